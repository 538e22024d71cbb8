"""INIT and version 0: which generation's chunks make version 0 (a part of `RoundMachine`).

A rule part of services/syncer/rounds.RoundMachine (see services/syncer/membership.py).

- **Version 0**: the machine emits `CommitV0(fragments)` once every fragment is initialized and
  `islands` members are live; the shell commits v0 of every fragment durably, broadcasts it, then
  feeds back a single `V0Done(now)`. Rounds launch only after that.
- **INIT and generations**: version 0 comes from one process of the INIT island. The shell feeds
  each INIT chunk whose framing it checked as `InitChunk` and keeps its bytes until the machine
  answers `InitStore` (write them) or `InitDrop` (free them) — exactly one per chunk. A fragment's
  chunks come from one generation; a chunk of a retired generation is refused (`stale_gen`), one of
  another island (`not_init_island`) or fragment (`unknown_fragment`) too: counted and taped, no
  error message (a flood of chunks must not become a flood of errors). A chunk of a generation not
  seen yet (its hello comes through another consumer, so it may arrive later) is *held* — no
  waiting — and replayed when that generation's hello is admitted; at most `MAX_HELD_GENS` unseen
  generations are held (a further one is refused, `unknown_gen`), and held chunks are dropped when
  their generation is retired or version 0 is decided. A new generation of the INIT island while
  `phase == "init"` clears every initialized fragment (counter `init.restart`, a `session` tape
  record): INIT restarts with the new process, which sends everything again. `InitComplete` (a whole
  fragment at once) follows the same generation rules for callers that check fragments themselves:
  one of a retired generation is ignored (`ignored.init_stale_gen`), one of an unseen generation held
  (`init.held`) and replayed at its hello. Once `CommitV0` is out, INIT is over: a new generation
  changes nothing about version 0.
"""
from __future__ import annotations

from yeto.services.syncer.events import InitChunk, InitComplete, V0Done
from yeto.services.syncer.actions import InitDrop, InitStore
from yeto.services.syncer.machine_state import Part
from yeto.services.syncer.state import Member, Phase


