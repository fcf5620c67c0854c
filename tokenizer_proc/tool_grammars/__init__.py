"""Forced tool calls in a model's own syntax: one Lark grammar per mlx-lm tool format, written so
that mlx-lm's parser of that format reads every output it allows back as calls to the tools with
arguments valid for their schemas.

`native` builds it where the model's format has a grammar here and the tools can be written in
it faithfully; otherwise (another format, none, or a name or schema the format cannot carry)
it is None, and the call takes the generic JSON form (`tool_choice._generic`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizer_proc.tool_grammars import (
    function_gemma,
    gemma4,
    glm47,
    json_tools,
    kimi_k2,
    kimi_k3,
    longcat,
    minicpm5,
    minimax_m2,
    mistral,
    muse_spark,
    pythonic,
    qwen3_coder,
)

Builder = Callable[[Any, list[dict[str, Any]], bool], "str | None"]

# NOTE: mlx-lm's format (its parser module's name) -> the grammar of a forced call in it
BUILDERS: dict[str, Builder] = {
    "json_tools": json_tools.grammar,
    "qwen3_coder": qwen3_coder.grammar,
    "mistral": mistral.grammar,
    "pythonic": pythonic.grammar,
    "glm47": glm47.grammar,
    "kimi_k2": kimi_k2.grammar,
    "minimax_m2": minimax_m2.grammar,
    "longcat": longcat.grammar,
    "function_gemma": function_gemma.grammar,
    "minicpm5": minicpm5.grammar,
    "muse_spark": muse_spark.grammar,
    "kimi_k3": kimi_k3.grammar,
    "gemma4": gemma4.grammar,
}


def format_of(tokenizer: Any) -> str | None:
    """The model's tool-call format as mlx-lm names it (None: it has none)."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    parser = getattr(tokenizer, "tool_parser", None)
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] or None


def native(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The grammar of one call (or, `parallel`, one or more) to `tools` in the model's own
    syntax; None where there is none for its format or these tools."""
    build = BUILDERS.get(format_of(tokenizer) or "")
    return build(tokenizer, tools, parallel) if build is not None and tools else None
