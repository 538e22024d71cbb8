"""In-order reading of one stream's versions, BCAST or FINAL (docs/design.md §3.6, §5.5) — pure, no I/O.

Owns `CutReader`: which version of each fragment to read, the version digest streamed over the chunks in
order (no process buffers a whole fragment), and the verdict on every chunk (its doc has the rules and the
shell's loop). The shell (learner/island_wire.py) fetches and stages; this decides.
Invariants: nothing is installed unless every chunk of that one version passed in order and the bytes
hash to the seal's version digest, so a version is never partial or mixed; a version is installed at most
once and versions only grow; nothing a chunk claims is trusted beyond that chunk (a bad chunk is refused
as a WireError, counted by the shell, and the island trains on); what is refused is a *message* (its stream
sequence), never a version number, so forged chunks cannot hold the real versions back.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from yeto.schemas.chunks import ChunkSpan, DigestMismatch, VersionDigest, check_chunk, check_digest, chunk_plan
from yeto.schemas.dtypes import BULK_DTYPES, packed_nbytes
from yeto.schemas.errors import WireError

from .sync_state import check_count, session_numels


class VersionConflict(WireError):
    """One version number seen with two version digests (the version held, or the manifest's). One
    of the two is garbage someone published; the chunk is refused, not fatal."""

    code = "version_conflict"


# An IEEE float is NaN or ±Inf exactly when its exponent bits are all ones.
_EXP_MASK = {"f32": (np.uint32, 0x7F800000), "bf16": (np.uint16, 0x7F80)}


def all_finite(payload: Any, dtype: str) -> bool:
    """No NaN / Inf among the little-endian `dtype` values of `payload` (one vectorized pass)."""
    word, mask = _EXP_MASK[dtype]
    bits = np.frombuffer(payload, dtype=np.dtype(word).newbyteorder("<"))
    return not bool(np.any((bits & mask) == mask))


# ---- reading a cut in chunk order ------------------------------------------------------------------

@dataclass
class _Reading:
    version: int
    hasher: VersionDigest
    # The chunk digests of the chunks passed, in order: chunk 0's (with the version) names the
    # byte-stream being read; the others tell a chunk re-published with other bytes (chunk_changed).
    digests: list = field(default_factory=list)

    @property
    def next(self) -> int:
        return len(self.digests)

    def passed(self, payload, digest: str | None) -> None:
        """The next chunk passed: its bytes go into the version digest, its chunk digest is kept."""
        self.hasher.update(payload)
        self.digests.append(digest)


class CutReader:
    """In-order reader of one stream's versions, every fragment. The rules:

    * the last chunk seals the version: on BCAST only it carries the `version_digest` (the syncer may publish
      chunks 0..n-2 while it is still merging, and the seal once the version is durable); FINAL carries it on
      every chunk and every chunk must carry the one wanted (the manifest's);
    * a version completes only when every chunk of that one version passed, in order, and their bytes hash to
      the seal's `version_digest`; then it is `held`. Until the seal lands the reading waits at the last chunk
      (which still holds an older version); chunks that land one by one are read on at each boundary;
    * a reading is identified by (version, chunk 0's chunk `digest`): one version number may be re-issued with
      other bytes (a syncer restarted before the version was durable merges it again), so a new chunk 0 under
      the same version with other bytes drops the reading (read again from chunk 0), and so does a chunk
      already read re-published under that version with other bytes; the same bytes re-published keep it.
      Chunks of two byte-streams hashed together unnoticed fail the seal's digest check;
    * chunks of the held version or older are not read again;
    * BCAST keeps one message per chunk subject, so a reader half-way through version v may find chunk k
      overwritten by v+1: the reading of v is dropped and v+1 read from chunk 0 ("restart"); if chunk k still
      holds an older version than the one wanted, the newer one has not reached it yet ("wait");
    * anyone who can publish on the stream can put garbage there (unless server permissions close that,
      docs/design.md §13): a bad chunk (framing that does not fit the session's chunk plan, a chunk digest
      mismatch, NaN / Inf values, a `version_digest` missing from a seal or present elsewhere on BCAST, the
      version held carried with another `version_digest`) or a digest mismatch at the seal is refused and
      drops the reading when the reading met it (a bad chunk checked on its own, ahead of the reading, leaves
      it). The syncer's real chunks of the same version (a re-broadcast, or a chunk that overwrote the
      garbage) are new messages and are read as usual. The version read is the one found at chunk 0, never
      one a notice merely claims.

    Shell loop, per fragment that got notices: fetch the chunk subjects `next_chunks(fid)` (in order, in
    bounded batches), hand each message to `take`, and act on the verdict: "accept" (stage the chunk on the
    ranks; a chunk with index 0 starts a new staging), "complete" (the last chunk passed and the version
    digest matched: commit on the ranks), "wait" (stop this fragment for now), "restart" (fetch again from
    chunk 0). A WireError from `take` means the chunk (or the version it completed) is refused: the reading
    was dropped (abort the ranks' staging); read the fragment again once a new message lands on one of its
    subjects (a new notice). Pass each message's stream sequence as `seq` so that a refused message is not
    refused (and counted) twice. `check` validates a chunk on its own (framing against the session's chunk
    plan, its digest) — for a chunk a notice pointed at, out of order.

    `fixed=True` (FINAL): only the versions named with `want` are read, and every chunk must carry the wanted
    version digest (BCAST: only the last chunk, the seal, carries one).
    """

    def __init__(self, session: Mapping, *, dtype: str | None = None, fixed: bool = False):
        self.dtype = session.get("bulk_dtype") if dtype is None else dtype
        if self.dtype not in BULK_DTYPES:
            raise WireError(f"bulk dtype must be one of {BULK_DTYPES}", field="bulk_dtype", value=self.dtype)
        cb = session["chunk_bytes"]
        numels = session_numels(session)
        self.spans: dict[int, list[ChunkSpan]] = {fid: chunk_plan(n, self.dtype, cb) for fid, n in numels.items()}
        self.total = {fid: packed_nbytes(self.dtype, n) for fid, n in numels.items()}
        self.fixed = fixed
        self.held: dict[int, tuple[int, str]] = {}
        self.wanted: dict[int, tuple[int, str]] = {}  # fixed mode: the versions to read
        self.announced: dict[int, int] = {}  # newest version a notice claimed (only says: look)
        # (fragment, chunk) -> stream sequence of the message refused there: that message is not read
        # (nor counted) again; any new message on the subject is.
        self.refused: dict[tuple[int, int], int] = {}
        self._reading: dict[int, _Reading] = {}
        self.counters: Counter[str] = Counter()

    def _fid(self, fid: Any) -> int:
        if isinstance(fid, bool) or not isinstance(fid, int) or fid not in self.spans:
            raise WireError("no such fragment in the session", field="fragment", value=fid)
        return fid

    # ---- what to read ---------------------------------------------------------------------------

    def hold(self, fid: int, version: int, vdigest: str) -> None:
        """Declare a version held (installed from elsewhere): it and older ones are not read."""
        fid = self._fid(fid)
        h = self.held.get(fid)
        if h is None or version > h[0]:
            self.held[fid] = (version, vdigest)
        rd = self._reading.get(fid)
        if rd is not None and rd.version <= version:
            del self._reading[fid]

    def want(self, fid: int, version: int, vdigest: str) -> None:
        """Read exactly this version of the fragment (FINAL: the manifest's version and digest)."""
        self.wanted[self._fid(fid)] = (version, vdigest)

    def held_version(self, fid: int) -> int:
        h = self.held.get(fid)
        return -1 if h is None else h[0]

    def announce(self, fid: int, version: int, vdigest: str | None) -> bool:
        """A notice says `version` has chunks on the stream. True when it is worth reading.
        `vdigest` is the notice's version digest, None for a BCAST chunk other than the seal:
        digests are compared only when there is one."""
        fid = self._fid(fid)
        check_count(version, "version")
        if vdigest is not None and not isinstance(vdigest, str):
            raise WireError("version_digest must be a string", field="version_digest", value=vdigest)
        h = self.held.get(fid)
        if h is not None and version <= h[0]:
            if version == h[0] and vdigest is not None and vdigest != h[1]:
                raise VersionConflict(f"fragment {fid} version {version} was installed with digest {h[1]}",
                                      field="version_digest", value=vdigest)
            return False
        if self.fixed:
            w = self.wanted.get(fid)
            if w is not None and version == w[0] and vdigest is not None and vdigest != w[1]:
                raise VersionConflict(f"fragment {fid} version {version}: notices carry digest {vdigest}, not the "
                                      f"{w[1]} wanted", field="version_digest", value=vdigest)
            return w is not None and version == w[0]
        self.announced[fid] = max(version, self.announced.get(fid, -1))
        return True

    def pending(self) -> list[int]:
        """Fragments that may have something to read: (fixed) a wanted version not held yet, else a
        notice newer than the version held."""
        out = []
        for fid in sorted(self.spans):
            v = self.wanted[fid][0] if self.fixed and fid in self.wanted else \
                (None if self.fixed else self.announced.get(fid))
            if v is not None and v > self.held_version(fid):
                out.append(fid)
        return out

    def next_chunks(self, fid: int) -> list[ChunkSpan]:
        """The chunks to read next, in order: the rest of the reading in progress, else from chunk 0."""
        rd = self._reading.get(fid)
        return self.spans[fid][rd.next if rd is not None else 0:]

    def reading(self, fid: int) -> tuple[int, int, int] | None:
        """(version, chunks passed, chunks) of the version being read, or None."""
        rd = self._reading.get(fid)
        return None if rd is None else (rd.version, rd.next, len(self.spans[fid]))

    def chunk_changed(self, fid: int, index: int, version: int, digest: Any) -> bool:
        """A notice says a new message landed on chunk `index` (`digest`: that chunk's chunk digest).
        True when the reading in progress must be dropped (the shell aborts the staging; the next
        read starts at chunk 0 again):

        * chunk 0 that is not the reading's (version, chunk 0 digest): that reading can no longer
          complete (its chunk 0 is gone). Without this a forged chunk 0 claiming a far version
          (valid chunk digest) started a reading that waited for its later chunks for ever
          ("not_yet"), while the real chunk 0 that overwrote it was never looked at again; and a
          version re-issued with other bytes (a syncer restarted before it was durable merges it
          again) would have its new chunks hashed onto the old ones;
        * a chunk already passed, of the version being read, with other bytes than the ones read
          there: the bytes read are not (or no longer) that version's — a forged chunk (valid chunk
          digest: BCAST's only check before the seal) the real one then overwrote. Only the seal
          could tell, and after its refusal nothing new would land to read the version again.

        The same bytes re-published (a restarted syncer re-issuing a version as it was) keep the
        reading; chunks not passed yet are simply read when the reading gets there."""
        rd = self._reading.get(fid)
        if rd is None or isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < rd.next:
            return False
        if index == 0:
            if (version, digest) == (rd.version, rd.digests[0]):
                return False
            self.counters["chunk0_changed"] += 1
        else:
            if version != rd.version or digest == rd.digests[index]:
                return False  # another version's chunk there: not this reading's bytes (read already)
            self.counters["chunk_changed"] += 1
        del self._reading[fid]
        return True

    def forget(self, fid: int) -> None:
        """Drop the reading in progress (the shell aborted the ranks' staging): the next read of the
        fragment starts again at chunk 0."""
        self._reading.pop(fid, None)

    # ---- one chunk ------------------------------------------------------------------------------

    def _head(self, fid: int, index: int, meta: Mapping) -> tuple[int, str | None]:
        """(version, version digest or None) of a chunk whose header fits its subject. The seal rule
        is checked here too, not only by the codec: the reader trusts no header it did not check."""
        n = len(self.spans[fid])
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise WireError(f"fragment {fid} has chunks 0..{n - 1}", field="chunk", value=index)
        if meta.get("fragment") != fid or meta.get("chunk") != index:
            raise WireError("chunk header does not match its subject", field="subject",
                            value=(fid, index, meta.get("fragment"), meta.get("chunk")))
        v = check_count(meta.get("version"), "version")
        vd = meta.get("version_digest")
        if index == n - 1 or self.fixed:
            if not isinstance(vd, str):
                raise WireError(f"chunk {index} of {n} must carry the version digest as a string "
                                f"({'FINAL: every chunk' if self.fixed else 'the last chunk seals the version'})",
                                field="version_digest", value=vd)
        elif vd is not None:
            raise WireError(f"belongs on the last chunk only (this is chunk {index} of {n})",
                            field="version_digest", value=vd)
        return v, vd

    def known_bad(self, fid: int, index: int, seq: int | None) -> bool:
        """The message at stream sequence `seq` on that chunk subject was refused before."""
        return seq is not None and self.refused.get((fid, index)) == seq

    def refuse(self, fid: int, index: int, seq: int | None) -> None:
        """That message on that chunk subject is garbage: remember it (only on the plan's subjects:
        what is remembered stays bounded by the chunk plan), and drop the reading if that is the
        chunk it needed next (it cannot go on). A chunk refused elsewhere (`check` on its own: one a
        notice pointed at, ahead of the reading or behind it) leaves the reading: behind it, its own
        bytes were read already; ahead, it meets that message later as "wait" (not refused twice),
        or the real chunk that overwrote it, and the seal's digest refuses any mix."""
        rd = self._reading.get(fid)
        if rd is not None and index == rd.next:
            del self._reading[fid]
        self.counters["refused"] += 1
        if seq is not None and 0 <= index < len(self.spans[fid]):
            self.refused[(fid, index)] = seq

    def check(self, fid: int, index: int, meta: Mapping, payload: Any, seq: int | None = None) -> None:
        """Validate one chunk on its own: framing against the session's chunk plan and its digest.
        A bad chunk is remembered as refused (see `refuse`); it drops the fragment's reading when it
        is the chunk the reading needed next (that subject holds garbage now: the reading can go on
        only once a new message lands there)."""
        fid = self._fid(fid)
        try:
            v, _ = self._head(fid, index, meta)
        except WireError:
            self.refuse(fid, index, seq)
            raise
        try:
            if meta.get("dtype") != self.dtype:
                raise WireError(f"chunks must be in the session's {self.dtype}", field="dtype", value=meta.get("dtype"))
            check_chunk(self.spans[fid], meta, payload)
            # The syncer never broadcasts a non-finite weight (its outer step would have to diverge
            # first, and then no island should take it); garbage with a valid digest is refused here.
            if not all_finite(payload, self.dtype):
                raise WireError(f"chunk {index} holds NaN or Inf values", field="payload", value=index,
                                code="non_finite")
        except WireError:
            self.refuse(fid, index, seq)
            raise

    def take(self, fid: int, index: int, meta: Mapping | None, payload: Any, seq: int | None = None) -> str:
        """One fetched chunk message (its decoded header, payload bytes and stream sequence; meta None:
        no message on that subject). Returns "accept", "complete", "wait" or "restart" (see the class
        doc). Raises WireError for a chunk refused (counted under `refused`; not again for the same
        `seq`: that message then means "wait")."""
        fid = self._fid(fid)
        if meta is None:
            self.counters["missing"] += 1
            return "wait"
        if self.known_bad(fid, index, seq):
            self.counters["refused_again"] += 1
            return "wait"
        self.check(fid, index, meta, payload, seq)
        v, vd = self._head(fid, index, meta)
        h = self.held.get(fid)
        if h is not None and v <= h[0]:
            if v == h[0] and vd is not None and vd != h[1]:
                self.refuse(fid, index, seq)
                raise VersionConflict(f"fragment {fid} version {v} was installed with digest {h[1]}",
                                      field="version_digest", value=vd)
            self.counters["old"] += 1
            return "wait"
        if self.fixed:
            w = self.wanted.get(fid)
            if w is None or v != w[0]:
                self.counters["ignored"] += 1
                return "wait"
            if vd != w[1]:
                self.refuse(fid, index, seq)
                raise VersionConflict(f"fragment {fid} version {v}: chunks carry digest {vd}, not the {w[1]} wanted",
                                      field="version_digest", value=vd)
        rd = self._reading.get(fid)
        if rd is not None:
            if v < rd.version:  # the version being read has not reached this chunk yet (or its seal
                self.counters["not_yet"] += 1  # has not landed: the last subject holds an older one)
                return "wait"
            if v > rd.version or index != rd.next:  # overwritten by a newer version mid-read
                del self._reading[fid]
                self.counters["dropped_partial"] += 1
                rd = None
        if rd is None:
            if index != 0:
                return "restart"
            rd = self._reading[fid] = _Reading(v, VersionDigest())
        rd.passed(payload, meta.get("digest"))
        if rd.next < len(self.spans[fid]):
            return "accept"
        del self._reading[fid]
        try:
            # The seal: its version digest must match every byte read under this version, in order.
            check_digest(vd, rd.hasher.hexdigest(), field="version_digest")
        except DigestMismatch:
            # Some chunk's bytes are not the version's (a forged chunk with a valid chunk digest). Not
            # knowing which, none is remembered: the fragment is read again only when a new message
            # lands on one of its subjects, which is what can make it whole.
            self.counters["refused"] += 1
            raise
        self.held[fid] = (v, vd)
        self.counters["completed"] += 1
        return "complete"


__all__ = ["CutReader", "VersionConflict", "all_finite"]
