"""Golden fixtures of the round machine (torchft style): recorded event sequences and the actions they must
produce, as JSON under tests/fixtures/rounds/ — a normal run, a restart with an attempt bump, an island
that rejoins mid-round with a new generation, and finalization with a late island.

Each fixture holds the SyncerConfig and, per event fed, the event and the actions it produced (their
JSON form, services/syncer/actions.action_to_json). The test feeds the fixture's events to a fresh
machine (the real session builder, schemas.layout.build_session) and compares every action.

After an intended change of the machine's behaviour, rewrite the fixtures and review the diff:

    YETO_REGEN_GOLDEN=1 pytest tests/test_golden_rounds.py

(regeneration drives the scenarios below against the current machine and writes their events and
actions; the test then fails once, naming the files it wrote, so a regeneration is never silent).
"""
from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from yeto.schemas.layout import layout_fingerprint
from yeto.services.syncer.actions import action_from_json, action_to_json
from yeto.services.syncer.events import event_from_json, event_to_json
from yeto.services.syncer.actions import CommitV0, Merge, PublishFinal, PublishPull
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.events import (
    FinalAck, FinalPublished, Heartbeat, Hello, InitChunk, MergeDone, PushComplete, Tick, V0Done,
)
from yeto.services.syncer.rounds import RoundMachine

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "rounds"
REGEN = os.environ.get("YETO_REGEN_GOLDEN") == "1"
LAYOUT = [{"name": "embed.weight", "shape": [4, 2], "dtype": "float32"},
          {"name": "layers.0.w", "shape": [2, 2], "dtype": "float32"}]
FP = layout_fingerprint(LAYOUT)
GEN = {"a": "a1" * 8, "b": "b1" * 8, "c": "c1" * 8, "d": "d1" * 8}
B2 = "b2" * 8


def config(**kw) -> SyncerConfig:
    base = dict(run="golden", islands=2, fragments=2, sync_every=2, total_steps=2, strict=False,
                quorum_timeout_s=5.0, member_timeout_s=3.0, grace_ms=0.0, final_timeout_s=20.0)
    base.update(kw)
    return SyncerConfig(**base)


class Driver:
    """Feeds events to a machine and keeps (event, actions) for the fixture."""

    def __init__(self, cfg: SyncerConfig):
        self.cfg = cfg
        self.m = RoundMachine(cfg)
        self.steps: list[dict] = []
        self.pulls: dict[tuple[int, str], dict] = {}   # (step, island) -> newest pull naming it
        self.merge: Merge | None = None

    def feed(self, ev) -> list:
        acts = self.m.handle(ev)
        self.steps.append({"event": event_to_json(ev), "actions": [action_to_json(a) for a in acts]})
        for a in acts:
            if isinstance(a, PublishPull):
                for mem in a.pull["members"]:
                    self.pulls[(a.pull["step"], mem["island"])] = a.pull
            if isinstance(a, Merge):
                self.merge = a
        return acts

    def hello(self, island, now, gen=None):
        return self.feed(Hello(island, gen or GEN[island], LAYOUT, FP, "auto", "auto", now))

    def start(self, islands, now=0.0):
        for isl in islands:
            self.hello(isl, now)
        acts = []
        for f in range(self.cfg.fragments):
            acts += self.feed(InitChunk(islands[0], GEN[islands[0]], f, 0, 1, now + 0.1))
        assert any(isinstance(a, CommitV0) for a in acts)
        self.feed(V0Done(now + 0.5))

    def beat(self, island, local_step, now, gen=None, step_time_s=0.1):
        return self.feed(Heartbeat(island, gen or GEN[island], local_step, step_time_s, now))

    def push(self, island, step, now, *, gen=None, tokens=100, local=5, try_=0):
        pull = self.pulls[(step, island)]
        return self.feed(PushComplete(island, gen or GEN[island], pull["fragment"], step, pull["attempt"], try_,
                                      pull["base_version"], local, local, tokens, True, None, now,
                                      norm=0.25 * tokens / 100, non_finite=0))

    def merge_done(self, now):
        mg, self.merge = self.merge, None
        assert mg is not None, "no Merge outstanding"
        return self.feed(MergeDone(mg.step, mg.fragment, mg.version, 0.2, now))

    def final(self, now, acks):
        self.feed(FinalPublished(now))
        acts = []
        for island, gen in acks:
            acts += self.feed(FinalAck(island, gen, self.cfg.total_steps, now + 0.1))
        return acts


def normal_run() -> Driver:
    """Two islands, two fragments, two rounds launched by the pacing rules, the final cut, both ack."""
    d = Driver(config())
    d.start(["a", "b"])
    t = 1.0
    for step in (1, 2):
        for isl in ("a", "b"):
            d.beat(isl, step, t)
        d.feed(Tick(t + 0.2))
        d.push("a", step, t + 0.3, tokens=100)
        d.push("b", step, t + 0.4, tokens=300)
        d.merge_done(t + 0.6)
        t += 1.0
    d.final(t, [("a", GEN["a"]), ("b", GEN["b"])])
    assert d.m.phase == "done"
    return d


