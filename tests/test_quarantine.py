"""Defence in depth inside the syncer's round machine (docs/design.md §9): a push holding NaN/Inf,
one whose norm exceeds --max-push-norm, or one whose norm exceeds --outlier-factor x the round's median
norm is `quarantined` (taped with its figures, counted, released, never merged; the round goes on as if
that member had not answered), and a claimed c_tokens is capped at --max-token-factor x the round's
lower median claim. Hand-built event sequences, no broker, no clock."""
from __future__ import annotations

import math

import pytest

from yeto.services.syncer.outer import weights_for
from yeto.services.syncer.actions import Merge, Release
from yeto.services.syncer.config import DISPOSITIONS, HOPELESS_RESTART_S, OUTLIER_MIN_PUSHES
from yeto.services.syncer.events import Heartbeat, Hello, InitComplete, PushComplete, Tick, V0Done
from yeto.services.syncer.rounds import RoundMachine
from tests.test_rounds import FP, LAYOUT, _validator, cfg, dispositions, machine, merge_done, of, pulls, tapes

GEN = {i: i + "1" * 15 for i in "abcd"}
EVENT = _validator("event")


def start(m, islands):
    for isl in islands:
        m.handle(Hello(isl, GEN[isl], LAYOUT, FP, "auto", "auto", 0.0))
    for f in range(m.config.fragments):
        m.handle(InitComplete(islands[0], GEN[islands[0]], f, 0.0))
    m.handle(V0Done(0.0))
    assert m.phase == "running"


def qpush(m, island, step, *, norm=1.0, non_finite=0, tokens=100, attempt=None, try_=0, now=5.0):
    """A valid push of `island` for round `step` carrying the shell's figures (norm, non-finite count)."""
    r = m.rounds[step]
    return PushComplete(island, GEN[island], r.fragment, step, attempt or r.attempt, try_, m.versions[r.fragment],
                        10, 5, tokens, True, None, now, norm=norm, non_finite=non_finite)


def launched(islands=("a", "b", "c"), **kw) -> RoundMachine:
    """A non-strict machine (H/P = 4, step time 1 s) with round 1 launched at t = 4 for `islands`."""
    base = dict(strict=False, islands=len(islands), fragments=1, sync_every=4, total_steps=3, grace_ms=0.0,
                quorum_timeout_s=100.0)
    base.update(kw)
    m = machine(**base)
    start(m, islands=islands)
    for isl in islands:
        m.handle(Heartbeat(isl, GEN[isl], 0, 1.0, 0.0))
    acts = m.handle(Tick(4.0))
    assert [p["step"] for p in pulls(acts)] == [1] and sorted(m.rounds[1].slots) == sorted(islands)
    return m


def valid_event(rec: dict) -> bool:
    return not list(EVENT.iter_errors({"v": 1, "run": "r1", **rec}))


def quarantined(acts) -> list[dict]:
    return [e for e in tapes(acts, "disposition") if e["disposition"] == "quarantined"]


# ---- configuration -------------------------------------------------------------------------------

def test_flags_are_off_by_default_except_the_token_cap_and_bad_values_name_the_flag():
    c = cfg()
    assert (c.max_push_norm, c.outlier_factor, c.max_token_factor) == (None, None, 4.0)
    assert "quarantined" in DISPOSITIONS and OUTLIER_MIN_PUSHES == 3
    for flag, bad in (("max_push_norm", 0.0), ("max_push_norm", -1.0), ("max_push_norm", math.nan),
                      ("max_push_norm", math.inf), ("outlier_factor", 1.0), ("outlier_factor", 0.5),
                      ("max_token_factor", 0.5), ("max_token_factor", math.inf), ("outlier_factor", True)):
        with pytest.raises(ValueError, match="--" + flag.replace("_", "-")):
            cfg(**{flag: bad})
    cfg(max_push_norm=1e-3, outlier_factor=1.5, max_token_factor=1.0)


# ---- rules judged on the push itself --------------------------------------------------------------

