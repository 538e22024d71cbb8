"""docs/design.md §10: `yeto demo --syncer-shards 2` end to end — the real nats-server of the test session,
two real `yeto syncer --shard K --shards 2` processes, island `a` (one process) and island `b` (two gloo
ranks) — runs once (module fixture, 12 rounds, P = 4); the tests read what it printed and left.

It must end as the one-syncer demo does (tests/test_demo.py): every island bitwise on the final cut,
which `yeto export` reads from both shards' checkpoint directories; each round merged exactly once;
each shard's directory and status record naming only its own fragments. Also: the demo refuses more
shards than fragments, and docker-compose.yml's commented two-shard example is a valid pair of
services once uncommented.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from yeto.learner import demo
from yeto.services.cmd_export import export
from yeto.services.steplog.shards import ShardBoard
from tests.e2e_procs import kv_json, merges

ROOT = Path(__file__).resolve().parents[1]
ROUNDS, P, N = 12, 4, 2


@pytest.fixture(scope="module")
def sharded_demo(nats_url, tmp_path_factory):
    work = tmp_path_factory.mktemp("demo-shards")
    run = f"t_demo_shards_{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--nats", nats_url, "--run", run,
                           "--workdir", str(work), "--rounds", str(ROUNDS), "--fragments", str(P),
                           "--syncer-shards", str(N)], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"yeto demo --syncer-shards {N} exited {proc.returncode}:\n{out[-5000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"run": run, "summary": summary, "workdir": work, "output": out, "seconds": time.monotonic() - t0}


def test_every_island_ends_on_the_final_cut_bitwise(sharded_demo):
    s = sharded_demo["summary"]
    assert s["run"] == sharded_demo["run"] and s["syncer_shards"] == N
    assert s["rounds"] == ROUNDS and s["max_abs_diff_vs_final_cut"] == 0.0
    # checked again from the files, not from the demo's report
    work = Path(s["workdir"])
    final = load_file(str(work / "final-cut.safetensors"))
    assert sorted(final) == sorted(n for n, _ in demo.build_model().named_parameters())
    for island in ("a", "b"):
        mine = load_file(str(work / f"island-{island}.safetensors"))
        assert sorted(mine) == sorted(final)
        for name, value in final.items():
            assert torch.equal(mine[name], value), (island, name)
    # the two shard processes both ran and said so in their log lines
    out = sharded_demo["output"]
    assert "[syncer-s0]" in out and "[syncer-s1]" in out


def test_each_shard_directory_holds_its_own_fragments_and_together_the_final_cut(sharded_demo):
    work, run = Path(sharded_demo["summary"]["workdir"]), sharded_demo["run"]
    assert not (work / "syncer").exists()
    for k in range(N):
        ck = orjson.loads((work / f"syncer-s{k}" / "checkpoint.json").read_bytes())
        assert sorted(map(int, ck["versions"])) == [f for f in range(P) if f % N == k]
        assert ck["final"] is True and ck["run"] == run
        assert ck["versions"] == {f: ROUNDS // P for f in ck["versions"]}  # 3 rounds per fragment, after v0
    # the demo's exported file is what `yeto export` of the parent directory writes
    info = export(work, work / "again.safetensors", run)
    assert info["final"] is True and len(info["dirs"]) == N
    with safe_open(str(work / "again.safetensors"), "pt") as a, safe_open(str(work / "final-cut.safetensors"), "pt") as b:
        assert a.metadata() == b.metadata() and a.metadata()["checkpoint_dirs"] == str(N)
        for name in b.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


async def test_rounds_merged_once_and_the_state_kv_per_shard(sharded_demo, nc):
    run = sharded_demo["run"]
    js = nc.jetstream()
    steps = [m["step"] for m in await merges(js, run)]
    assert sorted(steps) == list(range(1, ROUNDS + 1)), steps  # every round once, whichever shard ran it
    manifest = await kv_json(js, run, "final")
    assert manifest is not None and sorted(map(int, manifest["versions"])) == list(range(P))
    assert sorted(map(int, manifest["version_digests"])) == list(range(P))
    board = ShardBoard()
    for k in range(N):
        for base in ("syncer", "commit"):
            rec = await kv_json(js, run, f"{base}.{k}")
            assert rec is not None, f"{base}.{k}"
            assert board.put(f"{base}.{k}", orjson.dumps(rec))
        status = await kv_json(js, run, f"syncer.{k}")
        assert (status["shard"], status["shards"]) == (k, N)
        assert status["fragments"] == [f for f in range(P) if f % N == k]
        assert sorted(map(int, status["versions"])) == status["fragments"]
        assert status["exited"] is True and status["rss_bytes"] > 0
    assert await kv_json(js, run, "syncer") is None  # no unsharded record in a sharded run
    # what the viewers make of the real records: both shards done, none missing
    rows = board.rows(time.time())
    assert board.malformed == 0 and [(r.shard, r.state) for r in rows] == [(0, "exited"), (1, "exited")]
    assert board.missing(time.time()) == []


@pytest.mark.e2e
def test_more_shards_than_fragments_is_refused():
    for extra, why in ((["--syncer-shards", "5", "--fragments", "4"], "--syncer-shards 5 exceeds --fragments 4"),
                       (["--syncer-shards", "0"], "--syncer-shards must be an integer >= 1")):
        proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--nats", "nats://127.0.0.1:1", *extra],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr


def test_compose_two_shard_example_is_two_valid_syncer_services(monkeypatch):
    from yeto.services.cli import build_parser

    text = (ROOT / "docker-compose.yml").read_text()
    block = text.split("# BEGIN two syncer shards\n")[1].split("  # END two syncer shards")[0]
    lines = block.splitlines()
    assert all(line.startswith("  #") for line in lines), "the example stays commented out"
    uncommented = text.replace(block, "\n".join(re.sub(r"^  # ?", "  ", line) for line in lines) + "\n")
    uncommented = uncommented.replace("  # syncer-s0-data:", "  syncer-s0-data:").replace("  # syncer-s1-data:", "  syncer-s1-data:")
    svcs = yaml.safe_load(uncommented)["services"]
    volumes = yaml.safe_load(uncommented)["volumes"]
    monkeypatch.setenv("YETO_RUN", "demo")
    seen = []
    for k in range(2):
        svc = svcs[f"syncer-s{k}"]
        args = build_parser().parse_args(svc["command"])
        assert (args.shard, args.shards) == (k, 2) and args.checkpoint_dir == f"/data/syncer-s{k}"
        vol = svc["volumes"][0].split(":")[0]
        assert vol == f"syncer-s{k}-data" and vol in volumes
        seen.append(vol)
        assert svc["environment"]["YETO_FRAGMENTS"] == "${YETO_FRAGMENTS:-2}"
    assert svcs["syncer-s0"]["environment"] == svcs["syncer-s1"]["environment"]  # the same run settings
    assert len(set(seen)) == 2
