"""Wire basics shared by every socket: the message base class, the protocol version, the codec.

Every frame on every socket is one `Message` subclass from a module in `engine.messages`, encoded
with msgpack. Subclasses are tagged by class name, so each socket decodes one tagged union with a
typed decoder: an unknown tag or a malformed frame is a `msgspec.ValidationError`, never pickle.
"""

from __future__ import annotations

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
