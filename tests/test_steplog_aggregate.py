"""The pure step-log aggregator, chart model and terminal rendering (no broker needed here)."""
from __future__ import annotations

import json

import orjson
from hypothesis import given, settings, strategies as st

from yeto.schemas import subjects as S
from yeto.services.steplog.aggregate import Aggregator, ChartModel, feed_all, is_quorum_timeout
from yeto.services.steplog.tail import render_text
from tests.test_steplog_support import MALFORMED, SyntheticRun, add_malformed, gen_of, scenario

RUN = "agg_run"


def folded(run=RUN, malformed=True, **kw):
    r = scenario(run)
    if malformed:
        add_malformed(r)
    agg = Aggregator(run, **kw)
    recs = feed_all(agg, [(s, d) for s, d, _ in r.msgs])
    return r, agg, recs


def test_islands_hold_the_latest_step_and_running_totals():
    r, agg, recs = folded()
    assert len(recs) == len(r.steplogs) + len(r.events)
    for name in ("a", "b"):
        mine = [m for m in r.steplogs if m["island"] == name]
        st_ = agg.islands[name]
        last = mine[-1]
        assert (st_.step, st_.boundary_s, st_.export_s, st_.apply_s) == (last["step"], last["boundary_s"], last["export_s"], last["apply_s"])
        assert st_.pending_pulls == last["pending_pulls"] and st_.dropped == last["dropped"]
        assert st_.versions == {int(f): v for f, v in last["versions"].items()}
        for k in ("pushes", "applies", "bytes_out", "bytes_in", "scatter_bytes", "gather_bytes", "rejected"):
            assert st_.totals[k] == sum(m[k] for m in mine), k
            assert st_.last[k] == last[k]
        assert st_.events == len(mine)
        assert abs(st_.boundary_sum_s - sum(m["boundary_s"] for m in mine)) < 1e-12
        assert st_.gen == gen_of(name) and st_.gens == 1
    assert agg.islands["a"].loss == 2.75 and agg.islands["b"].loss is None
    assert agg.islands["b"].live is False and agg.islands["a"].live is True


def test_rounds_dispositions_restarts_and_timeouts():
    r, agg, _ = folded()
    assert set(agg.rounds) == {1, 2}  # the version-0 commits (step 0) are not rounds
    r1, r2 = agg.rounds[1], agg.rounds[2]
    assert (r1.fragment, r1.attempt, r1.status, r1.version, r1.base_version) == (0, 1, "committed", 1, 0)
    assert (r1.quorum_s, r1.grace_s, r1.sync_s, r1.expected, r1.responded, r1.quorum) == (1.25, 0.0, 1.75, 2, 2, 2)
    assert dict(r1.dispositions) == {"accepted": 2, "duplicate": 1} and r1.restarts == 0
    assert (r2.fragment, r2.attempt, r2.restarts, r2.quorum_timeouts) == (1, 2, 1, 1)
    assert dict(r2.dispositions) == {"accepted": 1, "out_of_round": 1}
    assert r2.reason.startswith("deadline passed below quorum")
    want = {}
    for m in r.events:
        if m["kind"] == "disposition":
            want[m["disposition"]] = want.get(m["disposition"], 0) + 1
    assert dict(agg.dispositions) == want
    assert dict(agg.islands["a"].dispositions) == {"accepted": 2, "duplicate": 1}
    assert (agg.merges, agg.restarts, agg.quorum_timeouts, agg.errors, agg.syncer_resumes) == (2, 1, 1, 1, 0)
    assert agg.syncer_versions == {0: 1, 1: 1} and agg.committed_step == 2


def test_version_lag_is_against_the_syncer_and_never_negative():
    _, agg, _ = folded()
    assert agg.lag("a") == {0: 0, 1: 0}
    assert agg.lag("b") == {0: 0, 1: 1}
    assert agg.islands["b"].max_lag(agg.syncer_versions) == 1
    # A viewer that started mid-run: no merge seen yet, the commit record seeds the syncer's versions,
    # and an island holding a newer version than anything seen raises the known version (lower bound).
    late = Aggregator(RUN)
    late.seed_versions({"0": 5, "1": 4}, committed_step=9)
    run = SyntheticRun(RUN)
    run.step("a", 40, boundary_s=0.1, export_s=0.0, apply_s=0.0, versions={0: 5, 1: 3})
    run.step("b", 41, boundary_s=0.1, export_s=0.0, apply_s=0.0, versions={0: 6})
    feed_all(late, [(s, d) for s, d, _ in run.msgs])
    assert late.syncer_versions == {0: 6, 1: 4} and late.committed_step == 9
    assert late.lag("a") == {0: 1, 1: 1} and late.lag("b") == {0: 0}
    assert late.islands["b"].missing(late.syncer_versions) == [1]


