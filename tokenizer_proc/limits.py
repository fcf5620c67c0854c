"""The front door's input limits: each a cheap check run before any slow work, each an
`InvalidRequest` that names the limit and its option.

Pure functions of a request and the config; the front door calls them in order: frame size
before decoding, request shape (counts, characters, nesting) before sampling parameters and
tokenization, stop strings once the parameters are known (a client's share of admission is the
core's: tokenizer_proc/core.py).
"""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.messages.to_tokenizer import Generate
from engine.sampling_params import SamplingParams

# NOTE: a chat request has tens of values, a large tool schema thousands; the walk costs ~1 us per
# value on the front door's loop, so more is refused (a million-element list took a second).
MAX_VALUES = 20_000


def _limit(field: str, what: str, option: str, value: int | float) -> InvalidRequest:
    flag = "--" + option.replace("_", "-")
    return InvalidRequest(field, f"{what} exceeds the limit {option}={value} ({flag})")


def check_frame(size: int, config: EngineConfig) -> None:
    if size > config.max_frame_bytes:
        raise _limit("frame", f"{size} bytes", "max_frame_bytes", config.max_frame_bytes)


def check_body(size: int | None, config: EngineConfig) -> None:
    """An HTTP body's declared size (Content-Length) within `--max-body-bytes`."""
    if size is not None and size > config.max_body_bytes:
        raise body_error(f"{size} bytes", config)


def body_error(what: str, config: EngineConfig) -> InvalidRequest:
    return _limit("body", what, "max_body_bytes", config.max_body_bytes)


def nesting_error(config: EngineConfig, field: str = "frame") -> InvalidRequest:
    """For a frame or body too deep to decode at all (msgspec raises RecursionError)."""
    return _limit(field, "nesting", "max_nesting_depth", config.max_nesting_depth)


def check_generate(msg: Generate, config: EngineConfig, max_context: int) -> int:
    """Counts, characters and nesting of a request, before anything walks it slowly; returns
    the characters of its text (the prompt, or every string of its messages and tools)."""
    if msg.prompt is not None and len(msg.prompt) > config.max_prompt_chars:
        raise _limit(
            "prompt", f"{len(msg.prompt)} characters", "max_prompt_chars", config.max_prompt_chars
        )
    if msg.input_ids is not None and len(msg.input_ids) >= max_context:
        # NOTE: before the ids are scanned one by one; text prompts are checked once tokenized.
        n = len(msg.input_ids)
        raise InvalidRequest("input_ids", f"{n} prompt tokens; the context holds {max_context}")
    chars = 0
    if msg.messages is not None:
        if len(msg.messages) > config.max_messages:
            n, limit = len(msg.messages), config.max_messages
            raise _limit("messages", f"{n} messages", "max_messages", limit)
        chars = _check_tree(msg.messages, "messages", config, chars)
    if msg.tools is not None:
        # NOTE: the template renders tools into the prompt: they count with the messages.
        chars = _check_tree(msg.tools, "tools", config, chars)
    depth, _ = shape(msg.params, "params")
    if depth > config.max_nesting_depth:
        limit = config.max_nesting_depth
        raise _limit("params", f"nesting depth {depth}", "max_nesting_depth", limit)
    return chars + len(msg.prompt or "")


def _check_tree(value: Any, field: str, config: EngineConfig, chars_before: int) -> int:
    """Nesting and characters of messages or tools; the characters so far plus theirs."""
    depth, chars = shape(value, field)
    if depth > config.max_nesting_depth:
        limit = config.max_nesting_depth
        raise _limit(field, f"nesting depth {depth}", "max_nesting_depth", limit)
    chars += chars_before
    if chars > config.max_prompt_chars:
        limit = config.max_prompt_chars
        raise _limit(field, f"{chars} characters", "max_prompt_chars", limit)
    return chars


def shape(value: Any, field: str) -> tuple[int, int]:
    """(nesting depth, characters of every string) of a decoded value, without recursion; a
    value with more than MAX_VALUES parts is refused before the walk takes long."""
    depth, chars, seen = 0, 0, 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise InvalidRequest(field, f"more than {MAX_VALUES} values; too large to take")
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            depth = max(depth, level)
            stack.extend((k, level + 1) for k in item)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            depth = max(depth, level)
            stack.extend((v, level + 1) for v in item)
    return depth, chars


def check_stop(params: SamplingParams, config: EngineConfig) -> None:
    limit = config.max_stop_strings
    for name in ("stop", "stop_token_ids"):
        n = len(getattr(params, name))
        if n > limit:
            raise _limit(name, f"{n} entries", "max_stop_strings", limit)
    longest = max((len(s) for s in params.stop), default=0)
    if longest > config.max_stop_chars:
        limit = config.max_stop_chars
        raise _limit("stop", f"a stop string of {longest} characters", "max_stop_chars", limit)


def peek_rid(frame: bytes) -> str:
    """The rid of a frame that will not be decoded (too large, too deep): a request's frame is a
    msgpack array [tag, rid, ...], read here header by header, so the caller waiting on that rid
    gets its error. "" when the frame does not start that way."""
    try:
        pos = _skip_array_header(frame, 0)
        _, pos = _read_str(frame, pos)
        rid, _ = _read_str(frame, pos)
        return rid
    except (IndexError, ValueError):
        return ""


def _skip_array_header(frame: bytes, pos: int) -> int:
    head = frame[pos]
    if 0x90 <= head <= 0x9F:
        return pos + 1
    if head in (0xDC, 0xDD):
        return pos + (3 if head == 0xDC else 5)
    raise ValueError("not an array")


def _read_str(frame: bytes, pos: int) -> tuple[str, int]:
    head = frame[pos]
    if 0xA0 <= head <= 0xBF:
        start, n = pos + 1, head - 0xA0
    elif head in (0xD9, 0xDA, 0xDB):
        width = {0xD9: 1, 0xDA: 2, 0xDB: 4}[head]
        start, n = pos + 1 + width, int.from_bytes(frame[pos + 1 : pos + 1 + width], "big")
    else:
        raise ValueError("not a string")
    if n > 256 or start + n > len(frame):
        raise ValueError("not a rid")
    return frame[start : start + n].decode("utf-8"), start + n
