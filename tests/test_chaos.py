"""docs/design.md §14: `soak/chaos.py` in CI size. A real run (own nats-server, the syncer, 4 islands, island
b with 2 gloo ranks) in which islands, the syncer and the broker are SIGKILLed at every kind of moment the
harness knows (INIT, after a pull, mid-push, mid-merge, mid-broadcast, the broker mid-push and
mid-broadcast, the final cut) and restarted; one kill of each kind. It must lose no round, double
nothing, end with every island bitwise on the exported final cut, and leave no process behind. The same with a
standby taking over, and in the sparse outer mode (`--outer sparseloco`).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.scripted import ROOT

sys.path.insert(0, str(ROOT / "soak"))
from chaos import ALL_KINDS, END_KINDS, group_members  # noqa: E402

pytestmark = pytest.mark.soak

LAST = re.compile(r"^chaos rounds=(\d+) kills=(\d+) lost=(\d+) double=(\d+) final_equal=(true|false) goodput=(\S+)$")


@pytest.mark.timeout(420)
def test_chaos_soak_ci_size_loses_nothing_and_ends_on_the_final_cut(tmp_path):
    # rounds are cheap (a fraction of a second without a kill) and stall while a killed part is down (a
    # round waits for every member, up to the member timeout), so seed 3's last mid-run kill arms at
    # about round 11 on a quiet or a loaded machine; 24 rounds leave it twice that (kills arm below
    # round 22), and the final-cut kill comes after them
    rounds = 24
    out_json = tmp_path / "chaos.json"
    # seed 3 kills the 2-rank island b mid-push and picks syncer-final as the final-cut kill (the full
    # soak, seed 1, takes an island down during the final cut)
    cmd = [sys.executable, str(ROOT / "soak" / "chaos.py"), "--rounds", str(rounds), "--kills-per-kind", "1",
           "--first-kill-after", "2", "--gap-min", "1", "--gap-max", "2", "--seed", "3", "--no-baseline", "--quorum-timeout", "30",
           # 50 ms of simulated compute per inner step, not the soak's 20: four islands stepping flat out
           # took a quarter of the run's CPU, which the killed parts' restarts (torch imports) need on 2 cores
           "--step-delay", "0.05",
           # a restarted 2-rank island needs up to ~60 s to be admitted on a loaded 2-core machine; with the
           # soak's 20 s the run can go on without it and finish before it is back (soak/README.md, "The suite's form")
           "--member-timeout", "90",
           "--progress-every", "30", "--timeout", "330", "--workdir", str(tmp_path / "work"), "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    m = LAST.match(last)
    assert m, f"no summary line (rc {proc.returncode}):\n{out[-6000:]}"
    n, kills, lost, double, final_equal, goodput = m.groups()
    res = json.loads(out_json.read_text())["chaos"]
    tail = f"\n--- soak/chaos.py output (tail) ---\n{out[-8000:]}"  # a string, so pytest prints it whole

    # every kind of death happened, each at least once, and all but the final-cut one mid-run
    fired = set(res["recovery"])
    assert fired >= set(ALL_KINDS) - set(END_KINDS), f"kinds fired: {sorted(fired)}{tail}"
    assert fired & set(END_KINDS), f"kinds fired: {sorted(fired)}{tail}"
    assert int(kills) >= len(ALL_KINDS) - 1
    assert goodput == "na"

    assert int(n) == rounds, tail
    assert (int(lost), int(double)) == (0, 0), (f"lost rounds {res['lost_rounds']}, doubled rounds {res['double_rounds']}, "
                                                f"doubled versions {res['double_versions']}{tail}")
    assert final_equal == "true", f"islands equal to the final cut: {res['islands_equal']}{tail}"
    assert res["bad_apply"] == [] and res["crashes"] == [] and not res["timed_out"], tail
    # no process left: neither when the run ended nor now (every group the harness started)
    assert res["left"] == {}, f"left running: {res['left']}{tail}"
    assert {name: group_members(pgid) for name, pgid in res["pgids"].items() if group_members(pgid)} == {}
    # every kill recovered (the final-cut kill: the run ended cleanly after it)
    never = {k: v for k, v in res["recovery"].items() if any(x is None for x in v)}
    assert never == {}, f"never recovered: {never}{tail}"
    assert proc.returncode == 0, tail


@pytest.mark.timeout(420)
def test_chaos_standby_owner_killed_never_restarted_loses_nothing(tmp_path):
    """docs/design.md §11: `soak/chaos.py --standby`: two syncers, each its own empty checkpoint directory (two hosts);
    every syncer kill takes the owner, which is never restarted: its standby takes over from the state KV
    (a new standby starts). Nothing lost, nothing doubled, every island on the final cut."""
    out_json = tmp_path / "chaos.json"
    cmd = [sys.executable, str(ROOT / "soak" / "chaos.py"), "--standby", "--rounds", "30", "--kills-per-kind", "1",
           "--kinds", "syncer-mid-merge,syncer-mid-broadcast,syncer-final", "--first-kill-after", "3",
           "--gap-min", "3", "--gap-max", "5", "--seed", "2", "--no-baseline", "--quorum-timeout", "30",
           "--step-delay", "0.05", "--member-timeout", "90", "--progress-every", "30", "--timeout", "330",
           "--workdir", str(tmp_path / "work"), "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    m = LAST.match(last)
    assert m, f"no summary line (rc {proc.returncode}):\n{out[-6000:]}"
    n, kills, lost, double, final_equal, _ = m.groups()
    res = json.loads(out_json.read_text())["chaos"]
    tail = f"\n--- soak/chaos.py output (tail) ---\n{out[-8000:]}"
    assert set(res["recovery"]) >= {"syncer-mid-merge", "syncer-mid-broadcast"}, tail
    assert int(kills) >= 2 and int(n) == 30, tail
    assert (int(lost), int(double)) == (0, 0), tail
    assert final_equal == "true" and res["crashes"] == [] and not res["timed_out"], tail
    logs = [p.read_text() for p in (tmp_path / "work" / "chaos").glob("syncer-*.log")]
    assert "owns the run now" in out and any("restored run" in text for text in logs), tail
    assert res["left"] == {}, tail
    assert proc.returncode == 0, tail


@pytest.mark.timeout(420)
def test_chaos_sparse_outer_mode_syncer_and_island_killed_loses_nothing(tmp_path):
    """docs/design.md §4.10: `soak/chaos.py --outer sparseloco`: the syncer (restarted with --resume) and islands
    SIGKILLed mid-merge, mid-broadcast, mid-push (a sparse push of several 1 KiB chunks) and in the final cut of a
    sparse run. Nothing lost, nothing doubled, every island bitwise on the exported final cut, every merge sparse."""
    out_json = tmp_path / "chaos.json"
    # sized like the standby test above: a few kills, seed-scheduled a few rounds apart
    cmd = [sys.executable, str(ROOT / "soak" / "chaos.py"), "--outer", "sparseloco", "--rounds", "24",
           "--kills-per-kind", "1", "--kinds", "island-mid-push,syncer-mid-merge,syncer-mid-broadcast,syncer-final",
           "--first-kill-after", "2", "--gap-min", "2", "--gap-max", "3", "--seed", "3", "--no-baseline",
           "--quorum-timeout", "30", "--step-delay", "0.05", "--member-timeout", "90", "--progress-every", "30",
           "--timeout", "330", "--workdir", str(tmp_path / "work"), "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    m = LAST.match(last)
    assert m, f"no summary line (rc {proc.returncode}):\n{out[-6000:]}"
    n, kills, lost, double, final_equal, _ = m.groups()
    res = json.loads(out_json.read_text())["chaos"]
    tail = f"\n--- soak/chaos.py output (tail) ---\n{out[-8000:]}"
    # the syncer and an island each died at least once mid-run, and each kill recovered
    assert set(res["recovery"]) >= {"island-mid-push", "syncer-mid-merge", "syncer-mid-broadcast"}, tail
    assert {k: v for k, v in res["recovery"].items() if any(x is None for x in v)} == {}, tail
    assert int(kills) >= 3 and int(n) == 24, tail
    assert (int(lost), int(double)) == (0, 0), (f"lost rounds {res['lost_rounds']}, doubled rounds {res['double_rounds']}, "
                                                f"doubled versions {res['double_versions']}{tail}")
    assert final_equal == "true", f"islands equal to the final cut: {res['islands_equal']}{tail}"
    assert res["bad_apply"] == [] and res["crashes"] == [] and not res["timed_out"] and res["left"] == {}, tail
    # the run was sparse from its first merge to its last, the resumed syncers' too (the pin survives --resume)
    tape = [json.loads(line) for line in (tmp_path / "work" / "chaos" / "tape.jsonl").read_text().splitlines() if line]
    merges = [r for r in tape if r.get("kind") == "merge"]
    assert merges and all(r["detail"].get("outer_mode") == "sparseloco" for r in merges), tail
    assert any(r["detail"].get("sparse_entries", 0) > 0 for r in merges), tail
    assert proc.returncode == 0, tail
