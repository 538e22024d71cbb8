"""INIT and version 0: which generation's chunks make version 0 (rules of `RoundMachine`).

Rule functions of services/syncer/rounds.RoundMachine over (state, config, output): see machine_state.py.

- **Version 0**: the machine emits `CommitV0(fragments)` once every fragment is initialized and
  `islands` members are live; the shell commits v0 of every fragment durably, broadcasts it, then
  feeds back a single `V0Done(now)`. Rounds launch only after that.
- **INIT and generations**: version 0 comes from one process of the INIT island. The shell feeds
  each INIT chunk whose framing it checked as `InitChunk` and keeps its bytes until the machine
  answers `InitStore` (write them) or `InitDrop` (free them) — exactly one per chunk; which chunks
  are taken, refused or held is `on_init_chunk`'s doc (`on_init`: a whole fragment at once). A new
  generation of the INIT island while `phase == "init"` clears every initialized fragment (counter
  `init.restart`, a `session` tape record): INIT restarts with the new process, which sends everything
  again. Once `CommitV0` is out, INIT is over: a new generation changes nothing about version 0.
"""
from __future__ import annotations

from yeto.services.syncer.events import InitChunk, InitComplete, V0Done
from yeto.services.syncer.actions import InitDrop, InitStore
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.machine_state import MachineState, Output
from yeto.services.syncer.state import Member, Phase


def on_init(s: MachineState, cfg: SyncerConfig, out: Output, ev: InitComplete, now: float) -> None:
    """A whole fragment at once (for callers that check fragments themselves), under `on_init_chunk`'s
    generation rules: one of a retired generation is ignored (`ignored.init_stale_gen`), one of an unseen
    generation held (`init.held`) and replayed at its hello."""
    if s.session is None or ev.island != s.init_island:
        out.reject(ev.island, ev.gen, "not_init_island",
                        f"INIT data is taken only from the INIT island {s.init_island!r}",
                        now, fatal=False, field="island")
        return
    m = s.members.get(ev.island)   # None only on a follower shard that has not read its record yet
    if m is not None and ev.gen in m.retired_gens:
        s.counters["ignored.init_stale_gen"] += 1
        out.tape("error", now, island=ev.island, gen=ev.gen, fragment=ev.fragment,
                      reason="INIT of fragment from a stale generation ignored")
        return
    if s.phase != Phase.INIT:
        s.counters["ignored.init_late"] += 1
        return
    if m is None or ev.gen != m.gen:
        # Its hello is not in yet (another consumer): keep it until that generation is admitted.
        s.held_init.setdefault(ev.gen, {})[ev.fragment] = ev
        s.counters["init.held"] += 1
        return
    if not 0 <= ev.fragment < cfg.fragments or not cfg.owns(ev.fragment):
        out.reject(ev.island, ev.gen, "bad_fragment",
                        f"fragment {ev.fragment} outside 0..{cfg.fragments - 1}", now,
                        fatal=False, field="fragment")
        return
    if ev.fragment in s.initialized:
        s.counters["ignored.init_duplicate"] += 1
        return
    s.initialized.add(ev.fragment)
    s.counters["init.fragment"] += 1


def replay_held(s: MachineState, cfg: SyncerConfig, out: Output, m: Member, now: float) -> None:
    held = s.held_init.pop(m.gen, None) if m.island == s.init_island else None
    for f in sorted(held or ()):
        s.counters["init.replayed"] += 1
        on_init(s, cfg, out, held[f], now)
    if m.island == s.init_island:
        for g in sorted(m.retired_gens & set(s.held_chunks)):
            drop_held_chunks(s, cfg, out, g, "generation retired")
        chunks = s.held_chunks.pop(m.gen, {})
        for key in sorted(chunks):
            s.counters["init.chunk_replayed"] += 1
            on_init_chunk(s, cfg, out, chunks[key], now)


def drop_held_chunks(s: MachineState, cfg: SyncerConfig, out: Output, gen: str, reason: str) -> None:
    for (f, k) in sorted(s.held_chunks.pop(gen, {})):
        s.counters["init.held_dropped"] += 1
        out.emit(InitDrop(gen, f, k, reason))


def _refuse_init_chunk(s: MachineState, cfg: SyncerConfig, out: Output, ev: InitChunk, code: str, message: str, now: float, field: str) -> None:
    # Counted and taped, never answered on ctl.to: a flood of bad chunks must not become a flood
    # of error messages (and the process that sent a stale generation's chunks is gone).
    s.counters[f"rejected.{code}"] += 1
    out.tape("error", now, island=ev.island, gen=ev.gen, fragment=ev.fragment,
                  reason=f"{code}: {message}", detail={"code": code, "field": field, "chunk": ev.chunk})
    out.emit(InitDrop(ev.gen, ev.fragment, ev.chunk, code))


MAX_HELD_GENS = 2   # unseen INIT generations whose chunks are held at once (a restart races its hello)


