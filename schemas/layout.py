"""Fragment layout and fingerprints (docs/design.md §3.7) — pure, deterministic.

A session splits the canonical layout (the named tensors every island agrees on) into P fragments:

* embedding-like tensors (names containing embed, wte, wpe, lm_head, output_layer) get a fragment of
  their own: they are large, touched by every token, and syncing them alone keeps the other
  fragments' sizes comparable;
* the rest are strided by layer index (layer i -> fragment i mod Q) so each fragment holds a slice of
  the depth, then tensors without a layer index are bin-packed (largest first into the lightest
  fragment); ties are broken by name so every process computes the same assignment.

Offsets inside a fragment are element offsets; a fragment's bytes on the wire are its tensors' values
concatenated in fragment order, in the wire dtype.
"""
from __future__ import annotations

import hashlib
import math
import re
from typing import Iterable, Sequence

import orjson

from .dtypes import BULK_DTYPES, PUSH_DTYPES
from .errors import ConfigError, WireError

EMBED_MARKERS = ("embed", "wte", "wpe", "lm_head", "output_layer")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_NUM_RE = re.compile(r"(\d+)")

TENSOR_DTYPES = ("float32", "bfloat16", "float16")


def natural_key(name: str) -> tuple:
    """Sort key that orders layers.2 before layers.10."""
    return tuple(int(p) if p.isdigit() else p for p in _NUM_RE.split(name))


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def is_embedding(name: str) -> bool:
    low = name.lower()
    return any(marker in low for marker in EMBED_MARKERS)


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def canonical_layout(layout: Iterable[dict]) -> list[dict]:
    """Return the layout in canonical order (natural sort by name) with normalized entries.

    Raises WireError on a duplicate name, a negative dimension or an unknown dtype.
    """
    out: list[dict] = []
    seen: set[str] = set()
    for i, entry in enumerate(layout):
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise WireError("tensor name must be a non-empty string", field=f"layout.{i}.name", value=name)
        if name in seen:
            raise WireError("duplicate tensor name in layout", field=f"layout.{i}.name", value=name)
        seen.add(name)
        shape = entry.get("shape")
        if not isinstance(shape, (list, tuple)) or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape
        ):
            raise WireError("shape must be a list of non-negative integers", field=f"layout.{i}.shape", value=shape)
        dtype = entry.get("dtype", "float32")
        if dtype not in TENSOR_DTYPES:
            raise WireError(f"dtype must be one of {TENSOR_DTYPES}", field=f"layout.{i}.dtype", value=dtype)
        out.append({"name": name, "shape": [int(s) for s in shape], "dtype": dtype})
    out.sort(key=lambda e: natural_key(e["name"]))
    return out


def _sha256_json(obj) -> str:
    return hashlib.sha256(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()


def layout_fingerprint(layout: Iterable[dict]) -> str:
    """sha256 over names, shapes, dtypes in canonical order."""
    canon = canonical_layout(layout)
    return _sha256_json([[e["name"], e["shape"], e["dtype"]] for e in canon])


def assign_fragments(layout: Iterable[dict], fragments: int) -> list[list[dict]]:
    """Split a layout into `fragments` non-empty lists of tensors (each in canonical order)."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ConfigError("must be a positive integer", field="fragments", value=fragments)
    canon = [e for e in canonical_layout(layout) if numel(e["shape"]) > 0]
    if len(canon) < fragments:
        raise WireError(
            f"the model has {len(canon)} non-empty tensors and a fragment holds whole tensors: it cannot be split "
            f"into {fragments} fragments (give the syncer --fragments / YETO_FRAGMENTS <= {len(canon)})",
            field="fragments", value=fragments)
    bins: list[list[dict]] = [[] for _ in range(fragments)]
    embeds = [e for e in canon if is_embedding(e["name"])]
    rest = [e for e in canon if not is_embedding(e["name"])]
    if fragments == 1:
        bins[0] = list(canon)
        return bins
    if embeds and rest:
        bins[0] = embeds
        body = list(range(1, fragments))
    else:
        body = list(range(fragments))
        rest = canon
    sizes = {b: 0 for b in body}
    loose: list[dict] = []
    for e in rest:
        li = layer_index(e["name"])
        if li is None:
            loose.append(e)
            continue
        b = body[li % len(body)]
        bins[b].append(e)
        sizes[b] += numel(e["shape"])
    # If striding left a fragment empty (fewer layers than fragments), bin-pack everything instead.
    if any(not bins[b] for b in body) and len(rest) >= len(body):
        for b in body:
            bins[b] = []
            sizes[b] = 0
        loose = list(rest)
    for e in sorted(loose, key=lambda e: (-numel(e["shape"]), natural_key(e["name"]))):
        b = min(body, key=lambda b: (sizes[b], b))
        bins[b].append(e)
        sizes[b] += numel(e["shape"])
    for b in range(fragments):
        if not bins[b]:
            raise WireError("a fragment would be empty; use fewer fragments", field="fragments", value=fragments)
        bins[b].sort(key=lambda e: natural_key(e["name"]))
    return bins


def build_fragments(layout: Iterable[dict], fragments: int) -> list[dict]:
    out = []
    for fid, tensors in enumerate(assign_fragments(layout, fragments)):
        offset = 0
        entries = []
        for e in tensors:
            n = numel(e["shape"])
            entries.append({"name": e["name"], "shape": e["shape"], "offset": offset, "numel": n})
            offset += n
        out.append({"id": fid, "tensors": entries, "numel": offset})
    return out


def session_fingerprint(layout_fp: str, fragments: list[dict], push_dtype: str, bulk_dtype: str, chunk_bytes: int) -> str:
    assignment = [[f["id"], [t["name"] for t in f["tensors"]]] for f in fragments]
    return _sha256_json([layout_fp, assignment, push_dtype, bulk_dtype, chunk_bytes])


def build_session(
    layout: Iterable[dict],
    fragments: int,
    *,
    run: str,
    push_dtype: str,
    bulk_dtype: str,
    chunk_bytes: int,
    init_island: str,
    sync_every: int,
    created: float = 0.0,
    protocol_version: int = 1,
) -> dict:
    """The session record the syncer writes to the `state` KV (key `session`)."""
    if push_dtype not in PUSH_DTYPES:
        raise ConfigError(f"must be one of {PUSH_DTYPES}", field="push_dtype", value=push_dtype)
    if bulk_dtype not in BULK_DTYPES:
        raise ConfigError(f"must be one of {BULK_DTYPES}", field="bulk_dtype", value=bulk_dtype)
    layout = list(layout)
    lfp = layout_fingerprint(layout)
    frags = build_fragments(layout, fragments)
    return {
        "v": protocol_version,
        "run": run,
        "fragments": frags,
        "layout_fingerprint": lfp,
        "session_fingerprint": session_fingerprint(lfp, frags, push_dtype, bulk_dtype, chunk_bytes),
        "push_dtype": push_dtype,
        "bulk_dtype": bulk_dtype,
        "chunk_bytes": chunk_bytes,
        "init_island": init_island,
        "sync_every": sync_every,
        "created": created,
    }
