"""docs/design.md §13: `yeto demo --secure` end to end — `yeto auth init --tls` into the work directory, a
broker serving it (what `yeto broker --auth` serves), the real syncer, island a and two-rank island b,
each process with its own identity over TLS. One run; the tests read what it printed and left.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 8


@pytest.fixture(scope="module")
def secure_demo(tmp_path_factory):
    work = tmp_path_factory.mktemp("demo-secure")
    run = f"t_sdemo_{uuid.uuid4().hex[:8]}"
    # No YETO_NATS / credentials from outside: the demo must hand each process its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_") and k != "NATS_URL"}
    proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--secure", "--run", run, "--workdir", str(work),
                           "--rounds", str(ROUNDS)], capture_output=True, text=True, timeout=280, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"yeto demo --secure exited {proc.returncode}:\n{out[-4000:]}"
    return {"run": run, "work": work, "out": out, "summary": json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.mark.timeout(300)
def test_secure_demo_ends_on_the_final_cut_like_the_open_one(secure_demo):
    s = secure_demo["summary"]
    assert s["run"] == secure_demo["run"] and s["rounds"] == ROUNDS
    assert s["max_abs_diff_vs_final_cut"] == 0.0
    assert set(s["final_loss"]) == {"a", "b"} and s["eval_loss"] > 0
    assert s["secure"] == {"tls": True, "identities": ["a", "admin", "b", "observer", "syncer"]}
    work = secure_demo["work"]
    final = load_file(str(work / "final-cut.safetensors"))
    for island in ("a", "b"):
        mine = load_file(str(work / f"island-{island}.safetensors"))
        assert sorted(mine) == sorted(final) and all(torch.equal(mine[k], v) for k, v in final.items())


@pytest.mark.timeout(300)
def test_secure_demo_ran_through_tls_with_no_permission_violation(secure_demo):
    work, out = secure_demo["work"], secure_demo["out"]
    assert "NATS tls://127.0.0.1:" in out and f"identities and CA in {work / 'auth'}" in out
    auth = work / "auth"
    for name in ("syncer", "a", "b", "observer", "admin"):
        assert (auth / f"{name}.creds").stat().st_mode & 0o777 == 0o600
    assert (auth / "tls" / "ca.pem").exists()
    log = (work / "nats-server.log").read_text(errors="replace")
    # every process was let in (anonymous is refused by this server) and used only what its role allows
    assert "Violation" not in log, [ln for ln in log.splitlines() if "Violation" in ln]


def test_secure_refuses_an_outside_broker(tmp_path):
    proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--secure", "--nats", "nats://127.0.0.1:1",
                           "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--secure" in proc.stderr and "--nats" in proc.stderr, proc.stderr
