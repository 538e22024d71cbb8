"""Provisioning of a run's JetStream streams, KV buckets and consumers (DESIGN §3, "Provisioning").

Who does what:

* the **syncer** calls `provision_run` at start: it creates what is missing and checks what exists
  (idempotent). An existing stream, bucket or consumer whose configuration differs on a field that
  changes behaviour raises `ProvisionConflict` and is never modified: silently "fixing" a live run's
  stream (say, shrinking PUSH's `max_bytes` or turning BCAST's one-message-per-subject off) would
  change what islands see mid-run. Every conflict is found before anything is created, so a
  conflicting start leaves the server exactly as it found it.
* an **island** calls `check_run` (waits, polling, until every stream and bucket exists; never creates
  one) and then `ensure_island_consumers` for its own two durable consumers on CTL (pulls, and
  messages to it), replacing those of its previous generation.
* `remove_run` backs `yeto run rm R`.

Consumers are **durable pull consumers**, all of them (the island's cut reader, an ordered consumer, is
the one exception, see `bcast_consumer_config`). Why pull: the reader decides when and how much to
fetch, so a batch's bytes stay bounded (NATS-NOTES trap 4: a batch larger than the server's
per-connection buffer gets the client cut off as a slow consumer — keep `fetch` batches ≲ 32 MiB), a
slow syncer or an island busy in a training step never has bytes pushed into its process, and a
durable survives a restart of its reader (it resumes at its ack floor). `syncer-push` is
**headers-only**: the syncer records each chunk's stream sequence from its header and acks at once,
and the merge reads the payloads later by sequence with direct get (PUSH has `allow_direct`), so
the payload never crosses the wire twice.

The configs are pure functions (`stream_configs`, `kv_configs`, `syncer_consumer_configs`,
`island_consumer_config`, `bcast_consumer_config`, `config_conflicts`); the async functions are thin
shells around them.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import nats.errors
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from . import subjects as S
from .errors import WireError
from .ids import check_gen, check_island
from .ids import check_run as _check_run_id

log_ = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
HOUR = 3600.0
DAY = 24 * HOUR

# nats-py names a KV bucket's stream KV_<bucket> (nats/js/client.py KV_STREAM_TEMPLATE).
KV_STREAM_PREFIX = "KV_"

# Ack waits: how long a delivered, unacked message waits before redelivery. The syncer acks CTL and
# PUSH messages as soon as it has recorded them; an INIT chunk is acked after it is copied into the
# syncer's parameter buffer, which can take longer for a large chunk on a busy host.
SYNCER_CTL_ACK_WAIT_S = 30.0
SYNCER_INIT_ACK_WAIT_S = 60.0
SYNCER_PUSH_ACK_WAIT_S = 30.0
ISLAND_ACK_WAIT_S = 30.0
# An island's consumer nobody fetches from for this long is removed by the server (an island that
# never comes back). Long enough that an island in a slow step or a network outage keeps its place; a
# restarted island replaces its consumers at once (ensure_island_consumers).
ISLAND_INACTIVE_S = DAY

# JetStream error codes used here.
ERR_STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"


# ---- errors --------------------------------------------------------------------------------------

class ProvisionError(RuntimeError):
    """Provisioning failed for a reason other than bad input (the server refused, timed out, ...)."""


class ProvisionConflict(ProvisionError):
    """An existing stream / bucket / consumer differs from what this run wants; it was left unchanged.

    `conflicts` lists every (what, field, existing, wanted); `what`, `stream`, `field`, `existing`,
    `wanted` are those of the first, for callers that only care about one.
    """

    def __init__(self, run: str, conflicts: list[tuple[str, str, str, Any, Any]]):
        # each conflict: (what, stream, field, existing, wanted)
        self.run = run
        self.conflicts = conflicts
        self.what, self.stream, self.field, self.existing, self.wanted = conflicts[0]
        lines = [f"{w}: {f} is {e!r} on the server, this run wants {n!r}" for w, _s, f, e, n in conflicts]
        super().__init__(
            f"run {run}: existing JetStream objects conflict with this run's configuration and were NOT "
            f"changed: " + "; ".join(lines)
            + f". Start with matching settings, or remove the run with `yeto run rm {run}`."
        )


class RunNotProvisioned(ProvisionError):
    """`check_run` timed out: the named streams / buckets still do not exist."""

    def __init__(self, run: str, missing: list[str], waited_s: float):
        self.run = run
        self.missing = list(missing)
        self.waited_s = waited_s
        super().__init__(
            f"run {run} is not provisioned after {waited_s:.1f}s: missing {', '.join(missing)} "
            f"(the syncer creates them at start: is `yeto syncer --run {run}` running against this NATS?)"
        )


# ---- limits --------------------------------------------------------------------------------------

def push_max_bytes_for(pipeline: int, members: int, fragment_bytes: int, slack: float = 1.5) -> int:
    """PUSH `max_bytes` for `pipeline` rounds in flight × `members` pushes × `fragment_bytes` each.

    DESIGN §4: pushes wait in PUSH until their round commits. `slack` covers re-sends (`try`),
    restarted attempts whose chunks are not yet deleted, and message headers.
    """
    for name, v in (("pipeline", pipeline), ("members", members), ("fragment_bytes", fragment_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise WireError("must be a positive integer", field=name, value=v, code="bad_limit")
    if not (isinstance(slack, (int, float)) and slack >= 1.0):
        raise WireError("must be a number >= 1", field="slack", value=slack, code="bad_limit")
    return int(math.ceil(pipeline * members * fragment_bytes * slack))


@dataclass(frozen=True)
class RunLimits:
    """Sizes and ages of a run's streams. Defaults suit a real run; tests use `RunLimits.small()`.

    `-1` means "no limit" for byte sizes, `0` for ages (JetStream's own conventions).
    Note: the server *reserves* every stream's `max_bytes` against its `max_file_store` (the shipped
    config allows 200 GB), so runs that are never removed eat the reservation even while empty.
    """

    duplicate_window_s: float = 120.0
    ctl_max_age_s: float = 7 * DAY
    # DESIGN §4: pipeline × members × fragment bytes; see push_max_bytes_for. A bound is mandatory:
    # it is the backpressure signal (10077) that keeps islands from filling the broker's disk.
    push_max_bytes: int = 8 * GiB
    push_max_age_s: float = DAY  # safety net: the syncer deletes pushes after each commit
    steplog_max_age_s: float = 7 * DAY
    steplog_max_bytes: int = 1 * GiB
    events_max_age_s: float = 90 * DAY
    events_max_bytes: int = -1
    storage: str = "file"  # "memory" for tests only: the shipped config caps memory at 1 GB
    replicas: int = 1  # 3 on a NATS cluster (DESIGN §8)
    max_msg_size: int = -1  # -1: the server's max_payload governs
    members_history: int = 1  # heartbeats rewrite members' keys every few seconds: keep the newest only
    state_history: int = 5  # a few revisions of the session / versions record help a post-mortem

    def __post_init__(self):
        def bad(name, why):
            raise WireError(why, field=name, value=getattr(self, name), code="bad_limit")

        for name in ("duplicate_window_s", "ctl_max_age_s", "push_max_age_s", "steplog_max_age_s", "events_max_age_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or math.isnan(v):
                bad(name, "must be a number of seconds >= 0 (0: no limit)")
        if self.duplicate_window_s <= 0:
            bad("duplicate_window_s", "must be > 0: every publish relies on Nats-Msg-Id dedup")
        for name in ("push_max_bytes", "steplog_max_bytes", "events_max_bytes", "max_msg_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or (v <= 0 and v != -1):
                bad(name, "must be a positive number of bytes or -1 (no limit)")
        if self.push_max_bytes == -1:
            bad("push_max_bytes", "must be bounded: PUSH's max_bytes + discard new is the backpressure signal")
        # The server refuses a duplicate window longer than a stream's max age.
        for name in ("ctl_max_age_s", "push_max_age_s", "steplog_max_age_s", "events_max_age_s"):
            age = getattr(self, name)
            if 0 < age < self.duplicate_window_s:
                bad(name, f"must be 0 or >= duplicate_window_s ({self.duplicate_window_s}s)")
        if self.storage not in ("file", "memory"):
            bad("storage", "must be 'file' or 'memory'")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or not 1 <= self.replicas <= 5:
            bad("replicas", "must be an integer in 1..5")
        for name in ("members_history", "state_history"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64:
                bad(name, "must be an integer in 1..64 (the KV history limit)")

    @classmethod
    def small(cls, **overrides) -> "RunLimits":
        """Small byte limits for tests and demos, so a test session's server is not exhausted by
        reservations (see the class note)."""
        kw: dict[str, Any] = dict(push_max_bytes=64 * MiB, steplog_max_bytes=8 * MiB, events_max_bytes=8 * MiB)
        kw.update(overrides)
        return cls(**kw)

    @property
    def storage_type(self) -> api.StorageType:
        return api.StorageType(self.storage)


# ---- pure configs --------------------------------------------------------------------------------

def stream_configs(run: str, limits: RunLimits = RunLimits()) -> dict[str, api.StreamConfig]:
    """The wanted StreamConfig of every stream of `run`, by kind (DESIGN §3 streams table)."""
    _check_run_id(run)
    L = limits
    LIM, WQ = api.RetentionPolicy.LIMITS, api.RetentionPolicy.WORK_QUEUE
    OLD, NEW = api.DiscardPolicy.OLD, api.DiscardPolicy.NEW

    def cfg(kind: str, description: str, **kw) -> api.StreamConfig:
        base = dict(
            name=S.stream(run, kind),
            description=f"yeto run {run}: {description}",
            subjects=S.stream_subjects(run, kind),
            retention=LIM,
            storage=L.storage_type,
            num_replicas=L.replicas,
            discard=OLD,
            max_msgs=-1,
            max_bytes=-1,
            max_age=0.0,
            max_msgs_per_subject=-1,
            max_msg_size=L.max_msg_size,
            duplicate_window=float(L.duplicate_window_s),
            allow_direct=False,
            metadata={"yeto_run": run, "yeto_stream": kind},
        )
        base.update(kw)
        return api.StreamConfig(**base)

    return {
        "CTL": cfg("CTL", "control (hello, heartbeat, pull, to-island, ack)", max_age=float(L.ctl_max_age_s)),
        # Limits + max_bytes + discard NEW: a full PUSH refuses publishes (10077) instead of dropping
        # older pushes that a round still needs; the syncer deletes chunks after each commit.
        "PUSH": cfg(
            "PUSH", "push chunks (island -> syncer)",
            max_bytes=L.push_max_bytes, discard=NEW, allow_direct=True, max_age=float(L.push_max_age_s),
        ),
        # Work queue: the syncer's ack removes an INIT chunk once it holds it.
        "INIT": cfg("INIT", "initial weights from the INIT island", retention=WQ),
        # One message per chunk subject: the stream *is* the current cut; a reader may see chunks of
        # versions v and v+1 side by side (DESIGN §3, broadcast assembly).
        "BCAST": cfg("BCAST", "current cut, one message per chunk", max_msgs_per_subject=1, allow_direct=True),
        "FINAL": cfg("FINAL", "authoritative f32 final cut", max_msgs_per_subject=1, allow_direct=True),
        # Limits, never interest retention: interest drops events while no dashboard listens.
        "STEPLOG": cfg(
            "STEPLOG", "per-step island events",
            max_age=float(L.steplog_max_age_s), max_bytes=L.steplog_max_bytes,
        ),
        "EVENTS": cfg(
            "EVENTS", "the syncer's tape", max_age=float(L.events_max_age_s), max_bytes=L.events_max_bytes,
        ),
    }


def kv_configs(run: str, limits: RunLimits = RunLimits()) -> dict[str, api.KeyValueConfig]:
    """The wanted KeyValueConfig of each bucket, by kind. No TTL anywhere (NATS-NOTES trap 6: per-key
    TTL leases misbehave in nats-py 2.16; liveness is judged from heartbeat times in the values)."""
    _check_run_id(run)
    hist = {"members": limits.members_history, "state": limits.state_history}
    what = {"members": "island -> generation, layout, last step, last heartbeat", "state": "session, versions, global step"}
    return {
        kind: api.KeyValueConfig(
            bucket=S.kv_bucket(run, kind),
            description=f"yeto run {run}: {what[kind]}",
            history=hist[kind],
            storage=limits.storage_type,
            replicas=limits.replicas,
        )
        for kind in S.KV_KINDS
    }


def kv_stream_name(bucket: str) -> str:
    return KV_STREAM_PREFIX + bucket


def syncer_consumer_configs(run: str, *, push_headers_only: bool = True) -> dict[str, tuple[str, api.ConsumerConfig]]:
    """The syncer's durable pull consumers: name -> (stream kind, config). DESIGN §3 consumer table."""
    _check_run_id(run)

    def durable(name: str, description: str, **kw) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            name=name,
            durable_name=name,
            description=f"yeto run {run}: {description}",
            deliver_policy=api.DeliverPolicy.ALL,
            ack_policy=api.AckPolicy.EXPLICIT,
            max_deliver=-1,
            **kw,
        )

    return {
        S.SYNCER_CTL_CONSUMER: ("CTL", durable(
            S.SYNCER_CTL_CONSUMER, "syncer reads hello, heartbeat, ack",
            filter_subjects=S.syncer_ctl_filters(run), ack_wait=SYNCER_CTL_ACK_WAIT_S,
        )),
        S.SYNCER_INIT_CONSUMER: ("INIT", durable(
            S.SYNCER_INIT_CONSUMER, "syncer reads initial weights", ack_wait=SYNCER_INIT_ACK_WAIT_S,
        )),
        S.SYNCER_PUSH_CONSUMER: ("PUSH", durable(
            S.SYNCER_PUSH_CONSUMER, "syncer records push chunks by sequence",
            filter_subject=S.push_all(run), ack_wait=SYNCER_PUSH_ACK_WAIT_S, headers_only=push_headers_only,
        )),
    }


