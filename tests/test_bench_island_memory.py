"""bench/island_memory.py: a smoke run on tiny models (output contract, byte accounting, bit-exact
round trip), and its pure helpers.

Not a timed or memory-gated assertion at these sizes: a few MiB of model are below the noise of a
Python process's RSS; the slope goal (≤ 0.1) is for the default sizes (see bench/README.md).
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
BENCH = ROOT / "bench" / "island_memory.py"
SIZE_LINE = re.compile(
    r"^size (?P<size>[0-9.]+) MiB: rank0 growth (?P<growth>-?[0-9.]+) MiB \(baseline (?P<base>\d+) MiB, peak "
    r"(?P<peak>\d+) MiB(?:, sampled)?; anchors in memory (?P<anchors>\d+) MiB, the rest (?P<rest>-?[0-9.]+) MiB\); "
    r"INIT (?P<init>\d+) MiB out, cut (?P<cut>\d+) MiB in, gathered (?P<gathered>\d+) MiB, scattered "
    r"(?P<scattered>\d+) MiB; (?P<secs>[0-9.]+)s$", re.M)
LAST_LINE = re.compile(r"^island rank0_rss_slope=(?P<x>[-+0-9.eE]+|nan)$")


def _load():
    spec = importlib.util.spec_from_file_location("bench_island_memory", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(150)
@pytest.mark.parametrize("anchors", ["files", "memory"])
@pytest.mark.e2e
def test_smoke_run_prints_a_line_per_size_and_the_slope_last(anchors):
    proc = subprocess.run([sys.executable, str(BENCH), "--sizes", "2,4", "--fragments", "2", "--anchors", anchors],
                          capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    out = proc.stdout
    last = LAST_LINE.match(out.strip().splitlines()[-1])
    assert last, f"last line is not `island rank0_rss_slope=<x>`:\n{out}"
    lines = list(SIZE_LINE.finditer(out))
    assert [float(m["size"]) for m in lines] == [2.0, 4.0], out
    for m in lines:
        size = float(m["size"])
        # INIT sends the whole model, the cut brings it back; rank 0 gathers from and scatters to
        # rank 1 exactly rank 1's half (TP=2), never the whole model
        assert int(m["init"]) == int(m["cut"]) == size
        assert int(m["gathered"]) == int(m["scattered"]) == size / 2
        assert int(m["peak"]) >= int(m["base"]) > 0
        # anchors: rank 0's own half in memory mode, none in memory with files
        assert int(m["anchors"]) == (size / 2 if anchors == "memory" else 0)
    growth = [float(m["growth"]) for m in lines]
    assert float(last["x"]) == pytest.approx((growth[1] - growth[0]) / 2, abs=0.051)  # printed to 0.1 MiB


def test_model_shapes_slope_and_sizes():
    bench = _load()
    for mib in (2, 256, 1000.5):
        shapes = bench.model_shapes(mib)
        total = sum(r * c for r, c in shapes.values()) * 4
        assert total <= mib * (1 << 20) and total > mib * (1 << 20) - 4 * 512
        assert len(shapes) >= 4 and all(r % 2 == 0 and c == 256 for r, c in shapes.values())
        assert max(r * c * 4 for r, c in shapes.values()) <= 8 << 20
    assert bench.slope([256, 512, 1024], [50.0, 70.0, 126.8]) == pytest.approx(0.1)
    assert bench.slope([1024, 256], [126.8, 50.0]) == pytest.approx(0.1)
    assert math.isnan(bench.slope([5, 5], [1.0, 2.0]))
    with pytest.raises(Exception, match="--sizes"):
        bench.parse_sizes("256")
    with pytest.raises(Exception, match="--sizes"):
        bench.parse_sizes("256,-1")
