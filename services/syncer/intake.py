"""Push intake ledger — pure: which chunks of which push try have arrived, at which stream sequence.

The syncer's PUSH consumer records each chunk's stream sequence and acks at once; the payload stays
in JetStream until the merge reads it by sequence (direct get) and deletes it after the commit. This
ledger turns the stream of chunk headers into "push try complete" facts for the round machine: a try
completes once, when its last missing chunk arrives (a resent chunk index keeps its first copy), and
is marked invalid, with the first reason the tape records, when its chunks disagree with the session
or with each other (a total or count that changes, a chunk the shell refused, a push digest that does
not match). It also decides which chunks can never count (`PushLedger.closed`) and what a commit
forgets, sweeps and reports (`pop_round`, `pop_swept`, `pop_dropped`).

`push_digest` (on the last chunk) is sha256 over the push's chunk digests in chunk order
(`schemas.chunks.push_digest`): it binds the set and order of chunks to one push without re-reading
the payloads, which stay in JetStream until the merge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from yeto.schemas.chunks import push_digest
from yeto.services.syncer.decoded_pushes import DecodedPushes

PushKey = tuple  # (island, gen, fragment, step, attempt, try)

# `yeto syncer --push-memory-mib auto` (the default): the pushes kept from intake to the merge are sized
# by the fragments this syncer owns, so N shards divide this memory as they divide the fragments
# (docs/design.md §10): 1/PUSH_MEMORY_AUTO_SHARE of their f32 bytes (half), never under
# PUSH_MEMORY_AUTO_MIN (a small model keeps every push) and never over PUSH_MEMORY_AUTO_MAX.
PUSH_MEMORY_AUTO_SHARE = 2
PUSH_MEMORY_AUTO_MIN = 64 << 20
PUSH_MEMORY_AUTO_MAX = 1024 << 20


def auto_push_memory_bytes(own_numel: int) -> int:
    """`--push-memory-mib auto`: the push bytes kept in memory for a syncer owning `own_numel` parameters."""
    if own_numel < 0:
        raise ValueError(f"own_numel must be >= 0, got {own_numel!r}")
    return int(min(PUSH_MEMORY_AUTO_MAX, max(PUSH_MEMORY_AUTO_MIN, own_numel * 4 // PUSH_MEMORY_AUTO_SHARE)))


@dataclass
class PushTry:
    key: PushKey
    chunks: int
    total: int
    dtype: str
    base_version: int
    local_step: int
    c_steps: int
    c_tokens: int
    seqs: dict[int, int] = field(default_factory=dict)  # chunk index -> stream sequence
    digests: dict[int, str] = field(default_factory=dict)
    push_digest: str | None = None
    invalid: str | None = None  # first reason this try is unusable
    done: bool = False
    sumsq: float = 0.0          # Σ value² over the chunks in (float64), for the quarantine rules
    non_finite: int = 0         # NaN/Inf values over the chunks in
    # chunk index -> its payload as received and checked at intake, kept for the merge within the
    # ledger's byte budget (PushLedger.hold_bytes); the merge takes it instead of reading it back
    held: dict[int, bytes] = field(default_factory=dict, repr=False)

    @property
    def norm(self) -> float:
        return math.sqrt(self.sumsq)

    def invalidate(self, reason: str) -> None:
        """The try is unusable; the first reason is the one the tape records."""
        self.invalid = self.invalid or reason

    def record(self, meta: dict, seq: int, *, sumsq: float, non_finite: int) -> None:
        """Chunk meta["chunk"] is in, at stream sequence `seq` (the last chunk carries the push digest)."""
        idx = meta["chunk"]
        self.seqs[idx] = seq
        self.digests[idx] = meta["digest"]
        self.sumsq += sumsq
        self.non_finite += non_finite
        if "push_digest" in meta:
            self.push_digest = meta["push_digest"]

    def hold(self, idx: int, payload: bytes) -> None:
        self.held[idx] = payload

    def take(self, idx: int) -> bytes | None:
        return self.held.pop(idx, None)

    def drop_held(self) -> int:
        """Every payload kept for the merge forgotten; returns their bytes."""
        freed = sum(len(d) for d in self.held.values())
        self.held.clear()
        return freed

    def finish(self) -> None:
        """Its last missing chunk arrived: the push digest must bind the chunks in order."""
        self.done = True
        if self.invalid is None:
            want = push_digest([self.digests[i] for i in range(self.chunks)])
            if self.push_digest != want:
                self.invalid = f"push_digest {self.push_digest} does not match its chunks ({want})"

    @property
    def complete(self) -> bool:
        return len(self.seqs) == self.chunks


@dataclass(frozen=True)
class DroppedTry:
    """An incomplete try forgotten at a commit: it never reached the machine (no PushComplete, so no
    disposition), so the shell tapes this as its one record (`out_of_round`, reason `push_incomplete`)."""
    key: PushKey
    chunks_in: int
    chunks: int
    base_version: int
    local_step: int
    reason: str


def key_of(meta: dict) -> PushKey:
    return (meta["island"], meta["gen"], meta["fragment"], meta["step"], meta["attempt"], meta["try"])


class PushLedger:
    """Tries are forgotten when their round commits (`pop_round`) or when the machine releases them
    (`pop_try`). JetStream redelivers chunks (a fetch whose ack was lost, a resumed syncer's durable
    consumer), and a chunk arriving after its try or round was forgotten would open a try that never
    completes and is never removed. So: a chunk of a *released* try is closed (dropped), and so is a
    *redelivered* chunk of a committed round (`committed_step`: rounds commit strictly in step order).
    A fresh late push to a committed round is still taken, so it completes and gets its out_of_round
    disposition; one that never completes is swept at the next commit (`pop_round` returns its
    sequences in `swept`). Every incomplete try forgotten there (its round committed, or swept) is
    reported once in `dropped`, and its key stays closed (a tombstone) so the chunks that straddled the
    commit open no second try (and no second record). Rounds may commit several times a second, so a
    tombstone lasts `TOMBSTONE_COMMITS` commits, and at most `MAX_TOMBSTONES` are kept (oldest go first)."""

    TOMBSTONE_COMMITS = 1000
    MAX_TOMBSTONES = 10_000

    def __init__(self, committed_step: int = 0, *, hold_bytes: int = 0) -> None:
        if hold_bytes < 0:
            raise ValueError(f"hold_bytes must be >= 0, got {hold_bytes!r}")
        self.tries: dict[PushKey, PushTry] = {}
        # Pushes kept in memory from intake to their merge (`yeto syncer --push-memory-mib`): the merge
        # would otherwise read every member's every chunk back from PUSH (a direct get per chunk: as many
        # bytes again through the broker and the client as the pushes themselves). Within the budget,
        # first come first kept; past it the chunk is read back as before. Freed as the merge takes
        # each chunk, or with its try.
        self.hold_bytes = hold_bytes
        self.held_bytes = 0
        self.committed_step = committed_step
        self.released: set[PushKey] = set()
        self._opened_at: dict[PushKey, int] = {}   # committed_step when the try was opened
        self.swept: list[int] = []                 # sequences of swept tries, for the shell to delete
        # (fragment, step, attempt) -> the push dtype its pull asked for when `yeto run set` changed it
        self.round_dtypes: dict[tuple[int, int, int], str] = {}
        self.dropped: list[DroppedTry] = []        # incomplete tries forgotten, for the shell to tape
        self._tombstones: dict[PushKey, int] = {}  # dropped incomplete try -> committed_step when dropped
        # sparse mode: a complete try's tensors as intake decoded them (decoded_pushes.py), in the same budget
        self.decoded = DecodedPushes()

    def set_budget(self, hold_bytes: int) -> None:
        """The push bytes kept in memory from now on (the session is known: `--push-memory-mib auto`)."""
        if hold_bytes < 0:
            raise ValueError(f"hold_bytes must be >= 0, got {hold_bytes!r}")
        self.hold_bytes = hold_bytes

    def resume(self, committed_step: int, *, hold_bytes: int) -> None:
        """A resumed syncer's ledger, before any chunk: rounds up to the checkpoint's `committed_step` are
        committed (their redelivered chunks are closed)."""
        if self.tries or self.released:
            raise RuntimeError("a ledger resumes before it has recorded anything")
        self.committed_step = committed_step
        self.set_budget(hold_bytes)

    def restore_try(self, t: PushTry) -> None:
        """The redo of an interrupted merge (merge.Merger.redo): a complete try as the merge's intent recorded
        it, its chunks read back from PUSH by their stream sequences."""
        self._release_key(t.key)
        self.tries[t.key] = t

    def closed(self, meta: dict, *, redelivered: bool = False) -> str | None:
        """Why a chunk can never count (its try released, or a redelivery of a committed round), else None."""
        key = key_of(meta)
        if key in self.released:
            return "its push try was released (rejected, or discarded by a restart)"
        if key in self._tombstones:
            return f"its push try was dropped incomplete when round {meta['step']} committed (taped then)"
        if redelivered and meta["step"] <= self.committed_step:
            return f"redelivered chunk of committed round {meta['step']} (committed step {self.committed_step})"
        return None

    def add(self, meta: dict, seq: int, *, expected_total: int | None, chunk_ok: bool, chunk_reason: str | None = None,
            sumsq: float = 0.0, non_finite: int = 0, payload: bytes | None = None) -> PushTry | None:
        """Record one validated chunk header at stream sequence `seq`.

        `expected_total` is the byte size a push of this fragment must have in the session dtype (None if
        the shell could not tell: an unknown fragment, or a chunk it refused before planning, e.g. another
        dtype, whose own reason then names the try's fault). `chunk_ok` is False when the shell found the
        payload's digest or size bad. `sumsq` / `non_finite` are the chunk's Σ value² and count of
        NaN/Inf values: summed per try (a resent chunk index counts once) into the figures the round
        machine's quarantine rules judge. `payload`: the chunk's bytes, checked; kept for the merge
        (`take`) while the try is valid and the budget allows. Returns the try when it just became
        complete (valid or not), else None.
        """
        key = key_of(meta)
        # `closed` was asked before the shell awaited (a bad chunk's rejection is taped first), and a
        # commit may have dropped this try meanwhile: re-checked here, or the chunk would open a second
        # try, swept and taped a second time (soak/hostile.py, a CI run: 5 records for 4 overlap tries).
        if key in self.released or key in self._tombstones:
            return None
        t = self.tries.get(key) or self._open(key, meta, expected_total, chunk_ok)
        if t.done:
            return None
        if meta["chunks"] != t.chunks or meta["total"] != t.total:
            t.invalidate(f"chunks/total changed within one push ({meta['chunks']}/{meta['total']} vs {t.chunks}/{t.total})")
        idx = meta["chunk"]
        if idx in t.seqs:
            # A resend of one chunk under the same try (JetStream's dedup window missed it): keep the first.
            return None
        if not chunk_ok:
            t.invalidate(chunk_reason or f"chunk {idx} rejected")
        t.record(meta, seq, sumsq=sumsq, non_finite=non_finite)
        if payload is not None and chunk_ok and t.invalid is None and self.held_bytes + len(payload) <= self.hold_bytes:
            t.hold(idx, payload)
            self.held_bytes += len(payload)
        if t.complete:
            t.finish()
        if t.invalid is not None:
            self._release(t)   # an invalid try is never merged: its bytes go now
        return t if t.done else None

    def _open(self, key: PushKey, meta: dict, expected_total: int | None, chunk_ok: bool) -> PushTry:
        """A try's first chunk: the try, judged against the size the session's fragment takes."""
        self._opened_at[key] = self.committed_step
        t = PushTry(key=key, chunks=meta["chunks"], total=meta["total"], dtype=meta["dtype"],
                    base_version=meta["base_version"], local_step=meta["local_step"],
                    c_steps=meta["c_steps"], c_tokens=meta["c_tokens"])
        if expected_total is None and chunk_ok:
            t.invalidate(f"unknown fragment {meta['fragment']}")
        elif expected_total is not None and meta["total"] != expected_total:
            t.invalidate(f"push total {meta['total']} bytes, the session's fragment takes {expected_total}")
        self.tries[key] = t
        return t

    def take(self, t: PushTry, chunk: int) -> bytes | None:
        """Chunk `chunk` of try `t` as received at intake (checked against its digest there), handed over
        once and forgotten; None when it was not kept (the budget was full, or after a restart)."""
        data = t.take(chunk)
        if data is not None:
            self.held_bytes -= len(data)
        return data

    def keep_decoded(self, t: PushTry, push) -> bool:
        """Sparse mode: try `t`'s tensors as intake decoded them, kept for the merge in place of its raw
        chunks (which they make unneeded) when they fit the budget; not for a try that is invalid or no
        longer the ledger's (forgotten while intake decoded it). Returns whether they were kept."""
        if t.invalid is not None or self.tries.get(t.key) is not t:
            return False
        raw, before = sum(len(d) for d in t.held.values()), self.decoded.nbytes
        if not self.decoded.keep(t, push, self.hold_bytes - (self.held_bytes - raw)):
            return False
        self.held_bytes += self.decoded.nbytes - before - t.drop_held()
        return True

    def take_decoded(self, t: PushTry):
        """Try `t`'s decoded tensors kept at intake, handed over once; None when not kept for this try."""
        push, n = self.decoded.take(t)
        self.held_bytes -= n
        return push

    def _release(self, t: PushTry) -> None:
        self.held_bytes -= t.drop_held()
        self._release_key(t.key)

    def _release_key(self, key: PushKey) -> None:
        self.held_bytes -= self.decoded.drop(key)

    def expect_pull(self, pull: dict) -> None:
        """A pull went out: a push dtype it names (`yeto run set push_dtype`) is what its pushes must carry."""
        if "push_dtype" in pull:
            self.round_dtypes[(pull["fragment"], pull["step"], pull["attempt"])] = pull["push_dtype"]

    def push_dtype(self, fragment: int, step: int, attempt: int, session_dtype: str) -> str:
        """The dtype a push of this round must carry: its pull's, else the session's."""
        return self.round_dtypes.get((fragment, step, attempt), session_dtype)

    def pop_round(self, fragment: int, step: int) -> list[int]:
        """Forget every try of a (fragment, step) round, which is committed; return their sequences to
        delete (one purge of the fragment's subject). Also sweeps incomplete tries of committed rounds
        that stayed incomplete for a whole commit (`swept`: their sequences, to delete one by one)."""
        seqs = []
        prev, self.committed_step = self.committed_step, max(self.committed_step, step)
        for key in [k for k in self.tries if k[2] == fragment and k[3] == step]:
            self._drop_if_incomplete(key, f"push_incomplete: {{n}}/{{chunks}} chunks in when round {step} committed")
            seqs.extend(self._pop(key))
        for key in [k for k, t in self.tries.items() if k[3] <= prev and not t.done and self._opened_at[k] < prev]:
            self._drop_if_incomplete(key, f"push_incomplete: {{n}}/{{chunks}} chunks in, swept a whole commit after "
                                          f"round {key[3]} committed")
            self.swept.extend(self._pop(key))
        self.released = {k for k in self.released if k[3] > self.committed_step}
        self.round_dtypes = {k: v for k, v in self.round_dtypes.items() if k[1] > self.committed_step}
        # A hostile run showed a try's last chunk arriving a second (two commits) after its first.
        self._tombstones = {k: c for k, c in self._tombstones.items() if c >= prev - self.TOMBSTONE_COMMITS}
        while len(self._tombstones) > self.MAX_TOMBSTONES:
            del self._tombstones[next(iter(self._tombstones))]
        return seqs

    def _drop_if_incomplete(self, key: PushKey, reason: str) -> None:
        t = self.tries[key]
        if t.done:   # complete: the machine got it (PushComplete) and taped its disposition
            return
        self.dropped.append(DroppedTry(key, len(t.seqs), t.chunks, t.base_version, t.local_step,
                                       reason.format(n=len(t.seqs), chunks=t.chunks)))
        self._tombstones[key] = self.committed_step

    def pop_dropped(self) -> list[DroppedTry]:
        """The incomplete tries forgotten since the last call, for the shell to tape (each once)."""
        out, self.dropped = self.dropped, []
        return out

    def pop_swept(self) -> list[int]:
        """Sequences of swept tries since the last call, for the shell to delete one by one."""
        out, self.swept = self.swept, []
        return out

    def pop_try(self, key: PushKey) -> list[int]:
        """Forget one try the machine is done with (merged, rejected, or discarded by a restart); return its
        sequences to delete. A try of a round not yet committed, or one still open, stays closed (released)
        so a redelivered or resent chunk of it opens nothing."""
        if key[3] > self.committed_step or key in self.tries:
            self.released.add(key)
        return self._pop(key)

    def _pop(self, key: PushKey) -> list[int]:
        self._opened_at.pop(key, None)
        t = self.tries.pop(key, None)
        if t is not None:
            self._release(t)
        return list(t.seqs.values()) if t else []
