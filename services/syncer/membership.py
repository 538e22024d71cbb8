"""Hellos, the session pin, members and their generations, heartbeats (rules of `RoundMachine`).

Rule functions of services/syncer/rounds.RoundMachine over (state, config, output): they read and write
the machine's `MachineState` and emit through its `Output`; they hold no state of their own.

- **init_island named**: hellos from other islands are *queued* (not refused, not admitted) until the
  INIT island's hello pins the session (`_pin` checks the hello's own layout); then they are re-examined
  in arrival order. A dtype mismatch is refused at once (it does not depend on the session). A queued
  island that sends a newer generation replaces its queued hello.
- **Members**: any number of islands may join (N only gates version 0). A member silent for
  `member_timeout_s` or longer leaves; a heartbeat of its current generation brings it back.
  A hello with a generation the island had before is a stale replay and is ignored.
- **Unknown members**: a heartbeat of an island, or of a generation of it, the machine has no record
  of gets a non-fatal `SendError` with code `unknown_member` (`_ask_hello`): the island must send
  hello again.
"""
from __future__ import annotations

from typing import Callable

from yeto.schemas import outer_mode as OM

from yeto.services.syncer.actions import PublishPull, WriteSession
from yeto.services.syncer.config import UNKNOWN_MEMBER, SyncerConfig
from yeto.services.syncer.events import Heartbeat, Hello
from yeto.services.syncer import finalize, init_rules
from yeto.services.syncer.machine_state import MachineState, Output
from yeto.services.syncer.state import Member, Phase, default_builder


def _stated(software: str | None) -> dict | None:
    # The release an island runs, on its join record: during a rolling upgrade the tape says which
    # generation of which island came back on which release.
    return None if software is None else {"software": software}


def on_hello(s: MachineState, cfg: SyncerConfig, out: Output, ev: Hello, now: float, *,
             builder: Callable[..., dict] | None = None) -> None:
    """`builder`: builds the session from the INIT island's hello (tests pass a stub; default: state.default_builder)."""
    if not cfg.coordinator:
        s.counters["ignored.not_owner"] += 1   # sharded: only shard 0 takes these (sharding.py)
        return
    m = s.members.get(ev.island)
    if m is not None and ev.gen in m.retired_gens:
        s.counters["ignored.hello_stale_gen"] += 1
        return
    if m is not None and ev.gen == m.gen:
        s.counters["ignored.hello_duplicate"] += 1
        return
    for key, flag in (("push_dtype", "--push-dtype"), ("bulk_dtype", "--bulk-dtype")):
        asked = getattr(ev, key)
        # the session's dtype once pinned (a runtime push_dtype rides on the pulls, not the session)
        pinned = (s.session or {}).get(key, getattr(cfg, key))
        if asked != "auto" and asked != pinned:
            out.reject(ev.island, ev.gen, "dtype_mismatch",
                            f"hello asks {key} {asked!r}, the session uses {pinned!r} ({flag})",
                            now, fatal=True, field=key)
            return
    if s.phase == Phase.FINALIZING and m is None:
        out.reject(ev.island, ev.gen, "run_finishing",
                        f"run is finalizing at step {s.final.final_step}; no rounds left to join",
                        now, fatal=True)
        return
    if s.session is None:
        if cfg.init_island is not None and ev.island != cfg.init_island:
            s.queued[ev.island] = ev      # a newer generation replaces the queued one
            s.counters["hello.queued"] += 1
            return
        if _pin(s, cfg, out, ev, now, builder):
            _admit(s, cfg, out, ev, now)
            queued, s.queued = s.queued, {}
            for q in queued.values():
                on_hello(s, cfg, out, q, now, builder=builder)
        return
    if ev.layout_fingerprint != s.layout_fp:
        out.reject(ev.island, ev.gen, "layout_mismatch",
                        f"layout_fingerprint {ev.layout_fingerprint} differs from the session's {s.layout_fp}",
                        now, fatal=True, field="layout_fingerprint")
        return
    if m is None:
        _admit(s, cfg, out, ev, now)
    else:
        new_generation(s, cfg, out, m, ev.gen, now, software=ev.software)


