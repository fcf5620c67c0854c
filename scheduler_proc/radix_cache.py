"""Radix tree over token ids; each node owns the KV of its span as slot indices of a prefix store.

The tree knows nothing about MLX: it maps token prefixes to store slots, counts references of the
paths running requests use, and picks least recently used unreferenced leaves to evict. The caller
(`PrefixCache`) allocates and frees the slots themselves, and holds each running request's lock as
a `Hit`.

Invariants (checked by tests/test_radix_cache.py after every random step):
- every non-root node has a non-empty span with one slot per token, keyed in its parent by its
  first token;
- a node's reference count is the number of locks held on it or on any of its descendants, so a
  node in use by a running request is never a candidate for eviction;
- a slot is owned by exactly one node.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Protocol


class Node:
    __slots__ = ("tokens", "slots", "children", "parent", "ref", "last_used")

    def __init__(self, tokens: list[int], slots: list[int], parent: Node | None) -> None:
        self.tokens, self.slots = tokens, slots
        # NOTE: the root is its own parent, so every node has one; walks up stop at the root.
        self.parent: Node = parent if parent is not None else self
        self.children: dict[int, Node] = {}
        self.ref = 0
        self.last_used = 0

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Match:
    """The longest cached prefix: its length, store slots, and the node to lock it by."""

    length: int
    slots: list[int]
    node: Node


@dataclass(eq=False)
class Hit:
    """A request's locked cached prefix (a `Match` it holds a lock on until it is released)."""

    length: int
    slots: list[int]
    node: Node
    released: bool = False


class TreeObserver(Protocol):
    """Told of every change to the tree's token prefixes (KV events: kv_event_log.py)."""

    def inserted(self, leaf: Node, tokens: list[int]) -> None:
        """`leaf` was added at the end of the path `tokens` (the whole prefix, leaf included)."""

    def split(self, upper: Node, lower: Node) -> None:
        """A node was cut in two: `upper` (new) now holds its first tokens, `lower` the rest."""

    def removed(self, leaf: Node) -> None:
        """`leaf` was evicted."""

    def flushed(self) -> None:
        """A flush evicted every unlocked span (`PrefixCache.flush`)."""


class RadixCache:
    def __init__(self) -> None:
        self.root = Node([], [], None)
        self.root.ref = 1  # NOTE: the root is never evicted
        self.observer: TreeObserver | None = None  # NOTE: KV events, when on
        self.total_tokens = 0
        self.locked_tokens = 0
        self.evicted_tokens = 0
        self._clock = itertools.count(1)
        self._now = 0

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.locked_tokens

    # -- lookup ------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> Match:
        """Longest cached prefix of `tokens`; a node matched part way is split at the end."""
        node, i, slots = self.root, 0, []
        now = self._now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common(child.tokens, tokens, i)
            if k < len(child):
                child = self._split(child, k)
            child.last_used = now
            slots += child.slots
            node, i = child, i + k
        return Match(i, slots, node)

    def insert(self, tokens: list[int], slots: list[int]) -> int:
        """Cache `tokens` with their slots; returns how many leading tokens were already cached.

        The tree takes ownership of `slots[present:]`; `slots[:present]` stay the caller's.
        """
        assert len(tokens) == len(slots), "one slot per token"
        m = self.match_prefix(tokens)
        if m.length < len(tokens):
            leaf = Node(tokens[m.length :], slots[m.length :], m.node)
            leaf.last_used = self._now  # NOTE: same age as its path, so parents never age first
            m.node.children[tokens[m.length]] = leaf
            self.total_tokens += len(leaf)
            if self.observer is not None:
                self.observer.inserted(leaf, tokens)
        return m.length

    # -- references --------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """A running request uses the path root..node: none of it may be evicted."""
        while node is not self.root:
            if node.ref == 0:
                self.locked_tokens += len(node)
            node.ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.ref <= 0:
                raise RuntimeError("radix cache: unlock of a node that is not locked")
            node.ref -= 1
            if node.ref == 0:
                self.locked_tokens -= len(node)
            node = node.parent

    # -- eviction ----------------------------------------------------------------------------
    def evict(self, n_tokens: int) -> list[int]:
        """Free at least `n_tokens` slots if possible, least recently used leaves first."""
        heap = [(n.last_used, id(n), n) for n in self.nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += self._remove(leaf)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def _remove(self, leaf: Node) -> list[int]:
        del leaf.parent.children[leaf.tokens[0]]
        self.total_tokens -= len(leaf)
        self.evicted_tokens += len(leaf)
        if self.observer is not None:
            self.observer.removed(leaf)
        return leaf.slots

    def _split(self, child: Node, k: int) -> Node:
        """Cut `child` after `k` tokens; the new upper node keeps its references and age."""
        upper = Node(child.tokens[:k], child.slots[:k], child.parent)
        upper.ref, upper.last_used = child.ref, child.last_used
        upper.children[child.tokens[k]] = child
        child.parent.children[child.tokens[0]] = upper
        child.tokens, child.slots, child.parent = child.tokens[k:], child.slots[k:], upper
        if self.observer is not None:
            self.observer.split(upper, child)
        return upper

    def nodes(self):
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack += node.children.values()
            yield node


def _common(span: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix of `span` and `tokens[start:]`."""
    n = min(len(span), len(tokens) - start)
    if span[:n] == tokens[start : start + n]:
        return n
    k = 0
    while span[k] == tokens[start + k]:
        k += 1
    return k
