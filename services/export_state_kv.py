"""`yeto export --from jetstream`: the committed cut read from JetStream, for when the syncer's host and its
checkpoint directory are gone (docs/design.md §11).

Owns: reading every shard's `ckpt.<K>.manifest` and its versions' chunks (`ckpt.<K>.f<F>.v<N>.p.<k>`,
written by services/syncer/state_store.py; only the syncer identity may read them) into files of a scratch
directory, one chunk in memory at a time, then handing them to the directory export's writer, so both
exports write the same file for the same cut. May touch: the run's `ckpt` and `state` KV, read only.
A version the sparse mode keeps as updates (state_chain.py: the manifest's `chains`) is spooled as its chain's
full version with the updates after it applied, each checked against its digest.
Invariants: the spooled bytes match the version digest the manifest recorded (with a bf16 bulk dtype that
covers the bf16 rounding only) and, once the run is finished, the f32 digest of the final manifest (every
bit). A chunk missing under a manifest that has since moved on (a running syncer purges older chunks once
the next manifest lands) starts the read over; one missing under a manifest that has not moved is an
incomplete state KV, refused naming the key.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson

from yeto.schemas import subjects as S
from yeto.schemas.stream_configs import kv_stream_name

ELEM = 4   # f32


class _Moved(Exception):
    """A chunk the manifest named was purged by a newer commit: read again from the new manifest."""


async def spool_state_kv(opts, run: str, scratch: Path, *, attempts: int, error, progress=None):
    """(session, [(label, CheckpointState, {fragment: spooled params file})]) for every shard of `run`.
    `error(text, code)` builds the exception to raise (the caller's ExportError)."""
    from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

    from yeto.schemas.chunks import VersionDigest, chunk_plan
    from yeto.schemas.conn import connect, redact
    from yeto.services.syncer import state_chain as SC
    from yeto.services.syncer.checkpoint import CheckpointError, CheckpointState

    nc = await connect(opts)
    try:
        js = nc.jetstream(timeout=10)
        bucket = S.kv_bucket(run, "ckpt")
        try:
            state_kv = await js.key_value(S.kv_bucket(run, "state"))
            kv = await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            raise error(f"run {run} has no state KV ({S.kv_bucket(run, 'state')}, {bucket}) at {redact(opts.url)}: it "
                        f"was never provisioned there, or it was removed", 2) from None

        async def get(key: str, kv=kv) -> tuple[bytes | None, int]:
            try:
                e = await kv.get(key)
            except KeyNotFoundError:
                return None, 0
            return (e.value or None), e.revision or 0

        raw, _ = await get("session", state_kv)
        if raw is None:
            raise error(f"run {run}: its state KV holds no session (no island has started it yet)", 2)
        session = orjson.loads(raw)
        final_digests: dict[int, tuple[int, str]] = {}   # fragment -> (final version, its f32 digest)
        raw, _ = await get("final", state_kv)
        if raw is not None:
            from yeto.schemas import codec

            try:
                fin = codec.decode("manifest", raw)
            except Exception as exc:  # noqa: BLE001 - any decode failure: the record is not one
                raise error(f"run {run}: state KV final is not a final manifest: {exc}", 1) from None
            final_digests = {int(f): (int(v), fin["version_digests"][f]) for f, v in fin["versions"].items()
                             if f in fin.get("version_digests", {})}
        numels = {int(f["id"]): int(f["numel"]) for f in session["fragments"]}
        for _attempt in range(attempts):
            info = await js.stream_info(kv_stream_name(bucket), subjects_filter=S.kv_key(run, "ckpt", "ckpt.*.manifest"))
            shard_ids = sorted(int(subj.split(".")[-2]) for subj in (info.state.subjects or {}))
            if not shard_ids:
                raise error(f"run {run}: its ckpt KV holds no committed state (no ckpt.<K>.manifest): the syncer ran "
                            f"with --state-store local, or has committed nothing yet; export from its --checkpoint-dir", 2)
            out = []
            try:
                for k in shard_ids:
                    mkey = f"ckpt.{k}.manifest"
                    raw, rev = await get(mkey)
                    if raw is None:
                        raise _Moved(mkey)
                    doc = orjson.loads(raw)
                    try:
                        state = CheckpointState.from_json(orjson.dumps(doc["state"]))
                    except (CheckpointError, KeyError, ValueError) as exc:
                        raise error(f"run {run}: ckpt KV {mkey} is not a checkpoint manifest: {exc}", 1) from None
                    elems = int(doc["chunk_elems"])
                    try:
                        chains = SC.from_manifest(doc, state.versions, state.version_digests, f"ckpt KV {mkey}")
                    except SC.ChainError as exc:
                        raise error(f"run {run}: {exc}", 1) from None
                    files = {}
                    for fid, v in sorted(state.versions.items()):
                        if fid not in numels:
                            raise error(f"run {run}: ckpt KV {mkey} names fragment {fid}, which the session "
                                        f"(fragments 0..{len(numels) - 1}) does not have", 1)
                        n = numels[fid]
                        path = scratch / f"s{k}-f{fid}-v{v}.f32"
                        base = chains[fid].base if fid in chains else v   # a chain: its full version, then updates
                        with open(path, "wb") as w:
                            for c, off in enumerate(range(0, n, elems)):
                                w.write(await _kv_chunk(get, f"ckpt.{k}.f{fid}.v{base}.p.{c}", min(elems, n - off) * ELEM,
                                                     mkey, rev, run, error,
                                                     f"the committed state of fragment {fid} version {v}"))
                        if fid in chains:
                            await _apply_chain(path, chains[fid], session, fid, n, elems, k, get, mkey, rev, run, error)
                        want_digest = state.version_digests.get(fid)
                        if want_digest is not None:
                            got = await asyncio.to_thread(_digest, path, n, session, VersionDigest, chunk_plan)
                            if got != want_digest:
                                raise error(f"run {run}: fragment {fid} version {v} read from the ckpt KV has digest "
                                            f"{got[:12]}…, its manifest {mkey} recorded {want_digest[:12]}…: corrupt "
                                            f"state", 1)
                        fv = final_digests.get(fid)
                        # with an f32 bulk dtype the version digest just checked is this f32 digest: one pass
                        f32_checked = want_digest is not None and session["bulk_dtype"] == "f32" and fv is not None \
                            and fv[1] == want_digest
                        if fv is not None and fv[0] == v and not f32_checked:
                            got = await asyncio.to_thread(_f32_digest, path, VersionDigest)
                            if got != fv[1]:
                                raise error(f"run {run}: fragment {fid} version {v} read from the ckpt KV has f32 "
                                            f"digest {got[:12]}…, the final manifest recorded {fv[1][:12]}…: corrupt "
                                            f"state", 1)
                        files[fid] = path
                        if progress is not None:
                            progress(f"fragment {fid} version {v}: {n * ELEM / 2**20:.1f} MiB from the ckpt KV "
                                     f"(shard {k}), digest checked")
                    out.append((f"ckpt KV ckpt.{k}", state, files))
                return session, out
            except _Moved:
                for _label, _state, files in out:
                    for p in files.values():
                        Path(p).unlink(missing_ok=True)
                continue
        raise error(f"run {run}: its committed state kept changing under the export ({attempts} tries); try again", 1)
    finally:
        await nc.close()


async def _kv_chunk(get, key: str, want: int, mkey: str, rev: int, run: str, error, what: str) -> bytes:
    """One chunk of the ckpt KV, `want` bytes. Missing: `_Moved` when the manifest moved on since it was read
    (the caller reads again), else an error naming the key; another length: an error naming the key."""
    data, _ = await get(key)
    if data is None:
        _, now_rev = await get(mkey)
        if now_rev != rev:
            raise _Moved(key)
        raise error(f"run {run}: ckpt KV {key} is missing under an unchanged {mkey}: {what} is incomplete", 1)
    if len(data) != want:
        raise error(f"run {run}: ckpt KV {key} holds {len(data)} bytes, not {want}: {what} is corrupt", 1)
    return data


async def _apply_chain(path: Path, chain, session: dict, fid: int, n: int, elems: int, shard: int, get, mkey: str,
                       rev: int, run: str, error) -> None:
    """The spooled full version of `chain` turned into its top version: every update after it fetched
    (`ckpt.<K>.f<F>.v<N>.u.<k>`) and applied with `apply_step_`, each result checked against its digest
    (state_chain.py); the fragment is held whole in memory for this."""
    import torch

    from yeto.schemas import outer_mode as OM
    from yeto.services.syncer import state_chain as SC
    from yeto.services.syncer.checkpoint import sha256_of

    t = torch.from_file(str(path), shared=False, size=n, dtype=torch.float32).clone()
    if await asyncio.to_thread(sha256_of, t) != chain.digest(chain.base):
        raise error(f"run {run}: ckpt KV ckpt.{shard}.f{fid}.v{chain.base}.p.* do not hash to the digest {mkey}'s "
                    f"chain recorded for version {chain.base}: corrupt state", 1)
    frag = next(f for f in session["fragments"] if f["id"] == fid)
    spec = OM.from_session(session).spec
    step = elems * ELEM
    for u in range(chain.base + 1, chain.top + 1):
        msg = bytearray()
        for c, off in enumerate(range(0, max(1, chain.size(u)), step)):
            msg += await _kv_chunk(get, f"ckpt.{shard}.f{fid}.v{u}.u.{c}", min(step, chain.size(u) - off), mkey, rev,
                                run, error, f"the update making fragment {fid} version {u}")
        try:
            await asyncio.to_thread(SC.apply, t, bytes(msg), frag, spec, chain.digest(u), f"ckpt.{shard}.f{fid}.v{u}.u.*")
        except SC.ChainError as exc:
            raise error(f"run {run}: {exc}", 1) from None
    with open(path, "wb") as w:
        w.write(memoryview(t.view(torch.uint8).numpy()))


def _digest(path: Path, numel: int, session: dict, VersionDigest, chunk_plan) -> str:
    """The version digest of a spooled fragment, computed as the syncer does (services/syncer/cut.py
    `bulk_digest`: sha256 over the params packed in the session's bulk dtype, in its chunk plan)."""
    import torch

    from yeto.schemas.dtypes import pack

    h = VersionDigest()
    dtype = session["bulk_dtype"]
    with open(path, "rb") as r:
        for s in chunk_plan(numel, dtype, session["chunk_bytes"]):
            r.seek(s.elem_offset * ELEM)
            t = torch.frombuffer(bytearray(r.read(s.elem_count * ELEM)), dtype=torch.float32)
            h.update(pack(t, dtype))
    return h.hexdigest()


def _f32_digest(path: Path, VersionDigest) -> str:
    h = VersionDigest()
    with open(path, "rb") as r:
        while block := r.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)
