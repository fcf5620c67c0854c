"""Pieces every reply parser shares (tool_calls.py, harmony.py, reasoning.py): a parsed call in
OpenAI's form, and how much of a streamed text's end may still become a marker. Apart from
tool_calls.py so that harmony.py, which tool_choice.py asks for a forced call's grammar, does not
import the module that imports tool_choice.py."""

from __future__ import annotations

import json
import uuid
from typing import Any


def openai_call(name: Any, args: Any, index: int, ident: str | None = None) -> dict[str, Any]:
    """A parsed call in OpenAI's form; ValueError when it cannot be one (a name that is not a
    string, arguments with a number JSON cannot hold: Python reads `1e400` as inf)."""
    if not isinstance(name, str):
        raise ValueError(f"a tool call's name must be a string, got {name!r}")
    return {
        "index": index,
        "id": ident or call_id(),
        "type": "function",
        "function": {
            "name": name,
            "arguments": args if isinstance(args, str) else json.dumps(args, allow_nan=False),
        },
    }


def call_id() -> str:
    """A fresh call id in OpenAI's shape."""
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