def test_malformed_messages_are_skipped_and_counted_by_reason():
    r, agg, recs = folded()
    assert agg.malformed == MALFORMED
    assert dict(agg.malformed_by) == {("steplog", "DecodeError"): 1, ("steplog", "required"): 1,
                                      ("steplog", "subject_mismatch"): 1, ("event", "run_mismatch"): 1}
    assert "someone_else" in agg.last_malformed
    # nothing of the broken messages leaked into the state: b's event on a's subject did not move a
    assert agg.islands["a"].step == 4 and agg.islands["a"].events == 4
    # foreign subjects and wrong kinds are refused too, without raising
    assert agg.feed("yeto.other.steplog.a", r.msgs[4][1]) is None
    assert agg.feed(S.events(RUN, "merge"), orjson.dumps(r.events[0])) is None  # a join on the merge subject
    assert agg.feed(f"yeto.{RUN}.push.a.0", b"{}") is None
    assert agg.malformed == MALFORMED + 3


_BASES = [(S.steplog(RUN, m["island"]), m) for m in scenario(RUN).steplogs[-2:]] + \
    [(S.events(RUN, m["kind"]), m) for m in scenario(RUN).events]
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                     max_leaves=8)
_DROP = object()


@st.composite
def near_misses(draw):
    """A real step-log event or tape record with one field replaced by anything (or dropped)."""
    subject, base = draw(st.sampled_from(_BASES))
    key = draw(st.sampled_from(sorted(base)))
    value = draw(_json | st.just(_DROP) | st.integers(min_value=-2, max_value=3))
    msg = {k: v for k, v in {**base, key: value}.items() if v is not _DROP}
    return subject, json.dumps(msg).encode()


@settings(max_examples=300, deadline=None)
@given(case=st.one_of(
    near_misses(),
    st.tuples(st.sampled_from(["steplog.a", "events.merge", "events.error", "steplog.x.y", "nonsense"])
              .map(lambda t: f"yeto.{RUN}.{t}"),
              st.binary(max_size=200) | _json.map(lambda v: json.dumps(v).encode())),
))
def test_any_bytes_on_any_subject_never_raise(case):
    subject, data = case
    agg = Aggregator(RUN)
    rec = agg.feed(subject, data)
    if rec is None:
        assert agg.malformed == 1 and not agg.islands and not agg.rounds and not agg.kinds
    else:  # still valid after the change (say, another loss value): folded, and nothing counted as bad
        assert agg.malformed == 0 and sum(agg.kinds.values()) == 1
    assert ("steplog", "unhandled") not in agg.malformed_by and ("event", "unhandled") not in agg.malformed_by


def test_island_filter_keeps_one_island_and_all_rounds():
    _, agg, _ = folded(island="a")
    assert set(agg.islands) == {"a"}
    assert agg.filtered == 4  # b's four step-log events
    assert set(agg.rounds) == {1, 2} and agg.merges == 2
    assert dict(agg.islands["a"].dispositions) == {"accepted": 2, "duplicate": 1}


def test_quorum_timeout_classification():
    base = {"v": 1, "run": RUN, "t": 1.0}
    assert is_quorum_timeout({**base, "kind": "restart", "step": 3, "fragment": 0, "attempt": 2, "reason": "x"})
    assert not is_quorum_timeout({**base, "kind": "restart", "step": 3, "fragment": 0, "attempt": 1,
                                  "reason": "syncer resumed from checkpoint"})
    assert is_quorum_timeout({**base, "kind": "error", "step": 3, "fragment": 0, "attempt": 1,
                              "reason": "quorum_timeout (strict: attempt stands): 1/2 answered"})
    assert not is_quorum_timeout({**base, "kind": "error", "reason": "quorum_timeout-looking text without a round"})
    assert is_quorum_timeout({**base, "kind": "error", "reason": "x", "detail": {"cause": "quorum_timeout"}})
    # the syncer resuming is counted apart, not as a restart of a round
    r = SyntheticRun(RUN)
    r.tape("restart", step=7, fragment=0, attempt=1, reason="syncer resumed from checkpoint")
    agg = Aggregator(RUN)
    feed_all(agg, [(s, d) for s, d, _ in r.msgs])
    assert (agg.syncer_resumes, agg.restarts, agg.quorum_timeouts) == (1, 0, 0)


