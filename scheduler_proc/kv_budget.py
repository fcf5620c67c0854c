"""How the KV budget is spent: pages of full-attention K/V, and slots (one per running request)
for what is bounded per request (window rings, recurrent state).

Rules (docs/kv_cache.md), each named in the start-up log:
- context: `--context-length`, else the model's own limit (`max_position_embeddings`), at most
  what the pages hold;
- running requests: `--max-running-requests`, else what the budget holds at a typical request of
  `TYPICAL_REQUEST_TOKENS` tokens, at most `MAX_AUTO_RUNNING` (the largest warmed batch);
- pages: the rest of the budget after the slots, in pages of `--page-size` tokens; allocated
  at once on CUDA (the device's memory is the engine's), and from `INITIAL_TOKENS`, doubling as
  tokens arrive, where the KV shares memory with the rest of the machine (Apple silicon, CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.memory import KVBudget, kv_budget

# NOTE: a chat or completion is a few hundred to a few thousand tokens; an agent's 10-30k. Pages
# follow the tokens held, so this only sizes the batch the engine is ready to run.
TYPICAL_REQUEST_TOKENS = 2048
MAX_AUTO_RUNNING = 256
INITIAL_TOKENS = 32768


@dataclass(frozen=True)
class KVPlan:
    pages: int
    page_size: int
    slots: int  # most requests running at once
    context: int  # most tokens (prompt + generated) of one request
    budget: KVBudget
    slot_tokens: int = 0  # a slot's rings and state, in tokens' worth of full-layer KV
    slots_rule: str = "--max-running-requests"
    context_rule: str = "--context-length"
    initial_pages: int = 0  # allocated at start (0: all of `pages`); the pool grows to `pages`

    @property
    def tokens(self) -> int:
        """Token capacity of the pages (the scratch page not counted)."""
        return self.pages * self.page_size

    @property
    def allocated_tokens(self) -> int:
        """Tokens' worth of KV allocated: pages, scratch page, every slot and the scratch slot."""
        return (self.pages + 1) * self.page_size + (self.slots + 1) * self.slot_tokens

    @property
    def start_pages(self) -> int:
        return self.initial_pages or self.pages

    def describe(self) -> str:
        gib = self.allocated_tokens * self.budget.bytes_per_token / 2**30
        slots = ""
        if self.slot_tokens:
            slots = f"; per request {self.slot_tokens} tokens' worth of rings/state"
        grows = ""
        if self.start_pages < self.pages:
            grows = f", {self.start_pages} allocated now, doubling as tokens arrive"
        return (
            f"KV up to {gib:.2f} GiB: {self.pages} pages x {self.page_size} tokens "
            f"({self.tokens} tokens{grows}){slots}; max running requests {self.slots} "
            f"({self.slots_rule}); context {self.context} tokens ({self.context_rule}); "
            f"cap: {self.budget.describe()}"
        )


def plan_kv(
    config: EngineConfig,
    bytes_per_token: int,
    max_positions: int | None,
    weights: int = 0,
    slot_bytes: int = 0,
    grow: bool = False,
) -> KVPlan:
    """Slots first (each costs `slot_bytes`), then pages, all within the memory cap.

    `bytes_per_token`: one token of every full-attention layer (what a page holds per token).
    """
    budget = kv_budget(config.max_total_tokens, config.mem_fraction, bytes_per_token, weights)
    page = config.page_size
    total = max(budget.tokens, 2 * page)
    slot_tokens = -(-slot_bytes // bytes_per_token)
    if config.max_running_requests:
        slots, slots_rule = config.max_running_requests, "--max-running-requests"
    else:
        fit = total // (TYPICAL_REQUEST_TOKENS + slot_tokens)
        slots = min(MAX_AUTO_RUNNING, fit)
        slots_rule = f"budget / {TYPICAL_REQUEST_TOKENS}-token requests, at most {MAX_AUTO_RUNNING}"
        if fit > MAX_AUTO_RUNNING:
            # NOTE: said, since the ceiling, not memory, is then what bounds concurrency: 4-bit
            # pages in 8 GiB hold 455 such requests, and 256 ran where 310 could (an H200)
            slots_rule += f"; the budget holds {fit}: --max-running-requests runs more"
    # NOTE: slots never take every page: at least one request of two pages must fit.
    slots = max(1, min(slots, (total - 2 * page) // max(1, slot_tokens) - 1))
    pages = max(2, (total - (slots + 1) * slot_tokens) // page - 1)
    if config.context_length:
        context, context_rule = config.context_length, "--context-length"
    elif max_positions:
        context, context_rule = max_positions, "the model's max_position_embeddings"
    else:
        context, context_rule = pages * page, "no model limit: the KV pages"
    if context > pages * page:
        context, context_rule = pages * page, f"{context_rule}, cut to what the KV pages hold"
    initial = min(pages, -(-INITIAL_TOKENS // page)) if grow else 0
    return KVPlan(
        pages, page, slots, max(2, context), budget, slot_tokens, slots_rule, context_rule, initial
    )
