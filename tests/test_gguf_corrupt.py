"""Corrupt GGUF files give a ModelError, never a signal: MLX's reader trusts the
header, and a flipped byte in the tensor table once crashed the converter with SIGSEGV."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from engine.errors import ModelError
from engine.gguf_check import check_gguf
from tests.gguf_writer import hf_weights, write_llama_gguf

CORRUPTIONS = 400
# NOTE: runs in a child: a segfault must fail the test, not kill pytest.
CHILD = r"""
import json, random, shutil, sys
from pathlib import Path
from engine.errors import ModelError
from engine.gguf import convert_gguf

src, header_end, n, work = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
data = src.read_bytes()
rng = random.Random(11)
outcomes = {"converted": 0, "model_error": 0}
for i in range(n):
    corrupt = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        corrupt[rng.randrange(4, header_end)] = rng.randrange(256)
    if i % 4 == 0:  # NOTE: and some truncated ones
        corrupt = corrupt[: rng.randrange(8, len(corrupt))]
    path = work / "c.gguf"
    path.write_bytes(bytes(corrupt))
    shutil.rmtree(work / "out", ignore_errors=True)
    try:
        convert_gguf(path, work / "out")
        outcomes["converted"] += 1
    except ModelError:
        outcomes["model_error"] += 1
print(json.dumps(outcomes))
"""


@pytest.fixture(scope="module")
def model_gguf(tmp_path_factory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "m.gguf", hf_weights())


def test_corrupt_headers_are_model_errors_never_signals(model_gguf, tmp_path):
    header_end = gguf.GGUFReader(model_gguf).data_offset
    args = [str(model_gguf), str(header_end), str(CORRUPTIONS), str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, f"the converter died (code {done.returncode}):\n{done.stderr}"
    outcomes = json.loads(done.stdout.splitlines()[-1])
    assert sum(outcomes.values()) == CORRUPTIONS and outcomes["model_error"] > 0, outcomes


def test_a_tensor_past_the_end_is_named(model_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_gguf.read_bytes()[:-100])
    with pytest.raises(ModelError, match="corrupt GGUF: tensor '.*' extends past the end"):
        check_gguf(cut)


def test_the_default_model_passes_the_check(default_model_dir):
    from engine.models import default_gguf_path

    check_gguf(default_gguf_path())


def test_nested_metadata_arrays_are_walked(tmp_path):
    import numpy as np

    path = tmp_path / "nested.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.nested", [[1, 2], [3, 4, 5], ["a", "b"]])
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check_gguf(path)
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ModelError, match="extends past the end"):
        check_gguf(path)
