"""Operating a running scheduler (scheduler_proc/admin.py): pause modes and continue, new weights,
LoRA adapters, the prefix cache; tiny random models whose outputs depend on their context, so a
stream that lost, repeated or recomputed a token wrongly differs from mlx-lm's greedy output."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from adapters import make_adapter
from scheduler_util import (
    assert_pages_balanced,
    greedy,
    make_scheduler,
    random_prompt,
    reference_greedy,
    tiny_model,
    tokens,
)

from engine.messages import admin as ops
from engine.messages.to_client import Chunk
from engine.random_model import TINY_LLAMA, TINY_QWEN3, make_random_model
from scheduler_proc.admin import Admin
from scheduler_proc.scheduler import Scheduler

N_TOKENS = 12


class Driven:
    """A scheduler with its Admin, driven as the scheduler process drives them."""

    def __init__(self, sched: Scheduler, model_dir: Path) -> None:
        self.sched = sched
        self.answers: list[ops.AdminDone] = []
        self.admin = Admin(sched, sched.config, model_dir, self.answers.append)
        self.outs: dict[str, list[Chunk]] = {}
        self.events: list[str] = []  # "out:<rid>" / "done:<rid>", in the order the loop sends

    def submit(self, rid: str, prompt: list[int], n: int = N_TOKENS) -> None:
        self.sched.submit(rid, prompt, greedy(n))

    def operate(self, op: ops.AdminOp, rid: str = "op") -> None:
        self.admin.submit(ops.AdminCommand(rid, op))

    def iterate(self, n: int = 1) -> None:
        for _ in range(n):
            if self.sched.has_work():
                for out in self.sched.step():
                    self.outs.setdefault(out.rid, []).append(out)
                    self.events.append(f"out:{out.rid}")
            seen = len(self.answers)
            self.admin.poll()
            self.events += [f"done:{a.rid}" for a in self.answers[seen:]]

    def run_until(self, cond: Any, limit: int = 5_000) -> None:
        for _ in range(limit):
            if cond():
                return
            self.iterate()
        raise AssertionError("condition never held")

    def answer(self, rid: str = "op") -> ops.AdminDone:
        self.run_until(lambda: any(a.rid == rid for a in self.answers))
        return next(a for a in self.answers if a.rid == rid)

    def finish(self) -> None:
        self.run_until(lambda: not self.sched.has_work() and not self.admin.busy())

    def finish_reason(self, rid: str) -> str | None:
        return self.outs[rid][-1].finish_reason


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [random_prompt(rng, rng.randint(5, 70)) for _ in range(16)]


def _driven(model_dir: Path, **overrides: Any) -> Driven:
    return Driven(make_scheduler(tiny_model(model_dir), **overrides), model_dir)


@pytest.mark.parametrize("overlap", [True, False])
def test_retract_then_continue_keeps_every_stream(tiny_weights_dir, prompts, overlap):
    """16 streams mid-decode go back to the queue, nothing runs while paused, and after continue
    each stream is exactly mlx-lm's uninterrupted greedy output."""
    d = _driven(tiny_weights_dir, disable_overlap=not overlap)
    for i, p in enumerate(prompts):
        d.submit(f"r{i}", p)
    d.run_until(lambda: d.sched.running.n_decode == 16 and len(d.outs) == 16)
    d.operate(ops.PauseGeneration("retract"))
    done = d.answer()
    assert done.failure is None and done.info["retracted"] == 16
    assert done.info["paused"] and done.info["pause_mode"] == "retract"
    assert not d.sched.running.reqs and not d.sched.has_work()
    before = {rid: len(tokens(o)) for rid, o in d.outs.items()}
    assert all(0 < n < N_TOKENS for n in before.values())
    d.iterate(20)
    assert {rid: len(tokens(o)) for rid, o in d.outs.items()} == before  # NOTE: nothing moved
    d.operate(ops.ContinueGeneration(), "go")
    assert d.answer("go").info["paused"] is False
    d.finish()
    model = tiny_model(tiny_weights_dir)
    for i, p in enumerate(prompts):
        assert tokens(d.outs[f"r{i}"]) == reference_greedy(model, p, N_TOKENS), f"r{i}"
    assert_pages_balanced(d.sched)


