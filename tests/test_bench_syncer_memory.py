"""bench/syncer_memory.py: a smoke run on a 4 MiB model (1 syncer, then 4 shards: the output contract,
every process's peak RSS, the ratio last), and its pure parts.

Not a performance assertion: the ratio's goal (<= 0.35) is about a 1 GiB model, where a syncer's
fixed overhead (torch, buffers) is small next to the fragments; at 4 MiB it is not. The 1 GiB figures
live in bench/README.md.
"""
from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "syncer_memory.py"
LAST = re.compile(r"^syncer shard_rss_ratio=(?P<x>[-+0-9.eE]+|nan|inf)$")
MEM = r"peak (?P<peak>\d+) MiB \(baseline (?P<base>\d+), growth (?P<growth>\d+)\)"
CONFIG_MEM = re.compile(r"^\[(?P<label>1 shard|4 shards)\] (?P<rest>.*peak \d+ MiB.*)$", re.M)
MERGE = re.compile(r"^\[(?P<label>1 shard|4 shards)\] merge per round: median merge loop (?P<loop>[0-9.]+) s, median "
                   r"commit path (?P<path>[0-9.]+) s \((?P<n>\d+) merge records; push chunks (?P<held>\d+) kept in memory, "
                   r"(?P<read>\d+) read back\); rounds wall [0-9.]+ s = "
                   r"(?P<per>[0-9.]+) s per round", re.M)
PEAKS = re.compile(r"^peak RSS (?P<rest>.*); wall [0-9.]+ s", re.M)
SUMMARY = re.compile(r"^merge time per round: 1 shard (?P<one>[0-9.]+) s .*, 4 shards (?P<four>[0-9.]+) s", re.M)
GROWTH = re.compile(r"^RSS growth: 1 syncer (?P<one>\d+) MiB; largest shard \((?P<who>shard \d)\) (?P<shard>\d+) MiB of 4",
                    re.M)


def _load():
    spec = importlib.util.spec_from_file_location("bench_syncer_memory", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(240)
@pytest.mark.e2e
def test_syncer_memory_smoke_prints_every_process_and_the_ratio_last():
    proc = subprocess.run([sys.executable, str(BENCH), "--size-mib", "4", "--rounds", "4", "--shards", "4",
                           "--timeout", "150"], capture_output=True, text=True, timeout=230)
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr[-12000:]}"
    last = LAST.match(out.strip().splitlines()[-1])
    assert last, f"last line is not `syncer shard_rss_ratio=<x>`:\n{out}"
    ratio = float(last["x"])
    assert math.isfinite(ratio) and ratio > 0, out

    # each configuration: every syncer process's peak, baseline and growth (peak - baseline)
    mems = {m["label"]: m["rest"] for m in CONFIG_MEM.finditer(out)}
    assert set(mems) == {"1 shard", "4 shards"}, out
    names = {label: re.findall(r"(syncer|shard \d) " + MEM, rest) for label, rest in mems.items()}
    assert [n for n, *_ in names["1 shard"]] == ["syncer"], out
    assert [n for n, *_ in names["4 shards"]] == ["shard 0", "shard 1", "shard 2", "shard 3"], out
    for label, rows in names.items():
        for name, peak, base, grow in rows:
            assert int(peak) > 0 and int(base) > 0, (label, name, out)
            assert abs(int(peak) - int(base) - int(grow)) <= 1 or int(grow) == 0, (label, name, out)
    # the ratio is the largest shard's growth over the syncer's (both printed, rounded to MiB)
    g = GROWTH.search(out)
    assert g, out
    one = int(names["1 shard"][0][3])
    assert int(g["one"]) == one and int(g["shard"]) == max(int(r[3]) for r in names["4 shards"]), out
    if one >= 2:  # both printed rounded to whole MiB: the ratio lies within what the rounding allows
        shard = int(g["shard"])
        assert max(0.0, shard - 0.5) / (one + 0.5) - 0.001 <= ratio <= (shard + 0.5) / (one - 0.5) + 0.001, out

    # where each process's growth came: one line per configuration naming every process and phase
    phases = dict(re.findall(r"^\[(1 shard|4 shards)\] RSS growth by phase \(MiB, VmRSS sampled every 0.1 s\): (.*)$", out, re.M))
    assert set(phases) == {"1 shard", "4 shards"}, out
    for label, rest in phases.items():
        procs = [part.split(" INIT + v0 ")[0] for part in rest.split("; ")]
        assert procs == [n for n, *_ in names[label]], (label, out)
        for part in rest.split("; "):
            assert re.fullmatch(r"(syncer|shard \d) INIT \+ v0 \d+, rounds \d+, last round \+ final cut \d+", part), (part, out)

    # merge figures of both configurations: every round merged once (4 rounds), times > 0
    merges = {m["label"]: m for m in MERGE.finditer(out)}
    assert set(merges) == {"1 shard", "4 shards"}, out
    for label, m in merges.items():
        assert int(m["n"]) == 4 and float(m["loop"]) > 0 and float(m["path"]) >= float(m["loop"]), (label, out)
        # a 4 MiB model: each fragment (1 MiB) is one chunk: 4 rounds x 2 members, each chunk kept or read back once
        assert int(m["held"]) + int(m["read"]) == 8, (label, out)
    s = SUMMARY.search(out)
    assert s and float(s["one"]) == float(merges["1 shard"]["loop"]) and float(s["four"]) == float(merges["4 shards"]["loop"])

    # peak RSS of every process: the broker, the bench process (scripted islands), each syncer
    peaks = PEAKS.search(out)
    assert peaks, out
    listed = dict(re.findall(r"(?:^|, )([^,]+?) (\d+) MiB", peaks["rest"]))
    want = {"bench (scripted islands)", "nats-server", "syncer (1 shard)",
            *(f"shard {k} (4 shards)" for k in range(4))}
    assert set(listed) == want and all(int(v) > 0 for v in listed.values()), (listed, out)