class InitRules(Part):
    def on_init(self, ev: InitComplete, now: float) -> None:
        if self.s.session is None or ev.island != self.s.init_island:
            self.out.reject(ev.island, ev.gen, "not_init_island",
                            f"INIT data is taken only from the INIT island {self.s.init_island!r}",
                            now, fatal=False, field="island")
            return
        m = self.s.members.get(ev.island)   # None only on a follower shard that has not read its record yet
        if m is not None and ev.gen in m.retired_gens:
            self.s.counters["ignored.init_stale_gen"] += 1
            self.out.tape("error", now, island=ev.island, gen=ev.gen, fragment=ev.fragment,
                          reason="INIT of fragment from a stale generation ignored")
            return
        if self.s.phase != Phase.INIT:
            self.s.counters["ignored.init_late"] += 1
            return
        if m is None or ev.gen != m.gen:
            # Its hello is not in yet (another consumer): keep it until that generation is admitted.
            self.s.held_init.setdefault(ev.gen, {})[ev.fragment] = ev
            self.s.counters["init.held"] += 1
            return
        if not 0 <= ev.fragment < self.config.fragments or not self.config.owns(ev.fragment):
            self.out.reject(ev.island, ev.gen, "bad_fragment",
                            f"fragment {ev.fragment} outside 0..{self.config.fragments - 1}", now,
                            fatal=False, field="fragment")
            return
        if ev.fragment in self.s.initialized:
            self.s.counters["ignored.init_duplicate"] += 1
            return
        self.s.initialized.add(ev.fragment)
        self.s.counters["init.fragment"] += 1

    def replay_held(self, m: Member, now: float) -> None:
        held = self.s.held_init.pop(m.gen, None) if m.island == self.s.init_island else None
        for f in sorted(held or ()):
            self.s.counters["init.replayed"] += 1
            self.on_init(held[f], now)
        if m.island == self.s.init_island:
            for g in sorted(m.retired_gens & set(self.s.held_chunks)):
                self.drop_held_chunks(g, "generation retired")
            chunks = self.s.held_chunks.pop(m.gen, {})
            for key in sorted(chunks):
                self.s.counters["init.chunk_replayed"] += 1
                self.on_init_chunk(chunks[key], now)

    def drop_held_chunks(self, gen: str, reason: str) -> None:
        for (f, k) in sorted(self.s.held_chunks.pop(gen, {})):
            self.s.counters["init.held_dropped"] += 1
            self.out.emit(InitDrop(gen, f, k, reason))

    def _refuse_init_chunk(self, ev: InitChunk, code: str, message: str, now: float, field: str) -> None:
        # Counted and taped, never answered on ctl.to: a flood of bad chunks must not become a flood
        # of error messages (and the process that sent a stale generation's chunks is gone).
        self.s.counters[f"rejected.{code}"] += 1
        self.out.tape("error", now, island=ev.island, gen=ev.gen, fragment=ev.fragment,
                      reason=f"{code}: {message}", detail={"code": code, "field": field, "chunk": ev.chunk})
        self.out.emit(InitDrop(ev.gen, ev.fragment, ev.chunk, code))

    MAX_HELD_GENS = 2   # unseen INIT generations whose chunks are held at once (a restart races its hello)

    def on_init_chunk(self, ev: InitChunk, now: float) -> None:
        """Version 0 comes from one process (generation) of the INIT island: a fragment's chunks are
        taken from one generation; a chunk of the island's current generation starts a fragment that
        holds another generation's chunks over; a retired generation's chunk is refused; a chunk of a
        generation not seen yet is held until its hello (CTL and INIT are separate consumers)."""
        if self.s.session is None or ev.island != self.s.init_island:
            self._refuse_init_chunk(ev, "not_init_island",
                                    f"INIT data is taken only from the INIT island {self.s.init_island!r}", now, "island")
            return
        m = self.s.members.get(ev.island)   # None only on a follower shard that has not read its record yet
        if m is not None and ev.gen in m.retired_gens:
            self._refuse_init_chunk(ev, "stale_gen", f"INIT chunk of a retired generation of {ev.island} (a restarted "
                                    f"process resends everything)", now, "gen")
            return
        if not 0 <= ev.fragment < self.config.fragments:
            self._refuse_init_chunk(ev, "unknown_fragment", f"fragment {ev.fragment} outside "
                                    f"0..{self.config.fragments - 1}", now, "fragment")
            return
        if not self.config.owns(ev.fragment):
            self._refuse_init_chunk(ev, "unknown_fragment", f"fragment {ev.fragment} belongs to another shard "
                                    f"(this is shard {self.config.shard} of {self.config.shards})", now, "fragment")
            return
        if self.s.phase != Phase.INIT:
            # Version 0 is decided (or committed): INIT bytes can no longer change it.
            self.s.counters["init.late_chunk"] += 1
            self.out.emit(InitDrop(ev.gen, ev.fragment, ev.chunk, "late"))
            return
        if m is None or ev.gen != m.gen:
            held = self.s.held_chunks.get(ev.gen)
            if held is None and len(self.s.held_chunks) >= self.MAX_HELD_GENS:
                self._refuse_init_chunk(ev, "unknown_gen", f"INIT chunk of generation {ev.gen}, whose hello the syncer "
                                        f"has not admitted ({self.MAX_HELD_GENS} unseen generations held already)",
                                        now, "gen")
                return
            key = (ev.fragment, ev.chunk)
            if held is not None and key in held:
                self.s.counters["init.duplicate_chunk"] += 1
                self.out.emit(InitDrop(ev.gen, ev.fragment, ev.chunk, "duplicate"))
                return
            self.s.held_chunks.setdefault(ev.gen, {})[key] = ev
            self.s.counters["init.held_chunk"] += 1
            return
        gen, count, stored = self.s.init_chunks.get(ev.fragment, (None, ev.chunks, set()))
        if gen is not None and gen != ev.gen:
            self.s.counters["init.restart_fragment"] += 1
            self.out.tape("session", now, island=ev.island, gen=ev.gen, fragment=ev.fragment,
                          reason=f"INIT of fragment {ev.fragment} starts over with generation {ev.gen} "
                              f"(had {len(stored)}/{count} chunks of generation {gen})")
            self.s.initialized.discard(ev.fragment)
            gen, count, stored = None, ev.chunks, set()
        if ev.fragment in self.s.initialized or ev.chunk in stored or ev.chunks != count or not 0 <= ev.chunk < count:
            self.s.counters["init.duplicate_chunk"] += 1
            self.out.emit(InitDrop(ev.gen, ev.fragment, ev.chunk, "duplicate"))
            return
        stored.add(ev.chunk)
        self.s.init_chunks[ev.fragment] = (ev.gen, count, stored)
        self.out.emit(InitStore(ev.gen, ev.fragment, ev.chunk))
        if len(stored) == count:
            self.s.initialized.add(ev.fragment)
            self.s.counters["init.fragment"] += 1

    def on_v0_done(self, ev: V0Done, now: float) -> None:
        if self.s.phase != Phase.COMMITTING_V0:
            raise ValueError(f"V0Done in phase {self.s.phase!r}: no CommitV0 outstanding")
        self.s.versions = {f: 0 for f in self.config.own_fragments}
        self.s.enter(Phase.RUNNING, "V0Done")
        self.s.last_launch_at = now
        self.s.last_launch_step = 0
        for m in self.s.members.values():
            m.ref_step, m.ref_local = 0, m.est_local(now)
        self.out.tape("session", now, reason="version 0 committed", detail={"versions": {str(k): v for k, v in self.s.versions.items()}})
