"""Wire protocol: tagged unions, typed decoders, error naming, typed errors on the wire."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from engine.errors import EngineDead, InvalidRequest, Overloaded, ProtocolMismatch, ShuttingDown
from engine.messages import to_client as tc
from engine.messages import to_detokenizer as td
from engine.messages import to_launcher as tl
from engine.messages import to_scheduler as ts
from engine.messages import to_tokenizer as tt
from engine.messages.to_client import TokenLogprob
from engine.protocol import Codec, error_field
from engine.sampling_params import SamplingParams
from engine.wire_errors import to_exception, to_failure

SAMPLES = [
    (tt.FromClient, tt.Generate("r1", prompt="hi", params={"max_tokens": 3})),
    (tt.FromClient, tt.Generate("r2", messages=[{"role": "user", "content": "x"}])),
    (tt.FromClient, tt.AbortRequest("r3", "r1")),
    (tt.FromClient, tt.Ping()),
    (tt.FromEngine, tt.Chunks([tc.Chunk("r1", "a", [1], "stop", 2, 1)])),
    (tt.FromEngine, tt.Control("drain")),
    (ts.ToScheduler, ts.TokenizedRequest("r1", [1, 2], SamplingParams(stop=["x"]))),
    (ts.ToScheduler, ts.Drain(2.5)),
    (
        td.ToDetokenizer,
        td.StepOutputs([tc.Chunk("r", token_ids=[1], logprobs=[TokenLogprob(-0.5)])]),
    ),
    (td.ToDetokenizer, td.Register("r", ["\n\n"])),
    (td.ToDetokenizer, tt.RequestFailed(tc.Failure("r", "overloaded", "4 waiting"))),
    (tc.ToClient, tc.Failure("r", "invalid_request", "bad", "top_p")),
    (tl.ToLauncher, tl.Ready("scheduler", 12, tl.SchedulerFacts("/x", "x", 5, 64))),
]


@pytest.mark.parametrize(("union", "msg"), SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(union, msg):
    codec = Codec(union)
    assert codec.decode(codec.encode(msg)) == msg


def test_finish_reasons_and_control_actions_are_closed_sets():
    for union, frame in [
        (tt.FromEngine, tt.Chunks([tc.Chunk("r", finish_reason="done")])),  # type: ignore[arg-type]
        (tt.FromEngine, tt.Control("reboot")),  # type: ignore[arg-type]
    ]:
        with pytest.raises(msgspec.ValidationError):
            Codec(union).decode(msgspec.msgpack.encode(frame))


def test_the_sdk_wire_modules_need_no_engine_process_package():
    """A client installs the SDK: its messages must not import the scheduler (or MLX)."""
    code = (
        "import sys, engine.client, engine.messages.to_detokenizer;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('scheduler_proc', 'mlx')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_frames_are_compact_arrays_with_the_tag_first():
    raw = msgspec.msgpack.decode(Codec(tt.FromClient).encode(tt.Generate("r1", prompt="hi")))
    # NOTE: positional, no field names on the wire (msgspec keeps defaults in array-like frames)
    assert raw[:3] == ["Generate", "r1", "hi"] and len(raw) == 1 + len(
        tt.Generate.__struct_fields__
    )


def test_unknown_tag_and_wrong_shapes_are_rejected():
    codec = Codec(tt.FromClient)
    for frame in [
        b"\xc1garbage",
        msgspec.msgpack.encode(["Nope", "r"]),
        msgspec.msgpack.encode({"a": 1}),
    ]:
        with pytest.raises(msgspec.MsgspecError):
            codec.decode(frame)


def test_a_frame_for_another_socket_is_rejected():
    frame = Codec(ts.ToScheduler).encode(ts.Drain(1.0))
    with pytest.raises(msgspec.ValidationError):
        Codec(tt.FromClient).decode(frame)


def test_no_pickle_anywhere():
    import pickle

    with pytest.raises(msgspec.MsgspecError):
        Codec(tt.FromClient).decode(pickle.dumps(tt.Ping()))


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"max_tokens": "x"}, "max_tokens"),
        ({"bogus": 1}, "bogus"),
        ({"stop": 3}, "stop"),
        ({"top_p": 2.0}, "top_p"),
        ({"max_tokens": 10**30}, "max_tokens"),  # NOTE: these three once failed on the wire
        ({"top_k": 2**64}, "top_k"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ],
)
def test_sampling_params_errors_name_the_field(raw, field):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.parse(raw, vocab_size=100)
    assert e.value.field == field


def test_error_field_of_array_like_paths():
    fields = tt.Generate.__struct_fields__
    assert error_field("Expected `str | null`, got `int` - at `$[2]`", "frame", fields) == "prompt"
    assert error_field("Invalid value 'X' - at `$[0]`", "frame", fields) == "type"
    assert error_field("Expected `array`, got `int`", "frame", fields) == "frame"


@pytest.mark.parametrize(
    "exc",
    [InvalidRequest("top_p", "bad"), Overloaded("full"), ShuttingDown("bye"), EngineDead("x")]
    + [ProtocolMismatch("v2")],
)
def test_typed_errors_survive_the_wire(exc):
    back = to_exception(to_failure("r", exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    if isinstance(exc, InvalidRequest):
        assert back.field == "top_p"


def test_the_front_door_checks_tokenized_prompts_against_the_model_too():
    """The scheduler process takes the front door's word (one check per request), so ids a
    tokenizer makes beyond the model's vocabulary are refused there, naming the client's field."""
    from tokenizer_proc import prepare

    class WideTokenizer:  # NOTE: a tokenizer vocabulary larger than the model's embedding
        bos_token = None

        def encode(self, text, add_special_tokens=True):
            return [1, 99]

    with pytest.raises(InvalidRequest) as e:
        prepare.token_ids(tt.Generate("r", prompt="hi"), WideTokenizer(), 50, 64)
    assert e.value.field == "prompt" and "out of range" in e.value.message
    assert prepare.token_ids(tt.Generate("r", input_ids=[1, 49]), None, 50, 64) == [1, 49]


def test_a_chats_shared_prefix_is_its_leading_system_messages_as_the_template_writes_them(
    default_model_dir,
):
    """`prepare.prompt(shared=prepare.shared_prefix)`: the tokens of the system messages before the first other
    message, when the template writes them alone as it writes them in the chat; 0 when no such
    message leads others."""
    from engine.tokenizer_loader import load_tokenizer
    from tokenizer_proc import prepare

    tok = load_tokenizer(default_model_dir)
    system = {"role": "system", "content": "You are a careful agent. " * 20}
    user = {"role": "user", "content": "Fix the test."}

    def shared(messages: list[dict]) -> tuple[int, list[int]]:
        got = prepare.prompt(
            tt.Generate("r", messages=messages), tok, 49152, 8192, shared=prepare.shared_prefix
        )
        return got.shared, got.ids

    n, ids = shared([system, user])
    alone = tok.apply_chat_template([system], add_generation_prompt=False)
    assert n == len(alone) > 100 and ids[:n] == list(alone)
    assert shared([system, system, user])[0] > n, "every leading system message"
    assert shared([user])[0] == 0 and shared([system])[0] == 0
    assert shared([user, system, user])[0] == 0, "a system message that does not lead"
    plain = prepare.prompt(tt.Generate("r", messages=[system, user]), tok, 49152, 8192)
    assert plain.shared == 0 and plain.ids == ids, "not asked: not rendered twice"


class DayTemplate:
    """A chat template that writes the day first (as templates with `strftime_now` do), then
    one token per message."""

    def __init__(self) -> None:
        self.day = 7

    def apply_chat_template(self, messages, add_generation_prompt=False, **kwargs):
        ids = [self.day] + [len(m["content"]) for m in messages]
        return ids + [1] * add_generation_prompt


def test_a_system_prompts_head_is_rendered_once_and_again_when_the_template_changes_it():
    """`SharedHeads`: agents resending one system prompt render its head once, not once per
    turn; a kept head that no longer begins the prompt (the template's date moved on) is rendered
    again, never answered stale; another system prompt is its own head."""
    from tokenizer_proc import prepare
    from tokenizer_proc.shared_heads import SharedHeads

    tok, heads = DayTemplate(), SharedHeads()
    system = {"role": "system", "content": "be brief"}

    def shared(*messages: dict) -> int:
        req = tt.Generate("r", messages=list(messages))
        got = prepare.prompt(req, tok, 49152, 8192, shared=heads)
        uncached = prepare.prompt(req, tok, 49152, 8192, shared=prepare.shared_prefix)
        assert got == uncached
        return got.shared

    for turn in range(1, 6):
        user = [{"role": "user", "content": "x" * turn}, {"role": "assistant", "content": "ok"}]
        assert shared(system, *user) == 2
    assert heads.rendered == 1, "one render for every turn under one system prompt"
    tok.day = 8
    assert shared(system, {"role": "user", "content": "hi"}) == 2 and heads.rendered == 2
    assert shared({"role": "system", "content": "be long"}, {"role": "user", "content": "hi"})
    assert heads.rendered == 3
    small = SharedHeads(kept=1)
    hi = {"role": "user", "content": "hi"}
    assert small([system, hi], tok, None, {}, [8, 8, 2, 1]) == 2
    assert small([{"role": "system", "content": "a"}, hi], tok, None, {}, [8, 1, 2, 1]) == 2
    assert len(small._heads) == 1, "no more heads kept than asked"
