"""The syncer's I/O shell: NATS JetStream in, the round machine in the middle, checkpoint + NATS out.

Four durable pull consumers (services/syncer/receive.py) feed one event queue (hellos and heartbeats
first: services/syncer/event_queue.py); one task feeds the queue's events to the pure `RoundMachine` and
carries out its actions in order (`_do`). Long actions (a merge: services/syncer/merge.py; version 0 and
the final cut: services/syncer/cut.py) run as tasks that feed their completion back as events, so intake
never stops while a fragment is merged. Every event fed, and a digest of what it produced, is recorded on
the tape (services/syncer/recording.py, written by services/syncer/tape.py) for `yeto replay`. `yeto run
set`: services/syncer/settings_desk.py. Memory: params and momentum of every fragment (f32) plus
O(members x chunk) bytes for a merge. Status: every `status_every_s` and at exit a log line and the
`state` KV key `syncer`.
Invariants: state KV key `pulls` (step -> highest attempt published) is written *before* a pull is
published, so a restarted syncer relaunches an in-flight round with a higher attempt (a new pull id). A
shard (`--shard K --shards N`, docs/design.md §10) owns only its fragments' consumers, checkpoint and
state keys, CTL and HB only the coordinator; with one shard every name, key and record is the unsharded one.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter

import orjson

from yeto.schemas import codec, leader_watch, shards as SH, subjects as S
from yeto.schemas.chunks import max_chunk_bytes
from yeto.schemas.conn import connect, server_max_payload
from yeto.schemas import messages as M   # the wire's Shutdown, beside the machine's action of that name
from yeto.schemas.provision import kv as kv_handle, kv_put, provision_run
from yeto.schemas.publish import publish_retry
from yeto.services.syncer.actions import (
    Action, AdoptSession, ApplySettings, CommitV0, Done, InitDrop, InitStore, Merge, PublishFinal, PublishPull,
    PublishShardFinal, Rebroadcast, RecordFinal, Release, SendError, SendManifest, Shutdown, Tape, WriteMember,
    WriteSession,
)
from yeto.services.syncer.events import Event, FinalPublished, Tick, V0Done
from yeto.services.syncer.rounds import RoundMachine
from yeto.services.syncer.checkpoint import CheckpointDir
from yeto.services.syncer.consumer_reset import own_consumers, reset_lost_deliveries
from yeto.services.syncer.cut import CTL_PUBLISH_ATTEMPTS, CutPublisher
from yeto.services.syncer.event_queue import EventQueue
from yeto.services.syncer.handover import HANDED_OVER, HandOver, install as install_handover
from yeto.services.syncer.intake import PushLedger, auto_push_memory_bytes
from yeto.services.syncer.lease import Fenced, RunLease
from yeto.services.syncer.shard_watch import ShardWatch
from yeto.services.syncer.speculate import Speculator
from yeto.services.syncer import memtrace
from yeto.services.syncer.merge import Merger
from yeto.services.syncer.model_store import ModelStore
from yeto.services.syncer.receive import Receiver
from yeto.services.syncer.recording import INPUT_KIND, InputRecorder
from yeto.services.syncer.settings_desk import SettingsDesk
from yeto.services.syncer.service_config import ServiceConfig
from yeto.services.syncer.state_store import StateStore
from yeto.services.syncer.status import status_record
from yeto.services.syncer.errors import SyncerError
from yeto.services.syncer.opening import RunOpening
from yeto.services.syncer.run_claim import RunClaim
from yeto.services.syncer.tape import TapeWriter

log = logging.getLogger("yeto.syncer")

FETCH_BATCH = 64            # messages per fetch; chunk payloads <= 8 MiB keeps a batch well under 32 MiB (docs/design.md §15.4)
PUSH_FETCH_BATCH = 8
# INIT chunks per fetch: a fetched batch sits in the client beside the bytes waiting for the machine
# (receive.INIT_PENDING_BYTES), so with 1 MiB chunks 64 of them were a fixed 64 MiB more per process
# during INIT (docs/design.md §10)
INIT_FETCH_BATCH = 8
MIN_WAIT_S = 0.05          # the shortest wait for an event when the machine's next wake-up is already past
EXIT_STEP_S = 25.0          # the longest one step of the exit path may take (above the tape flush's own 20 s)
HANDOVER_STOP_S = 3.0  # a hand-over's wait for its cancelled intake tasks (once 25 s: design §7.1); unacked comes again


class SyncerService:
    def __init__(self, cfg: ServiceConfig):
        self.cfg = cfg
        self.run_id = cfg.machine.run
        self.counters: Counter = Counter()
        self.machine: RoundMachine | None = None
        self.ledger = PushLedger(hold_bytes=cfg.push_memory_bytes or 0)   # auto: set with the session
        # Built once connected: the tape writer, the global model (model store) and its publisher (BCAST,
        # FINAL, manifests), then intake and merge.
        self.tape: TapeWriter | None = None
        self.model: ModelStore | None = None
        self.publisher: CutPublisher | None = None
        self.receiver: Receiver | None = None
        self.merger: Merger | None = None
        self.queue = EventQueue()   # liveness (hello, heartbeat) before the rest: services/syncer/event_queue.py
        self.done: Done | None = None
        self.nc = None
        self.js = None
        self.state_kv = None
        self.ckpt_kv = None
        self.members_kv = None
        self._tasks: list[asyncio.Task] = []
        mc = cfg.machine
        self.shard, self.shards = mc.shard, mc.shards
        self.label = SH.label(mc.shard, mc.shards)
        # this process: tape keys and its input records (per shard: two shards may start in one millisecond)
        self._proc = f"{int(time.time() * 1000):x}" + (f"s{mc.shard}" if mc.sharded else "")
        self.watch: ShardWatch | None = None
        self._attempts_seen: dict[int, int] = {}
        self._status_t = 0.0
        self._started_at = time.time()
        self._pulls_written: dict[int, int] = {}
        self.recorder = InputRecorder(self._proc)
        self._pending_inputs: dict | None = None   # an input record the recorder handed back, not yet taped
        self._pending_actions: list[Action] = []  # produced at start (resume), carried out by the loop
        self.lease: RunLease | None = None
        self.fenced: Fenced | None = None   # set once another syncer took the run over: nothing more goes out
        self.handover: HandOver | None = None   # SIGTERM to the owner: the run goes to a standby now
        self.desk: SettingsDesk | None = None   # `yeto run set` requests, while this process owns its shard
        # stream kind -> the durable this shard reads it with (only the coordinator reads CTL and HB)
        self._consumers = own_consumers(mc.shard, mc.shards, mc.coordinator)
        self._reading = False   # the intake tasks run: a reconnect from here on may have lost deliveries
        self._side_tasks: set[asyncio.Task] = set()

    async def run(self) -> int:
        memtrace.start()
        try:
            return await self._run()
        except Fenced as exc:
            log.error("%s: fenced: %s", self.label, exc)
            return 4
        except HandOver:
            log.warning("%s: handed run %s over: lease released, a standby continues it", self.label, self.run_id)
            return HANDED_OVER

    def _request_handover(self) -> None:
        if self.handover is None and self.done is None:
            log.warning("%s: SIGTERM: handing run %s over after the event in hand", self.label, self.run_id)
            self.handover = HandOver(self.run_id)
            self.queue.put_nowait(self.handover)

    async def _guard(self) -> None:
        """Before anything that makes a version visible: still the owner (asks the KV after a pause)."""
        if self.fenced is not None:
            raise self.fenced
        if self.lease is None:
            return
        try:
            await self.lease.confirm()
        except Fenced as exc:
            self.fenced = exc
            raise

    def _lease_lost(self, exc: Fenced) -> None:
        self.fenced = exc
        self.queue.put_nowait(exc)

    async def _run(self) -> int:
        name = f"yeto-syncer-{self.run_id}" + (f"-s{self.shard}" if self.cfg.machine.sharded else "")
        self.nc = await connect(self.cfg.connect, name=name, max_reconnect_attempts=-1,
                                error_cb=self._on_error, disconnected_cb=self._on_disconnect,
                                reconnected_cb=self._on_reconnect)
        self.js = self.nc.jetstream(timeout=30)
        # a stream leader's election re-sends what its dead predecessor left unacknowledged (docs/design.md §3.8)
        await leader_watch.watch(self.nc, self.run_id)
        try:
            bound = max_chunk_bytes(server_max_payload(self.nc))
            if self.cfg.machine.chunk_bytes > bound:
                log.warning("--chunk-bytes %d exceeds what the server's max_payload %d allows with headers; using %d",
                            self.cfg.machine.chunk_bytes, server_max_payload(self.nc), bound)
                self.cfg = dataclasses.replace(self.cfg, machine=dataclasses.replace(self.cfg.machine, chunk_bytes=bound))
            mc = self.cfg.machine
            report = await provision_run(self.js, self.run_id, self.cfg.limits, push_headers_only=False,
                                         shard=mc.shard, shards=mc.shards, fragments=mc.fragments)
            log.info("provisioned run %s: %s", self.run_id, report)
            self.state_kv = await kv_handle(self.js, self.run_id, "state")
            self.members_kv = await kv_handle(self.js, self.run_id, "members")
            self.ckpt_kv = await kv_handle(self.js, self.run_id, "ckpt")
            self.tape = TapeWriter(self.js, self.run_id, self.counters, self._proc,
                                   shard=mc.shard if mc.sharded else None)
            store = StateStore(self.js, self.run_id, self.ckpt_kv, self.counters, shard=mc.shard,
                               chunk_bytes=mc.chunk_bytes, guard=self._guard) if self.cfg.state_store == "jetstream" else None
            # Every durable write and every chunk published asks `_guard` first: a deposed owner does neither.
            self.model = ModelStore(self.js, self.run_id, self.counters, CheckpointDir(self.cfg.checkpoint_dir),
                                    shard=mc.shard, shards=mc.shards, state_store=store, guard=self._guard)
            self.publisher = CutPublisher(self.js, self.run_id, self.counters, self.model, self.tape, guard=self._guard)
            claim = RunClaim(mc, state_kv=self.state_kv, model=self.model, counters=self.counters,
                             resume=self.cfg.resume, standby_only=self.cfg.standby_only,
                             lease_ttl_s=self.cfg.lease_ttl_s, label=self.label)
            self.lease = claim.lease   # held from here on: closed at exit whatever happens
            claimed = await claim.claim()
            if claimed is None:
                return 0   # the run finished: nothing was ours to do
            install_handover(self._request_handover)   # SIGTERM: handover.py
            self._tasks.append(asyncio.create_task(self.lease.keep(self._lease_lost)))
            # What the previous owner fetched and never acked (it was handed over, killed or fenced) would come
            # again only after the ack wait (30 s): soak/rolling.py's 20-25 s gaps at a hand-over. Nobody can
            # ack it now, so the consumers holding such deliveries are made again from their ack floor.
            await reset_lost_deliveries(self.js, self.run_id, self._consumers, self.counters)
            await self._open(claimed.resume)
            self.desk = SettingsDesk(self.nc, self.js, self.run_id, self.counters, self.queue, shard=mc.shard,
                                     shards=mc.shards, key=self._key("settings"))
            await self.desk.start()
            # the speculative merge: intake tells it of every push chunk recorded, the merge adopts its sums
            spec = Speculator(self.model, self.ledger, self.counters, lr=self.cfg.outer.lr,
                              momentum=self.cfg.outer.momentum, max_token_factor=mc.max_token_factor,
                              equal_weights=mc.equal_weights) if self.cfg.speculate and mc.outer is None else None
            self.receiver = Receiver(self.js, self.run_id, self.counters, self.model, self.ledger, self.tape, self.queue,
                                     self._do, speculator=spec)
            self.merger = self._new_merger(speculator=spec)
            if self.model.session is not None:   # resumed: the merge loop is known now (outer.prewarm)
                self.merger.prewarm(mc.islands)
            rx = self.receiver
            # Per shard (schemas/stream_configs.syncer_consumer_configs): only the coordinator reads CTL.
            # A follower reads INIT and PUSH once it holds the session (Receiver.consume's `ready`).
            ready = None if mc.coordinator else (lambda: self.model.session is not None)
            self._tasks += [
                asyncio.create_task(rx.consume("INIT", self._consumers["INIT"], rx.on_init, INIT_FETCH_BATCH,
                                               ready=ready)),
                asyncio.create_task(rx.consume("PUSH", self._consumers["PUSH"], rx.on_push, PUSH_FETCH_BATCH,
                                               ready=ready)),
            ]
            if mc.coordinator:
                # Heartbeats on their own stream and consumer: nothing queued on CTL, INIT or PUSH delays them.
                self._tasks[:0] = [asyncio.create_task(rx.consume("HB", self._consumers["HB"], rx.on_ctl, FETCH_BATCH)),
                                   asyncio.create_task(rx.consume("CTL", self._consumers["CTL"], rx.on_ctl, FETCH_BATCH))]
            self._reading = True
            if self.watch is not None:
                self._tasks.append(asyncio.create_task(self.watch.run()))
            await self._main_loop()
        finally:
            # Every step of the way out is bounded: a syncer whose run is over must exit.
            for t in self._tasks:
                t.cancel()
            await self._bounded(asyncio.gather(*self._tasks, return_exceptions=True), "stopping the consumers",
                                HANDOVER_STOP_S if self.handover is not None else EXIT_STEP_S)
            for t in (t for t in self._tasks if not t.done()):
                log.warning("left behind at exit: %s at %s", t.get_coro().__qualname__, "; ".join(
                    f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}" for f in t.get_stack(limit=3)))
            if self.tape is not None and self.fenced is None:
                if self.receiver is not None:
                    await self._bounded(self.receiver.flush_limits(force=True), "taping the rate-limited rejections")
                await self._bounded(self._tape_inputs(force=True), "taping the last inputs")
                await self._bounded(self.tape.flush(), "flushing the tape")
            if self.machine is not None and self.state_kv is not None and self.fenced is None:
                try:  # the last status record (counters at exit) for operators and post-mortems
                    await asyncio.wait_for(self._write_status(final=True), 5)
                except BaseException as exc:  # noqa: BLE001 - never mask the real exit reason
                    log.warning("writing the final status record failed: %r", exc)
            try:   # not drain(): it waits for every subscription; all that matters was acked or published
                await asyncio.wait_for(self.nc.flush(), 5)
            except Exception:
                pass
            if self.lease is not None and self.fenced is None and (self.done is not None or self.handover is not None):
                # A finished run's lease goes at once, and a handed-over one's after the flush above (one
                # connection keeps its order: all it published is on the server before a standby takes the key).
                await self._bounded(self.lease.release(), "releasing the lease")
            if self.lease is not None:
                self.lease.close()
            await self._bounded(self.nc.close(), "closing the NATS connection")
        if self.done is None:
            return 1
        if not self.done.ok:
            log.error("finalization timed out; no ack from: %s", ", ".join(self.done.missing))
            return 3
        if self.cfg.machine.sharded:
            log.info("run %s: %s done (its rounds committed up to step %d, its final cut published)", self.run_id,
                     self.label, self.machine.committed_step)
        else:
            log.info("run %s finished: %d rounds committed", self.run_id, self.machine.committed_step)
        return 0

    @staticmethod
    async def _bounded(aw, what: str, timeout_s: float = EXIT_STEP_S) -> None:
        """One step of the exit path, given at most `timeout_s` (then logged and left behind)."""
        try:
            await asyncio.wait_for(aw, timeout_s)
        except asyncio.TimeoutError:
            log.warning("%s took over %.0f s at exit: left behind", what, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the exit goes on; the reason is logged
            log.warning("%s failed at exit: %r", what, exc)

    async def _open(self, resume: bool) -> None:
        """The round machine, fresh or resumed (opening.py); a resumed one is fed before the loop starts
        what the last owner's settings were and a Tick, whose actions the loop carries out first."""
        mc = self.cfg.machine
        opening = RunOpening(mc, resume=resume, js=self.js, state_kv=self.state_kv, members_kv=self.members_kv,
                             model=self.model, publisher=self.publisher, ledger=self.ledger, tape=self.tape,
                             recorder=self.recorder,
                             counters=self.counters, label=self.label, new_merger=self._new_merger,
                             push_budget=self.push_budget)
        opened = await opening.open()
        self.machine = opened.machine
        self._attempts_seen.update(opened.attempts)
        kept = await opening.settle(opened)
        if mc.sharded:
            self.watch = ShardWatch(js=self.js, run_id=self.run_id, config=mc, state_kv=self.state_kv,
                                    members_kv=self.members_kv, queue=self.queue, publisher=self.publisher, tape=self.tape,
                                    counters=self.counters, machine=self.machine, members_seen=opened.member_revs,
                                    status_every_s=self.cfg.status_every_s)
        if opened.resumed is not None:
            self._apply((self._feed(kept) if kept is not None else []) + self._feed(Tick(now=time.time())))

    def _new_merger(self, speculator: Speculator | None = None) -> Merger:
        """A merger with the shell's flags (the redo of an interrupted merge gets one that never speculates)."""
        return Merger(self.js, self.run_id, self.counters, self.model, self.publisher, self.ledger, self.tape,
                      lr=self.cfg.outer.lr, momentum=self.cfg.outer.momentum, attempts=self._attempts_seen,
                      broadcast=self.cfg.broadcast, ckpt_writer=self.cfg.ckpt_writer, speculator=speculator)

    async def _on_error(self, exc):
        self.counters["nats_error"] += 1
        log.warning("nats error: %r", exc)

    async def _on_disconnect(self):
        if self.nc is not None and (self.nc.is_closed or self.nc.is_draining):
            return   # our own close at exit: nothing to report (every clean exit warned "reconnecting")
        self.counters["disconnects"] += 1
        log.warning("disconnected from NATS; reconnecting")

    async def _on_reconnect(self):
        log.info("reconnected to NATS")
        if self._reading and self.handover is None and self.done is None and self.fenced is None:
            # deliveries handed to a fetch on the lost connection (consumer_reset.py)
            self._side_tasks.add(t := asyncio.create_task(
                reset_lost_deliveries(self.js, self.run_id, dict(self._consumers), self.counters)))
            t.add_done_callback(self._side_tasks.discard)

    def _key(self, name: str) -> str:
        """This shard's state KV key `name` (`syncer`, `commit`, `pulls`): `<name>.<K>` when sharded."""
        return SH.state_key(name, self.shard, self.shards)

    async def _main_loop(self) -> None:
        past_tick = None   # the time of the last Tick fed because a wake-up was due
        while self.done is None:
            wake = self.machine.next_wakeup()
            timeout = self.cfg.tick_s
            if wake is not None:
                timeout = max(0.0, min(timeout, wake - time.time()))
            if timeout == 0.0 and past_tick is not None and wake is not None and wake <= past_tick:
                # The Tick at that time changed nothing it promised: wait as for any other event rather
                # than spin (never expected; the machine moves due times forward).
                self.counters["loop.past_wakeup"] += 1
                timeout = MIN_WAIT_S
            # Queued events first, always: on Python 3.11 asyncio.wait_for(get(), 0) times out without
            # dequeuing even when the queue is full, so a due time in the past starved every event (the
            # wedge of docs/design.md §4.4: the heartbeats that would have brought the islands back were never read).
            if not self.queue.empty():
                event = self.queue.get_nowait()
                await asyncio.sleep(0)   # let intake and tasks run between queued events
            elif timeout <= 0.0:
                event = Tick(now=time.time())
            else:
                try:
                    event = await asyncio.wait_for(self.queue.get(), timeout=timeout)
                except asyncio.TimeoutError:
                    event = Tick(now=time.time())
            past_tick = event.now if isinstance(event, Tick) and wake is not None and wake <= event.now else None
            if isinstance(event, BaseException):
                raise event
            actions = self._feed(event)
            await self._tape_inputs()
            await self._apply_async(actions)
            await self._status()

    def _feed(self, event: Event) -> list[Action]:
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
            await self.tape.write(rec, kind=INPUT_KIND)
        now = time.time()
        if force or self.recorder.due(now):
            rec = self.recorder.take(now)
            if rec is not None:
                await self.tape.write(rec, kind=INPUT_KIND)

    def _apply(self, actions) -> None:
        """Queue actions produced outside the loop (at start) for the loop to carry out."""
        self._pending_actions = list(actions)

    async def _apply_async(self, actions) -> None:
        if self._pending_actions:
            actions, self._pending_actions = self._pending_actions + list(actions), []
        for a in actions:
            await self._do(a)

    async def _status(self) -> None:
        if self.receiver is not None:
            await self.receiver.flush_limits()   # a burst of untaped rejections that ended: one record
        now = time.monotonic()
        if now - self._status_t < self.cfg.status_every_s:
            return
        self._status_t = now
        m = self.machine
        live = sorted(i for i, mem in m.members.items() if getattr(mem, "live", True))
        missing = sorted(self.watch.missing) if self.watch is not None else []
        # (`yeto syncer` puts the shard's label in every log line's prefix)
        log.info("phase %s | committed step %d/%d | versions %s | members %s | rejected %d | restarts %d%s",
                 m.phase, m.committed_step, self.cfg.machine.total_steps, dict(m.versions), ",".join(live),
                 self.counters["rejected"], m.counters.get("restart", 0),
                 f" | shards missing {missing}" if missing else "")
        try:
            await self._write_status()
        except Exception as exc:  # status is for operators: never let it stop the syncer
            self.counters["status_error"] += 1
            log.warning("writing the status record failed: %r", exc)

    async def _write_status(self, *, final: bool = False) -> None:
        rec = status_record(self.machine, self.cfg.machine, self.counters, started_at=self._started_at,
                            missing=self.watch.missing if self.watch is not None else None, final=final)
        await kv_put(self.js, self.run_id, "state", self._key("syncer"), orjson.dumps(rec),
                     counters=self.counters)

    async def _do(self, a) -> None:
        """Carry out one action of the machine: the handler its type names in `ACTIONS`."""
        await self._guard()   # a deposed owner carries out nothing (lease.py)
        handler = self.ACTIONS.get(type(a))
        if handler is None:  # pragma: no cover - a new action type without a handler is a programming error
            raise SyncerError(f"unhandled action {a!r}")
        await handler(self, a)

    # ---- the actions (one handler per action type, `ACTIONS` below) -----------------------------------

    async def _write_session(self, a: WriteSession) -> None:
        self._take_session(a.session)
        await asyncio.to_thread(self.model.write_session, a.session)
        await kv_put(self.js, self.run_id, "state", "session", codec.encode("session", a.session), counters=self.counters)
        self._mem("session pinned")
        log.info("session pinned: %d fragments, push %s, bulk %s, INIT island %s",
                 len(a.session["fragments"]), a.session["push_dtype"], a.session["bulk_dtype"], a.session["init_island"])

    async def _adopt_session(self, a: AdoptSession) -> None:
        # A follower takes the session the coordinator pinned (the state KV already holds it).
        self._take_session(a.session)
        await asyncio.to_thread(self.model.write_session, a.session)
        self._mem("session adopted")
        log.info("session adopted from the coordinator: %d fragments (this shard: %s), push %s, bulk %s",
                 len(a.session["fragments"]), sorted(self.model.frags), a.session["push_dtype"], a.session["bulk_dtype"])

    async def _write_member(self, a: WriteMember) -> None:
        await kv_put(self.js, self.run_id, "members", a.island, orjson.dumps(a.record), counters=self.counters)

    async def _publish_pull(self, a: PublishPull) -> None:
        p = dict(a.pull)
        msg = M.Pull(run=self.run_id, **p)
        self._attempts_seen[p["step"]] = max(self._attempts_seen.get(p["step"], 0), p["attempt"])
        if self.merger is not None:
            self.merger.expect(p)
        await self._write_pulls_record()
        await publish_retry(self.js, S.pull(self.run_id), msg.encode(),
                            S.pull_msg_id(p["fragment"], p["step"], p["attempt"], p["seq"]), counters=self.counters,
                            attempts=CTL_PUBLISH_ATTEMPTS)

    async def _send_error(self, a: SendError) -> None:
        msg = M.Error(run=self.run_id, code=a.code, message=a.message, fatal=a.fatal, field=a.field, gen=a.gen)
        await publish_retry(self.js, S.to_island(self.run_id, a.island), msg.encode(),
                            S.to_island_msg_id(a.island, "error", f"{a.gen}.{self.tape.next_key()}"), counters=self.counters,
                            attempts=CTL_PUBLISH_ATTEMPTS)
        if a.code == "bad_layout":
            # the run cannot start on this island's model: the operator's to fix, said as loudly as it is
            log.error("run %s cannot pin its session on island %s's model: %s", self.run_id, a.island, a.message)
        else:
            log.warning("error to %s/%s: %s: %s", a.island, a.gen, a.code, a.message)

    async def _store_init(self, a: InitStore) -> None:
        self.receiver.store_init(a)
        if a.chunk == 0:
            self._mem(f"INIT fragment {a.fragment} begins")

    async def _drop_init(self, a: InitDrop) -> None:
        self.receiver.drop_init(a)

    async def _release(self, a: Release) -> None:
        seqs = self.ledger.pop_try((a.island, a.gen, a.fragment, a.step, a.attempt, a.try_))
        await self.merger.delete_seqs(seqs)

    async def _tape(self, a: Tape) -> None:
        await self.tape.write(dict(a.event), kind=a.event.get("kind", "event"))

    async def _send_manifest(self, a: SendManifest) -> None:
        await self.publisher.send_manifest(a)

    async def _record_final(self, a: RecordFinal) -> None:
        await self.publisher.record_final(a.record)

    async def _shutdown(self, a: Shutdown) -> None:
        msg = M.Shutdown(run=self.run_id, reason=a.reason, gen=a.gen)
        await publish_retry(self.js, S.to_island(self.run_id, a.island), msg.encode(),
                            S.to_island_msg_id(a.island, "shutdown", a.gen), counters=self.counters,
                            attempts=CTL_PUBLISH_ATTEMPTS)

    async def _rebroadcast(self, a: Rebroadcast) -> None:
        await self.publisher.rebroadcast(a)

    async def _apply_settings(self, a: ApplySettings) -> None:
        self.merger.use_outer(a.settings)   # the speculative merge forecasts with them too
        await self.desk.apply(a)

    async def _done(self, a: Done) -> None:
        self.done = a

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

    # Long actions run as tasks and feed their completion back as an event (intake never stops).

    def _take_session(self, session: dict) -> None:
        """A session pinned or adopted: this syncer's fragments, its push budget, and its merge loop started
        (a resume does the same in opening.py and after the merger exists)."""
        self.model.set_session(session)
        self.ledger.set_budget(self.push_budget())
        if self.merger is not None:   # else the prewarm right after its creation covers it
            self.merger.prewarm(self.cfg.machine.islands)

    def push_budget(self) -> int:
        """The push bytes kept from intake to the merge: `--push-memory-mib`, or with `auto` a share of the
        f32 bytes of the fragments this syncer owns (the session must be set)."""
        if self.cfg.push_memory_bytes is not None:
            return self.cfg.push_memory_bytes
        budget = auto_push_memory_bytes(sum(f.numel for f in self.model.frags.values()))
        log.info("push memory (auto): %.0f MiB of pushes kept from intake to the merge", budget / (1 << 20))
        return budget

    def _mem(self, phase: str) -> None:
        """`YETO_MEM_TRACE`: RSS and the big allocations this shell knows of (services/syncer/memtrace.py)."""
        if not memtrace.enabled():
            return
        frags = self.model.frags.values() if self.model is not None else ()
        memtrace.mark(phase, fragments=sum(f.params.numel() * 8 for f in frags if f.params is not None),
                      pushes_held=self.ledger.held_bytes,
                      init_pending=self.receiver.init_pending_bytes if self.receiver is not None else 0)

    async def _merge(self, a: Merge) -> None:
        self._mem(f"merge step {a.step} begins")
        done, seqs = await self.merger.merge(a)
        self._mem(f"merge step {a.step} committed")
        await self.queue.put(done)
        await self.merger.cleanup(a.fragment, seqs)

    async def _commit_v0(self, a: CommitV0) -> None:
        self._mem("INIT in, version 0 begins")
        await self.publisher.commit_v0(a, self._attempts_seen)
        self._mem("version 0 committed")
        await self.queue.put(V0Done(now=time.time()))

    async def _publish_shard_final(self, a: PublishShardFinal) -> None:
        self._mem("final cut begins")
        await self.publisher.publish_shard_final(a)
        self._mem("final cut published")
        await self.queue.put(FinalPublished(now=time.time()))

    async def _publish_final(self, a: PublishFinal) -> None:
        self._mem("final cut begins")
        await self.publisher.publish_final(a)
        self._mem("final cut published")
        await self.queue.put(FinalPublished(now=time.time()))

    async def _write_pulls_record(self) -> None:
        """Before a pull is published: remember its attempt durably (state KV `pulls`), so a restarted
        syncer never reuses a published pull id for a relaunched round (JetStream would drop the
        relaunch as a duplicate, and an island that already answered it would never push again)."""
        done = self.machine.committed_step if self.machine is not None else 0
        attempts = {s: a for s, a in self._attempts_seen.items() if s > done}
        if attempts == self._pulls_written:
            return
        await kv_put(self.js, self.run_id, "state", self._key("pulls"), orjson.dumps({"attempts": {str(k): v for k, v in sorted(attempts.items())}}), counters=self.counters)
        self._pulls_written = attempts

    def _in_task(long):
        """A long action's handler: `long` runs as a task and feeds its completion back (intake never stops)."""
        async def start(self, a) -> None:
            self._spawn(long(self, a))
        return start

    # Action type -> its handler, as the round machine keeps a handler per event type (tests/test_syncer_actions.py).
    ACTIONS = {
        WriteSession: _write_session, AdoptSession: _adopt_session, WriteMember: _write_member,
        PublishPull: _publish_pull, SendError: _send_error, InitStore: _store_init, InitDrop: _drop_init,
        Release: _release, Tape: _tape, SendManifest: _send_manifest, RecordFinal: _record_final,
        Shutdown: _shutdown, Rebroadcast: _rebroadcast, ApplySettings: _apply_settings, Done: _done,
        Merge: _in_task(_merge), CommitV0: _in_task(_commit_v0), PublishFinal: _in_task(_publish_final),
        PublishShardFinal: _in_task(_publish_shard_final),
    }
    del _in_task
