"""OpenAI's reasoning effort (`reasoning_effort` on chat, `reasoning.effort` on Responses, the
SDK's `reasoning_effort`) made concrete for whatever model serves it.

A template that reads the effort itself (gpt-oss's writes `Reasoning: low|medium|high` into its
system message) gets it as the template variable `reasoning_effort`; `none` also switches the
thought off where the template has the switch (`enable_thinking: false`, Qwen3's). A model with
one-token think markers gets a thinking budget as well (`BUDGETS`: the thought is ended by the
engine after that many tokens), unless the request set its own. A model that does not think
takes any effort and changes nothing, as other OpenAI-compatible servers do: clients send it
without knowing what the model is.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequest

# NOTE: tokens of thought per effort. OpenAI publishes no numbers; these follow the usual reading
# (a few hundred tokens for a quick check, thousands for a hard problem). `xhigh`: no limit.
BUDGETS: dict[str, int | None] = {
    "none": 1,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": None,
}
# NOTE: the values gpt-oss's template knows
TEMPLATE_EFFORT = {"none": "low", "minimal": "low", "xhigh": "high"}


def check(effort: Any, field: str = "reasoning_effort") -> str | None:
    """A request's effort, one of `BUDGETS`' names (None: not given)."""
    if effort is None:
        return None
    if effort not in BUDGETS:
        raise InvalidRequest(field, f"must be one of {', '.join(BUDGETS)}, got {effort!r}")
    return str(effort)


def template_kwargs(effort: str, given: dict[str, Any] | None) -> dict[str, Any]:
    """The chat template's variables for `effort`; the request's own `given` ones win."""
    out: dict[str, Any] = {"reasoning_effort": TEMPLATE_EFFORT.get(effort, effort)}
    if effort == "none":
        out["enable_thinking"] = False
    return {**out, **(given or {})}


def budget(effort: str, max_tokens: int) -> int | None:
    """The thinking budget of `effort` (None: none, or no tighter than `max_tokens` already)."""
    tokens = BUDGETS[effort]
    return tokens if tokens is not None and tokens < max_tokens else None
