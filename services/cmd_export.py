"""`yeto export`: write the current (or final) cut as a safetensors file with canonical names.

Reads the syncer's checkpoint directory (the source of truth for committed bytes) and streams one
tensor at a time into the file, so memory stays at one tensor, not the model.
"""
from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

import orjson


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write the current or final cut of a run as safetensors (canonical names)")
    p.add_argument("--run", default=os.environ.get("YETO_RUN"), required="YETO_RUN" not in os.environ, help="run id (env YETO_RUN)")
    p.add_argument("--checkpoint-dir", default=os.environ.get("YETO_CHECKPOINT_DIR"),
                   help="the syncer's checkpoint directory (env YETO_CHECKPOINT_DIR; default ./yeto-data/<run>/syncer)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.set_defaults(func=run)


def export(ckpt_dir: str | os.PathLike, out: str | os.PathLike, run: str | None = None) -> dict:
    from services.syncer.checkpoint import CheckpointDir

    ck = CheckpointDir(ckpt_dir)
    session = ck.read_session()
    # A running syncer deletes a fragment's older files right after each commit: open every file of one
    # checkpoint state first (an open file survives its unlink), and start over if a commit got between.
    for _ in range(20):
        state = ck.read_state()
        if run is not None and state.run != run:
            raise SystemExit(f"yeto export: checkpoint {ckpt_dir} belongs to run {state.run!r}, not {run!r}")
        files = {}
        try:
            for f in session["fragments"]:
                files[f["id"]] = open(ck.files(f["id"], state.versions[f["id"]])[0], "rb")
            break
        except FileNotFoundError:
            for fh in files.values():
                fh.close()
    else:
        raise SystemExit(f"yeto export: checkpoint {ckpt_dir} kept changing under the export; try again")
    entries = []  # (name, shape, open fragment file, byte offset, nbytes)
    for f in session["fragments"]:
        for t in f["tensors"]:
            entries.append((t["name"], t["shape"], files[f["id"]], t["offset"] * 4, t["numel"] * 4))
    entries.sort(key=lambda e: e[0])
    header, pos = {}, 0
    for name, shape, _, _, nbytes in entries:
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    header["__metadata__"] = {"run": state.run, "committed_step": str(state.committed_step), "final": str(state.final),
                              "versions": orjson.dumps({str(k): v for k, v in state.versions.items()}).decode(),
                              "session_fingerprint": session["session_fingerprint"]}
    hjson = orjson.dumps(header)
    hjson += b" " * (-len(hjson) % 8)  # align the data section
    tmp = Path(str(out) + ".tmp")
    try:
        with open(tmp, "wb") as w:
            w.write(struct.pack("<Q", len(hjson)))
            w.write(hjson)
            for name, shape, r, off, nbytes in entries:
                r.seek(off)
                w.write(r.read(nbytes))
    finally:
        for fh in files.values():
            fh.close()
    os.replace(tmp, out)
    return {"tensors": len(entries), "bytes": pos, "committed_step": state.committed_step, "final": state.final}


def run(args) -> int:
    ckpt = args.checkpoint_dir or os.path.join("yeto-data", args.run, "syncer")
    info = export(ckpt, args.out, args.run)
    kind = "final" if info["final"] else "current"
    print(f"exported the {kind} cut of run {args.run} (step {info['committed_step']}): {info['tensors']} tensors, "
          f"{info['bytes'] / 2**20:.1f} MiB -> {args.out}")
    return 0
