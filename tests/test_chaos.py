"""Issue 16, "Show": `bench/chaos.py` in CI size. A real run (own nats-server, the syncer, 4 islands, island
b with 2 gloo ranks) in which islands, the syncer and the broker are SIGKILLed at every kind of moment the
harness knows (INIT, after a pull, mid-push, mid-merge, mid-broadcast, the broker mid-push and
mid-broadcast, the final cut) and restarted; one kill of each kind. It must lose no round, double
nothing, end with every island bitwise on the exported final cut, and leave no process behind.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.scripted import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from chaos import ALL_KINDS, END_KINDS, group_members  # noqa: E402

LAST = re.compile(r"^chaos rounds=(\d+) kills=(\d+) lost=(\d+) double=(\d+) final_equal=(true|false) goodput=(\S+)$")


@pytest.mark.timeout(420)
def test_chaos_soak_ci_size_loses_nothing_and_ends_on_the_final_cut(tmp_path):
    rounds = 20
    out_json = tmp_path / "chaos.json"
    # seed 2 kills the 2-rank island b among others and picks syncer-final as the final-cut kill (the full
    # soak, seed 1, takes an island down during the final cut)
    cmd = [sys.executable, str(ROOT / "bench" / "chaos.py"), "--rounds", str(rounds), "--kills-per-kind", "1",
           "--first-kill-after", "2", "--gap-min", "1", "--gap-max", "2", "--seed", "2", "--no-baseline", "--quorum-timeout", "30",
           "--progress-every", "30", "--timeout", "330", "--workdir", str(tmp_path / "work"), "--json", str(out_json)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    m = LAST.match(last)
    assert m, f"no summary line (rc {proc.returncode}):\n{out[-6000:]}"
    n, kills, lost, double, final_equal, goodput = m.groups()
    res = json.loads(out_json.read_text())["chaos"]

    # every kind of death happened, each at least once, and all but the final-cut one mid-run
    fired = set(res["recovery"])
    assert fired >= set(ALL_KINDS) - set(END_KINDS), (sorted(fired), out[-6000:])
    assert fired & set(END_KINDS), (sorted(fired), out[-6000:])
    assert int(kills) >= len(ALL_KINDS) - 1
    assert goodput == "na"

    assert int(n) == rounds, out[-6000:]
    assert (int(lost), int(double)) == (0, 0), (res["lost_rounds"], res["double_rounds"], res["double_versions"],
                                                out[-6000:])
    assert final_equal == "true", (res["islands_equal"], out[-6000:])
    assert res["bad_apply"] == [] and res["crashes"] == [] and not res["timed_out"], out[-6000:]
    # no process left: neither when the run ended nor now (every group the harness started)
    assert res["left"] == {}, res["left"]
    assert {name: group_members(pgid) for name, pgid in res["pgids"].items() if group_members(pgid)} == {}
    # every kill recovered (the final-cut kill: the run ended cleanly after it)
    never = {k: v for k, v in res["recovery"].items() if any(x is None for x in v)}
    assert never == {}, (never, out[-6000:])
    assert proc.returncode == 0, out[-6000:]
