"""`yeto export`: write the current (or final) cut as a safetensors file with canonical names.

Reads the syncer's checkpoint directory (the source of truth for committed bytes) and streams one
tensor at a time into the file, so memory stays at one tensor, not the model.

A sharded run (`yeto syncer --shard K --shards N`) has one checkpoint directory per shard, each
naming only its own fragments' versions. `--checkpoint-dir` is then given once per shard, or once
for a parent directory whose sub-directories are the shards' (`yeto-data/<run>/` holding `syncer-s0`,
`syncer-s1`, ...). The directories must belong to the same run and session (session fingerprint) and
together name every fragment of the session exactly once; anything else is refused with an error
naming the fragment and the directories, because a file mixing two sessions, or one fragment's bytes
from two places, is not a cut of the model.

`--from jetstream` reads the same cut from the run's `ckpt` KV in JetStream instead (services/export_state_kv.py): no
checkpoint directory needed, so a run whose syncer host is gone can still be exported.
"""
from __future__ import annotations

import asyncio
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable

import orjson

# How often one directory's checkpoint may change under the export before it gives up (a running
# syncer commits every few seconds at most; 20 collisions in a row means something else is wrong).
OPEN_ATTEMPTS = 20


class ExportError(SystemExit):
    """The checkpoint directories (or the state KV) cannot make one cut; the message says which and why.
    Exit 2 for what the command line names wrongly, 1 for a state found incomplete or corrupt."""

    def __init__(self, text: str, exit_code: int = 2):
        super().__init__(f"yeto export: {text}")
        self.text = text
        self.exit_code = exit_code


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write the current or final cut of a run as safetensors (canonical names)")
    p.add_argument("--run", default=os.environ.get("YETO_RUN"), required="YETO_RUN" not in os.environ, help="run id (env YETO_RUN)")
    env = os.environ.get("YETO_CHECKPOINT_DIR")
    p.add_argument("--checkpoint-dir", action="append", default=None,
                   help="a syncer checkpoint directory, or a parent directory whose sub-directories are the "
                        "shards' checkpoint directories; repeat it once per shard of a sharded run (env "
                        "YETO_CHECKPOINT_DIR, one directory; default ./yeto-data/<run>/syncer when it exists, "
                        "else ./yeto-data/<run>)")
    p.set_defaults(env_checkpoint_dir=env)
    p.add_argument("--from", dest="source", choices=("dir", "jetstream"), default="dir",
                   help="where the committed cut is read: the syncer's checkpoint directories (default), or the "
                        "run's committed state in JetStream (`yeto syncer --state-store jetstream`, the default: no "
                        "directory needed; the syncer identity in a secured run)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    from yeto.schemas.conn import add_connect_args

    add_connect_args(p, run=False)
    p.set_defaults(func=run)


def _natural(path: Path) -> tuple:
    # syncer-s2 before syncer-s10
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name))


def resolve_dirs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The checkpoint directories named by `paths`: each is one itself (it holds checkpoint.json or
    session.json), or a parent whose sub-directories holding either are taken in natural order."""
    from yeto.services.syncer.checkpoint import MANIFEST

    def is_ckpt(d: Path) -> bool:
        return (d / MANIFEST).is_file() or (d / "session.json").is_file()

    out: list[Path] = []
    seen: set[str] = set()
    for raw in paths:
        p = Path(raw)
        if is_ckpt(p):
            found = [p]
        elif p.is_dir():
            found = sorted((d for d in p.iterdir() if d.is_dir() and is_ckpt(d)), key=_natural)
            if not found:
                raise ExportError(f"{p} is no checkpoint directory (no {MANIFEST}) and none of its sub-directories is one")
        else:
            raise ExportError(f"checkpoint directory {p} does not exist (without the syncer's directory, "
                              f"`--from jetstream --nats URL` reads the run's committed state from JetStream)")
        for d in found:
            key = os.path.realpath(d)
            if key not in seen:  # the same directory named twice (a path and its parent) is read once
                seen.add(key)
                out.append(d)
    if not out:
        raise ExportError("no checkpoint directory given")
    return out


@dataclass
class _Shard:
    path: Path | str   # a directory, or the state KV's label for a shard
    session: dict
    state: object  # services.syncer.checkpoint.CheckpointState
    files: dict  # fragment id -> open params file


def _open_consistent(path: Path) -> _Shard:
    """Read one directory's session and state and open its fragments' params files together.

    A running syncer deletes a fragment's older files right after each commit: open every file of one
    checkpoint state first (an open file survives its unlink), and start over if a commit got between."""
    from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointError

    ck = CheckpointDir(path)
    try:
        session = ck.read_session()
        for _ in range(OPEN_ATTEMPTS):
            state = ck.read_state()
            files: dict[int, IO[bytes]] = {}
            try:
                for fid, version in sorted(state.versions.items()):
                    files[fid] = _open_version(ck, session, state, fid, version)
                return _Shard(path, session, state, files)
            except FileNotFoundError:
                for fh in files.values():
                    fh.close()
            except CheckpointError:   # a chain's file pruned under us, or a corrupt one: which, the state says
                for fh in files.values():
                    fh.close()
                if ck.read_state() == state:
                    raise
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    raise ExportError(f"checkpoint {path} kept changing under the export; try again")


def _open_version(ck, session: dict, state, fid: int, version: int) -> IO[bytes]:
    """The version's params file, or (the sparse mode's chains, state_chain.py) its params rebuilt in
    memory from the chain's full version and updates, each checked against its digest."""
    import io

    import torch

    chain = state.chains.get(fid)
    if chain is None or chain.top != version or chain.top == chain.base:
        return open(ck.files(fid, version)[0], "rb")
    numel = next(int(f["numel"]) for f in session["fragments"] if f["id"] == fid)
    params, _ = ck.load_fragment(fid, version, numel, momentum=False, chain=chain)
    return io.BytesIO(memoryview(params.view(torch.uint8).numpy()).tobytes())


