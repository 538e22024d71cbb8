"""Ids are subject tokens; every subject and Nats-Msg-Id comes from schemas.subjects."""
from __future__ import annotations

import pytest

from yeto.schemas import subjects as S
from yeto.schemas.errors import IdError
from yeto.schemas.ids import check_gen, check_island, check_run, new_generation


@pytest.mark.parametrize("bad", ["a.b", "a b", "a*", ">", "", "ü", "a\n", None, 5, "x" * 65])
def test_bad_ids_refused_with_field_and_value(bad):
    with pytest.raises(IdError) as ei:
        check_run(bad)
    assert ei.value.field == "run"
    assert repr(bad)[:20] in str(ei.value)
    with pytest.raises(IdError) as ei:
        S.push("run1", bad, 0)
    assert ei.value.field == "island"


def test_good_ids_pass():
    assert check_run("run-1_A") == "run-1_A"
    assert check_island("isl_0") == "isl_0"


def test_generation_is_16_hex_and_random():
    gens = {new_generation() for _ in range(100)}
    assert len(gens) == 100
    for g in gens:
        assert check_gen(g) == g
    with pytest.raises(IdError):
        check_gen("0123456789ABCDEF")


def test_subjects_fall_under_their_stream():
    import fnmatch

    run = "r1"

    def matches(subject, pattern):
        # NATS wildcards: '*' one token, '>' the rest
        st, pt = subject.split("."), pattern.split(".")
        for i, p in enumerate(pt):
            if p == ">":
                return len(st) > i
            if i >= len(st) or (p != "*" and p != st[i]):
                return False
        return len(st) == len(pt)

    cases = {
        "CTL": [S.hello(run, "a"), S.pull(run), S.to_island(run, "a")],
        "HB": [S.heartbeat(run, "a"), S.ack(run, "a")],
        "PUSH": [S.push(run, "a", 3)],
        "INIT": [S.init(run, 2)],
        "BCAST": [S.bcast(run, 1, 7)],
        "FINAL": [S.final(run, 1, 7)],
        "STEPLOG": [S.steplog(run, "a")],
        "EVENTS": [S.events(run, "merge")],
    }
    for kind, subs in cases.items():
        for sub in subs:
            owners = [k for k in S.STREAM_KINDS if any(matches(sub, p) for p in S.stream_subjects(run, k))]
            assert owners == [kind], (sub, owners)
    assert not fnmatch.fnmatch(S.push(run, "a", 3), "*..*")


def test_msg_ids_are_per_attempt_and_try():
    a = S.push_msg_id("isl", "0" * 16, 1, 5, 1, 0, 3)
    assert a == "push.isl.0000000000000000.1.5.1.0.3"
    assert S.push_msg_id("isl", "0" * 16, 1, 5, 1, 1, 3) != a  # a re-send of a push is a new try
    assert S.pull_msg_id(1, 5, 2, 0) != S.pull_msg_id(1, 5, 2, 1)  # a rebound slot re-publishes with seq+1
    assert S.bcast_msg_id(0, 4, 2) == "bcast.0.4.2"
    assert S.final_msg_id(0, 4, 2) == "final.0.4.2"


def test_negative_fragment_refused():
    with pytest.raises(IdError) as ei:
        S.bcast("r", -1, 0)
    assert ei.value.field == "fragment"


def test_parse_roundtrip():
    assert S.parse("r", S.push("r", "isl", 2)) == ("push", "isl", "2")
    with pytest.raises(ValueError):
        S.parse("r", "yeto.other.push.a.1")


def test_jetstream_api_subjects_are_built_here_and_refuse_non_tokens():
    assert S.js_api() == "$JS.API" and S.js_api("hub") == "$JS.hub.API"
    assert S.consumer_msg_next("YETO_r1_CTL", "pull-a") == "$JS.API.CONSUMER.MSG.NEXT.YETO_r1_CTL.pull-a"
    assert S.consumer_msg_next("BENCH_x", "c0", domain="dc1") == "$JS.dc1.API.CONSUMER.MSG.NEXT.BENCH_x.c0"
    assert S.kv_key("r1", "state", "session") == "$KV.yeto_r1_state.session"
    assert S.js_ack("YETO_r1_CTL") == "$JS.ACK.YETO_r1_CTL.*.>"
    assert S.js_ack("YETO_r1_CTL", "isl-a") == "$JS.ACK.YETO_r1_CTL.isl-a.>"
    assert S.js_flow_control("YETO_r1_BCAST") == "$JS.FC.YETO_r1_BCAST.>"
    assert S.push_fragment_all("r1", 3) == "yeto.r1.push.*.3"
    assert S.hello_again_msg_id("a", "00000000000000a1", 2) == S.hello_msg_id("a", "00000000000000a1") + ".again.2"
    for bad in ("a.b", "*", ">", ""):
        with pytest.raises(IdError):
            S.js_ack(bad)
        with pytest.raises(IdError):
            S.js_flow_control(bad)
        with pytest.raises(IdError):
            S.consumer_msg_next(bad, "c")
        with pytest.raises(IdError):
            S.js_api(bad)


def test_run_level_wildcards():
    assert S.run_all("r1") == "yeto.r1.>"
    assert S.push_island_all("r1", "a") == "yeto.r1.push.a.*" and S.init_all("r1") == "yeto.r1.init.*"
    assert S.stream_subjects("r1", "INIT") == [S.init_all("r1")]
    with pytest.raises(IdError):
        S.push_island_all("r1", "a.*")
