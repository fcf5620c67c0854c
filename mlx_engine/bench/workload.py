"""Deterministic benchmark workloads: the same seed gives the same requests on every server.

A workload is a list of sessions; a session is one or more turns sent one after another, each
turn's prompt holding the earlier turns and the server's own replies (the shared-prefix multi-turn
chat). Random and JSONL workloads are sessions of one turn.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NOTE: short common English words, each one token in the usual BPE vocabularies, so a prompt of
# N words is about N tokens on any model; servers report the exact count in `usage`.
WORDS = tuple(
    """the of and to in is was for on are with as at be by this from or have an they which one you
    were her all she there would their we him been has when who will more no if out so said what up
    its about into than them can only other new some could time these two may then do first any my
    now such like our over man me even most made after also did many before must through back years
    where much your way well down should because each just those people how too little state good
    very make world still own see men work long get here between both life being under never day
    same another know while last might us great old year off come since against go came right used
    take three states himself few house use during without again place around however home small
    found thought went say part once general high upon school every does got united left number
    course war until always away something fact though water less public put think almost hand
    enough far took head yet government system better set told nothing night end why called didn
    eyes find going look asked later knew point next city give group toward young let room side""".split()
)


@dataclass(frozen=True)
class Session:
    """One user's conversation: `turns` user messages, each answered before the next is sent."""

    turns: tuple[str, ...]
    max_tokens: int
    system: str = ""
    chat: bool = True  # False: a plain completion (`/v1/completions`, one turn)


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def parse_range(text: str) -> tuple[int, int]:
    """ "64" -> (64, 64); "32:128" -> (32, 128), both ends included."""
    lo, _, hi = str(text).partition(":")
    low, high = int(lo), int(hi or lo)
    if not 0 < low <= high:
        raise ValueError(f"bad length range {text!r}: want N or LOW:HIGH with 0 < LOW <= HIGH")
    return low, high


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_workload(
    num: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0
) -> Workload:
    """`num` plain completions with prompt and output lengths drawn uniformly from the ranges."""
    rng = random.Random(seed)
    sessions = tuple(
        Session(
            turns=(f"{i}: " + _words(rng, rng.randint(*input_len)),),
            max_tokens=rng.randint(*output_len),
            chat=False,
        )
        for i in range(num)
    )
    return Workload(f"random in {input_len} out {output_len} seed {seed}", sessions)


def jsonl_workload(path: Path, num: int, output_len: tuple[int, int], seed: int = 0) -> Workload:
    """Lines of {"prompt": str} or {"messages": [...]} (optional "max_tokens"); a seeded sample.

    A "messages" line keeps its system message and sends its user messages as turns.
    """
    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    if not lines:
        raise ValueError(f"{path}: no requests")
    rng = random.Random(seed)
    picked = [lines[i % len(lines)] for i in range(num)] if num > len(lines) else lines[:]
    rng.shuffle(picked)
    sessions = tuple(_session(x, rng.randint(*output_len)) for x in picked[:num])
    return Workload(f"jsonl {Path(path).name} seed {seed}", sessions)


def _session(line: dict[str, Any], max_tokens: int) -> Session:
    max_tokens = int(line.get("max_tokens", max_tokens))
    if "prompt" in line:
        return Session((str(line["prompt"]),), max_tokens, chat=False)
    msgs = line.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"a JSONL line needs 'prompt' or 'messages': {line!r}")
    system = "".join(m["content"] for m in msgs if m.get("role") == "system")
    turns = tuple(m["content"] for m in msgs if m.get("role") == "user")
    return Session(turns, max_tokens, system=system)


def multiturn_workload(
    users: int,
    turns: int,
    system_len: int,
    user_len: tuple[int, int],
    output_len: int,
    seed: int = 0,
) -> Workload:
    """`users` chats sharing one long system prompt, `turns` user messages each, every message's
    length drawn from `user_len` (an agent's tool results vary turn by turn)."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + _words(rng, system_len)
    sessions = tuple(
        Session(
            tuple(_words(rng, rng.randint(*user_len)) for _ in range(turns)),
            output_len,
            system=system,
        )
        for _ in range(users)
    )
    return Workload(
        f"multi-turn {users} users x {turns} turns, system {system_len} words seed {seed}",
        sessions,
    )
