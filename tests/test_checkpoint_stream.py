"""The merge's streamed checkpoint files (services/syncer/checkpoint.VersionFiles) on real files.

(a) A version streamed chunk by chunk (inline or on a writer thread) and committed is byte-identical to the same params and momentum written whole.
(b) A real process killed with SIGKILL while streaming a version (half the chunks, every chunk but
before the fsync, after the fsync and renames but before the manifest) leaves the previous version
readable and the directory resumable; re-issuing the same version over the leftovers gives the right
bytes, and the fragment's next commit deletes them. (c) The real syncer streams each merged version
(`yeto syncer --checkpoint-writer` inline / thread; `whole` writes them at the commit) and its checkpoint
holds the broadcast bytes, with either `--broadcast` mode.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from yeto.schemas.chunks import chunk_plan
from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointError, CheckpointState, VersionFiles

ROOT = Path(__file__).resolve().parents[1]
NUMEL = 300_001          # not a multiple of the chunk: the last chunk is short


def _state(versions: dict[int, int], step: int) -> CheckpointState:
    return CheckpointState(run="r", session_fingerprint="s", layout_fingerprint="l", committed_step=step,
                           versions=dict(versions), version_digests={k: f"d{v}" for k, v in versions.items()})


def _tensors(seed: int, numel: int = NUMEL) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g), torch.randn(numel, generator=g)


def _spans(numel: int, chunk: int):
    return [(o, min(chunk, numel - o)) for o in range(0, numel, chunk)]


@pytest.mark.parametrize("thread", [False, True])
@pytest.mark.parametrize("chunk", [65_536, 1, NUMEL])
def test_streamed_files_are_byte_identical_to_a_whole_write(tmp_path, thread, chunk):
    numel = NUMEL if chunk != 1 else 513   # chunks of one element on a small fragment
    params, momentum = _tensors(1, numel)
    whole, streamed = CheckpointDir(tmp_path / "whole"), CheckpointDir(tmp_path / "streamed")
    whole.commit(_state({0: 3}, 3), {0: (params, momentum)})

    vf = VersionFiles(streamed, 0, 3, params, momentum, thread=thread)
    for o, c in _spans(numel, chunk):
        vf.add(o, c)
    assert not streamed.files(0, 3)[0].exists()           # nothing under the final name before the commit
    streamed.commit(_state({0: 3}, 3), {0: (params, momentum)}, {0: vf})

    for a, b in zip(whole.files(0, 3), streamed.files(0, 3)):
        assert a.read_bytes() == b.read_bytes()
        assert len(b.read_bytes()) == numel * 4
    assert (whole.path / "checkpoint.json").read_bytes() == (streamed.path / "checkpoint.json").read_bytes()
    p, m = streamed.load_fragment(0, 3, numel)
    assert torch.equal(p, params) and torch.equal(m, momentum)
    assert sorted(q.name for q in streamed.path.iterdir()) == ["checkpoint.json", "frag-0-v3.momentum", "frag-0-v3.params"]
    assert vf.seconds > 0 and vf.written == numel


@pytest.mark.parametrize("thread", [False, True])
def test_a_version_without_momentum_streams_its_params_file_alone(tmp_path, thread):
    """The sparse mode (docs/design.md §4.10): VersionFiles with momentum None writes the params file only,
    byte for byte the whole write's."""
    params = _tensors(2, 5000)[0]
    whole, streamed = CheckpointDir(tmp_path / "whole"), CheckpointDir(tmp_path / "streamed")
    whole.commit(_state({0: 3}, 3), {0: (params, None)})
    vf = VersionFiles(streamed, 0, 3, params, None, thread=thread)
    for o, c in _spans(5000, 777):
        vf.add(o, c)
    streamed.commit(_state({0: 3}, 3), {0: (params, None)}, {0: vf})
    assert sorted(q.name for q in streamed.path.iterdir()) == ["checkpoint.json", "frag-0-v3.params"]
    assert whole.files(0, 3)[0].read_bytes() == streamed.files(0, 3)[0].read_bytes()
    p, m = streamed.load_fragment(0, 3, 5000, momentum=False)
    assert m is None and torch.equal(p, params)


