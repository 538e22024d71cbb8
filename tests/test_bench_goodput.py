"""bench/goodput.py: a smoke run on a 4 MiB model, islands of one and of two ranks (output contract: both passes ran, merges committed, every
process's peak RSS), and its pure parts (the rate window, staleness from a step log and the tape) on
hand-made data.

Not a timed assertion: steps/s on 2 shared cores are too noisy to gate on; the 256 MiB figures live in
bench/README.md.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOODPUT = ROOT / "bench" / "goodput.py"
LAST = re.compile(r"^goodput ratio=(?P<ratio>[0-9.]+) staleness=(?P<st>[0-9.]+) sync_steps_per_s=(?P<s>[0-9.]+) "
                  r"alone_steps_per_s=(?P<a>[0-9.]+) boundary_share=(?P<share>[0-9.]+) installs=(?P<installs>\d+) "
                  r"merges=(?P<merges>\d+)$")


def _load():
    spec = importlib.util.spec_from_file_location("bench_goodput", GOODPUT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rate_window_leaves_out_warmup_and_tail():
    g = _load()
    times = [0.0, 5.0] + [5.0 + 0.5 * k for k in range(1, 11)] + [30.0, 60.0]   # slow start, slow end
    # steps 1..11 are 0.5 s apart: 2 steps/s, whatever the first and last steps cost
    assert g.rate(times, warmup=1, tail=2) == pytest.approx(2.0)
    with pytest.raises(SystemExit):
        g.rate(times[:4], warmup=2, tail=2)


def test_boundary_share_is_the_time_inside_boundary_over_the_same_window():
    g = _load()
    times = [0.0, 5.0] + [5.0 + 0.5 * k for k in range(1, 11)] + [30.0, 60.0]
    inside = [4.0, 4.0] + [0.05] * 10 + [20.0, 20.0]   # boundary_s[i]: inside the boundary that ended at times[i]
    # steps 2..11 (the window of rate(warmup=1, tail=2)): 10 x 0.05 s inside of 5 s
    assert g.boundary_share(times, inside, warmup=1, tail=2) == pytest.approx(0.1)


def test_staleness_counts_versions_committed_beyond_the_one_installed():
    g = _load()
    merges = [{"fragment": 0, "version": 1, "t": 10.0}, {"fragment": 0, "version": 2, "t": 20.0},
              {"fragment": 1, "version": 1, "t": 15.0}, {"fragment": 0, "version": 3, "t": 30.0}]
    log = [json.dumps({"t": 12.0, "versions": {"0": 1, "1": 0}}),
           json.dumps({"t": 25.0, "versions": {"0": 1, "1": 1}}),    # installs f1 v1 at 25: newest 1 -> 0
           json.dumps({"t": 31.0, "versions": {"0": 2, "1": 1}})]    # installs f0 v2 at 31: newest 3 -> 1
    assert g.staleness(log, merges) == [0, 0, 1]
    assert g.width_for(256) ** 2 * 4 * g.LAYERS == pytest.approx(256 * (1 << 20), rel=0.01)


@pytest.mark.timeout(300)
@pytest.mark.e2e
@pytest.mark.parametrize("ranks", [1, 2])
def test_smoke_run_prints_both_passes_and_the_last_line(tmp_path, ranks):
    out = subprocess.run([sys.executable, str(GOODPUT), "--size-mib", "4", "--steps", "48", "--warmup", "8",
                          "--step-s", "0.05", "--workdir", str(tmp_path), "--ranks", str(ranks)],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert f"2 islands of {ranks} rank(s)" in lines[0], lines[0]
    m = LAST.match(lines[-1])
    assert m, lines[-1]
    assert int(m["merges"]) == 48 * 4 // 32, out.stdout   # steps x P / H rounds, each merged once
    assert int(m["installs"]) >= 2 * 4, out.stdout        # each island installed every fragment at least once
    assert float(m["s"]) > 0 and float(m["a"]) > 0 and float(m["ratio"]) > 0 and 0 <= float(m["share"]) < 1
    rss = next(ln for ln in lines if ln.startswith("peak RSS MiB: "))
    islands = ["alone-i0", "alone-i1", "sync-i0", "sync-i1"]
    if ranks > 1:   # each rank's own peak, not its launcher's
        islands = [f"{i}-r{k}" for i in islands for k in range(ranks)]
    for proc in islands + ["sync-syncer"]:
        m = re.search(rf"\b{proc} (\d+)\b", rss)
        assert m and int(m.group(1)) > 50, rss   # a process that imported torch is past 50 MiB
    assert ranks == 1 or not re.search(r"\bsync-i0 ", rss), rss
