"""The syncer's round state machine, driven by hand-built event sequences (no broker, no clock)."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from yeto.schemas.errors import WireError
from yeto.services.syncer.actions import (
    CommitV0, Done, InitDrop, InitStore, Merge, PublishFinal, PublishPull, Rebroadcast, RecordFinal, Release,
    SendError, SendManifest, Shutdown, Tape, WriteMember, WriteSession,
)
from yeto.services.syncer.config import HOPELESS_RESTART_S, SyncerConfig
from yeto.services.syncer.events import (
    FinalAck, FinalPublished, Heartbeat, Hello, InitChunk, InitComplete, MergeDone, PushComplete, Tick, V0Done,
)
from yeto.services.syncer.rounds import RoundMachine

LAYOUT = [{"name": "w", "shape": [4], "dtype": "f32"}]
FP = "f" * 64
OTHER_FP = "e" * 64
GEN = {"a": "a1" * 8, "b": "b1" * 8, "c": "c1" * 8}
A2, A3 = "a2" * 8, "a3" * 8
SCHEMAS = Path(__file__).resolve().parents[1] / "schemas" / "json"


class Builder:
    """Stands in for schemas.layout.build_session; records its calls."""

    def __init__(self, fingerprint: str = FP):
        self.calls: list[tuple] = []
        self.fingerprint = fingerprint

    def __call__(self, layout, fragments, **kw):
        self.calls.append((layout, fragments, kw))
        return {"fragments": [{"id": f, "tensors": [], "numel": 0} for f in range(fragments)],
                "layout_fingerprint": self.fingerprint, "session_fingerprint": "s" * 64, **kw}


def cfg(**kw) -> SyncerConfig:
    base = dict(run="r1", islands=2, fragments=2, sync_every=4, total_steps=4, quorum_timeout_s=100.0,
                member_timeout_s=1000.0, grace_ms=0.0, final_timeout_s=50.0, strict=True)
    base.update(kw)
    return SyncerConfig(**base)


def machine(**kw) -> RoundMachine:
    return RoundMachine(cfg(**kw), session_builder=Builder())


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def tapes(actions, kind=None):
    return [a.event for a in actions if isinstance(a, Tape) and (kind is None or a.event["kind"] == kind)]


def hello(island, gen=None, now=0.0, fp=FP, push="auto", bulk="auto"):
    return Hello(island, gen or GEN[island], LAYOUT, fp, push, bulk, now)


def push(m, island, step, *, gen=None, attempt=1, try_=0, base=None, fragment=None, valid=True, reason=None,
         tokens=100, local=10, now=1.0):
    frag = m.config.fragment_of(step) if fragment is None else fragment
    base = m.versions.get(frag, 0) if base is None else base
    return PushComplete(island, gen or GEN[island], frag, step, attempt, try_, base, local, 5, tokens, valid, reason, now)


def start(m, islands=("a", "b"), now=0.0) -> list:
    acts = []
    for isl in islands:
        acts += m.handle(hello(isl, now=now))
    for f in range(m.config.fragments):
        acts += m.handle(InitComplete(islands[0], GEN[islands[0]], f, now))
    assert of(acts, CommitV0), "version 0 is due once every fragment is in and N islands are admitted"
    acts += m.handle(V0Done(now))
    return acts


def pulls(actions):
    return [a.pull for a in of(actions, PublishPull)]


def merge_done(m, merge: Merge, now: float, merge_to_broadcast_s: float = 0.5):
    return m.handle(MergeDone(merge.step, merge.fragment, merge.version, merge_to_broadcast_s, now))


def dispositions(actions):
    return [e["disposition"] for e in tapes(actions, "disposition")]


# ---- configuration -------------------------------------------------------------------------------

def test_config_refuses_h_not_a_multiple_of_p_naming_the_flag():
    with pytest.raises(ValueError, match="--sync-every"):
        cfg(fragments=3, sync_every=4)
    for bad_chunk in (100, 1023, (64 << 20) + 1):
        with pytest.raises(ValueError, match=f"--chunk-bytes must be between 1024 and 67108864.*value {bad_chunk}"):
            cfg(chunk_bytes=bad_chunk)
    cfg(chunk_bytes=1024)
    with pytest.raises(ValueError, match="--push-dtype"):
        cfg(push_dtype="fp8")
    with pytest.raises(ValueError, match="--bulk-dtype"):
        cfg(bulk_dtype="q4")
    with pytest.raises(ValueError, match="--pipeline"):
        cfg(pipeline=0)
    c = cfg(fragments=4, sync_every=12)
    assert c.steps_per_round == 3 and c.tau == 3 and [c.fragment_of(t) for t in (1, 4, 5, 8)] == [0, 3, 0, 3]


# ---- session pinning, admission, INIT, version 0 --------------------------------------------------

def test_first_hello_pins_the_session_and_is_the_init_island():
    b = Builder()
    m = RoundMachine(cfg(push_dtype="bf16", chunk_bytes=4096), session_builder=b)
    acts = m.handle(hello("b", now=5.0))
    ws = of(acts, WriteSession)
    assert len(ws) == 1 and ws[0].session["init_island"] == "b" and m.init_island == "b"
    layout, fragments, kw = b.calls[0]
    assert layout == LAYOUT and fragments == 2
    assert kw["push_dtype"] == "bf16" and kw["bulk_dtype"] == "f32" and kw["chunk_bytes"] == 4096
    assert kw["sync_every"] == 4 and kw["run"] == "r1" and kw["init_island"] == "b"
    # the session is written before the member, so an island that sees itself admitted finds it
    assert acts.index(ws[0]) < acts.index(of(acts, WriteMember)[0])
    rec = of(acts, WriteMember)[0].record
    assert rec["gen"] == GEN["b"] and rec["layout_fingerprint"] == FP and rec["admitted_at"] == 5.0 and rec["live"]
    assert [e["island"] for e in tapes(acts, "join")] == ["b"]
    # a second island joins without re-pinning
    acts = m.handle(hello("a", now=6.0))
    assert not of(acts, WriteSession) and set(m.members) == {"a", "b"} and m.init_island == "b"


def test_layout_mismatch_is_refused_fatally_and_not_admitted():
    m = machine()
    m.handle(hello("a"))
    acts = m.handle(hello("b", fp=OTHER_FP))
    err = of(acts, SendError)
    assert len(err) == 1 and err[0].code == "layout_mismatch" and err[0].fatal and err[0].island == "b"
    assert err[0].gen == GEN["b"] and err[0].field == "layout_fingerprint"
    assert "b" not in m.members and not of(acts, WriteMember)
    assert m.counters["rejected.layout_mismatch"] == 1 and tapes(acts, "error")


def test_explicit_other_dtypes_are_refused_auto_and_equal_are_not():
    m = machine(push_dtype="bf16", bulk_dtype="bf16")
    acts = m.handle(hello("a", push="f32"))
    assert [e.code for e in of(acts, SendError)] == ["dtype_mismatch"] and m.session is None
    acts = m.handle(hello("b", bulk="f32"))
    assert [e.code for e in of(acts, SendError)] == ["dtype_mismatch"] and "b" not in m.members
    acts = m.handle(hello("a", gen="a9" * 8, push="bf16", bulk="auto"))
    assert not of(acts, SendError) and "a" in m.members and m.counters["rejected.dtype_mismatch"] == 2


def test_hello_whose_fingerprint_is_not_its_layouts_does_not_pin():
    m = RoundMachine(cfg(), session_builder=Builder(fingerprint=OTHER_FP))
    acts = m.handle(hello("a"))
    assert [e.code for e in of(acts, SendError)] == ["layout_mismatch"] and m.session is None and not m.members


def test_layout_the_builder_refuses_is_refused_with_its_code():
    def refusing(layout, fragments, **kw):
        raise WireError("duplicate tensor name", field="layout.1.name", value="w", code="bad_layout")

    m = RoundMachine(cfg(), session_builder=refusing)
    acts = m.handle(hello("a"))
    err = of(acts, SendError)
    assert err[0].code == "bad_layout" and err[0].fatal and err[0].field == "layout.1.name"
    assert m.session is None and m.phase == "pinning"


def test_named_init_island_queues_other_hellos_until_it_arrives():
    m = RoundMachine(cfg(init_island="b"), session_builder=Builder())
    acts = m.handle(hello("a", now=1.0))
    assert acts == [] and m.session is None and not m.members  # queued: neither refused nor admitted
    acts = m.handle(hello("a", gen="a7" * 8, now=1.5))           # a newer generation replaces the queued one
    acts = m.handle(hello("b", now=2.0))
    assert len(of(acts, WriteSession)) == 1 and m.init_island == "b"
    assert [w.island for w in of(acts, WriteMember)] == ["b", "a"]
    assert m.members["a"].gen == "a7" * 8 and m.members["a"].admitted_at == 2.0


def test_init_only_from_the_init_island_and_v0_needs_all_fragments_and_n_islands():
    m = machine(fragments=2, islands=2)
    m.handle(hello("a"))
    acts = m.handle(InitComplete("a", GEN["a"], 0, 1.0))
    assert not of(acts, CommitV0)
    m.handle(hello("b"))
    acts = m.handle(InitComplete("b", GEN["b"], 1, 2.0))       # b is not the INIT island
    err = of(acts, SendError)
    assert err[0].code == "not_init_island" and not err[0].fatal and not of(acts, CommitV0)
    acts = m.handle(InitComplete("a", "a9" * 8, 1, 2.5))        # a generation whose hello is not in: held
    assert not of(acts, CommitV0) and m.counters["init.held"] == 1 and m.counters["init.fragment"] == 1
    acts = m.handle(InitComplete("a", GEN["a"], 1, 3.0))
    assert of(acts, CommitV0) == [CommitV0((0, 1))] and m.phase == "committing_v0"
    assert not pulls(acts)                                     # nothing launches before V0Done
    acts = m.handle(V0Done(4.0))
    assert m.versions == {0: 0, 1: 0} and pulls(acts)[0]["base_version"] == 0


def test_new_init_generation_during_init_clears_what_the_old_one_sent():
    m = machine(fragments=2, islands=2)
    m.handle(hello("a"))
    m.handle(hello("b"))
    m.handle(InitComplete("a", GEN["a"], 0, 1.0))
    acts = m.handle(hello("a", gen=A2, now=2.0))                   # the INIT island restarted mid-INIT
    assert m.counters["init.restart"] == 1 and not of(acts, CommitV0)
    (rec,) = [t for t in tapes(acts, "session") if "INIT restarts" in t["reason"]]
    assert rec["gen"] == A2 and rec["detail"] == {"dropped_fragments": [0]}
    assert not list(_validator("event").iter_errors({"v": 1, "run": "r1", **rec}))   # a valid tape record
    # the old process's last fragment completes late: ignored, it must not mix into version 0
    acts = m.handle(InitComplete("a", GEN["a"], 1, 2.5))
    assert not of(acts, CommitV0) and m.counters["ignored.init_stale_gen"] == 1
    assert tapes(acts, "error")[0]["gen"] == GEN["a"]
    acts = m.handle(InitComplete("a", A2, 1, 3.0))                 # fragment 0 must come again from A2
    assert not of(acts, CommitV0)
    acts = m.handle(InitComplete("a", A2, 0, 3.5))
    assert of(acts, CommitV0) == [CommitV0((0, 1))]


def test_init_of_an_unseen_generation_is_held_and_replayed_at_its_hello():
    m = machine(fragments=2, islands=2)
    m.handle(hello("a"))
    m.handle(hello("b"))
    m.handle(InitComplete("a", GEN["a"], 0, 1.0))
    # A2's chunks overtook its hello (INIT and CTL are separate consumers)
    assert m.handle(InitComplete("a", A2, 0, 2.0)) == [] and m.handle(InitComplete("a", A2, 1, 2.1)) == []
    assert m.counters["init.held"] == 2 and not m.state.initialized - {0}
    acts = m.handle(hello("a", gen=A2, now=3.0))                   # clears GEN[a]'s fragment 0, replays A2's
    assert m.counters["init.restart"] == 1 and m.counters["init.replayed"] == 2
    assert of(acts, CommitV0) == [CommitV0((0, 1))]
    assert m.counters["init.fragment"] == 3 and m.members["a"].gen == A2


def test_held_init_of_a_generation_that_is_retired_or_late_never_counts():
    m = machine(fragments=2, islands=2)
    m.handle(hello("a"))
    m.handle(hello("b"))
    m.handle(InitComplete("a", A2, 0, 1.0))                       # held: A2 unseen
    m.handle(hello("a", gen=A2, now=2.0))                          # replayed: fragment 0 from A2
    assert m.state.initialized == {0}
    m.handle(hello("a", gen=A3, now=3.0))                          # restarts again: A2 is retired
    assert m.state.initialized == set() and m.counters["init.restart"] == 2
    for f in (0, 1):                                               # A2's late completions: ignored
        assert not of(m.handle(InitComplete("a", A2, f, 4.0)), CommitV0)
    assert m.counters["ignored.init_stale_gen"] == 2 and m.state.initialized == set()
    assert m.handle(hello("a", gen=A2, now=4.5)) == []             # a replay of a retired hello changes nothing
    assert of(m.handle(InitComplete("a", A3, 0, 5.0)) + m.handle(InitComplete("a", A3, 1, 5.0)), CommitV0)
    # once version 0 is being committed, a new generation does not touch INIT, and its INIT is late
    acts = m.handle(hello("a", gen="a4" * 8, now=6.0))
    assert m.counters["init.restart"] == 2 and m.phase == "committing_v0" and not tapes(acts, "session")
    m.handle(InitComplete("a", "a5" * 8, 0, 6.5))
    assert m.counters["ignored.init_late"] == 1 and m.counters["init.held"] == 1


def chunks(m, gen, fragment, idx, n=3, island="a", now=1.0):
    acts = []
    for k in idx:
        acts += m.handle(InitChunk(island, gen, fragment, k, n, now))
    return acts


def test_init_chunks_of_an_unseen_generation_are_held_never_waited_for_then_replayed():
    # regression: each INIT chunk of an unknown generation blocked INIT intake for 10 s in the shell;
    # the machine now decides per chunk: store, drop, or hold until the generation's hello
    m = machine(fragments=2, islands=2)
    m.handle(hello("a"))
    m.handle(hello("b"))
    acts = chunks(m, GEN["a"], 0, range(3))
    assert of(acts, InitStore) == [InitStore(GEN["a"], 0, k) for k in range(3)] and m.state.initialized == {0}
    # A2's chunks overtake its hello: held (no store, no drop), fragment 0 of GEN[a] stays complete
    acts = chunks(m, A2, 0, range(3)) + chunks(m, A2, 1, [0, 1])
    assert not of(acts, InitStore) and not of(acts, InitDrop) and m.state.initialized == {0}
    assert m.counters["init.held_chunk"] == 5
    assert of(chunks(m, A2, 0, [1]), InitDrop) == [InitDrop(A2, 0, 1, "duplicate")]   # a resend while held
    # a chunk of the current generation is still taken at once: intake is not blocked
    assert of(chunks(m, GEN["a"], 1, [0]), InitStore) == [InitStore(GEN["a"], 1, 0)]
    acts = m.handle(hello("a", gen=A2, now=2.0))             # INIT restarts with A2, its held chunks replayed
    assert of(acts, InitStore) == [InitStore(A2, 0, 0), InitStore(A2, 0, 1), InitStore(A2, 0, 2),
                                   InitStore(A2, 1, 0), InitStore(A2, 1, 1)]
    assert m.state.initialized == {0} and not of(acts, CommitV0)
    # GEN[a]'s late chunk is refused as stale: counted, taped with its code, its bytes freed, no error message
    acts = chunks(m, GEN["a"], 1, [2])
    assert of(acts, InitDrop) == [InitDrop(GEN["a"], 1, 2, "stale_gen")] and not of(acts, SendError)
    (rec,) = tapes(acts, "error")
    assert rec["detail"]["code"] == "stale_gen" and rec["gen"] == GEN["a"] and m.counters["rejected.stale_gen"] == 1
    acts = chunks(m, A2, 1, [2])
    assert of(acts, InitStore) == [InitStore(A2, 1, 2)] and of(acts, CommitV0) == [CommitV0((0, 1))]
    assert of(chunks(m, A2, 1, [2]), InitDrop) == [InitDrop(A2, 1, 2, "late")]


def test_init_chunks_refused_bounded_and_dropped_when_v0_is_decided():
    m = machine(fragments=1, sync_every=1, islands=2)
    m.handle(hello("a"))
    (d,) = of(chunks(m, GEN["b"], 0, [0], island="b"), InitDrop)          # not the INIT island
    assert d.reason == "not_init_island" and m.counters["rejected.not_init_island"] == 1
    (d,) = of(chunks(m, GEN["a"], 5, [0]), InitDrop)
    assert d.reason == "unknown_fragment"
    # at most MAX_HELD_GENS unseen generations are held; a further one is refused, never stored
    chunks(m, "c1" * 8, 0, [0])
    chunks(m, "c2" * 8, 0, [0])
    (d,) = of(chunks(m, "c3" * 8, 0, [0]), InitDrop)
    assert d.reason == "unknown_gen" and m.counters["rejected.unknown_gen"] == 1
    chunks(m, GEN["a"], 0, range(3))
    acts = m.handle(hello("b"))                                           # N islands: version 0 is decided
    assert of(acts, CommitV0) and of(acts, InitDrop) == [InitDrop("c1" * 8, 0, 0, "version 0 decided"),
                                                          InitDrop("c2" * 8, 0, 0, "version 0 decided")]


def test_v0_waits_for_the_nth_island():
    m = machine(islands=3)
    m.handle(hello("a"))
    m.handle(hello("b"))
    assert not of(m.handle(InitComplete("a", GEN["a"], 0, 1)) + m.handle(InitComplete("a", GEN["a"], 1, 1)), CommitV0)
    assert of(m.handle(hello("c", now=2)), CommitV0)


# ---- rounds in lockstep (strict) ------------------------------------------------------------------

def test_strict_full_run_steps_fragments_versions_and_final():
    m = machine(total_steps=4, fragments=2, sync_every=4)
    acts = start(m)
    seen, merges = [], []
    for t in range(1, 5):
        (p,) = pulls(acts)
        assert (p["step"], p["fragment"], p["attempt"], p["seq"]) == (t, (t - 1) % 2, 1, 0)
        assert p["base_version"] == (t - 1) // 2
        assert p["members"] == [{"island": "a", "gen": GEN["a"]}, {"island": "b", "gen": GEN["b"]}]
        acts = m.handle(push(m, "b", t, tokens=300, now=t))
        assert not of(acts, Merge)                              # strict waits for every expected member
        acts = m.handle(push(m, "a", t, tokens=100, now=t))
        (mg,) = of(acts, Merge)
        assert (mg.step, mg.fragment, mg.attempt, mg.version, mg.base_version) == (t, (t - 1) % 2, 1, (t + 1) // 2, (t - 1) // 2)
        assert [(x.island, x.gen) for x in mg.members] == [("a", GEN["a"]), ("b", GEN["b"])]
        assert [x.weight for x in mg.members] == [0.25, 0.75]
        assert not pulls(acts)                                 # pipeline 1: next round after the commit
        merges.append(mg.record)
        acts = merge_done(m, mg, now=t + 0.5)
        seen.append((mg.step, mg.fragment, mg.version))
    assert seen == [(1, 0, 1), (2, 1, 1), (3, 0, 2), (4, 1, 2)]
    assert m.versions == {0: 2, 1: 2} and m.committed_step == 4
    (fin,) = of(acts, PublishFinal)
    assert fin.final_step == 4 and fin.versions == {0: 2, 1: 2} and fin.record["targets"] == {"a": GEN["a"], "b": GEN["b"]}
    assert not of(acts, SendManifest)                           # manifests only once the cut is out
    assert merges and merges[0]["weights"] == {"a": 100, "b": 300} and merges[0]["responded"][0]["island"] == "a"
    assert m.counters["disposition.accepted"] == 8 and m.counters["merge"] == 4
    assert not pulls(acts)                                     # never beyond --total-steps


def test_merge_weights_equal_and_all_zero_fallback():
    m = machine(equal_weights=True)
    start(m)
    m.handle(push(m, "a", 1, tokens=100))
    (mg,) = of(m.handle(push(m, "b", 1, tokens=900)), Merge)
    assert [x.weight for x in mg.members] == [0.5, 0.5]
    m = machine()
    start(m)
    m.handle(push(m, "a", 1, tokens=0))
    acts = m.handle(push(m, "b", 1, tokens=0))
    (mg,) = of(acts, Merge)
    assert [x.weight for x in mg.members] == [0.5, 0.5]
    assert mg.record["weights"] == {"a": 1.0, "b": 1.0}


# ---- dispositions ---------------------------------------------------------------------------------

def test_every_disposition_and_rejected_pushes_change_nothing():
    m = machine(islands=2, max_base_lag=1)
    start(m)
    # commit round 1 (fragment 0 -> v1) and 2 (fragment 1 -> v1), then round 3 targets fragment 0 at v1
    for t in (1, 2):
        m.handle(push(m, "a", t))
        merge_done(m, of(m.handle(push(m, "b", t)), Merge)[0], now=t)
    assert m.versions == {0: 1, 1: 1} and 3 in m.rounds
    r = m.rounds[3]
    cases = [
        (push(m, "a", 9), "out_of_round"),                              # no round for step 9
        (push(m, "a", 3, attempt=2), "out_of_round"),                   # attempt not in flight
        (push(m, "a", 3, fragment=1), "out_of_round"),                  # step 3 targets fragment 0
        (push(m, "c", 3, gen=GEN["c"]), "unexpected_member"),           # not expected
        (push(m, "a", 3, gen="a9" * 8), "unexpected_member"),           # other generation
        (push(m, "a", 3, valid=False, reason="chunk 2 digest mismatch"), "invalid"),
        (push(m, "a", 3, base=2), "future_base"),
        (push(m, "a", 3, base=1, try_=1), "accepted"),
        (push(m, "a", 3, base=1, try_=2), "duplicate"),                 # a later try: first valid wins
        (push(m, "a", 3, base=1, try_=1), "duplicate"),                 # the same push re-delivered
    ]
    records = []
    for ev, want in cases:
        before = (r.attempt, r.answered, r.quorum_at, r.complete_at)
        acts = m.handle(ev)
        assert dispositions(acts) == [want], (ev, want)
        records += tapes(acts, "disposition")
        if want != "accepted":
            assert (r.attempt, r.answered, r.quorum_at, r.complete_at) == before
    assert records[5]["reason"] == "chunk 2 digest mismatch" and records[5]["try"] == 0
    assert (records[7]["island"], records[7]["gen"], records[7]["try"]) == ("a", GEN["a"], 1)
    assert m.counters["disposition.out_of_round"] == 3 and m.counters["disposition.unexpected_member"] == 2
    assert m.counters["disposition.duplicate"] == 2 and m.counters["disposition.accepted"] == 5
    assert m.counters["disposition.invalid"] == 1 and m.counters["disposition.future_base"] == 1


def test_stale_base_beyond_max_lag():
    m = machine(fragments=1, sync_every=2, total_steps=5, max_base_lag=1)
    start(m, islands=("a", "b"))
    for t in (1, 2):
        m.handle(push(m, "a", t))
        merge_done(m, of(m.handle(push(m, "b", t)), Merge)[0], now=t)
    assert m.versions == {0: 2}
    acts = m.handle(push(m, "a", 3, base=0))
    assert dispositions(acts) == ["stale_base"] and m.rounds[3].answered == 0
    acts = m.handle(push(m, "a", 3, base=1))                     # lag 1 is allowed
    assert dispositions(acts) == ["accepted"]
    (mg,) = of(m.handle(push(m, "b", 3, base=2)), Merge)
    assert {x.island: x.base_version for x in mg.members} == {"a": 1, "b": 2}
    assert mg.record["staleness"] == {"a": 1, "b": 0}


def test_release_for_rejected_pushes_but_never_for_the_accepted_identity():
    m = machine()
    start(m)
    m.handle(push(m, "a", 1, try_=0))
    acts = m.handle(push(m, "a", 1, try_=0))          # re-delivery of the accepted push: the merge needs it
    assert dispositions(acts) == ["duplicate"] and not of(acts, Release)
    acts = m.handle(push(m, "a", 1, try_=1))          # another try: never merged
    assert of(acts, Release) == [Release("a", GEN["a"], 1, 0, 1, 1, "duplicate")]
    acts = m.handle(push(m, "b", 1, valid=False, reason="not finite"))
    assert of(acts, Release)[0].reason == "invalid"


# ---- quorum, grace, restart -----------------------------------------------------------------------

def nonstrict(**kw) -> RoundMachine:
    base = dict(strict=False, quorum=1, grace_ms=60_000.0, sync_every=8, fragments=2, quorum_timeout_s=100.0)
    base.update(kw)
    return machine(**base)


def launch_first(m, now=0.0, step_time=1.0):
    start(m, now=now)
    acts = []
    for isl in ("a", "b"):
        acts += m.handle(Heartbeat(isl, GEN[isl], 0, step_time, now))
    acts += m.handle(Tick(now + 4 * step_time))                # H/P = 4 steps after V0Done (time rule)
    assert [p["step"] for p in pulls(acts)] == [1]
    return m.rounds[1]


def test_adaptive_grace_after_quorum():
    # grace = clamp(γ·(τ·step_time − time_to_quorum − last_sync), 0, cap); τ = H/P = 4, step 1.0 s
    m = nonstrict(grace_gamma=1.0)
    r = launch_first(m)                                          # launched at t = 4
    acts = m.handle(push(m, "a", 1, now=5.0))                  # quorum K=1 after 1.0 s
    assert r.quorum_at == 5.0 and r.grace_s == pytest.approx(4 * 1.0 - 1.0 - 0.0)
    assert not of(acts, Merge) and not of(m.handle(Tick(7.9)), Merge)
    (mg,) = of(m.handle(Tick(8.0)), Merge)
    assert [x.island for x in mg.members] == ["a"] and mg.members[0].weight == 1.0
    # a push after completion is out of round; last sync time shortens the next grace
    assert dispositions(m.handle(push(m, "b", 1, now=8.5))) == ["out_of_round"]
    t = mg.record
    assert t["quorum_s"] == 1.0 and t["grace_s"] == 3.0 and t["quorum"] == 1 and mg.launched_at == 4.0
    # the shell reports merge time only (0.5 s), but the Merge went out at 8 and its MergeDone (after
    # checkpoint and broadcast) came at 9: the whole sync, 1.0 s, shortens the next grace
    acts = merge_done(m, mg, now=9.0, merge_to_broadcast_s=0.5)
    # round 2 was due 4 s (H/P steps) after round 1's launch, i.e. at 8: it launches at the commit
    assert [p["step"] for p in pulls(acts)] == [2]
    m.handle(push(m, "b", 2, now=9.5))
    assert m.rounds[2].grace_s == pytest.approx(4.0 - 0.5 - 1.0)


def test_grace_cap_gamma_and_all_pushed_completes_at_once():
    m = nonstrict(grace_ms=1500.0, grace_gamma=2.0)
    r = launch_first(m)
    m.handle(push(m, "a", 1, now=4.0))
    assert r.grace_s == 1.5                                      # 2·(4 − 0 − 0) = 8 s, capped at 1.5 s
    (mg,) = of(m.handle(push(m, "b", 1, now=4.1)), Merge)      # everyone answered: no grace wait
    assert len(mg.members) == 2
    m2 = nonstrict(grace_gamma=1.0, grace_tau=0)
    r2 = launch_first(m2)
    assert of(m2.handle(push(m2, "a", 1, now=6.0)), Merge) and r2.grace_s == 0.0   # negative -> 0


def test_restart_below_quorum_discards_and_recaptures():
    m = nonstrict(quorum=2, member_timeout_s=50.0)
    start(m, islands=("a", "b"))
    m.handle(hello("c", now=0.0))
    for isl in ("a", "b", "c"):
        m.handle(Heartbeat(isl, GEN[isl], 0, 1.0, 0.0))
    m.handle(Tick(4.0))
    r = m.rounds[1]
    assert len(r.slots) == 3 and r.quorum == 2
    m.handle(push(m, "a", 1, now=5.0))
    for t in (20.0, 40.0):                                      # a and b stay alive; c goes silent
        m.handle(Heartbeat("a", GEN["a"], int(t), 1.0, t))
        m.handle(Heartbeat("b", GEN["b"], int(t), 1.0, t))
    acts = m.handle(Tick(60.0))
    assert [e["island"] for e in tapes(acts, "leave")] == ["c"]
    assert not m.members["c"].live and of(acts, WriteMember)[0].record["live"] is False
    m.handle(Heartbeat("a", GEN["a"], 90, 1.0, 90.0))
    m.handle(Heartbeat("b", GEN["b"], 90, 1.0, 90.0))
    assert not of(m.handle(Tick(103.9)), PublishPull)
    acts = m.handle(Tick(104.0))                                # deadline = launch 4 + 100
    (p,) = pulls(acts)
    assert (p["step"], p["attempt"], p["seq"]) == (1, 2, 0)
    assert [x["island"] for x in p["members"]] == ["a", "b"]   # re-captured: c left
    (rs,) = tapes(acts, "restart")
    assert rs["attempt"] == 2 and rs["responded"] == [{"island": "a", "gen": GEN["a"]}]
    assert of(acts, Release) == [Release("a", GEN["a"], 1, 0, 1, 0, "restart")]
    assert m.counters["restart"] == 1 and m.counters["quorum_timeout"] == 1
    assert r.attempt == 2 and r.answered == 0 and r.quorum == 2 and r.deadline == 204.0
    acts = m.handle(push(m, "b", 1, attempt=1, now=105.0))     # a late push of the discarded attempt
    assert dispositions(acts) == ["out_of_round"] and "stale attempt" in tapes(acts)[0]["reason"]


def test_round_whose_quorum_is_out_of_reach_restarts_early_not_at_the_deadline():
    # soak/chaos.py: after a broker restart every island answered with a base two versions behind; each
    # push was refused stale_base and the round sat below quorum for the whole quorum timeout (60 s).
    m = nonstrict(quorum=1, fragments=1, sync_every=4, max_base_lag=0, total_steps=6, quorum_timeout_s=100.0)
    r = launch_first(m)
    acts = merge_done(m, of(m.handle(push(m, "a", 1, now=5.0)) + m.handle(push(m, "b", 1, now=5.0)), Merge)[0], now=6.0)
    assert [p["step"] for p in pulls(acts)] == [2]
    r = m.rounds[2]
    acts = m.handle(push(m, "a", 2, base=0, now=11.0))
    assert dispositions(acts) == ["stale_base"] and r.hopeless_at is None  # b may still answer
    acts = m.handle(push(m, "b", 2, base=0, now=12.0))
    assert dispositions(acts) == ["stale_base"]
    assert r.hopeless_at == 12.0 and m.next_wakeup() <= 12.0 + HOPELESS_RESTART_S  # nobody left to answer
    assert not pulls(m.handle(Tick(13.0)))
    acts = m.handle(Tick(12.0 + HOPELESS_RESTART_S))
    (p,) = pulls(acts)
    assert (p["step"], p["attempt"]) == (2, 2) and r.deadline == 12.0 + HOPELESS_RESTART_S + 100.0
    assert m.counters["restart_early"] == 1 and m.counters["quorum_timeout"] == 0
    # the new attempt answered from the re-broadcast version commits as usual
    m.handle(push(m, "a", 2, attempt=2, now=15.0))
    (mg,) = of(m.handle(push(m, "b", 2, attempt=2, now=15.5)), Merge)
    assert mg.attempt == 2 and len(mg.members) == 2


def test_member_that_leaves_mid_round_does_not_hold_it_until_the_deadline():
    # soak/chaos.py: the live members had answered, b had left, yet the round waited its 60 s deadline.
    m = nonstrict(quorum=None, fragments=1, sync_every=4, member_timeout_s=20.0, quorum_timeout_s=100.0)
    launch_first(m)
    m.handle(push(m, "a", 1, now=5.0))
    acts = m.handle(Heartbeat("a", GEN["a"], 5, 1.0, 19.0)) + m.handle(Tick(20.0))
    assert [e["island"] for e in tapes(acts, "leave")] == ["b"]             # silent since 0
    assert not pulls(acts) and not pulls(m.handle(Tick(20.0 + HOPELESS_RESTART_S - 0.1)))
    acts = m.handle(Tick(20.0 + HOPELESS_RESTART_S))                       # not at the deadline (104)
    (p,) = pulls(acts)
    assert p["attempt"] == 2 and [x["island"] for x in p["members"]] == ["a"]
    (mg,) = of(m.handle(push(m, "a", 1, attempt=2, now=27.0)), Merge)
    assert [x.island for x in mg.members] == ["a"]


def test_strict_rounds_never_restart_early():
    m = machine(strict=True, quorum_timeout_s=100.0, max_base_lag=0, fragments=1, sync_every=1, total_steps=4)
    start(m)
    merge_done(m, of(m.handle(push(m, "a", 1, now=1.0)) + m.handle(push(m, "b", 1, now=1.0)), Merge)[0], now=2.0)
    assert 2 in m.rounds  # round 2 is in flight
    m.handle(push(m, "a", 2, base=0, now=3.0))
    m.handle(push(m, "b", 2, base=0, now=3.0))
    assert not pulls(m.handle(Tick(50.0))) and m.counters["restart_early"] == 0


def test_strict_deadline_only_warns_and_all_must_answer():
    m = machine(strict=True, quorum=1, quorum_timeout_s=10.0)
    start(m)
    r = m.rounds[1]
    acts = m.handle(push(m, "a", 1, now=1.0))
    assert not of(acts, Merge)                                  # strict ignores K
    acts = m.handle(Tick(10.0))
    assert r.attempt == 1 and not pulls(acts) and m.counters["quorum_timeout"] == 1
    assert "strict" in tapes(acts, "error")[0]["reason"] and m.counters["restart"] == 0
    (mg,) = of(m.handle(push(m, "b", 1, now=25.0)), Merge)
    assert mg.attempt == 1 and len(mg.members) == 2


# ---- re-broadcast of a lost version ---------------------------------------------------------------

def test_restart_below_quorum_rebroadcasts_the_committed_version_before_the_new_pull_rate_limited():
    # BCAST may hold a forged or lost chunk of the committed version: islands then stay on an older
    # one and never answer; nothing else would ever publish that version again.
    m = nonstrict(quorum=2, fragments=1, sync_every=4, quorum_timeout_s=10.0, member_timeout_s=1e6)
    r = launch_first(m)                                          # step 1, fragment 0, version 0
    d1 = r.deadline
    assert not of(m.handle(Tick(d1 - 0.1)), Rebroadcast)
    acts = m.handle(Tick(d1))
    kinds = [type(a) for a in acts if isinstance(a, (Rebroadcast, PublishPull))]
    assert kinds == [Rebroadcast, PublishPull]                   # islands can read it before answering
    assert of(acts, Rebroadcast)[0].fragment == 0 and of(acts, Rebroadcast)[0].version == 0
    assert m.counters["rebroadcast"] == 1
    acts = m.handle(push(m, "a", 1, attempt=2, base=0, now=d1 + 1))
    assert dispositions(acts) == ["accepted"] and not of(acts, Rebroadcast)
    # the next restart comes one quorum timeout later: due again
    assert r.deadline == d1 + 10.0
    acts = m.handle(Tick(d1 + 10.0))
    assert tapes(acts, "restart") and of(acts, Rebroadcast) == [Rebroadcast(0, 0, of(acts, Rebroadcast)[0].reason)]
    assert m.counters["rebroadcast"] == 2


def test_stale_base_push_rebroadcasts_once_per_quorum_timeout_and_never_while_the_merge_is_due():
    m = machine(fragments=1, sync_every=2, total_steps=6, max_base_lag=0, quorum_timeout_s=100.0)
    start(m, islands=("a", "b"))
    m.handle(push(m, "a", 1))
    merge_done(m, of(m.handle(push(m, "b", 1)), Merge)[0], now=1.0)
    assert m.versions == {0: 1}
    acts = m.handle(push(m, "a", 2, base=0, now=2.0))           # a never got version 1
    assert dispositions(acts) == ["stale_base"]
    (rb,) = of(acts, Rebroadcast)
    assert (rb.fragment, rb.version) == (0, 1) and "stale base_version 0" in rb.reason
    acts = m.handle(push(m, "a", 2, base=0, try_=1, now=50.0))  # within one quorum timeout: not again
    assert dispositions(acts) == ["stale_base"] and not of(acts, Rebroadcast)
    assert m.counters["rebroadcast.rate_limited"] == 1
    acts = m.handle(push(m, "a", 2, base=0, try_=2, now=102.0))
    assert of(acts, Rebroadcast) == [Rebroadcast(0, 1, rb.reason)]
    # strict: once every member answered, the round's merge is due and its params change: no re-send
    m.handle(push(m, "a", 2, try_=3, now=103.0))
    (mg,) = of(m.handle(push(m, "b", 2, now=104.0)), Merge)
    acts = m.handle(push(m, "a", 2, base=0, try_=4, now=300.0))
    assert dispositions(acts) == ["out_of_round"] and not of(acts, Rebroadcast)
    merge_done(m, mg, now=301.0)
    acts = m.handle(push(m, "b", 3, base=0, now=302.0))
    assert of(acts, Rebroadcast)[0].version == 2


def test_strict_deadline_below_quorum_rebroadcasts_too():
    m = machine(strict=True, quorum=1, quorum_timeout_s=10.0)
    start(m)
    acts = m.handle(Tick(10.0))
    assert m.counters["quorum_timeout"] == 1 and of(acts, Rebroadcast)[0].fragment == 0


# ---- generations, liveness ------------------------------------------------------------------------

def test_new_generation_rebinds_unanswered_slots_and_keeps_accepted_pushes():
    m = machine(pipeline=2, fragments=2)
    acts = start(m)
    assert [p["step"] for p in pulls(acts)] == [1, 2]
    m.handle(push(m, "a", 1))                                   # a answered round 1 with its old gen
    acts = m.handle(hello("a", gen=A2, now=3.0))
    assert m.members["a"].gen == A2 and of(acts, WriteMember)[0].record["gen"] == A2
    assert tapes(acts, "join")[0]["gen"] == A2
    (p,) = pulls(acts)                                         # only round 2's slot was unanswered
    assert (p["step"], p["attempt"], p["seq"]) == (2, 1, 1)
    assert {"island": "a", "gen": A2} in p["members"]
    assert dispositions(m.handle(push(m, "a", 2, now=4.0))) == ["unexpected_member"]   # old gen
    assert dispositions(m.handle(push(m, "a", 2, gen=A2, now=4.0))) == ["accepted"]
    (mg1,) = of(m.handle(push(m, "b", 1, now=5.0)), Merge)
    assert [(x.island, x.gen) for x in mg1.members] == [("a", GEN["a"]), ("b", GEN["b"])]
    # a replayed hello of the retired generation changes nothing
    acts = m.handle(hello("a", gen=GEN["a"], now=6.0))
    assert acts == [] and m.members["a"].gen == A2 and m.counters["ignored.hello_stale_gen"] == 1
    # a third generation finds nothing to rebind: a answered both rounds
    acts = m.handle(hello("a", gen=A3, now=7.0))
    assert not pulls(acts) and m.members["a"].gen == A3


def test_liveness_leave_not_captured_then_heartbeat_revives():
    m = machine(member_timeout_s=30.0, fragments=1, sync_every=1, total_steps=3)
    start(m)
    m.handle(Heartbeat("a", GEN["a"], 1, 1.0, 20.0))
    acts = m.handle(Tick(30.0))
    assert [e["island"] for e in tapes(acts, "leave")] == ["b"] and m.counters["leave"] == 1
    m.handle(push(m, "a", 1, now=31.0))
    (mg,) = of(m.handle(push(m, "b", 1, now=31.5)), Merge)      # b's slot was frozen at launch: still counts
    acts = merge_done(m, mg, now=32.0)
    (p,) = pulls(acts)
    assert p["members"] == [{"island": "a", "gen": GEN["a"]}]   # b is not captured while gone
    acts = m.handle(Heartbeat("b", GEN["b"], 40, 1.0, 33.0))
    assert tapes(acts, "join")[0]["reason"] == "heartbeat resumed" and m.members["b"].live
    acts = m.handle(Heartbeat("b", "b9" * 8, 40, 1.0, 33.0))   # a generation never seen: asked to say hello
    assert [e.code for e in of(acts, SendError)] == ["unknown_member"] and not of(acts, WriteMember)
    assert m.members["b"].gen == GEN["b"]



def test_an_island_that_says_it_leaves_is_gone_at_once_and_its_round_completes_without_it():
    # A planned stop (the island's launcher sent SIGTERM): its last heartbeat says so. No grace window here
    # (grace_ms 0), so the merge follows the leave at once.
    m = nonstrict(quorum=None, fragments=1, sync_every=4, member_timeout_s=20.0, quorum_timeout_s=100.0, grace_ms=0.0)
    launch_first(m)
    m.handle(push(m, "a", 1, now=5.0))
    acts = m.handle(Heartbeat("b", GEN["b"], 5, 1.0, 6.0, leaving=True))
    (lv,) = tapes(acts, "leave")
    assert lv["island"] == "b" and "said it is stopping" in lv["reason"] and not m.members["b"].live
    assert m.counters["leave.said"] == 1 and of(acts, WriteMember)
    # the round stops waiting for b at once: b is excused from its quorum (pushes.excuse), so it merges a's push,
    # neither at the member timeout (20 s of silence) or its deadline (100 s) nor after a restart that would ask a
    # to push again (HOPELESS_RESTART_S later)
    (mg,) = of(acts, Merge)
    # a heartbeat of that generation sent before the leaving one but delivered after it revives nothing
    m.handle(Heartbeat("b", GEN["b"], 4, 1.0, 6.5))
    assert not m.members["b"].live and m.counters["ignored.heartbeat_after_leave"] == 1
    assert [i.island for i in mg.members] == ["a"] and mg.attempt == 1 and m.rounds[1].quorum == 1
    assert not pulls(m.handle(Tick(6.0 + HOPELESS_RESTART_S + 1)))
    # in strict mode every member is waited for: the leave excuses nothing
    st = machine(fragments=1, sync_every=4, quorum_timeout_s=100.0)
    assert pulls(start(st))
    st.handle(push(st, "a", 1, now=5.0))
    assert not of(st.handle(Heartbeat("b", GEN["b"], 5, 1.0, 6.0, leaving=True)) + st.handle(Tick(6.1)), Merge)
    # a new process of the island (a new generation) joins again
    m.handle(hello("b", gen="b2" * 8, now=10.0))
    assert m.members["b"].live and m.members["b"].gen == "b2" * 8 and not m.members["b"].left


def test_a_leaving_heartbeat_is_taped_with_its_flag_and_an_ordinary_one_as_before():
    from yeto.services.syncer.events import event_from_json, event_to_json

    plain = Heartbeat("b", GEN["b"], 5, 1.0, 6.0)
    assert "leaving" not in event_to_json(plain)                 # older tapes and golden fixtures stay as they were
    bye = Heartbeat("b", GEN["b"], 5, 1.0, 6.0, leaving=True)
    assert event_to_json(bye)["leaving"] is True and event_from_json(event_to_json(bye)) == bye
    assert event_from_json(event_to_json(plain)) == plain


# ---- pacing (not strict) --------------------------------------------------------------------------

def test_no_launch_without_step_times_then_time_rule():
    m = nonstrict(sync_every=8, fragments=2)                   # H/P = 4
    acts = start(m, now=100.0)
    assert not pulls(acts)
    assert not pulls(m.handle(Tick(1000.0)))                   # nothing known about the islands' pace
    # b heartbeats before its first step (step_time null): it gives no pace and blocks nothing
    assert not pulls(m.handle(Heartbeat("b", GEN["b"], 0, None, 1000.0)))
    # the first known pace, 2.0 s · H/P = 4 steps after V0Done (t = 100): long due
    assert [p["step"] for p in pulls(m.handle(Heartbeat("a", GEN["a"], 0, 2.0, 1000.0)))] == [1]


def test_time_rule_uses_the_slowest_member():
    m = nonstrict(sync_every=8, fragments=2)
    start(m, now=0.0)
    m.handle(Heartbeat("a", GEN["a"], 0, 0.5, 0.0))
    m.handle(Heartbeat("b", GEN["b"], 0, 2.0, 0.0))
    assert m.next_wakeup() == pytest.approx(6.0)               # b: due at local 4 − lead 1 = 3 steps · 2 s
    assert not pulls(m.handle(Tick(5.9)))
    assert pulls(m.handle(Tick(6.0)))                          # progress rule: both at their due step − 1


def test_progress_rule_launches_early_when_islands_are_ahead():
    m = nonstrict(sync_every=8, fragments=2, quorum=None, launch_lead_steps=0)
    start(m, now=0.0)
    m.handle(Heartbeat("a", GEN["a"], 0, 10.0, 0.0))
    m.handle(Heartbeat("b", GEN["b"], 0, 10.0, 0.0))           # time rule would wait 40 s
    m.handle(Heartbeat("a", GEN["a"], 4, None, 3.0))
    assert not pulls(m.handle(Heartbeat("b", GEN["b"], 3, None, 3.0)))
    acts = m.handle(Heartbeat("b", GEN["b"], 4, None, 3.5))
    assert [p["step"] for p in pulls(acts)] == [1]


def test_ema_from_heartbeat_deltas_when_no_step_time_given():
    m = nonstrict()
    start(m)
    m.handle(Heartbeat("a", GEN["a"], 0, None, 0.0))
    m.handle(Heartbeat("a", GEN["a"], 10, None, 5.0))
    assert m.members["a"].ema_step_s == pytest.approx(0.5)
    m.handle(Heartbeat("a", GEN["a"], 20, 1.5, 6.0))
    assert m.members["a"].ema_step_s == pytest.approx(0.3 * 1.5 + 0.7 * 0.5)


def test_late_joiner_does_not_stall_the_time_rule():
    m = nonstrict(sync_every=4, fragments=2, quorum=None, total_steps=10, grace_ms=0.0, launch_lead_steps=0)
    start(m, now=0.0)
    for isl in ("a", "b"):
        m.handle(Heartbeat(isl, GEN[isl], 0, 1.0, 0.0))
    assert [p["step"] for p in pulls(m.handle(Tick(2.0)))] == [1]    # H/P = 2 steps of 1 s
    m.handle(push(m, "a", 1, now=2.5))
    (mg,) = of(m.handle(push(m, "b", 1, now=2.5)), Merge)
    m.handle(hello("c", now=2.6))                               # joins, reports nothing for a while
    assert not pulls(merge_done(m, mg, now=2.7))
    # a and b are far ahead (the progress rule alone would launch now) but c has not reported yet
    assert not pulls(m.handle(Heartbeat("a", GEN["a"], 10, 1.0, 2.8)) + m.handle(Heartbeat("b", GEN["b"], 10, 1.0, 2.8)))
    assert not pulls(m.handle(Tick(3.9)))
    (p,) = pulls(m.handle(Tick(4.0)))                           # the time rule: H/P steps after round 1
    assert p["step"] == 2 and [x["island"] for x in p["members"]] == ["a", "b", "c"]


def test_pipeline_never_two_rounds_on_one_fragment():
    m = machine(pipeline=5, fragments=2, total_steps=6)
    acts = start(m)
    assert [(p["step"], p["fragment"]) for p in pulls(acts)] == [(1, 0), (2, 1)]


# ---- commit order ---------------------------------------------------------------------------------

def test_commits_strictly_in_step_order():
    m = machine(pipeline=2, fragments=2, total_steps=4)
    start(m)
    m.handle(push(m, "a", 2))
    acts = m.handle(push(m, "b", 2))                            # round 2 complete before round 1
    assert not of(acts, Merge) and not m.rounds[2].accepting
    assert dispositions(m.handle(push(m, "a", 2, try_=1))) == ["out_of_round"]
    m.handle(push(m, "a", 1))
    (mg1,) = of(m.handle(push(m, "b", 1)), Merge)
    assert mg1.step == 1
    with pytest.raises(ValueError):
        m.handle(MergeDone(2, 1, 1, 0.1, 3.0))                  # not the outstanding merge
    with pytest.raises(ValueError):
        m.handle(MergeDone(1, 0, 7, 0.1, 3.0))                  # wrong version
    acts = merge_done(m, mg1, now=3.0)
    merges = of(acts, Merge)
    assert [x.step for x in merges] == [2]                      # released only after round 1's commit
    # round 3 (fragment 0) launches after round 1's commit, on the new version
    assert [(p["step"], p["base_version"]) for p in pulls(acts)] == [(3, 1)]


# ---- finalization ---------------------------------------------------------------------------------

def run_to_final(m, now=1.0):
    acts = start(m)
    for t in range(1, m.config.total_steps + 1):
        m.handle(push(m, "a", t, now=now))
        (mg,) = of(m.handle(push(m, "b", t, now=now)), Merge)
        acts = merge_done(m, mg, now=now)
    return acts


def publish_final(m, now=1.5):
    """Answer the machine's PublishFinal (the shell published the f32 cut)."""
    return m.handle(FinalPublished(now))


