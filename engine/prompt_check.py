"""The rules a prompt must meet before the scheduler takes it: one definition for the front door
(which names the field the client used) and for the scheduler's in-process callers."""

from __future__ import annotations

from engine.errors import InvalidRequest


def check_prompt(ids: list[int], vocab_size: int, max_context: int, field: str) -> list[int]:
    """The prompt's token ids are the model's and fit the context with a token to spare."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise InvalidRequest(field, f"ids out of range [0, {vocab_size}): {bad[:8]}")
    if not ids:
        raise InvalidRequest(field, "the prompt has no tokens")
    if len(ids) >= max_context:
        raise InvalidRequest(
            field,
            f"{len(ids)} prompt tokens; the context holds {max_context} (prompt and output; "
            "the model's limit or --context-length)",
        )
    return ids