def island_consumer_config(
    run: str, island: str, gen: str, kind: str, start_seq: int | None = None,
    *, ack_wait_s: float = ISLAND_ACK_WAIT_S, inactive_s: float = ISLAND_INACTIVE_S,
) -> api.ConsumerConfig:
    """Island I's durable pull consumer `kind` on CTL, owned by generation `gen`: "pull" (named
    `pull-I`, filter `ctl.pull`) or "to" (named `isl-I`, filter `ctl.to.I`). See subjects.py for why
    the names are fixed and each has one filter subject.

    Delivers from stream sequence `start_seq` when given (the island's hello: nothing stored before
    it can be meant for this generation), else everything the stream still holds. The owning
    generation is in the metadata (`S.ISLAND_GEN_KEY`).
    """
    name = S.island_consumer(island, kind)
    check_gen(gen)
    kw: dict[str, Any] = {}
    if start_seq is not None:
        if isinstance(start_seq, bool) or not isinstance(start_seq, int) or start_seq <= 0:
            raise WireError("must be a positive stream sequence", field="start_seq", value=start_seq, code="bad_limit")
        kw["deliver_policy"] = api.DeliverPolicy.BY_START_SEQUENCE
        kw["opt_start_seq"] = start_seq
    else:
        kw["deliver_policy"] = api.DeliverPolicy.ALL
    return api.ConsumerConfig(
        name=name,
        durable_name=name,
        description=f"yeto run {run}: island {island} gen {gen} " + ("pulls" if kind == "pull" else "messages to it"),
        ack_policy=api.AckPolicy.EXPLICIT,
        filter_subject=S.island_consumer_filter(run, island, kind),
        ack_wait=float(ack_wait_s),
        max_deliver=-1,
        inactive_threshold=float(inactive_s),
        metadata={S.ISLAND_GEN_KEY: gen},
        **kw,
    )