def test_final_acks_only_from_targets_then_shutdown_and_done():
    m = machine(total_steps=2)
    acts = run_to_final(m)
    (fin,) = of(acts, PublishFinal)
    assert fin.final_step == 2 and m.phase == "finalizing" and tapes(acts, "final") and not of(acts, SendManifest)
    acts = m.handle(FinalAck("a", GEN["a"], 2, 1.2))            # before the cut is out: nobody was sent it
    assert m.counters["rejected.final_ack"] == 1
    acts = publish_final(m)
    assert of(acts, SendManifest) == [SendManifest("a", GEN["a"], 2, {0: 1, 1: 1}), SendManifest("b", GEN["b"], 2, {0: 1, 1: 1})]
    assert of(acts, RecordFinal)[0].record == {"final_step": 2, "versions": {"0": 1, "1": 1},
                                               "targets": {"a": GEN["a"], "b": GEN["b"]}, "acked": [], "finished": False}
    acts = m.handle(FinalAck("c", GEN["c"], 2, 2.0))
    assert not of(acts, Done) and m.counters["rejected.final_ack"] == 2
    acts = m.handle(FinalAck("a", "a9" * 8, 2, 2.0))            # not the generation sent the cut
    acts += m.handle(FinalAck("a", GEN["a"], 1, 2.0))           # wrong step
    assert not of(acts, Done) and m.counters["rejected.final_ack"] == 4
    assert dispositions(m.handle(push(m, "a", 3))) == ["out_of_round"]
    acts = m.handle(FinalAck("a", GEN["a"], 2, 3.0))
    assert not of(acts, Done) and of(acts, RecordFinal)[0].record["acked"] == ["a"]   # acks are kept durably
    acts = m.handle(FinalAck("b", GEN["b"], 2, 3.0))
    assert of(acts, Shutdown) == [Shutdown("a", GEN["a"], "final"), Shutdown("b", GEN["b"], "final")]
    assert of(acts, RecordFinal)[-1].record["finished"] is True
    assert of(acts, Done) == [Done(True, ())] and m.phase == "done"
    assert m.handle(Tick(100.0)) == []


