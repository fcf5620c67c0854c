"""The Linux CPU path: optimized BLAS under MLX (in subprocesses: it must precede `import mlx`),
its fallback, and dequantize-at-load."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine import cpu_backend
from engine.config import EngineConfig
from engine.cpu_backend import BackendInfo, child_env
from engine.cpu_dequantize import dequantize_model, is_quantized, resolve_dequantize
from engine.random_model import TINY_LLAMA, make_random_model

ROOT = Path(__file__).resolve().parent.parent
LINUX = sys.platform == "linux"
HAS_OPENBLAS = LINUX and bool(cpu_backend._candidates("auto"))

# NOTE: run in a fresh interpreter: the BLAS is chosen before mlx.core is imported there.
CHILD = """
import json, sys
from pathlib import Path
blas, deq, model_dir, out, import_first = sys.argv[1:6]
if import_first == "1":
    import mlx.core
from engine.config import EngineConfig
from engine.cpu_backend import setup_cpu_backend
config = EngineConfig(cpu_blas=blas, cpu_dequantize=deq)
info = setup_cpu_backend(config)
import mlx.core as mx, numpy as np
from mlx_lm.utils import load_model
from engine.cpu_dequantize import maybe_dequantize
model, _ = load_model(Path(model_dir))
model = maybe_dequantize(model, config)
tokens = mx.array([[(7 * i + 3 * j) % 997 + 1 for j in range(8)] for i in range(4)])
np.save(out, np.array(model(tokens).astype(mx.float32)))
print(json.dumps({"optimized": info.optimized, "path": info.path, "env": dict(info.env)}))
"""


@pytest.fixture(scope="module")
def f32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("cpu-f32"), TINY_LLAMA)


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory: pytest.TempPathFactory, f32_dir: Path) -> Path:
    from mlx_lm.utils import save_config, save_model

    model, config = load_model(f32_dir)
    nn.quantize(model, group_size=32, bits=4)
    config["quantization"] = {"group_size": 32, "bits": 4}
    out = tmp_path_factory.mktemp("cpu-q4")
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def _child(
    tmp: Path, blas: str, model_dir: Path, *, deq: str = "off", **kw
) -> tuple[dict, np.ndarray]:
    out = tmp / f"logits-{len(list(tmp.iterdir()))}.npy"
    argv = [sys.executable, "-c", CHILD, blas, deq, str(model_dir), str(out)]
    argv.append("1" if kw.get("import_first") else "0")
    env = kw.get("env") or _clean_env()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), np.load(out)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _assert_close(a: np.ndarray, b: np.ndarray) -> None:
    scale = float(np.abs(b).max())
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * scale)


# ---------------------------------------------------------------- BLAS, in subprocesses


@pytest.fixture(scope="module")
def child_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu-child")


@pytest.fixture(scope="module")
def reference_run(child_tmp: Path, f32_dir: Path) -> tuple[dict, np.ndarray]:
    return _child(child_tmp, "reference", f32_dir)


@pytest.fixture(scope="module")
def openblas_run(child_tmp: Path, f32_dir: Path) -> tuple[dict, np.ndarray, list[str]]:
    """The optimized run, with the dynamic linker's record of what libmlx's cblas_sgemm binds to."""
    if not HAS_OPENBLAS:
        pytest.skip("no OpenBLAS installed (scripts/_env.sh installs it)")
    ld = child_tmp / "ld"
    env = {**_clean_env(), "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(ld)}
    info, logits = _child(child_tmp, "auto", f32_dir, env=env)
    lines = [
        line
        for f in child_tmp.glob("ld.*")
        for line in f.read_text(errors="replace").splitlines()
        if "libmlx.so" in line and "`cblas_sgemm'" in line
    ]
    return info, logits, lines


def test_openblas_logits_match_reference(openblas_run: tuple, reference_run: tuple) -> None:
    (fast, fast_logits, _), (ref, ref_logits) = openblas_run, reference_run
    assert fast["optimized"] and not ref["optimized"]
    _assert_close(fast_logits, ref_logits)


def test_libmlx_binds_cblas_sgemm_to_openblas(openblas_run: tuple) -> None:
    lines = openblas_run[2]
    assert lines and all("openblas" in line for line in lines), lines


def test_fallback_when_blas_cannot_load(
    tmp_path: Path, f32_dir: Path, reference_run: tuple
) -> None:
    bad, bad_logits = _child(tmp_path, str(tmp_path / "no-such-libblas.so"), f32_dir)
    ref, ref_logits = reference_run
    assert not bad["optimized"] and bad["path"] is None
    _assert_close(bad_logits, ref_logits)


def test_child_env_preloads_for_a_late_setup(
    tmp_path: Path, f32_dir: Path, openblas_run: tuple
) -> None:
    info = openblas_run[0]
    parent = BackendInfo("x", path=info["path"], optimized=True, env=tuple(info["env"].items()))
    env = child_env(parent, _clean_env())
    late, _ = _child(tmp_path, "auto", f32_dir, env=env, import_first=True)
    assert late["optimized"] and Path(late["path"]).resolve() == Path(info["path"]).resolve()


def test_late_setup_without_preload_falls_back(tmp_path: Path, f32_dir: Path) -> None:
    late, _ = _child(tmp_path, "auto", f32_dir, import_first=True)
    assert not late["optimized"]


# ---------------------------------------------------------------- dequantize, in process


def test_dequantized_logits_match_quantized(q4_dir: Path) -> None:
    tokens = mx.array([[5, 17, 300, 2, 9, 41]] * 3)
    model, _ = load_model(q4_dir)
    assert is_quantized(model)
    quantized = np.array(model(tokens).astype(mx.float32))
    dequantize_model(model)
    assert not is_quantized(model)
    assert all(v.dtype == mx.float32 for _, v in _params(model))
    _assert_close(np.array(model(tokens)), quantized)


def test_dequantize_in_child_matches_quantized(tmp_path: Path, q4_dir: Path) -> None:
    blas = "auto" if HAS_OPENBLAS else "reference"
    _, deq_logits = _child(tmp_path, blas, q4_dir, deq="on")
    _, q_logits = _child(tmp_path, "reference", q4_dir, deq="off")
    _assert_close(deq_logits, q_logits)


def test_resolve_dequantize() -> None:
    fast, slow = BackendInfo("openblas", optimized=True), BackendInfo("reference")
    assert resolve_dequantize("auto", fast) == (mx.default_device().type == mx.cpu)
    assert not resolve_dequantize("auto", slow)
    assert not resolve_dequantize("auto", None)
    assert resolve_dequantize("on", slow) and not resolve_dequantize("off", fast)
    for refused in ("sometimes", "yes", "1", "ON"):  # NOTE: what EngineConfig.validate() refuses
        with pytest.raises(ValueError):
            resolve_dequantize(refused, fast)


def test_config_validates_cpu_dequantize() -> None:
    assert EngineConfig(cpu_dequantize="on").validate().cpu_dequantize == "on"
    with pytest.raises(ValueError):
        EngineConfig(cpu_dequantize="maybe").validate()


# ---------------------------------------------------------------- small pieces


def test_coretype_from_cpu_flags() -> None:
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma"}
    assert cpu_backend._coretype_for(avx512) == "SkylakeX"
    assert cpu_backend._coretype_for({"avx2", "fma", "sse4_2"}) == "Haswell"
    assert cpu_backend._coretype_for({"sse4_2"}) is None


def test_child_env_sets_ld_preload() -> None:
    info = BackendInfo("ob", path="/x/libopenblas.so.0", optimized=True, env=(("A", "1"),))
    env = child_env(info, {"LD_PRELOAD": "/y/other.so"})
    assert env["LD_PRELOAD"].split() == ["/x/libopenblas.so.0", "/y/other.so"]
    assert env["A"] == "1"
    assert "LD_PRELOAD" not in child_env(BackendInfo("reference"), {})


def _params(model: nn.Module) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def test_sgemm_check_rejects_a_wrong_kernel() -> None:
    class Broken:
        @staticmethod
        def cblas_sgemm(*args: object) -> None:
            return None  # NOTE: leaves C at zero, as a miscompiled kernel might

    assert not cpu_backend._sgemm_ok(Broken())  # type: ignore[arg-type]


@pytest.mark.skipif(not HAS_OPENBLAS, reason="no OpenBLAS installed (scripts/_env.sh installs it)")
def test_sgemm_check_accepts_openblas() -> None:
    import ctypes

    path = cpu_backend._candidates("auto")[0]
    assert cpu_backend._sgemm_ok(ctypes.CDLL(path, mode=os.RTLD_LOCAL))


@pytest.mark.skipif(not HAS_OPENBLAS, reason="no OpenBLAS installed (scripts/_env.sh installs it)")
def test_reported_blas_is_the_preloaded_one(tmp_path: Path, f32_dir: Path) -> None:
    # NOTE: with LD_PRELOAD in effect, asking for "reference" cannot undo it; the report must not lie.
    path = cpu_backend._candidates("auto")[0]
    env = {**_clean_env(), "LD_PRELOAD": path}
    info, _ = _child(tmp_path, "reference", f32_dir, env=env)
    assert info["optimized"]


@pytest.mark.parametrize("deq", ["off", "on"])
def test_engine_honours_cpu_dequantize(deq, q4_dir, default_model_dir, tmp_path, caplog):
    """The engine once dropped the config on the way to the loader: `--cpu-dequantize off` was
    ignored and weights were dequantized whenever 'auto' said so."""
    import shutil

    from engine.random_model import TOKENIZER_FILES
    from mlx_engine.inprocess import InProcessEngine

    model_dir = tmp_path / "q4"
    shutil.copytree(q4_dir, model_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, model_dir / name)
    caplog.set_level(logging.INFO, logger="engine.cpu_dequantize")
    transport = InProcessEngine(str(model_dir), cpu_dequantize=deq, max_total_tokens=4096)
    transport.close()
    dequantized = any("dequantized to float32" in r.getMessage() for r in caplog.records)
    assert dequantized == (deq == "on")


OFFLINE_AS_README = """
import json, sys
from mlx_engine.offline import OfflineEngine
from engine.cpu_backend import backend_info
from engine.cpu_dequantize import is_quantized
eng = OfflineEngine(sys.argv[1], max_total_tokens=4096, context_length=256)
r = eng.generate([[1, 2, 3]], dict(max_tokens=2, temperature=0.0))[0]
print(json.dumps(dict(optimized=backend_info().optimized, completion=r.usage.completion_tokens,
                      quantized=is_quantized(eng.scheduler.runner.model))))
eng.close()
"""


@pytest.mark.skipif(not HAS_OPENBLAS, reason="no OpenBLAS installed (scripts/_env.sh installs it)")
def test_offline_engine_as_the_readme_writes_it_gets_the_fast_cpu_path(q4_dir: Path) -> None:
    """`from mlx_engine.offline import OfflineEngine` first: optimized BLAS and float32 weights."""
    argv = [sys.executable, "-c", OFFLINE_AS_README, str(q4_dir)]
    proc = subprocess.run(
        argv, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == dict(optimized=True, completion=2, quantized=False)
