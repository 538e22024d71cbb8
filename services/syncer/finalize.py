"""Finalization: the final cut, manifests, acks, the end of the run (rules of `RoundMachine`).

Rule functions of services/syncer/rounds.RoundMachine over (state, config, output): see machine_state.py.

- **Finalization** is decided here, carried out by the shell: once every step is committed the
  machine emits one `PublishFinal` (the f32 cut; never a second one), and only after its
  `FinalPublished` a `SendManifest` per target (live members), so a manifest always carries every
  fragment's digest. A known island heard from during finalization with a generation that is not the
  target (a new generation, or a heartbeat of a member that was not live when finalization began)
  becomes the target and gets the manifest as soon as the cut is out — even if an earlier generation
  acked — so no process trains on after the syncer exits. Hellos of unknown islands get a fatal
  `run_finishing` error. `RecordFinal` keeps targets and acks durable so a resumed syncer continues
  finalization (or, when the run finished, exits at once).
"""
from __future__ import annotations

from yeto.services.syncer.actions import Done, PublishFinal, RecordFinal, SendManifest, Shutdown
from yeto.services.syncer.events import FinalAck, FinalPublished
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.machine_state import MachineState, Output
from yeto.services.syncer.state import Member, Phase, _Final


def start_final(s: MachineState, cfg: SyncerConfig, out: Output, now: float) -> None:
    targets = {m.island: m.gen for m in s.live()}
    f = s.final = _Final(final_step=s.committed_step, started_at=now, targets=targets,
                              versions=dict(s.versions))
    s.enter(Phase.FINALIZING, "every step committed: final cut")
    out.emit(PublishFinal(f.final_step, dict(f.versions), f.record()))
    out.tape("final", now, step=s.committed_step, reason="final cut publishing",
                  detail={"versions": {str(k): v for k, v in s.versions.items()},
                       "targets": [{"island": i, "gen": g} for i, g in sorted(targets.items())]})


def on_final_published(s: MachineState, cfg: SyncerConfig, out: Output, ev: FinalPublished, now: float) -> None:
    # (sharded: the machine hands FinalPublished to sharding.shard_final_published instead)
    f = s.final
    if f is None or f.cut_out:
        raise ValueError("FinalPublished without an outstanding PublishFinal")
    f.cut_out = True
    out.emit(RecordFinal(f.record()))
    out.tape("final", now, step=f.final_step, reason="final cut published",
                  detail={"targets": [{"island": i, "gen": g} for i, g in sorted(f.targets.items())]})
    for island, gen in sorted(f.targets.items()):
        if island not in f.acked:
            out.emit(SendManifest(island, gen, f.final_step, dict(f.versions)))
    if not f.targets or f.acked >= set(f.targets):
        finish(s, cfg, out, True, now)


def final_target(s: MachineState, cfg: SyncerConfig, out: Output, m: Member, now: float) -> None:
    """A known island heard from during finalization with a generation that is not the target:
    it must install the final cut and ack (once the cut is out, it gets the manifest now)."""
    f = s.final
    if m.island in f.acked:
        return
    f.targets[m.island] = m.gen
    s.counters["final.target_added"] += 1
    out.tape("final", now, step=f.final_step, island=m.island, gen=m.gen,
                  reason="manifest target: a known island came back during finalization")
    if f.cut_out:
        out.emit(RecordFinal(f.record()))
        out.emit(SendManifest(m.island, m.gen, f.final_step, dict(f.versions)))


def on_final_ack(s: MachineState, cfg: SyncerConfig, out: Output, ev: FinalAck, now: float) -> None:
    if not cfg.coordinator:
        s.counters["ignored.not_owner"] += 1   # sharded: only shard 0 takes acks (sharding.py)
        return
    f = s.final
    if f is None or not f.cut_out or f.targets.get(ev.island) != ev.gen or ev.final_step != f.final_step:
        s.counters["rejected.final_ack"] += 1
        out.tape("error", now, island=ev.island, gen=ev.gen,
                      reason=f"final ack for step {ev.final_step} ignored: not a target of the final cut")
        return
    if ev.island in f.acked:
        s.counters["ignored.final_ack_duplicate"] += 1
        return
    f.acked.add(ev.island)
    s.counters["final.ack"] += 1
    if f.acked == set(f.targets):
        finish(s, cfg, out, True, now)
    else:
        out.emit(RecordFinal(f.record()))


def finish(s: MachineState, cfg: SyncerConfig, out: Output, ok: bool, now: float) -> None:
    f = s.final
    for island in sorted(f.acked):
        out.emit(Shutdown(island, f.targets[island], "final"))
    missing = tuple(sorted(set(f.targets) - f.acked))
    if f.cut_out:
        out.emit(RecordFinal(f.record(finished=True)))
    out.tape("final", now, step=f.final_step,
                  reason="all targets acked" if ok else f"final timeout: no ack from {', '.join(missing)}")
    out.emit(Done(ok, missing))
    s.enter(Phase.DONE, "all targets acked" if ok else "final timeout")
