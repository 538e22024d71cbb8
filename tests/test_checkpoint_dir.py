"""The syncer's checkpoint directory (services/syncer/checkpoint.py) on real files in tmp_path.

A commit writes the fragment files, then swaps the manifest in by rename, then deletes what it replaced;
what a crash leaves (a torn `.tmp`, files of a version the manifest never named) is never read and is
cleaned by the fragment's next commit; every unusable file is refused with an error naming it.
"""
from __future__ import annotations

import hashlib

import numpy as np
import orjson
import pytest
import torch

from yeto.services.syncer.checkpoint import MANIFEST, CheckpointDir, CheckpointError, CheckpointState, sha256_of


def state(versions: dict[int, int], step: int = 1, **kw) -> CheckpointState:
    return CheckpointState(run="r1", session_fingerprint="sfp", layout_fingerprint="lfp", committed_step=step,
                           versions=dict(versions), version_digests={f: f"dig{f}.{v}" for f, v in versions.items()}, **kw)


def pair(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


def f32_bytes(t: torch.Tensor) -> bytes:
    return np.asarray(t.numpy(), dtype="<f4").tobytes()  # the independent reference: NumPy's little-endian f32


def names(ck: CheckpointDir) -> set[str]:
    return {p.name for p in ck.path.iterdir()}


def test_commit_then_read_round_trips_every_field_and_the_bytes(tmp_path):
    ck = CheckpointDir(tmp_path / "ck")
    assert not ck.exists()
    frag0, frag1 = pair(0, 1000), pair(1, 7)
    st = state({0: 0, 1: 0}, step=0, attempts={3: 2}, tape=[{"kind": "merge", "step": 0}],
               final_record={"targets": {"a": "00ff"}, "acks": []})
    ck.commit(st, {0: frag0, 1: frag1})
    assert ck.exists() and names(ck) == {MANIFEST, "frag-0-v0.params", "frag-0-v0.momentum",
                                         "frag-1-v0.params", "frag-1-v0.momentum"}
    assert ck.read_state() == st
    p, m = ck.files(0, 0)
    assert p.read_bytes() == f32_bytes(frag0[0]) and m.read_bytes() == f32_bytes(frag0[1])
    for fid, (params, momentum) in ((0, frag0), (1, frag1)):
        lp, lm = ck.load_fragment(fid, 0, params.numel())
        assert torch.equal(lp, params) and torch.equal(lm, momentum)
    assert sha256_of(frag0[0]) == hashlib.sha256(f32_bytes(frag0[0])).hexdigest()


def test_a_commit_replaces_its_fragments_old_files_and_leaves_the_others(tmp_path):
    ck = CheckpointDir(tmp_path)
    ck.commit(state({0: 0, 1: 0}, step=0), {0: pair(0, 16), 1: pair(1, 16)})
    new0 = pair(2, 16)
    ck.commit(state({0: 1, 1: 0}, step=1), {0: new0})
    assert names(ck) == {MANIFEST, "frag-0-v1.params", "frag-0-v1.momentum", "frag-1-v0.params", "frag-1-v0.momentum"}
    assert ck.read_state().versions == {0: 1, 1: 0}
    assert torch.equal(ck.load_fragment(0, 1, 16)[0], new0[0])
    assert torch.equal(ck.load_fragment(1, 0, 16)[1], pair(1, 16)[1]), "fragment 1 was not part of the commit"
    # fragment 1's files are not fragment 10's: the prefix frag-1-v never matches frag-10-v
    ck.commit(state({0: 1, 1: 0, 10: 0}, step=2), {10: pair(3, 4)})
    ck.commit(state({0: 1, 1: 1, 10: 0}, step=3), {1: pair(4, 16)})
    assert {"frag-10-v0.params", "frag-10-v0.momentum", "frag-1-v1.params"} <= names(ck)
    assert "frag-1-v0.params" not in names(ck)


def test_what_a_crash_mid_commit_leaves_is_ignored_and_cleaned_by_the_next_commit(tmp_path):
    """The states a SIGKILL can leave, built on disk: v2's files written (one of them torn, still under its
    .tmp name) and a torn manifest .tmp never renamed. The old version reads back whole."""
    ck = CheckpointDir(tmp_path)
    v1 = pair(0, 64)
    ck.commit(state({0: 1}), {0: v1})
    p2, m2 = ck.files(0, 2)
    p2.write_bytes(f32_bytes(pair(9, 64)[0]))                                     # written, never referenced
    m2.with_suffix(m2.suffix + ".tmp").write_bytes(f32_bytes(pair(9, 64)[1])[:100])  # torn mid-write
    (tmp_path / (MANIFEST + ".tmp")).write_bytes(state({0: 2}, step=2).to_json()[:40])  # torn manifest
    assert ck.read_state() == state({0: 1})
    lp, lm = ck.load_fragment(0, 1, 64)
    assert torch.equal(lp, v1[0]) and torch.equal(lm, v1[1])
    # the commit that follows (a resumed syncer recommitting v2) leaves only what its manifest names
    v2 = pair(5, 64)
    ck.commit(state({0: 2}, step=2), {0: v2})
    assert names(ck) == {MANIFEST, "frag-0-v2.params", "frag-0-v2.momentum"}
    assert torch.equal(ck.load_fragment(0, 2, 64)[0], v2[0]) and ck.read_state().committed_step == 2


def test_session_record_round_trips_and_is_replaced_whole(tmp_path):
    ck = CheckpointDir(tmp_path / "new")
    ck.write_session({"run": "r1", "fragments": [{"id": 0}]})
    ck.write_session({"run": "r1", "fragments": [{"id": 0}, {"id": 1}]})
    assert ck.read_session() == {"run": "r1", "fragments": [{"id": 0}, {"id": 1}]}
    assert names(ck) == {"session.json"}, "no .tmp left behind"


def _manifest(tmp_path, text: bytes) -> CheckpointDir:
    (tmp_path / MANIFEST).write_bytes(text)
    return CheckpointDir(tmp_path)


@pytest.mark.parametrize("text, says", [
    (b'{"format": 1, "run": "r1", "session_fi', "is not a checkpoint manifest (JSONDecodeError"),
    (b"[1, 2]", "not a checkpoint manifest (no 'format' field in list)"),
    # a later release's state: refused naming both formats (schemas/versions.py)
    (orjson.dumps({"format": 3, "software": "yeto-nats 9.0.0"}),
     "the checkpoint manifest is state format 3 (written by yeto-nats 9.0.0), this syncer resumes formats 1..2"),
    (orjson.dumps({"format": 1, "run": "r1", "session_fingerprint": "s", "layout_fingerprint": "l",
                   "versions": {}}), "lacks the field 'committed_step'"),
    (orjson.dumps({"format": 1, "run": "r1", "session_fingerprint": "s", "layout_fingerprint": "l",
                   "committed_step": "three", "versions": {}}), "is not a checkpoint manifest (ValueError"),
])
def test_an_unusable_manifest_is_refused_naming_the_file(tmp_path, text, says):
    ck = _manifest(tmp_path, text)
    with pytest.raises(CheckpointError) as ei:
        ck.read_state()
    assert str(tmp_path / MANIFEST) in str(ei.value) and says in str(ei.value), ei.value


def test_missing_and_torn_files_are_refused_naming_them(tmp_path):
    ck = CheckpointDir(tmp_path)
    with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path} \\(missing {MANIFEST}\\)"):
        ck.read_state()
    with pytest.raises(CheckpointError, match="missing session.json"):
        ck.read_session()
    (tmp_path / "session.json").write_bytes(b'{"run": ')
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'session.json'} is not JSON"):
        ck.read_session()
    (tmp_path / "session.json").write_bytes(b'"r1"')
    with pytest.raises(CheckpointError, match="holds a str, not a session record"):
        ck.read_session()

    ck.commit(state({0: 3}), {0: pair(0, 32)})
    with pytest.raises(CheckpointError, match="lacks fragment 0 version 2 \\(frag-0-v2.params, frag-0-v2.momentum\\)"):
        ck.load_fragment(0, 2, 32)
    p, m = ck.files(0, 3)
    m.write_bytes(m.read_bytes()[:-4])  # a momentum file one value short (torn, or copied in part)
    with pytest.raises(CheckpointError, match=f"{m} holds 124 bytes, expected 128 \\(32 f32 values\\)"):
        ck.load_fragment(0, 3, 32)
    with pytest.raises(CheckpointError, match=f"{p} holds 128 bytes, expected 132"):
        ck.load_fragment(0, 3, 33)  # the session says another size: refused, never read short


