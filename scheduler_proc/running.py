"""Which requests run (each holds a slot): prefilling ones, then decoding ones.

A slot is a request's place in the per-request buffers (window rings, recurrent state); its
full-attention KV lives in pages (`Req.pages`), so nothing moves when requests come and go: a
decode step's rows are the decoding requests in order, whatever their slots.
"""

from __future__ import annotations

from scheduler_proc.request import Req


class RunningTable:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._decode: list[Req] = []
        self._prefill: list[Req] = []

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

    def newest(self) -> Req:
        """The request admitted last: the first to give its pages back when decode runs out."""
        return max(self.reqs, key=lambda r: r.admitted)
