"""The speculative merge (`yeto syncer --speculate on`, off by default): a round's outer gradient summed chunk by chunk
while its pushes arrive, adopted by the merge when the round's Merge is the one forecast
(services/syncer/spec_rules.py says what is decided and why it is safe; this is the shell around it).

Owns `Speculator`: intake calls `on_chunk` after the ledger recorded a push chunk; once every member of
the round's pull has a try in the ledger the forecast is fixed, and chunk k is taken from the ledger's
held pushes (intake.PushLedger.take: freed there) as soon as every member's chunk k is held, its Δ summed
into the round's buffer on a worker thread (outer.OuterStep.gradient). `adopt` (the merge, on its Merge)
waits for the sums in flight and hands the buffer over only on an exact match; the merge then finishes
each summed chunk with OuterStep.presummed, the same bits as a merge of the pushes themselves.
Invariants: a chunk that was not held (the push budget was full, a restart) is not speculated: the merge
reads it from PUSH. Memory: one f32 buffer of the fragment's size per speculated round, at most `budget`
bytes of them (by default the largest own fragment's: one round at a time), allocated at its first summed
chunk and freed when its merge ends or its round is abandoned; the pushes it sums leave the ledger's held
bytes as they are summed.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Awaitable, Callable

import torch

from yeto.schemas.chunks import chunk_plan
from yeto.services.syncer import spec_rules
from yeto.services.syncer.actions import Merge
from yeto.services.syncer.intake import PushLedger, PushTry
from yeto.services.syncer.model_store import ModelStore
from yeto.services.syncer.outer import OuterStep, delta_view

log = logging.getLogger("yeto.syncer")


class Speculation:
    """One round's sums: `grad[k's elements]` holds chunk k's Δ for every k in `done`."""

    def __init__(self, f: spec_rules.Forecast, keys: list, spans, dtype: str):
        self.forecast, self.keys, self.spans, self.dtype = f, keys, spans, dtype
        self.grad: torch.Tensor | None = None
        self.taken: set[int] = set()   # chunks whose pushes were taken from the ledger (queued or summed)
        self.done: set[int] = set()    # chunks whose Δ is in grad
        self.queue: list[tuple[int, list]] = []
        self.worker: asyncio.Future | None = None
        self.step = OuterStep(f.weights, f.lr, f.momentum)   # its gradient(): the merge kernel's coefficients
        self.nbytes = 0

    def allocate(self, numel: int) -> int:
        """The f32 buffer the sums go into, at the first chunk summed; returns its bytes."""
        self.grad, self.nbytes = torch.empty(numel, dtype=torch.float32), numel * 4
        return self.nbytes

    def free(self) -> int:
        """The buffer dropped (the merge is done with it, or the round was abandoned); returns its bytes."""
        freed, self.grad, self.nbytes = self.nbytes, None, 0
        return freed

    def queue_chunk(self, k: int, payloads: list) -> None:
        """Chunk k's pushes, taken from the ledger, for the worker to sum."""
        self.taken.add(k)
        self.queue.append((k, payloads))

    def next_batch(self) -> list[tuple[int, list]]:
        batch, self.queue = self.queue, []
        return batch

    def keep_summing(self, work: Callable[["Speculation"], Awaitable[None]]) -> None:
        """A worker sums the queued chunks: `work(self)` is started unless one is running (one per round)."""
        if self.worker is None or self.worker.done():
            self.worker = asyncio.ensure_future(work(self))

    def sum_chunks(self, batch: list[tuple[int, list]]) -> None:
        """Worker thread: Δ of each (chunk, payloads) into grad."""
        for k, payloads in batch:
            s = self.spans[k]
            deltas = [delta_view(p, self.dtype, s.elem_count) for p in payloads]
            self.step.gradient(deltas, self.grad[s.elem_offset: s.elem_offset + s.elem_count])
            self.done.add(k)


class Speculator:
    """The rounds being speculated (see the module doc). With pushes held in memory (f32 pushes of 2
    islands hold 8 bytes a parameter) its buffer usually holds less than the pushes it replaces."""

    def __init__(self, model: ModelStore, ledger: PushLedger, counters: Counter, *, lr: float, momentum: float,
                 max_token_factor: float | None, equal_weights: bool, budget: int | None = None):
        self.model, self.ledger, self.counters = model, ledger, counters
        self.lr, self.momentum = lr, momentum
        self.max_token_factor, self.equal_weights = max_token_factor, equal_weights
        self.budget = budget
        self.pulls: dict[tuple[int, int], dict] = {}            # (fragment, step) -> its latest pull
        self.specs: dict[tuple[int, int, int], Speculation] = {}  # (fragment, step, attempt)
        self.in_use = 0

    def use_outer(self, lr: float, momentum: float) -> None:
        """`yeto run set`'s outer values in force: the next forecasts are made with them."""
        self.lr, self.momentum = lr, momentum

    def expect(self, pull: dict) -> None:
        """A pull went out (PublishPull): its round may be speculated; an older attempt's sums are dropped."""
        fid, step = int(pull["fragment"]), int(pull["step"])
        old = self.pulls.get((fid, step))
        self.pulls[(fid, step)] = dict(pull)
        # a new attempt, or the same attempt asking other members (a re-published pull): forecast again
        same = old is not None and (old["attempt"], old["members"]) == (pull["attempt"], pull["members"])
        for key in [k for k in self.specs if k[:2] == (fid, step) and not (same and k[2] == int(pull["attempt"]))]:
            self._drop(key, "the round's pull changed")

    def on_chunk(self, meta: dict) -> None:
        """After the ledger recorded a push chunk: sum its chunk index if every member's is now held. Never
        raises: intake must go on whatever happens here (the merge then reads the pushes as before)."""
        key = (meta["fragment"], meta["step"], meta["attempt"])
        try:
            self._on_chunk(meta)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self.counters["speculate.error"] += 1
            log.warning("speculative merge of %s given up: %r", key, exc)
            if key in self.specs:
                self._drop(key, "an error")
            self.pulls.pop(key[:2], None)

    def _on_chunk(self, meta: dict) -> None:
        fid, step, attempt, k = meta["fragment"], meta["step"], meta["attempt"], meta["chunk"]
        pull = self.pulls.get((fid, step))
        if pull is None or int(pull["attempt"]) != attempt or self.model.session is None:
            return
        sp = self.specs.get((fid, step, attempt))
        among = (k,)
        if sp is None:
            # a member's first chunk (pushes are published in chunk order) may complete the forecast; then
            # every chunk already held by all is ready, not only this one
            if k != 0 or (sp := self._open(pull)) is None:
                return
            among = range(len(sp.spans))
        tries: list[PushTry | None] = [self.ledger.tries.get(key) for key in sp.keys]
        if any(t is None or t.invalid is not None for t in tries):
            return   # a member's try went (released) or turned out invalid: the Merge will not match
        ready = spec_rules.ready_chunks([t.held for t in tries], sp.taken, among)
        if not ready:
            return
        if sp.grad is None:
            need = self.model.frags[fid].numel * 4
            budget = self.budget if self.budget is not None else max(f.numel for f in self.model.frags.values()) * 4
            if not spec_rules.fits(need, self.in_use, budget):
                self.counters["speculate.no_room"] += 1
                return
            self.in_use += sp.allocate(self.model.frags[fid].numel)
        for k in ready:
            sp.queue_chunk(k, [self.ledger.take(t, k) for t in tries])
        sp.keep_summing(self._work)

    def _open(self, pull: dict) -> Speculation | None:
        fid, step, attempt = int(pull["fragment"]), int(pull["step"]), int(pull["attempt"])
        if fid not in self.model.frags:
            return None
        claims: dict[tuple[str, str], list] = {}
        keys: dict[tuple[str, str], list] = {}
        for key, t in self.ledger.tries.items():
            island, gen, f, s, a, try_ = key
            if (f, s, a) == (fid, step, attempt):
                claims.setdefault((island, gen), []).append(spec_rules.Claim(try_, t.c_tokens, t.c_steps,
                                                                            t.invalid is None))
                keys.setdefault((island, gen), []).append(key)
        fc = spec_rules.forecast(pull, claims, version=int(pull["base_version"]) + 1, lr=self.lr,
                                 momentum=self.momentum, max_token_factor=self.max_token_factor,
                                 equal_weights=self.equal_weights)
        if fc is None:
            return None
        s = self.model.session
        sp = Speculation(fc, [keys[(island, gen)][0] for island, gen, _ in fc.members],
                         chunk_plan(self.model.frags[fid].numel, pull.get("push_dtype", s["push_dtype"]), s["chunk_bytes"]),
                         pull.get("push_dtype", s["push_dtype"]))
        self.specs[(fid, step, attempt)] = sp
        return sp

    async def _work(self, sp: Speculation) -> None:
        while sp.queue:
            batch = sp.next_batch()
            await asyncio.to_thread(sp.sum_chunks, batch)
            self.counters["speculate.chunks"] += len(batch)

    async def adopt(self, a: Merge, *, lr: float, momentum: float) -> Speculation | None:
        """The round's sums if `a` is the merge they were made for (the caller `release`s them after its
        merge), else None (thrown away: the merge reads the pushes from PUSH as before)."""
        sp = self.specs.pop((a.fragment, a.step, a.attempt), None)
        for key in [k for k in self.specs if k[:2] == (a.fragment, a.step)]:
            self._drop(key, "another attempt is merged")
        self.pulls.pop((a.fragment, a.step), None)
        if sp is None:
            return None
        try:
            while sp.worker is not None and not sp.worker.done():
                await asyncio.shield(sp.worker)   # the chunks already taken are summed (a thread cannot be cancelled)
        except Exception as exc:  # noqa: BLE001 - the chunks it did not sum are read from PUSH
            log.warning("step %d: summing a speculative chunk failed (%r): merged from the pushes", a.step, exc)
            self.counters["speculate.error"] += 1
            self.release(sp)
            return None
        why = spec_rules.mismatch(sp.forecast, a, lr=lr, momentum=momentum)
        if why is not None or sp.grad is None:
            self.counters["speculate.discarded" if why is not None else "speculate.empty"] += 1
            if why is not None:
                log.info("step %d: the speculative merge is not the round's (%s): merged from the pushes", a.step, why)
            self.release(sp)
            return None
        self.counters["speculate.adopted"] += 1
        log.info("step %d: speculative merge adopted (%d of %d chunks summed)", a.step, len(sp.done), len(sp.spans))
        return sp

    def release(self, sp: Speculation) -> None:
        if sp.grad is not None:
            self.in_use -= sp.free()

    def _drop(self, key: tuple, why: str) -> None:
        sp = self.specs.pop(key)
        self.counters["speculate.dropped"] += 1
        log.debug("speculative merge of %s dropped: %s", key, why)
        if sp.worker is not None and not sp.worker.done():
            # its thread may still write into grad: freed when it is done
            sp.worker.add_done_callback(lambda _f: self.release(sp))
        else:
            self.release(sp)