def test_final_timeout_names_the_missing_and_shuts_down_the_acked():
    m = machine(total_steps=1, fragments=1, sync_every=1, final_timeout_s=50.0)
    run_to_final(m, now=1.0)
    publish_final(m)
    m.handle(FinalAck("b", GEN["b"], 1, 2.0))
    assert not of(m.handle(Tick(50.9)), Done)
    acts = m.handle(Tick(51.0))
    assert of(acts, Done) == [Done(False, ("a",))] and of(acts, Shutdown) == [Shutdown("b", GEN["b"], "final")]


def test_new_generation_of_a_target_gets_the_cut_unknown_islands_are_refused():
    m = machine(total_steps=1, fragments=1, sync_every=1)
    run_to_final(m)
    publish_final(m)
    acts = m.handle(hello("a", gen=A2, now=2.0))
    assert of(acts, SendManifest) == [SendManifest("a", A2, 1, {0: 1})] and not of(acts, PublishFinal)
    acts = m.handle(hello("c", now=2.0))
    assert [e.code for e in of(acts, SendError)] == ["run_finishing"] and "c" not in m.members
    m.handle(FinalAck("b", GEN["b"], 1, 3.0))
    acts = m.handle(FinalAck("a", A2, 1, 3.0))
    assert of(acts, Done) == [Done(True, ())] and Shutdown("a", A2, "final") in acts


