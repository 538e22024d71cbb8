"""The island's NATS client (docs/design.md §5.1): a background thread running nats-py's asyncio loop.

Owns the connection and the loop thread: it reads the island's CTL consumers into thread-safe inboxes
(`ctl_reader.CtlReader`), turns BCAST / FINAL chunk headers into notices (`cut_notices`; the bytes stay in
JetStream until the sync rank fetches them), publishes a heartbeat every `heartbeat_s`, looks for the
run's final record every `FINAL_POLL_S` and drains the step-log queue; bad input is rejected (counted in
`counters["rejected"]`).
Invariants: the training thread never touches the network; it drains the inboxes (`learner.inbox`) at
step boundaries and runs what it must wait for (fetching chunks, a push and its acks) on the loop through
`call`, always with a timeout. Whatever a waiting boundary may wait for raises `arrivals`
(learner.waiting), so it wakes at once. One random `gen` per client (per process start), kept across
reconnects; `check_health` raises only once nats-py gave up reconnecting, or the syncer sent a fatal error.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import threading
import time
from collections import Counter
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Awaitable, Iterable

import nats
import nats.errors
from nats.js.errors import KeyNotFoundError, NotFoundError

from yeto.schemas import codec, leader_watch
from yeto.schemas import provision as P
from yeto.schemas import subjects as S
from yeto.schemas.conn import connect
from yeto.schemas.errors import ConnectError, WireError
from yeto.schemas.ids import new_generation
from yeto.schemas.messages import Ack, Heartbeat, Hello
from yeto.schemas.publish import first_send, note_taken, publish_retry
from yeto.schemas.versions import VersionError

from .config import IslandConfig
from .ctl_reader import CtlReader
from .cut_notices import CutWatcher
from .errors import IslandUnhealthy, NotConnected
from .inbox import CutInbox, Inbox, PublishHandle
from .publisher import StreamPublisher
from .steplog import StepLog
from .waiting import Arrivals, wait_until

log = logging.getLogger("yeto.island")

# The state KV key the syncer writes as it exits a finished run: the final manifest (no `gen`).
FINAL_KEY = "final"
FINAL_POLL_S = 5.0  # how often a running island looks for it (see _heartbeat_loop)


def cut_contexts(nc, config: IslandConfig):
    """(hub JetStream, cut JetStream). An island in a datacenter (`domain` set, not the hub's) is
    connected to its leaf node: the run's streams and buckets are reached through the hub's domain,
    the cut through its own (the mirror, see schemas.provision.ensure_cut_mirrors)."""
    if config.domain is None:
        js = nc.jetstream()
        return js, js
    js = nc.jetstream(domain=config.hub_domain)
    return js, (js if config.domain == config.hub_domain else nc.jetstream(domain=config.domain))


class Fetch:
    """A call in flight on the client's loop: `result()` waits for it until its deadline (then it is
    cancelled: TimeoutError), `cancel()` drops it. `IslandClient.call` waits at once;
    `fetch_last_ahead` hands one back to wait for later."""

    __slots__ = ("_fut", "_timeout", "_deadline")

    def __init__(self, fut: "concurrent.futures.Future", timeout: float | None):
        self._fut, self._timeout = fut, timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def result(self) -> Any:
        try:
            return self._fut.result(None if self._deadline is None else max(0.0, self._deadline - time.monotonic()))
        except FutureTimeout:
            if self._fut.done():
                raise   # the call's own timeout (a NATS request's: the same class on 3.11), not this deadline
            self._fut.cancel()
            raise TimeoutError(f"NATS call did not finish within {self._timeout:.1f}s") from None

    def cancel(self) -> None:
        self._fut.cancel()


class IslandClient:
    def __init__(self, config: IslandConfig, *, gen: str | None = None):
        self.config = config
        self.run, self.island = config.run, config.island
        self.gen = gen or new_generation()
        self.arrivals = Arrivals()  # raised by the loop thread when input lands (see the module doc)
        self.pulls = Inbox(self.arrivals)  # decoded pull dicts
        self.control = Inbox(self.arrivals)  # (kind, msg): manifest / error / shutdown / final for this island
        self.bcast = CutInbox(self.arrivals)
        self.final = CutInbox(self.arrivals)
        self.steplog = StepLog(self.run, self.island, self.gen, maxlen=config.steplog_queue, path=config.step_log)
        # Written by the loop thread only; read by the training thread as a copy (dict copy is atomic).
        self._counters: Counter[str] = Counter()
        self.rejections: collections.deque[str] = collections.deque(maxlen=64)  # recent reasons, newest last
        # Progress reported in heartbeats (set by the training thread).
        self.local_step = 0
        self.step_time_s: float | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.nc = None
        self.js = None
        self.cut_js = None  # BCAST / FINAL: the datacenter's mirror (YETO_DOMAIN), else self.js
        self._fatal: BaseException | None = None
        self._gave_up = False
        self._closing = False
        self._said_leaving = False
        self._tasks: list[asyncio.Task] = []
        self._subs: list = []
        self._wake: asyncio.Event | None = None
        self.ctl: CtlReader | None = None  # once the hello is out
        self.cuts: CutWatcher | None = None  # the BCAST / FINAL watchers, once the hello is acked
        self._bad_final: bytes | None = None  # a final record refused already (counted once)

    # ---- lifecycle (training thread) ------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread and connect (retrying for `connect_timeout_s`)."""
        if self.loop is not None:
            return
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"yeto-nats-{self.island}", daemon=True)
        self._thread.start()
        self.call(self._connect(), self.config.connect_timeout_s + 5)

    def call(self, coro: Awaitable, timeout: float | None) -> Any:
        """Run `coro` on the loop and wait for its result; cancel it on timeout (TimeoutError)."""
        return Fetch(self._submit(coro), timeout).result()

    @property
    def connected(self) -> bool:
        nc = self.nc
        return nc is not None and nc.is_connected

    @property
    def counters(self) -> Counter:
        return Counter(dict(self._counters))

    def rejected_total(self) -> int:
        return self._counters.get("rejected", 0)

    def progress(self, local_step: int, step_time_s: float | None) -> None:
        """The training thread's progress, for the next heartbeat."""
        self.local_step, self.step_time_s = local_step, step_time_s

    def check_health(self) -> None:
        """Raise if the island must stop: a fatal error from the syncer, a crashed background task,
        or the connection given up after `max_reconnects` failed reconnects. A connection that is
        merely down (reconnecting) is healthy: training goes on."""
        if self._fatal is not None:
            raise self._fatal
        if self.ctl is not None and self.ctl.fatal is not None:
            raise self.ctl.fatal
        if self._gave_up:
            raise IslandUnhealthy(f"NATS connection to {self.config.nats.url} lost: gave up after "
                                  f"{self.config.max_reconnects} failed reconnects (YETO_MAX_RECONNECTS)")

    def close(self, timeout: float = 20.0) -> None:
        """Flush the step log (briefly), stop the background tasks, remove this generation's CTL
        consumer and close the connection. Idempotent."""
        self._closing = True
        if self.ctl is not None:
            self.ctl.stop_reading()
        loop = self.loop
        if loop is not None and loop.is_running():
            try:
                self.call(self._aclose(), timeout)
            except Exception as exc:  # closing must not raise over the training loop's own error
                log.warning("island %s: closing the NATS client: %r", self.island, exc)
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout)
            if not loop.is_running():
                loop.close()
        self.loop = None
        self.steplog.wake_with(None)
        self.steplog.close()

    # ---- provisioning and the session (training thread) -----------------------------------------

    def provision(self, hello: dict) -> None:
        """Island-side provisioning (docs/design.md §3.3): wait for the run's streams, publish hello, make the
        island's CTL consumers this generation's, delivering from the hello's stream sequence (from
        its PubAck: nothing stored before it can be meant for this generation; no read of CTL is
        needed, so the permissions give an island none), and start the background readers and
        heartbeats.

        `hello`: the hello fields beyond type / v / run / island / gen."""
        to = self.config.session_timeout_s
        self.call(P.check_run(self.js, self.run, timeout_s=to, log=log.warning), None if to is None else to + 10)
        if self.cut_js is not self.js:  # an island datacenter: the cut is read from its local mirror
            self.call(P.ensure_cut_mirrors(self.cut_js, self.run, self.config.hub_domain, log=log.warning), 60)
        msg = Hello(run=self.run, island=self.island, gen=self.gen, **hello)
        ack = self.call(publish_retry(self.js, S.hello(self.run, self.island), msg.encode(),
                                      S.hello_msg_id(self.island, self.gen), counters=self._counters), 60)
        self.ctl = CtlReader(js=self.js, run=self.run, island=self.island, gen=self.gen, hello=hello,
                             counters=self._counters, pulls=self.pulls, control=self.control, reject=self._reject,
                             spawn=self._spawn, connected=lambda: self.connected, on_fatal=self.arrivals.notify)
        self.call(self._after_hello(ack.seq), 60)

    async def _after_hello(self, seq: int) -> None:
        self.cuts = CutWatcher(self.cut_js, self.run, bcast=self.bcast, final=self.final, reject=self._reject)
        self._subs += await self.cuts.start()
        # a datacenter's mirror lags the hub by design: a pull ahead of it is no sign of a lost watcher
        await self.ctl.start(seq, self.cuts if self.cut_js is self.js else None)
        self._spawn(self._heartbeat_loop(), "heartbeat")
        self._spawn(self._steplog_loop(), "steplog")

    def final_record(self) -> dict | None:
        """The run's final record (state KV `final`: the syncer finished the run and exited), decoded
        as a manifest; None when absent. Raises WireError when it does not decode or names another run."""
        raw = self.state_key(FINAL_KEY)
        return None if raw is None else self._decode_final(raw)

    def _decode_final(self, raw: bytes) -> dict:
        msg = codec.decode("manifest", raw)
        if msg["run"] != self.run:
            raise WireError("final record names another run", field="run", value=msg["run"])
        return msg

    def state_key(self, key: str) -> bytes | None:
        """The value of `key` in the run's `state` KV, or None when absent."""
        return self.call(self._kv_get("state", key), 30)

    async def _kv_get(self, bucket: str, key: str) -> bytes | None:
        kv = await P.kv(self.js, self.run, bucket)
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        return entry.value or None  # an empty value is a delete marker (docs/design.md §15.6)

    def wait_session(self, *, poll_s: float = 0.2, log_every_s: float = 30.0) -> dict:
        """Wait for the syncer's session record (state KV key `session`), with a log line while
        waiting; raise on a fatal error from the syncer or after `session_timeout_s`."""
        t0 = time.monotonic()
        last_log: list[float] = []
        found: list[bytes] = []
        to = self.config.session_timeout_s

        def present() -> bool:
            self.check_health()
            try:
                raw = self.state_key("session")
            except (TimeoutError, NotConnected, nats.errors.Error) as exc:
                log.debug("island %s: reading the session record: %r", self.island, exc)
                raw = None
            if raw is not None:
                found.append(raw)
                return True
            if not last_log or time.monotonic() - last_log[-1] >= log_every_s:
                log.warning("island %s (gen %s): waiting for the syncer's session record of run %s "
                            "(KV %s key 'session'; waited %.0fs)", self.island, self.gen, self.run,
                            S.kv_bucket(self.run, "state"), time.monotonic() - t0)
                last_log.append(time.monotonic())
            return False

        # A KV value raises no arrival: this wait polls every `poll_s`.
        if not wait_until(present, math.inf if to is None else t0 + to, poll=poll_s):
            raise TimeoutError(f"island {self.island}: no session record for run {self.run} after "
                               f"{time.monotonic() - t0:.0f}s (is the syncer running and has it admitted this island?)")
        try:
            session = codec.decode("session", found[0])
        except VersionError as exc:
            # a syncer of a protocol this release does not speak: stop, naming both (schemas/versions.py)
            raise IslandUnhealthy(f"island {self.island}: cannot join run {self.run}: {exc}") from None
        if session["run"] != self.run:
            raise WireError("session record names another run", field="run", value=session["run"])
        if last_log:
            log.warning("island %s: session record of run %s found after %.1fs", self.island, self.run,
                        time.monotonic() - t0)
        return session

    # ---- calls the training thread waits for -----------------------------------------------------

    def publish_stream(self, items: Iterable[tuple[str, Any, str, dict]], *, timeout: float,
                       detach: bool = False) -> "int | PublishHandle":
        """See `StreamPublisher.publish`."""
        return StreamPublisher(self.js, submit=self._submit, connected=lambda: self.connected, arrivals=self.arrivals,
                               counters=self._counters).publish(items, timeout=timeout, detach=detach)

    def _submit(self, coro: Awaitable) -> "concurrent.futures.Future":
        if self.loop is None or not self.loop.is_running():
            if asyncio.iscoroutine(coro):
                coro.close()
            raise NotConnected("the NATS client is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def fetch_last(self, kind: str, subjects: list[str], *, timeout: float | None = None) -> list:
        """The newest message on each subject of stream `kind` (direct get), None where there is none."""
        return self.call(self._fetch_last(kind, subjects), self.config.fetch_timeout_s if timeout is None else timeout)

    def fetch_last_ahead(self, kind: str, subjects: list[str]) -> "Fetch":
        """`fetch_last` started now on the loop, its result taken later (`Fetch.result`), so the
        training thread checks and stages one batch while the next is on the wire. The timeout
        counts from now."""
        return Fetch(self._submit(self._fetch_last(kind, subjects)), self.config.fetch_timeout_s)

    async def _fetch_last(self, kind: str, subjects: list[str]) -> list:
        stream = S.stream(self.run, kind)
        js = self.cut_js if kind in P.CUT_KINDS else self.js

        async def one(subject: str):
            try:
                return await js.get_msg(stream, subject=subject, direct=True)   # asked again on a move (conn.py)
            except NotFoundError:
                return None

        return list(await asyncio.gather(*(one(s) for s in subjects)))

    def send_ack(self, final_step: int, *, resend: int = 0, timeout: float = 60.0) -> None:
        msg = Ack(run=self.run, island=self.island, gen=self.gen, final_step=final_step)
        self.call(publish_retry(self.js, S.ack(self.run, self.island), msg.encode(),
                                S.ack_msg_id(self.island, self.gen, final_step, resend), counters=self._counters),
                  timeout)

    # ---- loop side -------------------------------------------------------------------------------

    async def _connect(self) -> None:
        cfg = self.config
        try:
            # the first connection is bounded (connect_timeout_s, YETO_CONNECT_TIMEOUT; nats-py alone retried a
            # dead address for 60 x 2 s in silence); after it, reconnects keep the max_reconnects budget
            self.nc = await connect(
                cfg.nats, within_s=cfg.connect_timeout_s, name=f"yeto-island-{self.island}-{self.gen}",
                # nats-py reads 0 as "no limit"; our 0 means "give up at the first loss".
                max_reconnect_attempts=cfg.max_reconnects, reconnect_time_wait=cfg.reconnect_wait_s,
                allow_reconnect=cfg.max_reconnects != 0, connect_timeout=5,
                disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
                closed_cb=self._on_closed, error_cb=self._on_error)
        except ConnectError as exc:
            raise IslandUnhealthy(str(exc)) from None
        self.js, self.cut_js = cut_contexts(self.nc, cfg)
        # a stream leader's election re-sends what its dead predecessor left unacknowledged (docs/design.md §3.8)
        await leader_watch.watch(self.nc, self.run)
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # loop closed
                pass

        self.steplog.wake_with(wake)

    async def _on_disconnected(self) -> None:
        self.arrivals.notify()
        if self._closing:  # our own close(): not a network event, not counted
            return
        self._counters["disconnects"] += 1
        log.warning("island %s: NATS connection lost; reconnecting (training goes on)", self.island)

    async def _on_reconnected(self) -> None:
        self.arrivals.notify()
        self._counters["reconnects"] += 1
        log.warning("island %s: NATS reconnected", self.island)
        if self.ctl is not None and self.ctl.consumers and not self._closing:
            self._spawn(self.ctl.after_reconnect(), "ctl-after-reconnect")   # deliveries lost with the old connection

    async def _on_closed(self) -> None:
        if not self._closing:
            self._gave_up = True
            self.arrivals.notify()

    async def _on_error(self, exc: Exception) -> None:
        self._counters["nats_errors"] += 1
        log.debug("island %s: nats error: %r", self.island, exc)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"yeto-{name}")

        def done(t: asyncio.Task) -> None:
            if t in self._tasks:   # short tasks come and go for the whole run (ctl_reader's held pulls)
                self._tasks.remove(t)
            if not t.cancelled() and t.exception() is not None and not self._closing:
                log.error("island %s: background task %s crashed: %r", self.island, name, t.exception())
                self._fatal = IslandUnhealthy(f"background task {name} crashed: {t.exception()!r}")
                self.arrivals.notify()

        task.add_done_callback(done)
        self._tasks.append(task)

    def _reject(self, what: str, exc: Exception) -> None:
        self._counters["rejected"] += 1
        self._counters[f"rejected.{getattr(exc, 'code', type(exc).__name__)}"] += 1
        text = f"{what}: {exc}"
        self.rejections.append(text)
        log.warning("island %s: rejected %s", self.island, text)

    # Heartbeats and the step log.

    async def _poll_final(self) -> None:
        """The run's final record, handed to the training thread as a ("final", manifest) control
        message while one is there (the syncer finished the run and exited: nobody sends this
        process a manifest any more). Never raises."""
        raw = None
        try:
            raw = await self._kv_get("state", FINAL_KEY)
            if raw is None:
                return
            msg = self._decode_final(raw)
        except WireError as exc:
            if raw != self._bad_final:  # the same bad value, read again every few seconds, counts once
                self._bad_final = raw
                self._reject("final record in the state KV", exc)
            return
        except Exception as exc:  # noqa: BLE001 - no answer now: look again later
            log.debug("island %s: reading the final record: %r", self.island, exc)
            return
        self._counters["final_record_seen"] += 1
        self.control.put(("final", msg))

    def say_leaving(self, timeout: float = 3.0) -> bool:
        """Tell the syncer that this generation stops before the run ends (a heartbeat with `leaving`), so
        that its rounds stop waiting for this island now instead of at the member timeout. Once, best effort:
        True when the broker stored it. Heartbeats stop here (one sent after it would be ignored anyway)."""
        loop = self.loop
        if self._said_leaving or loop is None or not loop.is_running() or not self.connected or self.ctl is None:
            return False
        self._said_leaving = True   # the heartbeat loop sends nothing more
        msg = Heartbeat(run=self.run, island=self.island, gen=self.gen, local_step=self.local_step,
                        step_time_s=self.step_time_s, leaving=True)
        try:
            self.call(publish_retry(self.js, S.heartbeat(self.run, self.island), msg.encode(),
                                    S.leaving_msg_id(self.island, self.gen), timeout=max(0.5, timeout / 2),
                                    attempts=2, counters=self._counters), timeout)
        except Exception as exc:  # noqa: BLE001 - the member timeout still ends its membership
            log.warning("island %s: could not tell the syncer it is leaving: %r", self.island, exc)
            return False
        self._counters["said_leaving"] += 1
        log.warning("island %s: stopping before the run ends: told the syncer it is leaving (generation %s)",
                    self.island, self.gen)
        return True

    async def _heartbeat_loop(self) -> None:
        seq = 0
        period = self.config.heartbeat_s
        final_at = time.monotonic() + FINAL_POLL_S
        while not self._closing:
            if self.connected and time.monotonic() >= final_at:
                final_at = time.monotonic() + FINAL_POLL_S
                await self._poll_final()
            if self.connected and not self._said_leaving:
                msg = Heartbeat(run=self.run, island=self.island, gen=self.gen, local_step=self.local_step,
                                step_time_s=self.step_time_s)
                try:
                    await publish_retry(self.js, S.heartbeat(self.run, self.island), msg.encode(),
                                        S.heartbeat_msg_id(self.island, self.gen, seq), timeout=max(1.0, period),
                                        attempts=2, counters=self._counters)
                    self._counters["heartbeats"] += 1
                except Exception as exc:
                    self._counters["heartbeat_failed"] += 1
                    log.debug("island %s: heartbeat: %r", self.island, exc)
                seq += 1
            await asyncio.sleep(period)

    async def _steplog_loop(self) -> None:
        subject = S.steplog(self.run, self.island)
        while not self._closing:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that lands as it
            # times out, and this loop would outlive close().
            try:
                async with asyncio.timeout(0.5):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            await self._flush_steplog(subject)

    async def _flush_steplog(self, subject: str, timeout: float = 10.0) -> None:
        # Events wait in the (bounded) queue while the connection is down: nothing is lost but drops.
        while self.connected:
            items = self.steplog.pop_all(256)
            if not items:
                return
            futs, sent = [], []
            for step, line in items:
                msg_id = S.steplog_msg_id(self.island, self.gen, step)
                try:
                    first = first_send(subject, msg_id)
                    futs.append(await self.js.publish_async(subject, line, headers={S.MSG_ID: msg_id},
                                                            wait_stall=timeout))
                    sent.append((line, msg_id, first))
                except Exception:
                    self._counters["steplog_failed"] += 1
            if futs:
                try:
                    res = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout)
                except asyncio.TimeoutError:
                    res = [TimeoutError()] * len(futs)
                failed = sum(isinstance(r, BaseException) for r in res)
                self._counters["steplog_sent"] += len(res) - failed
                self._counters["steplog_failed"] += failed
                for r, (line, msg_id, first) in zip(res, sent):
                    if first and getattr(r, "duplicate", False):   # another publisher took the id (schemas/publish.py)
                        try:
                            await self.js.publish_async(subject, line, wait_stall=timeout, headers={
                                S.MSG_ID: note_taken(subject, msg_id, self._counters)})
                        except Exception:
                            self._counters["steplog_failed"] += 1

    async def _aclose(self) -> None:
        if self.nc is None:
            return
        try:
            await asyncio.wait_for(self._flush_steplog(S.steplog(self.run, self.island)), 3.0)
        except Exception:
            pass
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks.clear()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs.clear()
        if self.cuts is not None:
            await self.cuts.stop()   # a watcher made again since start (ctl_reader.CUT_NOTICE_WAIT_S)
        if self.ctl is not None and self.ctl.consumers and self.nc.is_connected:
            try:  # this generation's consumers are garbage once the process ends (a newer one's are not)
                await asyncio.wait_for(P.remove_island_consumers(self.js, self.run, self.island, self.gen), 5.0)
            except Exception:
                pass
        try:
            await asyncio.wait_for(self.nc.close(), 5.0)
        except Exception:
            pass
        # nats-py's own reader/flusher/subscription tasks: finish them before the loop stops, so
        # none is destroyed pending.
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        if rest:
            await asyncio.wait(rest, timeout=2.0)


__all__ = ["Fetch", "IslandClient", "cut_contexts"]
