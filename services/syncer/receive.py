"""The syncer's intake: four durable pull consumers (CTL: hello, ack; HB: heartbeats, the newest per island;
INIT: initial weights; PUSH: push chunks) turned into round-machine events on the shell's queue.

Invariants: bad input from the wire (malformed JSON, schema violations, wrong sizes, NaN/Inf INIT values,
unknown fragment, digest mismatch, an island id that does not match its subject, a protocol version
outside the accepted range: schemas/versions.py) is acked (never redelivered), counted, written to the
EVENTS tape, and changes no state. Per identity (the subject's island token), CTL and heartbeat messages
beyond a rate are dropped before they are decoded, and rejections beyond a rate are taped once per burst
(services/syncer/intake_limit.py). Push chunks are checked and acked at once, their payloads left in the
stream (the ledger records where); a push holding NaN/Inf is well-formed but poisonous: its chunks' norms
and non-finite counts go to the round machine, which quarantines it. INIT chunk bytes wait in
`init_pending` until the machine answers InitStore or InitDrop, and intake pauses while too many of them
wait (`_init_room`), so INIT is bounded in memory and never stalls intake for good.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from typing import Awaitable, Callable

import torch

from yeto.schemas import codec, subjects as S
from yeto.schemas import outer_mode as OM
from yeto.schemas.chunks import check_chunk, chunk_plan, plan_nbytes
from yeto.schemas.errors import WireError
from yeto.schemas.ids import GEN_RE
from yeto.schemas.layout import layout_fingerprint
from yeto.schemas import messages as M
from yeto.schemas.versions import VersionError
from yeto.services.syncer.actions import InitDrop, InitStore, SendError
from yeto.services.syncer.events import FinalAck, Heartbeat, Hello, InitChunk, PushComplete
from yeto.services.syncer.intake import PushLedger
from yeto.services.syncer.intake_limit import IntakeLimits
from yeto.services.syncer import sparse_merge as SM
from yeto.services.syncer.merge import delete_push_seqs, read_push_bytes
from yeto.services.syncer.model_store import ModelStore
from yeto.services.syncer.outer import delta_view
from yeto.services.syncer.speculate import Speculator
from yeto.services.syncer.tape import TapeWriter

log = logging.getLogger("yeto.syncer")

INIT_PENDING_BYTES = 16 << 20   # INIT chunk bytes waiting for the machine's InitStore/InitDrop before intake pauses
DELETE_IN_FLIGHT = 32          # refused push chunks deleted at once (off intake's path)
INIT_ROOM_WAIT_S = 5.0          # the longest one chunk waits for room (well under the INIT consumer's 60 s ack wait)


class Receiver:
    def __init__(self, js, run_id: str, counters: Counter, model: ModelStore, ledger: PushLedger, tape: TapeWriter,
                 queue: asyncio.Queue, send_error: Callable[[SendError], Awaitable[None]], *,
                 speculator: Speculator | None = None):
        self.js, self.run_id, self.counters = js, run_id, counters
        self.model, self.ledger, self.tape, self.queue, self.send_error = model, ledger, tape, queue, send_error
        self._doomed: list[int] = []                   # refused push chunks to delete (_delete_later)
        self._deleter: asyncio.Future | None = None
        self.limits = IntakeLimits()   # per-identity bounds on CTL/heartbeat intake and on taped rejections
        self.init_pending: dict[tuple[str, int, int], tuple] = {}   # (gen, fragment, chunk) -> (span, values)
        self.init_pending_bytes = 0
        self.spec = speculator   # the speculative merge (speculate.py), told of every push chunk recorded
        self._outer: OM.SparseOuter | None = None   # the pinned session's sparse settings (`outer`)
        self._outer_of: dict | None = None          # ... read from this session record

    async def consume(self, kind: str, durable: str, handler, batch: int, *,
                      ready: Callable[[], bool] | None = None) -> None:
        """Fetch and handle `kind` messages forever. `ready` (a follower shard's INIT and PUSH): fetch
        nothing until it says so (the session is adopted): an INIT chunk refused for want of a session
        would be gone from the work queue for good, and an island may send it as soon as it reads the
        session the coordinator pinned, before this shard's next look at the state KV."""
        import nats.errors

        sub = await self.js.pull_subscribe_bind(durable, stream=S.stream(self.run_id, kind))
        while True:
            if ready is not None and not ready():
                await asyncio.sleep(0.05)
                continue
            try:
                msgs = await sub.fetch(batch, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reconnects, 503s: back off and carry on
                self.counters[f"fetch_error.{kind}"] += 1
                log.debug("fetch on %s failed: %r", kind, exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    await handler(msg)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # A handler bug must not kill intake; the message is acked so it cannot loop.
                    self.counters[f"handler_error.{kind}"] += 1
                    log.exception("handling a %s message failed: %r", kind, exc)
                try:
                    await msg.ack()
                except Exception:
                    self.counters["ack_error"] += 1

    async def reject(self, where: str, exc: Exception | str, *, island: str | None = None, gen: str | None = None,
                      extra: dict | None = None) -> None:
        code = getattr(exc, "code", "invalid")
        self.counters[f"rejected.{code}"] += 1
        self.counters["rejected"] += 1
        reason = f"{where}: {exc}"
        # `island` is the subject's island token wherever the subject has one: the publisher's identity
        if not self.limits.tape(island or "?", code, time.monotonic()):
            self.counters["rejected.untaped"] += 1   # one record per burst: flush_limits
            log.debug("rejected %s (not taped: rate limit)", reason)
            return
        log.warning("rejected %s", reason)
        rec = {"kind": "error", "reason": reason[:2000]}
        if island is not None:
            rec["island"] = island
        if gen is not None:
            rec["gen"] = gen
        detail = {"code": code, "where": where}
        if isinstance(exc, WireError) and exc.field is not None:
            detail["field"] = exc.field
        if extra:
            detail.update(extra)
        rec["detail"] = detail
        await self.tape.write(rec, kind="error")

    async def flush_limits(self, *, force: bool = False) -> None:
        """Tape one record per burst of rejections left untaped by the rate limit (intake_limit.py)."""
        for s in self.limits.take_summaries(time.monotonic(), force=force):
            log.warning("rejected %d more messages from %s in %.1f s without taping each (rate limit): %s",
                        s["count"], s["identity"], s["last_at"] - s["first_at"], s["codes"])
            await self.tape.write({"kind": "error", "island": s["identity"],
                                   "reason": f"rate limited: {s['count']} more rejections from {s['identity']} in "
                                             f"{s['last_at'] - s['first_at']:.1f} s were counted, not taped one by one",
                                   "detail": {"code": "rate_limited", "suppressed": s["count"], "codes": s["codes"]}},
                                  kind="error")

    async def on_ctl(self, msg) -> None:
        tokens = S.parse(self.run_id, msg.subject)   # ctl.<kind>.<island> (the consumer's filters)
        subj_island = tokens[2] if len(tokens) == 3 else None
        if not self.limits.allow(subj_island or "?", time.monotonic()):
            # dropped before it is decoded: a flood from one identity costs the syncer almost nothing
            self.counters[f"rate_limited.{tokens[1] if len(tokens) > 1 else 'ctl'}"] += 1
            return
        try:
            kind, m = codec.decode_typed(msg.data, allowed=("hello", "heartbeat", "ack"))
        except VersionError as exc:
            await self.refuse_protocol(msg.subject, exc, subj_island)
            return
        except WireError as exc:
            await self.reject(f"ctl message on {msg.subject}", exc, island=subj_island)
            return
        if m["run"] != self.run_id or m["island"] != subj_island:
            await self.reject(f"{kind} on {msg.subject}",
                               WireError("island/run in the message does not match its subject", field="island",
                                         value=m["island"], code="subject_mismatch"), island=subj_island)
            return
        now = time.time()
        if kind == "hello":
            # The machine compares later hellos by their *claimed* fingerprint: make sure the claim is
            # the layout's own (pinning checks this too), or a hello could bring another layout in.
            try:
                own_fp = layout_fingerprint(m["layout"])
            except WireError as exc:
                own_fp, why = None, f"layout refused: {exc}"
            else:
                why = f"layout_fingerprint {m['layout_fingerprint']} is not its layout's fingerprint {own_fp}"
            if own_fp != m["layout_fingerprint"]:
                err = WireError(why, field="layout_fingerprint", value=m["layout_fingerprint"], code="layout_mismatch")
                await self.reject(f"hello on {msg.subject}", err, island=m["island"], gen=m["gen"])
                await self.send_error(SendError(m["island"], m["gen"], "layout_mismatch", why, True, "layout_fingerprint"))
                return
            await self.queue.put(Hello(island=m["island"], gen=m["gen"], layout=m["layout"],
                                         layout_fingerprint=m["layout_fingerprint"], push_dtype=m["push_dtype"],
                                         bulk_dtype=m["bulk_dtype"], now=now, software=m.get("software")))
        elif kind == "heartbeat":
            await self.queue.put(Heartbeat(island=m["island"], gen=m["gen"], local_step=m["local_step"],
                                             step_time_s=m.get("step_time_s"), now=now,
                                             leaving=bool(m.get("leaving", False))))
        else:
            await self.queue.put(FinalAck(island=m["island"], gen=m["gen"], final_step=m["final_step"], now=now))

    async def refuse_protocol(self, subject: str, exc: VersionError, subj_island: str | None) -> None:
        """A message in a protocol this syncer does not accept (schemas/versions.py): counted and taped like
        any refusal; a hello is also answered with a fatal error carrying the same line (both versions
        named), so the island stops and says why instead of waiting for a session that never comes. Only
        to the island the subject names, and only with a well-formed generation: the error's own schema."""
        gen = exc.gen if isinstance(exc.gen, str) and GEN_RE.fullmatch(exc.gen) else None
        await self.reject(f"{exc.kind} on {subject}", exc, island=subj_island, gen=gen)
        if exc.kind == "hello" and gen is not None and subj_island is not None and exc.island == subj_island:
            await self.send_error(SendError(subj_island, gen, exc.code, str(exc), True, "v"))

    async def on_init(self, msg) -> None:
        """One INIT chunk: its framing is checked here (bad ones are refused, counted and taped); which
        generation's chunks make version 0 is the round machine's decision (InitChunk -> InitStore /
        InitDrop). The bytes wait in `init_pending` until it decides (intake pauses while too many wait)."""
        head: M.InitChunk | None = None
        try:
            head = M.InitChunk.from_header((msg.headers or {}).get(codec.CHUNK_HEADER, ""))
            if self.model.session is None:
                raise WireError("INIT chunk before the session is pinned", field="fragment", value=head.fragment, code="no_session")
            if head.run != self.run_id:
                raise WireError(f"INIT chunk of another run on run {self.run_id}'s stream", field="run",
                                value=head.run, code="subject_mismatch")
            fid = head.fragment
            fr = self.model.frags.get(fid)
            if fr is None:
                raise WireError("unknown fragment", field="fragment", value=fid, code="unknown_fragment")
            if head.dtype != self.model.session["bulk_dtype"]:
                raise WireError(f"INIT dtype must be the session's bulk dtype {self.model.session['bulk_dtype']}", field="dtype", value=head.dtype)
            spans = chunk_plan(fr.numel, head.dtype, self.model.session["chunk_bytes"])
            span = check_chunk(spans, head.to_wire(), msg.data)
            k = span.index
            values = delta_view(msg.data, head.dtype, span.elem_count)
            if not bool(torch.isfinite(values).all()):
                raise WireError("INIT values must be finite", field="payload", value=f"chunk {k}", code="non_finite")
        except WireError as exc:
            await self.reject(f"INIT chunk on {msg.subject}", exc, island=head and head.island, gen=head and head.gen)
            return
        key = (head.gen, fid, k)
        if key in self.init_pending:
            self.counters["init.duplicate_chunk"] += 1
            return
        await self._init_room()
        self.init_pending[key] = (span, values)
        self.init_pending_bytes += values.numel() * values.element_size()
        await self.queue.put(InitChunk(island=head.island, gen=head.gen, fragment=fid, chunk=k,
                                         chunks=len(spans), now=time.time()))

    async def _init_room(self) -> None:
        """Wait while the machine has more INIT bytes to answer than INIT_PENDING_BYTES (the machine loop
        is slower than a fetch: unbounded, one syncer held 3.3x the model during INIT in
        bench/syncer_memory.py); never longer than INIT_ROOM_WAIT_S per chunk, so chunks held for a hello
        that has not arrived yet can never stall intake for good."""
        if self.init_pending_bytes < INIT_PENDING_BYTES:
            return
        self.counters["init.intake_paused"] += 1
        deadline = time.monotonic() + INIT_ROOM_WAIT_S
        while self.init_pending_bytes >= INIT_PENDING_BYTES:
            if time.monotonic() >= deadline:
                self.counters["init.intake_pause_timeout"] += 1
                return
            await asyncio.sleep(0.01)

    async def on_push(self, msg) -> None:
        seq = msg.metadata.sequence.stream
        tokens = S.parse(self.run_id, msg.subject)   # push.<island>.<fragment>
        subj_island = tokens[1] if len(tokens) == 3 else None
        try:
            head = M.PushChunk.from_header((msg.headers or {}).get(codec.CHUNK_HEADER, ""))
            head.check_subject(self.run_id, subj_island, tokens[-1])
        except WireError as exc:
            await self.reject(f"push chunk on {msg.subject}", exc, island=subj_island)
            self._delete_later(seq)
            return
        meta = head.to_wire()   # the ledger's and the speculator's record of the chunk
        why_closed = self.ledger.closed(meta, redelivered=msg.metadata.num_delivered > 1)
        if why_closed is not None:
            # A redelivery (or a late resend) of a chunk no round can use: drop it, it opens no try.
            self.counters["push.late_chunk"] += 1
            log.debug("push chunk on %s dropped: %s", msg.subject, why_closed)
            self._delete_later(seq)
            return
        ok, reason, expected_total = True, None, None
        sumsq, non_finite = 0.0, 0
        fr = self.model.frags.get(meta["fragment"])
        if self.model.session is None or fr is None:
            # No round can ever target it: refuse the chunk here (tape + counter) rather than let a
            # try that cannot complete sit in the ledger.
            why = ("no session pinned yet" if self.model.session is None
                   else f"the session has {len(self.model.session['fragments'])} fragments" if self.model.owns(meta["fragment"])
                   else f"fragment of another syncer shard than shard {self.model.shard}/{self.model.shards}")
            await self.reject(f"push chunk on {msg.subject}",
                               WireError(f"unknown fragment ({why})", field="fragment", value=meta["fragment"],
                                         code="unknown_fragment"), island=subj_island, gen=meta["gen"])
            self._delete_later(seq)
            return
        else:
            try:
                outer = self.outer()
                SM.check_encoding(meta, outer)   # a sparse push in a dense run, or the other way: refused
                want = self.ledger.push_dtype(meta["fragment"], meta["step"], meta["attempt"], self.model.session["push_dtype"])
                if meta["dtype"] != want:
                    whose = "session's" if want == self.model.session["push_dtype"] else "round's (yeto run set)"
                    raise WireError(f"push dtype must be the {whose} {want}", field="dtype", value=meta["dtype"])
                if outer is not None:
                    # one message in opaque byte chunks: decoded whole once the try completes (below)
                    spans = SM.push_spans(self.model.session["fragments"][meta["fragment"]], outer,
                                          self.model.session["chunk_bytes"])
                    expected_total = plan_nbytes(spans)
                    check_chunk(spans, meta, msg.data)
                else:
                    spans = chunk_plan(fr.numel, meta["dtype"], self.model.session["chunk_bytes"])
                    expected_total = plan_nbytes(spans)
                    span = check_chunk(spans, meta, msg.data)
                    values = delta_view(msg.data, meta["dtype"], span.elem_count)  # a view: no copy per chunk
                    # The quarantine figures, one chunk at a time (never the whole push in memory); the round
                    # machine decides (NaN/Inf, --max-push-norm, --outlier-factor). Squares of f32 values
                    # summed in float64 cannot overflow, so a non-finite sum means NaN/Inf values.
                    sumsq = float(torch.linalg.vector_norm(values, dtype=torch.float64)) ** 2
                    if not math.isfinite(sumsq):
                        non_finite, sumsq = values.numel() - int(torch.isfinite(values).sum()), 0.0
            except WireError as exc:
                # The try is invalid (its disposition says so once complete), but a try whose other
                # chunks never come would never be taped: tape the chunk's rejection now.
                ok, reason = False, str(exc)
                await self.reject(f"push chunk on {msg.subject}", exc, island=subj_island, gen=meta["gen"],
                                   extra={"step": meta["step"], "attempt": meta["attempt"], "try": meta["try"],
                                          "chunk": meta["chunk"]})
        # the checked payload is handed on: within its budget the ledger keeps it for the merge
        t = self.ledger.add(meta, seq, expected_total=expected_total, chunk_ok=ok, chunk_reason=reason,
                            sumsq=sumsq, non_finite=non_finite, payload=msg.data if ok else None)
        if self.spec is not None and ok:
            self.spec.on_chunk(meta)
        if t is not None:
            island, gen, fid, step, attempt, try_ = t.key
            norm = t.norm
            if t.invalid is None and self.outer() is not None:
                norm = await self._decode_sparse(t, subj_island)
            await self.queue.put(PushComplete(
                island=island, gen=gen, fragment=fid, step=step, attempt=attempt, try_=try_,
                base_version=t.base_version, local_step=t.local_step, c_steps=t.c_steps, c_tokens=t.c_tokens,
                valid=t.invalid is None, reason=t.invalid, now=time.time(), norm=norm, non_finite=t.non_finite))

    def outer(self) -> OM.SparseOuter | None:
        """The run's sparse settings (None: dense), read from the pinned session once per session record."""
        s = self.model.session
        if s is not self._outer_of:
            self._outer, self._outer_of = OM.from_session(s), s
        return self._outer

    async def _decode_sparse(self, t, island: str | None) -> float:
        """A complete sparse try decoded whole (its chunks kept at intake, else read back from PUSH) and the
        decoded tensors kept for the merge (PushLedger.keep_decoded): its norm for the quarantine rules, or, for bytes the decoder refuses, the try made invalid (counted,
        taped; the merge never sees it). Returns the norm (0 for a refused try)."""
        island_, gen, fid, step, attempt, try_ = t.key
        try:
            parts = [t.held.get(k) for k in range(t.chunks)]
            for k, part in enumerate(parts):
                if part is None:
                    parts[k] = await read_push_bytes(self.js, self.run_id, t.seqs[k], t.digests[k])
            data = b"".join(bytes(p) for p in parts)
            push, norm = await asyncio.to_thread(SM.decode_norm, self.model.session["fragments"][fid], self.outer(), data)
            # kept for the merge (no second read and decode) within the push budget; else it reads PUSH
            self.counters["push.sparse_decoded_kept" if self.ledger.keep_decoded(t, push)
                          else "push.sparse_decoded_not_kept"] += 1
            return norm
        except Exception as exc:
            # refused bytes (DecodeError naming the field), a chunk gone from PUSH (MergeError), or a read
            # that failed: the try is invalid now, never left without its PushComplete
            t.invalidate(f"sparse push refused: {exc}")
            await self.reject(f"sparse push of {island_} step {step}", exc, island=island, gen=gen,
                              extra={"step": step, "attempt": attempt, "try": try_})
            return 0.0

    def _delete_later(self, seq: int) -> None:
        """Delete a refused push chunk from PUSH off intake's path: awaited one by one, the deletes held a
        flood of garbage on one island's push subject to ~90 chunks a second (a round trip each), and the
        honest pushes behind it waited. Several deletes are in flight at once; a failure is
        counted (max_age is the safety net)."""
        self._doomed.append(seq)
        if self._deleter is None or self._deleter.done():
            self._deleter = asyncio.ensure_future(self._delete_doomed())

    async def _delete_doomed(self) -> None:
        while self._doomed:
            batch, self._doomed = self._doomed[:DELETE_IN_FLIGHT], self._doomed[DELETE_IN_FLIGHT:]
            await asyncio.gather(*(delete_push_seqs(self.js, self.run_id, self.counters, [q]) for q in batch))

    def store_init(self, a: InitStore) -> None:
        span, values = self.init_pending.pop((a.gen, a.fragment, a.chunk))
        self.init_pending_bytes -= values.numel() * values.element_size()
        self.model.init_chunk(a.fragment, span.elem_offset, values)

    def drop_init(self, a: InitDrop) -> None:
        dropped = self.init_pending.pop((a.gen, a.fragment, a.chunk), None)
        if dropped is not None:
            self.init_pending_bytes -= dropped[1].numel() * dropped[1].element_size()
        self.counters[f"init.dropped.{a.reason}"] += 1
