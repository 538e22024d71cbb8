"""Sharded round machines (services/syncer/sharding.py), driven by hand-built events: no broker, no clock.

`Cluster` wires N machines the way the shell wires them through NATS: the coordinator's WriteSession /
WriteMember reach the other shards as SessionSeen / MemberSeen, a shard's PublishShardFinal comes back
as FinalPublished (and reaches the coordinator as ShardFinal), CommitV0 as V0Done. The reference is an
unsharded machine fed the same island behaviour.
"""
from __future__ import annotations

import pytest

from yeto.schemas.errors import ConfigError
from yeto.services.syncer import round_rules
from yeto.services.syncer.actions import action_from_json, action_to_json
from yeto.services.syncer.events import event_from_json, event_to_json
from yeto.services.syncer.actions import (
    AdoptSession, CommitV0, Done, Merge, PublishFinal, PublishPull, PublishShardFinal, RecordFinal, SendManifest,
    Shutdown, WriteMember, WriteSession,
)
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.events import (
    FinalAck, FinalPublished, Heartbeat, Hello, InitComplete, MemberSeen, MergeDone, PushComplete, SessionSeen,
    ShardFinal, Tick, V0Done,
)
from yeto.services.syncer.rounds import RoundMachine

from tests.test_rounds import FP, GEN, LAYOUT, Builder, of, tapes

A2 = "a2" * 8


def cfg(**kw) -> SyncerConfig:
    base = dict(run="r1", islands=2, fragments=4, sync_every=4, total_steps=8, quorum_timeout_s=100.0,
                member_timeout_s=1000.0, grace_ms=0.0, final_timeout_s=50.0, strict=True)
    base.update(kw)
    return SyncerConfig(**base)


class Cluster:
    """N shards of one run, with what the shell and NATS carry between them (see the module docstring)."""

    def __init__(self, n: int, **kw):
        self.n = n
        self.m = [RoundMachine(cfg(shard=k, shards=n, **kw), session_builder=Builder()) for k in range(n)]
        self.out: list[tuple[int, object]] = []     # (shard, action) in the order they were produced
        self.merges: list[Merge] = []
        self.done: dict[int, Done] = {}

    def owner(self, fragment: int) -> int:
        return fragment % self.n

    def feed(self, k: int, ev) -> list:
        acts = self.m[k].handle(ev)
        for a in acts:
            self.out.append((k, a))
        for a in acts:
            self.route(k, a, ev.now)
        return acts

    def route(self, k: int, a, now: float) -> None:
        if isinstance(a, WriteSession) and self.n > 1:
            for j in range(1, self.n):
                self.feed(j, SessionSeen(a.session, now))
        elif isinstance(a, WriteMember) and self.n > 1:
            for j in range(1, self.n):
                self.feed(j, MemberSeen(a.island, a.record, now))
        elif isinstance(a, CommitV0):
            self.feed(k, V0Done(now))
        elif isinstance(a, Merge):
            self.merges.append(a)
        elif isinstance(a, PublishShardFinal):
            self.feed(k, FinalPublished(now))
            if k != 0:
                self.feed(0, ShardFinal(k, a.final_step, dict(a.versions), now))
        elif isinstance(a, PublishFinal):
            self.feed(k, FinalPublished(now))
        elif isinstance(a, Done):
            self.done[k] = a

    def actions(self, cls, shard=None) -> list:
        return [a for k, a in self.out if isinstance(a, cls) and (shard is None or k == shard)]

    def start(self, now: float = 0.0) -> None:
        for isl in ("a", "b"):
            self.feed(0, Hello(isl, GEN[isl], LAYOUT, FP, "auto", "auto", now))
        for f in range(self.m[0].config.fragments):
            self.feed(self.owner(f), InitComplete("a", GEN["a"], f, now))
        assert all(m.phase == "running" for m in self.m), [m.phase for m in self.m]

    def pull(self, step: int) -> dict:
        got = [a.pull for a in self.actions(PublishPull) if a.pull["step"] == step]
        assert got, f"no pull for step {step}"
        return got[-1]

    def answer(self, step: int, now: float, islands=("a", "b"), tokens=None) -> Merge:
        p = self.pull(step)
        k = self.owner(p["fragment"])
        n_before = len(self.merges)
        for i, isl in enumerate(islands):
            gen = next(mm["gen"] for mm in p["members"] if mm["island"] == isl)
            self.feed(k, PushComplete(isl, gen, p["fragment"], step, p["attempt"], 0, p["base_version"], step * 10, 5,
                                      (tokens or {}).get(isl, 100 + i), True, None, now))
        assert len(self.merges) == n_before + 1, f"step {step}: no merge after every member pushed"
        merge = self.merges[-1]
        self.feed(k, MergeDone(step, merge.fragment, merge.version, 0.1, now))
        return merge


