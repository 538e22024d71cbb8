"""`yeto export` across syncer shards (docs/design.md §10): one safetensors file from every shard's checkpoint
directory, on real directories written by services/syncer/checkpoint.CheckpointDir.

The same params are committed once into one unsharded directory (every fragment) and once split over
shard directories (fragment f in shard f mod N, each checkpoint.json naming only its own fragments),
and the exports must be equal byte for byte; directories that are not one cut (two sessions, two
runs, a fragment twice or nowhere) are refused with an error naming the fragment and the directories.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from safetensors import safe_open

from yeto.schemas import shards
from yeto.schemas.layout import build_session
from yeto.services.cmd_export import ExportError, export
from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointState, sha256_of
from tests.scripted import tiny_layout

ROOT = Path(__file__).resolve().parents[1]
RUN = "r1"
P = 4


def session(chunk_bytes: int = 1024, run: str = RUN) -> dict:
    return build_session(tiny_layout(4, 8), P, run=run, push_dtype="f32", bulk_dtype="f32", chunk_bytes=chunk_bytes,
                         init_island="a", sync_every=4)


def params(sess: dict, seed: int = 0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {f["id"]: (torch.randn(f["numel"], generator=g), torch.randn(f["numel"], generator=g))
            for f in sess["fragments"]}


def write_dir(path: Path, sess: dict, frags: dict, versions: dict[int, int], *, step: int, final: bool = False,
              run: str = RUN) -> CheckpointDir:
    """A checkpoint directory as a syncer (shard) leaves it: session.json (the full session) and a
    checkpoint.json naming `versions` (its own fragments only)."""
    ck = CheckpointDir(path)
    ck.write_session(sess)
    st = CheckpointState(run=run, session_fingerprint=sess["session_fingerprint"],
                         layout_fingerprint=sess["layout_fingerprint"], committed_step=step,
                         versions=dict(versions), version_digests={f: sha256_of(frags[f][0]) for f in versions},
                         final=final)
    ck.commit(st, {f: frags[f] for f in versions})
    return ck


VERSIONS = {0: 3, 1: 2, 2: 2, 3: 2}  # after step 9 of P = 4: fragment 0 had rounds 1, 5, 9


def sharded(tmp: Path, n: int, sess: dict, frags: dict, *, final: bool = False, parent: str = "run") -> list[Path]:
    out = []
    for k in range(n):
        own = shards.own_fragments(P, k, n)
        step = max(t for t in range(1, 10) if shards.owns_step(t, P, k, n))  # highest own step committed
        d = tmp / parent / f"syncer-s{k}"
        write_dir(d, sess, frags, {f: VERSIONS[f] for f in own}, step=step, final=final)
        out.append(d)
    return out


def read(path: Path) -> tuple[dict[str, bytes], dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}, f.metadata()


@pytest.fixture
def cut(tmp_path):
    sess = session()
    frags = params(sess)
    single = write_dir(tmp_path / "single" / "syncer", sess, frags, VERSIONS, step=9)
    info = export(single.path, tmp_path / "single.safetensors", RUN)
    assert info["tensors"] == len(tiny_layout(4, 8)) and info["committed_step"] == 9
    return sess, frags, read(tmp_path / "single.safetensors")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shard_dirs_export_equal_to_the_single_directory(tmp_path, cut, n):
    sess, frags, (want, want_meta) = cut
    dirs = sharded(tmp_path, n, sess, frags)
    # repeated --checkpoint-dir, and the parent directory: the same file as the unsharded export
    for i, arg in enumerate((dirs, tmp_path / "run")):
        out = tmp_path / f"sharded-{i}.safetensors"
        info = export(arg, out, RUN)
        got, meta = read(out)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name] == want[name], name
        assert orjson.loads(meta["versions"]) == orjson.loads(want_meta["versions"])
        assert meta["session_fingerprint"] == want_meta["session_fingerprint"]
        assert meta["committed_step"] == "9" and meta["final"] == "False" and meta["checkpoint_dirs"] == str(n)
        assert info["dirs"] == [str(d) for d in dirs]
    # and every tensor is the committed f32 bytes of its fragment at its offset
    for f in sess["fragments"]:
        flat = frags[f["id"]][0]
        for t in f["tensors"]:
            assert got[t["name"]] == flat[t["offset"]: t["offset"] + t["numel"]].numpy().tobytes()


@pytest.mark.e2e
def test_cli_repeated_dirs_parent_dir_and_the_default(tmp_path, cut):
    sess, frags, (want, _) = cut
    parent = tmp_path / "yeto-data" / RUN  # where `yeto demo` and the default --checkpoint-dir put them
    dirs = sharded(tmp_path, 2, sess, frags, final=True, parent=f"yeto-data/{RUN}")
    env = dict(os.environ)
    env.pop("YETO_CHECKPOINT_DIR", None)
    runs = {
        "repeated": ["--checkpoint-dir", str(dirs[0]), "--checkpoint-dir", str(dirs[1])],
        "parent": ["--checkpoint-dir", str(parent)],
        "default": [],  # ./yeto-data/<run> holds no syncer/: its syncer-s<K> directories
    }
    for name, extra in runs.items():
        out = tmp_path / f"{name}.safetensors"
        proc = subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "export", "--run", RUN, *extra, "--out", str(out)],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
        assert proc.returncode == 0, (name, proc.stderr)
        assert "exported the final cut" in proc.stdout and "from 2 checkpoint directories" in proc.stdout, proc.stdout
        got, meta = read(out)
        assert got == want and meta["final"] == "True", name


def test_a_fragment_in_two_directories_is_refused_naming_both(tmp_path, cut):
    sess, frags, _ = cut
    dirs = sharded(tmp_path, 2, sess, frags)
    # an unsharded directory of the same run left beside the shards' (or a shard named twice over)
    stray = write_dir(tmp_path / "run" / "syncer", sess, frags, {1: 2}, step=2).path
    with pytest.raises(ExportError) as exc:
        export(tmp_path / "run", tmp_path / "x.safetensors", RUN)
    text = exc.value.text
    assert "fragment 1 is in more than one" in text and str(stray) in text and str(dirs[1]) in text, text
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.safetensors.tmp").exists()


def test_a_missing_shard_is_refused_naming_its_fragments(tmp_path, cut):
    sess, frags, _ = cut
    dirs = sharded(tmp_path, 4, sess, frags)
    with pytest.raises(ExportError) as exc:
        export([dirs[0], dirs[2]], tmp_path / "x.safetensors", RUN)
    text = exc.value.text
    assert "fragments 1, 3 are in no checkpoint directory" in text and str(dirs[0]) in text and str(dirs[2]) in text, text
    # a shard that adopted the session but never committed: named, not silently skipped
    (dirs[3] / "checkpoint.json").unlink()
    with pytest.raises(ExportError) as exc:
        export(tmp_path / "run", tmp_path / "x.safetensors", RUN)
    assert f"no checkpoint in {dirs[3]}" in exc.value.text, exc.value.text


def test_other_session_or_run_is_refused(tmp_path, cut):
    sess, frags, _ = cut
    dirs = sharded(tmp_path, 2, sess, frags)
    other = session(chunk_bytes=2048)  # same layout, other session fingerprint
    assert other["session_fingerprint"] != sess["session_fingerprint"]
    odd = write_dir(tmp_path / "old" / "syncer-s1", other, params(other), {1: 2, 3: 2}, step=8).path
    with pytest.raises(ExportError) as exc:
        export([dirs[0], odd], tmp_path / "x.safetensors", RUN)
    assert "different sessions" in exc.value.text and str(odd) in exc.value.text, exc.value.text
    with pytest.raises(ExportError) as exc:
        export(dirs, tmp_path / "x.safetensors", "r2")
    assert "belongs to run 'r1', not 'r2'" in exc.value.text
    foreign = write_dir(tmp_path / "r9" / "syncer-s1", sess, frags, {1: 2, 3: 2}, step=8, run="r9").path
    with pytest.raises(ExportError) as exc:
        export([dirs[0], foreign], tmp_path / "x.safetensors")
    assert "different runs" in exc.value.text, exc.value.text


def test_final_only_when_every_shard_is_final(tmp_path, cut):
    sess, frags, _ = cut
    dirs = sharded(tmp_path, 2, sess, frags, final=True)
    assert export(dirs, tmp_path / "a.safetensors", RUN)["final"] is True
    write_dir(dirs[1], sess, frags, {1: 2, 3: 2}, step=8, final=False)
    info = export(dirs, tmp_path / "b.safetensors", RUN)
    assert info["final"] is False and info["final_dirs"] == [str(dirs[0])]
    assert read(tmp_path / "b.safetensors")[1]["final"] == "False"


def test_nothing_there_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="none of its sub-directories"):
        export(tmp_path / "empty", tmp_path / "x.safetensors", RUN)
    with pytest.raises(ExportError, match="does not exist"):
        export(tmp_path / "nope", tmp_path / "x.safetensors", RUN)
