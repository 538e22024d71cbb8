"""Provisioning of a run's JetStream streams, KV buckets and consumers (docs/design.md §3.3).

Owns the async shells around the pure configs of `schemas.stream_configs` (streams, buckets, the
syncer's consumers, mirrors, conflicts) and `schemas.island_consumers` (an island's CTL consumers), and
re-exports them. The syncer calls `provision_run` at start; an island calls `check_run` (waits until every
stream and bucket exists, never creates one), then `ensure_island_consumers`, and in a datacenter
`ensure_cut_mirrors`; `remove_run` backs `yeto run rm R`.
Invariants: provisioning is idempotent; an existing stream, bucket or consumer whose configuration differs
on a field that changes behaviour raises `ProvisionConflict` and is never modified (fixing a live run's
stream would change what islands see mid-run), and every conflict is found before anything is created.
Every consumer is a durable pull consumer (the reader decides how many bytes to fetch, §15.4) except the
island's ordered, headers-only cut readers; `syncer-push` is headers-only (payloads read by direct get).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import nats.errors
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from . import subjects as S
from .errors import WireError
from .ids import check_run as _check_run_id
from .island_consumers import (ConsumerTaken, ISLAND_CONSUMER_TRIES, consumer_owner, ensure_island_consumer,
                               ensure_island_consumers, island_consumer_owner, remove_island_consumers)
from .provision_base import (ProvisionConflict, ProvisionError, ProvisionReport, RunNotProvisioned,
                             consumer_info_or_none, server_refused, stream_info_or_none)
from .stream_configs import (CONSUMER_FIELDS, CUT_KINDS, DAY, ERR_STREAM_NAME_IN_USE, GiB, HOUR,
                             ISLAND_ACK_WAIT_S, ISLAND_INACTIVE_S, KV_FIELDS, KV_STREAM_PREFIX, KiB,
                             MIRROR_FIELDS, MiB, RunLimits, STREAM_FIELDS, SYNCER_CTL_ACK_WAIT_S,
                             SYNCER_INIT_ACK_WAIT_S, SYNCER_PUSH_ACK_WAIT_S, bcast_consumer_config,
                             config_conflicts, final_consumer_config, hub_api_prefix, island_consumer_config,
                             kv_configs, kv_stream_name, mirror_configs, mirror_conflicts, mirror_source, push_max_bytes_for,
                             stream_configs, syncer_consumer_configs)

# The shells below, and the pure configs and island-consumer shells re-exported for callers that
# import everything provisioning from here.
__all__ = ['CONSUMER_FIELDS', 'CUT_KINDS', 'ConsumerTaken', 'DAY', 'ERR_STREAM_NAME_IN_USE', 'GiB', 'HOUR', 'ISLAND_ACK_WAIT_S', 'ISLAND_CONSUMER_TRIES', 'ISLAND_INACTIVE_S', 'KV_FIELDS', 'KV_PUT_ATTEMPTS', 'KV_STREAM_PREFIX', 'KiB', 'MIRROR_FIELDS', 'MiB', 'ProvisionConflict', 'ProvisionError', 'ProvisionReport', 'RunLimits', 'RunNotProvisioned', 'STREAM_FIELDS', 'SYNCER_CTL_ACK_WAIT_S', 'SYNCER_INIT_ACK_WAIT_S', 'SYNCER_PUSH_ACK_WAIT_S', 'bcast_consumer_config', 'check_run', 'config_conflicts', 'consumer_info_or_none', 'consumer_owner', 'ensure_cut_mirrors', 'ensure_island_consumer', 'ensure_island_consumers', 'final_consumer_config', 'hub_api_prefix', 'island_consumer_config', 'island_consumer_owner', 'kv', 'kv_configs', 'kv_put', 'kv_stream_name', 'mirror_configs', 'mirror_conflicts', 'mirror_source', 'unprovisioned', 'provision_run', 'push_max_bytes_for', 'remove_island_consumers', 'remove_run', 'server_refused', 'stream_configs', 'stream_info_or_none', 'syncer_consumer_configs']

log_ = logging.getLogger(__name__)


def _remade_from_its_floor(field_: str, existing, wanted) -> bool:
    """A syncer consumer made again from the message after its ack floor (services/syncer/consumer_reset.py:
    deliveries lost with a connection) starts `by_start_sequence`; it reads on as the configured `all` did."""
    return field_ == "deliver_policy" and existing == "by_start_sequence" and wanted == "all"


async def _ensure_consumers(js, run: str, wanted: list[tuple[str, api.ConsumerConfig]], report: ProvisionReport) -> None:
    """Check every consumer first (on streams that exist), raise on any conflict, then create."""
    conflicts, to_create = [], []
    for stream_name, cfg in wanted:
        what = f"consumer {stream_name}/{cfg.durable_name}"
        info = await consumer_info_or_none(js, stream_name, cfg.durable_name)
        if info is None:
            to_create.append((stream_name, cfg, what))
            continue
        for f, e, w in config_conflicts(info.config, cfg, "consumer"):
            if _remade_from_its_floor(f, e, w):
                continue
            conflicts.append((what, stream_name, f, e, w))
        report.note_found(what)
    if conflicts:
        raise ProvisionConflict(run, conflicts)
    for stream_name, cfg, what in to_create:
        try:
            await js.add_consumer(stream_name, config=cfg)
        except APIError as exc:
            raise server_refused(what, exc) from exc
        report.note_created(what)


async def _check_streams(js, wanted, report: ProvisionReport, label: str, conflicts_of) -> tuple[list, list]:
    """(missing configs, conflicts) of the wanted streams; the ones found go to the report."""
    missing, conflicts = [], []
    for cfg in wanted:
        info = await stream_info_or_none(js, cfg.name)
        if info is None:
            missing.append(cfg)
            continue
        conflicts += [(f"{label} {cfg.name}", cfg.name, f, e, w) for f, e, w in conflicts_of(info.config, cfg)]
        report.note_found(f"{label} {cfg.name}")
    return missing, conflicts


async def _add_streams(js, run: str, cfgs, report: ProvisionReport, label: str, conflicts_of) -> None:
    """Create each stream. A concurrent creator with the same config makes add_stream a no-op; one with
    another config makes it fail with 10058, which is re-read: the same config counts as found,
    another raises ProvisionConflict."""
    for cfg in cfgs:
        what = f"{label} {cfg.name}"
        try:
            await js.add_stream(cfg)
        except APIError as exc:
            if exc.err_code == ERR_STREAM_NAME_IN_USE:
                info = await stream_info_or_none(js, cfg.name)
                if info is not None:
                    c = conflicts_of(info.config, cfg)
                    if c:
                        raise ProvisionConflict(run, [(what, cfg.name, f, e, w) for f, e, w in c]) from exc
                    report.note_found(what)
                    continue
            raise server_refused(what, exc) from exc
        report.note_created(what)


async def _add_kv(js, run: str, kcfg: api.KeyValueConfig, report: ProvisionReport) -> None:
    """Create a KV bucket; as `_add_streams`, a concurrent creator (another syncer shard) is tolerated:
    the bucket it made counts as found when its configuration matches, else ProvisionConflict."""
    what, sname = f"kv {kcfg.bucket}", kv_stream_name(kcfg.bucket)
    try:
        await js.create_key_value(kcfg)
    except APIError as exc:
        if exc.err_code == ERR_STREAM_NAME_IN_USE:
            info = await stream_info_or_none(js, sname)
            if info is not None:
                c = config_conflicts(info.config, kcfg, "kv")
                if c:
                    raise ProvisionConflict(run, [(what, sname, f, e, w) for f, e, w in c]) from exc
                report.note_found(what)
                return
        raise server_refused(what, exc) from exc
    report.note_created(what)


async def _shard_count_conflicts(js, run: str, shards: int, fragments: int | None) -> list:
    """A run's syncer shards must agree on --shards: a shard started with another count would consume
    (and run rounds of) fragments another shard owns. The PUSH consumers tell what the run was started
    with: the unsharded `syncer-push`, or shard 0's `syncer-push-s0`, whose filters name shard 0's
    fragments and so the count."""
    stream = S.stream(run, "PUSH")
    plain, first = S.SYNCER_PUSH_CONSUMER, f"{S.SYNCER_PUSH_CONSUMER}-s0"
    out = []
    if shards > 1 and await consumer_info_or_none(js, stream, plain) is not None:
        out.append((f"consumer {stream}/{plain}", stream, "shards", 1, shards))
    if shards == 1 and await consumer_info_or_none(js, stream, first) is not None:
        out.append((f"consumer {stream}/{first}", stream, "shards", "> 1", shards))
    if shards > 1:
        info = await consumer_info_or_none(js, stream, first)
        if info is not None:
            _, want = syncer_consumer_configs(run, shard=0, shards=shards, fragments=fragments)[first]
            if any(f == "filter" for f, _, _ in config_conflicts(info.config, want, "consumer")):
                out.append((f"consumer {stream}/{first}", stream, "shards",
                            f"another count (shard 0 reads {sorted(info.config.filter_subjects or [])})", shards))
    return out


async def provision_run(
    js, run: str, limits: RunLimits = RunLimits(), *, push_headers_only: bool = True,
    log: Callable[[str], None] | None = None, shard: int = 0, shards: int = 1, fragments: int | None = None,
) -> ProvisionReport:
    """The syncer-side call: create what is missing, check what exists (docs/design.md §3.3).

    Raises ProvisionConflict (nothing created, nothing changed) if any existing stream, bucket or
    syncer consumer differs from the wanted configuration on a field that matters.

    Syncer shards (`shard` K of `shards` N, `fragments` P): every shard provisions the run's streams
    and buckets (the same configs: shards may start in any order, on any host, at the same moment)
    and its own consumers (`syncer_consumer_configs`). Two shards creating the same stream or bucket
    at once both succeed: an identical create is a no-op on the server, and a create that loses the
    race to another config is re-read and compared like an existing one.
    """
    _check_run_id(run)
    kw = dict(push_headers_only=push_headers_only, log=log or log_.info, shard=shard, shards=shards,
              fragments=fragments)
    for attempt in range(1, PROVISION_TRIES):
        try:
            return await _provision_once(js, run, limits, **kw)
        except nats.errors.TimeoutError:
            # A JetStream API request whose reply was lost with a node killed under it (the meta or a stream
            # leader's) waits out its whole timeout: a standby starting then exited 1 (soak/chaos.py --cluster 3
            # --standby). Every step reads or makes an identical config, so asking again is safe.
            log_.warning("run %s: the JetStream API did not answer while provisioning (a node down?); asking "
                         "again (%d of %d)", run, attempt + 1, PROVISION_TRIES)
    return await _provision_once(js, run, limits, **kw)


PROVISION_TRIES = 3


async def _provision_once(js, run: str, limits: RunLimits, *, push_headers_only: bool, log: Callable[[str], None],
                          shard: int, shards: int, fragments: int | None) -> ProvisionReport:
    report = ProvisionReport(run)
    streams = stream_configs(run, limits)
    kvs = kv_configs(run, limits)
    consumers = syncer_consumer_configs(run, push_headers_only=push_headers_only, shard=shard, shards=shards,
                                        fragments=fragments)

    # Phase 1: read everything, collect conflicts; nothing is created before all checks pass.
    missing_streams, conflicts = await _check_streams(js, streams.values(), report, "stream",
                                                      lambda e, w: config_conflicts(e, w, "stream"))
    missing_kvs: list[api.KeyValueConfig] = []
    for kcfg in kvs.values():
        sname = kv_stream_name(kcfg.bucket)
        info = await stream_info_or_none(js, sname)
        if info is None:
            missing_kvs.append(kcfg)
            continue
        conflicts += [(f"kv {kcfg.bucket}", sname, f, e, w) for f, e, w in config_conflicts(info.config, kcfg, "kv")]
        report.note_found(f"kv {kcfg.bucket}")
    missing_names = {c.name for c in missing_streams}
    wanted_consumers = [(S.stream(run, kind), cfg) for kind, cfg in consumers.values()]
    for stream_name, cfg in wanted_consumers:
        if stream_name in missing_names:
            continue
        info = await consumer_info_or_none(js, stream_name, cfg.durable_name)
        if info is not None:
            conflicts += [(f"consumer {stream_name}/{cfg.durable_name}", stream_name, f, e, w)
                          for f, e, w in config_conflicts(info.config, cfg, "consumer")
                          if not _remade_from_its_floor(f, e, w)]
    if S.stream(run, "PUSH") not in missing_names:
        conflicts += await _shard_count_conflicts(js, run, shards, fragments)
    if conflicts:
        raise ProvisionConflict(run, conflicts)

    # Phase 2: create what is missing.
    await _add_streams(js, run, missing_streams, report, "stream", lambda e, w: config_conflicts(e, w, "stream"))
    for kcfg in missing_kvs:
        await _add_kv(js, run, kcfg, report)
    await _ensure_consumers(js, run, wanted_consumers, report)
    log(str(report))
    return report


def _wanted_names(run: str) -> list[tuple[str, str]]:
    """(label, stream name) of every stream and KV bucket stream of a run."""
    out = [(f"stream {S.stream(run, k)}", S.stream(run, k)) for k in S.STREAM_KINDS]
    out += [(f"kv {S.kv_bucket(run, k)}", kv_stream_name(S.kv_bucket(run, k))) for k in S.KV_KINDS]
    return out


async def unprovisioned(js, run: str) -> list[str]:
    """Labels of the run's streams and buckets that do not exist (yet)."""
    missing = []
    for label, name in _wanted_names(_check_run_id(run)):
        if await stream_info_or_none(js, name) is None:
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
            missing = await unprovisioned(js, run)
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


