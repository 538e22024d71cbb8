"""Shards: the rules a sharded machine adds (rules of `RoundMachine`; schemas/shards.py says who owns what,
docs/design.md §10 the design). Rule functions over (state, config, output): see machine_state.py. With
one shard (`config.shards == 1`) none of this runs and the machine behaves exactly as it always did.

- **Every shard** runs the rounds of its own fragments (round t belongs to shard ((t-1) mod P) mod N)
  with every rule of an unsharded machine; its `versions` and `committed_step` are its own fragments'
  and its own rounds'. It launches round t no sooner than (t - its last launched step) x H/P x the
  slowest member's step time after its last launch, or when the members' progress says t is due, on the
  estimates the coordinator writes into the members KV (`ema_step_s`, `reported_at`, `ref_step`, `ref_local`).
- **The coordinator** (shard 0) alone takes hellos, heartbeats and acks, pins the session, admits,
  judges liveness and writes the members KV; followers follow what it wrote (`on_session_seen`,
  `on_member_seen`) and never judge liveness. Each shard publishes its own final cut
  (`start_shard_final`); the coordinator collects the others' (`on_shard_final`), then sends the manifests.
Invariants: an event a shard does not own (a hello, heartbeat or ack fed to a follower; SessionSeen,
MemberSeen or ShardFinal fed to the coordinator) is counted (`ignored.not_owner`) and changes nothing.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from yeto.services.syncer.actions import AdoptSession, Done, PublishShardFinal, RecordFinal, SendManifest
from yeto.services.syncer.events import MemberSeen, SessionSeen, ShardFinal
from yeto.services.syncer import finalize, init_rules, membership
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.machine_state import MachineState, Output
from yeto.services.syncer.state import Member, Phase, _Final


class MemberRecordError(ValueError):
    pass


def _member_fields(record: Mapping[str, Any]) -> dict:
    """The fields of a members-KV record a follower uses, checked (the KV is written by the coordinator,
    but whatever reaches the machine from the wire is checked)."""
    if not isinstance(record, Mapping):
        raise MemberRecordError(f"record is {type(record).__name__}, not an object")
    gen = record.get("gen")
    if not isinstance(gen, str) or not gen:
        raise MemberRecordError(f"gen {gen!r} is not a generation")
    out: dict[str, Any] = {"gen": gen, "live": record.get("live", True),
                           "layout_fingerprint": record.get("layout_fingerprint")}
    if not isinstance(out["live"], bool):
        raise MemberRecordError(f"live {out['live']!r} is not a boolean")
    for key, kind in (("last_step", int), ("ref_step", int), ("last_heartbeat", float), ("reported_at", float),
                      ("admitted_at", float), ("ref_local", float), ("ema_step_s", float)):
        value = record.get(key)
        if value is None:
            out[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or (kind is int and value != int(value)):
            raise MemberRecordError(f"{key} {value!r} is not a {'count' if kind is int else 'number'} >= 0")
        out[key] = kind(value)
    return out


# -- followers: the coordinator's records -------------------------------------------------------


def on_session_seen(s: MachineState, cfg: SyncerConfig, out: Output, ev: SessionSeen, now: float) -> None:
    if cfg.coordinator:
        s.counters["ignored.not_owner"] += 1
        return
    if s.session is not None:
        if ev.session.get("session_fingerprint") != s.session.get("session_fingerprint"):
            s.counters["rejected.session_changed"] += 1
            out.tape("error", now, reason="the state KV's session differs from the one this shard pinned; ignored",
                          detail={"code": "session_changed", "seen": ev.session.get("session_fingerprint")})
        return
    if ev.session.get("outer") != cfg.outer:
        # a follower merges as the run is pinned: one started with another --outer must not adopt it
        s.counters["rejected.session_record"] += 1
        out.tape("error", now, reason=f"session record pins outer {ev.session.get('outer')!r}, this shard's --outer "
                                      f"gives {cfg.outer!r}: ignored", detail={"code": "outer_mismatch", "field": "outer"})
        return
    frags = ev.session.get("fragments")
    if not isinstance(frags, list) or len(frags) != cfg.fragments:
        s.counters["rejected.session_record"] += 1
        out.tape("error", now, reason=f"session record with {len(frags) if isinstance(frags, list) else frags!r} "
                                        f"fragments, --fragments is {cfg.fragments}: ignored",
                      detail={"code": "bad_layout", "field": "fragments"})
        return
    s.session = dict(ev.session)
    s.init_island = s.session.get("init_island")
    s.layout_fp = s.session.get("layout_fingerprint")
    s.enter(Phase.INIT, "follower: session seen")
    out.emit(AdoptSession(dict(s.session)))
    # Members read before the session (the records are polled apart) were not admitted: do it now.
    for island in sorted(s.unpinned_members):
        on_member_seen(s, cfg, out, MemberSeen(island, s.unpinned_members[island], now), now)
    s.unpinned_members.clear()


def on_member_seen(s: MachineState, cfg: SyncerConfig, out: Output, ev: MemberSeen, now: float) -> None:
    """A follower takes a members record that changed: admission, a new generation (whose unanswered
    slots are rebound and re-pulled, as on the coordinator), liveness, progress. While the coordinator is
    down it keeps the membership it last read; its member is admitted without a `join` tape record (the
    coordinator wrote it). A record that is not a well-formed member record is counted
    (`rejected.member_record`), taped, and ignored."""
    if cfg.coordinator:
        s.counters["ignored.not_owner"] += 1
        return
    try:
        rec = _member_fields(ev.record)
    except MemberRecordError as exc:
        s.counters["rejected.member_record"] += 1
        out.tape("error", now, island=ev.island, reason=f"members record of {ev.island!r} ignored: {exc}",
                      detail={"code": "invalid", "field": "members"})
        return
    if s.session is None:
        s.unpinned_members[ev.island] = dict(ev.record)
        return
    if rec["layout_fingerprint"] not in (None, s.layout_fp):
        s.counters["rejected.member_record"] += 1
        out.tape("error", now, island=ev.island, reason=f"members record of {ev.island!r} has another layout; ignored",
                      detail={"code": "layout_mismatch", "field": "layout_fingerprint"})
        return
    m = s.members.get(ev.island)
    if m is not None and rec["gen"] in m.retired_gens:
        s.counters["ignored.member_stale_gen"] += 1
        return
    if m is None:
        m = Member(island=ev.island, gen=rec["gen"], layout_fingerprint=s.layout_fp,
                   admitted_at=rec["admitted_at"] if rec["admitted_at"] is not None else now,
                   last_heartbeat=now, reported_at=now)
        if s.phase in (Phase.RUNNING, Phase.FINALIZING):
            m.ref_step, m.ref_local = s.next_step - 1, 0.0
        s.members[ev.island] = m
        s.counters["join.mirrored"] += 1
        _mirror_progress(s, cfg, out, m, rec, now)
        init_rules.replay_held(s, cfg, out, m, now)
    elif rec["gen"] != m.gen:
        membership.new_generation(s, cfg, out, m, rec["gen"], now, mirrored=True)
        _mirror_progress(s, cfg, out, m, rec, now)
    else:
        _mirror_progress(s, cfg, out, m, rec, now)


def _mirror_progress(s: MachineState, cfg: SyncerConfig, out: Output, m: Member, rec: dict, now: float) -> None:
    if m.live != rec["live"]:
        s.counters["leave.mirrored" if m.live else "join.resumed_mirrored"] += 1
    m.live = rec["live"]
    m.last_heartbeat = now        # unused by a follower (it never judges liveness)
    if rec["last_step"] is not None:
        m.reported_step = rec["last_step"]
        m.reported_at = rec["reported_at"] if rec["reported_at"] is not None else (rec["last_heartbeat"] or now)
    if rec["ema_step_s"]:
        m.ema_step_s = rec["ema_step_s"]
    if rec["ref_step"] is not None and rec["ref_local"] is not None:
        m.ref_step, m.ref_local = rec["ref_step"], rec["ref_local"]

# -- finalization across shards -----------------------------------------------------------------


def own_rounds_done(s: MachineState, cfg: SyncerConfig, out: Output) -> bool:
    return s.next_step > cfg.total_steps and not s.rounds


def start_shard_final(s: MachineState, cfg: SyncerConfig, out: Output, now: float) -> None:
    """Every own round up to --total-steps is committed: one `PublishShardFinal` (its fragments' f32 cut)."""
    s.own_final_started = True
    if not cfg.coordinator:
        # nothing left to launch; a follower only publishes its cut
        s.enter(Phase.FINALIZING, "follower: own rounds committed")
    out.emit(PublishShardFinal(cfg.total_steps, dict(s.versions)))
    out.tape("final", now, step=cfg.total_steps, reason=f"shard {cfg.shard}/{cfg.shards}: final cut publishing",
                  detail={"versions": {str(k): v for k, v in sorted(s.versions.items())}, "shard": cfg.shard})


def shard_final_published(s: MachineState, cfg: SyncerConfig, out: Output, now: float) -> None:
    """After its `FinalPublished` a follower is done (`Done(True, ())`); the coordinator keeps admitting
    (other shards still run rounds) and counts its own cut in."""
    if not s.own_final_started or s.own_final_out:
        raise ValueError("FinalPublished without an outstanding PublishShardFinal")
    s.own_final_out = True
    out.tape("final", now, step=cfg.total_steps, reason=f"shard {cfg.shard}/{cfg.shards}: final cut published",
                  detail={"shard": cfg.shard})
    if cfg.coordinator:
        s.shard_finals[cfg.shard] = dict(s.versions)
    else:
        out.emit(Done(True, ()))
        s.enter(Phase.DONE, "follower: own final cut out")


def on_shard_final(s: MachineState, cfg: SyncerConfig, out: Output, ev: ShardFinal, now: float) -> None:
    """The coordinator collects every other shard's final cut; when all N are in it records the
    finalization (`start_manifests`: RecordFinal, versions of every fragment) and sends the manifests;
    acks, the final timeout and Shutdown are as unsharded. A ShardFinal of an unknown shard, or one naming
    fragments the shard does not own, is counted and taped; a second one of a shard is counted; neither
    changes anything."""
    if not cfg.coordinator:
        s.counters["ignored.not_owner"] += 1
        return
    versions, why = None, None
    if not isinstance(ev.shard, int) or not 0 < ev.shard < cfg.shards:
        why = f"shard {ev.shard!r} is not one of 1..{cfg.shards - 1}"
    elif ev.shard in s.shard_finals:
        s.counters["ignored.shard_final_duplicate"] += 1
        return
    elif ev.final_step != cfg.total_steps:
        why = f"final_step {ev.final_step!r}, --total-steps is {cfg.total_steps}"
    else:
        try:
            versions = {int(k): int(v) for k, v in ev.versions.items()}
        except (TypeError, ValueError, AttributeError):
            why = f"versions {ev.versions!r} are not fragment -> version"
        else:
            want = [f for f in range(cfg.fragments) if f % cfg.shards == ev.shard]
            if sorted(versions) != want or any(v < 0 for v in versions.values()):
                why = f"versions of fragments {sorted(versions)}, shard {ev.shard} owns {want}"
    if why is not None:
        s.counters["rejected.shard_final"] += 1
        out.tape("error", now, reason=f"final record of shard {ev.shard!r} ignored: {why}",
                      detail={"code": "invalid", "field": "final"})
        return
    s.shard_finals[ev.shard] = versions
    s.counters["final.shard"] += 1
    out.tape("final", now, step=cfg.total_steps, reason=f"shard {ev.shard}/{cfg.shards}: final cut in",
                  detail={"shard": ev.shard, "versions": {str(k): v for k, v in sorted(versions.items())},
                       "shards_in": sorted(s.shard_finals)})


def start_manifests(s: MachineState, cfg: SyncerConfig, out: Output, now: float) -> None:
    """Every shard's final cut is out: freeze the live members as targets and send the manifests."""
    versions: dict[int, int] = {}
    for v in s.shard_finals.values():
        versions.update(v)
    targets = {m.island: m.gen for m in s.live()}
    f = s.final = _Final(final_step=cfg.total_steps, started_at=now, targets=targets,
                              versions=dict(sorted(versions.items())), cut_out=True)
    s.enter(Phase.FINALIZING, "every shard's final cut is out")
    out.emit(RecordFinal(f.record()))
    out.tape("final", now, step=f.final_step, reason="final cut published by every shard",
                  detail={"versions": {str(k): v for k, v in f.versions.items()},
                       "targets": [{"island": i, "gen": g} for i, g in sorted(targets.items())]})
    for island, gen in sorted(targets.items()):
        out.emit(SendManifest(island, gen, f.final_step, dict(f.versions)))
    if not targets:
        finalize.finish(s, cfg, out, True, now)
