"""docs/design.md §7.1, §11, §14: `soak/rolling.py`, every part of a run restarted on purpose while it trains. A
3-node `yeto broker --cluster 3` rolled with `yeto broker roll`, the owning syncer handed over twice (SIGTERM, a
standby on its own empty directory), each of two islands stopped (SIGTERM) and started again, the outer learning
rate changed once with `yeto run set`: no round lost or doubled, every island bitwise on the exported final cut,
and no gap between two rounds' merges longer than the median round + 3 s.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.scripted import ROOT

pytestmark = pytest.mark.soak

LAST = re.compile(r"^rolling lost=(\d+) double=(\d+) final_equal=(true|false) max_commit_gap_s=(\S+) "
                  r"median_round_s=(\S+)$")


@pytest.mark.timeout(600)
def test_rolling_maintenance_loses_nothing_and_never_stalls(tmp_path):
    out_json = tmp_path / "rolling.json"
    # 200 rounds of ~0.45 s: the six operations were over by round ~90-110 on the loaded 2-core VM (soak/README.md),
    # but under a full CI run once not before round 200 ("the run ended first"): 320 rounds
    cmd = [sys.executable, str(ROOT / "soak" / "rolling.py"), "--rounds", "320", "--timeout", "500",
           "--progress-every", "30", "--workdir", str(tmp_path / "work"), "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560)
    out = proc.stdout + proc.stderr
    tail = f"\n--- soak/rolling.py output (tail) ---\n{out[-8000:]}"
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    m = LAST.match(last)
    assert m, f"no summary line (rc {proc.returncode}):{tail}"
    lost, double, final_equal, gap, median = m.groups()
    res = json.loads(out_json.read_text())["rolling"]
    assert [o["name"] for o in res["ops"]] == ["broker-roll", "handover", "island-a", "outer-lr", "handover",
                                               "island-b"] and res["failed"] == [], tail
    assert (int(lost), int(double)) == (0, 0), tail
    assert final_equal == "true", tail
    assert res["handover_rcs"] == [143, 143] and res["crashes"] == [] and res["left"] == {}, tail
    # the outer lr set mid-run is on every merge from the round after the request on (the tape's merge records)
    set_at = next(o["round"] for o in res["ops"] if o["name"] == "outer-lr")
    assert res["outer_lr_from"] is not None and set_at < res["outer_lr_from"] <= set_at + 10, tail
    assert res["committed"] == 320, tail
    # the bound, strict since its last open gap was closed (design §7.1): every run since the fixes met it, loaded
    # (soak/README.md: 4 + 3 runs two at once, two full CI rehearsals)
    assert float(gap) <= float(median) + 3.0, f"max_commit_gap_s={gap} > median_round_s={median} + 3{tail}"
    assert proc.returncode == 0, tail
