"""mlx-lm's `longcat` format (Meituan's LongCat), one block per call:

    <longcat_tool_call>NAME
    <longcat_arg_key>K</longcat_arg_key>
    <longcat_arg_value>V</longcat_arg_value>
    </longcat_tool_call>

GLM-4.7's format with other tags, read the same way (glm47.py: a "string" parameter is raw text,
any other JSON), with one difference: mlx-lm's parser finds the name before the first key and
fails on a call without one. It reads a block that starts with `{` as JSON first, so a call
without parameters is written `{"name": "NAME", "arguments": {}}`, and a call in tags has at
least one parameter.
"""

from __future__ import annotations

import json

from tokenizer_proc.tool_grammars.glm47 import KeyValueTags


def _empty(name: str) -> str:
    return json.dumps({"name": name, "arguments": {}})


LONGCAT = KeyValueTags(
    ("<longcat_arg_key>", "</longcat_arg_key>"),
    ("<longcat_arg_value>", "</longcat_arg_value>"),
    _empty,
)
grammar = LONGCAT.grammar
