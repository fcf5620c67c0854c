"""Structured output: a request's constraint (JSON schema, regex or Lark grammar) as one
llguidance grammar, checked where the request comes in.

llguidance (Rust, no dependencies of its own) over xgrammar, whose wheel requires torch and triton:
the engine never imports torch. Its masks cost 15-27 us a row on this CPU (docs/structured_output.md).
"""

from __future__ import annotations

from engine.errors import InvalidRequest

# NOTE: the cheap rules live with the parameters (`SamplingParams.validate` runs them): this
# module, which compiles, depends on them, not the other way round
from engine.sampling_params import CONSTRAINT_FIELDS as FIELDS
from engine.sampling_params import SamplingParams, check_shape, field_of

__all__ = ["FIELDS", "JSON_STYLE", "check", "field_of", "grammar_of"]

# NOTE: json.dumps's separators (what models see in their training data and templates) and no
# free whitespace: with it a weak model's JSON ran to max_tokens in newlines and spaces.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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
