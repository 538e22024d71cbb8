"""docs/design.md §10: syncer shards end to end, every part a real process.

A real nats-server (the session's), N `yeto syncer --shard K --shards N` processes, each with its own
checkpoint directory, and two `python -m yeto.learner.demo` islands (the tiny MLP, fixed seeds), P = 4
fragments. Nothing here goes through `yeto demo`: the test starts every process itself.

- The same lockstep run (`--strict`, YETO_LOCKSTEP=1 islands) with 1, 2 and 4 shards: every island's
  saved parameters, the final cut (read from the shards' checkpoint directories) and the run's final
  manifest (state KV `final`: versions and f32 version digests) are bitwise equal across the three.
- A follower shard killed with SIGKILL mid-run (non-strict, paced islands: in lockstep the other
  shard could not commit while one is down, since the islands wait for every round in order) and
  restarted with `--resume`: the run finishes, both islands saved exactly the final cut, the EVENTS
  tape commits every (fragment, version) exactly once with consecutive versions per fragment and one
  merge per round, the islands' step logs never show a fragment's version going back, the victim
  taped its resume, and the other shard taped commits between the kill and the restart.
- The same with shard 0, the coordinator (sessions, members, liveness, manifests).
"""
from __future__ import annotations

import hashlib
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from yeto.schemas import shards as SH
from yeto.schemas.provision import remove_run
from yeto.services.syncer.checkpoint import CheckpointDir
from tests.e2e_procs import SYNCER_TIMEOUTS, IslandProc, kv_json, tails, wait_exit, wait_until
from tests.scripted import SyncerProc, tape_of

P = 4
ISLANDS = ("a", "b")

# Lockstep: H = P, so every island step answers one round; 8 rounds = 2 versions per fragment.
LOCK_ROUNDS = 8
LOCK_ARGS = ("--islands", "2", "--fragments", str(P), "--sync-every", str(P), "--total-steps", str(LOCK_ROUNDS),
             "--strict", "--init-island", "a", "--push-dtype", "f32", "--bulk-dtype", "f32", *SYNCER_TIMEOUTS,
             "--status-every", "1")

# Kill and resume: H = 2P (2 island steps per round), islands paced by --step-delay, long enough that
# the run is mid-way when a shard dies and the other shard has rounds left to commit while it is down.
KILL_ROUNDS = 48
KILL_ARGS = ("--islands", "2", "--fragments", str(P), "--sync-every", str(2 * P), "--total-steps", str(KILL_ROUNDS),
             "--init-island", "a", *SYNCER_TIMEOUTS, "--status-every", "1")
KILL_AFTER_MERGES = 8       # merges on the tape (of both shards) before the kill
OUTAGE_MIN_S = 2.0          # the victim stays down at least this long ...
OTHERS_COMMITS = 2          # ... and until the other shard taped this many commits since the kill


# --------------------------------------------------------------------------- helpers


def shard_procs(url: str, run: str, work: Path, n: int, *args: str) -> dict[str, SyncerProc]:
    """N syncer processes of one run, one checkpoint directory each. With n == 1 no shard flag at all
    (the unsharded syncer every earlier run used: the reference the sharded runs must equal)."""
    out = {}
    for k in range(n):
        flags = () if n == 1 else ("--shard", str(k), "--shards", str(n))
        ckpt = work / ("syncer" if n == 1 else f"syncer-s{k}")
        out[f"shard{k}"] = SyncerProc(url, run, ckpt, *args, *flags, log=work / f"syncer-s{k}.log")
    return out


def ckpt_dirs(procs: dict[str, SyncerProc]) -> list[Path]:
    return [Path(p.cmd[p.cmd.index("--checkpoint-dir") + 1]) for name, p in sorted(procs.items())]


@dataclass
class Cut:
    tensors: dict[str, torch.Tensor]     # canonical name -> f32 values
    versions: dict[int, int]
    digests: dict[int, str]              # sha256 of each fragment's f32 params file (the f32 version digest)
    final: list[bool]                    # per directory: its checkpoint is marked final


def read_cut(dirs: list[Path], run: str, n: int) -> Cut:
    """The cut the shards' checkpoint directories hold together, read without `yeto export`: each
    directory names exactly its shard's own fragments (f mod N == K), all of one session, and together
    every fragment once."""
    tensors, versions, digests, final = {}, {}, {}, []
    fingerprint = None
    for k, d in enumerate(dirs):
        ck = CheckpointDir(d)
        st, session = ck.read_state(), ck.read_session()
        assert st.run == run, (d, st.run)
        fingerprint = fingerprint or session["session_fingerprint"]
        assert session["session_fingerprint"] == fingerprint == st.session_fingerprint, d
        assert sorted(st.versions) == list(SH.own_fragments(P, k, n)), (d, st.versions)
        frags = {f["id"]: f for f in session["fragments"]}
        assert sorted(frags) == list(range(P))
        for fid, v in st.versions.items():
            assert fid not in versions, f"fragment {fid} in two checkpoint directories"
            raw = ck.files(fid, v)[0].read_bytes()
            assert len(raw) == 4 * frags[fid]["numel"], (d, fid, len(raw))
            versions[fid], digests[fid] = v, hashlib.sha256(raw).hexdigest()
            flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
            for t in frags[fid]["tensors"]:
                tensors[t["name"]] = flat[t["offset"]: t["offset"] + t["numel"]].view(t["shape"]).clone()
        final.append(st.final)
    assert sorted(versions) == list(range(P)), versions
    return Cut(tensors, versions, digests, final)


