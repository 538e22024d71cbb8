"""`yeto run set` against a real syncer and nats-server: a changed outer learning rate takes effect at the
next merge (checked against an independent reference whose lr changes at the same round), a refused or
malformed request names the field and changes nothing, a resumed syncer keeps what was set, and both
processes' inputs replay to identical actions."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
import pytest
import torch

from yeto.schemas import codec, subjects as S
from yeto.services.steplog.aggregate import Aggregator
from yeto.services.steplog.tail import render_text
from tests.scripted import LR, MU, Reference, close_run, finish_on_reference, push_round, start_run, tape, tiny_layout, \
    wait_tape

pytestmark = pytest.mark.timeout(90)

LAYOUT = tiny_layout(4, 32)
RUN_ARGS = ("--islands", "2", "--fragments", "2", "--sync-every", "2", "--total-steps", "6", "--strict",
            "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024")


def yeto(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", *args], capture_output=True, text=True,
                          timeout=60)


async def _request(nc, run: str, data: bytes) -> dict:
    msg = await nc.request(S.settings(run), data, timeout=10)
    return codec.decode_typed(msg.data, allowed=("settings_result",))[1]


async def test_run_set_changes_the_outer_lr_from_the_next_merge_refuses_bad_values_and_survives_a_resume(
        nats_url, run_id, tmp_path):
    ckpt = tmp_path / "ckpt"
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], ckpt, *RUN_ARGS, layout=LAYOUT)
    a, b = isls
    js = a.js
    try:
        ref = Reference(init)
        gen = torch.Generator().manual_seed(11)
        tokens = {"a": 300, "b": 100}

        async def play(t: int, attempt: int | None = None) -> None:
            fid = await push_round(isls, ref, gen, t, tokens, attempt=attempt)
            torch.testing.assert_close(await a.wait_version(fid, (t + 1) // 2), ref.value(fid), rtol=1e-6, atol=1e-6)

        for t in (1, 2):
            await play(t)

        # ---- the operator lowers the outer lr and the quorum timeout; the CLI prints what is in force
        res = await asyncio.to_thread(yeto, "run", "set", run_id, "outer-lr=0.3", "quorum_timeout=45", "--nats", nats_url)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "outer_lr=0.3" in res.stdout and "quorum_timeout_s=45" in res.stdout, res.stdout
        for opt in ref.opt.values():
            for group in opt.param_groups:
                group["lr"] = 0.3
        await play(3)           # merged with lr 0.3: the reference agrees only if the change took effect here
        kept = orjson.loads((await (await js.key_value(S.kv_bucket(run_id, "state"))).get("settings")).value)
        assert kept["settings"] == {"outer_lr": 0.3, "quorum_timeout_s": 45.0}

        # ---- bad input: a value out of range (the schema lets a number through) and a malformed request
        bad = codec.encode("settings", codec.make("settings", run=run_id, id="bad-1", set={"outer_momentum": 1.5}))
        ans = await _request(a.nc, run_id, bad)
        assert not ans["ok"] and ans["field"] == "outer_momentum" and ans["value"] == "1.5", ans
        ans = await _request(a.nc, run_id, b'{"type": "settings", "v": 1, "run": "x"')
        assert not ans["ok"] and ans["id"] == "invalid" and "malformed" in ans["error"], ans
        # the CLI refuses a bad key before sending anything (usage error)
        res = await asyncio.to_thread(yeto, "run", "set", run_id, "sync_every=8", "--nats", nats_url)
        assert res.returncode == 2 and "sync_every" in res.stderr, res.stdout + res.stderr
        # a retried request (same id) is answered, not applied twice
        again = codec.encode("settings", codec.make("settings", run=run_id, id="ret-1", set={"outer_momentum": 0.8}))
        first, second = await _request(a.nc, run_id, again), await _request(a.nc, run_id, again)
        assert first["ok"] and first["changed"] == {"outer_momentum": 0.8} and second["ok"] and second["changed"] == {}
        for opt in ref.opt.values():
            for group in opt.param_groups:
                group["momentum"] = 0.8

        # ---- SIGKILL and --resume: the settings in force come back before the first round
        await play(4)
        syncer.kill()
        syncer.start("--resume")
        await wait_tape(js, run_id, lambda r: "kept" in r.get("reason", ""), kind="settings", timeout=30)
        await play(5, attempt=2)   # relaunched with a new attempt; still lr 0.3, momentum 0.8
        await play(6)
        await finish_on_reference(isls, syncer, ref, 6)

        settings = await tape(js, run_id, "settings")
        reasons = [r["reason"] for r in settings]
        assert sum("refused" in x for x in reasons) == 1 and sum("kept" in x for x in reasons) == 1, reasons
        merges = {m["step"]: m for m in await tape(js, run_id, "merge")}
        assert "outer" not in merges[2].get("detail", {}) and merges[3]["detail"]["outer"] == {"outer_lr": 0.3}
        assert merges[6]["detail"]["outer"] == {"outer_lr": 0.3, "outer_momentum": 0.8}
        # what `yeto steplog tail` and the dashboard show: the settings in force, from which step, refusals
        agg = Aggregator(run_id)
        for rec in await tape(js, run_id):
            assert agg.feed(S.events(run_id, rec["kind"]), orjson.dumps(rec)) is not None
        summary = agg.summary()
        assert summary["settings"] == {"outer_lr": 0.3, "outer_momentum": 0.8, "quorum_timeout_s": 45.0}
        assert summary["settings_refused"] == 1 and summary["settings_step"] >= 3
        shown = render_text(agg)
        assert "runtime settings (yeto run set) outer_lr=0.3, outer_momentum=0.8, quorum_timeout_s=45.0" in shown, shown
        rp = await asyncio.to_thread(yeto, "replay", "--nats", nats_url, "--run", run_id)
        assert rp.returncode == 0, rp.stdout + rp.stderr
        segs = [line for line in rp.stdout.splitlines() if line.startswith("syncer process ")]
        assert len(segs) == 2 and all(line.endswith(" identical") for line in segs), rp.stdout
    finally:
        await close_run(isls, syncer, run_id)


async def test_run_set_with_no_syncer_says_so_and_exits_1(nats_url, run_id):
    res = await asyncio.to_thread(yeto, "run", "set", run_id, "outer_lr=0.5", "--nats", nats_url, "--timeout", "1")
    assert res.returncode == 1 and "no syncer of run" in res.stdout and "nothing changed" in res.stdout, res.stdout


async def test_run_set_push_dtype_moves_the_next_rounds_to_bf16_and_refuses_a_push_in_the_old_dtype(
        nats_url, run_id, tmp_path):
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], tmp_path / "ckpt", *RUN_ARGS, layout=LAYOUT)
    a, b = isls
    try:
        ref = Reference(init)
        gen = torch.Generator().manual_seed(12)
        tokens = {"a": 300, "b": 100}
        for t in (1, 2):
            fid = await push_round(isls, ref, gen, t, tokens)
            torch.testing.assert_close(await a.wait_version(fid, 1), ref.value(fid), rtol=1e-6, atol=1e-6)
        p3 = {isl.island: await isl.expect_pull(3) for isl in isls}
        assert "push_dtype" not in p3["a"]                      # launched before the change: the session's f32
        res = await asyncio.to_thread(yeto, "run", "set", run_id, "push_dtype=bf16", "--nats", nats_url)
        assert res.returncode == 0 and "push_dtype=bf16" in res.stdout, res.stdout + res.stderr
        deltas = [torch.randn(a.frag(0)["numel"], generator=gen) * 0.1 for _ in isls]
        for isl, d in zip(isls, deltas):
            await isl.push(p3[isl.island], d, c_tokens=tokens[isl.island])
        ref.round(0, deltas, [tokens["a"], tokens["b"]])
        torch.testing.assert_close(await a.wait_version(0, 2), ref.value(0), rtol=1e-6, atol=1e-6)
        # round 4 (launched after the change) asks for bf16: an f32 push is refused naming the dtype, the bf16 one is merged
        p4 = {isl.island: await isl.expect_pull(4) for isl in isls}
        assert p4["a"]["push_dtype"] == "bf16" == p4["b"]["push_dtype"]
        deltas = [torch.randn(a.frag(1)["numel"], generator=gen) * 0.1 for _ in isls]
        await a.push(p4["a"], deltas[0], c_tokens=tokens["a"], dtype="f32", try_=0)
        bad = await wait_tape(a.js, run_id, lambda r: r["island"] == "a" and r["step"] == 4, kind="disposition")
        assert bad["disposition"] == "invalid" and "push dtype must be the round's (yeto run set) bf16" in bad["reason"], bad
        for isl, d in zip(isls, deltas):
            await isl.push(p4[isl.island], d, c_tokens=tokens[isl.island], try_=1)
        ref.round(1, [d.to(torch.bfloat16).float() for d in deltas], [tokens["a"], tokens["b"]])
        torch.testing.assert_close(await a.wait_version(1, 2), ref.value(1), rtol=1e-6, atol=1e-6)
        merges = {m["step"]: m for m in await tape(a.js, run_id, "merge")}
        assert merges[4]["version"] == 2 and set(merges[4]["weights"]) == {"a", "b"}
    finally:
        await close_run(isls, syncer, run_id)