def merge_key(a: Merge) -> tuple:
    return (a.step, a.fragment, a.attempt, a.version, a.base_version,
            tuple((mi.island, mi.gen, mi.try_, mi.weight) for mi in a.members))


def run_strict(n: int, steps: int = 8) -> tuple[list[tuple], list]:
    c = Cluster(n, total_steps=steps)
    c.start()
    merges = [merge_key(c.answer(t, now=float(t))) for t in range(1, steps + 1)]
    return merges, c


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_strict_run_merges_exactly_what_one_syncer_merges(n):
    ref, one = run_strict(1)
    got, c = run_strict(n)
    assert got == ref
    # each round ran on the shard that owns its fragment
    for k, a in c.out:
        if isinstance(a, Merge):
            assert a.fragment % n == k
    # the manifests carry every fragment's version, the same as one syncer's
    ref_manifests = {(a.island, a.gen, a.final_step, tuple(sorted(a.versions.items()))) for a in one.actions(SendManifest)}
    manifests = {(a.island, a.gen, a.final_step, tuple(sorted(a.versions.items()))) for a in c.actions(SendManifest)}
    assert manifests == ref_manifests and len(manifests) == 2
    assert all(k == 0 for k, a in c.out if isinstance(a, (SendManifest, Shutdown, WriteMember, WriteSession)))
    # followers are done once their cut is out; the coordinator after the acks
    assert set(c.done) == set(range(1, n))
    for isl in ("a", "b"):
        c.feed(0, FinalAck(isl, GEN[isl], 8, 9.0))
    assert c.done[0].ok and all(d.ok for d in c.done.values())
    finished = c.actions(RecordFinal, 0)[-1].record
    assert finished["finished"] and finished["versions"] == {str(f): 2 for f in range(4)}


def test_manifests_wait_for_every_shard_and_each_shard_publishes_only_its_fragments():
    c = Cluster(2, total_steps=4)
    c.start()
    # Shard 1's rounds (steps 2 and 4) answered first: it publishes its cut; no manifest yet.
    c.answer(2, 1.0)
    c.answer(4, 2.0)
    finals = c.actions(PublishShardFinal)
    assert [(a.final_step, a.versions) for a in finals] == [(4, {1: 1, 3: 1})]
    assert not c.actions(SendManifest) and 1 in c.done
    c.answer(1, 3.0)
    assert not c.actions(SendManifest)
    c.answer(3, 4.0)
    assert [a.versions for a in c.actions(PublishShardFinal, 0)] == [{0: 1, 2: 1}]
    assert {a.island for a in c.actions(SendManifest)} == {"a", "b"}
    assert c.actions(SendManifest)[0].versions == {0: 1, 1: 1, 2: 1, 3: 1}


def test_follower_mirrors_a_new_generation_and_rebinds_its_unanswered_slot():
    c = Cluster(2, total_steps=8)
    c.start()
    p2 = c.pull(2)                       # shard 1's round, launched at once in strict mode
    assert {m["island"]: m["gen"] for m in p2["members"]} == {"a": GEN["a"], "b": GEN["b"]}
    c.feed(0, Hello("a", A2, LAYOUT, FP, "auto", "auto", 1.0))
    rebound = [a.pull for a in c.actions(PublishPull, 1) if a.pull["step"] == 2]
    assert rebound[-1]["seq"] == 1 and {m["island"]: m["gen"] for m in rebound[-1]["members"]}["a"] == A2
    assert c.m[1].members["a"].gen == A2 and GEN["a"] in c.m[1].members["a"].retired_gens
    # the follower wrote and taped nothing about membership: the coordinator did
    assert not [t for t in tapes([a for k, a in c.out if k == 1], "join")]
    assert [t["reason"] for t in tapes([a for k, a in c.out if k == 0], "join")][-1].startswith("new generation")


def test_liveness_is_the_coordinators_a_follower_follows_it():
    c = Cluster(2, total_steps=8, strict=False, quorum=1, member_timeout_s=10.0)
    c.start()
    for k in (0, 1):
        c.feed(k, Tick(500.0))
    assert c.m[0].members["a"].live is False               # the coordinator judged it
    assert c.m[1].members["a"].live is False               # the follower read the coordinator's record
    c2 = Cluster(2, total_steps=8, strict=False, member_timeout_s=10.0)
    c2.start()
    c2.feed(1, Tick(500.0))                                # only the follower hears time pass
    assert c2.m[1].members["a"].live is True and c2.m[1].counters["leave"] == 0