def _cut_config(filter_subject: str, headers_only: bool) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=filter_subject,
        headers_only=headers_only,
    )


def bcast_consumer_config(run: str, fragment: int | None = None, *, headers_only: bool = True) -> api.ConsumerConfig:
    """The island cut reader's consumer config on BCAST: the newest message of every chunk subject,
    then new ones. Use it as an ordered consumer:

        cfg = bcast_consumer_config(run)
        sub = await js.subscribe(cfg.filter_subject, stream=stream(run, "BCAST"), ordered_consumer=True, config=cfg)

    `headers_only` (default): the inbox holds notices (chunk headers, stream sequence), not bytes;
    rank 0 fetches the payloads by sequence at the boundary (DESIGN §3, island-side buffering).
    """
    subj = S.bcast_all(run) if fragment is None else S.bcast_fragment(run, fragment)
    return _cut_config(subj, headers_only)


def final_consumer_config(run: str, fragment: int | None = None, *, headers_only: bool = True) -> api.ConsumerConfig:
    """As `bcast_consumer_config`, on FINAL (the f32 final cut)."""
    subj = S.final_all(run) if fragment is None else S.final_fragment(run, fragment)
    return _cut_config(subj, headers_only)


# ---- pure comparison -----------------------------------------------------------------------------

# Stream fields that change behaviour; anything else (description, metadata the server adds, ...) is
# informational and may differ.
STREAM_FIELDS = (
    "subjects", "retention", "storage", "num_replicas", "discard", "max_msgs", "max_bytes", "max_age",
    "max_msgs_per_subject", "max_msg_size", "duplicate_window", "allow_direct",
)
# KV bucket fields, as fields of the bucket's stream (KV name -> stream field).
KV_FIELDS = {"history": "max_msgs_per_subject", "storage": "storage", "replicas": "num_replicas",
             "ttl": "max_age", "max_bytes": "max_bytes"}