def test_streaming_starts_the_writeback_of_every_byte_in_order_and_pruning_can_wait(tmp_path, monkeypatch):
    """VersionFiles asks the kernel to start writing each file back every WRITEBACK_BYTES (so the
    commit's fsync finds little left): the ranges it hands to sync_file_range cover each file once,
    in order, to its last byte. A commit with prune=False keeps the older version's files until
    `prune`, which leaves exactly the files the manifest names."""
    import yeto.services.syncer.checkpoint as C

    if sys.platform.startswith("linux"):
        assert C._sync_file_range is not None  # the writeback really starts here, not only in this test
    calls: list[tuple[int, int, int]] = []
    real = C.start_writeback
    monkeypatch.setattr(C, "start_writeback", lambda fd, off, n: (calls.append((fd, off, n)), real(fd, off, n)))
    monkeypatch.setattr(C, "WRITEBACK_BYTES", 100_000)
    ck = CheckpointDir(tmp_path)
    old_p, old_m = _tensors(1)
    ck.commit(_state({0: 2}, 2), {0: (old_p, old_m)})
    params, momentum = _tensors(2)
    vf = VersionFiles(ck, 0, 3, params, momentum)
    for o, c in _spans(NUMEL, 65_536):
        vf.add(o, c)
    fds = sorted({fd for fd, _, _ in calls})
    assert len(fds) == 2
    for fd in fds:
        ranges = [(off, n) for f, off, n in calls if f == fd]
        assert ranges[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert ranges[-1][0] + ranges[-1][1] == NUMEL * 4 and len(ranges) == 5  # one per 256 KiB chunk (>= 100 kB)
    ck.commit(_state({0: 3}, 3), {0: (params, momentum)}, {0: vf}, prune=False)
    assert {q.name for q in tmp_path.iterdir()} == {"checkpoint.json", "frag-0-v2.params", "frag-0-v2.momentum",
                                                   "frag-0-v3.params", "frag-0-v3.momentum"}
    ck.prune(ck.read_state(), [0])
    assert {q.name for q in tmp_path.iterdir()} == {"checkpoint.json", "frag-0-v3.params", "frag-0-v3.momentum"}
    p, m = ck.load_fragment(0, 3, NUMEL)
    assert torch.equal(p, params) and torch.equal(m, momentum)


def test_an_incomplete_or_out_of_order_stream_is_refused_and_the_old_version_stays(tmp_path):
    ck = CheckpointDir(tmp_path)
    old_p, old_m = _tensors(1)
    ck.commit(_state({0: 1}, 1), {0: (old_p, old_m)})
    params, momentum = _tensors(2)
    vf = VersionFiles(ck, 0, 2, params, momentum)
    vf.add(0, 1000)
    with pytest.raises(CheckpointError, match=r"out of order.*expected from 1000"):
        vf.add(2000, 10)
    with pytest.raises(CheckpointError, match=r"1000 of 300001 values streamed to frag-0-v2.params.tmp"):
        ck.commit(_state({0: 2}, 2), {0: (params, momentum)}, {0: vf})
    # files of another version than the commit's are refused before anything is written
    vf3 = VersionFiles(ck, 0, 3, params, momentum)
    with pytest.raises(CheckpointError, match=r"fragment 0 version 3 do not belong to this commit"):
        ck.commit(_state({0: 2}, 2), {0: (params, momentum)}, {0: vf3})
    vf3.abort()
    assert not vf3.tmp[0].exists() and not vf3.tmp[1].exists()
    assert ck.read_state().versions == {0: 1}
    p, m = ck.load_fragment(0, 1, NUMEL)
    assert torch.equal(p, old_p) and torch.equal(m, old_m)


def test_a_failing_writer_thread_fails_the_commit(tmp_path):
    ck = CheckpointDir(tmp_path)
    params, momentum = _tensors(3)
    vf = VersionFiles(ck, 0, 1, params, momentum, thread=True)
    vf._f[1].close()                      # the momentum file's writes fail on the writer thread
    vf.add(0, 1000)
    vf.add(1000, NUMEL - 1000)
    with pytest.raises(CheckpointError, match=r"writing frag-0-v1.params.tmp / frag-0-v1.momentum.tmp failed"):
        ck.commit(_state({0: 1}, 1), {0: (params, momentum)}, {0: vf})
    assert not ck.exists() and not ck.files(0, 1)[0].exists()


# The child commits version 1 whole, then streams version 2 and stops at `stage` (prints it, then
# sleeps until the parent's SIGKILL). Seeds: version 1 = 1, version 2 = 2.
CHILD = textwrap.dedent("""
    import sys, time
    import torch
    from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointState, VersionFiles
    path, stage, thread, numel, chunk = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
    def tensors(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    def state(v):
        return CheckpointState(run="r", session_fingerprint="s", layout_fingerprint="l", committed_step=v,
                               versions={0: v}, version_digests={0: f"d{v}"})
    ck = CheckpointDir(path)
    ck.commit(state(1), {0: tensors(1)})
    p, m = tensors(2)
    vf = VersionFiles(ck, 0, 2, p, m, thread=thread)
    spans = [(o, min(chunk, numel - o)) for o in range(0, numel, chunk)]
    for k, (o, c) in enumerate(spans):
        if stage == "half" and k == len(spans) // 2:
            break
        vf.add(o, c)
    while vf.written < vf.done:           # a writer thread caught up: what was added is in the .tmp files
        time.sleep(0.01)
    if stage == "before_manifest":
        vf.finish()                       # fsynced and renamed: what CheckpointDir.commit does first
    print(stage, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("stage,thread", [("half", False), ("half", True), ("before_fsync", False),
                                          ("before_fsync", True), ("before_manifest", False)])
@pytest.mark.e2e
def test_sigkill_while_streaming_leaves_the_old_version_and_the_next_commit_deletes_the_leftovers(
        tmp_path, stage, thread):
    chunk = 40_000
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), stage, "1" if thread else "0", str(NUMEL),
                             str(chunk)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    try:
        line = proc.stdout.readline().strip()
        assert line == stage, f"child said {line!r}"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ck = CheckpointDir(tmp_path)
    names = sorted(q.name for q in tmp_path.iterdir())
    # what the crash left: the stream's files, never named by the manifest
    if stage == "before_manifest":
        assert "frag-0-v2.params" in names and "frag-0-v2.momentum" in names, names
    else:
        assert "frag-0-v2.params.tmp" in names and "frag-0-v2.momentum.tmp" in names, names
        size = (tmp_path / "frag-0-v2.params.tmp").stat().st_size
        half = (-(-NUMEL // chunk)) // 2      # the child's chunks written before it stopped
        assert size == (chunk * half * 4 if stage == "half" else NUMEL * 4)

    # the previous version is the checkpoint, complete (what a resumed syncer reads)
    st = ck.read_state()
    assert st.versions == {0: 1} and st.committed_step == 1
    p, m = ck.load_fragment(0, st.versions[0], NUMEL)
    want_p, want_m = _tensors(1)
    assert torch.equal(p, want_p) and torch.equal(m, want_m)

    # the resumed syncer re-issues version 2 (the same bytes), streamed over the leftovers
    new_p, new_m = _tensors(2)
    vf = VersionFiles(ck, 0, 2, new_p, new_m, thread=thread)
    for o, c in _spans(NUMEL, 70_000):
        vf.add(o, c)
    ck.commit(_state({0: 2}, 2), {0: (new_p, new_m)}, {0: vf})
    p, m = ck.load_fragment(0, 2, NUMEL)
    assert torch.equal(p, new_p) and torch.equal(m, new_m)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["checkpoint.json", "frag-0-v2.momentum", "frag-0-v2.params"]


@pytest.mark.parametrize("leftover", ["frag-0-v2.params.tmp", "frag-0-v2.params"])
def test_the_next_commit_of_the_fragment_deletes_a_leftover_of_another_version(tmp_path, leftover):
    ck = CheckpointDir(tmp_path)
    ck.commit(_state({0: 1, 1: 1}, 1), {0: _tensors(1), 1: _tensors(1)})
    # a crashed stream of version 2 (a torn .tmp, or complete files no manifest names)
    (tmp_path / leftover).write_bytes(b"\x00" * 12)
    (tmp_path / "frag-0-v2.momentum.tmp").write_bytes(b"\x00" * 4)
    # another fragment's commit keeps them (they are fragment 0's), fragment 0's next commit deletes them
    p, m = _tensors(5)
    vf = VersionFiles(ck, 1, 2, p, m)
    vf.add(0, NUMEL)
    ck.commit(_state({0: 1, 1: 2}, 2), {1: (p, m)}, {1: vf})
    assert (tmp_path / leftover).exists()
    vf = VersionFiles(ck, 0, 3, p, m, thread=True)
    vf.add(0, NUMEL)
    ck.commit(_state({0: 3, 1: 2}, 3), {0: (p, m)}, {0: vf})
    assert sorted(q.name for q in tmp_path.iterdir()) == [
        "checkpoint.json", "frag-0-v3.momentum", "frag-0-v3.params", "frag-1-v2.momentum", "frag-1-v2.params"]


@pytest.mark.parametrize("writer,broadcast", [("inline", "with-commit"), ("thread", "cut-through"),
                                              ("whole", "after-commit")])
async def test_the_syncer_streams_the_merged_version_into_its_checkpoint(nats_url, run_id, tmp_path, writer, broadcast):
    """The real syncer (`--checkpoint-writer` and `--broadcast` as given): after each merged round the checkpoint's params
    file holds bitwise the broadcast f32 version, the merge record's ckpt_write_s says the files were
    streamed (0 for `whole`, the old path), and no .tmp file or older version is left."""
    import asyncio

    import orjson

    from tests.scripted import Reference, SyncerProc, tape
    from tests.test_syncer_e2e import LR, MU, _close, _setup

    syncer, isls, init = await _setup(nats_url, run_id, ["a", "b"], tmp_path, "--checkpoint-writer", writer,
                                      "--broadcast", broadcast, "--islands", "2", "--fragments", "2",
                                      "--sync-every", "2", "--total-steps", "6", "--strict", "--outer-lr", str(LR),
                                      "--outer-momentum", str(MU), "--chunk-bytes", "1024")
    assert isinstance(syncer, SyncerProc)
    try:
        ref = Reference(init)
        gen = torch.Generator().manual_seed(1)
        ck = CheckpointDir(tmp_path / "ckpt")
        for t in (1, 2):
            fid = (t - 1) % 2
            deltas, tokens = [], []
            for i, isl in enumerate(isls):
                _, pull = await isl.wait_for(lambda k, m: k == "pull" and m["step"] == t)
                d = torch.randn(isl.frag(fid)["numel"], generator=gen) * 0.1
                await isl.push(pull, d, c_tokens=100 * (i + 1))
                deltas.append(d)
                tokens.append(100 * (i + 1))
            ref.round(fid, deltas, tokens)
            vals = await isls[0].wait_version(fid, 1)
            torch.testing.assert_close(vals, ref.p[fid].detach(), rtol=1e-6, atol=1e-6)
            st = ck.read_state()   # committed before the broadcast
            assert st.versions[fid] == 1
            p, m = ck.load_fragment(fid, 1, vals.numel())
            assert torch.equal(p, vals)                       # the streamed file is the broadcast version
            assert torch.isfinite(m).all() and m.abs().sum() > 0
        for _ in range(100):
            merges = await tape(isls[0].js, run_id, "merge")
            if len(merges) >= 2:
                break
            await asyncio.sleep(0.1)
        assert [r["step"] for r in merges[:2]] == [1, 2]
        for r in merges[:2]:
            d = r["detail"]
            assert d["checkpoint_s"] > 0 and d["ckpt_wait_s"] >= 0
            assert (d["ckpt_write_s"] > 0) == (writer != "whole"), d
            chunks = len(chunk_plan(isls[0].frag(r["fragment"])["numel"], "f32", 1024))
            assert d["broadcast_mode"] == broadcast
            assert d["early_chunks"] == (chunks - 1 if broadcast != "after-commit" else 0), d
        names = sorted(q.name for q in ck.path.iterdir() if q.name.startswith("frag-"))
        assert names == ["frag-0-v1.momentum", "frag-0-v1.params", "frag-1-v1.momentum", "frag-1-v1.params"]
        assert orjson.loads((ck.path / "checkpoint.json").read_bytes())["versions"] == {"0": 1, "1": 1}
    finally:
        await _close(isls, syncer, run_id)
