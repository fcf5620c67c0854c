"""One launched step: prefill chunks and/or a decode of rows `[0, B)`, with its lazy outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_proc.request import Req
from scheduler_proc.sampling import Sampled, SamplerState


@dataclass(eq=False)
class Chunk:
    """Prompt tokens `[start, end)` of one request; the last chunk samples its first token."""

    req: Req
    start: int
    end: int
    out: Sampled | None = None
    joined: bool = False  # the last token runs as a row of the batch's decode forward

    @property
    def last(self) -> bool:
        return self.end == self.req.prompt_len


@dataclass(eq=False)
class Batch:
    """Decode rows are `decode + joined`: rows `[0, D)` decoding, then the requests whose last
    prompt token rides in the same forward (rows `D..`, the first prefilling rows)."""

    decode: list[Req]
    chunks: list[Chunk] = field(default_factory=list)
    joined: list[Req] = field(default_factory=list)
    sampler: SamplerState | None = None
    chained: bool = False
    step_index: int = -1  # stamped by prepare_launch
    launch_ts: float | None = None  # stamped by prepare_launch, before graph building
    decode_out: Sampled | None = None

    @property
    def rows(self) -> list[Req]:
        return self.decode + self.joined

    @property
    def pure_decode(self) -> bool:
        return bool(self.decode) and not self.chunks

    def reqs(self) -> list[Req]:
        return self.decode + [c.req for c in self.chunks]
