"""mlx-lm's `minicpm5` format (MiniCPM5), one block per call, no wrapper around them:

    <function name="NAME">
    <param name="K">V</param>
    </function>

mlx-lm's parser takes each function block's name between quotes and each parameter's value up
to the first `</param>` (unwrapped when the whole value is a CDATA block, else stripped), and
converts it as minimax_m2's parser does, by the types it reads from the parameter's schema
(minimax_m2.py: `RawValues`). So values are written as there, with `</param>` closing them: a
string is raw text without `</param>` or `</function>` (nor a CDATA opening), no whitespace at
either end and not "null"; others JSON of their schemas. Parameters in their schema's order,
each required one present; parallel calls are consecutive blocks. A tokenizer whose tags are
added tokens takes the generic form (`lark.spelled`).
"""

from __future__ import annotations

from typing import Any

from tokenizer_proc.tool_grammars.lark import spelled
from tokenizer_proc.tool_grammars.minimax_m2 import NAME, RawValues
from tokenizer_proc.tool_grammars.tagged import Tags, build

CLOSE = "</param>"
SPELLED = ("<param", CLOSE, "</function>")
TAGS = Tags(NAME, '"{}">\n', '<param name="{}">', RawValues(CLOSE, (), ("<![CDATA[",)))


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """One block (or, `parallel`, one or more) of a call to `tools`; None where a tool's name
    or parameters cannot be written so that the parser reads them back."""
    if not spelled(tokenizer, SPELLED):
        return None
    return build(tokenizer, tools, TAGS, _top, parallel)


def _top(start: str, calls: str, end: str, many: str) -> list[str]:
    return [f"start: call{many}", f"call: {start} ({calls}) {end}"]