def test_new_generation_while_the_final_cut_is_published_never_publishes_it_twice():
    # regression, final-cut race: a target's new generation during the publication made the machine
    # emit a second Finalize while the first ran (a partial digest dict, two checkpoint writers)
    m = machine(total_steps=1, fragments=2, sync_every=2)
    acts = run_to_final(m)
    assert len(of(acts, PublishFinal)) == 1
    acts = m.handle(hello("a", gen=A2, now=1.2))                # cut not out yet
    assert not of(acts, PublishFinal) and not of(acts, SendManifest) and not of(acts, RecordFinal)
    acts = m.handle(hello("a", gen=A3, now=1.3))
    assert not of(acts, PublishFinal) and not of(acts, SendManifest)
    acts = publish_final(m, now=1.5)
    # one manifest per target, to the newest generation only, after the cut is out
    assert of(acts, SendManifest) == [SendManifest("a", A3, 1, {0: 1, 1: 0}), SendManifest("b", GEN["b"], 1, {0: 1, 1: 0})]
    with pytest.raises(ValueError, match="FinalPublished"):
        m.handle(FinalPublished(1.6))                          # a second publication is a shell bug
    assert m.handle(FinalAck("a", A2, 1, 2.0)) == [] or m.counters["rejected.final_ack"] == 1
    m.handle(FinalAck("a", A3, 1, 2.0))
    assert of(m.handle(FinalAck("b", GEN["b"], 1, 2.0)), Done) == [Done(True, ())]


