"""Models in each tool-call format, and the check that a forced call's sampled replies are valid
calls, for tests/test_tool_grammars.py and scripts/check_tool_calls.py.

A format's model is the default model's tokenizer with two unused added tokens renamed to the
format's markers (plain tokens) and a chat template written here, the shortest one from which
mlx-lm infers that format (`tokenizer_utils._infer_tool_parser`); its weights are random (a tiny
llama) or the default model's. `sample` runs forced-call requests at temperature 1 through the
scheduler itself; `verify` parses a reply as the engine would (`tool_calls.for_request`, mlx-lm's
parser of the format) and validates each call's arguments against its tool's schema.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
from tool_model import _rename_tokens

from engine.messages.to_tokenizer import Generate
from engine.random_model import TINY_LLAMA, make_random_model
from engine.tokenizer_loader import load_tokenizer
from tokenizer_proc import tool_calls, tool_choice

_CHAT = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}CALL{%- endfor %}"
    "{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TOOLS = (
    "{%- if tools %}<|im_start|>system\nTools:{%- for tool in tools %}\n"
    "{{ tool.function | tojson }}{%- endfor %}\nHOW<|im_end|>\n{% endif %}"
)
_NAME, _ARGS = "{{ tool_call.function.name }}", "{{ tool_call.function.arguments | tojson }}"


def _template(how: str, call: str) -> str:
    """Tools told in a system turn with how to call one (the text mlx-lm infers the format
    from), and an assistant's calls written as `call` (`tool_call` each)."""
    return _TOOLS.replace("HOW", how) + _CHAT.replace("CALL", call)


@dataclass(frozen=True)
class Format:
    markers: tuple[str, str]  # NOTE: what <issue_start> and <issue_comment> are renamed to
    template: str
    # NOTE: other unused added tokens renamed to a format's tags (added tokens, as the model's own)
    tags: tuple[tuple[str, str], ...] = ()


