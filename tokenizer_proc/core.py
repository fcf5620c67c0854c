"""The front door's core, free of I/O: the welcome, admission, the request table, aborts with
ownership, the health rule, health generation's verdict, and stats.

The ZMQ endpoint and the HTTP API (tokenizer_proc.server, tokenizer_proc.http_api) and the
in-process engine (mlx_engine.inprocess) all drive this one object; they move bytes, it decides.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine import api_keys
from engine.config import EngineConfig
from engine.errors import (
    EngineDead,
    EngineError,
    InvalidRequest,
    Overloaded,
    Paused,
    ShuttingDown,
    Unauthorized,
)
from engine.messages import admin as ops
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import PROTOCOL_VERSION
from engine.sampling_params import SamplingParams
from engine.wire_errors import to_failure
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.requests import Entry, RequestTable

log = logging.getLogger("tokenizer")

HEALTHY_WITHIN_S = 5.0  # the scheduler loop must have ticked this recently
# NOTE: the last 1/16 of admission is kept for clients below their fair share, so one that
# floods never leaves a newcomer nothing (docs/operations.md, "Fair admission").
RESERVE_DIVISOR = 16
NO_KEY = "missing or wrong API key: pass api_key= to the client or set MLX_ENGINE_API_KEY"
NO_TOKEN = (
    "shutdown and stats are for the engine's owner: the SDK of the user who launched it reads "
    "its control token (engine/control_token.py); or launch with --api-key"
)


@dataclass(frozen=True)
class DoorSettings:
    """What the front door needs to know about the engine behind it."""

    model: str
    vocab_size: int
    max_context: int
    max_in_flight: int  # running + queued: beyond it, Overloaded
    api_key: str | None = None  # the owner's
    # NOTE: without an API key, what control messages must carry (engine/control_token.py);
    # None: no token asked (the in-process engine, whose caller owns it)
    control_token: str | None = None
    client_cap: int = 0  # most one client may hold (`--client-share`); 0: max_in_flight
    client_keys: Mapping[str, str] = field(default_factory=dict)  # key -> client name
    running_slots: int = 0  # most requests running at once (what a router is told)
    adapter: str | None = None  # the LoRA adapter applied at launch (its name)
    # NOTE: the scheduler's prefix cache hits only at slot snapshots: tell it where a chat's
    # shared part ends (`prepare.shared_prefix`)
    snapshot_hits: bool = False


def door_settings(
    config: EngineConfig,
    model: tuple[str, int, int, int],
    control_token: str | None = None,
    snapshot_hits: bool = False,
) -> DoorSettings:
    """The front door's limits from the config and what the scheduler reported: `model` is
    (name, vocabulary, context, running rows), the rows as --max-running-requests 0 left them
    to the KV budget."""
    name, vocab_size, max_context, slots = model
    capacity = slots + config.max_queued_requests
    keys = api_keys.load(config.api_keys_file) if config.api_keys_file else {}
    return DoorSettings(
        model=name,
        vocab_size=vocab_size,
        max_context=max_context,
        max_in_flight=capacity,
        running_slots=slots,
        # NOTE: named as the scheduler names it (scheduler_proc/admin.py): the directory's name
        adapter=Path(config.adapter_path).name if config.adapter_path else None,
        client_cap=max(1, int(capacity * config.client_share)),
        api_key=config.api_key,
        client_keys=keys,
        control_token=control_token,
        snapshot_hits=snapshot_hits,
    )


class FrontDoor:
    def __init__(self, limits: DoorSettings) -> None:
        self.settings = limits
        self.table = RequestTable()
        self.counters: Counter[str] = Counter()
        self.metrics = Metrics(limits.model, limits.adapter)
        self.draining = False
        self.dead = False
        self.last_tick = time.monotonic()
        self.paused: ops.PauseGeneration | None = None  # NOTE: the operator's, as last told
        self.changing_model = 0  # NOTE: weight or adapter changes in flight (the loop is busy)

    # --- keys and the welcome -------------------------------------------------------------------

    @property
    def keyed(self) -> bool:
        return bool(self.settings.api_key or self.settings.client_keys)

    def key_ok(self, key: str | None) -> bool:
        return not self.keyed or self.key_name(key) is not None

    def key_name(self, key: str | None) -> str | None:
        """The client a key names (`api_keys.OWNER` for --api-key), None for a wrong key."""
        if key is None:
            return None
        owner, found = self.settings.api_key, None
        if owner and _same(key, owner):
            found = api_keys.OWNER
        # NOTE: every key compared, in constant time, so no key can be guessed byte by byte
        # from response times.
        for candidate, name in self.settings.client_keys.items():
            if _same(key, candidate):
                found = name
        return found

    def client_of(self, key: str | None, connection: str) -> str:
        """The unit of fair admission: the key's client where there are client keys, else the
        connection (`sdk:ID` of an SDK socket, `peer:ADDRESS` of HTTP)."""
        name = self.key_name(key) if self.settings.client_keys else None
        return f"key:{name}" if name is not None else connection

    def check_key(self, key: str | None) -> None:
        if not self.key_ok(key):
            raise Unauthorized("missing or wrong API key (Authorization: Bearer KEY)")

    def allows(self, msg: tt.FromClient, welcomed: bool) -> bool:
        """With a key, a client is served once its Hello carried it (`welcomed`), and its
        control messages must carry it again; without one, control messages carry the owner's
        token. Hello and Ping are always answered."""
        if isinstance(msg, (tt.GetStats, tt.ShutdownEngine, ops.AdminRequest)):
            return self.control_ok(msg.api_key) and (welcomed or not self.settings.api_key)
        return not self.keyed or isinstance(msg, (tt.Hello, tt.Ping)) or welcomed

    def control_ok(self, key: str | None) -> bool:
        """The key of an engine with one, else the control token (when one is set)."""
        if self.settings.api_key:
            return key is not None and _same(key, self.settings.api_key)
        token = self.settings.control_token
        return not token or (key is not None and _same(key, token))

    def welcome(self, msg: tt.Hello) -> tc.Welcome | tc.Failure:
        if msg.version != PROTOCOL_VERSION:
            text = f"client speaks protocol v{msg.version}, this engine v{PROTOCOL_VERSION}"
            return tc.Failure(msg.rid, "protocol", text + "; use a matching mlx-engine client")
        if not self.key_ok(msg.api_key):
            return unauthorized(msg)
        return tc.Welcome(msg.rid, PROTOCOL_VERSION, self.settings.model, self.settings.max_context)

    # --- health ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """The scheduler loop is alive (its heartbeat arrived, or the in-process loop ran)."""
        self.last_tick = time.monotonic()

    def health(self) -> tuple[bool, str]:
        if self.dead or self.draining:
            return False, "engine dead" if self.dead else "shutting down"
        age = time.monotonic() - self.last_tick
        if age > HEALTHY_WITHIN_S and not self.changing_model:
            return False, f"scheduler loop silent for {age:.1f}s"
        if self.changing_model:
            return True, "changing the model (weights or adapter); new requests wait"
        if self.paused is not None:
            return True, paused_detail(self.paused)
        return True, ""

    # --- operations -----------------------------------------------------------------------------

    def operation_sent(self, op: ops.AdminOp) -> None:
        """An operation goes to the scheduler: a pause refuses new requests from now on (when
        asked to); a continue admits them again; a model change may keep the loop busy."""
        if isinstance(op, ops.PauseGeneration):
            self.paused = op
        elif isinstance(op, ops.ContinueGeneration):
            self.paused = None
        elif isinstance(op, ops.MODEL_CHANGES):
            self.changing_model += 1

    def operation_done(self, op: ops.AdminOp, info: Mapping[str, object] | None) -> None:
        """Its answer came (`info`; None: it failed or was lost): the pause is the scheduler's."""
        if isinstance(op, ops.MODEL_CHANGES):
            self.changing_model -= 1
        if info is None:
            return
        if "lora_adapter" in info:  # NOTE: every answer carries the scheduler's state
            adapter = info["lora_adapter"]
            self.metrics.adapter = adapter if isinstance(adapter, str) else None
        if not info.get("paused"):
            self.paused = None
        elif isinstance(op, ops.PauseGeneration):
            self.paused = op

    # --- admission ------------------------------------------------------------------------------

    def admit(
        self, msg: tt.Generate, entry: Entry, screen: Callable[[], None] | None = None
    ) -> SamplingParams:
        """The one admission of every request, health generations included (same counters).
        `screen` runs the endpoint's input limits (cheap, before any parsing), refusals counted
        alike. Adds it to the table; the caller tokenizes next and ends with `forwarded` or
        `fail`."""
        self.counters["requests_received"] += 1
        try:
            self._check_admission(msg.rid)
            self._check_share(entry.client)
            if screen is not None:
                screen()
            params = SamplingParams.parse(msg.params, self.settings.vocab_size)
        except EngineError:
            self.counters["requests_rejected"] += 1
            raise
        self.table.add(msg.rid, entry)
        return params

    def _check_admission(self, rid: str) -> None:
        if self.dead:
            raise EngineDead("an engine process died")
        if self.draining:
            raise ShuttingDown("the engine is shutting down")
        if self.paused is not None and self.paused.new_requests == "refuse":
            raise Paused("generation is paused by the operator; retry after it continues")
        if not isinstance(rid, str) or not rid or rid in self.table:
            raise InvalidRequest("rid", f"must be a unique non-empty id, got {rid!r}")
        if len(self.table) >= self.settings.max_in_flight:
            raise Overloaded(f"{len(self.table)} requests in flight; retry later")

    def _check_share(self, client: str | None) -> None:
        """No client holds more than `--client-share` of admission; and near full, none at or
        above its fair share (what is left split among the clients in flight, a newcomer
        counted) takes the reserve meant for those below it."""
        if client is None:
            return
        held, cap = self.table.count(client), self.settings.max_in_flight
        if held >= (self.settings.client_cap or cap):
            raise Overloaded(
                f"this client has {held} requests in flight, its share of admission "
                "(--client-share); retry later"
            )
        reserve = max(1, cap // RESERVE_DIVISOR)
        if len(self.table) < cap - reserve:
            return
        clients = self.table.clients() + (0 if held else 1)
        fair = max(1, (cap - reserve) // clients)
        if held >= fair:
            raise Overloaded(
                f"admission is nearly full ({len(self.table)} of {cap}) and this client holds "
                f"{held}, its fair share beside {clients - 1} other client(s); retry later"
            )

    def fail(self, rid: str, error: EngineError) -> tc.Failure:
        """An admitted request failed before it reached the scheduler (or was refused there)."""
        self.table.pop(rid)
        self.counters["requests_rejected"] += 1
        return to_failure(rid, error)

    def forwarded(self, rid: str, entry: Entry) -> bool:
        """Tokenized: True when it goes to the scheduler now, False when an abort came first
        (the request is then over; the caller sends it its terminal abort chunk)."""
        if entry.aborted:
            self.table.pop(rid)
            return False
        entry.sent = True
        return True

    # --- replies --------------------------------------------------------------------------------

    def on_chunk(self, chunk: tc.Chunk) -> Entry | None:
        """Bookkeeping of one chunk from the engine; its entry (None: unknown rid, drop it)."""
        entry = self.table.get(chunk.rid)
        if entry is None:
            return None
        now = time.monotonic()
        if chunk.token_ids:
            self._observe_tokens(entry, len(chunk.token_ids), now)
        if chunk.finish_reason is not None:
            self.table.pop(chunk.rid)
            self.counters["requests_answered"] += 1
            self.counters[f"finish_{chunk.finish_reason}"] += 1
            self.counters["prompt_tokens"] += chunk.prompt_tokens
            self.metrics.e2e.observe(now - entry.admitted_at)
            _log_finished(chunk, entry, now)
        return entry

    def _observe_tokens(self, entry: Entry, n: int, now: float) -> None:
        if entry.first_token_at is None:
            entry.first_token_at = now
            self.metrics.observe_tokens(n, None, now - entry.admitted_at)
        else:
            self.metrics.observe_tokens(n, now - (entry.last_token_at or now), None)
        entry.last_token_at = now

    def on_failed(self, rid: str) -> Entry | None:
        """The scheduler refused an admitted request; its entry, for the caller to answer."""
        entry = self.table.pop(rid)
        if entry is not None:
            self.counters["requests_rejected"] += 1
        return entry

    # --- aborts ---------------------------------------------------------------------------------

    def abort(self, rid: str, owner: Hashable | None) -> bool:
        """Abort `rid` for `owner`; True when the scheduler must be told. An unknown (finished)
        rid is a no-op; another client's request is refused, whatever rid is named."""
        entry = self.table.get(rid)
        if entry is None:
            return False
        if entry.owner != owner:
            raise InvalidRequest("rid", f"request {rid!r} belongs to another client")
        entry.aborted = True
        return entry.sent

    def owner_gone(self, owner: Hashable) -> list[str]:
        """A client went away: its requests are aborted; returns those to abort in the scheduler."""
        rids = self.table.of_owner(owner)
        if rids:
            log.info("client gone; aborting %d request(s): %s", len(rids), rids[:4])
        to_scheduler = []
        for rid in rids:
            entry = self.table.get(rid)
            if entry is not None:  # NOTE: always, rids come from the table
                entry.gone = True
            if self.abort(rid, owner):
                to_scheduler.append(rid)
        return to_scheduler

    def end_all(self, kind: str, reason: str = "") -> list[tuple[Entry, tc.Chunk | tc.Failure]]:
        """Every request still in the table with its terminal message (drained or engine dead)."""
        out: list[tuple[Entry, tc.Chunk | tc.Failure]] = []
        for rid in self.table.rids():
            entry = self.table.pop(rid)
            if entry is None:  # NOTE: never, rids come from the table
                continue
            if kind == "abort":
                final: tc.Chunk | tc.Failure = tc.Chunk(rid, finish_reason="abort")
            else:
                final = tc.Failure(rid, kind, f"an engine process died: {reason}")
            out.append((entry, final))
        return out

    # --- stats ----------------------------------------------------------------------------------

    def stats(self, scheduler: dict[str, float]) -> dict[str, float]:
        stats = {k: float(v) for k, v in scheduler.items()}
        stats.update({k: float(v) for k, v in self.counters.items()})
        stats["requests_in_flight"] = float(len(self.table))
        if "kv_tokens_in_use" in stats:
            stats["kv_tokens_total"] = stats["kv_tokens_in_use"] + stats.get("kv_tokens_free", 0)
        return stats


def paused_detail(pause: ops.PauseGeneration) -> str:
    queue = "queue" if pause.new_requests == "queue" else "are refused"
    return f"generation paused ({pause.mode}); new requests {queue}"


def peer_client(remote: str | None, forwarded_for: str, trusted: frozenset[str]) -> str:
    """An HTTP request's client where no key names one: its peer address, or behind a trusted
    proxy the last address of X-Forwarded-For that is not a trusted proxy (the one the first
    trusted proxy saw; addresses before it are the client's own word)."""
    peer = remote or "unknown"
    if peer in trusted and forwarded_for:
        for hop in reversed([h.strip() for h in forwarded_for.split(",")]):
            if hop and hop not in trusted:
                return f"peer:{hop[:64]}"
    return f"peer:{peer}"


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def unauthorized(msg: tt.FromClient, keyed: bool = True) -> tc.Failure:
    """The answer to a client message refused for want of the key (`keyed`: the engine has one),
    or, without one, of the owner's control token."""
    return tc.Failure(getattr(msg, "rid", ""), "unauthorized", NO_KEY if keyed else NO_TOKEN)


class HealthProbe:
    """One health generation: a real one-token request through the whole engine, judged by one
    rule (a token arrived, finish stop or length) within one deadline."""

    def __init__(self) -> None:
        self.rid = f"health-{uuid.uuid4().hex}"
        self.deadline = time.monotonic() + tt.HEALTH_GENERATE_TIMEOUT_S
        self.tokens = 0

    def request(self) -> tt.Generate:
        return tt.Generate(self.rid, input_ids=[0], params={"max_tokens": 1, "temperature": 0.0})

    def feed(self, msg: tc.ToClient) -> tuple[bool, str] | None:
        """The verdict once `msg` ends the request, else None."""
        if isinstance(msg, tc.Failure):
            return False, f"{msg.kind}: {msg.message}"
        if not isinstance(msg, tc.Chunk):
            return None
        self.tokens += len(msg.token_ids)
        if msg.finish_reason is None:
            return None
        ok = msg.finish_reason in ("stop", "length") and self.tokens > 0
        return ok, "" if ok else f"finish_reason={msg.finish_reason}, {self.tokens} tokens"

    def expired(self) -> tuple[bool, str] | None:
        if time.monotonic() < self.deadline:
            return None
        return False, f"no token within {tt.HEALTH_GENERATE_TIMEOUT_S}s"


def _log_finished(chunk: tc.Chunk, entry: Entry, now: float) -> None:
    first = entry.first_token_at or now
    log.info(
        "rid=%s finish=%s prompt=%d completion=%d ttft=%.1fms total=%.1fms",
        chunk.rid,
        chunk.finish_reason,
        chunk.prompt_tokens,
        chunk.completion_tokens,
        (first - entry.admitted_at) * 1e3,
        (now - entry.admitted_at) * 1e3,
    )