def _kv_subject_via(js, subject: str) -> str:
    """The subject a KV put of `subject` ($KV.<bucket>.<key>) goes to through `js`. A context of another
    JetStream domain (a writer behind a leaf node: `nc.jetstream(domain="hub")`) sends it as
    `$JS.<domain>.API.$KV.<bucket>.<key>`, which that domain's servers map to the bucket's subject: a bare
    `$KV.>` never crosses a leaf link between two domains (nats-server denies it there, denyAllClientJs),
    and nats-py 2.16's KeyValue.put sends it bare."""
    prefix = getattr(js, "_prefix", S.js_api())
    return subject if prefix == S.js_api() else f"{prefix}.{subject}"


async def kv_put(js, run: str, kind: str, key: str, value: bytes, *, counters=None, attempts: int = KV_PUT_ATTEMPTS,
                 expected_rev: int | None = None):
    """Put `value` under `key` in the run's KV bucket `kind`, riding through reconnects and leader
    elections (see above). Returns the PubAck (its `seq` is the entry's revision). `expected_rev`: only
    over that revision of the key (0: only when the key has none), else nats-py's APIError 10071 (a
    re-send of the same put after a lost ack is answered as a duplicate first, so it never trips this)."""
    import uuid

    from .publish import publish_retry

    if kind not in S.KV_KINDS:
        raise WireError(f"must be one of {', '.join(S.KV_KINDS)}", field="kind", value=kind, code="bad_kv")
    subject = _kv_subject_via(js, S.kv_key(_check_run_id(run), kind, key))
    headers = None if expected_rev is None else {"Nats-Expected-Last-Subject-Sequence": str(int(expected_rev))}
    return await publish_retry(js, subject, value, f"kv.{kind}.{key}.{uuid.uuid4().hex}", headers,
                               counters=counters, attempts=attempts)


async def ensure_cut_mirrors(js, run: str, hub_domain: str, *, replicas: int = 1,
                             log: Callable[[str], None] | None = None) -> ProvisionReport:
    """Create the datacenter's mirrors of BCAST and FINAL through `js` (a JetStream context of the
    datacenter's domain) where missing; check existing ones. A stream of that name that is not the
    same mirror raises ProvisionConflict and is left unchanged."""
    log = log or log_.info
    report = ProvisionReport(run)
    wanted = mirror_configs(run, hub_domain, replicas=replicas)
    missing, conflicts = await _check_streams(js, wanted.values(), report, "mirror", mirror_conflicts)
    if conflicts:
        raise ProvisionConflict(run, conflicts)
    # Another island of the datacenter may create the same mirror at the same moment.
    await _add_streams(js, run, missing, report, "mirror", mirror_conflicts)
    if report.created:
        log(str(report))
    return report
