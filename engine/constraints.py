"""Structured output: a request's constraint (JSON schema, regex or Lark grammar) as one
llguidance grammar, checked where the request comes in.

llguidance (Rust, no dependencies of its own) over xgrammar, whose wheel requires torch and triton:
the engine never imports torch. Its masks cost 15-27 us a row on this CPU (docs/structured_output.md).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from engine.errors import InvalidRequest

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

# NOTE: the one field of SamplingParams each constraint kind lives in
FIELDS = ("json_schema", "regex", "grammar")
# NOTE: json.dumps's separators (what models see in their training data and templates) and no
# free whitespace: with it a weak model's JSON ran to max_tokens in newlines and spaces.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CONSTRAINT_CHARS = 256 << 10


def field_of(params: SamplingParams) -> str | None:
    """The constraint field a request set, or None; `InvalidRequest` when it set several."""
    set_ = [name for name in FIELDS if getattr(params, name) is not None]
    if len(set_) > 1:
        raise InvalidRequest(set_[1], f"only one of {', '.join(FIELDS)} per request")
    return set_[0] if set_ else None


def check_shape(params: SamplingParams) -> str | None:
    """The cheap rules (one constraint, its size), no compiling: the constraint's field or None."""
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


def grammar_of(params: SamplingParams) -> str | None:
    """The llguidance grammar of the request's constraint (None: unconstrained)."""
    name = check_shape(params)
    if name is None:
        return None
    from llguidance import LLMatcher

    value = getattr(params, name)
    if name == "json_schema":
        return LLMatcher.grammar_from_json_schema(value, defaults=JSON_STYLE)  # type: ignore[arg-type]
    if name == "regex":
        return LLMatcher.grammar_from_regex(value)
    return LLMatcher.grammar_from_lark(value)


def check(params: SamplingParams) -> None:
    """Refuse a constraint llguidance cannot compile, naming its field and llguidance's reason.

    NOTE: compiling takes time (a 190 KB schema: 0.36-0.65 s), so the front door runs it on its
    worker pool, never on the loop that serves every client (llguidance drops the GIL).
    """
    grammar = grammar_of(params)
    if grammar is None:
        return
    # NOTE: imported only for a constrained request: every long prompt passes here, and a
    # missing or broken llguidance must not fail requests that never asked for it.
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(field_of(params) or "grammar", f"cannot be compiled: {error.strip()}")
