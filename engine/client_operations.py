"""The SDK's calls that operate a running engine (docs/operations.md, "Operate a running
engine"), shared by `EngineClient` (answers) and `AsyncEngineClient` (awaitables of answers).

Each returns what the engine reports (a dict: `paused`, `model_path`, `weights_version`, ...) or
raises the typed error it failed with; all need the owner's key or control token, as `shutdown()`
does. Names and arguments are SGLang's HTTP routes'.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from engine.messages import admin as ops

Answer = TypeVar("Answer")
# NOTE: a model change first waits for running requests to finish; then it loads.
OPERATION_WAIT_S = 900.0


class Operations(Generic[Answer]):
    def _operate(self, op: ops.AdminOp, timeout: float | None) -> Answer:
        raise NotImplementedError

    def pause_generation(
        self,
        mode: ops.PauseMode = "abort",
        new_requests: ops.WhilePaused = "queue",
        *,
        timeout: float | None = None,
    ) -> Answer:
        """Stop generating: `abort` ends every request in flight, `wait` lets running requests
        finish, `retract` puts them back in the queue (their streams continue after
        `continue_generation`, nothing repeated), `in_place` keeps them where they are. New
        requests meanwhile wait in the queue (`queue`) or get `Paused` (`refuse`). Returns
        once the engine is paused (for `wait`, once the running requests finished)."""
        return self._operate(ops.PauseGeneration(mode, new_requests), timeout)

    def continue_generation(self, *, timeout: float | None = None) -> Answer:
        return self._operate(ops.ContinueGeneration(), timeout)

    def update_weights_from_disk(
        self, model_path: str, abort_all_requests: bool = False, *, timeout: float | None = None
    ) -> Answer:
        """New weights of the same architecture (a directory, .gguf or ORG/NAME), swapped in once
        the running requests finished (or were aborted); a checkpoint that does not fit is
        refused (`InvalidRequest`, field model_path) and the old weights keep serving."""
        return self._operate(ops.UpdateWeights(model_path, abort_all_requests), timeout)

    def load_lora_adapter(
        self, lora_path: str, lora_name: str = "", *, timeout: float | None = None
    ) -> Answer:
        """Apply an mlx-lm LoRA adapter directory (replacing the one loaded, if any)."""
        return self._operate(ops.LoadAdapter(lora_path, lora_name), timeout)

    def unload_lora_adapter(self, lora_name: str = "", *, timeout: float | None = None) -> Answer:
        return self._operate(ops.UnloadAdapter(lora_name), timeout)

    def flush_cache(self, *, timeout: float | None = None) -> Answer:
        """Empty the prefix cache (what running requests hold stays until they end)."""
        return self._operate(ops.FlushCache(), timeout)

    def get_model_info(self, *, timeout: float | None = None) -> Answer:
        return self._operate(ops.GetModelInfo(), timeout)

    def get_cached_blocks(self, *, timeout: float | None = None) -> Answer:
        """The prefix cache's blocks as KV events name them: `block_hashes` (sorted),
        `block_size`, and `kv_events_seq`, the last event batch's sequence number (-1: none
        yet, or events off); a subscriber that applied batches up to it holds the same set."""
        return self._operate(ops.GetCachedBlocks(), timeout)


def wait_for(timeout: float | None) -> float:
    return OPERATION_WAIT_S if timeout is None else timeout
