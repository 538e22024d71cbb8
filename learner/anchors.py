"""Per-rank values of one island rank's pieces (docs/design.md §5.5, §6) — pure torch + local files, no network.

Owns, per session fragment, flat float32 values for this rank's own pieces (never the whole fragment):
* **staging** — the incoming version, written chunk by chunk; blended into the model only once the sync
  rank verified its whole digest and says commit (or abort: a newer version overwrote a chunk mid-read);
* **anchor** — the raw Θ of the version held (a push is d = local − Θ): on commit the staging becomes the
  anchor of the rank's *owner* pieces (a replica never pushes);
* **residual** — the q4 error feedback of the owner pieces; a push works on a copy, kept only once the
  push got through.
Memory: the rank's own share (one f32 copy for anchors, plus the staging of the fragments arriving). In
memory, the anchor a commit replaces is kept (one at most, `spare`) for the next staging to write into:
a fresh slab costs its page faults again on every version (as much as the copy into it), and a staging
is as big in any case.
`directory=...` keeps all three in files there instead (pread/pwrite: page cache, not process memory) for
hosts where that copy does not fit in RAM; the values are the same bit for bit.
"""
from __future__ import annotations

import os
import shutil
import threading
import uuid
from typing import Iterable, Mapping

import torch


_F32 = 4
_IO_MAX = 1 << 30  # bytes per pread/pwrite call (Linux moves at most ~2 GiB per call)


class _MemSlab:
    """Named flat f32 arrays in memory."""

    def __init__(self, numels: Mapping[str, int], zero: bool = False, *, values: dict | None = None):
        make = torch.zeros if zero else torch.empty
        # `values`: the arrays themselves (a clone's), instead of new ones of `numels`
        self.t = values if values is not None else {n: make(k, dtype=torch.float32) for n, k in numels.items()}

    def write(self, name: str, lo: int, values: torch.Tensor) -> None:
        self.t[name][lo: lo + values.numel()].copy_(values)

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self.t[name][lo:hi]  # a view: callers only read it

    def keep(self, names: Iterable[str]) -> None:
        keep = set(names)
        self.t = {n: v for n, v in self.t.items() if n in keep}

    def clone(self) -> "_MemSlab":
        return _MemSlab({}, values={n: v.clone() for n, v in self.t.items()})

    def release(self) -> list[torch.Tensor]:
        """Hand the arrays out (to be written again by a new owner) and hold none."""
        out, self.t = list(self.t.values()), {}
        return out

    def nbytes(self) -> int:
        return sum(v.numel() * _F32 for v in self.t.values())

    def close(self) -> None:
        self.t = {}


