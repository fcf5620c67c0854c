"""GGUF import: converted models must compute what the original float weights compute."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.utils import load_model

import engine.gguf as engine_gguf
from engine.errors import ModelError
from engine.gguf import convert_gguf
from tests.gguf_writer import gguf_roundtrip, hf_config, hf_weights, write_llama_gguf

INPUTS = [[5, 80, 81, 82, 3, 100, 200, 7], [1, 2, 3], [258, 40, 41, 259, 260, 42, 43, 44, 45, 46]]

# Max |logit difference| allowed against the model built from what the file stores (gguf's own
# dequantizer): only float rounding differs, float32 compute for F32, float16 for the rest (MLX
# keeps float16 scales, so activations run in float16). Against the original float weights the
EXACT_TOL = {QType.F32: 1e-3, QType.F16: 0.1, QType.Q8_0: 0.1, QType.Q4_1: 0.1, QType.Q4_0: 0.1}
# quantization error itself is allowed, as relative RMS error of the logits.
ORIGINAL_TOL = {
    QType.F32: 1e-5,
    QType.F16: 2e-3,
    QType.Q8_0: 3e-2,
    QType.Q4_1: 0.3,
    QType.Q4_0: 0.3,
}


def reference_logits(weights: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    model = Model(ModelArgs.from_dict(hf_config()))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return np.array(model(mx.array([tokens]))[0])


def converted_logits(model_dir: Path, tokens: list[int]) -> np.ndarray:
    model, _ = load_model(model_dir)
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return hf_weights(seed=0)


@pytest.mark.parametrize("qtype", list(ORIGINAL_TOL))
def test_converted_logits_match_reference(tmp_path, weights, qtype):
    src = write_llama_gguf(tmp_path / "m.gguf", weights, qtype)
    out = convert_gguf(src, tmp_path / "out")
    stored = {k: gguf_roundtrip(v, qtype) for k, v in weights.items()}
    for tokens in INPUTS:
        got = converted_logits(out, tokens)
        assert max_diff(got, reference_logits(stored, tokens)) < EXACT_TOL[qtype]
        assert relative_rms(got, reference_logits(weights, tokens)) < ORIGINAL_TOL[qtype]


@pytest.mark.parametrize("qtype", [QType.F32, QType.Q4_0])
def test_a_wrong_permutation_is_caught(tmp_path, weights, qtype, monkeypatch):
    """The comparison above must fail if the converter skipped the q/k un-permutation."""
    monkeypatch.setattr(engine_gguf, "_unpermute", lambda w, n_heads: w)
    src = write_llama_gguf(tmp_path / "m.gguf", weights, qtype)
    out = convert_gguf(src, tmp_path / "out")
    stored = {k: gguf_roundtrip(v, qtype) for k, v in weights.items()}
    diffs = [max_diff(converted_logits(out, t), reference_logits(stored, t)) for t in INPUTS]
    assert min(diffs) > 10 * EXACT_TOL[qtype]


def test_quantization_bits_are_inferred_per_layer(tmp_path, weights):
    """An 8-bit embedding beside 4-bit layers (as in the default model) gets its own entry."""
    src = tmp_path / "m.gguf"
    write_llama_gguf(src, weights, QType.Q4_1)
    out = convert_gguf(src, tmp_path / "out")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4 and quant["group_size"] == 32
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] == 2


def test_untied_output_head(tmp_path, weights):
    untied = dict(weights, **{"lm_head.weight": hf_weights(seed=1)["model.embed_tokens.weight"]})
    src = write_llama_gguf(tmp_path / "m.gguf", untied, QType.F32)
    out = convert_gguf(src, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model = Model(ModelArgs.from_dict(hf_config(tied=False)))
    model.load_weights([(k, mx.array(v)) for k, v in untied.items()])
    want = np.array(model(mx.array([INPUTS[0]]))[0])
    assert max_diff(converted_logits(out, INPUTS[0]), want) < EXACT_TOL[QType.F32]


def test_tokenizer_and_chat_template_carry_over(tmp_path, weights):
    from transformers import AutoTokenizer

    out = convert_gguf(write_llama_gguf(tmp_path / "m.gguf", weights), tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "so the tea 1234 <|im_end|> héllo"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("Ġthe") in ids  # merges applied
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids  # specials kept whole
    assert ids.count(tok.convert_tokens_to_ids("1")) == 1  # smollm: digits split one by one
    assert tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n"


def test_not_gguf_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelError, match="not a GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_file_is_named(tmp_path, weights):
    src = write_llama_gguf(tmp_path / "m.gguf", weights)
    data = src.read_bytes()
    for cut in (len(data) // 2, 600):
        src.write_bytes(data[:cut])
        with pytest.raises(ModelError, match="past the end of the file"):
            convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ModelError, match="no such file"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_unsupported_architecture_is_named(tmp_path, weights):
    src = write_llama_gguf(tmp_path / "m.gguf", weights, arch="falcon")
    with pytest.raises(ModelError, match="unsupported architecture 'falcon'"):
        convert_gguf(src, tmp_path / "out")


def test_unsupported_tensor_type_is_named(tmp_path, weights):
    src = write_llama_gguf(tmp_path / "m.gguf", weights, QType.Q5_0)
    with pytest.raises(ModelError, match="cannot read GGUF"):
        convert_gguf(src, tmp_path / "out")


def test_missing_vocabulary_is_named(tmp_path, weights, monkeypatch):
    """A GGUF without tokenizer.ggml.tokens once failed with a bare KeyError."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_list", lambda self, tokens: None)
    src = write_llama_gguf(tmp_path / "m.gguf", weights)
    with pytest.raises(ModelError, match="lacks tokenizer.ggml.tokens"):
        convert_gguf(src, tmp_path / "out")


def test_failure_leaves_nothing_behind(tmp_path, weights):
    """A failure after the weights are mapped (here: the tokenizer) leaves no partial output."""
    src = write_llama_gguf(tmp_path / "m.gguf", weights, pre="unknown-pre")
    out = tmp_path / "models" / "out"
    with pytest.raises(ModelError, match="pre-tokenizer 'unknown-pre'"):
        convert_gguf(src, out)
    assert not out.exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_output_directory_in_use_is_refused(tmp_path, weights):
    src = write_llama_gguf(tmp_path / "m.gguf", weights)
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ModelError, match="not empty"):
        convert_gguf(src, out)
    assert (out / "precious.txt").read_text() == "keep me"


def test_conversion_reports_progress_per_tensor(tmp_path, weights, monkeypatch, caplog):
    """Each tensor is converted as it is written, a progress step each: with a short interval, a
    line per tensor (but the last, whose time the caller logs), bytes written growing."""
    monkeypatch.setattr(engine_gguf, "LOG_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="gguf")
    src = write_llama_gguf(tmp_path / "m.gguf", weights, QType.Q4_0)
    out = convert_gguf(src, tmp_path / "out")
    lines = [r.getMessage() for r in caplog.records if r.name == "gguf"]
    tensors = mx.load(str(out / "model.safetensors"))
    assert len(lines) == len(tensors) - 1, lines
    found = [re.fullmatch(r"converting m\.gguf: (\d+) of (\d+) kB, \d+ s", x) for x in lines]
    assert all(found), lines
    written = [int(m[1]) for m in found if m]
    assert written == sorted(written) and written[-1] <= int(found[0][2]), lines