_QWEN_CALL = (
    f"<tool_call>\n<function={_NAME}>\n{{% for k, v in tool_call.function.arguments | items %}}"
    "<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
)
_FUNCTION_GEMMA = _template(
    "Call as <start_function_call>call:NAME{key:<escape>text<escape>,n:1}<end_function_call>",
    f"<start_function_call>call:{_NAME}{{}}<end_function_call>",
)
_GEMMA4 = _template(
    'Call as <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1,nested:{a:1}}<tool_call|>',
    f"<|tool_call>call:{_NAME}{{}}<tool_call|>",
)
FORMATS: dict[str, Format] = {
    "json_tools": Format(
        ("<tool_call>", "</tool_call>"),
        _template(
            "Call one as <tool_call>{json}</tool_call>",
            # NOTE: mlx-lm infers json_tools from `tool_call.name` in the template
            '{%- set tool_call = tool_call.function %}<tool_call>{"name": "{{ tool_call.name }}", '
            '"arguments": {{ tool_call.arguments | tojson }}}</tool_call>',
        ),
    ),
    "qwen3_coder": Format(
        ("<tool_call>", "</tool_call>"),
        _template(
            "Call one as <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n"
            "</function>\n</tool_call>",
            _QWEN_CALL,
        ),
    ),
    # NOTE: Mistral Small 3.2's syntax: a header per call
    "mistral": Format(
        ("[TOOL_CALLS]", "[ARGS]"),
        _template("Call one as [TOOL_CALLS]NAME[ARGS]{json}", f"[TOOL_CALLS]{_NAME}[ARGS]{_ARGS}"),
    ),
    # NOTE: Mistral 7B v0.3's: one JSON array (the template never writes the header's marker)
    "mistral_array": Format(
        ("[TOOL_CALLS]", "<issue_comment>"),
        _template(
            'Call as [TOOL_CALLS] [{"name": NAME, "arguments": {json}}]',
            f'[TOOL_CALLS] [{{"name": "{_NAME}", "arguments": {_ARGS}}}]',
        ),
    ),
    "pythonic": Format(
        ("<|tool_call_start|>", "<|tool_call_end|>"),
        _template(
            "Call as <|tool_call_start|>[name(key=value)]<|tool_call_end|>",
            f"<|tool_call_start|>[{_NAME}(...)]<|tool_call_end|>",
        ),
    ),
    "kimi_k2": Format(
        ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
        _template(
            "Call as <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0"
            "<|tool_call_argument_begin|>{json}<|tool_call_end|><|tool_calls_section_end|>",
            f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{_NAME}:0"
            f"<|tool_call_argument_begin|>{_ARGS}<|tool_call_end|><|tool_calls_section_end|>",
        ),
    ),
    "minimax_m2": Format(
        ("<minimax:tool_call>", "</minimax:tool_call>"),
        _template(
            'Call as <minimax:tool_call>\n<invoke name="NAME">\n<parameter name="K">V'
            "</parameter>\n</invoke>\n</minimax:tool_call>",
            f'<minimax:tool_call>\n<invoke name="{_NAME}">\n</invoke>\n</minimax:tool_call>',
        ),
    ),
    "glm47": Format(
        ("<tool_call>", "</tool_call>"),
        _template(
            "Call as <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>",
            f"<tool_call>{_NAME}</tool_call>",
        ),
    ),
    "longcat": Format(
        ("<longcat_tool_call>", "</longcat_tool_call>"),
        _template(
            "Call as <longcat_tool_call>NAME<longcat_arg_key>K</longcat_arg_key>"
            "<longcat_arg_value>V</longcat_arg_value></longcat_tool_call>",
            f"<longcat_tool_call>{_NAME}</longcat_tool_call>",
        ),
    ),
    "function_gemma": Format(
        ("<start_function_call>", "<end_function_call>"),
        _FUNCTION_GEMMA,
    ),
    # NOTE: markers of ordinary text (no token renamed): `<function name=` opens a call
    "minicpm5": Format(
        ("<issue_start>", "<issue_comment>"),
        _template(
            'Call as <function name="NAME">\n<param name="K">V</param>\n</function>',
            f'<function name="{_NAME}">\n</function>',
        ),
    ),
    # NOTE: FunctionGemma's tokenizer has `<escape>` as an added token: strings close with it
    "function_gemma_escape": Format(
        ("<start_function_call>", "<end_function_call>"),
        _FUNCTION_GEMMA,
        (("<issue_closed>", "<escape>"),),
    ),
    "muse_spark": Format(
        ("<atem:function_calls>", "</atem:function_calls>"),
        _template(
            'Call as <atem:function_calls>\n<atem:invoke name="NAME">\n'
            '<atem:parameter name="K">V</atem:parameter>\n</atem:invoke>\n</atem:function_calls>',
            f'<atem:function_calls>\n<atem:invoke name="{_NAME}">\n</atem:invoke>\n'
            "</atem:function_calls>",
        ),
    ),
    # NOTE: mlx-lm infers Kimi K3's XTML from the vocabulary, not the template (`<|open|>`,
    # `<|sep|>`, `<|close|>` and `<|end_of_msg|>` tokens: `tokenizer_utils._is_xtml_vocab`): the
    # markers renamed are two of its delimiters, added tokens as in the model's own tokenizer
    "kimi_k3": Format(
        ("<|open|>", "<|close|>"),
        _template(
            'Call as <|open|>tools<|sep|><|open|>call tool="NAME" index="0"<|sep|><|open|>argument '
            'key="K" type="string"<|sep|>V<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools'
            "<|sep|>",
            f'<|open|>tools<|sep|><|open|>call tool="{_NAME}" index="0"<|sep|><|close|>call<|sep|>'
            "<|close|>tools<|sep|>",
        ),
        (("<issue_closed>", "<|sep|>"), ("<jupyter_start>", "<|end_of_msg|>")),
    ),
    "gemma4": Format(("<|tool_call>", "<tool_call|>"), _GEMMA4),
    # NOTE: Gemma 4's tokenizer has `<|"|>` as an added token: strings open and close with it
    "gemma4_quote": Format(
        ("<|tool_call>", "<tool_call|>"), _GEMMA4, (("<issue_closed>", '<|"|>'),)
    ),
}
# NOTE: the default model's own template, which has no tool calling: the generic form
GENERIC = "generic"
NATIVE = (
    "json_tools",
    "qwen3_coder",
    "mistral",
    "mistral_array",
    "pythonic",
    "glm47",
    "kimi_k2",
    "minimax_m2",
    "longcat",
    "function_gemma",
    "function_gemma_escape",
    "minicpm5",
    "muse_spark",
    "kimi_k3",
    "gemma4",
    "gemma4_quote",
)


def make_format_model(
    fmt: str, out: Path, tokenizer_from: Path, weights_from: Path | None = None
) -> Path:
    """A model in format `fmt`: random tiny weights, or `weights_from`'s (linked, not copied)."""
    if weights_from is None:
        make_random_model(out, TINY_LLAMA, tokenizer_from=tokenizer_from)
    else:
        out.mkdir(parents=True, exist_ok=True)
        for f in weights_from.iterdir():
            if f.suffix == ".safetensors":
                (out / f.name).symlink_to(f.resolve())
            elif f.is_file():
                shutil.copy(f, out / f.name)
    if fmt != GENERIC:
        spec = FORMATS[fmt]
        start, end = spec.markers
        names = {"<issue_start>": start, "<issue_comment>": end, **dict(spec.tags)}
        _rename_tokens(out, {k: v for k, v in names.items() if k != v}, spec.template)
    return out