def _pin(s: MachineState, cfg: SyncerConfig, out: Output, ev: Hello, now: float,
         builder: Callable[..., dict] | None) -> bool:
    """Pinning checks the hello's own fingerprint: the session builder recomputes the layout fingerprint;
    if it differs from the one the hello claims, the hello is refused (layout_mismatch). A layout the
    builder refuses (WireError / ValueError) is refused with the error's code."""
    builder = builder or default_builder()
    try:
        session = builder(
            list(ev.layout), cfg.fragments, run=cfg.run, push_dtype=cfg.push_dtype,
            bulk_dtype=cfg.bulk_dtype, chunk_bytes=cfg.chunk_bytes, init_island=ev.island,
            sync_every=cfg.sync_every, created=now,
        )
    except ValueError as exc:  # WireError (and ConfigError) are ValueErrors: a layout the builder cannot use
        code = getattr(exc, "code", "bad_layout")
        # a generic code says nothing to the island; "config": the layout does not fit --fragments
        code = "bad_layout" if code in (None, "invalid", "config") else code
        out.reject(ev.island, ev.gen, code, f"layout refused: {exc}", now, fatal=True,
                        field=getattr(exc, "field", None) or "layout")
        return False
    fp = session.get("layout_fingerprint", ev.layout_fingerprint)
    if fp != ev.layout_fingerprint:
        out.reject(ev.island, ev.gen, "layout_mismatch",
                        f"layout_fingerprint {ev.layout_fingerprint} is not the layout's fingerprint {fp}",
                        now, fatal=True, field="layout_fingerprint")
        return False
    if len(session.get("fragments", ())) != cfg.fragments:
        out.reject(ev.island, ev.gen, "bad_layout",
                        f"layout gives {len(session.get('fragments', ()))} fragments, --fragments is {cfg.fragments}",
                        now, fatal=True, field="layout")
        return False
    if cfg.software is not None:   # after the builder: a test's stub builder need not know it
        session = {**session, "software": cfg.software}
    session = OM.pin(session, cfg.outer)   # the outer mode islands follow (a dense run's session as before)
    s.session = session
    s.init_island = ev.island
    s.layout_fp = fp
    s.enter(Phase.INIT, "session pinned")
    out.emit(WriteSession(session))
    out.tape("session", now, island=ev.island, gen=ev.gen,
                  reason=f"session pinned by {ev.island}, the INIT island",
                  detail={"session_fingerprint": session.get("session_fingerprint"), "layout_fingerprint": fp})
    return True


def _admit(s: MachineState, cfg: SyncerConfig, out: Output, ev: Hello, now: float) -> None:
    m = Member(island=ev.island, gen=ev.gen, layout_fingerprint=ev.layout_fingerprint,
               admitted_at=now, last_heartbeat=now, reported_at=now)
    if s.phase in (Phase.RUNNING, Phase.FINALIZING):
        m.ref_step, m.ref_local = s.next_step - 1, 0.0
    s.members[ev.island] = m
    s.counters["join"] += 1
    out.write_member(m)
    out.tape("join", now, island=ev.island, gen=ev.gen, reason="admitted", detail=_stated(ev.software))
    init_rules.replay_held(s, cfg, out, m, now)


