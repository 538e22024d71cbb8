"""The syncer against a real nats-server, driven by scripted islands that speak only `schemas`."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import nats
import torch

from yeto.schemas import subjects as S
from yeto.schemas.provision import remove_run
from tests.scripted import Reference, ScriptedIsland, SyncerProc, tape, tiny_layout
from yeto.services.run_harness import wait_provisioned

LR, MU = 0.7, 0.9


async def _islands(nats_url, run, names, layout=None):
    out = []
    for name in names:
        nc = await nats.connect(nats_url)
        isl = ScriptedIsland(nc, run, name, layout)
        out.append(isl)
    return out


async def _setup(nats_url, run, names, tmp_path, *syncer_args, layout=None):
    syncer = SyncerProc(nats_url, run, tmp_path / "ckpt", *syncer_args).start()
    isls = await _islands(nats_url, run, names, layout)
    await wait_provisioned(isls[0].js, run, timeout=20)
    for isl in isls:
        await isl.connect_consumer()
    for isl in isls:
        await isl.hello()
        await asyncio.sleep(0.05)  # the first hello pins the session and names the INIT island
    session = await isls[0].wait_session()
    for isl in isls[1:]:
        await isl.wait_session()
    assert session["init_island"] == names[0]
    gen = torch.Generator().manual_seed(0)
    init = {f["id"]: torch.randn(f["numel"], generator=gen) for f in session["fragments"]}
    await isls[0].send_init(init)
    return syncer, isls, init


async def _close(isls, syncer, run):
    syncer.stop()
    js = isls[0].js
    await remove_run(js, run)
    for isl in isls:
        await isl.nc.close()


async def test_two_islands_complete_rounds_finalize_and_export(nats_url, run_id, tmp_path):
    syncer, isls, init = await _setup(nats_url, run_id, ["a", "b"], tmp_path, "--islands", "2", "--fragments", "2",
                                      "--sync-every", "2", "--total-steps", "4", "--strict",
                                      "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024")
    try:
        ref = Reference(init)
        for isl in isls:
            for fid, v in init.items():
                torch.testing.assert_close(await isl.wait_version(fid, 0), v, rtol=0, atol=0)
        gen = torch.Generator().manual_seed(1)
        for t in range(1, 5):
            fid = (t - 1) % 2
            deltas, tokens = [], []
            for i, isl in enumerate(isls):
                _, pull = await isl.wait_for(lambda k, m: k == "pull" and m["step"] == t)
                assert pull["fragment"] == fid and {m["island"] for m in pull["members"]} == {"a", "b"}
                d = torch.randn(isl.frag(fid)["numel"], generator=gen) * 0.1
                tok = 100 * (i + 1)
                await isl.push(pull, d, c_tokens=tok)
                deltas.append(d)
                tokens.append(tok)
            ref.round(fid, deltas, tokens)
            vals = await isls[0].wait_version(fid, t // 2 + (t % 2))
            torch.testing.assert_close(vals, ref.p[fid].detach(), rtol=1e-6, atol=1e-6)
        manifests = []
        for isl in isls:
            _, man = await isl.wait_for(lambda k, m: k == "manifest")
            assert man["final_step"] == 4 and man["gen"] == isl.gen
            manifests.append(man)
        for fid in range(2):
            v, vals, meta = await isls[0].read_cut(fid, final=True)
            assert meta["final_step"] == 4 and meta["dtype"] == "f32"
            assert v == manifests[0]["versions"][str(fid)]
            assert meta["version_digest"] == manifests[0]["version_digests"][str(fid)]
            torch.testing.assert_close(vals, ref.p[fid].detach(), rtol=1e-6, atol=1e-6)
        for isl in isls:
            await isl.ack(4)
        for isl in isls:
            await isl.wait_for(lambda k, m: k == "shutdown")
        assert syncer.wait(30) == 0, syncer.output()[-3000:]
        merges = await tape(isls[0].js, run_id, "merge")
        assert [m["step"] for m in merges] == [1, 2, 3, 4]
        assert all(set(m["weights"]) == {"a", "b"} for m in merges)
        # Export from the checkpoint directory: canonical names, equal to the final cut.
        out = tmp_path / "final.safetensors"
        proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "export", "--run", run_id, "--checkpoint-dir",
                               str(tmp_path / "ckpt"), "--out", str(out)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        from safetensors.torch import load_file

        tensors = load_file(str(out))
        session = isls[0].session
        assert sorted(tensors) == sorted(e["name"] for e in tiny_layout())
        for f in session["fragments"]:
            flat = ref.p[f["id"]].detach()
            for t in f["tensors"]:
                want = flat[t["offset"]: t["offset"] + t["numel"]].view(t["shape"])
                torch.testing.assert_close(tensors[t["name"]], want, rtol=1e-6, atol=1e-6)
        # The PUSH stream was emptied after the commits.
        info = await isls[0].js.stream_info(S.stream(run_id, "PUSH"))
        assert info.state.messages == 0
    finally:
        await _close(isls, syncer, run_id)