class _FileSlab:
    """Named flat f32 arrays in one sparse file (a fresh file reads as zeros)."""

    def __init__(self, path: str, numels: Mapping[str, int], zero: bool = False, *, create: bool = True):
        self.path = path
        self.slots: dict[str, tuple[int, int]] = {}
        off = 0
        for n, k in numels.items():
            self.slots[n] = (off, k)
            off += k
        self.size = off
        if create:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(self.fd, off * _F32)
        else:
            self.fd = os.open(path, os.O_RDWR)

    def _slot(self, name: str, lo: int, n: int) -> int:
        off, k = self.slots[name]
        if lo < 0 or lo + n > k:
            raise ValueError(f"elements [{lo}, {lo + n}) outside the {k} of {name}")  # the caller's offsets
        return (off + lo) * _F32

    def write(self, name: str, lo: int, values: torch.Tensor) -> None:
        v = values.detach().to(torch.float32).contiguous().reshape(-1)
        mv = memoryview(v.numpy()).cast("B")
        pos = self._slot(name, lo, v.numel())
        done = 0
        while done < len(mv):
            done += os.pwrite(self.fd, mv[done: done + _IO_MAX], pos + done)

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.float32)
        mv = memoryview(out.numpy()).cast("B")
        pos = self._slot(name, lo, hi - lo)
        done = 0
        while done < len(mv):
            got = os.preadv(self.fd, [mv[done: done + _IO_MAX]], pos + done)
            if got <= 0:
                raise OSError(f"short read of {self.path}")
            done += got
        return out

    def keep(self, names: Iterable[str]) -> None:
        pass  # disk, not memory: a replica's slots stay in the file until it is replaced

    def clone(self) -> "_FileSlab":
        path = f"{self.path}.{uuid.uuid4().hex[:8]}"
        shutil.copyfile(self.path, path)
        # the same names in the same order: the same slots (each follows the one before)
        return _FileSlab(path, {n: k for n, (_, k) in self.slots.items()}, create=False)

    def nbytes(self) -> int:
        return 0  # no process memory

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class AnchorStore:
    """Staging, anchors and q4 residuals of one rank's pieces, per fragment (see the module doc).
    Pieces are named by tensor name; positions are flat row-major indexes inside the rank's box."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = None if directory is None else os.fspath(directory)
        if self.directory is not None:
            os.makedirs(self.directory, exist_ok=True)
        self._tag = uuid.uuid4().hex[:8]  # one process's files never collide with another's
        self._staging: dict[int, tuple[int, object]] = {}  # fid -> (version, slab)
        self._anchor: dict[int, object] = {}
        self._residual: dict[int, object] = {}
        self._work: dict[int, object] = {}  # q4 residual working copy of the push in progress
        self._numels: dict[int, dict[str, int]] = {}
        # the arrays of the last anchor replaced, by size, for the next staging (the worker stages while
        # the training thread commits, hence the lock)
        self._spare: dict[int, list[torch.Tensor]] = {}
        self._spare_lock = threading.Lock()

    def _slab(self, kind: str, fid: int, numels: Mapping[str, int], zero: bool = False):
        if self.directory is None:
            if kind == "stage":
                return _MemSlab({}, values=self._reuse(numels))
            return _MemSlab(numels, zero)
        path = os.path.join(self.directory, f"{self._tag}-{kind}-f{fid}-{uuid.uuid4().hex[:6]}.f32")
        return _FileSlab(path, numels, zero)

    def _reuse(self, numels: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """Arrays for a staging of `numels`: the spare's of the same sizes, new ones for the rest; the
        spare's other arrays are let go."""
        with self._spare_lock:
            spare, self._spare = self._spare, {}
        out = {}
        for n, k in numels.items():
            same = spare.get(k)
            out[n] = same.pop() if same else torch.empty(k, dtype=torch.float32)
        return out

    def _recycle(self, slab) -> None:
        """A slab no longer read (the anchor a commit replaced): its arrays become the spare."""
        if isinstance(slab, _MemSlab):
            by_size: dict[int, list[torch.Tensor]] = {}
            for t in slab.release():
                by_size.setdefault(t.numel(), []).append(t)
            with self._spare_lock:
                self._spare = by_size
        else:
            slab.close()

    # ---- staging --------------------------------------------------------------------------------

    def begin(self, fid: int, version: int, numels: Mapping[str, int]) -> None:
        """Start staging `version` of a fragment (dropping any other version being staged)."""
        self.abort(fid)
        self._numels[fid] = dict(numels)
        self._staging[fid] = (version, self._slab("stage", fid, numels))

    def staging(self, fid: int) -> int | None:
        """The version being staged, or None."""
        s = self._staging.get(fid)
        return None if s is None else s[0]

    def stage(self, fid: int, name: str, lo: int, values: torch.Tensor) -> None:
        self._staging[fid][1].write(name, lo, values)

    def staged(self, fid: int, name: str) -> torch.Tensor:
        """The staged values of one piece (flat; a view in memory mode: read only)."""
        return self._staging[fid][1].read(name, 0, self._numels[fid][name])

    def abort(self, fid: int) -> None:
        s = self._staging.pop(fid, None)
        if s is not None:
            s[1].close()

    def commit(self, fid: int, owned: Iterable[str]) -> None:
        """The staged version becomes the anchor of the owner pieces `owned`; the old anchor goes."""
        _, slab = self._staging.pop(fid)
        slab.keep(owned)
        old = self._anchor.pop(fid, None)
        self._anchor[fid] = slab
        if old is not None:
            self._recycle(old)

    def drop_staged(self, fid: int) -> None:
        """Forget the staged version without making it the anchor (a final cut)."""
        self.abort(fid)

    # ---- anchors --------------------------------------------------------------------------------

    def has_anchor(self, fid: int) -> bool:
        return fid in self._anchor

    def anchor(self, fid: int, name: str, lo: int, hi: int) -> torch.Tensor:
        a = self._anchor.get(fid)
        if a is None:
            raise RuntimeError(f"fragment {fid} has no anchor on this rank yet")
        return a.read(name, lo, hi)

    # ---- q4 residual ----------------------------------------------------------------------------

    def begin_residual(self, fid: int, numels: Mapping[str, int]) -> None:
        """A working copy of the fragment's residual (zeros before the first q4 push) for one push."""
        self.abort_residual(fid)
        cur = self._residual.get(fid)
        self._work[fid] = cur.clone() if cur is not None else self._slab("resid", fid, numels, zero=True)

    def residual(self, fid: int, name: str, lo: int, hi: int) -> torch.Tensor:
        """The working residual of the push in progress."""
        return self._work[fid].read(name, lo, hi)

    def stage_residual(self, fid: int, name: str, lo: int, values: torch.Tensor) -> None:
        self._work[fid].write(name, lo, values)

    def keep_residual(self, fid: int) -> None:
        """The push got through: its working residual is the fragment's residual from now on."""
        work = self._work.pop(fid)
        old = self._residual.pop(fid, None)
        if old is not None:
            old.close()
        self._residual[fid] = work

    def abort_residual(self, fid: int) -> None:
        w = self._work.pop(fid, None)
        if w is not None:
            w.close()

    def committed_residual(self, fid: int, name: str, lo: int, hi: int) -> torch.Tensor | None:
        r = self._residual.get(fid)
        return None if r is None else r.read(name, lo, hi)

    # ---- accounting -----------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Process memory held (0 for file-backed values)."""
        slabs = [s for _, s in self._staging.values()] + list(self._anchor.values()) + \
            list(self._residual.values()) + list(self._work.values())
        with self._spare_lock:
            spare = sum(t.numel() * _F32 for ts in self._spare.values() for t in ts)
        return sum(s.nbytes() for s in slabs) + spare

    def close(self) -> None:
        for fid in list(self._staging):
            self.abort(fid)
        for d in (self._anchor, self._residual, self._work):
            for s in d.values():
                s.close()
            d.clear()
        with self._spare_lock:
            self._spare = {}


__all__ = ["AnchorStore"]