def test_coordinator_heartbeats_carry_pacing_estimates_to_followers():
    c = Cluster(2, total_steps=8, strict=False)
    c.start()
    c.feed(0, Heartbeat("a", GEN["a"], 7, 0.25, 3.0))
    rec = c.actions(WriteMember, 0)[-1].record
    assert rec["ema_step_s"] == 0.25 and rec["reported_at"] == 3.0 and rec["last_step"] == 7
    m = c.m[1].members["a"]
    assert (m.ema_step_s, m.reported_step, m.reported_at) == (0.25, 7, 3.0)
    # one syncer's records stay as they were
    one = Cluster(1, total_steps=8, strict=False)
    one.start()
    one.feed(0, Heartbeat("a", GEN["a"], 7, 0.25, 3.0))
    assert "ema_step_s" not in one.actions(WriteMember, 0)[-1].record


def test_a_shards_rounds_are_paced_n_rounds_apart():
    # P = 4, H/P = 1 step per round; shard 1 of 2 runs steps 2, 4, 6, ...: with a step time of 1 s its
    # first round is due 2 rounds (2 s) after version 0, not 1 (b has no step time yet, so only the
    # time rule can launch it).
    c = Cluster(2, total_steps=8, strict=False, fragments=4, sync_every=4)
    c.start(now=0.0)
    c.feed(0, Heartbeat("a", GEN["a"], 0, 1.0, 0.0))
    f = c.m[1]
    t, live = round_rules.can_launch_now(f.state, f.config, f.out)
    assert t == 2 and round_rules.launch_time(f.state, f.config, f.out, t, live) == 2.0
    assert not of(f.handle(Tick(1.9)), PublishPull)
    assert [a.pull["step"] for a in of(f.handle(Tick(2.0)), PublishPull)] == [2]
    assert f.state.last_launch_step == 2 and f.next_step == 4


def test_events_a_shard_does_not_own_change_nothing():
    c = Cluster(2)
    c.start()
    f, co = c.m[1], c.m[0]
    before = dict(f.members)
    assert f.handle(Hello("c", GEN["c"], LAYOUT, FP, "auto", "auto", 1.0)) == []
    assert f.handle(Heartbeat("a", GEN["a"], 3, 1.0, 1.0)) == []
    assert f.handle(FinalAck("a", GEN["a"], 8, 1.0)) == []
    assert f.members == before and f.counters["ignored.not_owner"] == 3
    assert co.handle(MemberSeen("c", {"gen": GEN["c"], "live": True}, 1.0)) == []
    assert "c" not in co.members and co.counters["ignored.not_owner"] == 1


@pytest.mark.parametrize("record, why", [
    ({"live": True}, "gen"), ({"gen": GEN["c"], "live": "yes"}, "live"), ({"gen": GEN["c"], "last_step": -1}, "last_step"),
    ({"gen": GEN["c"], "ema_step_s": float("nan")}, "ema_step_s"), ("x", "record"),
])
def test_a_malformed_members_record_is_counted_taped_and_ignored(record, why):
    c = Cluster(2)
    c.start()
    acts = c.m[1].handle(MemberSeen("c", record, 1.0))
    assert "c" not in c.m[1].members and c.m[1].counters["rejected.member_record"] == 1
    assert why in tapes(acts, "error")[0]["reason"]


def test_members_read_before_the_session_are_admitted_when_it_comes():
    f = RoundMachine(cfg(shard=1, shards=2), session_builder=Builder())
    f.handle(MemberSeen("a", {"gen": GEN["a"], "live": True, "layout_fingerprint": FP}, 0.0))
    f.handle(MemberSeen("b", {"gen": GEN["b"], "live": True, "layout_fingerprint": FP}, 0.0))
    assert not f.members
    session = Builder()(LAYOUT, 4, init_island="a")
    acts = f.handle(SessionSeen(session, 0.1))
    assert of(acts, AdoptSession) and sorted(f.members) == ["a", "b"] and f.phase == "init"
    # INIT of its own fragments only
    f.handle(InitComplete("a", GEN["a"], 0, 0.15))
    assert f.counters["rejected.bad_fragment"] == 1 and not f.state.initialized
    acts = f.handle(InitComplete("a", GEN["a"], 1, 0.2)) + f.handle(InitComplete("a", GEN["a"], 3, 0.2))
    assert of(acts, CommitV0)[0].fragments == (1, 3)


