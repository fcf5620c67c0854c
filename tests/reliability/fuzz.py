"""Generated client frames for fuzzing the ZMQ endpoint: random bytes, mutations of valid frames,
structurally plausible messages with hostile values, deep nesting and oversized values.

NOTE: `ShutdownEngine` is never generated (a valid one would stop the engine, which is allowed),
and generated requests ask for few tokens, so the fuzz is about parsing, not load.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgspec

from engine.messages import to_tokenizer as tt
from engine.transport import encode_request

TAGS = ["Hello", "Generate", "AbortRequest", "HealthCheck", "GetStats", "Ping", "Nope", "", "Gen"]
PARAM_KEYS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
              "stop_token_ids", "logprobs", "ignore_eos", "repetition_penalty", "bogus"]  # fmt: skip
SEEDS = [
    tt.Hello("h", 1),
    tt.Generate("g1", prompt="hello there", params={"max_tokens": 2}),
    tt.Generate("g2", messages=[{"role": "user", "content": "hi"}], params={"max_tokens": 1}),
    tt.Generate("g3", input_ids=[1, 2, 3], params={"max_tokens": 3, "stop": ["x"]}),
    tt.AbortRequest("a", "g1"),
    tt.HealthCheck("hc"),
    tt.GetStats("gs"),
    tt.Ping(),
]


def frames(seed: int, n: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    seeds = [encode_request(m) for m in SEEDS]
    makers = [_random_bytes, _mutated, _mutated, _structured, _structured, _structured, _deep]
    for i in range(n):
        if i % 500 == 499:
            yield _oversized(rng)
        else:
            yield rng.choice(makers)(rng, seeds)


def _random_bytes(rng: random.Random, seeds: list[bytes]) -> bytes:
    return rng.randbytes(rng.choice([0, 1, 2, 5, 17, 64, 1000]))


def _mutated(rng: random.Random, seeds: list[bytes]) -> bytes:
    frame = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        pos = rng.randrange(len(frame) or 1)
        if op == 0 and frame:
            frame[pos] = rng.randrange(256)
        elif op == 1:
            frame.insert(pos, rng.randrange(256))
        elif op == 2 and frame:
            del frame[pos]
        else:
            frame = frame[:pos]
    return bytes(frame)


def _structured(rng: random.Random, seeds: list[bytes]) -> bytes:
    tag = rng.choice(TAGS)
    body: list[Any] = [tag, _value(rng, 1) if rng.random() < 0.2 else f"f{rng.randrange(1 << 30)}"]
    if tag in ("Generate", "Gen"):
        body += [_prompt(rng), _messages(rng), _ids(rng), _params(rng)]
        body = body[: rng.randint(2, len(body))]
    else:
        body += [_value(rng, 2) for _ in range(rng.randint(0, 3))]
    return msgspec.msgpack.encode(body)


def _prompt(rng: random.Random) -> Any:
    return rng.choice(
        [None, None, "", "hi", "x" * rng.randrange(5000), "\u00e9\u6f22\U0001f600", 5]
    )


def _messages(rng: random.Random) -> Any:
    if rng.random() < 0.5:
        return None
    return [
        {
            rng.choice(["role", "content", "name", 7]): _value(rng, 3)
            for _ in range(rng.randint(0, 3))
        }
        for _ in range(rng.randint(0, 4))
    ]


def _ids(rng: random.Random) -> Any:
    if rng.random() < 0.5:
        return None
    pool = [0, 1, 5, -1, 2**31, 2**63 - 1, 10**9, "a", None, 1.5]
    return [rng.choice(pool) for _ in range(rng.randint(0, 8))]


def _params(rng: random.Random) -> Any:
    if rng.random() < 0.1:
        return _value(rng, 2)
    params = {rng.choice(PARAM_KEYS): _value(rng, 2) for _ in range(rng.randint(0, 4))}
    params["max_tokens"] = rng.choice([1, 2, 3, 0, -1, "x"])
    return params


def _value(rng: random.Random, depth: int) -> Any:
    kinds = ["none", "bool", "int", "float", "str", "bytes"] + (
        ["list", "dict"] if depth > 0 else []
    )
    kind = rng.choice(kinds)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 7, 2**31, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if kind == "float":
        return rng.choice([0.0, -0.5, 1e308, float("nan"), float("inf"), rng.random()])
    if kind == "str":
        return rng.choice(["", "user", "\x00", "a" * rng.randrange(300), "\u202e\ufeff"])
    if kind == "bytes":
        return rng.randbytes(rng.randrange(16))
    if kind == "list":
        return [_value(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    if kind == "dict":
        return {f"k{i}": _value(rng, depth - 1) for i in range(rng.randint(0, 3))}
    return None


def _deep(rng: random.Random, seeds: list[bytes]) -> bytes:
    depth = rng.choice([20, 40, 200, 900, 3000, 20000])
    head = msgspec.msgpack.encode(["Generate", f"d{rng.randrange(1 << 30)}", None])
    # NOTE: a 4-element array whose last element (messages) nests `depth` lists deep.
    return b"\x94" + head[1:] + b"\x91" * depth + b"\xc0"


def _oversized(rng: random.Random) -> bytes:
    size = rng.choice([9 << 20, 12 << 20])
    return msgspec.msgpack.encode(["Generate", f"big{rng.randrange(1 << 30)}", "x" * size])
