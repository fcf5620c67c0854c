"""KV pages: a free list with reference counts (no MLX here).

A page holds `page_size` consecutive tokens of one request's KV in every full-attention layer.
References come from two owners: each request whose page table lists the page (one each), and
the prefix cache's radix tree (one per cached token in the page). A page goes back to the free
list when its count reaches zero, so a page shared by a running request and the cache is never
freed under either; a decref below zero raises, so a double free cannot hide.

The free list hands out the lowest free page first: a request's pages tend to be ascending runs
(a lone row reads them as a slice), and the pool's tail stays free, so an idle pool can shrink
back (`shrink`, `highest_in_use`).
"""

from __future__ import annotations

import heapq


class PageAllocator:
    """Pages `1..size` (page 0 is the pool's scratch page, never handed out)."""

    def __init__(self, pages: int, page_size: int) -> None:
        self.size, self.page_size = 0, page_size
        self._free: list[int] = []  # NOTE: a min-heap
        self._refs = [0]
        self._cached = [0]  # NOTE: of a page's references, the prefix cache's tokens
        self.cache_only = 0  # pages only the prefix cache holds: what eviction could free
        self.add(pages)

    def add(self, n: int) -> None:
        """`n` new free pages (the pool grew)."""
        first = self.size + 1
        self.size += n
        self._refs += [0] * n
        self._cached += [0] * n
        # NOTE: each above every page already on the heap: appended, it stays a heap.
        self._free += range(first, self.size + 1)

    def shrink(self, size: int) -> None:
        """Pages above `size` leave (the pool shrank); every one of them must be free."""
        if size < self.highest_in_use():
            raise RuntimeError(f"KV pages: page {self.highest_in_use()} in use, above {size}")
        self._free = [p for p in self._free if p <= size]
        heapq.heapify(self._free)
        del self._refs[size + 1 :], self._cached[size + 1 :]
        self.size = size

    def highest_in_use(self) -> int:
        """The highest page with a reference (0: none)."""
        return next((p for p in range(self.size, 0, -1) if self._refs[p]), 0)

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.size - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        """`n` free pages, each with one reference (the caller's)."""
        if n > len(self._free):
            raise RuntimeError(f"KV pages: {n} wanted, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, page: int, n: int = 1, cached: bool = False) -> None:
        """`n` references more; `cached`: the prefix cache's (one per cached token)."""
        if self._refs[page] <= 0:
            raise RuntimeError(f"KV pages: reference to free page {page}")
        self._count(page, n, cached)

    def decref(self, page: int, n: int = 1, cached: bool = False) -> None:
        if self._refs[page] - n < 0 or (cached and self._cached[page] - n < 0):
            raise RuntimeError(f"KV pages: page {page} released more often than referenced")
        self._count(page, -n, cached)
        if self._refs[page] == 0:
            heapq.heappush(self._free, page)

    def _count(self, page: int, n: int, cached: bool) -> None:
        before = self._only_cached(page)
        self._refs[page] += n
        if cached:
            self._cached[page] += n
        self.cache_only += self._only_cached(page) - before

    def _only_cached(self, page: int) -> bool:
        return 0 < self._refs[page] == self._cached[page]

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page (a request's table)."""
        for p in pages:
            self.decref(p)

    def refs(self, page: int) -> int:
        return self._refs[page]
