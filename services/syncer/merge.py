"""The merge of a completed round: the accepted pushes read back from the PUSH stream chunk by chunk
(direct gets, in member order), the weighted mean and the f32 Nesterov outer step (services/syncer/outer),
the durable commit and broadcast (services/syncer/cut.py; the model store, services/syncer/model_store.py,
makes the version durable before its seal), then the round's pushes deleted from PUSH.
Each chunk's new params and momentum are written into the new version's checkpoint `.tmp` files as soon
as its outer step is done (checkpoint.VersionFiles), so the commit only fsyncs and renames them.
Memory: O(members x chunk) bytes beside the fragment's params and momentum.

Cut-through (`--broadcast cut-through`): each chunk of the new version is also sent to BCAST as soon as
it is merged (cut.BroadcastStream), the default; only its last chunk, the seal with the version digest,
waits for the durable commit. `--broadcast with-commit` sends them after the merge loop, while the
version is made durable. Before the first chunk goes out, the merge's inputs are written
durably as its intent (checkpoint.CheckpointDir.write_intent), so a syncer killed mid-broadcast redoes
the same merge on `--resume` (`Merger.redo`) and sends the same version number with the same bytes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import torch

from yeto.schemas import outer_mode as OM
from yeto.schemas import sparse_bcast as SB
from yeto.schemas import subjects as S
from yeto.schemas.chunks import chunk_plan, digest as chunk_digest
from yeto.services.syncer.actions import Merge, action_from_json, action_to_json
from yeto.services.syncer.cut import CutPublisher
from yeto.services.syncer.events import MergeDone
from yeto.services.syncer.intake import PushLedger, PushTry
from yeto.services.syncer.lease import Fenced
from yeto.services.syncer import sparse_merge as SM
from yeto.services.syncer.model_store import ModelStore
from yeto.services.syncer.outer import OuterStep, delta_dtype, delta_view, prewarm
from yeto.services.syncer.speculate import Speculator
from yeto.services.syncer.tape import TapeWriter

log = logging.getLogger("yeto.syncer")
# `yeto syncer --checkpoint-writer`: where the merge writes the new version's checkpoint files: "inline"
# (in the outer step's thread hop, right after it), "thread" (a writer thread of its own beside the
# merge) or "whole" (not streamed: the commit writes them whole). Measured with bench/round.py
# `--checkpoint-writer` (the comparison is in bench/README.md's git history): inline is the default.
CKPT_WRITERS = ("inline", "thread", "whole")
# `yeto syncer --broadcast`: when a new version's chunks go to BCAST. "cut-through": each as soon as it is
# merged; "with-commit": all after the merge loop, while the version is made durable (the checkpoint's
# fsync); "after-commit": all after the durable commit. In the first two the last chunk (the seal) waits
# for the commit. Measured (bench/README.md): cut-through is the fastest round on 16 cores (2.7 vs 3.2 s
# with-commit at 256 MiB) and on 2 shared cores (4.8 vs 5.7-6.1 s), since the islands fetch the chunks
# that landed many per request; before that fix it lost on 2 cores. with-commit beats after-commit by
# the broadcast's time.
BROADCAST_MODES = ("cut-through", "with-commit", "after-commit")
EARLY_MODES = ("cut-through", "with-commit")   # chunks before the seal, hence the merge intent


class MergeError(RuntimeError):
    pass


async def delete_push_seqs(js, run_id: str, counters: Counter, seqs) -> None:
    """Delete push chunks from PUSH by stream sequence; a failure is counted (max_age is the safety net)."""
    for seq in seqs:
        try:
            await js.delete_msg(S.stream(run_id, "PUSH"), seq)
        except Exception:
            counters["delete_error"] += 1


async def read_push_bytes(js, run_id: str, seq: int, want_digest: str | None):
    """A push chunk's bytes read back from PUSH by its stream sequence and checked against its chunk
    digest (MergeError when it is gone or changed)."""
    from nats.js.errors import NotFoundError

    try:
        m = await js.get_msg(S.stream(run_id, "PUSH"), seq=seq, direct=True)   # asked again on a move (conn.py)
    except NotFoundError:
        # Any replica answers a direct get; one still catching up (a cluster node just restarted)
        # does not hold the message yet. The stream leader does.
        try:
            m = await js.get_msg(S.stream(run_id, "PUSH"), seq=seq)
        except NotFoundError:
            # Gone from the stream (max_age, an operator's purge). nats-py's bare NotFoundError()
            # names nothing: the tape's record of a failed redo must say which message is missing.
            raise MergeError(f"PUSH message {seq} is gone from the stream (max_age or a purge)") from None
    if want_digest is not None and chunk_digest(m.data) != want_digest:
        raise MergeError(f"PUSH message {seq} changed in the stream (digest mismatch)")
    return m.data


class Merger:
    def __init__(self, js, run_id: str, counters: Counter, model: ModelStore, publisher: CutPublisher,
                 ledger: PushLedger, tape: TapeWriter, *, lr: float, momentum: float, attempts: dict[int, int],
                 broadcast: str = "cut-through", ckpt_writer: str = "inline", speculator: Speculator | None = None):
        if broadcast not in BROADCAST_MODES:
            raise ValueError(f"broadcast mode {broadcast!r} is not one of {BROADCAST_MODES}")
        if ckpt_writer not in CKPT_WRITERS:
            raise ValueError(f"checkpoint writer {ckpt_writer!r} is not one of {CKPT_WRITERS}")
        self.js, self.run_id, self.counters = js, run_id, counters
        self.model, self.publisher, self.ledger, self.tape = model, publisher, ledger, tape
        self.lr, self.momentum = lr, momentum
        self.attempts = attempts          # step -> highest attempt published (the shell keeps it current)
        self.broadcast, self.ckpt_writer = broadcast, ckpt_writer
        # the speculative merge (speculate.py), which intake tells of every push chunk recorded; None with
        # --speculate off (and for the redo of an interrupted merge, which never speculates)
        self.spec = speculator

    def expect(self, pull: dict) -> None:
        """A pull was published: its pushes' dtype is known (the ledger) and its round may be merged
        speculatively."""
        self.ledger.expect_pull(pull)
        if self.spec is not None:
            self.spec.expect(pull)

    def prewarm(self, members: int) -> None:
        """Have the outer-step loop for a merge of `members` pushes built (or loaded from the compile
        cache) in the background once the session is known, so the first merge uses it (outer.prewarm;
        another member count, a merge with islands missing, is built when first needed)."""
        s = self.model.session
        if s is None or s.get("outer") is not None:   # the sparse mode has no outer-step loop
            return
        for n in sorted({chunk_plan(fr.numel, s["push_dtype"], s["chunk_bytes"])[0].elem_count
                         for fr in self.model.frags.values()}):
            if prewarm(s["push_dtype"], n, members):
                log.info("outer step: loop for %d members x %d values prepared at start", members, n)
            if self.spec is not None:   # the loop finishing a speculated chunk: one f32 input, its Δ
                prewarm("f32", n, 1)

    async def _read_push_chunk(self, t: PushTry, k: int, dtype: str, count: int) -> torch.Tensor:
        """Chunk k of push try t: the bytes intake kept (checked against the chunk digest there), else
        read back from PUSH by its stream sequence and checked again."""
        return delta_view(await self._push_bytes(t, k), dtype, count)  # read in place: never written

    async def _push_bytes(self, t: PushTry, k: int):
        """Chunk k of push try t: the bytes intake kept, else read back from PUSH (`read_push_bytes`)."""
        data = self.ledger.take(t, k)
        if data is not None:
            self.counters["merge.push_chunk_held"] += 1
            return data
        self.counters["merge.push_chunk_read"] += 1
        return await read_push_bytes(self.js, self.run_id, t.seqs[k], t.digests[k])

    async def _sparse_step(self, a: Merge, tries: list[PushTry]) -> tuple[SM.FragmentStep, dict]:
        """The sparse mode's merge input: every accepted push as intake decoded it (PushLedger.take_decoded),
        else read whole and decoded again (checked at intake: a failure now is a MergeError), aggregated in
        member order with this merge's lr. Also the detail: the seconds of each part, pushes taken/decoded."""
        frag = self.model.session["fragments"][a.fragment]
        outer = OM.from_session(self.model.session)
        t0 = time.perf_counter()
        held = [self.ledger.take_decoded(t) for t in tries]

        async def decode(t, push):
            if push is not None:
                return push
            data = b"".join([bytes(await self._push_bytes(t, k)) for k in range(t.chunks)])
            try:
                return await asyncio.to_thread(SM.decode, frag, outer, data)
            except ValueError as exc:
                raise MergeError(f"merge of step {a.step}: push of {t.key[0]} no longer decodes: {exc}") from None

        pushes = await asyncio.gather(*(decode(t, p) for t, p in zip(tries, held)))   # kept in member order
        t1 = time.perf_counter()
        step = await asyncio.to_thread(SM.FragmentStep.of, frag, pushes, self.hyper(a)[0])
        kept = sum(p is not None for p in held)
        self.counters["merge.sparse_push_decoded_held"] += kept
        self.counters["merge.sparse_push_decoded_again"] += len(tries) - kept
        return step, {"sparse_decode_s": t1 - t0, "sparse_aggregate_s": time.perf_counter() - t1,
                      "sparse_pushes_held": kept, "sparse_pushes_decoded": len(tries) - kept}

    def use_outer(self, settings: dict) -> None:
        """`yeto run set`'s outer values in force: the speculative merge forecasts the next merge with them
        (a forecast made with others is discarded at the merge, which reads the pushes instead)."""
        if self.spec is not None:
            self.spec.use_outer(*self.hyper(Merge(0, 0, 0, 0, 0, (), outer=settings)))

    def hyper(self, a: Merge) -> tuple[float, float]:
        """The outer learning rate and momentum of this merge: the flags', or what `yeto run set` put in
        force when the machine decided it (Merge.outer), never read later than that."""
        return float(a.outer.get("outer_lr", self.lr)), float(a.outer.get("outer_momentum", self.momentum))

    def intent(self, a: Merge, tries: list[PushTry]) -> dict:
        """What redoing this merge needs besides the checkpointed params and momentum (see `redo`)."""
        return {"merge": action_to_json(a), "lr": self.lr, "momentum": self.momentum,
                # the resend id of a version number re-issued after a failed redo: a redo of this merge
                # must send under the same ids, or chunks only a killed syncer sent would shadow it
                "reissue": self.publisher.resend_id(a.fragment, a.version),
                "attempts": {str(k): v for k, v in self.attempts.items()},
                "tries": [{"key": list(t.key), "chunks": t.chunks, "total": t.total, "dtype": t.dtype,
                           "base_version": t.base_version, "local_step": t.local_step, "c_steps": t.c_steps,
                           "c_tokens": t.c_tokens, "seqs": {str(k): v for k, v in t.seqs.items()},
                           "digests": {str(k): v for k, v in t.digests.items()}, "push_digest": t.push_digest}
                          for t in tries]}

    async def redo(self, intent: dict) -> tuple[MergeDone, list[int]]:
        """Redo a cut-through merge a killed syncer had begun (its intent): the same pushes, read by the
        same stream sequences and checked against the same chunk digests, merged with the same weights
        and hyper-parameters on the checkpointed params and momentum, give the same bytes under the same
        version number. Raises MergeError when a push is gone from PUSH (then nothing was changed)."""
        a = action_from_json(intent["merge"])
        if not isinstance(a, Merge):
            raise MergeError(f"merge intent holds a {type(a).__name__}, not a Merge")
        for t in intent["tries"]:
            key = tuple(t["key"])
            self.ledger.restore_try(PushTry(
                key=key, chunks=t["chunks"], total=t["total"], dtype=t["dtype"], base_version=t["base_version"],
                local_step=t["local_step"], c_steps=t["c_steps"], c_tokens=t["c_tokens"],
                seqs={int(k): v for k, v in t["seqs"].items()}, digests={int(k): v for k, v in t["digests"].items()},
                push_digest=t["push_digest"], done=True))
        self.attempts.update({int(k): v for k, v in intent["attempts"].items()})
        self.lr, self.momentum = float(intent["lr"]), float(intent["momentum"])
        if intent.get("reissue") is not None:
            self.publisher.reissue_version(a.fragment, a.version, int(intent["reissue"]))
        try:
            return await self.merge(a, redone=True)
        except BaseException:
            # A failed redo (a push gone) may have stepped some chunks: back to the checkpointed version.
            await self.model.reload(a.fragment, a.version - 1)
            raise

    def _updates(self, version: int) -> bool:
        """Whether `version` goes out on BCAST as a sparse update message (schemas/sparse_bcast.py)."""
        session = self.model.session
        return session.get("outer") is not None and SB.sends_update(version, session["bulk_dtype"])

    async def merge(self, a: Merge, *, redone: bool = False) -> tuple[MergeDone, list[int]]:
        """Merge, outer step, durable commit, broadcast: the MergeDone to feed back, and the PUSH
        sequences of the round for `cleanup` (after MergeDone, off the commit path). A speculative merge
        of this very round (speculate.py) is adopted here: its chunks are finished from their summed Δ."""
        t0 = time.time()
        lr, momentum = self.hyper(a)
        sparse = self.model.session.get("outer") is not None   # never speculated (the service makes no speculator)
        spec = None if redone or self.spec is None or sparse else await self.spec.adopt(a, lr=lr, momentum=momentum)
        try:
            return await self._merge(a, redone, spec, t0)
        finally:
            if spec is not None:
                self.spec.release(spec)

    async def _merge(self, a: Merge, redone: bool, spec, t0: float) -> tuple[MergeDone, list[int]]:
        fid = a.fragment
        session = self.model.session
        dtype = self.ledger.push_dtype(fid, a.step, a.attempt, session["push_dtype"])
        sparse = session.get("outer") is not None
        # the merge loop's spans: the pushes' chunks (dense), the f32 plan of the params (sparse)
        spans = chunk_plan(self.model.frags[fid].numel, "f32" if sparse else dtype, session["chunk_bytes"])
        tries = []
        for m in a.members:
            t = self.ledger.tries.get((m.island, m.gen, fid, a.step, a.attempt, m.try_))
            if t is None or not t.complete:
                raise MergeError(f"merge of step {a.step}: push of {m.island}/{m.gen} try {m.try_} is not in the ledger")
            tries.append(t)
        scratch = torch.empty(max(s.elem_count for s in spans), dtype=torch.float32)
        # prepared once per merge: the hyper-parameters checked and the kernel chosen (and, the first
        # time, compiled in the background) here, not per chunk
        # (in a thread: YETO_OUTER_COMPILE=sync waits for the compile there, not on the event loop)
        lr, momentum = self.hyper(a)
        held0, read0 = self.counters["merge.push_chunk_held"], self.counters["merge.push_chunk_read"]
        # sparse: the whole step decoded and aggregated up front (a few values per tile), applied span by span
        sparse_step, sparse_detail = await self._sparse_step(a, tries) if sparse else (None, {})
        # the version's update message (BCAST), made on a thread while the loop below steps and writes
        upd = None
        if sparse and self._updates(a.version):
            upd = asyncio.ensure_future(asyncio.to_thread(
                sparse_step.update_message, session["fragments"][fid], OM.from_session(session)))
        outer_step = None if sparse else await asyncio.to_thread(
            OuterStep, [m.weight for m in a.members], lr, momentum, delta_dtypes=[delta_dtype(dtype)] * len(tries),
            chunk_numel=spans[0].elem_count)
        presummed = None if spec is None else await asyncio.to_thread(OuterStep.presummed, lr, momentum,
                                                                      chunk_numel=spans[0].elem_count)

        async def fetch(k):
            s = spans[k]
            if sparse:
                return None
            if spec is not None and k in spec.done:
                # summed while the pushes came in, from the chunks kept at intake: counted as held
                self.counters["merge.push_chunk_held"] += len(tries)
                return None
            return await asyncio.gather(*[self._read_push_chunk(t, k, dtype, s.elem_count) for t in tries])

        nxt = asyncio.create_task(fetch(0))
        # The new params of a chunk are final after its outer step: pack and hash them there, in the same
        # thread hop, so the version digest is ready when the loop ends (the broadcast sends these bytes).
        bulk = self.publisher.packer(fid)
        stream = None
        t_intent = time.perf_counter()
        await self.model.guard()   # a deposed owner writes no intent and no version files (lease.py)
        if self.broadcast in EARLY_MODES:
            # Durable before the first chunk goes out: a restarted syncer must send these same bytes.
            await self.model.write_intent(fid, self.intent(a, tries))
            # sparse: a version sent as an update only has no full cut to stream (schemas/sparse_bcast.py)
            if self.publisher.needs_full(a.version, self._updates(a.version)):
                stream = self.publisher.stream(fid, a.version, bulk)
        intent_s = time.perf_counter() - t_intent
        # The new version's checkpoint files, chunk by chunk into the page cache (the commit fsyncs them once).
        # (none when the directory keeps this version as its update message: state_chain.py)
        files = None
        if self.ckpt_writer != "whole" and not (upd is not None and self.model.dir_plans_update(fid, a.version)):
            files = await asyncio.to_thread(self.model.version_files, fid, a.version,
                                            thread=self.ckpt_writer == "thread")
        # ... and into the state KV, so the commit waits only for the last acks (state_store.StateStream)
        # (not when the state store keeps the version as its update message: state_chain.py)
        stored = self.model.state_stream(fid, a.version, update=upd is not None)

        def step(deltas, s):
            # the outer step of span s, in place in the model store (its one writer of a merged fragment)
            t = time.perf_counter()
            if sparse_step is not None:   # θ ← θ − s on this span; momentum untouched (none in this mode)
                self.model.update(fid, s.elem_offset, s.elem_count,
                                  lambda params, momentum: sparse_step.apply(params, s.elem_offset))
            elif deltas is None:
                sl = slice(s.elem_offset, s.elem_offset + s.elem_count)
                self.model.update(fid, s.elem_offset, s.elem_count, lambda params, momentum: presummed(
                    params, momentum, [spec.grad[sl]], out=scratch[: s.elem_count]))
            else:
                self.model.update(fid, s.elem_offset, s.elem_count, lambda params, momentum: outer_step(
                    params, momentum, deltas, out=scratch[: s.elem_count]))
            outer = time.perf_counter() - t
            bulk.add(s.elem_offset, s.elem_count)
            if files is not None:
                files.add(s.elem_offset, s.elem_count)
            return outer

        fetch_s = outer_s = 0.0
        try:
            for k, s in enumerate(spans):
                t = time.perf_counter()
                deltas = await nxt
                fetch_s += time.perf_counter() - t   # waiting for push bytes (not hidden by the prefetch)
                if k + 1 < len(spans):
                    nxt = asyncio.create_task(fetch(k + 1))  # prefetch while this chunk is merged
                await self.model.guard()   # woken from a pause after a takeover: not one more chunk written
                outer_s += await asyncio.to_thread(step, deltas, s)
                if stream is not None and self.broadcast == "cut-through":
                    await stream.put_ready()     # every broadcast chunk now packed, but never the seal
                if stored is not None:
                    await stored.put_ready(s.elem_offset + s.elem_count)
        except BaseException as exc:
            if not nxt.done():
                nxt.cancel()
            if upd is not None:
                upd.cancel()   # its result is not wanted (the thread finishes on its own)
            # never named by a manifest; deleted now, not left behind. Not by a deposed owner: its files'
            # names may be the new owner's own work in progress (a checkpoint directory both mount).
            if files is not None and not isinstance(exc, Fenced):
                await asyncio.to_thread(files.abort)
            raise
        merge_s = time.time() - t0
        rec = dict(a.record)
        rec["t"] = time.time()
        rec["sync_s"] = max(0.0, rec["t"] - a.launched_at)   # the tape's sync_s: launch to durable commit
        # merge_s: the whole merge loop; of it fetch_s waited for pushes, outer_s ran the outer step,
        # pack_s (added by the commit with its own stages) packed and hashed the new version.
        # ckpt_write_s (added by the commit): the checkpoint files' writes, inline in the loop or beside it.
        # push chunks the merge took from memory (kept at intake) and read back from PUSH
        rec["detail"] = {**rec.get("detail", {}), "merge_s": merge_s, "fetch_s": fetch_s, "outer_s": outer_s,
                         "broadcast_mode": self.broadcast,
                         "push_chunks_held": self.counters["merge.push_chunk_held"] - held0,
                         "push_chunks_read": self.counters["merge.push_chunk_read"] - read0,
                         # chunks the compiled outer loop stepped, and the eager twin (or SGD form)
                         "outer_compiled_chunks": (outer_step.compiled_calls if outer_step else 0)
                         + (presummed.compiled_calls if presummed else 0),
                         "outer_eager_chunks": (outer_step.eager_calls if outer_step else 0)
                         + (presummed.eager_calls if presummed else 0),
                         # chunks whose Δ a speculative merge summed while the pushes came in (speculate.py)
                         "speculated_chunks": len(spec.done) if spec is not None else 0}
        if stream is not None:
            rec["detail"]["intent_s"] = intent_s
            rec["detail"]["chunks_in_loop"] = stream.early   # sent while the loop ran (cut-through), not after
        if sparse:
            rec["detail"]["outer_mode"] = OM.SPARSE
            rec["detail"]["sparse_entries"] = int(sparse_step.index.numel())   # coordinates this step moved
            # the up-front part: pushes taken as intake decoded them (or read and decoded again), aggregated
            rec["detail"].update(sparse_detail)
        if redone:   # a killed syncer had begun this merge (and sent some of its chunks): the same bytes again
            rec["detail"]["redone"] = True
        updates = None if upd is None else {fid: await upd}
        try:
            await self.publisher.commit({fid: a.version}, step=a.step, attempts=self.attempts, records=[rec],
                                  updates=updates,
                                  packed={fid: bulk}, streamed={fid: files} if files is not None else None,
                                  streams={fid: stream} if stream is not None else None,
                                  stored={fid: stored} if stored is not None else None)
        except BaseException:
            # Before its renames the files are .tmp leftovers, after them files no manifest names (the
            # fragment's next commit deletes those): closing here leaves the crash semantics unchanged.
            if files is not None:
                await asyncio.to_thread(files.abort)
            raise
        # The round's pushes (every member, every try, every attempt) are no longer needed.
        seqs = self.ledger.pop_round(fid, a.step)
        merge_to_broadcast_s = time.time() - t0
        log.info("step %d: fragment %d -> version %d from %s (merge %.2fs, total %.2fs%s)", a.step, fid, a.version,
                 ",".join(m.island for m in a.members), merge_s, merge_to_broadcast_s,
                 ", redone after a restart" if redone else "")
        # The whole sync (merge, checkpoint, broadcast): what adaptive grace subtracts.
        return MergeDone(step=a.step, fragment=fid, version=a.version, merge_to_broadcast_s=merge_to_broadcast_s,
                           now=time.time()), seqs

    async def cleanup(self, fid: int, seqs: list[int]) -> None:
        """Delete the round's pushes and tape the tries that never completed."""
        # Cleanup after MergeDone, off the commit path: with the PUSH leader dead a purge waits out the
        # JetStream API timeout (30 s per round was seen in a cluster), and a missed purge is harmless (the
        # next commit of this fragment purges up to its own last sequence; max_age is the safety net).
        await self.purge_round(fid, seqs)
        await self.delete_seqs(self.ledger.pop_swept())
        await self.tape_dropped_tries()   # after MergeDone: the next round never waits on these records

    async def tape_dropped_tries(self) -> None:
        # An incomplete try never reached the machine, so this is its one record on the tape.
        for d in self.ledger.pop_dropped():
            island, gen, fid, step, attempt, try_ = d.key
            self.counters["push.dropped_incomplete"] += 1
            await self.tape.write({"kind": "disposition", "t": time.time(), "step": step, "fragment": fid,
                              "attempt": attempt, "try": try_, "island": island, "gen": gen,
                              "disposition": "out_of_round", "reason": d.reason, "base_version": d.base_version,
                              "detail": {"chunks_in": d.chunks_in, "chunks": d.chunks, "local_step": d.local_step}},
                             kind="disposition")

    async def purge_round(self, fid: int, seqs: list[int]) -> None:
        if not seqs:
            return
        # One purge per fragment subject up to the round's last sequence: no later round of this fragment
        # can have pushed yet (its pull is launched only after this commit).
        try:
            await self.js.purge_stream(S.stream(self.run_id, "PUSH"), subject=S.push_fragment_all(self.run_id, fid),
                                       seq=max(seqs) + 1)
        except Exception as exc:
            self.counters["purge_error"] += 1
            log.warning("purging PUSH after the commit failed (max_age will expire them): %r", exc)

    async def delete_seqs(self, seqs) -> None:
        await delete_push_seqs(self.js, self.run_id, self.counters, seqs)
