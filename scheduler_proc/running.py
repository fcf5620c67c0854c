"""Which requests run (each holds a slot): prefilling ones, then decoding ones.

A slot is a request's place in the per-request buffers (window rings, recurrent state); its
full-attention KV lives in pages (`Req.pages`), so nothing moves when requests come and go: a
decode step's rows are the decoding requests in order, whatever their slots.
"""

from __future__ import annotations

from collections import Counter

from scheduler_proc.request import Req


class RunningTable:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._decode: list[Req] = []
        self._prefill: list[Req] = []
        self._rows: Counter[str] = Counter()  # client -> running rows (scheduler_proc/waiting.py)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def reqs(self) -> list[Req]:
        return self._decode + self._prefill

    @property
    def n_decode(self) -> int:
        return len(self._decode)

    def decoding(self) -> list[Req]:
        return list(self._decode)

    def prefilling(self) -> list[Req]:
        return list(self._prefill)

    def tokens_in_use(self) -> int:
        return sum(r.kv_len for r in self.reqs)

    def add(self, req: Req) -> None:
        assert req.slot is None, f"{req.rid}: admitted twice"
        req.slot = self._free.pop()
        self._prefill.append(req)
        self._rows[req.client] += 1

    def promote(self, req: Req) -> None:
        """A prefilling request starts decoding: it joins the decode rows, last."""
        self._prefill.remove(req)
        self._decode.append(req)

    def release(self, req: Req) -> None:
        """Give the request's slot back exactly once."""
        slot = req.slot
        assert slot is not None, f"{req.rid}: slot released twice"
        (self._decode if req in self._decode else self._prefill).remove(req)
        self._free.append(slot)
        req.slot = None
        self._rows[req.client] -= 1
        if not self._rows[req.client]:
            del self._rows[req.client]

    def rows_of(self, client: str) -> int:
        return self._rows.get(client, 0)

    def clients(self) -> list[str]:
        """Clients with running rows, in the order they first took one (deterministic)."""
        return list(self._rows)

    def newest(self, client: str | None = None) -> Req:
        """The request admitted last (of `client`): the first to give its pages back."""
        reqs = [r for r in self.reqs if client is None or r.client == client]
        return max(reqs, key=lambda r: r.seated)

    def heaviest(self) -> str:
        """The client holding the most rows (the first to take its rows, at a tie)."""
        return max(self._rows, key=self._rows.__getitem__)
