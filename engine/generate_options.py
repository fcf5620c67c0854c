"""The keywords of the SDK's `generate` and `stream`, written once for both clients.

`EngineClient` and `AsyncEngineClient` take `prompt` and then `**options: Unpack[GenerateOptions]`,
so an editor completes and a type checker checks every keyword. The engine validates them again
(a misspelt or out-of-range one is an `InvalidRequest` naming it); the sampling keywords are
`SamplingParams`' fields (tests/test_client_options.py keeps the two lists equal).
"""

from __future__ import annotations

from typing import Any, TypedDict

from engine.messages import to_tokenizer as tt

# NOTE: the keywords that say what to run and how to wait; every other one is a sampling keyword
# and travels in `Generate.params`.
REQUEST_KEYS = frozenset(
    {
        "messages",
        "input_ids",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "reasoning_effort",
        "rid",
        "timeout",
    }
)
# NOTE: sampling fields the front door fills in from the model (its think markers, whether the
# prompt opened a thought): not keywords; a client's value is replaced
FILLED_IN = frozenset({"think_start_id", "think_end_id", "think_inside"})


class GenerateOptions(TypedDict, total=False):
    """What to run (one of the prompt, `messages` or `input_ids`), then how to sample it.

    `tools` (OpenAI-style specs, `{"type": "function", "function": {"name": ..., ...}}`) go to
    the chat template with `messages`, as over HTTP; the model's tool calls come back parsed in
    `tool_calls` (OpenAI's shape), out of `text`. `tool_choice="required"` or `{"type":
    "function", "function": {"name": ...}}` forces a call (arguments held to the tool's schema);
    `parallel_tool_calls=False` allows one. `chat_template_kwargs`: variables for the chat
    template (`{"enable_thinking": False}`). `think_budget`: a thinking model's thought ends
    after that many tokens (its end marker forced) and the answer follows; `reasoning_effort`
    (OpenAI's none, minimal, low, medium, high, xhigh) sets such a budget and the template's
    variable (a model that does not think ignores it). `timeout`: seconds
    for the whole request (None: no deadline); `rid`: the request's id (default: a fresh one),
    for `abort`.
    """

    messages: list[dict[str, Any]] | None
    input_ids: list[int] | None
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool
    chat_template_kwargs: dict[str, Any] | None
    reasoning_effort: str | None
    rid: str | None
    timeout: float | None
    # NOTE: sampling (engine/sampling_params.py says what each means and its default)
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int | None
    json_schema: dict[str, Any] | None
    regex: str | None
    grammar: str | None
    think_budget: int | None


def generate_message(prompt: str | None, options: GenerateOptions, rid: str) -> tt.Generate:
    """The wire request for one `generate` / `stream` call (`rid` when the options name none)."""
    return tt.Generate(
        rid=options.get("rid") or rid,
        prompt=prompt,
        messages=options.get("messages"),
        input_ids=options.get("input_ids"),
        params={k: v for k, v in options.items() if k not in REQUEST_KEYS},
        tools=options.get("tools"),
        tool_choice=options.get("tool_choice"),
        parallel_tool_calls=options.get("parallel_tool_calls", True),
        chat_template_kwargs=options.get("chat_template_kwargs"),
        reasoning_effort=options.get("reasoning_effort"),
    )