# Consumer fields that change what is delivered and how. Tuning fields (ack_wait, max_ack_pending,
# inactive_threshold) and the start time of an existing consumer (it already has a position) are not
# compared.
CONSUMER_FIELDS = ("filter", "ack_policy", "deliver_policy", "headers_only")


def _enum(v):
    return None if v is None else str(getattr(v, "value", v))


def _norm(field_: str, v: Any) -> Any:
    """Normalize a config value the way the server does, so read-back equals what was sent."""
    if field_ in ("subjects", "filter"):
        return sorted(v or [])
    if field_ in ("retention", "storage", "discard", "ack_policy", "deliver_policy"):
        return _enum(v)
    if field_ in ("max_msgs", "max_bytes", "max_msg_size", "max_msgs_per_subject"):
        return -1 if v is None or v <= 0 else int(v)
    if field_ in ("max_age", "duplicate_window"):
        return round(float(v or 0.0), 6)  # seconds; the wire carries integer nanoseconds
    if field_ in ("allow_direct", "headers_only"):
        return bool(v)
    if field_ == "num_replicas":
        return int(v or 1)
    return v


def _consumer_filter(c: api.ConsumerConfig) -> list[str]:
    # The server may turn a one-element filter_subjects into filter_subject; "" / ">" mean "all".
    subs = list(c.filter_subjects or [])
    if c.filter_subject and c.filter_subject != ">":
        subs.append(c.filter_subject)
    return subs