def _check_together(shards: list[_Shard], run: str | None) -> None:
    """Same run, same session, every fragment of the session exactly once (see the module doc)."""
    first = shards[0]
    for sh in shards:
        st = sh.state
        if run is not None and st.run != run:
            raise ExportError(f"checkpoint {sh.path} belongs to run {st.run!r}, not {run!r}")
        if st.run != first.state.run:
            raise ExportError(f"checkpoints {first.path} and {sh.path} belong to different runs "
                              f"({first.state.run!r}, {st.run!r})")
        fp = sh.session.get("session_fingerprint")
        if st.session_fingerprint != fp:
            raise ExportError(f"checkpoint {sh.path}: checkpoint.json is of session {st.session_fingerprint}, "
                              f"its session.json of {fp}")
        if fp != first.session.get("session_fingerprint"):
            raise ExportError(f"checkpoints {first.path} and {sh.path} belong to different sessions "
                              f"({first.session.get('session_fingerprint')}, {fp}) of run {st.run!r}")
    fragments = [f["id"] for f in first.session["fragments"]]
    holders: dict[int, list[_Shard]] = {f: [] for f in fragments}
    for sh in shards:
        for fid in sh.state.versions:
            if fid not in holders:
                raise ExportError(f"checkpoint {sh.path} names fragment {fid}, which the session (fragments "
                                  f"0..{len(fragments) - 1}) does not have")
            holders[fid].append(sh)
    for fid in fragments:
        if len(holders[fid]) > 1:
            where = ", ".join(f"{sh.path} (version {sh.state.versions[fid]})" for sh in holders[fid])
            raise ExportError(f"fragment {fid} is in more than one checkpoint directory: {where}; "
                              f"give each shard's directory once, and no other run's")
    missing = [fid for fid in fragments if not holders[fid]]
    if missing:
        names = ", ".join(str(sh.path) for sh in shards)
        raise ExportError(f"fragment{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                          f"{'are' if len(missing) > 1 else 'is'} in no checkpoint directory (read: {names}); "
                          f"a shard's directory is missing")


def export(ckpt_dir: str | os.PathLike | Iterable[str | os.PathLike], out: str | os.PathLike,
           run: str | None = None) -> dict:
    """Write the cut held by `ckpt_dir` (one directory, a parent of shard directories, or a list of
    either) to `out`; returns {"tensors", "bytes", "committed_step", "final", "dirs", "final_dirs"}."""
    paths = [ckpt_dir] if isinstance(ckpt_dir, (str, os.PathLike)) else list(ckpt_dir)
    dirs = resolve_dirs(paths)
    shards: list[_Shard] = []
    try:
        for d in dirs:
            shards.append(_open_consistent(d))
        _check_together(shards, run)
        return _write(shards, out)
    finally:
        for sh in shards:
            for fh in sh.files.values():
                fh.close()


