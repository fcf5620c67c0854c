"""`n` choices and `best_of` candidates: one engine request each, merged into one response.

Every candidate is the same request with its own id and, when the client gave a seed, its own seed
(seed + i), so sampled choices differ and a seeded request stays reproducible. They share the
prompt's KV through the prefix cache: the first to prefill publishes it, the others wait for it
(`PrefixCache.should_wait`) and compute only their last prompt token. With `best_of` > n, the n
candidates with the highest mean logprob per token are kept, as OpenAI ranks them; usage counts
the prompt once and every candidate's tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from tokenizer_proc.requests import Entry

SEED_LIMIT = 2**63


def candidates(gen: tt.Generate, count: int) -> list[tt.Generate]:
    """`count` copies of `gen`, each its own request (`rid-i`, the seed + i when seeded)."""
    seed = gen.params.get("seed")
    out = []
    for i in range(count):
        params = dict(gen.params)
        if isinstance(seed, int) and not isinstance(seed, bool):
            params["seed"] = (seed + i) % SEED_LIMIT
        out.append(msgspec.structs.replace(gen, rid=f"{gen.rid}-{i}", params=params))
    return out


def best(scores: Sequence[tuple[float, int]], n: int) -> list[int]:
    """Indices of the `n` candidates with the highest mean logprob per token (sum, count), in
    their original order when they tie (a candidate without tokens ranks last)."""
    mean = [s / k if k else float("-inf") for s, k in scores]
    return sorted(range(len(scores)), key=lambda i: -mean[i])[:n]


def merge(wholes: list[dict[str, Any]], keep: list[int]) -> dict[str, Any]:
    """One response from whole per-candidate responses: the kept choices, re-indexed in order,
    and the usage of them all (the prompt once)."""
    choices = []
    for index, i in enumerate(keep):
        choice = wholes[i]["choices"][0]
        choice["index"] = index
        choices.append(choice)
    return {**wholes[0], "choices": choices, "usage": total_usage([w["usage"] for w in wholes])}


def total_usage(parts: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = parts[0]["prompt_tokens"]
    completion = sum(p["completion_tokens"] for p in parts)
    cached = max(p["prompt_tokens_details"]["cached_tokens"] for p in parts)
    reasoning = sum(p["completion_tokens_details"]["reasoning_tokens"] for p in parts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


async def interleaved(
    entries: list[Entry], ended: set[int]
) -> AsyncIterator[tuple[int, tc.Chunk | tc.Failure]]:
    """Every candidate's messages as they come, tagged with its index, until each not in
    `ended` has sent its last (a chunk with a finish reason, or a failure)."""
    merged: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def feed(i: int, entry: Entry) -> None:
        while True:
            msg = await entry.replies().get()
            await merged.put((i, msg))
            if isinstance(msg, tc.Failure) or msg.finish_reason is not None:
                return

    tasks = [asyncio.create_task(feed(i, e)) for i, e in enumerate(entries) if i not in ended]
    live = len(tasks)
    try:
        while live:
            i, msg = await merged.get()
            live -= isinstance(msg, tc.Failure) or msg.finish_reason is not None
            yield i, msg
    finally:
        for task in tasks:
            task.cancel()
