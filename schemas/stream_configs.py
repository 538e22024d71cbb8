"""The wanted configuration of a run's JetStream objects — streams, KV buckets, consumers, datacenter
mirrors of the cut — and the comparison of an existing object with it. Pure functions, no I/O: the
shells in schemas.provision and schemas.island_consumers create and check what these describe (see
schemas.provision for who calls what, and why every consumer is a durable pull consumer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nats.js import api

from . import shards as SH, subjects as S
from .errors import ConfigError, WireError
from .ids import check_gen
from .ids import check_run as _check_run_id

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


# ---- limits --------------------------------------------------------------------------------------

def push_max_bytes_for(pipeline: int, members: int, fragment_bytes: int, slack: float = 1.5) -> int:
    """PUSH `max_bytes` for `pipeline` rounds in flight × `members` pushes × `fragment_bytes` each.

    docs/design.md §4.6: pushes wait in PUSH until their round commits. `slack` covers re-sends (`try`),
    restarted attempts whose chunks are not yet deleted, and message headers.
    """
    for name, v in (("pipeline", pipeline), ("members", members), ("fragment_bytes", fragment_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError("must be a positive integer", field=name, value=v, code="bad_limit")
    if not (isinstance(slack, (int, float)) and slack >= 1.0):
        raise ConfigError("must be a number >= 1", field="slack", value=slack, code="bad_limit")
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
    # docs/design.md §3.1: pipeline × members × fragment bytes; see push_max_bytes_for. A bound is mandatory:
    # it is the backpressure signal (10077) that keeps islands from filling the broker's disk.
    push_max_bytes: int = 8 * GiB
    push_max_age_s: float = DAY  # safety net: the syncer deletes pushes after each commit
    steplog_max_age_s: float = 7 * DAY
    steplog_max_bytes: int = 1 * GiB
    events_max_age_s: float = 90 * DAY
    events_max_bytes: int = -1
    storage: str = "file"  # "memory" for tests only: the shipped config caps memory at 1 GB
    replicas: int = 1  # 3 on a NATS cluster (docs/design.md §7)
    max_msg_size: int = -1  # -1: the server's max_payload governs
    members_history: int = 1  # heartbeats rewrite members' keys every few seconds: keep the newest only
    state_history: int = 5  # a few revisions of the session / versions record help a post-mortem

    def __post_init__(self):
        def bad(name, why):
            raise ConfigError(why, field=name, value=getattr(self, name), code="bad_limit")

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
    """The wanted StreamConfig of every stream of `run`, by kind (docs/design.md §3.1)."""
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
        "CTL": cfg("CTL", "control (hello, pull, to-island)", max_age=float(L.ctl_max_age_s)),
        # The newest heartbeat and final ack per island and nothing else: the syncer needs only the latest,
        # and a flood on one island's subject replaces itself instead of queueing in front of the others'.
        "HB": cfg("HB", "heartbeats and final acks, the newest per island", max_msgs_per_subject=1,
                  max_age=float(L.ctl_max_age_s)),
        # Limits + max_bytes + discard NEW: a full PUSH refuses publishes (10077) instead of dropping
        # older pushes that a round still needs; the syncer deletes chunks after each commit.
        "PUSH": cfg(
            "PUSH", "push chunks (island -> syncer)",
            max_bytes=L.push_max_bytes, discard=NEW, allow_direct=True, max_age=float(L.push_max_age_s),
        ),
        # Work queue: the syncer's ack removes an INIT chunk once it holds it.
        "INIT": cfg("INIT", "initial weights from the INIT island", retention=WQ),
        # One message per chunk subject: the stream *is* the current cut; a reader may see chunks of
        # versions v and v+1 side by side (docs/design.md §3.6).
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
    """The wanted KeyValueConfig of each bucket, by kind. No TTL anywhere (docs/design.md §15.6: per-key
    TTL leases misbehave in nats-py 2.16; liveness is judged from heartbeat times in the values)."""
    _check_run_id(run)
    hist = {"members": limits.members_history, "state": limits.state_history, "ckpt": 1}
    what = {"members": "island -> generation, layout, last step, last heartbeat", "state": "session, versions, global step",
            "ckpt": "the syncer's committed params and momentum (read and written by the syncer alone)"}
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


def syncer_consumer_configs(run: str, *, push_headers_only: bool = True, shard: int = 0, shards: int = 1,
                            fragments: int | None = None) -> dict[str, tuple[str, api.ConsumerConfig]]:
    """The syncer's durable pull consumers: name -> (stream kind, config). docs/design.md §3.3.

    Syncer shards (schemas/shards.py; `fragments` P is then required): shard K's INIT and PUSH
    consumers are named `syncer-init-s<K>` / `syncer-push-s<K>` and filter on its own fragments'
    subjects only (`filter_subjects`, one per fragment: its INIT chunks and every island's pushes of
    it), so a shard never receives, acks or holds bytes of another shard's fragments, and the INIT work
    queue's filters never overlap. Only the coordinator (shard 0) reads CTL (hellos) and HB (heartbeats, final acks).
    With one shard every name and filter is the unsharded one."""
    _check_run_id(run)
    SH.check(shard, shards, fragments)
    if shards > 1 and fragments is None:
        raise ConfigError("syncer shards need the fragment count to filter their consumers", field="fragments",
                          value=fragments)

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

    ctl = ("CTL", durable(
        S.SYNCER_CTL_CONSUMER, "syncer reads hellos",
        filter_subjects=S.syncer_ctl_filters(run), ack_wait=SYNCER_CTL_ACK_WAIT_S,
    ))
    hb = ("HB", durable(
        S.SYNCER_HB_CONSUMER, "syncer reads heartbeats and final acks",
        filter_subjects=S.syncer_hb_filters(run), ack_wait=SYNCER_CTL_ACK_WAIT_S,
    ))
    if shards == 1:
        return {
            S.SYNCER_CTL_CONSUMER: ctl,
            S.SYNCER_HB_CONSUMER: hb,
            S.SYNCER_INIT_CONSUMER: ("INIT", durable(
                S.SYNCER_INIT_CONSUMER, "syncer reads initial weights", ack_wait=SYNCER_INIT_ACK_WAIT_S,
            )),
            S.SYNCER_PUSH_CONSUMER: ("PUSH", durable(
                S.SYNCER_PUSH_CONSUMER, "syncer records push chunks by sequence",
                filter_subject=S.push_all(run), ack_wait=SYNCER_PUSH_ACK_WAIT_S, headers_only=push_headers_only,
            )),
        }
    own = SH.own_fragments(fragments, shard, shards)
    label = SH.label(shard, shards)
    init_name = SH.consumer(S.SYNCER_INIT_CONSUMER, shard, shards)
    push_name = SH.consumer(S.SYNCER_PUSH_CONSUMER, shard, shards)
    out = {S.SYNCER_CTL_CONSUMER: ctl, S.SYNCER_HB_CONSUMER: hb} if shard == SH.COORDINATOR else {}
    out[init_name] = ("INIT", durable(
        init_name, f"syncer {label} reads initial weights of fragments {list(own)}",
        filter_subjects=[S.init(run, f) for f in own], ack_wait=SYNCER_INIT_ACK_WAIT_S,
    ))
    out[push_name] = ("PUSH", durable(
        push_name, f"syncer {label} records push chunks of fragments {list(own)} by sequence",
        filter_subjects=[S.push_fragment_all(run, f) for f in own], ack_wait=SYNCER_PUSH_ACK_WAIT_S,
        headers_only=push_headers_only,
    ))
    return out


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


# An ordered consumer is one replica in memory on one server: when that server stops (a node restarted, in lame
# duck mode or killed) the consumer is gone, and nats-py notices only when two idle heartbeats in a row did not
# come (its default 5 s: 10-20 s without cut notices, islands pushing on stale versions that the syncer refuses).
# With 0.5 s it re-creates the consumer from the next sequence on a live server within 1-2 s (docs/design.md §7.1);
# the price is two small heartbeat messages a second on an idle cut.
CUT_IDLE_HEARTBEAT_S = 0.5


def _cut_config(filter_subject: str, headers_only: bool) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=filter_subject,
        headers_only=headers_only,
        idle_heartbeat=CUT_IDLE_HEARTBEAT_S,
    )


def bcast_consumer_config(run: str, fragment: int | None = None, *, headers_only: bool = True) -> api.ConsumerConfig:
    """The island cut reader's consumer config on BCAST: the newest message of every chunk subject,
    then new ones. Use it as an ordered consumer:

        cfg = bcast_consumer_config(run)
        sub = await js.subscribe(cfg.filter_subject, stream=stream(run, "BCAST"), ordered_consumer=True, config=cfg)

    `headers_only` (default): the inbox holds notices (chunk headers, stream sequence), not bytes;
    rank 0 fetches the payloads by sequence at the boundary (docs/design.md §3.6).
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


# ---- datacenter mirrors of the cut (docs/design.md §12) -------------------------------------------
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
    return S.js_api(hub_domain)


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


def mirror_source(c: api.StreamConfig) -> tuple:
    m = c.mirror
    return (None, None) if m is None else (m.name, m.external.api if m.external else None)


def mirror_conflicts(existing: api.StreamConfig, wanted: api.StreamConfig) -> list[tuple[str, Any, Any]]:
    """(field, existing, wanted) where an existing stream is not the wanted mirror."""
    out = []
    if mirror_source(existing) != mirror_source(wanted):
        out.append(("mirror", mirror_source(existing), mirror_source(wanted)))
    return out + [(f, _norm(f, getattr(existing, f)), _norm(f, getattr(wanted, f)))
                  for f in MIRROR_FIELDS if _norm(f, getattr(existing, f)) != _norm(f, getattr(wanted, f))]
