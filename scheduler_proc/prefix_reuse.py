"""The scheduler's side of the prefix cache: a request's row at admission, prefill end and retirement.

Every method is a no-op when the cache is off (`--disable-radix-cache`, or no store in the budget),
so the scheduler calls them unconditionally. All of them run while no step is in flight.
"""

from __future__ import annotations

from scheduler_proc.kv_cache import KVPool
from scheduler_proc.prefix_cache import PrefixCache, shares_pending_prefix
from scheduler_proc.request import Req

# NOTE: a waiting request whose prompt shares at least this many uncached tokens (and half of what
# it would compute) with a prompt being prefilled waits for that prompt to be cached first; 16
# takes in a chat template's system prompt (16 users arriving at once on the default model: the
# first prefill step computes 41 tokens instead of 16 x 41).
SHARED_PREFIX_MIN = 16


class PrefixReuse:
    def __init__(self, cache: PrefixCache | None, pool: KVPool) -> None:
        self.cache, self.pool = cache, pool

    def admit(self, req: Req) -> None:
        """Start the row with the longest cached prefix; the last prompt token is always computed."""
        if self.cache is None:
            return
        req.hit = self.cache.acquire(req.input_ids, req.prompt_len - 1)
        self.cache.load(req.hit, self.pool, req.row)
        req.prefilled = req.kv_len = req.cached_tokens = req.hit.length

    def should_wait(self, req: Req, prefilling: list[Req]) -> bool:
        """Whether `req` had better wait until a prompt being prefilled is cached."""
        if self.cache is None or not prefilling:
            return False
        cached = self.cache.cached_length(req.input_ids)
        need = max(SHARED_PREFIX_MIN, (req.prompt_len - cached) // 2)
        pending = [r.input_ids for r in prefilling]
        return shares_pending_prefix(req.input_ids, cached, pending, need)

    def publish(self, req: Req) -> None:
        """Prompt body in the KV: cache it now, so others reuse it while this one runs.

        NOTE: the body is every prompt token but the last (which runs in a decode step); a hit is
        capped there anyway, so waiting requests sharing the prompt need nothing more.
        """
        if self.cache is not None and req.hit is not None:
            assert req.kv_len >= req.prompt_len - 1, f"{req.rid}: prompt body not in the KV yet"
            body = req.input_ids[: req.prompt_len - 1]
            self.cache.publish(req.hit, body, self.pool, req.row)

    def retire(self, req: Req) -> None:
        """Before the row goes: cache what it computed (not after an error), drop the lock."""
        hit, req.hit = req.hit, None
        if self.cache is None or hit is None:
            return
        tokens = (req.input_ids + req.output_ids)[: req.kv_len]
        pool = None if req.finish_reason == "error" else self.pool
        self.cache.release(hit, tokens, pool, req.row)

    def stats(self) -> dict[str, int | float]:
        return self.cache.stats() if self.cache is not None else {}