def test_non_finite_push_is_quarantined_taped_counted_released_and_a_later_sane_try_counts():
    m = machine(fragments=1, sync_every=1, total_steps=1)       # strict: every member must answer
    start(m, ("a", "b"))
    acts = m.handle(qpush(m, "a", 1, norm=math.nan, non_finite=3))
    (rec,) = quarantined(acts)
    assert rec["island"] == "a" and rec["gen"] == GEN["a"] and rec["try"] == 0
    assert rec["detail"]["quarantine"] == {"rule": "non_finite", "non_finite": 3, "limit": 0}
    assert "3 non-finite values" in rec["reason"] and valid_event(rec)
    assert of(acts, Release) == [Release("a", GEN["a"], 1, 0, 1, 0, "quarantined")]
    assert m.counters["disposition.quarantined"] == 1 and m.counters["quarantine.non_finite"] == 1
    assert m.rounds[1].slots["a"].answer is None and m.rounds[1].slots["a"].refused == "quarantined"
    # NaN/Inf is quarantined whatever the flags (no --max-push-norm here); a sane later try is taken
    assert not of(m.handle(qpush(m, "b", 1)), Merge)
    (mg,) = of(m.handle(qpush(m, "a", 1, try_=1, norm=2.0)), Merge)
    assert [(x.island, x.try_) for x in mg.members] == [("a", 1), ("b", 0)]


def test_norm_above_max_push_norm_is_quarantined_at_the_limit_is_not_and_unset_means_off():
    m = launched(max_push_norm=10.0, quorum=2)
    acts = m.handle(qpush(m, "c", 1, norm=10.5, tokens=10**9))
    (rec,) = quarantined(acts)
    assert rec["detail"]["quarantine"] == {"rule": "max_push_norm", "norm": 10.5, "limit": 10.0}
    assert "exceeds --max-push-norm 10" in rec["reason"] and valid_event(rec)
    assert m.counters["quarantine.max_push_norm"] == 1 and of(acts, Release)[0].reason == "quarantined"
    assert dispositions(m.handle(qpush(m, "a", 1, norm=10.0, tokens=100))) == ["accepted"]   # at the limit
    (mg,) = of(m.handle(qpush(m, "b", 1, norm=3.0, tokens=300)), Merge)
    # c's push is left out of the merge and of the weights: as if it had not pushed
    assert [x.island for x in mg.members] == ["a", "b"]
    assert [x.weight for x in mg.members] == weights_for([100, 300], False) == [0.25, 0.75]
    assert mg.record["weights"] == {"a": 100, "b": 300} and mg.record["detail"]["norms"] == {"a": 10.0, "b": 3.0}
    assert mg.record["responded"] == [{"island": "a", "gen": GEN["a"]}, {"island": "b", "gen": GEN["b"]}]
    assert valid_event(mg.record | {"t": 9.0})
    # off by default: the same push is accepted
    m = launched(quorum=2)
    assert dispositions(m.handle(qpush(m, "c", 1, norm=1e30))) == ["accepted"] and not m.counters["quarantine.max_push_norm"]


def test_a_quarantined_member_is_excused_from_quorum_and_the_round_restarts_only_when_nobody_is_left():
    # Regression: with the quorum every member (the default), a quarantine used to leave the round below
    # quorum and restart it; a compromised island that poisons every push held the run for ever.
    m = launched(max_push_norm=10.0)                            # quorum: every member (3)
    m.handle(qpush(m, "a", 1, now=5.0))
    m.handle(qpush(m, "b", 1, now=5.0))
    acts = m.handle(qpush(m, "c", 1, norm=1e6, now=5.0))
    assert dispositions(acts) == ["quarantined"]
    (mg,) = of(acts, Merge)                                      # grace 0: a and b merge at once
    assert [x.island for x in mg.members] == ["a", "b"] and m.rounds[1].quorum == 2
    assert not m.counters["restart_early"]
    # every member quarantined: nobody is left to merge, so the attempt restarts early as before
    m = launched(max_push_norm=10.0)
    for isl in ("a", "b", "c"):
        acts = m.handle(qpush(m, isl, 1, norm=1e6, now=5.0))
        assert dispositions(acts) == ["quarantined"] and not of(acts, Merge)
    r = m.rounds[1]
    assert r.quorum == 1 and r.hopeless_at == 5.0
    assert not pulls(m.handle(Tick(5.0 + HOPELESS_RESTART_S - 0.1)))
    acts = m.handle(Tick(5.0 + HOPELESS_RESTART_S))
    (p,) = pulls(acts)
    assert (p["step"], p["attempt"]) == (1, 2) and m.counters["restart_early"] == 1 and m.rounds[1].quorum == 3
    # attempt 2: everyone behaves; everyone is merged
    for isl in ("a", "b", "c"):
        acts = m.handle(qpush(m, isl, 1, attempt=2, now=8.0))
    (mg,) = of(acts, Merge)
    assert mg.attempt == 2 and [x.island for x in mg.members] == ["a", "b", "c"]


