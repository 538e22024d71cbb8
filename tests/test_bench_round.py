"""bench/round.py: a smoke run on a 2 MiB fragment (output contract, the islands agree at the end), the same in
the sparse outer mode (pushes a small fraction of the dense ones), and its stage arithmetic on hand-made timestamps.

Not a timed assertion: round times on 2 shared cores are too noisy to gate on; the 256 MiB figures live
in bench/README.md.
"""
from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROUND = ROOT / "bench" / "round.py"
LAST_LINE = re.compile(r"^round ratio_vs_allreduce=(?P<x>[-+0-9.eE]+|nan|inf)$")
STAGE = r"(?P<{0}>[0-9.]+)"
ROW = re.compile(r"^(?P<label>round \d+|median): round (?P<round>[0-9.]+) s = "
                 + r" \+ ".join(f"{s} " + STAGE.format(s) for s in ("push", "members", "merge", "checkpoint", "broadcast", "apply"))
                 + r" \(from pull (?P<from_pull>[0-9.]+);", re.M)
VERSIONS = re.compile(r"^islands final versions: (?P<v>(?:i\d+=-?\d+ ?)+) \(rounds (?P<rounds>\d+)\); "
                      r"final_equal=(?P<eq>true|false)$", re.M)
ALLREDUCE = re.compile(r"^gloo all_reduce of (?P<mib>[0-9.]+) MiB f32 between (?P<n>\d) processes: median "
                       r"(?P<s>[0-9.]+) s", re.M)
EXACT_ROW = re.compile(r"^(?P<label>round \d+|median) syncer stages: (?P<figs>.*)$", re.M)
TRAFFIC = re.compile(r"^bytes per round through the broker: from islands \(pushes, step logs\) [0-9.]+ MiB \((?P<isl_out>[0-9.]+)\), "
                     r"to the syncer \(pushes\) [0-9.]+ MiB \((?P<syn_in>[0-9.]+)\), from the syncer \(BCAST, state KV, tape\) "
                     r"[0-9.]+ MiB \((?P<syn_out>[0-9.]+)\), to islands \(BCAST, pulls\) [0-9.]+ MiB \((?P<isl_in>[0-9.]+)\); "
                     r"total [0-9.]+ MiB = (?P<total>[0-9.]+) model sizes", re.M)
RSS = re.compile(r"^peak RSS nats-server (\d+) MiB, syncer (\d+) MiB, island i0 (\d+) MiB, island i1 (\d+) MiB, "
                 r"all_reduce rank (\d+) MiB", re.M)