def on_init_chunk(s: MachineState, cfg: SyncerConfig, out: Output, ev: InitChunk, now: float) -> None:
    """Version 0 comes from one process (generation) of the INIT island: a fragment's chunks are
    taken from one generation; a chunk of the island's current generation starts a fragment that
    holds another generation's chunks over. A chunk of a retired generation is refused (`stale_gen`),
    one of another island (`not_init_island`) or fragment (`unknown_fragment`) too: counted and taped,
    no error message (a flood of chunks must not become a flood of errors). A chunk of a generation not
    seen yet (its hello comes through another consumer, CTL, so it may arrive later) is *held* — no
    waiting — and replayed when that generation's hello is admitted; at most `MAX_HELD_GENS` unseen
    generations are held (a further one is refused, `unknown_gen`), and held chunks are dropped when
    their generation is retired or version 0 is decided."""
    if s.session is None or ev.island != s.init_island:
        _refuse_init_chunk(s, cfg, out, ev, "not_init_island",
                                f"INIT data is taken only from the INIT island {s.init_island!r}", now, "island")
        return
    m = s.members.get(ev.island)   # None only on a follower shard that has not read its record yet
    if m is not None and ev.gen in m.retired_gens:
        _refuse_init_chunk(s, cfg, out, ev, "stale_gen", f"INIT chunk of a retired generation of {ev.island} (a restarted "
                                f"process resends everything)", now, "gen")
        return
    if not 0 <= ev.fragment < cfg.fragments:
        _refuse_init_chunk(s, cfg, out, ev, "unknown_fragment", f"fragment {ev.fragment} outside "
                                f"0..{cfg.fragments - 1}", now, "fragment")
        return
    if not cfg.owns(ev.fragment):
        _refuse_init_chunk(s, cfg, out, ev, "unknown_fragment", f"fragment {ev.fragment} belongs to another shard "
                                f"(this is shard {cfg.shard} of {cfg.shards})", now, "fragment")
        return
    if s.phase != Phase.INIT:
        # Version 0 is decided (or committed): INIT bytes can no longer change it.
        s.counters["init.late_chunk"] += 1
        out.emit(InitDrop(ev.gen, ev.fragment, ev.chunk, "late"))
        return
    if m is None or ev.gen != m.gen:
        held = s.held_chunks.get(ev.gen)
        if held is None and len(s.held_chunks) >= MAX_HELD_GENS:
            _refuse_init_chunk(s, cfg, out, ev, "unknown_gen", f"INIT chunk of generation {ev.gen}, whose hello the syncer "
                                    f"has not admitted ({MAX_HELD_GENS} unseen generations held already)",
                                    now, "gen")
            return
        key = (ev.fragment, ev.chunk)
        if held is not None and key in held:
            s.counters["init.duplicate_chunk"] += 1
            out.emit(InitDrop(ev.gen, ev.fragment, ev.chunk, "duplicate"))
            return
        s.held_chunks.setdefault(ev.gen, {})[key] = ev
        s.counters["init.held_chunk"] += 1
        return
    gen, count, stored = s.init_chunks.get(ev.fragment, (None, ev.chunks, set()))
    if gen is not None and gen != ev.gen:
        s.counters["init.restart_fragment"] += 1
        out.tape("session", now, island=ev.island, gen=ev.gen, fragment=ev.fragment,
                      reason=f"INIT of fragment {ev.fragment} starts over with generation {ev.gen} "
                          f"(had {len(stored)}/{count} chunks of generation {gen})")
        s.initialized.discard(ev.fragment)
        gen, count, stored = None, ev.chunks, set()
    if ev.fragment in s.initialized or ev.chunk in stored or ev.chunks != count or not 0 <= ev.chunk < count:
        s.counters["init.duplicate_chunk"] += 1
        out.emit(InitDrop(ev.gen, ev.fragment, ev.chunk, "duplicate"))
        return
    stored.add(ev.chunk)
    s.init_chunks[ev.fragment] = (ev.gen, count, stored)
    out.emit(InitStore(ev.gen, ev.fragment, ev.chunk))
    if len(stored) == count:
        s.initialized.add(ev.fragment)
        s.counters["init.fragment"] += 1


def on_v0_done(s: MachineState, cfg: SyncerConfig, out: Output, ev: V0Done, now: float) -> None:
    if s.phase != Phase.COMMITTING_V0:
        raise ValueError(f"V0Done in phase {s.phase!r}: no CommitV0 outstanding")
    s.versions = {f: 0 for f in cfg.own_fragments}
    s.enter(Phase.RUNNING, "V0Done")
    s.last_launch_at = now
    s.last_launch_step = 0
    for m in s.members.values():
        m.ref_step, m.ref_local = 0, m.est_local(now)
    out.tape("session", now, reason="version 0 committed", detail={"versions": {str(k): v for k, v in s.versions.items()}})
