"""Per-request sampling parameters: one definition for the wire, the SDK and the scheduler."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from engine.errors import InvalidRequest
from engine.protocol import error_field

MAX_TOP_LOGPROBS = 20
# NOTE: JSON (the HTTP API) carries integers of any size and msgpack infinities; the wire to the
# scheduler carries neither beyond 64 bits (an OverflowError there was a 500), nor do they mean
# anything as sampling values.
INT_FIELDS = ("max_tokens", "top_k", "logprobs")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")  # fmt: skip


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int = 0  # top-n logprobs per generated token; 0: none
    # NOTE: each prompt token's logprob (given the tokens before it) and the top-n of that
    # position, on the request's first chunk (vLLM's name); None: none. Such a request takes no
    # prefix-cache hit: every position is computed.
    prompt_logprobs: int | None = None
    # NOTE: structured output, at most one (engine/constraints.py): the output is JSON matching
    # the schema ({"type": "object"}: any JSON object), matches the regex, or the Lark grammar.
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    # NOTE: a thinking model's thought capped at this many tokens, then its end marker forced
    # (Anthropic's `thinking.budget_tokens`); the front door fills in the markers' ids and
    # whether the prompt opened the thought (tokenizer_proc/reasoning.py)
    think_budget: int | None = None
    think_start_id: int | None = None
    think_end_id: int | None = None
    think_inside: bool = False

    @classmethod
    def parse(cls, raw: dict[str, Any], vocab_size: int | None = None) -> SamplingParams:
        """A client's sampling keywords, converted and validated; `InvalidRequest` names the
        first bad one (an unknown keyword by its own name)."""
        try:
            params = msgspec.convert(raw, cls)
        except msgspec.ValidationError as e:
            raise InvalidRequest(error_field(str(e), "params"), str(e)) from None
        return params.validate(vocab_size)

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise `InvalidRequest` naming the first bad field; return self when all are valid."""
        for name in INT_FIELDS:
            value = getattr(self, name)
            _check(value < 2**63, name, f"must be < 2**63, got {value}")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            _check(math.isfinite(value), name, f"must be a finite number, got {value}")
        _check(self.max_tokens > 0, "max_tokens", f"must be > 0, got {self.max_tokens}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}")
        _check(
            0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
        )
        if self.prompt_logprobs is not None:
            _check(
                0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
            )
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        if self.constrained:  # NOTE: compiled later, off the front door's loop (constraints.py)
            check_shape(self)
        if self.think_budget is not None:
            budget = self.think_budget
            _check(1 <= budget < 2**63, "think_budget", f"must be >= 1, got {budget}")
            _check(
                not self.constrained, "think_budget", "cannot be combined with structured output"
            )
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            _check(not bad, "stop_token_ids", f"ids out of range [0, {vocab_size}): {bad}")
        return self


# NOTE: the one field of SamplingParams each structured-output constraint kind lives in
CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar")
MAX_CONSTRAINT_CHARS = 256 << 10


def field_of(params: SamplingParams) -> str | None:
    """The constraint field a request set, or None; `InvalidRequest` when it set several."""
    set_ = [name for name in CONSTRAINT_FIELDS if getattr(params, name) is not None]
    if len(set_) > 1:
        raise InvalidRequest(set_[1], f"only one of {', '.join(CONSTRAINT_FIELDS)} per request")
    return set_[0] if set_ else None


def check_shape(params: SamplingParams) -> str | None:
    """A constraint's cheap rules (one of them, its size), no compiling: its field or None."""
    name = field_of(params)
    if name is None:
        return None
    value = getattr(params, name)
    size = len(json.dumps(value)) if name == "json_schema" else len(value)
    if size > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(name, f"at most {MAX_CONSTRAINT_CHARS} characters, got {size}")
    if not value and name != "json_schema":
        raise InvalidRequest(name, "must not be empty")
    return name


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(field, message)