def params_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0" + str(tensors[name].dtype).encode() + str(list(tensors[name].shape)).encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def assert_island_holds(isl: IslandProc, cut: Cut) -> dict[str, torch.Tensor]:
    saved = load_file(str(isl.out))
    assert sorted(saved) == sorted(cut.tensors), (isl.tag, sorted(saved))
    differ = [n for n in cut.tensors if not torch.equal(saved[n], cut.tensors[n])]
    assert differ == [], f"island {isl.tag}: tensors {differ} differ from the final cut"
    res = isl.result()
    assert res is not None and res["counters"]["rejected"] == 0, isl.output()[-3000:]
    return saved


async def finish(procs: dict, timeout: float) -> None:
    rcs = await wait_exit(procs, timeout)
    assert rcs == {name: 0 for name in procs}, f"exit codes {rcs}\n" + tails(procs)


def stop_all(*groups) -> None:
    for group in groups:
        for p in group.values():
            p.stop()


# --------------------------------------------------------------------------- 1, 2, 4 shards: same bytes


async def _lockstep_run(url: str, js, n: int, work: Path) -> dict:
    work.mkdir()
    run = f"t_shl{n}_{uuid.uuid4().hex[:8]}"
    syncers = shard_procs(url, run, work, n, *LOCK_ARGS)
    islands = {name: IslandProc(url, run, name, work, env={"YETO_LOCKSTEP": "1"}, args=("--step-delay", "0"))
               for name in ISLANDS}
    procs = {**syncers, **islands}
    try:
        for p in procs.values():
            p.start()
        await finish(procs, 150)
        manifest = await kv_json(js, run, "final")
        commits = await tape_of(js, run, "commit")
    finally:
        stop_all(procs)
        await remove_run(js, run)
    cut = read_cut(ckpt_dirs(syncers), run, n)
    assert all(cut.final), (n, cut.final)
    saved = {name: assert_island_holds(isl, cut) for name, isl in islands.items()}
    return {"n": n, "cut": cut, "manifest": manifest, "commits": commits, "saved": saved,
            "islands": {name: params_digest(s) for name, s in saved.items()}}


