"""A chat's shared head (`prepare.shared_prefix`) remembered per system prompt.

Where the scheduler asks for the head (models that hit only at slot snapshots), every chat would
render its leading system messages a second time: for an agent's 2,000-word system prompt that
costs as much as its whole prompt's template and tokenization again (tens of milliseconds of
the front door's CPU, per turn, per agent). Agents resend the same system prompt turn after
turn, so its head's length is kept, keyed by the messages, tools and template arguments.

A kept head is checked against each prompt (a digest of its first tokens): a template that
writes the date renders differently the next day, and then the head is rendered again.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from typing import Any

from tokenizer_proc import prepare

HEADS_KEPT = 1024  # NOTE: ~100 bytes each; a fleet has a handful of system prompts


class SharedHeads:
    """`prepare.shared_prefix` with its answers kept (thread-safe: prompts tokenize on a pool)."""

    def __init__(self, kept: int = HEADS_KEPT) -> None:
        self.kept = kept
        self._heads: dict[bytes, tuple[int, bytes]] = {}
        self._lock = threading.Lock()
        self.rendered = 0  # NOTE: heads rendered (not answered from what is kept), for tests

    def __call__(
        self,
        messages: list[dict[str, Any]],
        tokenizer: Any,
        tools: list[dict[str, Any]] | None,
        template: dict[str, Any],
        ids: list[int],
    ) -> int:
        lead = prepare.leading(messages)
        if lead == 0 or lead == len(messages):
            return 0
        key = _key(messages[:lead], tools, template, tokenizer)
        if key is not None:
            with self._lock:
                kept = self._heads.pop(key, None)
                if kept is not None:
                    self._heads[key] = kept  # NOTE: most recently used last
            if kept is not None and _holds(ids, *kept):
                return kept[0]
        self.rendered += 1
        n = prepare.shared_prefix(messages, tokenizer, tools, template, ids)
        if key is not None:
            with self._lock:
                self._heads[key] = (n, _digest(ids[:n]) if n else b"")
                while len(self._heads) > self.kept:
                    del self._heads[next(iter(self._heads))]
        return n


def _holds(ids: list[int], n: int, digest: bytes) -> bool:
    """Whether `ids` begins with the kept head (a head of 0: the template never writes these
    messages alone as it writes them in a chat, which does not change with the chat)."""
    return n == 0 or (n < len(ids) - 1 and _digest(ids[:n]) == digest)


def _digest(ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


def _key(
    lead: list[dict[str, Any]], tools: Any, template: dict[str, Any], tokenizer: Any
) -> bytes | None:
    """The messages, tools and template arguments' identity; None for values JSON cannot
    write in one order (mixed key types): such a chat's head is rendered each time."""
    try:
        text = json.dumps([lead, tools, template], sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return None
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16)
    h.update(id(tokenizer).to_bytes(8, "little"))
    return h.digest()