def config_conflicts(existing: Any, wanted: Any, kind: str = "stream") -> list[tuple[str, Any, Any]]:
    """[(field, existing, wanted)] for every behaviour-changing field that differs. Pure.

    kind: "stream" (StreamConfig vs StreamConfig), "kv" (the bucket's StreamConfig vs KeyValueConfig),
    "consumer" (ConsumerConfig vs ConsumerConfig).
    """
    out = []
    if kind == "stream":
        for f in STREAM_FIELDS:
            e, w = _norm(f, getattr(existing, f)), _norm(f, getattr(wanted, f))
            if e != w:
                out.append((f, e, w))
    elif kind == "kv":
        for kvf, sf in KV_FIELDS.items():
            w_raw = getattr(wanted, kvf)
            if sf == "storage" and w_raw is None:
                w_raw = api.StorageType.FILE
            e, w = _norm(sf, getattr(existing, sf)), _norm(sf, w_raw)
            if e != w:
                out.append((kvf, e, w))
    elif kind == "consumer":
        for f in CONSUMER_FIELDS:
            if f == "filter":
                e, w = _norm(f, _consumer_filter(existing)), _norm(f, _consumer_filter(wanted))
            else:
                e, w = _norm(f, getattr(existing, f)), _norm(f, getattr(wanted, f))
            if e != w:
                out.append((f, e, w))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return out


# ---- report --------------------------------------------------------------------------------------

@dataclass
class ProvisionReport:
    """What a provisioning call found: names like 'stream YETO_R_CTL', 'kv yeto_R_state',
    'consumer YETO_R_CTL/syncer-ctl'."""

    run: str
    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.created)

    def __str__(self) -> str:
        parts = []
        if self.created:
            parts.append("created " + ", ".join(self.created))
        if self.existing:
            parts.append("found " + ", ".join(self.existing))
        return f"run {self.run}: " + ("; ".join(parts) or "nothing")


# ---- I/O shells ----------------------------------------------------------------------------------

async def _stream_info(js, name: str) -> api.StreamInfo | None:
    try:
        return await js.stream_info(name)
    except NotFoundError:
        return None


async def _consumer_info(js, stream: str, name: str) -> api.ConsumerInfo | None:
    try:
        return await js.consumer_info(stream, name)
    except NotFoundError:
        return None


def _server_refused(what: str, exc: Exception) -> ProvisionError:
    return ProvisionError(f"creating {what} failed: {exc}")


async def _ensure_consumers(js, run: str, wanted: list[tuple[str, api.ConsumerConfig]], report: ProvisionReport) -> None:
    """Check every consumer first (on streams that exist), raise on any conflict, then create."""
    conflicts, to_create = [], []
    for stream_name, cfg in wanted:
        what = f"consumer {stream_name}/{cfg.durable_name}"
        info = await _consumer_info(js, stream_name, cfg.durable_name)
        if info is None:
            to_create.append((stream_name, cfg, what))
            continue
        for f, e, w in config_conflicts(info.config, cfg, "consumer"):
            conflicts.append((what, stream_name, f, e, w))
        report.existing.append(what)
    if conflicts:
        raise ProvisionConflict(run, conflicts)
    for stream_name, cfg, what in to_create:
        try:
            await js.add_consumer(stream_name, config=cfg)
        except APIError as exc:
            raise _server_refused(what, exc) from exc
        report.created.append(what)


async def provision_run(
    js, run: str, limits: RunLimits = RunLimits(), *, push_headers_only: bool = True,
    log: Callable[[str], None] | None = None,
) -> ProvisionReport:
    """The syncer-side call: create what is missing, check what exists (DESIGN §3 Provisioning).

    Raises ProvisionConflict (nothing created, nothing changed) if any existing stream, bucket or
    syncer consumer differs from the wanted configuration on a field that matters.
    """
    _check_run_id(run)
    log = log or log_.info
    report = ProvisionReport(run)
    streams = stream_configs(run, limits)
    kvs = kv_configs(run, limits)
    consumers = syncer_consumer_configs(run, push_headers_only=push_headers_only)

    # Phase 1: read everything, collect conflicts; nothing is created before all checks pass.
    conflicts: list = []
    missing_streams: list[api.StreamConfig] = []
    for cfg in streams.values():
        info = await _stream_info(js, cfg.name)
        if info is None:
            missing_streams.append(cfg)
            continue
        conflicts += [(f"stream {cfg.name}", cfg.name, f, e, w) for f, e, w in config_conflicts(info.config, cfg, "stream")]
        report.existing.append(f"stream {cfg.name}")
    missing_kvs: list[api.KeyValueConfig] = []
    for kcfg in kvs.values():
        sname = kv_stream_name(kcfg.bucket)
        info = await _stream_info(js, sname)
        if info is None:
            missing_kvs.append(kcfg)
            continue
        conflicts += [(f"kv {kcfg.bucket}", sname, f, e, w) for f, e, w in config_conflicts(info.config, kcfg, "kv")]
        report.existing.append(f"kv {kcfg.bucket}")
    missing_names = {c.name for c in missing_streams}
    wanted_consumers = [(S.stream(run, kind), cfg) for kind, cfg in consumers.values()]
    for stream_name, cfg in wanted_consumers:
        if stream_name in missing_names:
            continue
        info = await _consumer_info(js, stream_name, cfg.durable_name)
        if info is not None:
            conflicts += [(f"consumer {stream_name}/{cfg.durable_name}", stream_name, f, e, w)
                          for f, e, w in config_conflicts(info.config, cfg, "consumer")]
    if conflicts:
        raise ProvisionConflict(run, conflicts)

    # Phase 2: create what is missing. A concurrent creator with the same config makes add_stream a
    # no-op; one with another config makes it fail with 10058, which is re-read as a conflict.
    for cfg in missing_streams:
        try:
            await js.add_stream(cfg)
        except APIError as exc:
            if exc.err_code == ERR_STREAM_NAME_IN_USE:
                info = await _stream_info(js, cfg.name)
                if info is not None:
                    c = config_conflicts(info.config, cfg, "stream")
                    if c:
                        raise ProvisionConflict(run, [(f"stream {cfg.name}", cfg.name, f, e, w) for f, e, w in c]) from exc
                    report.existing.append(f"stream {cfg.name}")
                    continue
            raise _server_refused(f"stream {cfg.name}", exc) from exc
        report.created.append(f"stream {cfg.name}")
    for kcfg in missing_kvs:
        try:
            await js.create_key_value(kcfg)
        except APIError as exc:
            raise _server_refused(f"kv {kcfg.bucket}", exc) from exc
        report.created.append(f"kv {kcfg.bucket}")
    await _ensure_consumers(js, run, wanted_consumers, report)
    log(str(report))
    return report