def export_jetstream(opts, run: str, out: str | os.PathLike, progress=None) -> dict:
    """Write the cut kept in the run's ckpt KV to `out` (services/export_state_kv.py); same result as
    `export`, with "dirs" naming the state KV's shards."""
    import tempfile

    from yeto.services.export_state_kv import spool_state_kv

    parent = Path(out).resolve().parent
    with tempfile.TemporaryDirectory(dir=parent, prefix=".yeto-export-") as scratch:
        session, spooled = asyncio.run(spool_state_kv(opts, run, Path(scratch), attempts=OPEN_ATTEMPTS,
                                                      error=ExportError, progress=progress))
        shards = []
        try:
            for label, state, paths in spooled:
                shards.append(_Shard(label, session, state, {fid: open(p, "rb") for fid, p in paths.items()}))
            _check_together(shards, run)
            return _write(shards, out, source="jetstream")
        finally:
            for sh in shards:
                for fh in sh.files.values():
                    fh.close()


def _write(shards: list[_Shard], out: str | os.PathLike, source: str = "dir") -> dict:
    session = shards[0].session
    file_of = {fid: sh.files[fid] for sh in shards for fid in sh.files}
    versions = {fid: v for sh in shards for fid, v in sh.state.versions.items()}
    entries = []  # (name, shape, open fragment file, byte offset, nbytes)
    for f in session["fragments"]:
        for t in f["tensors"]:
            entries.append((t["name"], t["shape"], file_of[f["id"]], t["offset"] * 4, t["numel"] * 4))
    entries.sort(key=lambda e: e[0])
    header, pos = {}, 0
    for name, shape, _, _, nbytes in entries:
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    # Shards commit independently: the cut's step is the newest any of them committed, and it is the
    # final cut only when every shard's own final cut is in.
    committed_step = max(sh.state.committed_step for sh in shards)
    final = all(sh.state.final for sh in shards)
    meta = {"run": shards[0].state.run, "committed_step": str(committed_step), "final": str(final),
            "versions": orjson.dumps({str(k): v for k, v in sorted(versions.items())}).decode(),
            "session_fingerprint": session["session_fingerprint"]}
    if source != "dir":
        meta["source"] = source
    elif len(shards) > 1:
        meta["checkpoint_dirs"] = str(len(shards))
    header["__metadata__"] = meta
    hjson = orjson.dumps(header)
    hjson += b" " * (-len(hjson) % 8)  # align the data section
    tmp = Path(str(out) + ".tmp")
    try:
        with open(tmp, "wb") as w:
            w.write(struct.pack("<Q", len(hjson)))
            w.write(hjson)
            for _name, _shape, r, off, nbytes in entries:
                r.seek(off)
                data = r.read(nbytes)
                if len(data) != nbytes:  # a torn file: never write a short tensor
                    raise ExportError(f"{getattr(r, 'name', '?')} ends before byte {off + nbytes}")
                w.write(data)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"tensors": len(entries), "bytes": pos, "committed_step": committed_step, "final": final,
            "dirs": [str(sh.path) for sh in shards], "final_dirs": [str(sh.path) for sh in shards if sh.state.final]}


def default_dirs(run: str, base: str | os.PathLike = "yeto-data") -> list[Path]:
    """Without --checkpoint-dir: the unsharded syncer's directory when it exists, else the run's data
    directory, a parent of the shards' `syncer-s<K>` directories."""
    single = Path(base, run, "syncer")
    return [single] if single.exists() else [Path(base, run)]


def run(args) -> int:
    try:
        parent = Path(args.out).resolve().parent
        if not parent.is_dir():
            raise ExportError(f"--out {args.out}: directory {parent} does not exist")
        if getattr(args, "source", "dir") == "jetstream":
            if args.checkpoint_dir:
                raise ExportError("--checkpoint-dir and --from jetstream name two sources: give one")
            from yeto.schemas.conn import ConnectOptions
            from yeto.services.export_state_kv import say

            info = export_jetstream(ConnectOptions.from_args(args, name=f"yeto-export-{args.run}"), args.run,
                                    args.out, progress=say)
        else:
            paths = args.checkpoint_dir or ([args.env_checkpoint_dir] if getattr(args, "env_checkpoint_dir", None)
                                            else default_dirs(args.run))
            info = export(paths, args.out, args.run)
    except ExportError as exc:
        print(exc.code, file=sys.stderr)
        return exc.exit_code
    kind = "final" if info["final"] else "current"
    if getattr(args, "source", "dir") == "jetstream":
        where = f" from JetStream ({len(info['dirs'])} shard{'s' if len(info['dirs']) > 1 else ''})"
    else:
        where = f" from {len(info['dirs'])} checkpoint directories" if len(info["dirs"]) > 1 else ""
    print(f"exported the {kind} cut of run {args.run} (step {info['committed_step']}){where}: {info['tensors']} tensors, "
          f"{info['bytes'] / 2**20:.1f} MiB -> {args.out}")
    if not info["final"] and info["final_dirs"]:
        print(f"  (not final: only {', '.join(info['final_dirs'])} hold their final cut)", file=sys.stderr)
    return 0