def test_rounds_and_recent_records_are_bounded():
    r = SyntheticRun(RUN)
    for step in range(1, 31):
        r.tape("restart", step=step, fragment=0, attempt=2, reason="deadline passed below quorum")
    agg = Aggregator(RUN, max_rounds=10, max_recent=5)
    feed_all(agg, [(s, d) for s, d, _ in r.msgs])
    assert sorted(agg.rounds) == list(range(21, 31))
    assert len(agg.recent) == 5 and agg.recent[-1]["step"] == 30
    assert agg.quorum_timeouts == 30


def test_chart_model_snapshot_then_deltas_cover_every_point_once():
    r = scenario(RUN)
    agg = Aggregator(RUN)
    chart = ChartModel(agg, max_points=3)
    half = len(r.msgs) // 2
    for s, d, _ in r.msgs[:half]:
        chart.add(agg.feed(s, d))
    snap = chart.snapshot()
    chart.discard_delta()  # what the dashboard does: a new viewer's snapshot already holds them
    for s, d, _ in r.msgs[half:]:
        chart.add(agg.feed(s, d))
    delta = chart.take_delta()
    assert chart.take_delta() is None  # taken
    got = {k: len(snap["islands"].get(k, [])) + len(delta["islands"].get(k, [])) for k in ("a", "b")}
    assert got == {"a": 4, "b": 4}
    assert len(snap["rounds"]) + len(delta["rounds"]) == 2
    assert len(snap["timeouts"]) + len(delta["timeouts"]) == 1
    # the series are bounded; the newest points survive
    assert [p[1] for p in chart.islands["a"]] == [2, 3, 4]
    # island point layout: [t, step, boundary_s, export_s, apply_s, lag, loss]; lag of b's last point is 1,
    # b reports no loss, a's last is 2.75
    assert chart.islands["b"][-1][1:] == [4, 0.5, 0.05, 0.0, 1, None]
    assert chart.islands["a"][-1][-1] == 2.75
    assert [p[4] for p in chart.rounds] == [1.75, 4.25] and [p[3] for p in chart.rounds] == [1.25, 3.5]
    assert delta["summary"]["merges"] == 2 and delta["island_state"]["b"]["lag"] == 1
    assert orjson.loads(orjson.dumps(snap))["fields"]["island"] == list(ChartModel.ISLAND_FIELDS)


def test_render_shows_every_field():
    r, agg, _ = folded()
    text = render_text(agg, now=r.t + 2.0, width=260)
    for col in ("island", "gen", "step", "age", "boundary", "export", "apply", "exp/app", "mean bnd", "versions", "lag",
                "pulls", "push/apply", "out", "in", "scat/gath", "rej", "dispositions", "loss", "drop", "island traffic"):
        assert col in text, col
    # each island has a row in "islands" and one in "island traffic": read them together
    a_row = " ".join(line for line in text.splitlines() if line.startswith("│a "))
    for cell in ("9f3c2a7b1e4d6c08", " 4 ", "300 ms", "100 ms", "120 ms", "33%/40%", "225 ms", "0:1 1:1", "2/2",
                 "1000 B Σ2.0 KiB", "2.0 KiB Σ3.9 KiB", "600 B/300 B", "accepted 2 duplicate 1", "2.75",
                 f"{r.t + 2.0 - r.steplogs[-2]['t']:.2f} s"):  # age of a's last event
        assert cell in a_row, (cell, a_row)
    b_row = " ".join(line for line in text.splitlines() if line.startswith("│b (left)"))
    for cell in ("500 ms", "50 ms", "0:1 1:0", "1 (1:1)", "accepted 1 out_of_round 1", "│    3│", "04b1e6d2c9a87f35"):
        assert cell in b_row, (cell, b_row)
    r2 = next(line for line in text.splitlines() if line.startswith("│   2 │"))
    for cell in ("│    1 │", "│       2 │", "committed", "1/1 (1)", "3.50 s", "500 ms", "4.25 s", "0→1", "deadline passed"):
        assert cell in r2, (cell, r2)
    assert "restarts 1  quorum timeouts 1" in text and "syncer versions 0:1 1:1" in text
    assert "malformed 4" in text and "someone_else" in text
    assert "leave" in text and "no heartbeat for 31.0s" in text


def test_commit_before_merge_still_ends_committed():
    """The real syncer tapes `commit` (after the durable checkpoint and the broadcast) before `merge`."""
    r = SyntheticRun(RUN)
    r.tape("commit", step=1, fragment=0, version=1)
    r.tape("merge", step=1, fragment=0, attempt=1, base_version=0, version=1, expected=[], responded=[], quorum=1,
           weights={}, quorum_s=0.5, sync_s=0.75)
    agg = Aggregator(RUN)
    feed_all(agg, [(s, d) for s, d, _ in r.msgs])
    assert agg.rounds[1].status == "committed" and agg.rounds[1].sync_s == 0.75 and agg.merges == 1