def _wanted_names(run: str) -> list[tuple[str, str]]:
    """(label, stream name) of every stream and KV bucket stream of a run."""
    out = [(f"stream {S.stream(run, k)}", S.stream(run, k)) for k in S.STREAM_KINDS]
    out += [(f"kv {S.kv_bucket(run, k)}", kv_stream_name(S.kv_bucket(run, k))) for k in S.KV_KINDS]
    return out


async def missing_pieces(js, run: str) -> list[str]:
    """Labels of the run's streams and buckets that do not exist (yet)."""
    missing = []
    for label, name in _wanted_names(_check_run_id(run)):
        if await _stream_info(js, name) is None:
            missing.append(label)
    return missing


async def check_run(
    js, run: str, timeout_s: float | None = None, log: Callable[[str], None] | None = None,
    *, poll_s: float = 0.5, log_every_s: float = 30.0,
) -> None:
    """Island side: wait until every stream and KV bucket of `run` exists; never creates one.

    Logs one line when it starts waiting (and every `log_every_s`, or when the missing set changes);
    raises RunNotProvisioned naming what is still missing after `timeout_s` (None: wait forever).
    A request that gets no answer (broker restarting, reconnect) counts as "not yet" and is retried.
    """
    _check_run_id(run)
    log = log or log_.info
    t0 = time.monotonic()
    last_logged: tuple[float, tuple[str, ...]] | None = None
    while True:
        try:
            missing = await missing_pieces(js, run)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError) as exc:
            missing = [f"(no answer from JetStream: {type(exc).__name__})"]
        waited = time.monotonic() - t0
        if not missing:
            if last_logged is not None:
                log(f"run {run}: provisioned after {waited:.1f}s")
            return
        if timeout_s is not None and waited >= timeout_s:
            raise RunNotProvisioned(run, missing, waited)
        key = tuple(missing)
        if last_logged is None or last_logged[1] != key or time.monotonic() - last_logged[0] >= log_every_s:
            log(f"run {run}: waiting for the syncer to provision {', '.join(missing)} "
                f"(waited {waited:.0f}s{'' if timeout_s is None else f' of {timeout_s:.0f}s'})")
            last_logged = (time.monotonic(), key)
        sleep = poll_s if timeout_s is None else max(0.0, min(poll_s, timeout_s - waited))
        await asyncio.sleep(sleep)


class ConsumerTaken(ProvisionError):
    """Another generation of the island owns the consumer (this process was superseded)."""

    def __init__(self, name: str, owner: str | None):
        self.name, self.owner = name, owner
        super().__init__(f"consumer {name} belongs to generation {owner} of this island")


def consumer_owner(info: api.ConsumerInfo | None) -> str | None:
    """The generation that owns an island consumer (its metadata), None when absent or unmarked."""
    if info is None:
        return None
    return (info.config.metadata or {}).get(S.ISLAND_GEN_KEY)


async def island_consumer_owner(js, run: str, island: str, kind: str) -> tuple[bool, str | None]:
    """(exists, owning generation) of island I's consumer `kind`. Raises on no answer."""
    info = await _consumer_info(js, S.stream(run, "CTL"), S.island_consumer(island, kind))
    return info is not None, consumer_owner(info)


# Tries of one consumer's (delete,) create: another process of the island may be doing the same.
ISLAND_CONSUMER_TRIES = 5