def test_abort_ends_everything_and_answers_after_the_aborts(tiny_weights_dir, prompts):
    d = _driven(tiny_weights_dir, max_running_requests=4)
    for i, p in enumerate(prompts[:8]):
        d.submit(f"r{i}", p)
    d.run_until(lambda: d.sched.running.n_decode == 4)
    d.operate(ops.PauseGeneration("abort", "queue"))
    done = d.answer()
    assert done.info["aborted"] == 8
    assert all(d.finish_reason(f"r{i}") == "abort" for i in range(8))
    # NOTE: the answer follows the last abort: a caller has read them all when pause returns
    last_abort = max(i for i, e in enumerate(d.events) if e.startswith("out:"))
    assert d.events.index("done:op") > last_abort
    d.submit("late", prompts[8])
    d.iterate(10)
    assert "late" not in d.outs  # NOTE: queued while paused
    d.operate(ops.ContinueGeneration(), "go")
    d.finish()
    assert tokens(d.outs["late"]) == reference_greedy(tiny_model(tiny_weights_dir), prompts[8], 12)


def test_wait_lets_running_requests_finish_and_admits_nothing(tiny_weights_dir, prompts):
    d = _driven(tiny_weights_dir, max_running_requests=4)
    for i, p in enumerate(prompts[:6]):
        d.submit(f"r{i}", p)
    d.run_until(lambda: d.sched.running.n_decode == 4)
    running = {r.rid for r in d.sched.running.reqs}
    d.operate(ops.PauseGeneration("wait"))
    done = d.answer()
    assert done.failure is None
    assert {rid for rid in d.outs if d.finish_reason(rid) == "length"} == running
    assert len(d.sched._waiting) == 2  # NOTE: the two never admitted stay queued
    d.operate(ops.ContinueGeneration(), "go")
    d.finish()
    assert all(d.finish_reason(f"r{i}") == "length" for i in range(6))


def test_in_place_keeps_rows_and_takes_no_step(tiny_weights_dir, prompts):
    d = _driven(tiny_weights_dir)
    for i, p in enumerate(prompts[:4]):
        d.submit(f"r{i}", p)
    d.run_until(lambda: d.sched.running.n_decode == 4)
    d.operate(ops.PauseGeneration("in_place"))
    d.answer()
    steps = d.sched.stats()["steps_launched"]
    d.iterate(20)
    assert d.sched.stats()["steps_launched"] == steps and len(d.sched.running.reqs) == 4
    # NOTE: a model change would continue these streams on another model: refused
    d.operate(ops.LoadAdapter("/nowhere"), "lora")
    failure = d.answer("lora").failure
    assert failure is not None and "paused in place" in failure.message
    d.operate(ops.ContinueGeneration(), "go")
    d.finish()
    model = tiny_model(tiny_weights_dir)
    for i, p in enumerate(prompts[:4]):
        assert tokens(d.outs[f"r{i}"]) == reference_greedy(model, p, N_TOKENS)


def test_drain_ends_a_pause_and_fails_pending_operations(tiny_weights_dir, prompts):
    d = _driven(tiny_weights_dir)
    d.submit("r0", prompts[0])
    d.run_until(lambda: d.sched.running.n_decode == 1)
    d.operate(ops.PauseGeneration("wait"))  # NOTE: waits for r0
    d.operate(ops.FlushCache(), "flush")  # NOTE: queued behind the pause
    d.admin.on_drain()
    assert [a.failure.kind for a in d.answers if a.failure] == ["shutting_down"] * 2
    assert d.sched.seating and d.sched.stepping
    d.finish()
    assert d.finish_reason("r0") == "length"


# --- the model changes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def second_weights(tmp_path_factory) -> Path:
    """The tiny llama's shape with other random weights: its greedy outputs differ."""
    return make_random_model(tmp_path_factory.mktemp("tiny-llama-b"), TINY_LLAMA, seed=1)