@pytest.mark.timeout(240)
async def test_lockstep_run_with_1_2_and_4_shards_ends_bitwise_equal(nc, nats_url, tmp_path):
    js = nc.jetstream()
    runs = [await _lockstep_run(nats_url, js, n, tmp_path / f"n{n}") for n in (1, 2, 4)]
    ref = runs[0]
    want_versions = {f: LOCK_ROUNDS // P for f in range(P)}
    # Training moved the cut: it is not the INIT island's version 0 (the comparison is not vacuous).
    from yeto.learner import demo

    init = {n: p.detach() for n, p in demo.build_model(seed=demo.model_seed("a")).named_parameters()}
    assert sorted(init) == sorted(ref["cut"].tensors)
    assert all(not torch.equal(init[n], ref["cut"].tensors[n]) for n in init)
    for r in runs:
        n = r["n"]
        assert r["cut"].versions == want_versions, (n, r["cut"].versions)
        # The manifest covers every fragment, with the f32 digest of exactly the checkpoint's bytes.
        man = r["manifest"]
        assert man is not None, f"{n} shards: no `final` record in the state KV"
        assert man["final_step"] == LOCK_ROUNDS and {int(f): v for f, v in man["versions"].items()} == want_versions, (n, man)
        assert {int(f): d for f, d in man["version_digests"].items()} == r["cut"].digests, (n, man)
        # Each commit is taped once, by the shard that owns the fragment (versions 0..2 of each).
        assert sorted((c["fragment"], c["version"]) for c in r["commits"]) == \
            [(f, v) for f in range(P) for v in range(LOCK_ROUNDS // P + 1)], (n, r["commits"])
    for r in runs[1:]:
        n = r["n"]
        assert r["cut"].digests == ref["cut"].digests, f"{n} shards: final cut differs from 1 shard's"
        assert r["manifest"]["version_digests"] == ref["manifest"]["version_digests"], n
        assert r["islands"] == ref["islands"], f"{n} shards: island parameters differ from 1 shard's"
        for name in ISLANDS:
            for t, value in ref["saved"][name].items():
                assert torch.equal(r["saved"][name][t], value), (n, name, t)
        # and the same versions reached the tape with the same digests in every run
        dig = {(c["fragment"], c["version"]): c["detail"]["version_digest"] for c in r["commits"]}
        assert dig == {(c["fragment"], c["version"]): c["detail"]["version_digest"] for c in ref["commits"]}, n


# --------------------------------------------------------------------------- a shard killed and resumed


async def _kill_and_resume(url: str, js, work: Path, victim: int, n: int = 2) -> None:
    run = f"t_shk{victim}_{uuid.uuid4().hex[:8]}"
    syncers = shard_procs(url, run, work, n, *KILL_ARGS)
    islands = {name: IslandProc(url, run, name, work, args=("--step-delay", "0.05")) for name in ISLANDS}
    procs = {**syncers, **islands}
    vname = f"shard{victim}"
    others = [k for k in range(n) if k != victim]
    try:
        for p in procs.values():
            p.start()

        async def mid_run():
            dead = {name: p.proc.poll() for name, p in procs.items() if p.proc.poll() is not None}
            assert not dead, f"exited before the kill: {dead}\n" + tails(procs)
            merges = await tape_of(js, run, "merge")
            mine = [m for m in merges if SH.shard_of(m["fragment"], n) == victim]
            return len(merges) >= KILL_AFTER_MERGES and len(mine) >= 1

        await wait_until(mid_run, 120, f"{KILL_AFTER_MERGES} merges, one of shard {victim}", poll=0.5)
        syncers[vname].kill()
        killed_at = time.time()
        assert syncers[vname].proc.returncode == -9
        at_kill = await tape_of(js, run, "merge")
        assert max(m["step"] for m in at_kill) < KILL_ROUNDS, "the run was over at the kill: make it longer"

        async def others_committed():
            got = [c for c in await tape_of(js, run, "commit")
                   if SH.shard_of(c["fragment"], n) in others and c["t"] > killed_at]
            return len(got) >= OTHERS_COMMITS and time.time() - killed_at >= OUTAGE_MIN_S

        await wait_until(others_committed, 60, f"{OTHERS_COMMITS} commits of shards {others} with shard {victim} down",
                         poll=0.5)
        restarted_at = time.time()
        syncers[vname].start("--resume")
        await finish(procs, 150)
        commits = await tape_of(js, run, "commit")
        merges = await tape_of(js, run, "merge")
        restarts = await tape_of(js, run, "restart")
        manifest = await kv_json(js, run, "final")
    finally:
        stop_all(procs)
        await remove_run(js, run)

    per_frag = KILL_ROUNDS // P
    # No version lost or applied twice: every (fragment, version) committed exactly once, versions
    # 0..T/P consecutive per fragment, one merge per round 1..T.
    twice = {fv: c for fv, c in Counter((c["fragment"], c["version"]) for c in commits).items() if c > 1}
    assert twice == {}, f"committed more than once: {twice}"
    for f in range(P):
        got = [c["version"] for c in commits if c["fragment"] == f]
        assert sorted(got) == list(range(per_frag + 1)), (f, got)
    steps = Counter(m["step"] for m in merges)
    assert sorted(steps) == list(range(1, KILL_ROUNDS + 1)) and set(steps.values()) == {1}, steps
    # The victim came back from its checkpoint (its restart record names its next own round).
    resumed = [r for r in restarts if "resumed" in r.get("reason", "") and r["t"] > restarted_at]
    assert [SH.shard_of(r["fragment"], n) for r in resumed] == [victim], restarts
    # The other shards kept committing while the victim was down (their own commit records' times).
    during = [(c["fragment"], c["version"]) for c in commits if killed_at < c["t"] < restarted_at]
    assert len(during) >= OTHERS_COMMITS and all(SH.shard_of(f, n) in others for f, _ in during), during
    # ... and the victim committed after its restart what was left of its rounds.
    after = [c for c in commits if SH.shard_of(c["fragment"], n) == victim and c["t"] > restarted_at]
    assert after, "the resumed shard committed nothing"
    # The run finished on one final cut that both islands hold, and the manifest names its bytes.
    cut = read_cut(ckpt_dirs(syncers), run, n)
    assert all(cut.final) and cut.versions == {f: per_frag for f in range(P)}, (cut.final, cut.versions)
    assert manifest is not None and {int(f): d for f, d in manifest["version_digests"].items()} == cut.digests
    for isl in islands.values():
        assert_island_holds(isl, cut)
        # and no island installed a fragment's versions out of order (its step log, step by step)
        rows = isl.steplog_rows()
        assert len(rows) >= KILL_ROUNDS * 2, (isl.tag, len(rows))
        for f in range(P):
            seen = [int(r["versions"].get(str(f), -1)) for r in rows]
            assert seen == sorted(seen), (isl.tag, f, seen)


@pytest.mark.timeout(240)
async def test_follower_shard_killed_and_resumed_loses_and_doubles_nothing(nc, nats_url, tmp_path):
    await _kill_and_resume(nats_url, nc.jetstream(), tmp_path, victim=1)


@pytest.mark.timeout(240)
async def test_coordinator_shard_killed_and_resumed_loses_and_doubles_nothing(nc, nats_url, tmp_path):
    await _kill_and_resume(nats_url, nc.jetstream(), tmp_path, victim=0)