def new_generation(s: MachineState, cfg: SyncerConfig, out: Output, m: Member, gen: str, now: float, *, mirrored: bool = False,
                   software: str | None = None) -> None:
    """A new process of a member (`mirrored`: a follower shard read it from the members KV; the
    coordinator wrote and taped it already; `software`: the release its hello states)."""
    old = m.gen
    m.retired_gens.add(old)
    m.gen, m.live, m.left = gen, True, False
    m.admitted_at = m.last_heartbeat = m.reported_at = now
    m.reported_step, m._hb_step, m._hb_at = 0, None, None   # local steps restart with the process
    if s.phase in (Phase.RUNNING, Phase.FINALIZING):
        m.ref_step, m.ref_local = s.next_step - 1, 0.0
    s.counters["join.new_gen"] += 1
    if not mirrored:
        out.write_member(m)
        out.tape("join", now, island=m.island, gen=m.gen, reason=f"new generation (was {old})",
                      detail=_stated(software))
    if m.island == s.init_island and s.phase == Phase.INIT:
        # The new process sends every fragment again; what the old one sent must not be mixed in.
        dropped = sorted(s.initialized)
        s.initialized.clear()
        s.init_chunks.clear()
        s.held_init.pop(old, None)
        init_rules.drop_held_chunks(s, cfg, out, old, "generation retired")
        s.counters["init.restart"] += 1
        out.tape("session", now, island=m.island, gen=m.gen,
                      reason=f"INIT restarts with the INIT island's new generation {m.gen} (was {old})",
                      detail={"dropped_fragments": dropped})
        init_rules.replay_held(s, cfg, out, m, now)
    # rebind unanswered slots; an answered slot keeps the old generation's accepted push
    for step in sorted(s.rounds):
        r = s.rounds[step]
        slot = r.slots.get(m.island)
        if r.accepting and slot is not None and slot.answer is None and slot.gen != m.gen:
            slot.gen, slot.refused = m.gen, None   # the new generation answers afresh
            r.seq += 1
            s.counters["pull.rebound"] += 1
            out.emit(PublishPull(r.pull()))
    if s.final is not None:
        # A new process trains on unless it installs the final cut: it becomes the target, even
        # if its previous generation had acked.
        s.final.acked.discard(m.island)
        finalize.final_target(s, cfg, out, m, now)


def on_heartbeat(s: MachineState, cfg: SyncerConfig, out: Output, ev: Heartbeat, now: float) -> None:
    if not cfg.coordinator:
        s.counters["ignored.not_owner"] += 1   # sharded: only shard 0 takes these (sharding.py)
        return
    m = s.members.get(ev.island)
    if m is None or (ev.gen != m.gen and ev.gen not in m.retired_gens):
        # The syncer has no record of this generation (e.g. a resumed syncer whose members KV
        # missed it, or a hello lost with a killed syncer): the island trains, pushes nothing
        # useful and is never asked. Tell it to say hello again.
        s.counters["heartbeat.unknown"] += 1
        _ask_hello(s, cfg, out, ev.island, ev.gen, now)
        return
    if ev.gen != m.gen:
        s.counters["ignored.heartbeat_stale_gen"] += 1
        return
    if m.left:   # a heartbeat sent before its leaving one, delivered after it
        s.counters["ignored.heartbeat_after_leave"] += 1
        return
    if ev.leaving:
        leave(s, cfg, out, m, now, "the island said it is stopping (its last heartbeat)", said=True)
        return
    m.last_heartbeat = now
    m.observe_heartbeat(int(ev.local_step), ev.step_time_s, now)
    if not m.live:
        m.live = True
        s.counters["join.resumed"] += 1
        out.tape("join", now, island=m.island, gen=m.gen, reason="heartbeat resumed")
    out.write_member(m)
    f = s.final
    if f is not None and f.targets.get(m.island) != m.gen:
        finalize.final_target(s, cfg, out, m, now)


def leave(s: MachineState, cfg: SyncerConfig, out: Output, m: Member, now: float, reason: str, *, said: bool = False) -> None:
    """The member is gone for now: rounds stop waiting for it (round_rules: live members only), the
    final cut is not sent to it. A heartbeat of the same generation brings it back unless it said it
    leaves; a new generation (hello) always does."""
    if not m.live:
        return
    m.live = False
    m.left = m.left or said
    s.counters["leave"] += 1
    if said:
        s.counters["leave.said"] += 1
    out.write_member(m)
    out.tape("leave", now, island=m.island, gen=m.gen, reason=reason)


def _ask_hello(s: MachineState, cfg: SyncerConfig, out: Output, island: str, gen: str, now: float) -> None:
    """An island, or a generation of it, the machine has no record of (a resumed syncer that lost the
    members record, a hello lost with a killed syncer) is told to send hello again."""
    # Once per member timeout per generation: heartbeats come every few seconds, errors need not.
    last = s.hello_asked.get((island, gen))
    if last is not None and now - last < cfg.member_timeout_s:
        return
    s.hello_asked[(island, gen)] = now
    out.reject(island, gen, UNKNOWN_MEMBER,
                    f"island {island!r} generation {gen} is not a member of run {cfg.run} (the syncer has no "
                    f"record of it, e.g. after a restart): send hello again", now, fatal=False, field="gen")
