"""Sparse broadcasts of the sparse outer mode (docs/design.md §4.10): which versions BCAST carries as update
messages, where their chunks live, what their headers say, and what an island does with one. Pure, no I/O.

A committed version v ≥ 1 of a sparse run whose bulk dtype is f32 goes out as the update message from v−1
(schemas/sparse_update.py) cut into byte chunks (schemas/chunks.byte_plan) on the fragment's update subjects
of slot v mod `full_every` (`update_subject`), every header saying `encoding` "sparse-update" and
`base_version` v−1, the last one sealed with the version digest of the full f32 params (a full cut's digest).
Full cuts stay on the chunk subjects: version 0, every `full_every`-th version, re-broadcasts, the final
cut; a bf16 run broadcasts full cuts only (its anchors hold rounded bytes an f32 step cannot reproduce).
Invariants: an island applies an update only on the anchor of exactly `base_version` and installs the
result only if it hashes to the seal; anything else (a joiner, a gap, a digest mismatch, a bad header) reads
a full cut (`plan`). A header breaking these rules is a WireError naming the field (`check_head`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from . import subjects as S
from .chunks import VersionDigest, byte_plan, check_digest
from .errors import WireError
from .messages import BcastChunk, cut_chunk
from .sparse_spec import SparseSpec
from .sparse_update import apply_step_, decode_update

ENCODING = "sparse-update"


def sends_full(version: int, full_every: int) -> bool:
    """Whether committed `version` also goes out as a full cut (version 0 and every `full_every`-th)."""
    return version == 0 or version % full_every == 0


def sends_update(version: int, bulk_dtype: str) -> bool:
    """Whether committed `version` goes out as an update message (every version after 0, f32 runs only)."""
    return version >= 1 and bulk_dtype == "f32"


def slot(version: int, full_every: int) -> int:
    """The update slot of `version`: BCAST keeps one message per subject, so the last `full_every` updates
    stay readable side by side (enough to reach the newest version from the last full cut)."""
    return version % full_every


def update_subject(run: str, fragment: int, slot_: int, chunk: int) -> str:
    """Chunk `chunk` of the update in slot `slot_` of `fragment`: on BCAST (`yeto.R.bcast.F.u<slot>-<chunk>`)
    beside the fragment's full-cut chunk subjects, which it never overwrites."""
    for name, v in (("fragment", fragment), ("slot", slot_), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise WireError("must be a non-negative integer", field=name, value=v)
    return f"{S.root(run)}.bcast.{fragment}.u{slot_}-{chunk}"


def parse_update_token(token: str) -> tuple[int, int] | None:
    """(slot, chunk) of an update subject's last token `u<slot>-<chunk>`, None for anything else."""
    if not token.startswith("u") or token.count("-") != 1:
        return None
    a, b = token[1:].split("-")
    if not (a.isdigit() and b.isdigit() and a.isascii() and b.isascii()):
        return None
    return int(a), int(b)


def update_msg_id(fragment: int, version: int, chunk: int, resend: int | None = None) -> str:
    """The Nats-Msg-Id of an update chunk (apart from the full cut's `bcast.F.V.C`; a re-issued version's
    chunks go under its resend id, as a full cut's)."""
    base = f"bcast.{fragment}.{version}.u{chunk}"
    return base if resend is None else f"{base}.r{resend}"


@dataclass(frozen=True)
class UpdateHead:
    """What an update chunk's header claims: the version it makes and the version it applies to."""

    version: int
    base_version: int


def check_head(meta: Mapping, *, sparse: bool, bulk_dtype: str) -> UpdateHead | None:
    """A BCAST chunk header (the decoded dict): None for a full-cut chunk, else its UpdateHead. WireError
    naming the field for an update where none can be (a dense run, a bf16 run), an unknown encoding, or a
    base that is not the version before (the codec checks that too; the reader trusts no header it did
    not check)."""
    enc = meta.get("encoding")
    if enc is None:
        if meta.get("base_version") is not None:
            raise WireError("belongs to an update chunk only (no encoding)", field="base_version",
                            value=meta.get("base_version"))
        return None
    if enc != ENCODING:
        raise WireError(f"a broadcast chunk is a full cut (no encoding) or {ENCODING!r}", field="encoding", value=enc)
    if not sparse:
        raise WireError("this run's outer mode is dense: its broadcasts are full cuts", field="encoding", value=enc)
    if bulk_dtype != "f32":
        raise WireError(f"a {bulk_dtype} run broadcasts full cuts only", field="encoding", value=enc)
    v, base = meta.get("version"), meta.get("base_version")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise WireError("an update makes a version >= 1", field="version", value=v)
    if isinstance(base, bool) or not isinstance(base, int) or base != v - 1:
        raise WireError(f"must be the version before ({v - 1}): an update is one step", field="base_version",
                        value=base)
    return UpdateHead(v, base)


def update_chunks(message, *, run: str, fragment: int, version: int, version_digest: str, chunk_bytes: int,
                  full_every: int, resend: int | None = None) -> list[tuple[str, str, memoryview, BcastChunk]]:
    """(subject, Nats-Msg-Id, payload, header) of every chunk of the update `message` that makes `version`
    from the one before: byte chunks of at most `chunk_bytes`, the last sealed with `version_digest` (the
    full f32 params' digest after the update), on the subjects of the version's slot."""
    buf = memoryview(message).cast("B")
    spans = byte_plan(buf.nbytes, chunk_bytes)
    out = []
    for s in spans:
        payload = buf[s.byte_offset: s.byte_offset + s.nbytes]
        meta = cut_chunk(spans, s.index, payload, run=run, fragment=fragment, version=version, dtype="f32",
                         version_digest=version_digest, base_version=version - 1)
        out.append((update_subject(run, fragment, slot(version, full_every), s.index),
                    update_msg_id(fragment, version, s.index, resend), payload, meta))
    return out


def apply_update(anchor: torch.Tensor, message, frag: Mapping, spec: SparseSpec, version_digest: str) -> torch.Tensor:
    """The fragment's next version from its anchor (flat f32, the base version's exact params; not modified)
    and one update `message`: a new flat f32 tensor, returned only if its bytes hash to `version_digest` (the
    seal; DigestMismatch naming `version_digest` otherwise). A malformed message is a DecodeError naming its
    field. `apply_step_` per tensor at its offset, the syncer's own subtraction, so the bits are its."""
    out = anchor.detach().to(torch.float32).contiguous().clone()
    apply_update_(out, message, frag, spec, version_digest)
    return out


def apply_update_(params: torch.Tensor, message, frag: Mapping, spec: SparseSpec, version_digest: str) -> None:
    """`apply_update` in place on `params` (flat contiguous f32: the base version's exact params), with no
    copy of the fragment: the values it moves are kept as it reads them (`apply_step_` returns them) and put
    back when the result does not hash to `version_digest` (DigestMismatch) or anything fails midway, so a
    refused update leaves `params` bit for bit as they were; a DecodeError comes before any change."""
    if params.dtype != torch.float32 or not params.is_contiguous() or params.dim() != 1:
        raise ValueError("apply_update_ needs flat contiguous float32 params")
    shapes = [tuple(t["shape"]) for t in frag["tensors"]]
    steps = decode_update(message, shapes, spec)
    moved = []   # (offset, indices, the values before): what puts `params` back
    try:
        for t, step in zip(frag["tensors"], steps, strict=True):
            off = int(t["offset"])
            moved.append((off, step.indices, apply_step_(params[off: off + int(t["numel"])], step)))
        check_digest(version_digest, VersionDigest().update(params).hexdigest(), field="version_digest")
    except BaseException:
        for off, idx, old in moved:
            params[off + idx] = old
        raise


def decide(held: int | None, head: UpdateHead) -> str:
    """What an island holding `held` (None: nothing yet) does with a sealed update: "old" (it holds that
    version or a newer one: ignore), "apply" (its anchor is the update's base: apply and check the digest),
    "full" (anything else: read a full cut instead)."""
    if held is not None and head.version <= held:
        return "old"
    if held is not None and held == head.base_version:
        return "apply"
    return "full"


def plan(held: int | None, newest: int, full_at: int | None, full_every: int) -> list[tuple[str, int]]:
    """How a reader holding `held` reaches `newest`: [("full", v) then ("update", v) ...] in order. BCAST
    keeps the updates of the last `full_every` versions (newest−full_every+1 .. newest) and one full cut
    (`full_at`: the version on the chunk subjects, None if none yet). Updates only when every one from
    `held`+1 is still kept; else the full cut, then the updates after it that are kept (a full cut older
    than that chain is read alone: the next full cut or update catches up). Never more than `full_every`
    − 1 updates after a full cut, and none when the full cut is the newest."""
    if held is not None and held >= newest:
        return []
    oldest_kept = max(1, newest - full_every + 1)
    if held is not None and held + 1 >= oldest_kept:
        return [("update", v) for v in range(held + 1, newest + 1)]
    if full_at is None or (held is not None and full_at <= held):
        return []   # nothing on the stream reaches further now: wait for the next full cut
    if full_at + 1 < oldest_kept:
        return [("full", full_at)]
    return [("full", full_at)] + [("update", v) for v in range(full_at + 1, newest + 1)]


__all__ = ["ENCODING", "UpdateHead", "check_head", "decide", "plan", "sends_full", "sends_update", "slot",
           "apply_update", "apply_update_", "parse_update_token", "update_chunks", "update_msg_id", "update_subject"]
