"""Messages the tokenizer process receives.

Two sockets, two unions: `FromClient` on the client ROUTER endpoint (SDK and raw clients), and
`FromEngine` on its internal PULL socket (detokenizer output, launcher control).
"""

from __future__ import annotations

from typing import Any, Literal

from engine.messages.admin import AdminDone, AdminRequest
from engine.messages.to_client import Chunk, Failure
from engine.protocol import Message

# --- from clients -------------------------------------------------------------------------------


class Hello(Message):
    """First message of a client: the protocol version it speaks, and the engine's API key when
    it has one (`--api-key`): a ZMQ client is served only after a Hello with the right key."""

    rid: str
    version: int
    api_key: str | None = None


class Generate(Message):
    """One generation request: exactly one of prompt, messages or input_ids.

    `params` stays a plain mapping on the wire so a bad value is reported by its own field name
    (`max_tokens`, `top_p`, ...) when it is converted to `SamplingParams`.
    """

    rid: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    params: dict[str, Any] = {}
    tools: list[dict[str, Any]] | None = None  # OpenAI-style tool specs for the chat template
    # NOTE: OpenAI's tool_choice: "required" or {"type": "function", "function": {"name"}} force
    # a call, its arguments held to the tool's schema (tokenizer_proc/tool_choice.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # NOTE: extra variables for the chat template (vLLM's and SGLang's field), e.g.
    # {"enable_thinking": false} (tokenizer_proc/prepare.py)
    chat_template_kwargs: dict[str, Any] | None = None
    # NOTE: OpenAI's reasoning effort (none, minimal, low, medium, high, xhigh): a thinking
    # model's budget and the template's variable (tokenizer_proc/effort.py)
    reasoning_effort: str | None = None


class AbortRequest(Message):
    rid: str
    target: str


class HealthCheck(Message):
    rid: str


# NOTE: the engine's verdict on a HealthGenerate comes within this; a client waits a little longer
# (REPLY_SLACK_S) so that it hears "unhealthy" instead of timing out itself.
HEALTH_GENERATE_TIMEOUT_S = 30.0
REPLY_SLACK_S = 10.0


class HealthGenerate(Message):
    """A real one-token generation through the whole engine; answered by a HealthReply."""

    rid: str


class GetStats(Message):
    rid: str
    api_key: str | None = None  # NOTE: control messages carry the key again (see Hello)


class ShutdownEngine(Message):
    rid: str
    api_key: str | None = None


class Ping(Message):
    """Liveness probe of an SDK client with calls in flight."""


class Goodbye(Message):
    """The client is closing: abort whatever it still has running."""


class ClosingAck(Message):
    """Answer to `Closing`: this client read every reply sent before it."""


FromClient = (
    Hello
    | Generate
    | AbortRequest
    | HealthCheck
    | HealthGenerate
    | GetStats
    | ShutdownEngine
    | AdminRequest
    | Ping
    | Goodbye
    | ClosingAck
)

# --- from the engine ----------------------------------------------------------------------------


class Chunks(Message):
    """The detokenizer's output of one scheduler step (and request-level failures)."""

    chunks: list[Chunk] = []


class RequestFailed(Message):
    """The scheduler refused a request after admission (e.g. it can never fit the KV cache);
    the front door hands `failure` to the request's client as it is."""

    failure: Failure


class Heartbeat(Message):
    """The scheduler loop ticked at `ticked_at` (time.time()); forwarded by the detokenizer."""

    ticked_at: float


class SchedulerStats(Message):
    rid: str
    stats: dict[str, float] = {}


class Control(Message):
    """From the launcher: `drain` (refuse new requests) or `fail` (the engine died)."""

    action: Literal["drain", "fail"]
    reason: str = ""


class PipelineDrained(Message):
    """The detokenizer's last message: nothing more will come; the tokenizer may exit."""


FromEngine = (
    Chunks | RequestFailed | Heartbeat | SchedulerStats | AdminDone | Control | PipelineDrained
)