def test_the_sparse_mode_writes_and_reads_params_alone(tmp_path):
    """docs/design.md §4.10: the sparse outer mode has no momentum, so a version is its params file alone; a
    commit's next version replaces it, and a missing params file is refused naming it."""
    ck = CheckpointDir(tmp_path)
    p0, p1 = pair(0, 32)[0], pair(1, 32)[0]
    ck.commit(state({0: 1}), {0: (p0, None)})
    assert names(ck) == {MANIFEST, "frag-0-v1.params"}
    assert ck.files(0, 1, momentum=False) == (tmp_path / "frag-0-v1.params",)
    got, mom = ck.load_fragment(0, 1, 32, momentum=False)
    assert mom is None and got.numpy().tobytes() == f32_bytes(p0)
    with pytest.raises(CheckpointError, match=r"lacks fragment 0 version 1 \(frag-0-v1.params, frag-0-v1.momentum\)"):
        ck.load_fragment(0, 1, 32)   # read as a dense run's: its momentum file is not there
    ck.commit(state({0: 2}, step=2), {0: (p1, None)})
    assert names(ck) == {MANIFEST, "frag-0-v2.params"}
    with pytest.raises(CheckpointError, match=r"lacks fragment 0 version 1 \(frag-0-v1.params\)$"):
        ck.load_fragment(0, 1, 32, momentum=False)
