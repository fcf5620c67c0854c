"""The operator's operations on a running scheduler (engine/messages/admin.py): pause and continue,
new weights, a LoRA adapter, the prefix cache, model info (docs/operations.md).

One operation runs at a time, in arrival order. Each is a generator: it yields while it waits
(for running requests to finish, for outputs to be reported) and returns its answer. It is done
only once the scheduler has reported every output up to it, so its `AdminDone` follows those
outputs on the same socket: a client that paused with `abort` has read its aborts before the
pause returns. Both scheduler loops drive it the same way: `submit` a command as it arrives,
`poll` after each step (and when idle); `on_drain` at shutdown.

What changes the model (weights, adapters) waits until no request runs, with admission held, so
no stream mixes two models; the prefix cache is flushed after, its KV being the old model's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineError, InvalidRequest, ShuttingDown
from engine.messages import admin as ops
from engine.wire_errors import to_failure
from scheduler_proc import weights
from scheduler_proc.kv_event_log import cached_hashes

log = logging.getLogger("scheduler")

Info = dict[str, Any]
Operation = Generator[None, None, Info]


class Admin:
    def __init__(
        self,
        sched: Any,
        config: EngineConfig,
        model_dir: Path,
        tell: Callable[[ops.AdminDone], None],
        tp_size: int = 1,
    ) -> None:
        """`sched`: the Scheduler; `tell`: how an answer leaves (a no-op on tensor-parallel
        ranks other than 0, which apply the same commands)."""
        self.sched, self.config, self.tell, self.tp_size = sched, config, tell, tp_size
        self.model_path = str(model_dir)
        self.weights_version = 0
        adapter = config.adapter_path
        self.adapter: tuple[str, str] | None = (Path(adapter).name, adapter) if adapter else None
        self.paused: ops.PauseGeneration | None = None
        self._holding = False  # NOTE: a model change holds admission while requests finish
        self._queue: deque[ops.AdminCommand] = deque()
        self._active: tuple[ops.AdminCommand, Operation] | None = None

    # -- driving ---------------------------------------------------------------------------------
    def submit(self, cmd: ops.AdminCommand) -> None:
        """Queue `cmd`, and start it when it is the only one: a pause or a model change holds
        admission from the moment it arrives, before any request that came after it runs."""
        self._queue.append(cmd)
        self.poll()

    def busy(self) -> bool:
        """An operation is queued or in progress."""
        return bool(self._queue or self._active)

    def poll(self) -> None:
        """Advance the operation in progress; start the next when it is done."""
        while self._active is not None or self._queue:
            if self._active is None:
                cmd = self._queue.popleft()
                log.info("operation %s (%s)", type(cmd.op).__name__, cmd.rid)
                self._active = (cmd, self._run(cmd.op))
            cmd, work = self._active
            try:
                next(work)
                return  # NOTE: still waiting
            except StopIteration as done:
                self._answer(cmd.rid, {**done.value, **self.state()})
            except EngineError as e:
                self._fail(cmd.rid, e)
            except Exception as e:  # NOTE: a failed operation is its caller's, not the engine's
                if not self.sched.contain_errors:
                    raise
                log.exception("operation %s failed", type(cmd.op).__name__)
                self._fail(cmd.rid, EngineError(f"{type(e).__name__}: {e}"))
            self._active = None

    def on_drain(self) -> None:
        """Shutting down: pending operations fail, a pause ends, so running and queued requests
        finish (or are aborted) within the grace period."""
        if self._active is not None:
            cmd, work = self._active
            work.close()  # NOTE: runs its `finally`: a held admission is released
            self._fail(cmd.rid, ShuttingDown("the engine is shutting down"))
            self._active = None
        while self._queue:
            self._fail(self._queue.popleft().rid, ShuttingDown("the engine is shutting down"))
        self.paused = None
        self._admission()

    def state(self) -> Info:
        paused = self.paused
        return {
            "paused": paused is not None,
            "pause_mode": paused.mode if paused else None,
            "new_requests": paused.new_requests if paused else "serve",
            "model_path": self.model_path,
            "weights_version": self.weights_version,
            "lora_adapter": self.adapter[0] if self.adapter else None,
        }

    def stats(self) -> dict[str, float]:
        return {"paused": float(self.paused is not None), "weights_version": self.weights_version}

    # -- the operations --------------------------------------------------------------------------
    def _run(self, op: ops.AdminOp) -> Operation:
        if isinstance(op, ops.PauseGeneration):
            return self._pause(op)
        if isinstance(op, ops.ContinueGeneration):
            return self._continue()
        if isinstance(op, ops.FlushCache):
            return self._flush()
        if isinstance(op, ops.GetModelInfo):
            return self._info()
        if isinstance(op, ops.GetCachedBlocks):
            return self._blocks()
        return self._change_model(op)

    def _pause(self, op: ops.PauseGeneration) -> Operation:
        sched = self.sched
        self.paused = op
        self._admission()
        info: Info = {}
        if op.mode == "abort":
            info["aborted"] = len(sched.abort_all())
        elif op.mode in ("retract", "in_place"):
            sched.quiesce()
            if op.mode == "retract":
                info["retracted"] = sched.retract_running()
            self._admission()
        # NOTE: an ended request is reported at the next step; `wait` also waits for the
        # running ones to end.
        while sched.running_requests() if op.mode == "wait" else sched.unreported():
            yield
        log.info("generation paused (%s; new requests %s)", op.mode, op.new_requests)
        return info

    def _continue(self) -> Operation:
        was = self.paused
        self.paused = None
        self._admission()
        log.info("generation continues" if was else "continue: generation was not paused")
        return {"was_paused": was is not None}
        yield  # NOTE: unreachable; makes this a generator like the rest

    def _flush(self) -> Operation:
        self.sched.quiesce()  # NOTE: pages move only while no step is in flight
        flushed = self.sched.kv.flush()
        log.info("prefix cache flushed: %d tokens", flushed)
        return {"flushed_tokens": flushed, **self._cache_stats()}
        yield  # NOTE: unreachable; makes this a generator like the rest

    def _info(self) -> Operation:
        sched = self.sched
        return {
            "is_generation": True,
            "max_context": sched.max_context,
            "vocab_size": int(sched.vocab),
            "tp_size": self.tp_size,
            **self._cache_stats(),
        }
        yield  # NOTE: unreachable; makes this a generator like the rest

    def _blocks(self) -> Operation:
        """Read between steps: the tree as the events published up to `kv_events_seq` left it."""
        kv = self.sched.kv
        if kv.events is not None:
            kv.events.publish()  # NOTE: what this iteration recorded gets its number first
        page = kv.pages.page_size
        hashes = cached_hashes(kv.prefix.tree, page) if kv.prefix is not None else []
        seq = kv.events.seq if kv.events is not None else -1
        return {"block_hashes": hashes, "block_size": page, "kv_events_seq": seq}
        yield  # NOTE: unreachable; makes this a generator like the rest

    def _cache_stats(self) -> Info:
        stats = self.sched.stats()
        keys = ("prefix_cache_tokens", "prefix_cache_hit_rate", "prefix_cache_hit_tokens")
        return {k: stats.get(k, 0) for k in keys}

    def _change_model(self, op: ops.AdminOp) -> Operation:
        """Hold admission, wait until no request runs (or abort them), change, flush."""
        self._check_change(op)
        sched = self.sched
        self._holding = True
        self._admission()
        try:
            if isinstance(op, ops.UpdateWeights) and op.abort_all_requests:
                sched.abort_all()
            t0 = time.monotonic()
            while sched.running_requests():
                yield
            waited = time.monotonic() - t0
            sched.quiesce()
            info = self._apply(op)
            sched.model_changed()
            # NOTE: the disk tier keeps its files: they are keyed by the model they hold
            info["flushed_tokens"] = sched.kv.flush(disk=False)
            info["waited_s"] = round(waited, 3)
            return info
        finally:
            self._holding = False
            self._admission()

    def _check_change(self, op: ops.AdminOp) -> None:
        field = "model_path" if isinstance(op, ops.UpdateWeights) else "lora_path"
        if isinstance(op, ops.UnloadAdapter):
            field = "lora_name"
        if self.tp_size > 1:
            raise InvalidRequest(field, "not supported with --tp yet: restart the engine instead")
        if not self.sched.stepping and self.sched.running_requests():
            n = self.sched.running_requests()
            raise InvalidRequest(
                field,
                f"generation is paused in place with {n} running request(s), which would "
                "continue on another model: continue, or pause with mode retract or abort first",
            )

    def _apply(self, op: ops.AdminOp) -> Info:
        model = self.sched.runner.model
        if isinstance(op, ops.UpdateWeights):
            return self._swap(model, op)
        if isinstance(op, ops.LoadAdapter):
            return self._load_adapter(model, op)
        assert isinstance(op, ops.UnloadAdapter)
        return self._unload_adapter(model, op)

    def _swap(self, model: Any, op: ops.UpdateWeights) -> Info:
        had = weights.remove_adapter(model)
        try:
            info = weights.swap_weights(model, op.model_path, self.config)
        finally:
            if had and self.adapter is not None:  # NOTE: the adapter goes back on, whichever
                weights.load_adapter(model, self.adapter[1])
        self.model_path = op.model_path
        self.weights_version += 1
        return info

    def _load_adapter(self, model: Any, op: ops.LoadAdapter) -> Info:
        try:
            layers = weights.load_adapter(model, op.lora_path)
        except InvalidRequest:
            if self.adapter is not None:  # NOTE: the one before stays on
                weights.load_adapter(model, self.adapter[1])
            raise
        self.adapter = (op.lora_name or Path(op.lora_path).name, op.lora_path)
        return {"adapter_layers": layers}

    def _unload_adapter(self, model: Any, op: ops.UnloadAdapter) -> Info:
        if self.adapter is None:
            raise InvalidRequest("lora_name", "no adapter is loaded")
        if op.lora_name and op.lora_name != self.adapter[0]:
            raise InvalidRequest(
                "lora_name", f"no adapter {op.lora_name!r} is loaded ({self.adapter[0]!r} is)"
            )
        layers = weights.remove_adapter(model)
        self.adapter = None
        return {"adapter_layers": layers}

    # -- plumbing --------------------------------------------------------------------------------
    def _admission(self) -> None:
        paused = self.paused
        self.sched.seating = paused is None and not self._holding
        self.sched.stepping = paused is None or paused.mode != "in_place"

    def _answer(self, rid: str, info: Info) -> None:
        self.tell(ops.AdminDone(rid, info))

    def _fail(self, rid: str, error: EngineError) -> None:
        log.info("operation %s failed: %s", rid, error)
        self.tell(ops.AdminDone(rid, failure=to_failure(rid, error)))
