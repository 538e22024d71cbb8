"""Per-fragment sync state and the boundary's math (DESIGN §3, §5) — pure: torch tensors, no I/O.

`SyncState` holds, per fragment of the session, the version the island holds, that version's digest,
the *anchor* (the raw global value of that version, flat float32 in the fragment's layout order), the
inner-step and token counters since the anchor was installed, and the q4 error-feedback residual.

The boundary does, per fragment (see DESIGN §5 "Boundary order"):

1. `BcastAssembly.add(meta, payload)` for every broadcast chunk fetched; it returns a `Completed`
   version once it holds every chunk of one version.
2. `SyncState.apply(fid, version, digest, values, local)`: the first version overwrites the local
   values; later ones blend θ = α·θ_local + (1 − α)·Θ; the anchor becomes Θ and the counters reset.
   The shell writes the returned tensor into the model (`scatter_fragment`) and tells the pull book
   (`PullBook.committed`).
3. For a pull to answer: `delta(fid, local)` = local − anchor, packed in the session's push dtype
   (q4 with `push_residual` / `keep_residual`).

Memory: one anchor per fragment (f32, the fragment's size) — an island holds a full f32 copy of the
synced parameters besides its own. Multi-rank islands will later keep only their own slices of each
anchor (DESIGN §6 per-rank scatter); this module is written for a single-process island (or rank 0 of
a data-parallel one, where every rank holds the whole replica).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from schemas.chunks import Assembler, ChunkDuplicate, check_digest, version_digest
from schemas.dtypes import packed_nbytes
from schemas.errors import WireError

BULK_DTYPES = ("f32", "bf16")


class ProtocolError(WireError):
    """The syncer broke an invariant the island relies on (e.g. one version number with two different
    contents). Fatal: the island stops rather than train on weights it cannot trust."""

    code = "protocol"


def _check_count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError("must be a non-negative integer", field=field, value=value)
    return value


def _flat_f32(t: Any, numel: int, field: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
        raise WireError("expected a 1-D float32 tensor", field=field,
                        value=(getattr(t, "dtype", type(t).__name__), tuple(getattr(t, "shape", ()))))
    if t.numel() != numel:
        raise WireError(f"expected {numel} values (the fragment's size)", field=field, value=t.numel())
    return t


def _session_numels(session: Mapping) -> dict[int, int]:
    frags = session.get("fragments")
    if not isinstance(frags, list) or not frags:
        raise WireError("session must list its fragments", field="fragments", value=frags)
    out = {}
    for i, f in enumerate(frags):
        fid, n = f.get("id"), f.get("numel")
        if isinstance(fid, bool) or not isinstance(fid, int) or fid in out:
            raise WireError("fragment id must be a unique integer", field=f"fragments.{i}.id", value=fid)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise WireError("fragment numel must be a positive integer", field=f"fragments.{i}.numel", value=n)
        out[fid] = n
    return out


# ---- per-fragment state ---------------------------------------------------------------------------

@dataclass
class FragmentState:
    fid: int
    numel: int
    version: int | None = None  # None until the first version is installed
    digest: str | None = None  # version digest (sha256 of the bulk-dtype bytes) of `version`
    anchor: torch.Tensor | None = None  # raw global value of `version`, flat f32, layout order
    c_steps: int = 0  # inner steps since the anchor was installed
    c_tokens: int = 0  # tokens trained since the anchor was installed (the push's merge weight)
    residual: torch.Tensor | None = None  # q4 error feedback, flat f32, created on the first q4 push

    @property
    def steps_since_reset(self) -> int:
        # The push counter and the readiness counter count the same thing: steps since the anchor.
        return self.c_steps


class SyncState:
    """The island's view of every fragment of the session (see the module docstring)."""

    def __init__(self, session: Mapping, island: str, gen: str, alpha: float):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise WireError("alpha must be a number in [0, 1]", field="alpha", value=alpha)
        self.island = island
        self.gen = gen
        self.alpha = float(alpha)
        self.states: dict[int, FragmentState] = {fid: FragmentState(fid, n) for fid, n in _session_numels(session).items()}

    def _state(self, fid: int) -> FragmentState:
        st = self.states.get(fid)
        if st is None:
            raise WireError(f"no such fragment in the session (ids {sorted(self.states)})", field="fragment", value=fid)
        return st

    # ---- versions -------------------------------------------------------------------------------

    def accept_version(self, fid: int, version: int, digest: str) -> str:
        """Classify a complete broadcast version without changing state: "new" (newer than the one
        held, or the first), "same" (the version held, same digest), "old" (older: ignored).
        Raises ProtocolError for the version held with another digest."""
        st = self._state(fid)
        _check_count(version, "version")
        if st.version is None or version > st.version:
            return "new"
        if version < st.version:
            return "old"
        if digest != st.digest:
            raise ProtocolError(f"fragment {fid} version {version} arrived with digest {st.digest} before",
                                field="version_digest", value=digest)
        return "same"

    def needs_local(self, fid: int) -> bool:
        """Whether `apply` of the next version blends, and so needs the island's local values."""
        return self._state(fid).version is not None

    def apply(self, fid: int, version: int, digest: str, global_values: torch.Tensor,
              local: torch.Tensor | None = None) -> torch.Tensor | None:
        """Install a complete version. Returns the values to write into the model, or None when the
        version is not new ("same" or "old", nothing changes).

        * first version of the fragment: returns `global_values` itself (overwrite, no blend; there
          is no anchor to blend against) — `local` is not needed;
        * later versions: blends into `local` *in place*, θ = α·θ_local + (1 − α)·Θ, and returns it.

        Either way the anchor becomes `global_values` (the raw value, not the blend): the state keeps
        that tensor without copying, so the caller hands it over and must not modify it, nor the
        returned tensor in the overwrite case. Counters reset; the q4 residual is kept (it is error
        the syncer has not yet received, whatever the anchor).
        """
        st = self._state(fid)
        kind = self.accept_version(fid, version, digest)
        if kind != "new":
            return None
        glob = _flat_f32(global_values, st.numel, "global_values")
        if st.version is None:
            out = glob
        else:
            if local is None:
                raise WireError(f"fragment {fid} holds version {st.version}: blending needs the local values",
                                field="local", value=None)
            out = _flat_f32(local, st.numel, "local")
            out.mul_(self.alpha).add_(glob, alpha=1.0 - self.alpha)
        st.version, st.digest, st.anchor = version, digest, glob
        st.c_steps = st.c_tokens = 0
        return out

    # ---- steps and pushes -----------------------------------------------------------------------

    def note_step(self, tokens: int) -> None:
        """One inner step of `tokens` tokens completed: every fragment's counters grow."""
        _check_count(tokens, "tokens")
        for st in self.states.values():
            st.c_steps += 1
            st.c_tokens += tokens

    def ready(self, fid: int) -> bool:
        """A pull of this fragment can be answered: it has an anchor and a local step since."""
        st = self.states.get(fid)
        return st is not None and st.anchor is not None and st.c_steps >= 1

    def delta(self, fid: int, local: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """d = local − anchor (flat f32). With `inplace` the subtraction overwrites `local` (a gathered
        copy the caller no longer needs), saving one fragment-sized buffer."""
        st = self._state(fid)
        if st.anchor is None:
            raise RuntimeError(f"fragment {fid} has no anchor yet: a pull for it is not ready")
        loc = _flat_f32(local, st.numel, "local")
        return loc.sub_(st.anchor) if inplace else loc - st.anchor

    def push_residual(self, fid: int) -> torch.Tensor:
        """A working copy of the q4 residual (zeros before the first q4 push) for `pack_stream` to
        update in place. Keep it with `keep_residual` only once the push is acknowledged: a failed
        try is recomputed, and must start again from the residual the syncer's view matches."""
        st = self._state(fid)
        if st.residual is None:
            return torch.zeros(st.numel, dtype=torch.float32)
        return st.residual.clone()

    def keep_residual(self, fid: int, residual: torch.Tensor) -> None:
        st = self._state(fid)
        st.residual = _flat_f32(residual, st.numel, "residual")

    # ---- queries --------------------------------------------------------------------------------

    def versions(self) -> dict[str, int]:
        """{fragment id (as a string, for JSON): version held} for the step log; unversioned ones absent."""
        return {str(fid): st.version for fid, st in sorted(self.states.items()) if st.version is not None}

    def version(self, fid: int) -> int | None:
        return self._state(fid).version


# ---- broadcast assembly ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Completed:
    """One whole version of a fragment, decoded to flat float32 (layout order)."""

    fragment: int
    version: int
    version_digest: str
    values: torch.Tensor


@dataclass
class _Partial:
    version: int
    version_digest: str
    assembler: Assembler  # holds the bulk-dtype bytes


def _decode(buf: torch.Tensor, dtype: str) -> torch.Tensor:
    # `buf` is the Assembler's own freshly allocated byte buffer, so the f32 case can reuse it.
    if dtype == "f32":
        return buf.view(torch.float32)
    return buf.view(torch.bfloat16).to(torch.float32)


class BcastAssembly:
    """Assembles broadcast (or final) chunks per fragment, version by version.

    BCAST keeps one message per chunk subject, so a reader may see chunks of versions v and v+1 side
    by side. Rules:

    * a chunk of a version older than, or equal to, the newest version this assembly completed is
      ignored (equal with another `version_digest` raises ProtocolError: one version, two contents);
    * one partial version per fragment: a chunk of a newer version than the partial one drops the
      partial (its missing chunks were overwritten on the stream by the newer version and will never
      come; the newer version is what the island wants anyway); a chunk of an older version than the
      partial one is ignored;
    * a version completes only when every chunk of that one version is in; its bytes must hash to
      the `version_digest` the chunks carry (DigestMismatch otherwise, and the partial is dropped).

    Chunk framing, per-chunk digests, overlaps and duplicates are checked by `schemas.chunks.Assembler`;
    a repeated identical chunk (a redelivery) is ignored, other chunk errors propagate (ChunkError)
    and leave the state as it was.

    Memory trade-off: a partial version is buffered whole, in the bulk dtype (2 or 4 bytes per
    value), and decoded to f32 once complete — so a fragment costs its wire size while arriving plus
    its f32 size when handed over. Applying chunk by chunk would avoid the buffer but then a version
    would be half-applied while incomplete (the blend is in place); that chunk-wise scatter, which
    must keep the anchor update atomic per version, is later work (issue 5). Fine for single-process
    islands.

    Use a separate instance for FINAL chunks: the final cut's f32 digest differs from a bf16
    broadcast's digest of the same version.
    """

    def __init__(self, session: Mapping, *, dtype: str | None = None):
        self.dtype = session.get("bulk_dtype") if dtype is None else dtype
        if self.dtype not in BULK_DTYPES:
            raise WireError(f"bulk dtype must be one of {BULK_DTYPES}", field="bulk_dtype", value=self.dtype)
        self.numels = _session_numels(session)
        self._partial: dict[int, _Partial] = {}
        self._done: dict[int, tuple[int, str]] = {}  # fragment -> (version, digest) completed last
        self.counts: Counter[str] = Counter()

    def seed(self, fragment: int, version: int, digest: str) -> None:
        """Declare a version already held (e.g. installed from another source): chunks of it and of
        older versions are ignored from now on."""
        if fragment not in self.numels:
            raise WireError("no such fragment in the session", field="fragment", value=fragment)
        done = self._done.get(fragment)
        if done is None or version > done[0]:
            self._done[fragment] = (version, digest)
            p = self._partial.get(fragment)
            if p is not None and p.version <= version:
                del self._partial[fragment]

    def add(self, meta: Mapping, payload: Any) -> Completed | None:
        """Take one chunk (its decoded header dict and its payload bytes). Returns the completed
        version when this chunk was the last one missing, else None."""
        fid = meta.get("fragment")
        if isinstance(fid, bool) or not isinstance(fid, int) or fid not in self.numels:
            raise WireError("no such fragment in the session", field="fragment", value=fid)
        version = _check_count(meta.get("version"), "version")
        vdig = meta.get("version_digest")
        if not isinstance(vdig, str):
            raise WireError("version_digest must be a string", field="version_digest", value=vdig)
        if meta.get("dtype") != self.dtype:
            raise WireError(f"broadcast dtype must be the session's {self.dtype}", field="dtype", value=meta.get("dtype"))
        total = packed_nbytes(self.dtype, self.numels[fid])
        if meta.get("total") != total:
            raise WireError(f"fragment {fid} is {total} bytes in {self.dtype}", field="total", value=meta.get("total"))

        done = self._done.get(fid)
        if done is not None and version <= done[0]:
            if version == done[0] and vdig != done[1]:
                raise ProtocolError(f"fragment {fid} version {version} completed before with digest {done[1]}",
                                    field="version_digest", value=vdig)
            self.counts["old" if version < done[0] else "same"] += 1
            return None

        p = self._partial.get(fid)
        if p is not None and version < p.version:
            self.counts["older_than_partial"] += 1
            return None
        if p is not None and version > p.version:
            del self._partial[fid]
            self.counts["dropped_partial"] += 1
            p = None
        if p is not None and vdig != p.version_digest:
            raise ProtocolError(f"fragment {fid} version {version} chunks carry two version digests "
                                f"({p.version_digest} first)", field="version_digest", value=vdig)
        if p is None:
            p = _Partial(version, vdig, Assembler(total, meta.get("chunks")))
            self._partial[fid] = p
        try:
            p.assembler.add(meta, payload)
        except ChunkDuplicate as exc:
            if exc.identical:
                self.counts["duplicate_chunk"] += 1
                return None
            raise
        if not p.assembler.complete:
            return None

        del self._partial[fid]
        buf = p.assembler.result()
        check_digest(vdig, version_digest(buf), field="version_digest")
        self._done[fid] = (version, vdig)
        self.counts["completed"] += 1
        return Completed(fid, version, vdig, _decode(buf, self.dtype))

    # ---- queries --------------------------------------------------------------------------------

    def partial(self, fragment: int) -> tuple[int, int, int] | None:
        """(version, chunks received, chunks) of the version being assembled, or None."""
        p = self._partial.get(fragment)
        if p is None:
            return None
        return p.version, p.assembler.received, p.assembler.chunks

    def completed(self, fragment: int) -> int | None:
        done = self._done.get(fragment)
        return None if done is None else done[0]

    def nbytes_held(self) -> int:
        """Bytes buffered in partial versions (for memory accounting in logs)."""
        return sum(p.assembler.total or 0 for p in self._partial.values())


__all__ = [
    "BcastAssembly",
    "Completed",
    "FragmentState",
    "ProtocolError",
    "SyncState",
]