def _fresh_model(path: Path) -> Any:
    from mlx_lm.utils import load_model

    return load_model(path)[0]


def test_new_weights_wait_for_running_requests_then_serve(
    tiny_weights_dir, second_weights, prompts
):
    """Requests running at the swap finish on the old weights; those admitted after answer with
    the new ones, the same prompts too: the prefix cache (the old model's KV) is flushed."""
    old, new = _fresh_model(tiny_weights_dir), _fresh_model(second_weights)
    d = Driven(make_scheduler(_fresh_model(tiny_weights_dir)), tiny_weights_dir)
    for i, p in enumerate(prompts[:8]):
        d.submit(f"a{i}", p)
    d.run_until(lambda: d.sched.running.n_decode == 8)
    d.operate(ops.UpdateWeights(str(second_weights)))
    for i, p in enumerate(prompts[:8]):
        d.submit(f"b{i}", p)  # NOTE: arrive during the swap: they wait for it
    done = d.answer()
    assert done.failure is None, done.failure
    assert done.info["weights_version"] == 1 and done.info["model_path"] == str(second_weights)
    assert done.info["flushed_tokens"] > 0
    assert d.sched.stats()["prefix_cache_tokens"] == 0
    d.finish()
    for i, p in enumerate(prompts[:8]):
        assert tokens(d.outs[f"a{i}"]) == reference_greedy(old, p, N_TOKENS), f"a{i}"
    for i, p in enumerate(prompts[:8]):
        want = reference_greedy(new, p, N_TOKENS)
        assert tokens(d.outs[f"b{i}"]) == want, f"b{i}"
        assert want != reference_greedy(old, p, N_TOKENS)
    assert_pages_balanced(d.sched)


def test_weights_that_do_not_fit_are_refused_and_the_old_keep_serving(
    tiny_weights_dir, tmp_path, prompts
):
    other = make_random_model(tmp_path / "qwen3", TINY_QWEN3)
    d = Driven(make_scheduler(_fresh_model(tiny_weights_dir)), tiny_weights_dir)
    d.operate(ops.UpdateWeights(str(other)))
    failure = d.answer().failure
    assert failure is not None and failure.kind == "invalid_request"
    assert failure.field == "model_path" and "does not fit" in failure.message
    d.operate(ops.UpdateWeights(str(tmp_path / "missing")), "missing")
    assert d.answer("missing").failure.field == "model_path"
    d.submit("r0", prompts[0])
    d.finish()
    want = reference_greedy(tiny_model(tiny_weights_dir), prompts[0], N_TOKENS)
    assert tokens(d.outs["r0"]) == want
    assert d.admin.weights_version == 0 and d.sched.seating


