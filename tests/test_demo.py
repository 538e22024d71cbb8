"""docs/design.md §3.9: `yeto demo` end to end — the real nats-server of the test session, the real syncer,
island `a` (one process) and island `b` (two gloo ranks) training the demo MLP with streaming DiLoCo —
runs once (the `demo_run` session fixture, 12 rounds); these tests read what it printed and left in
its work directory.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
import torch
from safetensors.torch import load_file

from yeto.learner import demo
from tests.e2e_procs import kv_json

ROUNDS = 12  # what the demo_run fixture asks for
SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "schemas" / "json" / "steplog.schema.json").read_text())


def test_demo_exits_0_and_every_island_ends_on_the_final_cut_bitwise(demo_run):
    s = demo_run["summary"]
    assert s["run"] == demo_run["run"]
    assert s["rounds"] == ROUNDS
    assert s["max_abs_diff_vs_final_cut"] == 0.0
    # Checked again here from the files the demo left, not from its own report.
    work = Path(s["workdir"])
    final = load_file(str(work / "final-cut.safetensors"))
    assert sorted(final) == sorted(n for n, _ in demo.build_model().named_parameters())
    for island in ("a", "b"):
        mine = load_file(str(work / f"island-{island}.safetensors"))
        assert sorted(mine) == sorted(final)
        for name, value in final.items():
            assert torch.equal(mine[name], value), (island, name)


async def test_demo_learns_the_task(demo_run, nc):
    s = demo_run["summary"]
    work = Path(s["workdir"])
    # Version 0 is the INIT island's own initial model: its held-out loss is where training started.
    session = await kv_json(nc.jetstream(), demo_run["run"], "session")
    init_island = session["init_island"]
    assert init_island in ("a", "b")
    initial = demo.eval_loss(demo.build_model(seed=demo.model_seed(init_island)))
    model = demo.build_model()
    model.load_state_dict(load_file(str(work / "final-cut.safetensors")))
    final = demo.eval_loss(model)
    assert s["eval_loss"] == pytest.approx(final, abs=1e-6)  # the demo reports the final cut's loss
    assert final < 0.25 * initial, (final, initial)
    assert set(s["final_loss"]) == {"a", "b"}
    for island, loss in s["final_loss"].items():
        assert math.isfinite(loss) and 0.0 < loss < 0.5 * initial, (island, loss, initial)


def test_demo_reports_boundary_overhead(demo_run):
    s = demo_run["summary"]
    work = Path(s["workdir"])
    assert set(s["boundary"]) == {"a", "b"}
    for island, b in s["boundary"].items():
        assert set(b) >= {"steps", "step_time_s", "boundary_s", "boundary_overhead"}, b
        assert b["steps"] == s["steps"][island]
        assert b["step_time_s"] > 0 and b["boundary_s"] >= 0
        # recomputed from the step log: mean time inside the boundary over mean time per step (the
        # summary rounds seconds to 5 decimals and the ratio to 4)
        rows = [json.loads(line) for line in (work / f"steplog-{island}.jsonl").read_text().splitlines()]
        boundary = sum(r["boundary_s"] for r in rows) / len(rows)
        step_time = (rows[-1]["t"] - rows[0]["t"]) / (len(rows) - 1)
        assert b["boundary_s"] == pytest.approx(boundary, abs=1e-5)
        assert b["step_time_s"] == pytest.approx(step_time, abs=1e-5)
        assert b["boundary_overhead"] == pytest.approx(boundary / step_time, abs=1e-4)


def test_demo_step_logs_validate_against_the_schema(demo_run):
    s = demo_run["summary"]
    work = Path(s["workdir"])
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for island in ("a", "b"):
        lines = (work / f"steplog-{island}.jsonl").read_text().splitlines()
        assert len(lines) == s["steps"][island]
        rows = []
        for i, line in enumerate(lines):
            row = json.loads(line)
            errors = sorted(validator.iter_errors(row), key=str)
            assert not errors, f"steplog-{island}.jsonl line {i + 1}: {errors[0].message}"
            rows.append(row)
        assert {(r["run"], r["island"]) for r in rows} == {(demo_run["run"], island)}
        assert len({r["gen"] for r in rows}) == 1  # one process, one generation
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        assert all(b["t"] >= a["t"] for a, b in zip(rows, rows[1:]))
        # versions only grow, and the last event holds the final cut's versions (12 rounds, 2 fragments)
        for a, b in zip(rows, rows[1:]):
            assert all(b["versions"].get(f, -1) >= v for f, v in a["versions"].items()), (a, b)
        assert rows[-1]["versions"] == {"0": ROUNDS // 2, "1": ROUNDS // 2}
        # every round was answered once by every island, nothing was refused
        assert sum(r["pushes"] for r in rows) == ROUNDS
        assert sum(r["rejected"] for r in rows) == 0
        assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows)


@pytest.mark.timeout(200)
def test_demo_passes_replicas_to_its_syncer(nats_url, tmp_path):
    """`yeto demo --replicas 3 --nats URL` hands 3 to its syncer: on the session's one-server broker
    the syncer's provisioning is refused for replicas > 1 (a syncer given the default 1 would run)."""
    import subprocess
    import sys


    p = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--nats", nats_url, "--replicas", "3",
                        "--rounds", "2", "--workdir", str(tmp_path), "--timeout", "120"],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "syncer exited with 2" in p.stderr and "replicas > 1 not supported" in p.stderr, p.stderr[-2000:]
