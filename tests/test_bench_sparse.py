"""bench/sparse.py (the in-process version: no broker yet): a tiny smoke run in this process — the output
contract, dense bytes = every island's f32 push plus the f32 version delivered to every island, sparse
pushes of exactly `push_nbytes`, the last line's ratios recomputed from the printed totals. The loss and
bytes figures of the default run live in bench/README.md. Pure tier (no process, no broker)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAST = re.compile(r"^sparse bytes_ratio=(?P<b>[0-9.]+) loss_ratio=(?P<l>[0-9.]+) rounds=(?P<n>\d+)$")


def _load():
    spec = importlib.util.spec_from_file_location("bench_sparse", ROOT / "bench" / "sparse.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_sparse"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_smoke_run_prints_bytes_and_ratios(capsys):
    bench = _load()
    assert bench.main(["--rounds", "2", "--inner", "1", "--d-model", "32", "--layers", "1", "--heads", "2",
                       "--ctx", "16", "--batch", "4", "--corpus-bytes", "50000", "--threads", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    numel = int(re.match(r"model (\d+) parameters", out[0]).group(1))
    dense = re.search(r"^dense: .* bytes/round (\d+) ", "\n".join(out), re.M)
    assert int(dense.group(1)) == 2 * 4 * numel + 2 * 4 * numel
    totals = re.search(r"bytes over 2 rounds: dense (\d+), sparse (\d+)", "\n".join(out))
    d, s = int(totals.group(1)), int(totals.group(2))
    assert d == 2 * 16 * numel and 0 < s < d
    exp = re.search(r"^expected bytes/round: dense (\d+); sparse pushes 2 x (\d+), with the update between (\d+) "
                    r"and (\d+)$", "\n".join(out), re.M)
    assert int(exp.group(1)) == 16 * numel
    lo, hi = int(exp.group(3)), int(exp.group(4))
    per_round = [int(b) for b in re.search(r"^sparse: .* bytes/round (\d+) ", "\n".join(out), re.M).groups()]
    assert lo <= per_round[0] <= hi and lo <= s / 2 <= hi
    m = LAST.match(out[-1])
    assert m and int(m["n"]) == 2
    assert abs(float(m["b"]) - s / d) < 1e-4 and float(m["l"]) > 0


def test_round_bytes_counts_every_push_and_a_delivery_per_island():
    bench = _load()
    assert bench.round_bytes([10, 20, 30], 7, 3) == 60 + 21
    # one 64 x 64 tile, 2 islands: a push is 18 + 12 + 16 + 64·1.5 + 64/4 = 158 bytes; the update has 64
    # (same choices) to 128 entries: 14 + 12 + 2 counts + 1.5·n + 4·n
    exp = bench.expected_bytes([(64, 64)], 2, bench.SparseSpec())
    assert exp == {"dense": 4 * 4096 * 4, "push": 158, "sparse_min": 2 * 158 + 2 * (28 + 96 + 256),
                   "sparse_max": 2 * 158 + 2 * (28 + 192 + 512)}
