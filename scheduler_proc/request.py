"""A request's state inside the scheduler: waiting -> prefilling -> decoding -> finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.messages.to_client import Chunk, FinishReason, TokenLogprob
from engine.sampling_params import SamplingParams
from scheduler_proc.radix_cache import Hit


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    max_new: int  # max_tokens, capped by the context
    stop_ids: frozenset[int]
    client: str = ""  # the unit of fair scheduling (scheduler_proc/waiting.py)
    state: State = State.WAITING
    slot: int | None = None  # its rings / state slot while it runs
    pages: list[int] = field(default_factory=list)  # page table: its KV, in position order
    fill: list[int] = field(default_factory=list)  # tokens to prefill (see `fill_ids`)
    prefilled: int = 0  # fill tokens launched into the KV
    kv_len: int = 0  # tokens launched into the KV (prompt + decode inputs)
    preemptions: int = 0
    snap_at: int | None = None  # a position to snapshot its slot at (a shared prefix's end)
    shared: int = 0  # prompt tokens other conversations share (its system prompt), if known
    # NOTE: a snapshot taken at `snap_at`, for the disk tier once the prompt body (which holds
    # its tokens) is cached (`KVManager.publish`)
    snap_pending: Any = None
    seated: int = 0  # seating order while it runs (the newest is preempted first)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    new_ids: list[int] = field(default_factory=list)  # not yet reported
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    reported_finish: bool = False
    hit: Hit | None = None  # its locked cached prefix, while it runs
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    matcher: Any = None  # its llguidance matcher, when its output is constrained (grammar.py)
    building: Any = None  # the matcher's Future while the grammar thread builds it
    invalid: str | None = None  # the field at fault when it ended with an input error
    # NOTE: `prompt_logprobs`: per prefill chunk, lazy (first position, chosen, top ids, top
    # logprobs), each covering prompt positions not covered before (a preemption recomputes)
    prompt_lps: list[Any] = field(default_factory=list)
    prompt_lp_upto: int = 1  # prompt positions covered so far (position 0 has none)
    prompt_lp_sent: bool = False
    # NOTE: a thought under a budget (`SamplingParams.think_budget`): inside one now, its tokens
    # so far, and the end marker that replaces the next sampled token once the budget is spent
    thinking: bool = False
    thought: int = 0
    force_next: int | None = None
    spec: Any = None  # its speculation state (`speculate.RowSpec`), once it speculated
    draft: Any = None  # where its draft model's KV is valid (`draft.DraftRow`), --spec draft
    disk: Any = None  # its prompt's blocks loading from disk (`disk_tier.DiskLoad`)
    disk_checked: bool = False  # the disk was asked for its prompt's blocks (since its seating)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still computing its prompt's logprobs: no prefix hit may skip a position."""
        return self.params.prompt_logprobs is not None and self.prompt_lp_upto < self.prompt_len

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def fill_ids(self) -> list[int]:
        """What prefill computes: the prompt, or after a preemption the prompt and every token
        generated so far (the last of them runs in a decode step, which samples the next)."""
        return self.fill or self.input_ids

    @property
    def fill_len(self) -> int:
        return len(self.fill_ids)

    def preempt(self) -> None:
        """Its KV is gone: it waits to recompute prompt + output, its stream kept as it is."""
        self.fill = self.input_ids + self.output_ids
        self.state, self.slot, self.pages = State.WAITING, None, []
        self.prefilled = self.kv_len = 0
        self.preemptions += 1
        self.disk_checked = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error

    def append(self, token: int, logprob: TokenLogprob | None) -> None:
        """Record one generated token and finish on a stop id or the length limit."""
        self.output_ids.append(token)
        self.new_ids.append(token)
        if logprob is not None:
            self.new_logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish("stop")
        elif len(self.output_ids) >= self.max_new:
            self.finish("length")

    def take_output(self, prompt_logprobs: list[TokenLogprob | None] | None = None) -> Chunk:
        out = Chunk(
            rid=self.rid,
            token_ids=self.new_ids,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            logprobs=self.new_logprobs,
            prompt_logprobs=prompt_logprobs or [],
            prompt_ids=self.input_ids if prompt_logprobs else [],
            error=self.error,
            invalid=self.invalid,
        )
        self.new_ids, self.new_logprobs = [], []
        self.reported_finish = self.finished
        return out
