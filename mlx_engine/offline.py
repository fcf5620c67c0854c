"""In-process engine for tests and benchmarks: the scheduler with no sockets and no processes."""

from __future__ import annotations

import itertools
from typing import Any

from engine.cpu_backend import setup_cpu_backend

# NOTE: before this module imports mlx.core (through the scheduler): on Linux CPU the optimized
# BLAS only takes effect when loaded first, so `from mlx_engine.offline import OfflineEngine` as the
# first import gets the same fast path as a launched engine (a warning says when it is too late).
setup_cpu_backend(None, log_line=False)

from engine.config import EngineConfig  # noqa: E402
from engine.messages.to_tokenizer import Generate  # noqa: E402
from engine.results import GenerateResult, StreamChunk  # noqa: E402
from scheduler_proc.model_loader import load_for_scheduler  # noqa: E402
from scheduler_proc.scheduler import Scheduler  # noqa: E402
from tokenizer_proc.admission import Admission  # noqa: E402
from tokenizer_proc.core import FrontDoor, door_settings  # noqa: E402
from tokenizer_proc.requests import Entry  # noqa: E402


class OfflineEngine:
    """Token ids in, the SDK's `GenerateResult`s out (token ids and usage; no text)."""

    def __init__(self, model: str | None = None, **config_overrides: Any) -> None:
        self.config = EngineConfig(model=model, **config_overrides).validate()
        setup_cpu_backend(self.config)  # NOTE: logs which BLAS MLX calls, once per process
        from engine.models import resolve_model_dir, served_name

        model_dir = resolve_model_dir(self.config.model, self.config.gguf_file)
        net, eos = load_for_scheduler(str(model_dir), self.config)
        tokenizer = model_dir / "tokenizer.json"
        self.scheduler = sched = Scheduler(self.config, net, eos, tokenizer_file=tokenizer)
        name = served_name(self.config.model, model_dir)
        facts = (name, int(sched.vocab), sched.max_context, sched.running.slots)
        # NOTE: the launched engine's admission (limits, counters), token ids only: no tokenizer
        hits = sched.kv.snapshots is not None
        self.core = FrontDoor(door_settings(self.config, facts, snapshot_hits=hits))
        self.admission = Admission(self.core, self.config, None)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[list[int]],
        params: dict[str, Any] | list[dict[str, Any]] | None = None,
    ) -> list[GenerateResult]:
        """Run every prompt to completion; one dict of sampling keywords applies to all."""
        per_prompt = params if isinstance(params, list) else [params or {}] * len(prompts)
        results: dict[str, GenerateResult] = {}
        try:
            for ids, kw in zip(prompts, per_prompt, strict=True):
                rid = f"offline-{next(self._ids)}"
                self._submit(Generate(rid, input_ids=list(ids), params=kw))
                results[rid] = GenerateResult(rid)
        except Exception:
            self._abort_all(results)  # NOTE: all or nothing; no orphans left running
            raise
        self._run(results)
        return list(results.values())

    def _submit(self, request: Generate) -> None:
        """The launched engine's admission (tokenizer_proc/admission.py): same limits, same
        `InvalidRequest`s, then the scheduler."""
        entry = Entry(None)
        admitted = self.admission.admit(request, entry)
        try:
            ids, shared = self.admission.token_ids(request, admitted.params)
            params = self.admission.for_prompt(admitted.params, ids)
            self.scheduler.submit(request.rid, ids, params, checked=True, shared=shared)
        except Exception as e:
            raise self.admission.fail(request.rid, e) from e
        self.core.forwarded(request.rid, entry)

    def _abort_all(self, results: dict[str, GenerateResult]) -> None:
        for rid in results:
            self.scheduler.abort(rid)
        self._run(results)

    def _run(self, results: dict[str, GenerateResult]) -> None:
        pending = {rid for rid, r in results.items() if r.finish_reason is None}
        while pending:
            for out in self.scheduler.step():
                self.core.on_chunk(out)
                if out.rid in results:
                    results[out.rid].add(StreamChunk.from_wire(out))
                    if out.finish_reason is not None:
                        pending.discard(out.rid)

    def stats(self) -> dict[str, int | float]:
        return self.scheduler.stats()

    def close(self) -> None:
        self.scheduler.shutdown()
        self.scheduler.step()

    def __enter__(self) -> OfflineEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