def restart_attempt_bump() -> Driver:
    """Round 1 below quorum at its deadline: restarted with attempt 2 (release, re-broadcast, new pull)."""
    d = Driver(config(total_steps=1, member_timeout_s=30.0))
    d.start(["a", "b"])
    d.beat("a", 1, 1.0)
    d.beat("b", 1, 1.0)
    d.feed(Tick(1.2))
    d.push("a", 1, 1.5)
    for t in (2.0, 4.0, 6.0):          # both heartbeat, b never answers attempt 1; its deadline (5.5) passes
        d.beat("a", int(t), t)
        d.beat("b", int(t), t)
    d.feed(Tick(6.3))
    assert d.pulls[(1, "a")]["attempt"] == 2
    d.push("a", 1, 6.5, tokens=120)
    d.push("b", 1, 6.6, tokens=80)
    d.merge_done(7.0)
    d.final(7.5, [("a", GEN["a"]), ("b", GEN["b"])])
    assert d.m.phase == "done"
    return d


def rejoin_mid_round() -> Driver:
    """b restarts (new generation) while round 1 waits for it: its slot is rebound and the pull re-published;
    a push of the old generation is refused (unexpected member), the new one's is merged."""
    d = Driver(config(total_steps=1))
    d.start(["a", "b"])
    d.beat("a", 1, 1.0)
    d.beat("b", 1, 1.0)
    d.feed(Tick(1.2))
    d.push("a", 1, 1.4)
    d.hello("b", 1.6, gen=B2)
    assert d.pulls[(1, "b")]["members"][1]["gen"] == B2
    d.push("b", 1, 1.7, gen=GEN["b"])
    d.beat("b", 0, 1.8, gen=B2)
    d.push("b", 1, 1.9, gen=B2, local=1)
    d.merge_done(2.2)
    d.final(2.5, [("a", GEN["a"]), ("b", B2)])
    assert d.m.phase == "done"
    return d


def final_late_island() -> Driver:
    """Three islands; c goes silent and leaves before the last round, so finalization targets a and b;
    c heartbeats again while the cut is published and becomes a target (manifest once the cut is out);
    an unknown island's hello is refused; the run ends when a, b and c acked."""
    d = Driver(config(islands=3, total_steps=1, sync_every=4))
    d.start(["a", "b", "c"])
    for t, local in ((1.0, 0), (3.5, 1)):   # slow steps: round 1 waits for every live member's progress
        d.beat("a", local, t, step_time_s=10.0)
        d.beat("b", local, t, step_time_s=10.0)
    # c, silent since 0.0, left at 3.5 (member timeout 3 s): round 1 is a and b's
    assert d.pulls[(1, "a")]["members"] == [{"island": "a", "gen": GEN["a"]}, {"island": "b", "gen": GEN["b"]}]
    d.feed(Tick(3.6))
    d.push("a", 1, 3.9)
    acts = d.push("b", 1, 4.0)
    assert any(isinstance(a, Merge) for a in acts)
    acts = d.merge_done(4.2)
    assert any(isinstance(a, PublishFinal) for a in acts)
    d.beat("c", 7, 4.3)                # back while the cut is being published: a target, no manifest yet
    d.hello("d", 4.4)                  # unknown island: run_finishing
    d.final(4.5, [("a", GEN["a"]), ("b", GEN["b"]), ("c", GEN["c"])])
    assert d.m.phase == "done"
    return d


SCENARIOS = {f.__name__: f for f in (normal_run, restart_attempt_bump, rejoin_mid_round, final_late_island)}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden(name):
    path = FIXTURES / f"{name}.json"
    if REGEN:
        d = SCENARIOS[name]()
        FIXTURES.mkdir(parents=True, exist_ok=True)
        fixture = {"scenario": name, "description": " ".join(SCENARIOS[name].__doc__.split()),
                   "config": d.cfg.__dict__, "steps": d.steps}
        path.write_bytes(orjson.dumps(fixture, option=orjson.OPT_INDENT_2) + b"\n")
        pytest.fail(f"YETO_REGEN_GOLDEN=1: rewrote {path}; review its diff, then run without the switch")
    fixture = orjson.loads(path.read_bytes())
    m = RoundMachine(SyncerConfig(**fixture["config"]))
    for i, step in enumerate(fixture["steps"]):
        event = event_from_json(step["event"])
        assert event_to_json(event) == step["event"]                 # the JSON form round-trips
        got = [action_to_json(a) for a in m.handle(event)]
        assert got == step["actions"], (
            f"{path.name} event #{i} {step['event']['type']}: actions differ from the fixture "
            f"(an intended change? see this module's docstring)")
        for a in step["actions"]:
            assert action_to_json(action_from_json(a)) == a
