"""What the ckpt KV holds of a fragment in the sparse outer mode with an f32 bulk (docs/design.md §4.10, §8):
a committed version V as a *chain* — the full f32 params of a base version B and the update messages
(schemas/sparse_update.py) of B+1..V, each with the version digest its result must hash to. Pure, no I/O.

Rules: a version is written full when BCAST sends it full (`sparse_bcast.sends_full`: 0 and every
`full_every`-th), when no update message was made for it (a commit without a merge, a bf16 or dense
run), or when the chain held does not end on the version before with that version's digest (a first
commit after a restart whose state store lags the directory); else as an update. So a chain holds at
most `full_every` versions. A reader needs every version of the chain (`Chain.versions`); what a save may
purge is what the old chain held and the new one does not (`purgeable`). Dense and bf16 runs never make a
chain of more than one version, and their manifests carry none (`to_manifest`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from yeto.schemas.sparse_bcast import sends_full


class ChainError(RuntimeError):
    """The ckpt KV's record of a chain is unusable; the message names the key and field."""


@dataclass(frozen=True)
class Chain:
    base: int                  # the version held as full params
    digests: tuple[str, ...]   # version digests of base..top
    sizes: tuple[int, ...]     # bytes of the update messages of base+1..top

    @property
    def top(self) -> int:
        return self.base + len(self.sizes)

    @property
    def versions(self) -> range:
        return range(self.base, self.top + 1)

    def digest(self, version: int) -> str:
        return self.digests[version - self.base]

    def size(self, version: int) -> int:
        return self.sizes[version - self.base - 1]

    def to_json(self) -> dict:
        return {"base": self.base, "digests": list(self.digests), "sizes": list(self.sizes)}


def full(version: int, digest: str) -> Chain:
    return Chain(version, (digest,), ())


def writes_update(prev: Chain | None, version: int, digest_before: str | None, *, has_update: bool,
                  full_every: int) -> bool:
    """Whether committed `version` is written as its update message (True) or as full params (False):
    see the module doc. `digest_before`: the version digest of version − 1 as committed."""
    return (has_update and version >= 1 and not sends_full(version, full_every) and prev is not None
            and prev.top == version - 1 and digest_before is not None and prev.digests[-1] == digest_before)


def extend(prev: Chain, version: int, digest: str, nbytes: int) -> Chain:
    if version != prev.top + 1:
        raise ValueError(f"version {version} does not follow the chain's top {prev.top}")
    return Chain(prev.base, prev.digests + (digest,), prev.sizes + (nbytes,))


def purgeable(old: Chain | None, new: Chain) -> list[int]:
    """The versions a save of `new` may purge: those `old` (the chain the last manifest named) held."""
    return [] if old is None else [v for v in old.versions if v not in new.versions]


def needed(chains: Mapping[int, Chain], versions: Mapping[int, int]) -> dict[int, set[int]]:
    """Per fragment the versions the manifest's state needs kept: its chain's, else the version alone."""
    return {f: set(chains[f].versions) if f in chains else {v} for f, v in versions.items()}


def to_manifest(chains: Mapping[int, Chain], versions: Mapping[int, int]) -> dict:
    """The manifest's `chains` object: the fragments whose committed version is held as a chain with
    updates (an empty dict: the key is left out, so a manifest without one is as before)."""
    return {str(f): c.to_json() for f, c in sorted(chains.items()) if c.sizes and versions.get(f) == c.top}


def from_manifest(doc: Mapping, versions: Mapping[int, int], digests: Mapping[int, str],
                  where: str) -> dict[int, Chain]:
    """The `chains` of a manifest doc checked against its state (`versions`, `digests`): ChainError
    naming `where` and the field. A fragment without one is held full at its version."""
    raw = doc.get("chains") or {}
    if not isinstance(raw, Mapping):
        raise ChainError(f"{where}: chains is a {type(raw).__name__}, not an object")
    out = {}
    for key, c in raw.items():
        field = f"{where}: chains.{key}"
        if not (isinstance(key, str) and key.isdigit() and int(key) in versions):
            raise ChainError(f"{field}: the manifest's state has no fragment {key!r}")
        fid = int(key)
        try:
            base, ds, sizes = c["base"], tuple(c["digests"]), tuple(c["sizes"])
        except (TypeError, KeyError) as exc:
            raise ChainError(f"{field} lacks {exc}") from None
        ints = [base, *sizes]
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in ints) or not sizes:
            raise ChainError(f"{field}: base {base!r} / sizes {list(sizes)!r} must be non-negative integers, "
                             f"at least one size")
        if len(ds) != len(sizes) + 1 or not all(isinstance(d, str) and len(d) == 64 for d in ds):
            raise ChainError(f"{field}: digests must be {len(sizes) + 1} sha256 hex strings, one per version "
                             f"{base}..{base + len(sizes)}")
        chain = Chain(base, ds, sizes)
        if chain.top != versions[fid] or ds[-1] != digests.get(fid):
            raise ChainError(f"{field}: ends at version {chain.top} digest {ds[-1][:12]}…, the state commits "
                             f"version {versions[fid]} digest {str(digests.get(fid))[:12]}…")
        out[fid] = chain
    return out


def apply(params, message, frag: Mapping, spec, digest: str, key: str) -> None:
    """One update of a chain applied in place on `params` (flat f32, the version before, exact) with the
    one `apply_step_` definition, kept only if the result hashes to `digest`: ChainError naming `key` (the
    update's KV keys) for bytes that do not decode or a result that does not hash (params then unchanged)."""
    from yeto.schemas.errors import WireError
    from yeto.schemas.sparse_bcast import apply_update_

    try:
        apply_update_(params, message, frag, spec, digest)
    except WireError as exc:   # DecodeError and DigestMismatch are WireErrors
        raise ChainError(f"the update {key} is refused: {exc}") from None
