"""docs/design.md §11: `yeto export --from jetstream` writes the run's committed cut from its `ckpt` KV, with
no checkpoint directory: after a real two-shard `yeto demo` (bf16 bulk, so the version digest it checks is
not the plain f32 one), the export from JetStream with both syncer directories deleted is the same file
as the export from those directories, and every island holds it. A chunk changed or deleted under its
manifest is refused naming the fragment or the key (exit 1); a run that is not there, or two sources,
exit 2 naming what to fix.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import nats
import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from yeto.schemas import subjects as S


def _yeto(*args, timeout=120):
    return subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _meta(path):
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata())


async def _chunk_of(url, run, shard, fid):
    """(key, bytes, manifest revision) of the first params chunk of fragment `fid` in shard `shard`'s manifest."""
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream(timeout=10).key_value(S.kv_bucket(run, "ckpt"))
        e = await kv.get(f"ckpt.{shard}.manifest")
        v = orjson.loads(e.value)["state"]["versions"][str(fid)]
        key = f"ckpt.{shard}.f{fid}.v{v}.p.0"
        return key, (await kv.get(key)).value
    finally:
        await nc.close()


async def _kv(url, run, op, key, value=b""):
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream(timeout=10).key_value(S.kv_bucket(run, "ckpt"))
        await (kv.put(key, value) if op == "put" else kv.delete(key))
    finally:
        await nc.close()


@pytest.mark.timeout(400)
def test_export_from_jetstream_is_the_checkpoint_export_without_the_directories(nats_url, tmp_path):
    import asyncio

    run = f"t_exportjs_{uuid.uuid4().hex[:8]}"
    work = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--nats", nats_url, "--run", run,
                           "--workdir", str(work), "--rounds", "8", "--fragments", "2", "--syncer-shards", "2"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, YETO_BULK_DTYPE="bf16"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["max_abs_diff_vs_final_cut"] == 0.0

    from_dirs = tmp_path / "from-dirs.safetensors"
    p = _yeto("export", "--run", run, "--checkpoint-dir", str(work), "--out", str(from_dirs))
    assert p.returncode == 0, p.stderr
    for d in ("syncer-s0", "syncer-s1"):   # the syncers' hosts are gone
        shutil.rmtree(work / d)
    assert _yeto("export", "--run", run, "--checkpoint-dir", str(work), "--out", str(tmp_path / "x")).returncode == 2

    from_js = tmp_path / "from-jetstream.safetensors"
    p = _yeto("export", "--run", run, "--from", "jetstream", "--nats", nats_url, "--out", str(from_js))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"exported the final cut of run {run}" in p.stdout and "from JetStream (2 shards)" in p.stdout, p.stdout
    assert p.stderr.count("digest checked") == 2, p.stderr   # one line per fragment
    a, b = load_file(str(from_dirs)), load_file(str(from_js))
    assert sorted(a) == sorted(b) and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ma, mb = _meta(from_dirs), _meta(from_js)
    assert mb.pop("source") == "jetstream" and ma.pop("checkpoint_dirs") == "2"
    assert ma == mb and mb["final"] == "True"
    for island in ("a", "b"):
        mine = load_file(str(work / f"island-{island}.safetensors"))
        assert all(torch.equal(mine[n], b[n]) for n in b), island
    # no scratch left beside the output
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith(".yeto-export")) == []

    # Bytes changed under the manifest (same length): the version digest refuses them.
    key, good = asyncio.run(_chunk_of(nats_url, run, 1, 1))
    bad = bytearray(good)
    bad[0] ^= 0xFF
    asyncio.run(_kv(nats_url, run, "put", key, bytes(bad)))
    p = _yeto("export", "--run", run, "--from", "jetstream", "--nats", nats_url, "--out", str(tmp_path / "bad"))
    assert p.returncode == 1 and "fragment 1 version" in p.stderr and "corrupt" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "bad").exists()
    # A chunk gone under a manifest that did not move: incomplete, named.
    asyncio.run(_kv(nats_url, run, "delete", key))
    p = _yeto("export", "--run", run, "--from", "jetstream", "--nats", nats_url, "--out", str(tmp_path / "bad"))
    assert p.returncode == 1 and f"{key} is missing under an unchanged ckpt.1.manifest" in p.stderr, p.stderr


def test_export_from_jetstream_says_what_is_wrong(nats_url, tmp_path):
    p = _yeto("export", "--run", "nosuchrun", "--from", "jetstream", "--nats", nats_url, "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and "run nosuchrun has no state KV (yeto_nosuchrun_state, yeto_nosuchrun_ckpt)" in p.stderr, p.stderr
    p = _yeto("export", "--run", "r", "--from", "jetstream", "--checkpoint-dir", str(tmp_path), "--nats", nats_url,
              "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and "--checkpoint-dir and --from jetstream name two sources" in p.stderr, p.stderr
    p = _yeto("export", "--run", "r", "--checkpoint-dir", str(tmp_path / "gone"), "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and "--from jetstream" in p.stderr, p.stderr   # the hint where a directory is missing
    p = _yeto("export", "--run", "r", "--from", "jetstream", "--nats", nats_url, "--out", str(tmp_path / "no" / "o"))
    assert p.returncode == 2 and "does not exist" in p.stderr, p.stderr
