"""KV events from the prefix cache: the radix tree's inserts and evictions as whole-page blocks.

A block is a whole KV page along a cached path: it is cached while the tree holds every token up
to its end. The log watches the tree (`TreeObserver`): an insert stores the pages whose end its new
leaf reaches, an eviction removes the pages whose end lay in the evicted leaf, a flush that
leaves the tree empty clears everything. Each node keeps the hashes of the pages ending in its
span (`_Span`), so neither an eviction nor the page before an insert is hashed twice, and a split
only cuts an array in two. Hashing is O(new tokens), like the insert itself.

Events wait until `publish()` (once a loop iteration, after the step is queued) hands them to the
sink (`KVEventPublisher.put`), which encodes and sends them. A batch the sink could not send is
made good by the next one: a clear, then every cached block (`_resync`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence

from engine.kv_events import Cleared, Event, Removed, Stored, chain_hashes
from scheduler_proc.radix_cache import Node, RadixCache

# NOTE: takes a batch's sequence number and events; False when it had to drop them.
Sink = Callable[[int, list[Event]], bool]


# NOTE: a node's first token's position in its path, and the hashes of the pages ending in it,
# as int64s (8 bytes a hash in an array; a list holds a 32-byte int object and a pointer each).
_Span = tuple[int, array]


def _span(start: int, hashes: Sequence[int]) -> _Span:
    return start, array("q", hashes)


class KVEventLog:
    def __init__(self, tree: RadixCache, page_size: int, sink: Sink) -> None:
        self.tree, self.page_size, self.sink = tree, page_size, sink
        self._spans: dict[Node, _Span] = {}
        self._pending: list[Event] = []
        self.seq = -1  # the last batch's sequence number
        self.dropped = 0  # batches the sink dropped
        # NOTE: a subscriber starts from nothing: the first batch clears (or resyncs), so a
        # restarted engine's subscribers drop what the one before held.
        self._lost = True
        for node, start, _, hashes, _ in walk(tree, page_size):
            self._spans[node] = _span(start, hashes)
        tree.observer = self

    # -- the tree's changes ------------------------------------------------------------------
    def inserted(self, leaf: Node, tokens: list[int]) -> None:
        p = self.page_size
        start = len(tokens) - len(leaf)
        first, end = start // p, len(tokens) // p  # NOTE: pages first..end-1 end in the leaf
        if end <= first:
            self._spans[leaf] = _span(start, ())
            return
        parent = self._hash_of(leaf.parent, first - 1)
        pages = tokens[first * p : end * p]
        hashes = chain_hashes(parent, pages, p)
        self._spans[leaf] = _span(start, hashes)
        self._pending.append(Stored(hashes, parent, pages))

    def split(self, upper: Node, lower: Node) -> None:
        (start, hashes), p = self._spans[lower], self.page_size
        cut = start + len(upper)
        n = cut // p - start // p
        self._spans[upper] = (start, hashes[:n])
        self._spans[lower] = (cut, hashes[n:])

    def removed(self, leaf: Node) -> None:
        hashes = self._spans.pop(leaf)[1]
        if not hashes:
            return
        last = self._pending[-1] if self._pending else None
        if isinstance(last, Removed):  # NOTE: one eviction pass is one event
            last.hashes.extend(hashes)
        else:
            self._pending.append(Removed(hashes.tolist()))

    def flushed(self) -> None:
        """A flush ran: when it left nothing cached, one clear says all its removals."""
        if self.tree.total_tokens == 0:
            self._pending = [Cleared()]

    def _hash_of(self, node: Node, k: int) -> int | None:
        """The hash of page `k` of the path through `node`, which reaches its end (None: k < 0)."""
        if k < 0:
            return None
        end = (k + 1) * self.page_size
        while self._spans[node][0] >= end:
            node = node.parent
        start, hashes = self._spans[node]
        return hashes[k - start // self.page_size]

    # -- publishing ----------------------------------------------------------------------------
    def publish(self) -> None:
        """Hand what happened since the last call to the sink (nothing when nothing did)."""
        if self._lost:
            events = [Cleared(), *self._resync()]
        elif self._pending:
            events = self._pending
        else:
            return
        self._pending = []
        self.seq += 1
        self._lost = not self.sink(self.seq, events)
        self.dropped += self._lost

    def _resync(self) -> list[Event]:
        """Every cached block, parents first."""
        return [
            Stored(h, parent, pages)
            for _, _, parent, h, pages in walk(self.tree, self.page_size)
            if h
        ]


def walk(
    tree: RadixCache, page_size: int
) -> Iterator[tuple[Node, int, int | None, list[int], list[int]]]:
    """Every node, parents first, computed from its path's tokens alone: (node, its start, the
    hash of the page before its first, the hashes of the pages ending in it, their tokens)."""
    p = page_size
    # NOTE: with each node, the tokens of its path since the last page boundary before it
    stack: list[tuple[Node, int, list[int], int | None]] = [
        (child, 0, [], None) for child in tree.root.children.values()
    ]
    while stack:
        node, start, tail, parent = stack.pop()
        seq = tail + node.tokens
        whole = len(seq) // p * p
        hashes = chain_hashes(parent, seq[:whole], p)
        yield node, start, parent, hashes, seq[:whole]
        last = hashes[-1] if hashes else parent
        for child in node.children.values():
            stack.append((child, start + len(node), seq[whole:], last))


def cached_hashes(tree: RadixCache, page_size: int) -> list[int]:
    """The hashes of every whole page the tree holds, sorted (computed afresh, not from a log)."""
    return sorted(h for _, _, _, hashes, _ in walk(tree, page_size) for h in hashes)