async def ensure_island_consumer(
    js, run: str, island: str, gen: str, kind: str, start_seq: int | None = None, *, replace: bool = True,
    ack_wait_s: float = ISLAND_ACK_WAIT_S, inactive_s: float = ISLAND_INACTIVE_S,
    report: ProvisionReport | None = None,
) -> ProvisionReport:
    """Make island I's consumer `kind` one of generation `gen` (see island_consumer_config).

    Kept as it is when `gen` owns it already (its position too). Owned by another generation (an
    earlier process of the island): deleted and created anew when `replace` (a new process takes
    over), else ConsumerTaken (this process was superseded and must not take it back). A concurrent
    creator is retried a few times. Bind to it with
    `js.pull_subscribe_bind(S.island_consumer(I, kind), stream=stream(run, "CTL"))`.
    """
    _check_run_id(run)
    cfg = island_consumer_config(run, island, gen, kind, start_seq, ack_wait_s=ack_wait_s, inactive_s=inactive_s)
    report = report or ProvisionReport(run)
    ctl = S.stream(run, "CTL")
    what = f"consumer {ctl}/{cfg.name}"
    last: Exception | None = None
    for _ in range(ISLAND_CONSUMER_TRIES):
        info = await _consumer_info(js, ctl, cfg.name)
        if info is not None:
            owner = consumer_owner(info)
            if owner == gen:
                conflicts = [(what, ctl, f, e, w) for f, e, w in config_conflicts(info.config, cfg, "consumer")
                             if f != "deliver_policy"]  # its start is where it was created; it kept its place
                if conflicts:
                    raise ProvisionConflict(run, conflicts)
                report.existing.append(what)
                return report
            if not replace:
                raise ConsumerTaken(cfg.name, owner)
            try:
                await js.delete_consumer(ctl, cfg.name)
            except NotFoundError:
                pass
        try:
            await js.add_consumer(ctl, config=cfg)
        except APIError as exc:  # created meanwhile by another process: look again
            last = exc
            continue
        report.created.append(what)
        return report
    raise _server_refused(what, last) if last is not None else ProvisionError(f"creating {what} failed")


async def ensure_island_consumers(
    js, run: str, island: str, gen: str, start_seq: int | None = None,
    *, ack_wait_s: float = ISLAND_ACK_WAIT_S, inactive_s: float = ISLAND_INACTIVE_S,
) -> ProvisionReport:
    """Both of island I's consumers on CTL (`pull-I` and `isl-I`) for generation `gen`, replacing
    an earlier generation's (see ensure_island_consumer)."""
    _check_run_id(run)
    check_island(island)
    ctl = S.stream(run, "CTL")
    if await _stream_info(js, ctl) is None:
        raise RunNotProvisioned(run, [f"stream {ctl}"], 0.0)
    report = ProvisionReport(run)
    for kind in S.ISLAND_CONSUMER_KINDS:
        await ensure_island_consumer(js, run, island, gen, kind, start_seq, ack_wait_s=ack_wait_s,
                                     inactive_s=inactive_s, report=report)
    return report


async def remove_island_consumers(js, run: str, island: str, gen: str) -> list[str]:
    """Delete island I's consumers that generation `gen` owns (never a later generation's); return
    their names."""
    ctl = S.stream(run, "CTL")
    gone = []
    for kind in S.ISLAND_CONSUMER_KINDS:
        name = S.island_consumer(island, kind)
        if consumer_owner(await _consumer_info(js, ctl, name)) != gen:
            continue
        try:
            await js.delete_consumer(ctl, name)
            gone.append(name)
        except NotFoundError:
            pass
    return gone


async def remove_run(js, run: str) -> list[str]:
    """Delete every stream and KV bucket of `run` that exists; return their names (`yeto run rm`)."""
    _check_run_id(run)
    removed = []
    for kind in S.STREAM_KINDS:
        name = S.stream(run, kind)
        try:
            await js.delete_stream(name)
            removed.append(name)
        except NotFoundError:
            pass
    for kind in S.KV_KINDS:
        bucket = S.kv_bucket(run, kind)
        try:
            await js.delete_key_value(bucket)
            removed.append(bucket)
        except NotFoundError:
            pass
    return removed


async def kv(js, run: str, kind: str):
    """The KeyValue handle of bucket `kind` ('members' or 'state') of `run`; raises
    nats.js.errors.BucketNotFoundError if the run is not provisioned."""
    return await js.key_value(S.kv_bucket(run, kind))


# KV writes go through JetStream publishes to `$KV.<bucket>.<key>` (the KV protocol nats-py's
# KeyValue.put uses). On a cluster, a node's death leaves the buckets it led without a leader for the
# few seconds of an election: a bare put fails at once with "no responders" (503) and would stop the
# writer. Retried with one Nats-Msg-Id per logical write, a put that did land before its ack was lost
# is stored once.
KV_PUT_ATTEMPTS = 40  # with publish_retry's backoff (<= 2 s): about a minute, beyond any election