def _load():
    spec = importlib.util.spec_from_file_location("bench_round", ROUND)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_round"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_round_bench_smoke_prints_the_breakdown_and_the_ratio_last_and_islands_agree():
    proc = subprocess.run([sys.executable, str(ROUND), "--size-mib", "2", "--rounds", "2", "--allreduce-repeat", "2"],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    out = proc.stdout
    last = LAST_LINE.match(out.strip().splitlines()[-1])
    assert last, f"last line is not `round ratio_vs_allreduce=<x>`:\n{out}"
    ratio = float(last["x"])
    assert math.isfinite(ratio) and ratio > 0

    rows = {m["label"]: m for m in ROW.finditer(out)}
    assert set(rows) == {"round 2", "round 3", "median"}, out  # 1 warm-up round, then the 2 timed ones
    for label, m in rows.items():
        stages = [float(m[s]) for s in ("push", "members", "merge", "checkpoint", "broadcast", "apply")]
        # every stage was observed and ordered in time, and they add up to the round (3 decimals each)
        assert all(s >= 0 for s in stages), (label, out)
        assert sum(stages) == pytest.approx(float(m["round"]), abs=0.004), (label, out)
        assert float(m["from_pull"]) >= float(m["round"]) - 0.001
        assert float(m["round"]) > 0

    # the syncer's exact stage timings (the merge record's detail), each >= 0, and the merge loop's parts
    # (waiting for pushes, outer step) within the loop's wall time
    exact = {m["label"]: dict(kv.rsplit(" ", 1) for kv in m["figs"].split(", ")) for m in EXACT_ROW.finditer(out)}
    assert set(exact) == set(rows), out
    names = {"fetch", "outer", "pack+hash", "digest", "checkpoint files", "state in JetStream", "commit kv", "broadcast"}
    for label, figs in exact.items():
        assert set(figs) == names, (label, out)
        assert all(float(x) >= 0 for x in figs.values()), (label, out)
        # a real run wrote and fsynced checkpoint files and broadcast every chunk: neither takes no time
        assert float(figs["checkpoint files"]) > 0 and float(figs["broadcast"]) > 0, (label, out)
        loop = float(re.search(rf"^{label}: .*merge loop (?P<x>[0-9.]+)", out, re.M)["x"])
        assert float(figs["fetch"]) + float(figs["outer"]) <= loop + 0.002, (label, out)

    v = VERSIONS.search(out)
    assert v, out
    versions = dict(kv.split("=") for kv in v["v"].split())
    # both islands ended on the last version (3 rounds on one fragment: version 3) and hold the same bytes
    assert versions == {"i0": "3", "i1": "3"} and v["rounds"] == "3" and v["eq"] == "true", out

    # bytes through the broker per round, from its /connz: two islands pushed a model size each (the syncer
    # received both) and each read the new version; the syncer sent the version and its state
    t = TRAFFIC.search(out)
    assert t, out
    figs = {k: float(t[k]) for k in ("isl_out", "syn_in", "syn_out", "isl_in", "total")}
    assert 1.9 < figs["isl_out"] < 2.2 and 1.9 < figs["syn_in"] < 2.2 and figs["syn_out"] > 1.0 and figs["isl_in"] > 1.9, out
    assert figs["total"] == pytest.approx(figs["isl_out"] + figs["syn_in"] + figs["syn_out"] + figs["isl_in"], abs=0.03)
    assert float(re.search(r"^round bytes_per_model_byte=([0-9.]+)$", out, re.M)[1]) == pytest.approx(figs["total"], abs=0.01)

    ar = ALLREDUCE.search(out)
    assert ar and ar["n"] == "2" and float(ar["s"]) > 0, out
    # the peer moved the fragment's f32 size (the demo MLP: about 2 MiB)
    assert 1.5 < float(ar["mib"]) < 2.5, out
    rss = RSS.search(out)
    assert rss and all(int(x) > 0 for x in rss.groups()), out
    # the ratio is the quotient of the two printed medians (round to 3 decimals, all_reduce to 4)
    r, a = float(rows["median"]["round"]), float(ar["s"])
    assert (r - 0.0005) / (a + 0.00005) - 0.01 <= ratio <= (r + 0.0005) / max(a - 0.00005, 1e-9) + 0.01, out


SPARSE_PUSHES = re.compile(r"^sparse pushes per round: from islands (?P<isl_b>\d+) B \((?P<isl>[0-9.]+)\), to the syncer "
                           r"(?P<syn_b>\d+) B \((?P<syn>[0-9.]+)\) model sizes; f32 pushes: 2 each way$", re.M)


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_round_bench_sparse_smoke_pushes_a_small_fraction_of_a_model_and_islands_agree():
    """`--outer sparseloco` (docs/design.md §4.10): the same output contract, the islands on the same final cut,
    and the pushes and broadcasts through the broker a small fraction of a model size per round."""
    proc = subprocess.run([sys.executable, str(ROUND), "--size-mib", "2", "--rounds", "2", "--allreduce-repeat", "2",
                           "--outer", "sparseloco"], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    out = proc.stdout
    assert "--outer sparseloco;" in out.splitlines()[0], out
    last = LAST_LINE.match(out.strip().splitlines()[-1])
    assert last and math.isfinite(float(last["x"])) and float(last["x"]) > 0, out
    rows = {m["label"]: m for m in ROW.finditer(out)}
    assert set(rows) == {"round 2", "round 3", "median"}, out
    for label, m in rows.items():
        stages = [float(m[s]) for s in ("push", "members", "merge", "checkpoint", "broadcast", "apply")]
        assert all(s >= 0 for s in stages) and sum(stages) == pytest.approx(float(m["round"]), abs=0.004), (label, out)
    v = VERSIONS.search(out)
    assert v and dict(kv.split("=") for kv in v["v"].split()) == {"i0": "3", "i1": "3"} and v["eq"] == "true", out

    t = TRAFFIC.search(out)
    assert t, out
    figs = {k: float(t[k]) for k in ("isl_out", "syn_in", "syn_out", "isl_in", "total")}
    # dense f32 pushes are 1 model size per island (the dense smoke: 2.0 each way); sparse ones at the syncer's
    # default spec (64 of a 64 x 64 tile, 2-bit values) about 0.007 each, step logs and heartbeats on top
    assert figs["isl_out"] < 0.1 and figs["syn_in"] < 0.1, out
    # BCAST carries each version as its update message from the one before (design §4.10): the islands read a small
    # fraction of a model a round (dense: 2.0, a full cut each); the syncer's state KV keeps the same update between
    # full versions (its chains, §4.10 "Durable state": the timed rounds make versions 2 and 3 of 16), so what it
    # sends is a small fraction too (1.0 when it put the full params of every version)
    assert figs["isl_in"] < 0.2 and 0 < figs["syn_out"] < 0.2, out
    sp = SPARSE_PUSHES.search(out)
    assert sp, out
    # the 4-decimal line agrees with the rounded one, and something was pushed each round
    assert float(sp["isl"]) == pytest.approx(figs["isl_out"], abs=0.006) and float(sp["syn"]) == pytest.approx(figs["syn_in"], abs=0.006)
    assert 0 < float(sp["syn"]) < 0.1 and int(sp["syn_b"]) > 0, out


def _obs(bench, step=4, **kw):
    o = bench.RoundObs(step=step, pull=100.0, ready={"a": 100.5, "b": 100.2}, accepted={"a": 101.0, "b": 101.5},
                       merge_t=102.0, merge_s=0.4, commit_t=102.2, bcast0=102.6, taped=103.0,
                       installed={"a": 103.4, "b": 103.9}, export_s={"a": 0.3, "b": 0.2}, apply_s={"a": 1.0, "b": 1.1},
                       exact={k: 0.01 * i for i, (k, _) in enumerate(bench.EXACT)})
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def test_breakdown_stages_follow_the_timestamps_and_start_at_the_later_of_pull_and_ready():
    bench = _load()
    b = bench.breakdown(_obs(bench), ["a", "b"])
    # the last island reached its boundary (100.5) after the pull (100.0): the round starts there
    assert b["push"] == pytest.approx(0.5) and b["members"] == pytest.approx(0.5) and b["merge"] == pytest.approx(0.5)
    assert b["checkpoint"] == pytest.approx(0.6) and b["broadcast"] == pytest.approx(0.4)
    assert b["apply"] == pytest.approx(0.9) and b["round"] == pytest.approx(3.4) and b["from_pull"] == pytest.approx(3.9)
    assert b["digest"] == pytest.approx(0.2) and b["merge_loop"] == 0.4 and b["export"] == 0.3
    assert b["fetch_s"] == 0 and b["state_store_s"] == pytest.approx(0.05) and b["broadcast_s"] == pytest.approx(0.07)
    # (the syncer's figures, as recorded)
    # islands already waiting when the pull went out: the round starts at the pull
    b = bench.breakdown(_obs(bench, ready={"a": 99.0, "b": 98.0}), ["a", "b"])
    assert b["round"] == pytest.approx(3.9) == b["from_pull"]
    # island a pushed (101.0) before island b reached its boundary (101.2, the start): push counts 0,
    # members runs from the start, and the stages still add up to the round (seen in a full test run)
    b = bench.breakdown(_obs(bench, ready={"a": 100.1, "b": 101.2}), ["a", "b"])
    assert b["push"] == 0 and b["members"] == pytest.approx(0.3)
    assert min(b[k] for k in bench.STAGES) >= 0
    assert sum(b[k] for k in bench.STAGES) == pytest.approx(b["round"]) == pytest.approx(2.7)
    # the islands report the install (102.9) before the observer saw the broadcast taped (103.0)
    b = bench.breakdown(_obs(bench, installed={"a": 102.8, "b": 102.9}), ["a", "b"])
    assert b["apply"] == 0 and sum(b[k] for k in bench.STAGES) == pytest.approx(b["round"]) == pytest.approx(2.5)


def test_breakdown_names_what_was_not_observed():
    bench = _load()
    with pytest.raises(ValueError, match=r"round 4: not observed: bcast0, accepted\[b\]"):
        bench.breakdown(_obs(bench, bcast0=None, accepted={"a": 101.0}), ["a", "b"])
    # a merge record without the syncer's stage timings (a syncer from before they were recorded)
    with pytest.raises(ValueError, match=r"round 4: not observed: detail.fetch_s, detail.outer_s"):
        bench.breakdown(_obs(bench, exact={"pack_s": 0.1, "digest_s": 0.0, "checkpoint_s": 0.1, "commit_kv_s": 0.0,
                                           "broadcast_s": 0.1}), ["a", "b"])


def test_steplog_and_tape_records_fill_the_round():
    bench = _load()
    rounds = {1: bench.RoundObs(step=1), 2: bench.RoundObs(step=2)}
    lines = [json.dumps({"step": 1, "t": 10.0, "boundary_s": 2.0, "export_s": 0.5, "apply_s": 1.0, "versions": {"0": 1}}),
             # a step whose boundary did not hold the round's version (not a lockstep boundary): ignored
             json.dumps({"step": 2, "t": 11.0, "boundary_s": 0.1, "export_s": 0.0, "apply_s": 0.0, "versions": {"0": 1}}),
             ""]
    bench.parse_steplog(lines, "a", rounds)
    assert rounds[1].ready == {"a": 8.0} and rounds[1].installed == {"a": 10.0} and rounds[1].export_s == {"a": 0.5}
    assert rounds[2].ready == {} and rounds[2].installed == {}
    bench.note_event({"kind": "disposition", "disposition": "accepted", "step": 1, "island": "a", "t": 8.5}, 8.6, rounds)
    bench.note_event({"kind": "disposition", "disposition": "duplicate", "step": 1, "island": "b", "t": 8.7}, 8.8, rounds)
    bench.note_event({"kind": "merge", "step": 1, "t": 9.0, "detail": {"merge_s": 0.25, "fetch_s": 0.1, "outer_s": 0.05,
                                                                       "norms": {"a": 1.0}}}, 9.6, rounds)
    bench.note_event({"kind": "commit", "step": 1, "fragment": 0, "t": 9.1}, 9.7, rounds)
    bench.note_event({"kind": "merge", "step": 7, "t": 9.0, "detail": {"merge_s": 0.25}}, 9.6, rounds)  # no such round
    o = rounds[1]
    assert o.accepted == {"a": 8.5} and (o.merge_t, o.merge_s, o.taped, o.commit_t) == (9.0, 0.25, 9.6, 9.1)
    assert o.exact == {"fetch_s": 0.1, "outer_s": 0.05}  # only the stage timings of the detail


def test_traffic_counts_islands_and_syncer_between_two_connz_snapshots_and_leaves_others_out():
    bench = _load()
    before = bench.conn_bytes({"connections": [
        {"name": "yeto-island-a-1", "in_bytes": 100, "out_bytes": 50}, {"name": "yeto-syncer-r", "in_bytes": 10, "out_bytes": 20},
        {"name": "observer", "in_bytes": 0, "out_bytes": 5}]})
    after = bench.conn_bytes({"connections": [
        {"name": "yeto-island-a-1", "in_bytes": 300, "out_bytes": 450}, {"name": "yeto-island-b-2", "in_bytes": 200, "out_bytes": 400},
        {"name": "yeto-syncer-r", "in_bytes": 610, "out_bytes": 420}, {"name": "observer", "in_bytes": 0, "out_bytes": 9999},
        {"cid": 7, "in_bytes": 1, "out_bytes": 1}]})
    t = bench.traffic(before, after, rounds=2)
    # islands sent (200 + 200) and received (400 + 400), the syncer sent 600 and received 400: per round
    assert t == {"islands_out": 200.0, "islands_in": 400.0, "syncer_out": 300.0, "syncer_in": 200.0, "total": 1100.0}
    line = bench.fmt_traffic(t, model_bytes=100).splitlines()
    assert line[-1] == "round bytes_per_model_byte=11.00" and "to islands (BCAST, pulls) 0.0 MiB (4.00)" in line[0]


def test_traffic_counts_the_islands_reads_between_their_own_snapshots_when_given():
    """The islands' received bytes come from the `reads` pair (taken where no island reads a version), the rest from
    the merge-record pair: an island half-way through reading a version at a merge record no longer moves them."""
    bench = _load()
    # /connz's in_bytes is what the client sent, out_bytes what the server sent it
    snap = lambda sent, got: bench.conn_bytes({"connections": [  # noqa: E731
        {"name": "yeto-island-a-1", "in_bytes": sent, "out_bytes": got}]})
    t = bench.traffic(snap(0, 1000), snap(150, 1400), rounds=2, reads=(snap(0, 900), snap(0, 1300)))
    assert t["islands_out"] == 75.0 and t["islands_in"] == 200.0 and t["total"] == 275.0
