"""mlx-lm's `json_tools` format (Hermes, Qwen 2.5 / 3, the test models): `<tool_call>` then
`{"name": .., "arguments": {..}}` then `</tool_call>`, one block per call; its parser reads the
block as JSON."""

from __future__ import annotations

from typing import Any

from tokenizer_proc.tool_grammars.lark import json_value, marker
from tokenizer_proc.tool_grammars.schemas import call_schema


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    calls = [call_schema(t["function"], "arguments") for t in tools]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    start = marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = marker(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    # NOTE: the template's own layout may put a newline on either side of the JSON; none
    # outside the markers, where it would be text beside the calls
    return "\n".join(
        [
            f"start: call{'+' if parallel else ''}",
            f'call: {start} "\\n"? arguments "\\n"? {end}',
            f"arguments: {json_value(call)}",
        ]
    )
