"""A syncer killed with SIGKILL mid-run and restarted with --resume, against a real nats-server.

It continues with the same versions and bytes (checkpoint files, state KV and BCAST cut compared
before and after), never re-issues a version number with other bytes (every BCAST notice of the whole
test is recorded: (fragment, version) -> version digest must be unique, and no chunk subject goes back
a version), relaunches the round that was in flight with a new attempt, and finishes the run (final
cut equal to an independent reference, acks, exit 0), and both syncer processes' recorded inputs replay to
identical actions (`yeto replay`). Also: the current cut exported mid-run, and the
refusals of --resume / a fresh start over the wrong checkpoint (exit 2, a message that names the
problem, nothing changed).
"""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import orjson
import pytest
import torch
from safetensors import safe_open

from yeto.schemas import subjects as S
from tests.scripted import (LR, MU, CutWatcher, Reference, SyncerProc, close_run, finish_on_reference,
                            push_round, snapshot_dir, start_run, syncer_status, tape, tiny_layout, wait_tape)

pytestmark = pytest.mark.timeout(60)

LAYOUT = tiny_layout(4, 32)  # P=2: fragment 0 = embed (2 f32 chunks), fragment 1 = layers (17 chunks)
RUN_ARGS = ("--islands", "2", "--fragments", "2", "--sync-every", "2", "--total-steps", "6", "--strict",
            "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024", "--status-every", "0.5")


def _export(ckpt, out, run) -> tuple[dict, dict]:
    proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "export", "--run", run, "--checkpoint-dir", str(ckpt),
                           "--out", str(out)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    with safe_open(str(out), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _cli_args(cmd: list[str]) -> list[str]:
    """The `yeto` arguments of a `python [-P] -m yeto.services.cli ...` command line."""
    return cmd[cmd.index("yeto.services.cli") + 1:]


async def _cut(isl) -> dict:
    out = {}
    for fid in range(len(isl.session["fragments"])):
        v, vals, meta = await isl.read_cut(fid)
        out[fid] = (v, meta["version_digest"], vals)
    return out


async def test_sigkill_mid_round_then_resume_keeps_versions_and_bytes_and_finishes(nats_url, run_id, tmp_path):
    ckpt = tmp_path / "ckpt"
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], ckpt, *RUN_ARGS, layout=LAYOUT)
    a, b = isls
    js = a.js
    watcher = await CutWatcher(js, run_id).start()
    try:
        ref = Reference(init)
        gen = torch.Generator().manual_seed(6)
        tokens = {"a": 200, "b": 100}

        async def play(t: int, attempt: int = 1) -> None:
            fid = await push_round(isls, ref, gen, t, tokens, attempt=attempt)
            torch.testing.assert_close(await a.wait_version(fid, (t + 1) // 2), ref.value(fid), rtol=1e-6, atol=1e-6)

        for t in (1, 2, 3):
            await play(t)

        # ---- the current cut, exported mid-run from the checkpoint directory (round 4 is in flight)
        tensors, meta = _export(ckpt, tmp_path / "mid.safetensors", run_id)
        assert meta["final"] == "False" and meta["committed_step"] == "3"
        assert orjson.loads(meta["versions"]) == {"0": 2, "1": 1}
        for f in a.session["fragments"]:
            for t in f["tensors"]:
                want = ref.value(f["id"])[t["offset"]: t["offset"] + t["numel"]].view(t["shape"])
                torch.testing.assert_close(tensors[t["name"]], want, rtol=1e-6, atol=1e-6)

        # ---- round 4 in flight: a answered attempt 1, b has not; then SIGKILL
        p4a = await a.expect_pull(4, attempt=1)
        await b.expect_pull(4, attempt=1)
        await a.push(p4a, torch.randn(a.frag(1)["numel"], generator=gen), c_tokens=tokens["a"])
        await wait_tape(js, run_id, lambda r: r["step"] == 4 and r["island"] == "a" and r["disposition"] == "accepted",
                        kind="disposition")
        syncer.kill()
        files_before = snapshot_dir(ckpt)
        state_kv = await js.key_value(S.kv_bucket(run_id, "state"))
        commit_before = orjson.loads((await state_kv.get("commit")).value)
        cut_before = await _cut(a)
        assert {f: v for f, (v, _, _) in cut_before.items()} == {0: 2, 1: 1}

        # ---- restart from the checkpoint
        syncer.start("--resume")
        await wait_tape(js, run_id, lambda r: "resumed" in r.get("reason", ""), kind="restart")
        # the round in flight is relaunched with a new attempt: a's attempt-1 push was consumed by the
        # killed process, and a pull id it already answered would be dropped as a duplicate
        p4 = {isl.island: await isl.expect_pull(4, attempt=2, timeout=20) for isl in isls}
        assert p4["a"]["base_version"] == 1
        # nothing was committed since the kill: same checkpoint files, state KV, cut and versions
        assert snapshot_dir(ckpt) == files_before
        assert orjson.loads((await state_kv.get("commit")).value) == commit_before
        cut_after = await _cut(a)
        for fid, (v, d, vals) in cut_before.items():
            assert cut_after[fid][:2] == (v, d) and torch.equal(cut_after[fid][2], vals)
        st = await syncer_status(js, run_id)
        assert st["versions"] == {"0": 2, "1": 1} and st["committed_step"] == 3 and not st["exited"]

        deltas = []
        for isl in isls:
            deltas.append(torch.randn(isl.frag(1)["numel"], generator=gen) * 0.1)
            await isl.push(p4[isl.island], deltas[-1], c_tokens=tokens[isl.island])
        ref.round(1, deltas, [tokens["a"], tokens["b"]])
        torch.testing.assert_close(await a.wait_version(1, 2), ref.value(1), rtol=1e-6, atol=1e-6)
        for t in (5, 6):
            await play(t)

        # ---- finalization: manifest, f32 final cut equal to the reference, acks, exit 0
        man = await finish_on_reference(isls, syncer, ref, 6)
        assert man["versions"] == {"0": 3, "1": 3}

        merges = await tape(js, run_id, "merge")
        assert [(m["step"], m["attempt"]) for m in merges] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 1), (6, 1)]
        await asyncio.sleep(0.3)  # let the watcher drain its last notices
        assert watcher.conflicts == [], "a version number was broadcast with two different digests"
        assert watcher.went_back() == []
        assert set(watcher.digests) == {(f, v) for f in (0, 1) for v in range(4)}
        assert (await js.stream_info(S.stream(run_id, "PUSH"))).state.messages == 0
        final_state = orjson.loads((ckpt / "checkpoint.json").read_bytes())
        assert final_state["final"] and final_state["committed_step"] == 6
        # Both syncer processes' recorded inputs replay to identical actions, the second from its restore
        # inputs (the killed one's tape ends where it died).
        rp = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "replay", "--nats", nats_url, "--run", run_id],
                            capture_output=True, text=True, timeout=60)
        assert rp.returncode == 0, rp.stdout + rp.stderr
        segs = [line for line in rp.stdout.splitlines() if line.startswith("syncer process ")]
        assert len(segs) == 2 and "(fresh)" in segs[0] and "(resumed)" in segs[1], rp.stdout
        assert all(line.endswith(" identical") for line in segs), rp.stdout
    finally:
        await watcher.stop()
        await close_run(isls, syncer, run_id)