def test_known_island_back_during_finalization_gets_the_manifest():
    # regression: a known island heard from after finalization started (heartbeat of a member that had
    # left, or a new generation, even of one that acked) got neither manifest nor error
    m = machine(total_steps=1, fragments=1, sync_every=1, member_timeout_s=5.0)
    start(m)
    m.handle(Heartbeat("a", GEN["a"], 1, 0.1, 0.5))
    m.handle(push(m, "a", 1, now=0.5))
    (mg,) = of(m.handle(push(m, "b", 1, now=0.5)), Merge)
    m.handle(Heartbeat("b", GEN["b"], 1, 0.1, 5.5))             # a falls silent: it leaves at 5.5
    acts = merge_done(m, mg, now=5.6)
    assert not m.members["a"].live
    (fin,) = of(acts, PublishFinal)
    assert fin.record["targets"] == {"b": GEN["b"]}
    acts = m.handle(Heartbeat("a", GEN["a"], 2, 0.1, 5.8))      # a is back before the cut is out
    assert not of(acts, SendManifest) and m.state.final.targets == {"a": GEN["a"], "b": GEN["b"]}
    acts = publish_final(m, now=6.0)
    assert {(x.island, x.gen) for x in of(acts, SendManifest)} == {("a", GEN["a"]), ("b", GEN["b"])}
    m.handle(FinalAck("b", GEN["b"], 1, 6.5))
    # b's process restarts after its ack: the new one must install the cut too, and ack
    acts = m.handle(hello("b", gen="b2" * 8, now=7.0))
    assert of(acts, SendManifest) == [SendManifest("b", "b2" * 8, 1, {0: 1})]
    assert not of(m.handle(FinalAck("a", GEN["a"], 1, 7.5)), Done)
    acts = m.handle(FinalAck("b", "b2" * 8, 1, 8.0))
    assert of(acts, Done) == [Done(True, ())]