def test_strict_mode_never_excuses_a_quarantined_member():
    m = machine(fragments=1, sync_every=1, total_steps=1)       # strict: every member must answer
    start(m, ("a", "b"))
    m.handle(qpush(m, "b", 1))
    acts = m.handle(qpush(m, "a", 1, norm=math.inf, non_finite=1))
    assert dispositions(acts) == ["quarantined"] and not of(acts, Merge) and m.rounds[1].quorum == 2


# ---- the outlier rule: judged against the round's median when it would complete -----------------

def test_outlier_against_the_rounds_median_is_quarantined_and_the_rest_merge():
    m = launched(outlier_factor=5.0, quorum=2, grace_ms=60_000.0)
    m.handle(qpush(m, "c", 1, norm=100.0, tokens=100, now=5.0))   # first in: not judged on arrival
    m.handle(qpush(m, "a", 1, norm=1.0, tokens=100, now=5.1))     # quorum 2: the grace window starts
    assert m.rounds[1].quorum_at == 5.1
    acts = m.handle(qpush(m, "b", 1, norm=2.0, tokens=300, now=5.2))   # everyone in: judged now
    (rec,) = quarantined(acts)
    assert rec["island"] == "c" and rec["detail"]["quarantine"] == {
        "rule": "outlier", "norm": 100.0, "limit": 10.0, "median": 2.0, "pushes": 3}
    assert "--outlier-factor 5" in rec["reason"] and valid_event(rec)
    assert of(acts, Release) == [Release("c", GEN["c"], 1, 0, 1, 0, "quarantined")]
    assert m.counters["quarantine.outlier"] == 1 and m.counters["disposition.quarantined"] == 1
    # a and b still make quorum 2: the round completes with them once the grace window (4 - 1.1 s after
    # quorum) has passed, as for a member that did not answer
    assert not of(acts, Merge) and not of(m.handle(Tick(7.9)), Merge)
    (mg,) = of(m.handle(Tick(8.0)), Merge)
    assert [x.island for x in mg.members] == ["a", "b"] and [x.weight for x in mg.members] == [0.25, 0.75]
    assert mg.record["detail"]["norms"] == {"a": 1.0, "b": 2.0}


def test_outlier_rule_needs_three_pushes_and_uses_the_lower_median():
    # two pushes: neither is a reference for the other for this rule (the default norm bound, off
    # here, is the one that judges a round of two: see tests/test_norm_bound.py)
    m = launched(islands=("a", "b"), outlier_factor=2.0, push_norm_factor=None)
    m.handle(qpush(m, "a", 1, norm=1.0))
    (mg,) = of(m.handle(qpush(m, "b", 1, norm=1e6)), Merge)
    assert [x.island for x in mg.members] == ["a", "b"] and not m.counters["quarantine.outlier"]
    # four pushes: the lower of the two middle norms (2) is the reference, so two high ones cannot
    # shield each other by raising it
    m = launched(islands=("a", "b", "c", "d"), outlier_factor=5.0, quorum=2, grace_ms=60_000.0)
    for isl, norm in (("a", 1.0), ("b", 2.0), ("c", 50.0)):
        m.handle(qpush(m, isl, 1, norm=norm))
    acts = m.handle(qpush(m, "d", 1, norm=60.0))
    assert sorted(e["island"] for e in quarantined(acts)) == ["c", "d"]
    assert {e["detail"]["quarantine"]["median"] for e in quarantined(acts)} == {2.0}
    (mg,) = of(m.handle(Tick(8.0)), Merge)                   # a and b (quorum 2) after the grace window
    assert [x.island for x in mg.members] == ["a", "b"]