def _damaged(src: Path, dst: Path, damage: str) -> Path:
    """A copy of the directory `src` with its safetensors file(s) truncated to half, or their
    header's JSON corrupted."""
    import shutil

    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        data = path.read_bytes()
        if damage == "truncated":
            path.write_bytes(data[: len(data) // 2])
        else:
            path.write_bytes(data[:8] + b"{not json" + data[17:])
    return dst


@pytest.mark.parametrize("damage", ["truncated", "corrupt header"])
def test_damaged_weights_and_adapters_are_a_400_naming_the_file(
    tiny_weights_dir, tmp_path, prompts, damage
):
    """A damaged file the engine reads on request is the request's error (a 400 naming the
    field and the file), never a 500 (MLX's RuntimeError was one); the model is unchanged and
    serves on."""
    d = Driven(make_scheduler(_fresh_model(tiny_weights_dir)), tiny_weights_dir)
    second = make_random_model(tmp_path / "second", TINY_LLAMA, seed=1)
    d.operate(ops.UpdateWeights(str(_damaged(second, tmp_path / "w", damage))), "w")
    failure = d.answer("w").failure
    assert failure is not None and failure.kind == "invalid_request", failure
    assert failure.field == "model_path" and "model.safetensors" in failure.message, failure
    adapter = make_adapter(tmp_path / "lora", tiny_weights_dir)
    d.operate(ops.LoadAdapter(str(_damaged(adapter, tmp_path / "a", damage))), "a")
    failure = d.answer("a").failure
    assert failure is not None and failure.kind == "invalid_request", failure
    assert failure.field == "lora_path" and "adapters.safetensors" in failure.message, failure
    assert not _has_lora(d.sched)
    d.submit("r0", prompts[0])
    d.finish()
    want = reference_greedy(tiny_model(tiny_weights_dir), prompts[0], N_TOKENS)
    assert tokens(d.outs["r0"]) == want
    assert d.admin.weights_version == 0


def _reference_with_adapter(base_dir: Path, adapter: Path, prompt: list[int]) -> list[int]:
    from mlx_lm.tuner.utils import load_adapters

    model = load_adapters(_fresh_model(base_dir), str(adapter))
    model.eval()
    return reference_greedy(model, prompt, N_TOKENS)


def test_adapter_load_and_unload(tiny_weights_dir, tmp_path, prompts):
    adapter = make_adapter(tmp_path / "lora", tiny_weights_dir)
    base = _fresh_model(tiny_weights_dir)
    d = Driven(make_scheduler(_fresh_model(tiny_weights_dir)), tiny_weights_dir)
    d.operate(ops.LoadAdapter(str(adapter), "mine"))
    done = d.answer()
    assert done.failure is None and done.info["lora_adapter"] == "mine"
    assert done.info["adapter_layers"] > 0
    d.submit("with", prompts[0])
    d.finish()
    want = _reference_with_adapter(tiny_weights_dir, adapter, prompts[0])
    assert tokens(d.outs["with"]) == want
    assert want != reference_greedy(base, prompts[0], N_TOKENS)
    d.operate(ops.UnloadAdapter("other"), "wrong")
    assert d.answer("wrong").failure.field == "lora_name"
    d.operate(ops.UnloadAdapter("mine"), "off")
    assert d.answer("off").info["lora_adapter"] is None
    d.submit("without", prompts[0])
    d.finish()
    assert tokens(d.outs["without"]) == reference_greedy(base, prompts[0], N_TOKENS)


def test_bad_adapters_are_refused(tiny_weights_dir, tmp_path):
    d = Driven(make_scheduler(_fresh_model(tiny_weights_dir)), tiny_weights_dir)
    d.operate(ops.LoadAdapter(str(tmp_path)), "empty")
    assert "not an mlx-lm adapter" in d.answer("empty").failure.message
    wrong = make_adapter(tmp_path / "wrong", tiny_weights_dir)
    weights = mx.load(str(wrong / "adapters.safetensors"))
    weights = {k: mx.zeros((3, 3)) for k in weights}  # NOTE: no layer has this shape
    mx.save_safetensors(str(wrong / "adapters.safetensors"), weights)
    d.operate(ops.LoadAdapter(str(wrong)), "wrong")
    failure = d.answer("wrong").failure
    assert failure.field == "lora_path" and "cannot load" in failure.message
    assert not _has_lora(d.sched)


def _has_lora(sched: Scheduler) -> bool:
    from mlx_lm.tuner.lora import LoRALinear

    return any(isinstance(m, LoRALinear) for _, m in sched.runner.model.named_modules())


def test_flush_cache_empties_what_no_request_holds(tiny_weights_dir, prompts):
    d = _driven(tiny_weights_dir)
    d.submit("r0", prompts[0])
    d.finish()
    assert d.sched.stats()["prefix_cache_tokens"] > 0
    d.operate(ops.FlushCache())
    done = d.answer()
    assert done.info["flushed_tokens"] > 0 and done.info["prefix_cache_tokens"] == 0
    assert_pages_balanced(d.sched)
    d.operate(ops.GetModelInfo(), "info")
    info = d.answer("info").info
    assert info["max_context"] == d.sched.max_context and info["weights_version"] == 0
