"""Incremental detokenization: stop strings with hold-back, multi-byte characters, no per-request
detokenizer construction on the hot path."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from detokenizer_proc.detokenizer import Detokenizer
from engine.messages.to_client import Chunk

TEXT = "Hello wörld! 🙂 Ünïcödé ✓ end"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(default_model_dir)


def _run(detok: Detokenizer, ids: list[int], rid: str = "r", per_step: int = 1) -> list:
    chunks = []
    for i in range(0, len(ids), per_step):
        last = i + per_step >= len(ids)
        finish = "length" if last else None
        out = Chunk(rid, "", ids[i : i + per_step], finish, 1, i + per_step)
        got, _ = detok.process([out])
        chunks += got
        if got and got[-1].finish_reason is not None:
            break
    return chunks


def test_text_matches_decode_and_no_split_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    detok.register("r", [])
    chunks = _run(detok, ids)
    assert "".join(c.text for c in chunks) == TEXT
    assert all("\ufffd" not in c.text for c in chunks)
    assert len(ids) > len(TEXT.split())  # NOTE: the emoji and accents span several tokens


@pytest.mark.parametrize("stop", ["wörld", "ld! 🙂", "🙂", "ö", "✓ e", "Hello"])
def test_stop_string_never_leaks(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    detok.register("r", ["never-there", stop])
    chunks = _run(detok, ids)
    assert "".join(c.text for c in chunks) == TEXT[: TEXT.find(stop)]
    assert chunks[-1].finish_reason == "stop"
    assert len(detok) == 0


def test_stop_hit_asks_the_scheduler_to_abort_and_drops_late_outputs(tokenizer):
    detok = Detokenizer(tokenizer)
    detok.register("r", ["lo"])
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    chunks, stopped = detok.process([Chunk("r", "", ids)])
    assert stopped == ["r"] and chunks[0].text == "Hel"
    assert detok.process([Chunk("r", "", [5], "length")]) == ([], [])


def test_special_tokens_are_not_text(tokenizer):
    detok = Detokenizer(tokenizer)
    detok.register("r", [])
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    chunks, _ = detok.process([Chunk("r", "", ids, "stop")])
    assert chunks[0].text == "Hi" and chunks[0].token_ids == ids


def test_registering_a_request_is_cheap(tokenizer):
    """A request copies one prototype instead of building a detokenizer (a vocabulary map)."""
    detok = Detokenizer(tokenizer)
    t0 = time.perf_counter()
    for i in range(200):
        detok.register(f"r{i}", ["x"])
    per_request = (time.perf_counter() - t0) / 200
    t0 = time.perf_counter()
    type(detok._proto)(tokenizer._tokenizer)
    construction = time.perf_counter() - t0
    print(f"register {per_request * 1e6:.1f} us, construction {construction * 1e3:.2f} ms")
    assert per_request * 20 < construction


class _BreaksOn:
    """A streaming detokenizer that fails on one token id (a stand-in for any detokenizer bug)."""

    def __init__(self, bad: int) -> None:
        self.bad, self.text = bad, ""

    def reset(self) -> None:
        self.text = ""

    def add_token(self, t: int) -> None:
        if t == self.bad:
            raise ValueError(f"cannot decode {t}")
        self.text += "x"

    def finalize(self) -> None:
        pass


class _FakeTokenizer:
    all_special_ids: list[int] = []

    def __init__(self, bad: int) -> None:
        self.detokenizer = _BreaksOn(bad)


def test_a_failing_request_ends_alone_and_the_batch_still_streams():
    """One request's bad token ends that request with an error; the others in the same step
    still get their chunks (a lost terminal chunk would leave a client waiting forever)."""
    detok = Detokenizer(_FakeTokenizer(bad=666))
    detok.register("bad", [])
    detok.register("good", [])
    chunks, to_abort = detok.process([Chunk("bad", "", [1, 666]), Chunk("good", "", [1], "length")])
    by_rid = {c.rid: c for c in chunks}
    assert by_rid["good"].finish_reason == "length" and by_rid["good"].text == "x"
    assert by_rid["bad"].finish_reason == "error" and "cannot decode 666" in by_rid["bad"].error
    assert to_abort == ["bad"] and len(detok) == 0
    assert detok.process([Chunk("bad", "", [2], "length")]) == ([], [])