def test_heartbeat_of_an_unknown_island_or_generation_asks_for_hello():
    # regression: a resumed syncer without members ignored their heartbeats for ever
    m = machine(member_timeout_s=10.0)
    start(m, islands=("a", "b"))
    acts = m.handle(Heartbeat("c", GEN["c"], 5, 0.1, 1.0))
    (err,) = of(acts, SendError)
    assert (err.island, err.gen, err.code, err.fatal, err.field) == ("c", GEN["c"], "unknown_member", False, "gen")
    assert "hello again" in err.message and tapes(acts, "error")
    assert not of(m.handle(Heartbeat("c", GEN["c"], 6, 0.1, 5.0)), SendError)   # once per member timeout
    assert of(m.handle(Heartbeat("c", GEN["c"], 7, 0.1, 11.0)), SendError)
    # a known island with a generation the machine never saw (its hello was lost) is asked too
    (err,) = of(m.handle(Heartbeat("a", A2, 1, 0.1, 12.0)), SendError)
    assert err.code == "unknown_member" and err.gen == A2
    # a retired generation is only stale: no answer
    m.handle(hello("b", gen="b2" * 8, now=13.0))
    assert not of(m.handle(Heartbeat("b", GEN["b"], 1, 0.1, 14.0)), SendError)
    assert m.counters["ignored.heartbeat_stale_gen"] == 1
    # saying hello again makes it a member
    m.handle(hello("c", now=15.0))
    assert "c" in m.members and not of(m.handle(Heartbeat("c", GEN["c"], 8, 0.1, 16.0)), SendError)