def test_layout_splits_into_four_equal_fragments():
    bench = _load()
    from yeto.schemas.layout import build_fragments

    for size in (4, 1024):
        frags = build_fragments(bench.layout_for(size), bench.P)
        sizes = {f["numel"] for f in frags}
        assert len(frags) == 4 and len(sizes) == 1, (size, sizes)
        assert sum(f["numel"] for f in frags) * 4 == pytest.approx(size * bench.MiB, rel=0.01)


def test_ratio_phases_and_merge_figures():
    bench = _load()
    assert bench.shard_ratio({"shard 0": 250, "shard 1": 300}, 1000) == 0.3
    with pytest.raises(ValueError, match="single syncer's RSS growth is 0"):
        bench.shard_ratio({"shard 0": 250}, 0)
    with pytest.raises(ValueError, match="no shard growth"):
        bench.shard_ratio({}, 1000)
    assert bench.growth(100, 150) == 0 and bench.growth(300, 100) == 200
    # each sample counts for the phase it falls in; before the first mark for none
    series = [(0.5, 999), (1.0, 10), (1.5, 30), (2.0, 20), (3.5, 5)]
    assert bench.phase_peaks(series, [("a", 1.0), ("b", 2.0), ("c", 3.0)]) == {"a": 30, "b": 20, "c": 5}
    assert bench.phase_peaks([], [("a", 1.0)]) == {"a": 0}
    recs = [{"detail": {"merge_s": s, "checkpoint_s": 0.1, "commit_kv_s": 0.01, "broadcast_s": 0.2,
                        "push_chunks_held": 3, "push_chunks_read": 1}} for s in (0.5, 0.3, 0.9)]
    figs = bench.merge_figures(recs)
    assert figs["merge_loop"] == 0.5 and figs["commit_path"] == pytest.approx(0.81) and figs["rounds"] == 3
    assert figs["held"] == 9 and figs["read"] == 3
    assert bench.env_pair("YETO_MEM_TRACE=1") == ("YETO_MEM_TRACE", "1") and bench.env_pair("A=") == ("A", "")
    for bad in ("YETO_MEM_TRACE", "=1", "A B=1"):
        with pytest.raises(Exception, match="expected NAME=VALUE"):
            bench.env_pair(bad)
    with pytest.raises(ValueError, match="no merge record"):
        bench.merge_figures([])
