"""`yeto run set` in the round machine and the shared checks (pure): schemas/run_settings.py,
services/syncer/settings_rules.py. The machine's other rules are tests/test_rounds.py's."""
from __future__ import annotations

import pytest

from yeto.schemas import codec
from yeto.schemas.errors import ConfigError, SchemaError
from yeto.schemas.run_settings import check_settings, parse_assignments
from yeto.services.syncer.actions import ApplySettings, Merge, action_from_json, action_to_json
from yeto.services.syncer.events import Heartbeat, Reconfigure, event_from_json, event_to_json
from yeto.services.syncer.replay import replay, segments
from tests.test_rounds import GEN, launch_first, merge_done, nonstrict, of, pulls, push, tapes


def test_assignments_parse_to_checked_values_and_flag_names_are_accepted():
    got = parse_assignments(["outer-lr=0.5", "--quorum-timeout=30", "max_token_factor=off", "quorum=all",
                             "outer_momentum=0"])
    assert got == {"max_token_factor": None, "outer_lr": 0.5, "outer_momentum": 0.0, "quorum": None,
                   "quorum_timeout_s": 30.0}
    assert list(got) == sorted(got)


@pytest.mark.parametrize("words, field, value", [
    (["outer_lr=-1"], "outer_lr", -1.0),
    (["outer_momentum=1.5"], "outer_momentum", 1.5),
    (["quorum=0"], "quorum", 0),
    (["quorum=two"], "quorum", "two"),
    (["member_timeout_s=nan"], "member_timeout_s", "nan"),
    (["push_norm_factor=1"], "push_norm_factor", 1.0),
    (["outer_lr=off"], "outer_lr", "off"),
    (["sync_every=8"], "key", "sync_every"),
    (["outer_lr"], "setting", "outer_lr"),
])
def test_bad_settings_name_the_field_and_the_value(words, field, value):
    with pytest.raises(ConfigError) as exc:
        parse_assignments(words)
    assert exc.value.field == field and (exc.value.value == value or str(exc.value.value) == str(value)), exc.value
    assert field in str(exc.value)


def test_the_request_and_answer_messages_validate_and_refuse_a_nested_value():
    req = codec.make("settings", run="r1", id="set-1", set={"outer_lr": 0.5, "quorum": None, "push_dtype": "bf16"},
                     by="ops@h")
    assert codec.decode_typed(codec.encode("settings", req), allowed=("settings",))[1] == req
    for bad in ({"outer_lr": [0.5]}, {"outer_lr": {"x": 1}}, {}, {"Outer-LR": 1}):
        with pytest.raises(SchemaError):
            codec.make("settings", run="r1", id="set-1", set=bad)
    assert check_settings({"push_dtype": "q4"}) == {"push_dtype": "q4"}
    with pytest.raises(ConfigError, match="push_dtype must be one of f32, bf16, q4"):
        check_settings({"push_dtype": "fp8"})
    ans = codec.make("settings_result", run="r1", id="set-1", ok=False, shard=0, shards=1, error="x", field="outer_lr",
                     value="-1")
    assert ans["ok"] is False


def _running():
    m = nonstrict(quorum=1, fragments=2, sync_every=8, quorum_timeout_s=100.0, grace_ms=0.0)
    launch_first(m)          # round 1 launched at t = 4
    return m


def test_a_change_applies_to_rounds_launched_after_it_and_rides_on_later_merges():
    m = _running()
    r1 = m.rounds[1]
    assert r1.deadline == 104.0
    acts = m.handle(Reconfigure("set-1", {"quorum_timeout_s": 20, "outer_lr": 0.25}, "ops", 4.5))
    (ap,) = of(acts, ApplySettings)
    assert ap.ok and ap.changed == {"outer_lr": 0.25, "quorum_timeout_s": 20.0} and ap.settings == ap.changed
    (rec,) = tapes(acts, "settings")
    assert rec["detail"]["changed"] == ap.changed and "set by ops" in rec["reason"]
    assert r1.deadline == 104.0                                   # the round in flight keeps its deadline
    assert m.config.quorum_timeout_s == 20.0 and m.base_config.quorum_timeout_s == 100.0
    (mg,) = of(m.handle(push(m, "a", 1, now=5.0)), Merge)
    assert mg.outer == {"outer_lr": 0.25} and mg.record["detail"]["outer"] == {"outer_lr": 0.25}
    for isl in ("a", "b"):
        m.handle(Heartbeat(isl, GEN[isl], 8, 1.0, 9.0))
    acts = merge_done(m, mg, now=9.0)
    assert [p["step"] for p in pulls(acts)] == [2]
    assert m.rounds[2].deadline == 9.0 + 20.0                     # launched after the change: the new timeout
    # the Merge's JSON carries `outer` only when set, and comes back equal
    assert action_from_json(action_to_json(mg)) == mg and action_to_json(mg)["outer"] == {"outer_lr": 0.25}