# ---- restore (--resume) ---------------------------------------------------------------------------

def session_record(c: SyncerConfig) -> dict:
    return Builder()(LAYOUT, c.fragments, run=c.run, push_dtype=c.push_dtype, bulk_dtype=c.bulk_dtype,
                     chunk_bytes=c.chunk_bytes, init_island="a", sync_every=c.sync_every)


def test_restore_continues_after_the_committed_step():
    c = cfg(total_steps=6)
    members = {isl: {"gen": GEN[isl], "layout_fingerprint": FP, "last_step": 40, "last_heartbeat": 1.0,
                     "admitted_at": 0.0, "live": True} for isl in ("a", "b")}
    m = RoundMachine.restore(c, session_record(c), {"0": 2, "1": 1}, 3, members, now=500.0, min_attempts={4: 3})
    acts = m.handle(Tick(500.0))
    assert not of(acts, CommitV0) and not of(acts, WriteSession)
    (p,) = pulls(acts)
    assert (p["step"], p["fragment"], p["base_version"], p["attempt"]) == (4, 1, 1, 3)
    m.handle(push(m, "a", 4, attempt=3))
    (mg,) = of(m.handle(push(m, "b", 4, attempt=3)), Merge)
    assert mg.version == 2 and m.init_island == "a"
    # members restored are live for a full timeout from the restore time
    assert not tapes(m.handle(Tick(500.0 + c.member_timeout_s - 1)), "leave")


