"""Wire basics shared by every socket: the message base class, the protocol version, the codec,
and `error_field` (which field a msgspec validation error is about).

Every frame on every socket is one `Message` subclass from a module in `engine.messages`, encoded
with msgpack. Subclasses are tagged by class name, so each socket decodes one tagged union with a
typed decoder: an unknown tag or a malformed frame is a `msgspec.ValidationError`, never pickle.
"""

from __future__ import annotations

import re
from typing import Any, Generic, TypeVar

import msgspec

# NOTE: bump on any incompatible change of a client-facing message; the tokenizer process refuses
# a client whose Hello carries another version, with a clear error instead of garbled replies.
PROTOCOL_VERSION = 1

T = TypeVar("T")


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every wire message: positional arrays, defaults omitted, tagged by class name."""


class Codec(Generic[T]):
    """One encoder plus one typed decoder for one socket's union type."""

    def __init__(self, union: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, frame: bytes | memoryview) -> T:
        """Decode one frame; raises `msgspec.DecodeError` / `ValidationError` on a bad frame."""
        return self._decoder.decode(frame)


_PATH = re.compile(r"at `\$(?:\[(\d+)\]|\.(\w+))")
_UNKNOWN = re.compile(r"unknown field `(\w+)`")


def error_field(message: str, default: str, fields: tuple[str, ...] = ()) -> str:
    """The field a msgspec validation error is about: `$.name`, `$[i]` of an array-like struct
    with `fields` (index 0 is the tag), or an unknown field's name."""
    if m := _UNKNOWN.search(message):
        return m.group(1)
    m = _PATH.search(message)
    if m is None:
        return default
    if m.group(2):
        return m.group(2)
    index = int(m.group(1))
    if index == 0:
        return "type"
    return fields[index - 1] if index - 1 < len(fields) else default