async def kv_put(js, run: str, kind: str, key: str, value: bytes, *, counters=None, attempts: int = KV_PUT_ATTEMPTS):
    """Put `value` under `key` in the run's KV bucket `kind`, riding through reconnects and leader
    elections (see above). Returns the PubAck (its `seq` is the entry's revision)."""
    import uuid

    from .publish import publish_retry

    if kind not in S.KV_KINDS:
        raise WireError(f"must be one of {', '.join(S.KV_KINDS)}", field="kind", value=kind, code="bad_kv")
    subject = f"$KV.{S.kv_bucket(_check_run_id(run), kind)}.{key}"
    return await publish_retry(js, subject, value, f"kv.{kind}.{key}.{uuid.uuid4().hex}",
                               counters=counters, attempts=attempts)



# ---- datacenter mirrors of the cut (issue 13) ----------------------------------------------------
#
# An island datacenter runs a NATS leaf node with a JetStream domain of its own (services/leaf.py).
# There the run keeps a mirror of BCAST and FINAL, under the same stream names, so the datacenter's
# islands read the cut from it: each chunk crosses the WAN link once (the mirror's one copy), however
# many islands read it. Pushes, control and the KV buckets stay on the hub (domain `hub_domain`).
#
# Who creates a mirror: the island, in its own domain, at start (`ensure_cut_mirrors`, idempotent,
# conflicts reported as for the syncer's streams). Why there and not by the syncer: the leaf's
# JetStream is reachable from inside the datacenter even while the WAN link is down, a datacenter
# joins a run by starting its leaf and islands (the syncer need not list the domains in advance), and
# the syncer never waits at start for a datacenter whose link is down.

CUT_KINDS = ("BCAST", "FINAL")
# Fields compared on an existing mirror (the origin's subjects, duplicate window and ages do not apply).
MIRROR_FIELDS = ("retention", "storage", "num_replicas", "max_msgs_per_subject", "allow_direct")


def hub_api_prefix(hub_domain: str) -> str:
    return f"$JS.{hub_domain}.API"


def mirror_configs(run: str, hub_domain: str, *, replicas: int = 1) -> dict[str, api.StreamConfig]:
    """The wanted config of the datacenter's mirror of each cut stream (by kind), in the datacenter's
    own domain: same name as the hub's stream, sourced through the hub's API prefix."""
    _check_run_id(run)
    out = {}
    for kind in CUT_KINDS:
        name = S.stream(run, kind)
        out[kind] = api.StreamConfig(
            name=name,
            description=f"yeto run {run}: mirror of {name} in domain {hub_domain}",
            mirror=api.StreamSource(name=name, external=api.ExternalStream(api=hub_api_prefix(hub_domain))),
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,  # a leaf restart keeps the cut: islands re-read it locally
            num_replicas=replicas,
            discard=api.DiscardPolicy.OLD,
            # As the origin: one message per chunk subject, the mirror *is* the cut; direct gets.
            max_msgs_per_subject=1,
            allow_direct=True,
            metadata={"yeto_run": run, "yeto_stream": kind, "yeto_mirror_of": hub_domain},
        )
    return out


def _mirror_source(c: api.StreamConfig) -> tuple:
    m = c.mirror
    return (None, None) if m is None else (m.name, m.external.api if m.external else None)


async def ensure_cut_mirrors(js, run: str, hub_domain: str, *, replicas: int = 1,
                             log: Callable[[str], None] | None = None) -> ProvisionReport:
    """Create the datacenter's mirrors of BCAST and FINAL through `js` (a JetStream context of the
    datacenter's domain) where missing; check existing ones. A stream of that name that is not the
    same mirror raises ProvisionConflict and is left unchanged."""
    log = log or log_.info
    report = ProvisionReport(run)
    wanted = mirror_configs(run, hub_domain, replicas=replicas)
    conflicts, missing = [], []
    for cfg in wanted.values():
        info = await _stream_info(js, cfg.name)
        if info is None:
            missing.append(cfg)
            continue
        what = f"mirror {cfg.name}"
        if _mirror_source(info.config) != _mirror_source(cfg):
            conflicts.append((what, cfg.name, "mirror", _mirror_source(info.config), _mirror_source(cfg)))
        conflicts += [(what, cfg.name, f, _norm(f, getattr(info.config, f)), _norm(f, getattr(cfg, f)))
                      for f in MIRROR_FIELDS if _norm(f, getattr(info.config, f)) != _norm(f, getattr(cfg, f))]
        report.existing.append(what)
    if conflicts:
        raise ProvisionConflict(run, conflicts)
    for cfg in missing:
        try:
            await js.add_stream(cfg)
        except APIError as exc:
            if exc.err_code == ERR_STREAM_NAME_IN_USE:  # another island of the datacenter was first
                report.existing.append(f"mirror {cfg.name}")
                continue
            raise _server_refused(f"mirror {cfg.name}", exc) from exc
        report.created.append(f"mirror {cfg.name}")
    if report.created:
        log(str(report))
    return report
