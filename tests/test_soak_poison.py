"""docs/design.md §9: `soak/hostile.py --poison all` as a test — with the syncer's default flags, a
2-island run (the session's nats-server, the real `yeto syncer`, islands a and b as `python -m yeto.learner.demo`)
whose island a is compromised (learner/demo.py's YETO_DEMO_POISON: +50 on every pushed value, NaN pushes,
5 x its delta's norm, a 2^53-1 token claim) ends with a final eval loss within 10 x of a clean run's, run
side by side. Before the default norm bound: 7.5e8 (plus50), no round ever committed (nan), 13.9 (norm5x) against 0.076.
Every run must finish, the clean one untouched by the defences, and each poisoned one must show the rule
that bounded it (so a pass is not a run where the poison never arrived)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.soak, pytest.mark.timeout(240)]

LINE = re.compile(r"poison kind=(\w+) clean=(\S+) poisoned=(\S+) ratio=(\S+) quarantined=(\d+) clamped=(\d+) "
                  r"merges=(\d+) committed=(\S+) rules=(\{.*?\})")


def test_a_compromised_island_is_bounded_by_the_default_flags(nats_url, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "soak" / "hostile.py"), "--poison", "all", "--rounds", "24",
                           "--step-delay", "0.02", "--timeout", "180", "--nats", nats_url, "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=220)
    out = proc.stdout + proc.stderr
    clean = re.search(r"poison kind=clean eval_loss=(\S+) quarantined=(\d+) clamped=(\d+) committed=(\S+)", proc.stdout)
    assert clean, out[-4000:]
    assert float(clean[1]) < 1.0 and clean[2] == "0" and clean[3] == "0" and clean[4] == "24", out[-4000:]
    rows = {m[1]: m for m in LINE.finditer(proc.stdout)}
    assert sorted(rows) == ["nan", "norm5x", "plus50", "tokens"], out[-4000:]
    for kind, m in rows.items():
        ratio, quarantined, clamped, committed = float(m[4]), int(m[5]), int(m[6]), m[8]
        assert ratio <= 10.0 and committed == "24", (kind, m[0])
        if kind == "tokens":
            assert clamped >= 20 and quarantined == 0, m[0]        # every round's claim capped
        else:
            rule = "non_finite" if kind == "nan" else "norm_bound"
            # every push of island a, nearly: a 5x push once passed whenever a's true delta was under 0.8 x
            # b's (17 of 24 quarantined, ratio 14.9 in a loaded CI run); probation (K/2) closed that
            assert quarantined >= 20 and f'"{rule}"' in m[9], m[0]
    assert proc.stdout.strip().splitlines()[-1].startswith("poison ok=true"), out[-4000:]
    assert proc.returncode == 0, out[-4000:]