# One process for every refusal: it imports the CLI and the syncer (torch) once, while the test still
# makes the checkpoints, then reads the cases from stdin and runs `main(["syncer", ...])` per case (each
# its own asyncio.run, connection and checkpoint directory, as a fresh process would), between marker
# lines. After each one it names the non-daemon threads left (a process holding one would not exit);
# the last case is the process's own exit status (`sys.exit(main(...))`, as `yeto syncer` ends), so
# the exit path itself is checked too. Eight syncer processes one after another cost about 5 s of
# start-up each on a loaded 2-core machine.
REFUSALS = r"""
import json, sys, threading
from yeto.services.cli import main
import yeto.services.syncer.service  # noqa: F401 - the heavy imports, before the cases are ready
cases = json.loads(sys.stdin.readline())
for i, (name, argv) in enumerate(cases):
    print(f"@@case {name}", flush=True)
    if i == len(cases) - 1:
        sys.exit(main(argv))
    rc = main(argv)
    sys.stderr.flush()
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    print(f"@@rc {name} {rc} {json.dumps(left)}", flush=True)
"""


@pytest.mark.timeout(600)  # on a loaded CI machine: two runs to version 0, then one process for nine refusals
async def test_resume_and_fresh_start_over_the_wrong_checkpoint_are_refused(nats_url, run_id, tmp_path):
    base = ("--islands", "1", "--fragments", "1", "--sync-every", "1", "--total-steps", "1", "--strict",
            "--chunk-bytes", "1024")
    run2 = f"{run_id}_o"
    made = []
    log = tmp_path / "refusals.log"
    logf = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-c", REFUSALS], stdin=subprocess.PIPE, stdout=logf,
                            stderr=subprocess.STDOUT)
    try:
        # two runs, each to version 0 (a checkpoint on disk), then killed; independent, so side by side
        async def to_v0(run, layout, d):
            syncer, isls, _ = await start_run(nats_url, run, ["a"], tmp_path / d, *base, layout=layout)
            made.append((run, isls, syncer))
            await isls[0].wait_version(0, 0)
            syncer.kill()

        for res in await asyncio.gather(to_v0(run_id, LAYOUT, "ck1"), to_v0(run2, tiny_layout(3, 32), "ck2"),
                                        return_exceptions=True):  # both settle before any cleanup
            if isinstance(res, BaseException):
                raise res
        ck1, ck2 = tmp_path / "ck1", tmp_path / "ck2"
        # the second run's checkpoint claiming to be the first run's (a re-created run id, another layout)
        relabeled = tmp_path / "relabeled"
        shutil.copytree(ck2, relabeled)
        st = orjson.loads((relabeled / "checkpoint.json").read_bytes())
        (relabeled / "checkpoint.json").write_bytes(orjson.dumps({**st, "run": run_id}))
        # the first run's checkpoint with one flipped byte in its params
        corrupt = tmp_path / "corrupt"
        shutil.copytree(ck1, corrupt)
        params = next(corrupt.glob("frag-0-v0.params"))
        raw = bytearray(params.read_bytes())
        raw[5] ^= 0x40
        params.write_bytes(bytes(raw))
        (tmp_path / "empty").mkdir()
        before = snapshot_dir(ck1)

        cases = {
            "other_run": (ck2, ["--resume"], [f"belongs to run {run2!r}"]),
            "other_layout": (relabeled, ["--resume"], ["another layout"]),
            "corrupt": (corrupt, ["--resume"], ["corrupt checkpoint", "fragment 0 version 0"]),
            # (with --state-store jetstream, the default, both of these continue the run from the state KV:
            # tests/test_syncer_standby_e2e.py)
            "no_checkpoint": (tmp_path / "empty", ["--resume", "--state-store", "local"], ["no checkpoint"]),
            "fragments": (ck1, ["--resume", "--fragments", "2", "--sync-every", "2"], ["--fragments is 2"]),
            "dtype": (ck1, ["--resume", "--push-dtype", "bf16"], ["--push-dtype", "bf16"]),
            # the outer mode is pinned (docs/design.md §4.10): a dense run is not resumed as a sparse one
            "outer": (ck1, ["--resume", "--outer", "sparseloco"], ["pinned with outer diloco", "--outer gives"]),
            # a checkpoint directory is continued without --resume too (docs/design.md §11: the same command twice is
            # the HA set-up): one of another run is refused as with --resume
            "fresh_over_checkpoint": (ck2, [], [f"belongs to run {run2!r}"]),
            "fresh_over_session": (tmp_path / "fresh", ["--state-store", "local"], ["already has a session", "--resume"]),
        }
        argvs = [[name, _cli_args(SyncerProc(nats_url, run_id, ck, *base, *extra).cmd)] for name, (ck, extra, _) in cases.items()]
        assert all(a[0] == "syncer" for _, a in argvs)
        try:
            proc.stdin.write(orjson.dumps(argvs) + b"\n")
            proc.stdin.close()
        except BrokenPipeError:  # it died importing: its output below says why
            pass
        try:
            rc = await asyncio.to_thread(proc.wait, 300)
        except subprocess.TimeoutExpired:
            rc = None
        out = log.read_text(errors="replace")
        # a case that is not refused runs a syncer: the process is then still running, after that case's marker
        assert rc is not None, f"still running after 300 s (a case not refused?):\n{out[-3000:]}"
        parts = out.split("@@case ")[1:]
        assert [p.split("\n", 1)[0] for p in parts] == list(cases), out[-3000:]
        for (name, (_, _, words)), part in zip(cases.items(), parts):
            body = part.split("\n", 1)[1] if "\n" in part else ""
            if name == list(cases)[-1]:
                got, left = rc, []  # the process's exit status
            else:
                assert f"@@rc {name} " in body, (name, body[-2000:])
                got, left = body.rsplit(f"@@rc {name} ", 1)[1].split("\n", 1)[0].split(" ", 1)
                got, left = int(got), orjson.loads(left)
            assert got == 2, (name, got, body[-2000:])
            assert left == [], f"{name}: threads left running after the refusal: {left}"
            assert "Traceback" not in body, (name, body[-2000:])
            for w in words:
                assert w in body, (name, w, body[-2000:])
        assert snapshot_dir(ck1) == before  # refusals write nothing
        assert not (tmp_path / "fresh").exists() or not any((tmp_path / "fresh").iterdir())
    finally:
        if proc.poll() is None:  # a case that was not refused would still be running (or setup failed)
            proc.kill()
            proc.wait()
        logf.close()
        for run, isls, syncer in made:
            await close_run(isls, syncer, run)