def test_restore_refuses_inconsistent_state_and_finalizes_when_done():
    c = cfg(total_steps=2)
    members = {"a": {"gen": GEN["a"], "layout_fingerprint": FP}}
    with pytest.raises(ValueError, match="--push-dtype"):
        RoundMachine.restore(cfg(push_dtype="bf16"), session_record(c), {0: 0, 1: 0}, 0, members, now=1.0)
    with pytest.raises(ValueError, match="versions"):
        RoundMachine.restore(c, session_record(c), {0: 0}, 0, members, now=1.0)
    with pytest.raises(ValueError, match="layout_fingerprint"):
        RoundMachine.restore(c, session_record(c), {0: 0, 1: 0}, 0,
                             {"a": {"gen": GEN["a"], "layout_fingerprint": OTHER_FP}}, now=1.0)
    m = RoundMachine.restore(c, session_record(c), {0: 1, 1: 1}, 2, members, now=1.0)
    (fin,) = of(m.handle(Tick(1.0)), PublishFinal)
    assert fin.record["targets"] == {"a": GEN["a"]} and fin.versions == {0: 1, 1: 1}


def test_restore_of_a_finished_run_is_done_at_once():
    # regression: --resume of a finished run finalized again, waited --final-timeout and exited 3
    c = cfg(total_steps=2)
    members = {i: {"gen": GEN[i], "layout_fingerprint": FP} for i in ("a", "b")}
    rec = {"final_step": 2, "versions": {"0": 1, "1": 1}, "targets": {"a": GEN["a"], "b": GEN["b"]},
           "acked": ["a", "b"], "finished": True}
    m = RoundMachine.restore(c, session_record(c), {0: 1, 1: 1}, 2, members, now=1.0, final=rec)
    acts = m.handle(Tick(1.0))
    assert of(acts, Done) == [Done(True, ())] and m.phase == "done"
    assert not of(acts, PublishFinal) and not of(acts, SendManifest) and not of(acts, Shutdown)


def test_restore_mid_finalization_resends_the_manifest_to_targets_that_did_not_ack():
    c = cfg(total_steps=2)
    members = {i: {"gen": GEN[i], "layout_fingerprint": FP} for i in ("a", "b")}
    rec = {"final_step": 2, "versions": {"0": 1, "1": 1}, "targets": {"a": GEN["a"], "b": GEN["b"]},
           "acked": ["a"], "finished": False}
    m = RoundMachine.restore(c, session_record(c), {0: 1, 1: 1}, 2, members, now=1.0, final=rec)
    acts = m.handle(Tick(1.0))
    assert not of(acts, PublishFinal)                           # the cut is out already
    assert of(acts, SendManifest) == [SendManifest("b", GEN["b"], 2, {0: 1, 1: 1})]
    acts = m.handle(FinalAck("b", GEN["b"], 2, 2.0))
    assert of(acts, Shutdown) == [Shutdown("a", GEN["a"], "final"), Shutdown("b", GEN["b"], "final")]
    assert of(acts, Done) == [Done(True, ())]
    # every target had acked before the crash: done at once, with their shutdowns
    m = RoundMachine.restore(c, session_record(c), {0: 1, 1: 1}, 2, members, now=1.0,
                             final={**rec, "acked": ["a", "b"]})
    acts = m.handle(Tick(1.0))
    assert len(of(acts, Shutdown)) == 2 and of(acts, Done) == [Done(True, ())]


# ---- wire conformance and determinism -------------------------------------------------------------

def _validator(name: str):
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def scenario() -> list:
    """A busy run: non-strict, restart, rebinding, rejected pushes, finalization."""
    m = RoundMachine(cfg(strict=False, quorum=2, grace_ms=2000.0, total_steps=3, islands=2, pipeline=1,
                         quorum_timeout_s=20.0), session_builder=Builder())
    out = []
    out += m.handle(hello("b", now=1.0)) + m.handle(hello("a", now=1.0)) + m.handle(hello("c", now=1.0, fp=OTHER_FP))
    out += m.handle(InitComplete("b", GEN["b"], 0, 2.0)) + m.handle(InitComplete("b", GEN["b"], 1, 2.0))
    out += m.handle(V0Done(3.0))
    for isl in ("a", "b"):
        out += m.handle(Heartbeat(isl, GEN[isl], 0, 1.0, 3.0))
    out += m.handle(Tick(7.0))
    out += m.handle(push(m, "a", 1, now=7.5)) + m.handle(Tick(27.0))          # restart of round 1
    out += m.handle(hello("a", gen=A2, now=27.5))                              # rebinding
    out += m.handle(push(m, "a", 1, attempt=2, now=28.0))                      # stale generation
    out += m.handle(push(m, "a", 1, gen=A2, attempt=2, now=28.0))
    out += m.handle(push(m, "b", 1, attempt=2, tokens=0, now=28.5))
    for t in (2, 3):
        for mg in of(out, Merge):
            if mg.step == t - 1:
                out += merge_done(m, mg, now=29.0 + t)
        out += m.handle(Heartbeat("a", A2, 10 * t, 1.0, 29.0 + t))
        out += m.handle(Heartbeat("b", GEN["b"], 10 * t, 1.0, 29.0 + t))
        out += m.handle(Tick(40.0 + t))
        assert m.rounds[t].attempt == 1
        out += m.handle(push(m, "a", t, gen=A2, now=41.0 + t)) + m.handle(push(m, "b", t, now=41.0 + t))
        out += m.handle(push(m, "b", t, try_=1, now=41.0 + t))
    for mg in of(out, Merge):
        if mg.step == 3:
            out += merge_done(m, mg, now=50.0)
    out += m.handle(FinalPublished(50.5))
    out += m.handle(FinalAck("a", A2, 3, 51.0)) + m.handle(FinalAck("b", GEN["b"], 3, 51.0))
    return out


def test_tape_pulls_and_errors_conform_to_the_wire_schemas():
    out = scenario()
    kinds = {e["kind"] for e in tapes(out)}
    assert {"restart", "disposition", "join", "final", "error", "session"} <= kinds
    assert of(out, Done) == [Done(True, ())]
    event_v, pull_v, error_v = _validator("event"), _validator("pull"), _validator("error")
    merges = [mg.record for mg in of(out, Merge)]
    assert len(merges) == 3
    for e in tapes(out) + [{**r, "t": 1.0, "sync_s": 1.0} for r in merges]:
        event_v.validate({"v": 1, "run": "r1", **e})
    for p in pulls(out):
        pull_v.validate({"type": "pull", "v": 1, "run": "r1", **p})
    for err in of(out, SendError):
        doc = {"type": "error", "v": 1, "run": "r1", "code": err.code, "message": err.message,
               "fatal": err.fatal, "field": err.field, "gen": err.gen}
        error_v.validate(doc)


def test_deterministic():
    assert scenario() == scenario()


def test_default_builder_is_schemas_build_session():
    from yeto.schemas import layout as L

    layout = [{"name": "model.embed_tokens.weight", "shape": [8, 4], "dtype": "float32"},
              {"name": "model.layers.0.w", "shape": [4, 4], "dtype": "float32"},
              {"name": "model.layers.1.w", "shape": [4, 4], "dtype": "float32"}]
    fp = L.layout_fingerprint(layout)
    m = RoundMachine(cfg(push_dtype="bf16", chunk_bytes=4096))
    acts = m.handle(Hello("a", GEN["a"], layout, fp, "auto", "auto", 1700000000.0))
    (ws,) = of(acts, WriteSession)
    _validator("session").validate(ws.session)
    assert ws.session["init_island"] == "a" and ws.session["created"] == 1700000000.0
    assert len(ws.session["fragments"]) == 2 and ws.session["push_dtype"] == "bf16"
    # a hello whose fingerprint lies about its layout is refused by the real builder too
    m2 = RoundMachine(cfg())
    assert [e.code for e in of(m2.handle(Hello("a", GEN["a"], layout, "0" * 64, "auto", "auto", 1.0)), SendError)] == ["layout_mismatch"]