def test_shard_final_records_that_do_not_fit_are_refused():
    c = Cluster(2, total_steps=4)
    c.start()
    co = c.m[0]
    for ev in (ShardFinal(5, 4, {"1": 1, "3": 1}, 1.0), ShardFinal(1, 3, {"1": 1, "3": 1}, 1.0),
               ShardFinal(1, 4, {"0": 1, "1": 1}, 1.0), ShardFinal(1, 4, {"x": 1}, 1.0)):
        co.handle(ev)
    assert co.counters["rejected.shard_final"] == 4 and not co.state.shard_finals
    co.handle(ShardFinal(1, 4, {"1": 1, "3": 1}, 1.0))
    co.handle(ShardFinal(1, 4, {"1": 1, "3": 1}, 1.0))
    assert co.counters["ignored.shard_final_duplicate"] == 1 and co.state.shard_finals == {1: {1: 1, 3: 1}}


def test_restore_per_shard_own_versions_and_final_records():
    session = Builder()(LAYOUT, 4, init_island="a")
    members = {"a": {"gen": GEN["a"], "live": True}, "b": {"gen": GEN["b"], "live": True}}
    with pytest.raises(ValueError, match="shard 1 of 2"):
        RoundMachine.restore(cfg(shard=1, shards=2), session, {f: 1 for f in range(4)}, 4, members, now=0.0)
    # a follower resumed mid-run launches its next own round (step 6 after 4)
    f = RoundMachine.restore(cfg(shard=1, shards=2), session, {1: 1, 3: 1}, 4, members, now=0.0)
    acts = f.handle(Tick(0.0))
    assert [a.pull["step"] for a in of(acts, PublishPull)] == [6]
    # a follower whose final cut is out is done at once
    f = RoundMachine.restore(cfg(shard=1, shards=2), session, {1: 2, 3: 2}, 8, members, now=0.0,
                             final={"shard_final": True, "final_step": 8, "versions": {"1": 2, "3": 2}})
    assert of(f.handle(Tick(0.0)), Done)[0].ok
    # the coordinator whose own cut is out waits for the other shards, then sends the manifests
    co = RoundMachine.restore(cfg(shard=0, shards=2), session, {0: 2, 2: 2}, 7, members, now=0.0,
                              final={"shard_final": True, "final_step": 8, "versions": {"0": 2, "2": 2}})
    assert not of(co.handle(Tick(0.0)), SendManifest) and co.phase == "running"
    acts = co.handle(ShardFinal(1, 8, {"1": 2, "3": 2}, 1.0))
    assert sorted(a.island for a in of(acts, SendManifest)) == ["a", "b"]
    assert of(acts, SendManifest)[0].versions == {0: 2, 1: 2, 2: 2, 3: 2}
    # the coordinator resumed during manifests re-sends them with every shard's versions
    rec = of(acts, RecordFinal)[0].record
    co2 = RoundMachine.restore(cfg(shard=0, shards=2), session, {0: 2, 2: 2}, 7, members, now=2.0, final=rec)
    again = of(co2.handle(Tick(2.0)), SendManifest)
    assert sorted(a.island for a in again) == ["a", "b"] and again[0].versions == {0: 2, 1: 2, 2: 2, 3: 2}


def test_config_refuses_impossible_shards_naming_the_flag():
    with pytest.raises(ConfigError) as e:
        cfg(shards=5)
    assert e.value.field == "--shards" and "exceeds --fragments 4" in str(e.value)
    with pytest.raises(ConfigError) as e:
        cfg(shard=2, shards=2)
    assert e.value.field == "--shard"
    with pytest.raises(ConfigError) as e:
        cfg(shards=0)
    assert e.value.field == "--shards"


def test_new_events_and_actions_round_trip_their_json_forms():
    for ev in (SessionSeen({"fragments": [], "x": 1}, 1.5), MemberSeen("a", {"gen": GEN["a"], "live": True}, 2.0),
               ShardFinal(1, 8, {1: 2, 3: 2}, 3.0)):
        back = event_from_json(event_to_json(ev))
        assert event_to_json(back) == event_to_json(ev)
    for a in (PublishShardFinal(8, {1: 2, 3: 2}), AdoptSession({"fragments": []})):
        assert action_from_json(action_to_json(a)) == a


def test_follower_tapes_no_membership_and_one_final_record_pair():
    _, c = run_strict(2, steps=4)
    follower = [a for k, a in c.out if k == 1]
    kinds = [t["kind"] for t in tapes(follower)]
    assert "join" not in kinds and "leave" not in kinds and "session" in kinds   # "version 0 committed"
    assert [t["reason"] for t in tapes(follower, "final")] == ["shard 1/2: final cut publishing",
                                                               "shard 1/2: final cut published"]
    assert not [a for a in follower if type(a).__name__ in ("SendError", "WriteMember", "WriteSession", "SendManifest")]