def test_a_refused_change_changes_nothing_and_names_the_field_and_value():
    m = _running()
    before = m.config
    for settings, field in (({"outer_momentum": 2.0}, "outer_momentum"), ({"bogus": 1}, "key"),
                            ({"quorum_timeout_s": -1}, "quorum_timeout_s")):
        acts = m.handle(Reconfigure("bad", settings, "ops", 5.0))
        (ap,) = of(acts, ApplySettings)
        assert not ap.ok and ap.field == field and field in ap.error and ap.value is not None
        assert "refused" in tapes(acts, "settings")[0]["reason"]
    assert m.config is before and m.state.settings == {} and m.counters["settings.refused"] == 3
    (mg,) = of(m.handle(push(m, "a", 1, now=6.0)), Merge)
    assert mg.outer == {} and "outer" not in action_to_json(mg)     # as before any change: golden tapes hold


def test_a_retried_request_is_answered_again_not_applied_twice_and_changes_accumulate():
    m = _running()
    m.handle(Reconfigure("set-1", {"outer_lr": 0.5}, "ops", 5.0))
    acts = m.handle(Reconfigure("set-2", {"quorum": 2}, "ops", 5.1))
    assert of(acts, ApplySettings)[0].settings == {"outer_lr": 0.5, "quorum": 2} and m.config.quorum == 2
    acts = m.handle(Reconfigure("set-1", {"outer_lr": 0.5}, "ops", 5.2))
    (ap,) = of(acts, ApplySettings)
    assert ap.ok and ap.changed == {} and not tapes(acts, "settings") and m.counters["settings.repeated"] == 1
    assert m.counters["settings.applied"] == 2


def test_reconfigure_events_tape_and_replay_identical():
    """A golden run's events with two changes (one refused) fed in the middle: recorded in batches, replayed
    by a fresh machine with the same actions (tests/test_replay.py's recorder helper)."""
    from tests.test_replay import _events, _recorded

    events = _events()
    half = len(events) // 2
    changes = [Reconfigure("s1", {"outer_lr": 0.3, "quorum_timeout_s": 7}, "ops", events[half].now),
               Reconfigure("s2", {"outer_momentum": 3}, "ops", events[half].now)]
    records = _recorded(events[:half] + changes + events[half:])
    sigs = [s for r in records[1:] for v in r["detail"]["actions"].values() for s in v]
    assert sum(s.startswith("ApplySettings:") for s in sigs) == 2
    (seg,) = segments(records)
    res = replay(seg)
    assert (res.identical, res.gap, res.events) == (True, None, len(events) + 2)
    # the recorded answers are the machine's own: a refused change replays as refused
    assert res.actions == len(sigs)
    e = Reconfigure("s1", {"outer_lr": 0.3}, "ops", 4.1)
    assert event_from_json(event_to_json(e)) == e


def test_a_push_dtype_change_rides_on_the_pulls_of_rounds_launched_after_it_and_waits_for_the_session():
    from yeto.services.syncer.rounds import RoundMachine
    from tests.test_rounds import Builder, cfg

    early = RoundMachine(cfg(strict=False, quorum=1), session_builder=Builder())
    (ap,) = of(early.handle(Reconfigure("d0", {"push_dtype": "bf16"}, "ops", 0.0)), ApplySettings)
    assert not ap.ok and ap.field == "push_dtype" and "session is pinned" in ap.error
    m = _running()
    assert "push_dtype" not in m.rounds[1].pull()                  # launched before: the session's dtype
    (ap,) = of(m.handle(Reconfigure("d1", {"push_dtype": "bf16"}, "ops", 4.5)), ApplySettings)
    assert ap.ok and ap.changed == {"push_dtype": "bf16"}
    (mg,) = of(m.handle(push(m, "a", 1, now=5.0)), Merge)
    for isl in ("a", "b"):
        m.handle(Heartbeat(isl, GEN[isl], 8, 1.0, 9.0))
    (p2,) = pulls(merge_done(m, mg, now=9.0))
    assert p2["step"] == 2 and p2["push_dtype"] == "bf16"
    codec.make("pull", run="r1", **p2)                              # the pull schema takes it
    # the session keeps its dtype: a hello asking for it is admitted, one asking for bf16 is refused
    assert m.session["push_dtype"] == "f32"
    (back,) = of(m.handle(Reconfigure("d2", {"push_dtype": "f32"}, "ops", 9.5)), ApplySettings)
    assert back.ok and m.config.push_dtype == "f32"
    (q4,) = of(m.handle(Reconfigure("d3", {"push_dtype": "q4"}, "ops", 9.6)), ApplySettings)
    assert not q4.ok and q4.field == "push_dtype" and "q4 only as the session's" in q4.error


def test_the_sparse_mode_refuses_momentum_and_push_dtype_and_takes_the_lr():
    from yeto.schemas.outer_mode import check_outer

    m = nonstrict(quorum=1, fragments=2, sync_every=8, quorum_timeout_s=100.0, grace_ms=0.0,
                  outer=check_outer("sparseloco"))
    launch_first(m)
    for key, value in (("outer_momentum", 0.5), ("push_dtype", "bf16")):
        (ap,) = of(m.handle(Reconfigure(f"bad-{key}", {key: value}, "ops", 5.0)), ApplySettings)
        assert not ap.ok and ap.field == key and "sparse outer mode" in ap.error
    (ap,) = of(m.handle(Reconfigure("lr", {"outer_lr": 0.5}, "ops", 5.0)), ApplySettings)
    assert ap.ok and ap.changed == {"outer_lr": 0.5}