def test_outlier_that_breaks_quorum_leaves_the_round_open_for_the_rest():
    m = launched(islands=("a", "b", "c", "d"), outlier_factor=4.0, quorum=3, grace_ms=60_000.0)
    m.handle(qpush(m, "a", 1, norm=1.0, now=5.0))
    m.handle(qpush(m, "b", 1, norm=1.0, now=5.0))
    acts = m.handle(qpush(m, "c", 1, norm=9.0, now=5.0))      # quorum 3 reached: grace runs to 8.0
    r = m.rounds[1]
    assert r.quorum_at == 5.0 and not of(acts, Merge)
    acts = m.handle(Tick(8.0))                                 # would complete: c is an outlier (> 4 x 1)
    assert [e["island"] for e in quarantined(acts)] == ["c"] and not of(acts, Merge)
    assert r.answered == 2 and r.quorum_at is None              # below quorum again
    (mg,) = of(m.handle(qpush(m, "d", 1, norm=2.0, now=9.0)), Merge)   # quorum again, grace 0 by now
    assert [x.island for x in mg.members] == ["a", "b", "d"]


# ---- the c_tokens cap -------------------------------------------------------------------------------

def test_a_claim_above_factor_x_the_lower_median_is_clamped_and_taped():
    m = launched(islands=("a", "b"))                           # default --max-token-factor 4
    m.handle(qpush(m, "a", 1, tokens=100))
    (mg,) = of(m.handle(qpush(m, "b", 1, tokens=2 ** 53 - 1)), Merge)
    assert [x.c_tokens for x in mg.members] == [100, 400] and [x.weight for x in mg.members] == [0.2, 0.8]
    assert mg.record["weights"] == {"a": 100, "b": 400}
    assert mg.record["detail"]["token_clamp"] == {"b": {"claimed": 2 ** 53 - 1, "used": 400, "limit": 400}}
    assert m.counters["tokens.clamped"] == 1 and valid_event(mg.record | {"t": 9.0})


@pytest.mark.parametrize("tokens, kw, used", [
    ([100, 300], {}, [100, 300]),                               # an honest 3:1 is left alone
    ([0, 0, 500], {}, [0, 0, 500]),                             # zero claims take no part in the median
    ([100, 100, 10**9], {}, [100, 100, 400]),
    ([100, 10**9], {"max_token_factor": None}, [100, 10**9]),   # off
    ([100, 10**9], {"max_token_factor": 1.0}, [100, 100]),
    ([100, 10**9], {"equal_weights": True}, [100, 10**9]),      # weights are 1 each anyway
])
def test_token_cap_cases(tokens, kw, used):
    names = ("a", "b", "c")[: len(tokens)]
    m = launched(islands=names, **kw)
    acts = []
    for isl, tok in zip(names, tokens):
        acts += m.handle(qpush(m, isl, 1, tokens=tok))
    (mg,) = of(acts, Merge)
    assert [x.c_tokens for x in mg.members] == used
    assert ("token_clamp" in mg.record["detail"]) == (used != tokens)


def test_quarantine_and_clamp_hold_across_a_whole_run_to_finalization():
    # c misbehaves every round (huge norm, huge claim); a and b carry the run to its final cut
    m = launched(max_push_norm=50.0, quorum=2)
    for step in (1, 2, 3):
        acts = m.handle(qpush(m, "c", step, norm=1e9, tokens=2 ** 50, now=10.0 * step))
        assert dispositions(acts) == ["quarantined"]
        m.handle(qpush(m, "a", step, tokens=100, now=10.0 * step))
        (mg,) = of(m.handle(qpush(m, "b", step, tokens=100, now=10.0 * step)), Merge)
        assert [x.island for x in mg.members] == ["a", "b"]
        for isl in ("a", "b", "c"):
            m.handle(Heartbeat(isl, GEN[isl], 4 * step + 4, 1.0, 10.0 * step + 1))
        merge_done(m, mg, now=10.0 * step + 1)
        if step < 3:
            m.handle(Tick(10.0 * step + 5))
    assert m.committed_step == 3 and m.phase == "finalizing" and m.counters["quarantine.max_push_norm"] == 3