@functools.cache
def tokenizer_of(model_dir: Path) -> Any:
    """A format model's tokenizer, loaded once per test session."""
    return load_tokenizer(model_dir)


@functools.cache
def llg_tokenizer(model_dir: Path) -> Any:
    """llguidance's tokenizer of a format model, for checking its grammars' masks."""
    from llguidance import LLTokenizer

    return LLTokenizer(str(model_dir / "tokenizer.json"))


# --- the tools calls are forced to ------------------------------------------------------------

NOW = {"type": "object", "properties": {}, "additionalProperties": False}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "detailed": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "item": {"enum": ["tea", "coffee", "water"]},
        "quantity": {"type": "number"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["street"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["item", "quantity"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}}
    for n, p in (("now", NOW), ("get_weather", WEATHER), ("place_order", ORDER))
]
ASK = [{"role": "user", "content": "What should I do?"}]


def request(choice: Any = "required", parallel: bool = False, tools: Any = None) -> Generate:
    return Generate(
        rid="check",
        messages=ASK,
        tools=tools or TOOLS,
        tool_choice=choice,
        parallel_tool_calls=parallel,
    )


def verify(tokenizer: Any, msg: Generate, text: str) -> str | None:
    """None when `text` is, to the engine's parser for `msg`, only calls (one without parallel
    calls) to `msg`'s tools whose arguments are valid for their schemas; else what is wrong."""
    stream = tool_calls.for_request(tokenizer, msg)
    if stream is None:
        return "no parser for the request"
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    content, calls = content + rest, calls + more
    if content or not calls:
        return f"not only calls: text {content!r}, {len(calls)} calls"
    if not msg.parallel_tool_calls and len(calls) != 1:
        return f"{len(calls)} calls without parallel_tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in msg.tools or []}
    for call in calls:
        fn = call["function"]
        if fn["name"] not in schemas:
            return f"a call to {fn['name']!r}, no such tool"
        try:
            args = json.loads(fn["arguments"], parse_constant=_not_json)
            jsonschema.validate(args, schemas[fn["name"]])
        except (ValueError, jsonschema.ValidationError) as e:
            return f"{fn['name']}: {str(e).splitlines()[0]}"
    return None


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is no JSON number")


# --- sampling through the scheduler -----------------------------------------------------------


class Sampler:
    """A scheduler over a model directory, sampling many requests to their end."""

    def __init__(self, model_dir: Path, batch: int = 64) -> None:
        from engine.config import EngineConfig
        from engine.tokenizer_loader import load_tokenizer
        from scheduler_proc.model_loader import load_for_scheduler
        from scheduler_proc.scheduler import Scheduler

        config = EngineConfig(model=str(model_dir), max_running_requests=batch)
        model, self.eos = load_for_scheduler(str(model_dir), config)
        self.tokenizer = load_tokenizer(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        self.scheduler = Scheduler(config, model, self.eos, tokenizer_file=tokenizer_file)

    def sample(
        self, msg: Generate, n: int, max_tokens: int, seed: int = 0
    ) -> list[tuple[str, str]]:
        """`n` replies to `msg` at temperature 1 under its forced-call grammar: (finish reason,
        text) each, the text decoded as the detokenizer does (end-of-sequence tokens dropped)."""
        from engine.sampling_params import SamplingParams
        from tokenizer_proc.prepare import token_ids

        forced = msgspec.structs.replace(msg)
        tool_choice.force(forced, self.tokenizer)
        prompt = token_ids(forced, self.tokenizer, self.scheduler.vocab, 1 << 20)
        rng = random.Random(seed)
        outs: dict[str, list[int]] = {}
        ends: dict[str, str] = {}
        for i in range(n):
            rid = f"s{seed}-{i}"
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0, seed=rng.randrange(1 << 30), **forced.params
            )
            self.scheduler.submit(rid, list(prompt), params)
            outs[rid] = []
        while self.scheduler.has_work():
            for c in self.scheduler.step():
                outs[c.rid] += c.token_ids
                if c.finish_reason is not None:
                    ends[c.rid] = c.finish_reason
        eos = set(self.eos)
        return [
            (ends[rid], self.tokenizer.decode([t for t in ids if t not in eos]))
            for rid, ids in outs.items()
        ]
