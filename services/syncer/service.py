"""The syncer's I/O shell: NATS JetStream in, the round machine in the middle, checkpoint + NATS out.

Three durable pull consumers feed one event queue (CTL: hello/heartbeat/ack; INIT: initial weights;
PUSH: push chunk headers + payloads, checked and acked at once, payloads left in the stream); one task
feeds the queue's events to the pure `RoundMachine` and carries out its actions in order. Long actions
(a merge, version 0, the final cut) run as tasks that feed their completion back as events, so intake
never stops while a fragment is merged.

Memory: params and momentum of every fragment (f32) plus O(members x chunk) bytes for a merge — the
pushes wait in JetStream and are read back chunk by chunk with direct gets.

Bad input from the wire (malformed JSON, schema violations, wrong sizes, NaN/Inf INIT values, unknown
fragment, digest mismatch, an island id that does not match its subject) is acked (never redelivered),
counted, written to the EVENTS tape, and changes no state. A push holding NaN/Inf is well-formed but
poisonous: its chunks' norms and non-finite counts go to the round machine, which quarantines it.

Status for operators: every `status_every_s` (`--status-every`) and at exit the syncer logs one status
line and writes the `state` KV key `syncer` (see `status_record`): phase, committed step, versions,
live members, in-flight rounds, and the counters of the shell (`counters`: rejected.<code>, publish
retries, bytes broadcast, ...) and of the round machine (`rounds`: disposition.<d>, restart, merge, ...).
`nats kv get yeto_<run>_state syncer` shows it without touching the syncer.

State KV key `pulls` ({"attempts": {step: highest attempt published}}) is written *before* a pull is
published, so a restarted syncer relaunches an in-flight round with a higher attempt (a new pull id)
even when the round was launched after the last checkpoint.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import torch

from schemas import codec, subjects as S
from schemas.chunks import VersionDigest, check_chunk, chunk_header, digest as chunk_digest, max_chunk_bytes, plan_nbytes
from schemas.conn import ConnectOptions, connect, server_max_payload
from schemas.dtypes import pack
from schemas.errors import WireError
from schemas.layout import layout_fingerprint
from schemas.chunks import chunk_plan
from schemas.provision import RunLimits, kv as kv_handle, kv_put, provision_run
from schemas.publish import Pipeline, publish_retry
from services.syncer import rounds as R
from services.syncer.checkpoint import CheckpointDir, CheckpointError, CheckpointState
from services.syncer.intake import PushLedger
from services.syncer.outer import delta_view, outer_step_
from services.syncer.recording import INPUT_KIND, InputRecorder

log = logging.getLogger("yeto.syncer")
# Per-chunk ack wait of a broadcast (seconds): after a cluster node's death an ack can be lost without a
# reconnect; each lost wait stalls the round (30 s, nats-py's default, was seen in bench/chaos.py --cluster).
BCAST_ACK_S = 10.0

FETCH_BATCH = 64            # messages per fetch; chunk payloads <= 8 MiB keeps a batch well under 32 MiB (trap 4)
PUSH_FETCH_BATCH = 8
DIRECT_GET_TIMEOUT = 30.0
# Control publishes (pulls, errors, shutdown, manifests) ride out a cluster leader election (seconds;
# publish_retry's default 8 attempts last about 7 s): a PublishFailed here stops the syncer.
CTL_PUBLISH_ATTEMPTS = 40
# Tape records other than a commit's get a short direct budget (intake never waits long on one); one that
# does not land in it (an EVENTS leader election, a broker restart) waits in an in-order backlog that a
# background task retries with the long budget, instead of being dropped (issue 16). Bounded: past
# TAPE_BACKLOG_MAX waiting records a new one is dropped (counter `tape_dropped`).
TAPE_DIRECT_ATTEMPTS = 3
TAPE_RETRY_ATTEMPTS = 40
TAPE_BACKLOG_MAX = 10_000
TAPE_FLUSH_AT_EXIT_S = 20.0


class SyncerError(RuntimeError):
    pass


@dataclass
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9


@dataclass
class ServiceConfig:
    machine: R.SyncerConfig
    outer: OuterConfig
    connect: ConnectOptions
    checkpoint_dir: Path
    resume: bool = False
    limits: RunLimits = field(default_factory=RunLimits)
    tick_s: float = 0.2
    status_every_s: float = 5.0


@dataclass
class _Frag:
    numel: int
    params: torch.Tensor | None = None
    momentum: torch.Tensor | None = None


class SyncerService:
    def __init__(self, cfg: ServiceConfig):
        self.cfg = cfg
        self.run_id = cfg.machine.run
        self.counters: Counter = Counter()
        self.machine: R.RoundMachine | None = None
        self.ckpt = CheckpointDir(cfg.checkpoint_dir)
        self.ledger = PushLedger()
        self.frags: dict[int, _Frag] = {}
        self.session: dict | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done: R.Done | None = None
        self.nc = None
        self.js = None
        self.state_kv = None
        self.members_kv = None
        self._tasks: list[asyncio.Task] = []
        self._tape_seq = 0
        self._tape_prefix = f"{int(time.time() * 1000):x}"
        self._final_digests: dict[int, str] = {}
        self._attempts_seen: dict[int, int] = {}
        self._round_started: dict[int, float] = {}
        self._status_t = 0.0
        self._started_at = time.time()
        self._pulls_written: dict[int, int] = {}
        self._init_pending: dict[tuple[str, int, int], tuple] = {}   # (gen, fragment, chunk) -> (span, values)
        self._tape_backlog: collections.deque[tuple[str, bytes, str]] = collections.deque()
        self._tape_retrier: asyncio.Task | None = None
        self.recorder = InputRecorder(self._tape_prefix)
        self._pending_inputs: dict | None = None   # an input record the recorder handed back, not yet taped

    # ---- lifecycle --------------------------------------------------------------------------------

    async def run(self) -> int:
        self.nc = await connect(self.cfg.connect, name=f"yeto-syncer-{self.run_id}", max_reconnect_attempts=-1,
                                error_cb=self._on_error, disconnected_cb=self._on_disconnect,
                                reconnected_cb=self._on_reconnect)
        self.js = self.nc.jetstream(timeout=30)
        try:
            bound = max_chunk_bytes(server_max_payload(self.nc))
            if self.cfg.machine.chunk_bytes > bound:
                log.warning("--chunk-bytes %d exceeds what the server's max_payload %d allows with headers; using %d",
                            self.cfg.machine.chunk_bytes, server_max_payload(self.nc), bound)
                self.cfg.machine = dataclasses.replace(self.cfg.machine, chunk_bytes=bound)
            report = await provision_run(self.js, self.run_id, self.cfg.limits, push_headers_only=False)
            log.info("provisioned run %s: %s", self.run_id, report)
            self.state_kv = await kv_handle(self.js, self.run_id, "state")
            self.members_kv = await kv_handle(self.js, self.run_id, "members")
            await self._start_machine()
            self._tasks = [
                asyncio.create_task(self._consume("CTL", S.SYNCER_CTL_CONSUMER, self._on_ctl, FETCH_BATCH)),
                asyncio.create_task(self._consume("INIT", S.SYNCER_INIT_CONSUMER, self._on_init, FETCH_BATCH)),
                asyncio.create_task(self._consume("PUSH", S.SYNCER_PUSH_CONSUMER, self._on_push, PUSH_FETCH_BATCH)),
            ]
            await self._main_loop()
        finally:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._tape_inputs(force=True)
            await self._flush_tape_backlog()
            if self.machine is not None and self.state_kv is not None:
                try:  # the last status record (counters at exit) for operators and post-mortems
                    await asyncio.wait_for(self._write_status(final=True), 5)
                except BaseException as exc:  # noqa: BLE001 - never mask the real exit reason
                    log.warning("writing the final status record failed: %r", exc)
            try:
                # drain() waits for every subscription (up to 30 s by default); everything that matters
                # was acked or published already, so a flush and close is enough.
                await asyncio.wait_for(self.nc.flush(), 5)
            except Exception:
                pass
            await self.nc.close()
        if self.done is None:
            return 1
        if not self.done.ok:
            log.error("finalization timed out; no ack from: %s", ", ".join(self.done.missing))
            return 3
        log.info("run %s finished: %d rounds committed", self.run_id, self.machine.committed_step)
        return 0

    async def _on_error(self, exc):
        self.counters["nats_error"] += 1
        log.warning("nats error: %r", exc)

    async def _on_disconnect(self):
        self.counters["disconnects"] += 1
        log.warning("disconnected from NATS; reconnecting")

    async def _on_reconnect(self):
        log.info("reconnected to NATS")

    async def _start_machine(self) -> None:
        mc = self.cfg.machine
        kv_session = await self._kv_get(self.state_kv, "session")
        if self.cfg.resume:
            if not self.ckpt.exists():
                raise SyncerError(f"--resume: no checkpoint in {self.ckpt.path} (missing checkpoint.json)")
            state = self.ckpt.read_state()
            session = self.ckpt.read_session()
            if state.run != self.run_id:
                raise SyncerError(f"--resume: checkpoint {self.ckpt.path} belongs to run {state.run!r}, not {self.run_id!r}")
            if kv_session is not None and kv_session.get("session_fingerprint") != session["session_fingerprint"]:
                raise SyncerError(
                    f"--resume: checkpoint {self.ckpt.path} holds another layout (session fingerprint "
                    f"{session['session_fingerprint'][:12]}…) than run {self.run_id}'s state KV "
                    f"({kv_session.get('session_fingerprint', '?')[:12]}…)")
            if len(session["fragments"]) != mc.fragments:
                raise SyncerError(f"--resume: checkpoint has {len(session['fragments'])} fragments, --fragments is {mc.fragments}")
            commit = await self._kv_get(self.state_kv, "commit")
            if commit is not None and int(commit.get("committed_step", 0)) > state.committed_step:
                raise SyncerError(
                    f"--resume: state KV says step {commit['committed_step']} is committed but checkpoint "
                    f"{self.ckpt.path} holds only step {state.committed_step}: wrong checkpoint directory?")
            self._set_session(session)
            self.ledger = PushLedger(committed_step=state.committed_step)
            for fid, fr in self.frags.items():
                try:
                    fr.params, fr.momentum = self.ckpt.load_fragment(fid, state.versions[fid], fr.numel)
                except (CheckpointError, KeyError) as exc:
                    raise SyncerError(f"--resume: checkpoint {self.ckpt.path} is incomplete: {exc}") from None
            # The checkpoint is the source of truth for bytes: check it against the digests it recorded
            # (and broadcast) before serving it again.
            digests = {}
            for fid in sorted(self.frags):
                digests[fid] = await asyncio.to_thread(self._bulk_digest, fid, session["bulk_dtype"])
                want = state.version_digests.get(fid)
                if want is not None and digests[fid] != want:
                    raise SyncerError(
                        f"--resume: checkpoint {self.ckpt.path} fragment {fid} version {state.versions[fid]} has "
                        f"version digest {digests[fid][:12]}…, the checkpoint recorded {want[:12]}…: corrupt checkpoint")
            members = await self._read_members()
            final_record = state.final_record
            if state.final and final_record is None:
                # Marked final by a syncer that kept no finalization record (before records existed):
                # the run ended then.
                final_record = {"final_step": state.committed_step, "finished": True}
            # Attempts already published: those recorded at the last commit, and (state KV `pulls`,
            # written before each pull) those launched after it.
            published = dict(state.attempts)
            pulls = await self._kv_get(self.state_kv, "pulls")
            for k, a in ((pulls or {}).get("attempts") or {}).items():
                if int(k) > state.committed_step:
                    published[int(k)] = max(published.get(int(k), 0), int(a))
            restore = {"session": session, "versions": {str(k): v for k, v in state.versions.items()},
                       "committed_step": state.committed_step, "members": members, "now": time.time(),
                       "min_attempts": {str(s): a + 1 for s, a in published.items()}, "final": final_record}
            try:
                self.machine = R.RoundMachine.restore(
                    mc, session, state.versions, state.committed_step, members, now=restore["now"],
                    min_attempts={s: a + 1 for s, a in published.items()}, final=final_record,
                )
            except ValueError as exc:  # flags that contradict the checkpointed session
                raise SyncerError(f"--resume: {exc}") from None
            await self._tape(self.recorder.start(mc, restore, time.time()), kind=INPUT_KIND)
            self._attempts_seen = dict(published)
            # Bring the state KV in line with the checkpoint (the checkpoint is written first).
            await self._write_commit_record(state)
            # A crash between the durable commit and its tape records: write the ones the tape lacks.
            await self._retape(state)
            if final_record is not None and not final_record.get("finished"):
                # Finalization continues: manifests carry the f32 cut's digests (the cut is in FINAL).
                self._final_digests = {fid: await asyncio.to_thread(self._bulk_digest, fid, "f32")
                                       for fid in sorted(self.frags)}
            if final_record is not None and final_record.get("finished"):
                log.info("run %s already finished at step %d (final cut in FINAL; export it with `yeto export`): "
                         "nothing to do", self.run_id, state.committed_step)
                # A run finished by a syncer that wrote no final record (or lost it): write it now.
                self._final_digests = {fid: await asyncio.to_thread(self._bulk_digest, fid, "f32")
                                       for fid in sorted(self.frags)}
                await self._write_final_kv(int(final_record.get("final_step", state.committed_step)), state.versions)
            # A crash between the durable commit and the end of its broadcast leaves BCAST without the
            # newest version: broadcast the checkpointed cut again. Same bytes, same Nats-Msg-Ids, so
            # JetStream drops what it already holds inside the duplicate window; islands ignore a
            # version they already hold.
            if not state.final:
                for fid in sorted(self.frags):
                    await self._broadcast(fid, state.versions[fid], digests[fid])
            log.info("resumed run %s from %s at step %d, versions %s", self.run_id, self.ckpt.path,
                     state.committed_step, state.versions)
            await self._tape({"kind": "restart", "step": state.committed_step + 1, "fragment": mc.fragment_of(state.committed_step + 1),
                              "attempt": 1, "reason": "syncer resumed from checkpoint"}, kind="restart")
            self._apply(self._feed(R.Tick(now=time.time())))
        else:
            if self.ckpt.exists():
                raise SyncerError(
                    f"checkpoint directory {self.ckpt.path} already holds a checkpoint: pass --resume to continue "
                    f"it, or choose another --checkpoint-dir")
            if kv_session is not None:
                raise SyncerError(
                    f"run {self.run_id} already has a session in its state KV: pass --resume (with its checkpoint "
                    f"directory) or remove the run with `yeto run rm {self.run_id}`")
            self.machine = R.RoundMachine(mc)
            await self._tape(self.recorder.start(mc, None, time.time()), kind=INPUT_KIND)

    # ---- intake -----------------------------------------------------------------------------------

    async def _consume(self, kind: str, durable: str, handler, batch: int) -> None:
        import nats.errors

        sub = await self.js.pull_subscribe_bind(durable, stream=S.stream(self.run_id, kind))
        while True:
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

    async def _reject(self, where: str, exc: Exception | str, *, island: str | None = None, gen: str | None = None,
                      extra: dict | None = None) -> None:
        code = getattr(exc, "code", "invalid")
        self.counters[f"rejected.{code}"] += 1
        self.counters["rejected"] += 1
        reason = f"{where}: {exc}"
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
        await self._tape(rec, kind="error")

    async def _on_ctl(self, msg) -> None:
        tokens = msg.subject.split(".")
        # yeto.R.ctl.<kind>.<island>
        subj_island = tokens[4] if len(tokens) == 5 else None
        try:
            kind, m = codec.decode_typed(msg.data, allowed=("hello", "heartbeat", "ack"))
        except WireError as exc:
            await self._reject(f"ctl message on {msg.subject}", exc, island=subj_island)
            return
        if m["run"] != self.run_id or m["island"] != subj_island:
            await self._reject(f"{kind} on {msg.subject}",
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
                await self._reject(f"hello on {msg.subject}", err, island=m["island"], gen=m["gen"])
                await self._do(R.SendError(m["island"], m["gen"], "layout_mismatch", why, True, "layout_fingerprint"))
                return
            await self.queue.put(R.Hello(island=m["island"], gen=m["gen"], layout=m["layout"],
                                         layout_fingerprint=m["layout_fingerprint"], push_dtype=m["push_dtype"],
                                         bulk_dtype=m["bulk_dtype"], now=now))
        elif kind == "heartbeat":
            await self.queue.put(R.Heartbeat(island=m["island"], gen=m["gen"], local_step=m["local_step"],
                                             step_time_s=m.get("step_time_s"), now=now))
        else:
            await self.queue.put(R.FinalAck(island=m["island"], gen=m["gen"], final_step=m["final_step"], now=now))

    async def _on_init(self, msg) -> None:
        """One INIT chunk: its framing is checked here (bad ones are refused, counted and taped); which
        generation's chunks make version 0 is the round machine's decision (InitChunk -> InitStore /
        InitDrop). The bytes wait in `_init_pending` until it decides — never in a sleep."""
        meta: dict | None = None
        try:
            meta = codec.decode_header("init_chunk", (msg.headers or {}).get(codec.CHUNK_HEADER, ""))
            if self.session is None:
                raise WireError("INIT chunk before the session is pinned", field="fragment", value=meta["fragment"], code="no_session")
            if meta["run"] != self.run_id:
                raise WireError(f"INIT chunk of another run on run {self.run_id}'s stream", field="run",
                                value=meta["run"], code="subject_mismatch")
            fid = meta["fragment"]
            fr = self.frags.get(fid)
            if fr is None:
                raise WireError("unknown fragment", field="fragment", value=fid, code="unknown_fragment")
            if meta["dtype"] != self.session["bulk_dtype"]:
                raise WireError(f"INIT dtype must be the session's bulk dtype {self.session['bulk_dtype']}", field="dtype", value=meta["dtype"])
            spans = chunk_plan(fr.numel, meta["dtype"], self.session["chunk_bytes"])
            span = check_chunk(spans, meta, msg.data)
            k = span.index
            values = delta_view(msg.data, meta["dtype"], span.elem_count)
            if not bool(torch.isfinite(values).all()):
                raise WireError("INIT values must be finite", field="payload", value=f"chunk {k}", code="non_finite")
        except WireError as exc:
            await self._reject(f"INIT chunk on {msg.subject}", exc, island=meta and meta["island"], gen=meta and meta["gen"])
            return
        key = (meta["gen"], fid, k)
        if key in self._init_pending:
            self.counters["init.duplicate_chunk"] += 1
            return
        self._init_pending[key] = (span, values)
        await self.queue.put(R.InitChunk(island=meta["island"], gen=meta["gen"], fragment=fid, chunk=k,
                                         chunks=len(spans), now=time.time()))

    async def _on_push(self, msg) -> None:
        seq = msg.metadata.sequence.stream
        tokens = msg.subject.split(".")
        subj_island = tokens[3] if len(tokens) == 5 else None
        try:
            meta = codec.decode_header("push_chunk", (msg.headers or {}).get(codec.CHUNK_HEADER, ""))
        except WireError as exc:
            await self._reject(f"push chunk on {msg.subject}", exc, island=subj_island)
            await self._delete_seqs([seq])
            return
        if meta["run"] != self.run_id or meta["island"] != subj_island or tokens[4] != str(meta["fragment"]):
            await self._reject(f"push chunk on {msg.subject}",
                               WireError("island/fragment in the header does not match the subject", field="island",
                                         value=meta["island"], code="subject_mismatch"), island=subj_island)
            await self._delete_seqs([seq])
            return
        why_closed = self.ledger.closed(meta, redelivered=msg.metadata.num_delivered > 1)
        if why_closed is not None:
            # A redelivery (or a late resend) of a chunk no round can use: drop it, it opens no try.
            self.counters["push.late_chunk"] += 1
            log.debug("push chunk on %s dropped: %s", msg.subject, why_closed)
            await self._delete_seqs([seq])
            return
        ok, reason, expected_total = True, None, None
        sumsq, non_finite = 0.0, 0
        fr = self.frags.get(meta["fragment"])
        if self.session is None or fr is None:
            # No round can ever target it: refuse the chunk here (tape + counter) rather than let a
            # try that cannot complete sit in the ledger.
            why = "no session pinned yet" if self.session is None else f"the session has {len(self.frags)} fragments"
            await self._reject(f"push chunk on {msg.subject}",
                               WireError(f"unknown fragment ({why})", field="fragment", value=meta["fragment"],
                                         code="unknown_fragment"), island=subj_island, gen=meta["gen"])
            await self._delete_seqs([seq])
            return
        else:
            try:
                if meta["dtype"] != self.session["push_dtype"]:
                    raise WireError(f"push dtype must be the session's {self.session['push_dtype']}", field="dtype", value=meta["dtype"])
                spans = chunk_plan(fr.numel, meta["dtype"], self.session["chunk_bytes"])
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
                await self._reject(f"push chunk on {msg.subject}", exc, island=subj_island, gen=meta["gen"],
                                   extra={"step": meta["step"], "attempt": meta["attempt"], "try": meta["try"],
                                          "chunk": meta["chunk"]})
        t = self.ledger.add(meta, seq, expected_total=expected_total, chunk_ok=ok, chunk_reason=reason,
                            sumsq=sumsq, non_finite=non_finite)
        if t is not None:
            island, gen, fid, step, attempt, try_ = t.key
            await self.queue.put(R.PushComplete(
                island=island, gen=gen, fragment=fid, step=step, attempt=attempt, try_=try_,
                base_version=t.base_version, local_step=t.local_step, c_steps=t.c_steps, c_tokens=t.c_tokens,
                valid=t.invalid is None, reason=t.invalid, now=time.time(), norm=t.norm, non_finite=t.non_finite))

    # ---- the machine loop -------------------------------------------------------------------------

    async def _main_loop(self) -> None:
        while self.done is None:
            wake = self.machine.next_wakeup()
            timeout = self.cfg.tick_s
            if wake is not None:
                timeout = max(0.0, min(timeout, wake - time.time()))
            try:
                event = await asyncio.wait_for(self.queue.get(), timeout=timeout)
            except asyncio.TimeoutError:
                event = R.Tick(now=time.time())
            if isinstance(event, BaseException):
                raise event
            actions = self._feed(event)
            await self._tape_inputs()
            await self._apply_async(actions)
            await self._status()

    def _feed(self, event: R.Event) -> list[R.Action]:
        """Hand one event to the machine, recording it and what it produced for `yeto replay`."""
        try:
            actions = self.machine.handle(event)
        except Exception as exc:
            self._pending_inputs = self.recorder.add(event, None, time.time(), error=exc) or self.recorder.take(time.time())
            raise
        rec = self.recorder.add(event, actions, time.time())
        if rec is not None:
            self._pending_inputs = rec
        return actions

    async def _tape_inputs(self, *, force: bool = False) -> None:
        """Tape the input batch the recorder filled, or the one it holds once it is due (or at exit)."""
        rec, self._pending_inputs = self._pending_inputs, None
        if rec is not None:
            await self._tape(rec, kind=INPUT_KIND)
        now = time.time()
        if force or self.recorder.due(now):
            rec = self.recorder.take(now)
            if rec is not None:
                await self._tape(rec, kind=INPUT_KIND)

    def _apply(self, actions) -> None:
        """Queue actions produced outside the loop (at start) for the loop to carry out."""
        self._pending_actions = list(actions)

    async def _apply_async(self, actions) -> None:
        pending = getattr(self, "_pending_actions", None)
        if pending:
            self._pending_actions = []
            actions = list(pending) + list(actions)
        for a in actions:
            await self._do(a)

    async def _status(self) -> None:
        now = time.monotonic()
        if now - self._status_t < self.cfg.status_every_s:
            return
        self._status_t = now
        m = self.machine
        live = sorted(i for i, mem in m.members.items() if getattr(mem, "live", True))
        log.info("phase %s | committed step %d/%d | versions %s | members %s | rejected %d | restarts %d",
                 m.phase, m.committed_step, self.cfg.machine.total_steps, dict(m.versions), ",".join(live),
                 self.counters["rejected"], m.counters.get("restart", 0))
        try:
            await self._write_status()
        except Exception as exc:  # status is for operators: never let it stop the syncer
            self.counters["status_error"] += 1
            log.warning("writing the status record failed: %r", exc)

    def status_record(self, *, final: bool = False) -> dict:
        """The `state` KV key `syncer`: where the syncer stands and every counter (JSON)."""
        m = self.machine
        return {
            "pid": os.getpid(),
            "started_at": self._started_at,
            "updated_at": time.time(),
            "exited": final,
            "phase": m.phase,
            "committed_step": m.committed_step,
            "total_steps": self.cfg.machine.total_steps,
            "versions": {str(k): v for k, v in m.versions.items()},
            "live": sorted(i for i, mem in m.members.items() if mem.live),
            "rounds_in_flight": [{"step": r.step, "fragment": r.fragment, "attempt": r.attempt,
                                  "answered": r.answered, "expected": len(r.slots)}
                                 for _, r in sorted(m.rounds.items())],
            "counters": dict(sorted(self.counters.items())),
            "rounds": dict(sorted(m.counters.items())),
        }

    async def _write_status(self, *, final: bool = False) -> None:
        await kv_put(self.js, self.run_id, "state", "syncer", orjson.dumps(self.status_record(final=final)), counters=self.counters)

    async def _do(self, a) -> None:
        if isinstance(a, R.WriteSession):
            self._set_session(a.session)
            await asyncio.to_thread(self.ckpt.write_session, a.session)
            await kv_put(self.js, self.run_id, "state", "session", codec.encode("session", a.session), counters=self.counters)
            log.info("session pinned: %d fragments, push %s, bulk %s, INIT island %s",
                     len(a.session["fragments"]), a.session["push_dtype"], a.session["bulk_dtype"], a.session["init_island"])
        elif isinstance(a, R.WriteMember):
            await kv_put(self.js, self.run_id, "members", a.island, orjson.dumps(a.record), counters=self.counters)
        elif isinstance(a, R.PublishPull):
            p = dict(a.pull)
            msg = codec.make("pull", run=self.run_id, **p)
            self._attempts_seen[p["step"]] = max(self._attempts_seen.get(p["step"], 0), p["attempt"])
            await self._write_pulls_record()
            self._round_started.setdefault(p["step"], time.time())
            await publish_retry(self.js, S.pull(self.run_id), codec.encode("pull", msg),
                                S.pull_msg_id(p["fragment"], p["step"], p["attempt"], p["seq"]), counters=self.counters,
                                attempts=CTL_PUBLISH_ATTEMPTS)
        elif isinstance(a, R.SendError):
            fields = {"run": self.run_id, "code": a.code, "message": a.message, "fatal": a.fatal, "gen": a.gen}
            if a.field is not None:
                fields["field"] = a.field
            msg = codec.make("error", **fields)
            await publish_retry(self.js, S.to_island(self.run_id, a.island), codec.encode("error", msg),
                                S.to_island_msg_id(a.island, "error", f"{a.gen}.{self._next_tape_key()}"), counters=self.counters,
                                attempts=CTL_PUBLISH_ATTEMPTS)
            log.warning("error to %s/%s: %s: %s", a.island, a.gen, a.code, a.message)
        elif isinstance(a, R.InitStore):
            span, values = self._init_pending.pop((a.gen, a.fragment, a.chunk))
            fr = self.frags[a.fragment]
            if fr.params is None:
                fr.params = torch.zeros(fr.numel, dtype=torch.float32)
                fr.momentum = torch.zeros(fr.numel, dtype=torch.float32)
            fr.params[span.elem_offset: span.elem_offset + span.elem_count] = values
        elif isinstance(a, R.InitDrop):
            self._init_pending.pop((a.gen, a.fragment, a.chunk), None)
            self.counters[f"init.dropped.{a.reason}"] += 1
        elif isinstance(a, R.Release):
            seqs = self.ledger.pop_try((a.island, a.gen, a.fragment, a.step, a.attempt, a.try_))
            await self._delete_seqs(seqs)
        elif isinstance(a, R.Tape):
            await self._tape(dict(a.event), kind=a.event.get("kind", "event"))
        elif isinstance(a, R.Merge):
            self._spawn(self._merge(a))
        elif isinstance(a, R.CommitV0):
            self._spawn(self._commit_v0(a))
        elif isinstance(a, R.PublishFinal):
            self._spawn(self._publish_final(a))
        elif isinstance(a, R.SendManifest):
            await self._send_manifest(a)
        elif isinstance(a, R.RecordFinal):
            await self._record_final(a.record)
        elif isinstance(a, R.Shutdown):
            msg = codec.make("shutdown", run=self.run_id, reason=a.reason, gen=a.gen)
            await publish_retry(self.js, S.to_island(self.run_id, a.island), codec.encode("shutdown", msg),
                                S.to_island_msg_id(a.island, "shutdown", a.gen), counters=self.counters,
                                attempts=CTL_PUBLISH_ATTEMPTS)
        elif isinstance(a, R.Rebroadcast):
            await self._rebroadcast(a)
        elif isinstance(a, R.Done):
            self.done = a
        else:  # pragma: no cover - a new action type without a handler is a programming error
            raise SyncerError(f"unhandled action {a!r}")

    def _spawn(self, coro) -> None:
        async def wrapped():
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # surface in the main loop: a failed commit must stop the syncer
                log.exception("syncer task failed")
                await self.queue.put(exc)

        self._tasks.append(asyncio.create_task(wrapped()))

    # ---- session / fragments ------------------------------------------------------------------------

    def _set_session(self, session: dict) -> None:
        self.session = session
        for f in session["fragments"]:
            self.frags.setdefault(f["id"], _Frag(numel=f["numel"]))

    # ---- merge, commit, broadcast ------------------------------------------------------------------

    async def _read_push_chunk(self, seq: int, dtype: str, count: int, want_digest: str | None) -> torch.Tensor:
        from nats.js.errors import NotFoundError

        try:
            m = await self.js.get_msg(S.stream(self.run_id, "PUSH"), seq=seq, direct=True)
        except NotFoundError:
            # Any replica answers a direct get; one still catching up (a cluster node just restarted)
            # does not hold the message yet. The stream leader does.
            m = await self.js.get_msg(S.stream(self.run_id, "PUSH"), seq=seq)
        data = m.data
        if want_digest is not None and chunk_digest(data) != want_digest:
            raise SyncerError(f"PUSH message {seq} changed in the stream (digest mismatch)")
        return delta_view(data, dtype, count)  # read in place: the merge never writes a delta

    async def _merge(self, a: R.Merge) -> None:
        t0 = time.time()
        fid = a.fragment
        fr = self.frags[fid]
        dtype = self.session["push_dtype"]
        spans = chunk_plan(fr.numel, dtype, self.session["chunk_bytes"])
        tries = []
        for m in a.members:
            t = self.ledger.tries.get((m.island, m.gen, fid, a.step, a.attempt, m.try_))
            if t is None or not t.complete:
                raise SyncerError(f"merge of step {a.step}: push of {m.island}/{m.gen} try {m.try_} is not in the ledger")
            tries.append(t)
        weights = [m.weight for m in a.members]
        scratch = torch.empty(max(s.elem_count for s in spans), dtype=torch.float32)
        lr, mu = self.cfg.outer.lr, self.cfg.outer.momentum

        async def fetch(k):
            s = spans[k]
            return await asyncio.gather(*[self._read_push_chunk(t.seqs[k], dtype, s.elem_count, t.digests[k]) for t in tries])

        nxt = asyncio.create_task(fetch(0))
        for k, s in enumerate(spans):
            deltas = await nxt
            if k + 1 < len(spans):
                nxt = asyncio.create_task(fetch(k + 1))  # prefetch while this chunk is merged
            sl = slice(s.elem_offset, s.elem_offset + s.elem_count)
            await asyncio.to_thread(outer_step_, fr.params[sl], fr.momentum[sl], deltas, weights, lr, mu,
                                    out=scratch[: s.elem_count])
        merge_s = time.time() - t0
        rec = dict(a.record)
        rec["t"] = time.time()
        rec["sync_s"] = max(0.0, rec["t"] - a.launched_at)   # the tape's sync_s: launch to durable commit
        rec["detail"] = {**rec.get("detail", {}), "merge_s": merge_s}
        await self._commit({fid: a.version}, step=a.step, records=[rec])
        # The round's pushes (every member, every try, every attempt) are no longer needed.
        seqs = self.ledger.pop_round(fid, a.step)
        merge_to_broadcast_s = time.time() - t0
        log.info("step %d: fragment %d -> version %d from %s (merge %.2fs, total %.2fs)", a.step, fid, a.version,
                 ",".join(m.island for m in a.members), merge_s, merge_to_broadcast_s)
        # The whole sync (merge, checkpoint, broadcast): what adaptive grace subtracts.
        await self.queue.put(R.MergeDone(step=a.step, fragment=fid, version=a.version,
                                         merge_to_broadcast_s=merge_to_broadcast_s, now=time.time()))
        # Cleanup after MergeDone, off the commit path: with the PUSH leader dead a purge waits out the
        # JetStream API timeout (30 s per round was seen in a cluster), and a missed purge is harmless (the
        # next commit of this fragment purges up to its own last sequence; max_age is the safety net).
        await self._purge_round(fid, seqs)
        await self._delete_seqs(self.ledger.pop_swept())
        await self._tape_dropped_tries()   # after MergeDone: the next round never waits on these records

    async def _commit_v0(self, a: R.CommitV0) -> None:
        for fid in a.fragments:
            fr = self.frags[fid]
            if fr.params is None:
                raise SyncerError(f"version 0: fragment {fid} has no INIT data")
        await self._commit({fid: 0 for fid in a.fragments}, step=0)
        log.info("version 0 committed and broadcast for %d fragments", len(a.fragments))
        await self.queue.put(R.V0Done(now=time.time()))

    def _bulk_digest(self, fid: int, dtype: str) -> str:
        fr = self.frags[fid]
        h = VersionDigest()
        for s in chunk_plan(fr.numel, dtype, self.session["chunk_bytes"]):
            h.update(pack(fr.params[s.elem_offset: s.elem_offset + s.elem_count], dtype))
        return h.hexdigest()

    async def _commit(self, new_versions: dict[int, int], *, step: int, records: list[dict] = ()) -> None:
        """Durable (checkpoint files + state KV) before broadcast. The commit's tape records (`records`
        plus one `commit` record per fragment) are written with the checkpoint and taped after the
        broadcast under Nats-Msg-Ids keyed by fragment and version (see _retape)."""
        bulk = self.session["bulk_dtype"]
        digests = {}
        for fid in new_versions:
            digests[fid] = await asyncio.to_thread(self._bulk_digest, fid, bulk)
        prev = self.ckpt.read_state() if self.ckpt.exists() else None
        versions = dict(prev.versions) if prev else {}
        vdig = dict(prev.version_digests) if prev else {}
        versions.update(new_versions)
        vdig.update(digests)
        state = CheckpointState(
            run=self.run_id, session_fingerprint=self.session["session_fingerprint"],
            layout_fingerprint=self.session["layout_fingerprint"],
            committed_step=max(step, prev.committed_step if prev else 0), versions=versions, version_digests=vdig,
            attempts={s: a for s, a in self._attempts_seen.items() if s > step},
            tape=list(records) + [{"kind": "commit", "t": time.time(), "step": step, "fragment": fid, "version": v,
                                   "detail": {"version_digest": digests[fid]}} for fid, v in new_versions.items()],
        )
        frags = {fid: (self.frags[fid].params, self.frags[fid].momentum) for fid in new_versions}
        await asyncio.to_thread(self.ckpt.commit, state, frags)
        await self._write_commit_record(state)
        for fid, v in new_versions.items():
            await self._broadcast(fid, v, digests[fid])
        for rec in state.tape:
            await self._tape(dict(rec), kind=rec["kind"], msg_id=self._record_msg_id(rec))

    @staticmethod
    def _record_msg_id(rec: dict) -> str:
        # one per committed (fragment, version): a resumed syncer re-taping it is dropped as a duplicate
        return S.event_msg_id(rec["kind"], f"{rec['fragment']}.{rec['version']}")

    async def _retape(self, state: CheckpointState) -> None:
        """Tape the last commit's records that the tape lacks (the syncer died between the commit and
        the tape write). Records of one kind are taped in order, so the last record on a kind's subject
        tells which are in; Nats-Msg-Id dedup covers a record taped while this runs."""
        by_kind: dict[str, list[dict]] = {}
        for rec in state.tape:
            by_kind.setdefault(rec["kind"], []).append(rec)
        for kind, recs in by_kind.items():
            ids = [self._record_msg_id(r) for r in recs]
            last = None
            for attempt in range(5):
                try:
                    m = await self.js.get_msg(S.stream(self.run_id, "EVENTS"), subject=S.events(self.run_id, kind))
                    last = (m.headers or {}).get(S.MSG_ID)
                    break
                except Exception as exc:
                    import nats.js.errors
                    if isinstance(exc, nats.js.errors.NotFoundError):
                        break
                    await asyncio.sleep(0.5 * (attempt + 1))
            start = ids.index(last) + 1 if last in ids else 0
            for rec, mid in list(zip(recs, ids))[start:]:
                self.counters["tape.replayed"] += 1
                log.info("taping %s record of fragment %s version %s again: the syncer stopped before it was taped",
                         kind, rec.get("fragment"), rec.get("version"))
                await self._tape(dict(rec), kind=kind, msg_id=mid)

    async def _write_pulls_record(self) -> None:
        """Before a pull is published: remember its attempt durably (state KV `pulls`), so a restarted
        syncer never reuses a published pull id for a relaunched round (JetStream would drop the
        relaunch as a duplicate, and an island that already answered it would never push again)."""
        done = self.machine.committed_step if self.machine is not None else 0
        attempts = {s: a for s, a in self._attempts_seen.items() if s > done}
        if attempts == self._pulls_written:
            return
        await kv_put(self.js, self.run_id, "state", "pulls", orjson.dumps({"attempts": {str(k): v for k, v in sorted(attempts.items())}}), counters=self.counters)
        self._pulls_written = attempts

    async def _write_commit_record(self, state: CheckpointState) -> None:
        rec = {"committed_step": state.committed_step,
               "versions": {str(k): v for k, v in state.versions.items()},
               "version_digests": {str(k): v for k, v in state.version_digests.items()}}
        await kv_put(self.js, self.run_id, "state", "commit", orjson.dumps(rec), counters=self.counters)

    async def _broadcast(self, fid: int, version: int, vdigest: str, *, final_step: int | None = None,
                         resend: int | None = None) -> int:
        fr = self.frags[fid]
        dtype = "f32" if final_step is not None else self.session["bulk_dtype"]
        kind = "final_chunk" if final_step is not None else "bcast_chunk"
        spans = chunk_plan(fr.numel, dtype, self.session["chunk_bytes"])
        # The syncer sits next to the hub: an ack slower than BCAST_ACK_S is lost (a stream leader's node
        # died); a re-send with the same Nats-Msg-Id is deduplicated, so waiting less costs nothing.
        pipe = Pipeline(self.js, timeout=BCAST_ACK_S, counters=self.counters)
        sent = 0
        for s in spans:
            payload = pack(fr.params[s.elem_offset: s.elem_offset + s.elem_count], dtype)
            buf = payload.numpy().tobytes()
            meta = {"v": codec.PROTOCOL_VERSION, "run": self.run_id, "fragment": fid, "version": version, "dtype": dtype,
                    **chunk_header(spans, s.index, buf), "version_digest": vdigest}
            if final_step is not None:
                meta["final_step"] = final_step
                subject, msg_id = S.final(self.run_id, fid, s.index), S.final_msg_id(fid, version, s.index)
            else:
                subject, msg_id = S.bcast(self.run_id, fid, s.index), S.bcast_msg_id(fid, version, s.index, resend)
            await pipe.put(subject, buf, msg_id, {codec.CHUNK_HEADER: codec.encode_header(kind, meta)})
            sent += len(buf)
        await pipe.flush()
        self.counters["bytes_broadcast"] += sent
        return sent

    async def _tape_dropped_tries(self) -> None:
        # An incomplete try never reached the machine, so this is its one record on the tape.
        for d in self.ledger.pop_dropped():
            island, gen, fid, step, attempt, try_ = d.key
            self.counters["push.dropped_incomplete"] += 1
            await self._tape({"kind": "disposition", "t": time.time(), "step": step, "fragment": fid,
                              "attempt": attempt, "try": try_, "island": island, "gen": gen,
                              "disposition": "out_of_round", "reason": d.reason, "base_version": d.base_version,
                              "detail": {"chunks_in": d.chunks_in, "chunks": d.chunks, "local_step": d.local_step}},
                             kind="disposition")

    async def _rebroadcast(self, a: R.Rebroadcast) -> None:
        """The committed bytes of a version again (the machine saw a sign that BCAST lost them). Awaited
        in the loop, not spawned: no merge of this fragment starts (changing its params, broadcasting
        the next version on the same subjects) before it is out. A failure is counted, never fatal."""
        t0 = time.time()
        try:
            st = await asyncio.to_thread(self.ckpt.read_state)
            if st.versions.get(a.fragment) != a.version or self.frags[a.fragment].params is None:
                self.counters["rebroadcast.skipped"] += 1
                log.warning("re-broadcast of fragment %d version %d skipped: the checkpoint holds version %s",
                            a.fragment, a.version, st.versions.get(a.fragment))
                return
            vdigest = st.version_digests[a.fragment]
            # Milliseconds: unique per re-send across syncer restarts (re-sends of one fragment are a
            # quorum timeout apart), so the duplicate window never drops one.
            resend = time.time_ns() // 1_000_000
            sent = await self._broadcast(a.fragment, a.version, vdigest, resend=resend)
        except Exception as exc:
            self.counters["rebroadcast_error"] += 1
            log.warning("re-broadcast of fragment %d version %d failed: %r", a.fragment, a.version, exc)
            return
        self.counters["rebroadcast"] += 1
        log.warning("fragment %d version %d broadcast again (%s)", a.fragment, a.version, a.reason)
        await self._tape({"kind": "rebroadcast", "t": time.time(), "fragment": a.fragment, "version": a.version,
                          "reason": a.reason, "detail": {"version_digest": vdigest, "resend": resend, "bytes": sent,
                                                         "seconds": time.time() - t0}}, kind="rebroadcast")

    async def _purge_round(self, fid: int, seqs: list[int]) -> None:
        if not seqs:
            return
        # One purge per fragment subject up to the round's last sequence: no later round of this fragment
        # can have pushed yet (its pull is launched only after this commit).
        try:
            await self.js.purge_stream(S.stream(self.run_id, "PUSH"), subject=f"{S.root(self.run_id)}.push.*.{fid}",
                                       seq=max(seqs) + 1)
        except Exception as exc:
            self.counters["purge_error"] += 1
            log.warning("purging PUSH after the commit failed (max_age will expire them): %r", exc)

    async def _delete_seqs(self, seqs) -> None:
        for seq in seqs:
            try:
                await self.js.delete_msg(S.stream(self.run_id, "PUSH"), seq)
            except Exception:
                self.counters["delete_error"] += 1

    async def _publish_final(self, a: R.PublishFinal) -> None:
        """The f32 final cut (the machine emits PublishFinal once); its digests hash the f32 bytes and
        are checked against the manifest. The checkpoint is marked final (with the machine's
        finalization record) before FinalPublished lets the manifests go out."""
        digests = {}
        for fid in sorted(self.frags):
            digests[fid] = await asyncio.to_thread(self._bulk_digest, fid, "f32")
            await self._broadcast(fid, int(a.versions[fid]), digests[fid], final_step=a.final_step)
        self._final_digests = digests
        await self._record_final(a.record)
        log.info("final cut published (step %d)", a.final_step)
        await self.queue.put(R.FinalPublished(now=time.time()))

    async def _record_final(self, record: dict) -> None:
        def write():
            st = self.ckpt.read_state()
            st.final, st.final_record = True, dict(record)
            self.ckpt.commit(st, {})
        await asyncio.to_thread(write)
        if record.get("finished"):
            await self._write_final_kv(int(record["final_step"]), {int(k): int(v) for k, v in record["versions"].items()})

    async def _write_final_kv(self, final_step: int, versions: dict) -> None:
        """The run is finished and this syncer exits: leave the final manifest (no `gen`) in the state
        KV under `final`, so an island that (re)starts or was away finds the run over, installs the
        final cut from FINAL (checked against these digests) and stops instead of training on with
        nobody to sync with. Never raises (the checkpoint is the record; this is for islands)."""
        if sorted(self._final_digests) != sorted(int(k) for k in versions):
            self.counters["final_record_error"] += 1
            log.error("final record not written: digests of fragments %s, versions of %s",
                      sorted(self._final_digests), sorted(versions))
            return
        msg = codec.make("manifest", run=self.run_id, final_step=final_step,
                         versions={str(k): int(v) for k, v in sorted(versions.items())},
                         version_digests={str(k): v for k, v in sorted(self._final_digests.items())})
        try:
            await kv_put(self.js, self.run_id, "state", "final", codec.encode("manifest", msg), counters=self.counters)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self.counters["final_record_error"] += 1
            log.error("writing the final record to the state KV failed: %r", exc)

    async def _send_manifest(self, a: R.SendManifest) -> None:
        versions = {str(k): int(v) for k, v in a.versions.items()}
        msg = codec.make("manifest", run=self.run_id, final_step=a.final_step, versions=versions,
                         version_digests={str(k): v for k, v in sorted(self._final_digests.items())}, gen=a.gen)
        await publish_retry(self.js, S.to_island(self.run_id, a.island), codec.encode("manifest", msg),
                            S.to_island_msg_id(a.island, "manifest", a.gen), counters=self.counters,
                            attempts=CTL_PUBLISH_ATTEMPTS)
        log.info("manifest (final step %d) sent to %s/%s", a.final_step, a.island, a.gen)

    # ---- tape ---------------------------------------------------------------------------------------

    def _next_tape_key(self) -> str:
        self._tape_seq += 1
        return f"{self._tape_prefix}.{self._tape_seq}"

    async def _tape(self, event: dict, *, kind: str, msg_id: str | None = None) -> None:
        rec = {"v": codec.PROTOCOL_VERSION, "run": self.run_id, "t": time.time()}
        rec.update(event)
        try:
            data = codec.encode("event", rec)
        except WireError as exc:
            self.counters["tape_invalid"] += 1
            log.error("tape record does not validate (%s): %r", exc, rec)
            return
        # A commit's records (per-version msg ids) must reach the tape, so they ride out a cluster
        # leader election (seconds); other records keep a short budget: intake never stalls on them,
        # and one that misses it goes to the backlog (see TAPE_DIRECT_ATTEMPTS), same Nats-Msg-Id.
        subject, mid = S.events(self.run_id, kind), msg_id or S.event_msg_id(kind, self._next_tape_key())
        if msg_id is None and self._tape_backlog:
            self._defer_tape(subject, data, mid)  # behind the records still waiting: the tape keeps its order
            return
        try:
            await publish_retry(self.js, subject, data, mid, counters=self.counters,
                                attempts=TAPE_RETRY_ATTEMPTS if msg_id is not None else TAPE_DIRECT_ATTEMPTS)
        except Exception as exc:
            if msg_id is None:
                self._defer_tape(subject, data, mid)
                return
            self.counters["tape_error"] += 1
            log.warning("tape publish failed: %r", exc)

    def _defer_tape(self, subject: str, data: bytes, mid: str) -> None:
        if len(self._tape_backlog) >= TAPE_BACKLOG_MAX:
            self.counters["tape_dropped"] += 1
            log.warning("tape backlog full (%d records waiting): record dropped", len(self._tape_backlog))
            return
        if not self._tape_backlog:
            log.warning("tape publish failed: records wait in a backlog, retried in order")
        self._tape_backlog.append((subject, data, mid))
        self.counters["tape_deferred"] += 1
        if self._tape_retrier is None or self._tape_retrier.done():
            self._tape_retrier = asyncio.get_running_loop().create_task(self._drain_tape_backlog())

    async def _drain_tape_backlog(self) -> None:
        while self._tape_backlog:
            subject, data, mid = self._tape_backlog[0]
            try:
                await publish_retry(self.js, subject, data, mid, counters=self.counters, attempts=TAPE_RETRY_ATTEMPTS)
                self.counters["tape_retried"] += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a minute of failures: this record is lost, the next ones may land
                self.counters["tape_error"] += 1
                log.warning("tape publish failed for good: %r", exc)
            self._tape_backlog.popleft()
        log.info("tape backlog written")

    async def _flush_tape_backlog(self) -> None:
        """At exit: give the backlog a bounded time to land (the last records, e.g. the final's)."""
        task = self._tape_retrier
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), TAPE_FLUSH_AT_EXIT_S)
        except Exception:  # noqa: BLE001 - timed out (or failed): what is left is lost, counted
            self.counters["tape_dropped"] += len(self._tape_backlog)
            log.warning("exiting with %d tape records not written", len(self._tape_backlog))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    # ---- KV helpers -------------------------------------------------------------------------------

    @staticmethod
    async def _kv_get(kv, key: str):
        from nats.js.errors import KeyNotFoundError

        try:
            e = await kv.get(key)
        except KeyNotFoundError:
            return None
        if e is None or not e.value:
            return None
        return orjson.loads(e.value)

    async def _read_members(self) -> dict[str, dict]:
        """Every record of the members KV. Read from the bucket's stream (its subjects, then a get per
        key) rather than nats-py's `kv.keys()`: that watcher can report no keys while the first
        entries are still in flight (NoKeysError right after connecting), and a resumed syncer that
        takes it for "no members" ignores every island. An error is retried, then stops the syncer;
        it is never read as an empty bucket."""
        from nats.js.errors import KeyNotFoundError

        kv = self.members_kv
        last_exc = None
        for attempt in range(10):
            try:
                info = await self.js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
                out = {}
                for subject in sorted(info.state.subjects or {}):
                    key = subject[len(kv._pre):]
                    try:
                        e = await kv.get(key)
                    except KeyNotFoundError:  # deleted or purged
                        continue
                    if e is not None and e.value:
                        out[key] = orjson.loads(e.value)
                if info.state.messages and not info.state.subjects:
                    raise SyncerError(f"members bucket holds {info.state.messages} messages but listed no keys")
                return out
            except Exception as exc:  # noqa: BLE001 - a broker that just came up, a timeout: retry
                last_exc = exc
                self.counters["members_read_retry"] += 1
                log.warning("reading the members KV failed (attempt %d): %r", attempt + 1, exc)
                await asyncio.sleep(min(0.2 * 2 ** attempt, 3.0))
        raise SyncerError(f"--resume: cannot read the members KV of run {self.run_id}: {last_exc!r}")
