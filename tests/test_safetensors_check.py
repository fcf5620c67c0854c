"""The safetensors check the engine runs on files it reads on request: a whole file passes; each
kind of damage is a ValueError naming the file and what is wrong."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest

from engine.safetensors_check import check_file


@pytest.fixture
def whole(tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros((4, 8)), "b": mx.ones((3,), dtype=mx.int32)})
    return path


def _with_header(path: Path, header: object, data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_a_whole_file_passes(whole):
    check_file(whole)


def test_each_kind_of_damage_names_the_file(whole, tmp_path):
    data = whole.read_bytes()
    tensor = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    cases = {
        "shorter than": data[:5],
        "runs past the file": struct.pack("<Q", 2**40) + data[8:],
        "truncated": data[: len(data) - 4],
        "corrupt header": data[:8] + b"\xff" + data[9:],
    }
    for why, raw in cases.items():
        (tmp_path / "x.safetensors").write_bytes(raw)
        with pytest.raises(ValueError, match=why) as e:
            check_file(tmp_path / "x.safetensors")
        assert "x.safetensors" in str(e.value)
    bad = {
        "not a JSON object": [1, 2],
        "unknown dtype": {"t": {**tensor, "dtype": "Q9"}},
        "corrupt shape": {"t": {**tensor, "shape": [-1]}},
        "does not match": {"t": {**tensor, "data_offsets": [0, 15]}},
    }
    for why, header in bad.items():
        with pytest.raises(ValueError, match=why):
            check_file(_with_header(tmp_path / "h.safetensors", header, b"\0" * 16))
