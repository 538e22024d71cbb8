"""The island's NATS client (DESIGN §5): a background thread running nats-py's asyncio loop.

The training thread never touches the network directly. The loop thread:

* reads the island's two durable CTL consumers, `pull-I` (pulls) and `isl-I` (manifest / error /
  shutdown sent to this island), into thread-safe inboxes, acking each message once it is in an
  inbox. The names are fixed per island so the server's permissions can confine an island to its own
  (services/auth.py); a new process replaces them, and a process whose consumer another generation
  took over stops (`Superseded`) instead of reading that generation's messages;
* watches BCAST and FINAL with ordered, headers-only consumers: the inboxes hold *notices* (chunk
  headers; the newest per chunk subject), the bytes stay in JetStream until the sync rank fetches
  them at a boundary;
* publishes a heartbeat every `heartbeat_s` and drains the step-log queue.

The training thread drains the inboxes at step boundaries and runs the calls it must wait for
(fetching chunks, publishing a push and waiting for its acks) on the loop with
`asyncio.run_coroutine_threadsafe(...)`, always with a timeout (`call`).

Bad input (malformed JSON, a schema violation, a header that does not match its subject, a manifest /
error / shutdown that does not name a generation) is counted in `counters["rejected"]`, logged and
acked: redelivering it would not make it valid. A non-fatal error `unknown_member` (the syncer has no
record of this generation, e.g. it resumed without its members) makes the client say hello again.

Generation: one random `gen` per IslandClient (per process start); reconnects keep it, and it rides
on every message. Health: nats-py reconnects on its own; `check_health` raises only once it gave up
after `max_reconnects` failed attempts, or after the syncer sent a fatal error.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Awaitable, Iterable

import nats
import nats.errors
from nats.js.errors import KeyNotFoundError, NotFoundError

from schemas import codec
from schemas import provision as P
from schemas import subjects as S
from schemas.conn import connect
from schemas.errors import DecodeError, WireError
from schemas.ids import new_generation
from schemas.publish import Pipeline, publish_retry

from .config import IslandConfig
from .steplog import StepLog

log = logging.getLogger("yeto.island")

ISLAND_CTL_KINDS = ("pull", "manifest", "error", "shutdown")
# Non-fatal syncer error codes that mean "I have no record of you": the island says hello again.
REHELLO_CODES = frozenset({"unknown_member"})
CTL_FETCH_BATCH = 64
OWNER_CHECK_S = 5.0  # how often an idle CTL consumer's owner is looked at (see _ctl_pump)
# The state KV key the syncer writes as it exits a finished run: the final manifest (no `gen`).
FINAL_KEY = "final"
FINAL_POLL_S = 5.0  # how often a running island looks for it (see _heartbeat_loop)
PUSH_PIPELINE_BYTES = 16 << 20  # push bytes unacked at once (NATS-NOTES traps 5, 9)
DETACH_POLL_S = 0.02  # how soon a detached publish notices a lost connection
# A detached publish (a push) waits this long for its last acks before finishing in the background:
# on a healthy broker they are in within milliseconds, so the step log still shows the push at the
# boundary that made it; a full PUSH stream or a dying broker no longer holds the boundary.
ACK_WAIT_S = 1.0


class IslandUnhealthy(RuntimeError):
    """The island cannot go on: the connection is gone for good, or the syncer refused it."""


class SyncerRefused(IslandUnhealthy):
    """The syncer sent a fatal error (e.g. layout or dtype mismatch at hello)."""

    def __init__(self, msg: dict):
        self.code, self.field = msg.get("code"), msg.get("field")
        super().__init__(f"syncer refused this island: {msg.get('code')}: {msg.get('message')}"
                         + (f" (field {msg['field']})" if msg.get("field") else ""))


class Superseded(IslandUnhealthy):
    """A newer process of this island (another generation) took over its CTL consumers."""


class NotConnected(RuntimeError):
    """The connection is down right now (nats-py is reconnecting)."""


@dataclass(frozen=True, slots=True)
class ChunkNotice:
    """A BCAST / FINAL chunk's header as seen by the cut watcher (the bytes stay in JetStream)."""

    kind: str  # "bcast_chunk" or "final_chunk"
    subject: str
    fragment: int
    chunk: int
    version: int
    nbytes: int
    meta: dict


@dataclass(slots=True)
class PublishHandle:
    """A detached publish (see IslandClient.publish_stream): every item was handed over; `future`
    resolves once JetStream acked them all (None) or the stream failed (its exception)."""

    future: concurrent.futures.Future
    nbytes: int

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> int:
        """The payload bytes sent; raises the stream's error (or CancelledError). Only once done()."""
        self.future.result(0)
        return self.nbytes


class Inbox:
    """A thread-safe FIFO the loop fills and the training thread drains at step boundaries."""

    def __init__(self) -> None:
        self._q: collections.deque = collections.deque()

    def put(self, item: Any) -> None:
        self._q.append(item)  # deque append/popleft are atomic

    def drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self._q.popleft())
            except IndexError:
                return out

    def __len__(self) -> int:
        return len(self._q)


class CutInbox:
    """The newest notice per chunk subject (fragment, chunk), for BCAST / FINAL.

    A chunk subject holds one message, so an older notice of the same subject is obsolete: keeping
    only the newest bounds the inbox by the number of chunks of the model, however many versions
    land between two boundaries (a long evaluation, a slow step). Newest means the last to arrive
    (the ordered consumer delivers in stream order), not the highest version: a forged chunk
    claiming version 10^4 must not hide the real chunk that overwrote it (issue 16)."""

    def __init__(self) -> None:
        self._d: dict[tuple[int, int], ChunkNotice] = {}
        self._lock = threading.Lock()

    def put(self, n: ChunkNotice) -> None:
        key = (n.fragment, n.chunk)
        with self._lock:
            self._d[key] = n

    def drain(self) -> list[ChunkNotice]:
        with self._lock:
            d, self._d = self._d, {}
        return list(d.values())

    def __len__(self) -> int:
        return len(self._d)


def cut_contexts(nc, config: IslandConfig):
    """(hub JetStream, cut JetStream). An island in a datacenter (`domain` set, not the hub's) is
    connected to its leaf node: the run's streams and buckets are reached through the hub's domain,
    the cut through its own (the mirror, see schemas.provision.ensure_cut_mirrors)."""
    if config.domain is None:
        js = nc.jetstream()
        return js, js
    js = nc.jetstream(domain=config.hub_domain)
    return js, (js if config.domain == config.hub_domain else nc.jetstream(domain=config.domain))


class IslandClient:
    def __init__(self, config: IslandConfig, *, gen: str | None = None):
        self.config = config
        self.run, self.island = config.run, config.island
        self.gen = gen or new_generation()
        self.pulls = Inbox()  # decoded pull dicts
        self.control = Inbox()  # (kind, msg): manifest / error / shutdown for this island (and gen)
        self.bcast = CutInbox()
        self.final = CutInbox()
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
        self._tasks: list[asyncio.Task] = []
        self._subs: list = []
        self._wake: asyncio.Event | None = None
        self._consumers: dict[str, str] = {}  # kind ("pull" / "to") -> consumer name, once created
        self._hello_seq: int | None = None
        self._last_seq: dict[str, int] = {}  # kind -> stream sequence of the last message taken
        self._bad_final: bytes | None = None  # a final record refused already (counted once)
        self._hello: dict | None = None  # the hello's fields, for a re-hello
        self._rehellos = 0

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
        if self.loop is None or not self.loop.is_running():
            if asyncio.iscoroutine(coro):
                coro.close()
            raise NotConnected("the NATS client is not running")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()
            raise TimeoutError(f"NATS call did not finish within {timeout:.1f}s") from None

    @property
    def connected(self) -> bool:
        nc = self.nc
        return nc is not None and nc.is_connected

    @property
    def counters(self) -> Counter:
        return Counter(dict(self._counters))

    def rejected_total(self) -> int:
        return self._counters.get("rejected", 0)

    def check_health(self) -> None:
        """Raise if the island must stop: a fatal error from the syncer, a crashed background task,
        or the connection given up after `max_reconnects` failed reconnects. A connection that is
        merely down (reconnecting) is healthy: training goes on."""
        if self._fatal is not None:
            raise self._fatal
        if self._gave_up:
            raise IslandUnhealthy(f"NATS connection to {self.config.nats.url} lost: gave up after "
                                  f"{self.config.max_reconnects} failed reconnects (YETO_MAX_RECONNECTS)")

    def close(self, timeout: float = 20.0) -> None:
        """Flush the step log (briefly), stop the background tasks, remove this generation's CTL
        consumer and close the connection. Idempotent."""
        self._closing = True
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
        self.steplog.on_put = None
        self.steplog.close()

    # ---- provisioning and the session (training thread) -----------------------------------------

    def provision(self, hello: dict) -> None:
        """Island-side provisioning (DESIGN §3): wait for the run's streams, publish hello, make the
        island's CTL consumers this generation's, delivering from the hello's stream sequence (from
        its PubAck: nothing stored before it can be meant for this generation; no read of CTL is
        needed, so the permissions give an island none), and start the background readers and
        heartbeats.

        `hello`: the hello fields beyond type / v / run / island / gen."""
        to = self.config.session_timeout_s
        self.call(P.check_run(self.js, self.run, timeout_s=to, log=log.warning), None if to is None else to + 10)
        if self.cut_js is not self.js:  # an island datacenter: the cut is read from its local mirror
            self.call(P.ensure_cut_mirrors(self.cut_js, self.run, self.config.hub_domain, log=log.warning), 60)
        self._hello = dict(hello)
        msg = codec.make("hello", hello, run=self.run, island=self.island, gen=self.gen)
        ack = self.call(publish_retry(self.js, S.hello(self.run, self.island), codec.encode("hello", msg),
                                      S.hello_msg_id(self.island, self.gen), counters=self._counters), 60)
        self.call(self._after_hello(ack.seq), 60)

    async def _after_hello(self, seq: int) -> None:
        self._hello_seq = seq
        rep = await P.ensure_island_consumers(self.js, self.run, self.island, self.gen, start_seq=seq)
        log.info("island %s: CTL consumers: %s", self.island, rep)
        for kind in S.ISLAND_CONSUMER_KINDS:
            name = S.island_consumer(self.island, kind)
            self._consumers[kind] = name
            sub = await self.js.pull_subscribe_bind(durable=name, stream=S.stream(self.run, "CTL"))
            self._spawn(self._ctl_pump(sub, kind), f"ctl-{kind}")
        for kind, stream, cfg in (("bcast_chunk", "BCAST", P.bcast_consumer_config(self.run)),
                                  ("final_chunk", "FINAL", P.final_consumer_config(self.run))):
            self._subs.append(await self.cut_js.subscribe(
                cfg.filter_subject, stream=S.stream(self.run, stream), ordered_consumer=True, config=cfg,
                cb=self._cut_callback(kind)))
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
        return entry.value or None  # an empty value is a delete marker (NATS-NOTES trap 6)

    def wait_session(self, *, poll_s: float = 0.2, log_every_s: float = 30.0) -> dict:
        """Wait for the syncer's session record (state KV key `session`), with a log line while
        waiting; raise on a fatal error from the syncer or after `session_timeout_s`."""
        t0 = time.monotonic()
        last_log = None
        to = self.config.session_timeout_s
        while True:
            self.check_health()
            raw = None
            try:
                raw = self.state_key("session")
            except (TimeoutError, NotConnected, nats.errors.Error) as exc:
                log.debug("island %s: reading the session record: %r", self.island, exc)
            if raw is not None:
                session = codec.decode("session", raw)
                if session["run"] != self.run:
                    raise WireError("session record names another run", field="run", value=session["run"])
                if last_log is not None:
                    log.warning("island %s: session record of run %s found after %.1fs", self.island, self.run,
                                time.monotonic() - t0)
                return session
            waited = time.monotonic() - t0
            if to is not None and waited >= to:
                raise TimeoutError(f"island {self.island}: no session record for run {self.run} after {waited:.0f}s "
                                   f"(is the syncer running and has it admitted this island?)")
            if last_log is None or time.monotonic() - last_log >= log_every_s:
                log.warning("island %s (gen %s): waiting for the syncer's session record of run %s "
                            "(KV %s key 'session'; waited %.0fs)", self.island, self.gen, self.run,
                            S.kv_bucket(self.run, "state"), waited)
                last_log = time.monotonic()
            time.sleep(poll_s)

    # ---- calls the training thread waits for -----------------------------------------------------

    def publish_stream(self, items: Iterable[tuple[str, Any, str, dict]], *, timeout: float,
                       detach: bool = False) -> "int | PublishHandle":
        """Publish (subject, payload, msg id, headers) items as they are produced, with bounded bytes
        in flight, and wait until JetStream acked every one. Returns the payload bytes sent. Raises
        NotConnected, TimeoutError or PublishFailed; then the caller treats the whole stream as not
        sent (resends reuse the msg ids, so JetStream drops what did land).

        `detach=True` (pushes; the README promises the boundary never blocks): the items are still
        produced here (the export is collective), but a wait for pipeline room gives up at once when
        the connection drops (NotConnected: the try failed, nothing more is produced); once every
        item is handed over, the acks are awaited only while connected and at most ACK_WAIT_S: a
        PublishHandle is returned, done or not, and the pipeline goes on in the background (same
        msg ids, re-sent after a reconnect) until `timeout`."""
        deadline = time.monotonic() + timeout
        # An ack future can hang when the server answers with an error (NATS-NOTES trap 2): the
        # pipeline's own wait is a fraction of the budget, so such a publish is redone with
        # publish_retry (same msg id, backoff on 10077 / 10167) before the whole stream times out.
        pipe = Pipeline(self.js, max_bytes=PUSH_PIPELINE_BYTES, timeout=max(0.5, min(10.0, timeout / 4)),
                        counters=self._counters)
        sent = 0

        def left() -> float:
            rem = deadline - time.monotonic()
            if rem <= 0:
                raise TimeoutError(f"publishing did not finish within {timeout:.1f}s")
            return rem

        for subject, payload, msg_id, headers in items:
            if not self.connected:
                raise NotConnected("NATS connection is down")
            if detach:
                self._wait_connected(self._submit(pipe.put(subject, payload, msg_id, headers)), left(), cancel=True)
            else:
                self.call(pipe.put(subject, payload, msg_id, headers), left())
            sent += len(payload)
        if not detach:
            self.call(pipe.flush(), left())
            return sent
        handle = PublishHandle(self._submit(self._flush_within(pipe, left())), sent)
        self._wait_connected(handle.future, min(ACK_WAIT_S, deadline - time.monotonic()), cancel=False)
        return handle

    def _submit(self, coro: Awaitable) -> "concurrent.futures.Future":
        if self.loop is None or not self.loop.is_running():
            if asyncio.iscoroutine(coro):
                coro.close()
            raise NotConnected("the NATS client is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _wait_connected(self, fut: "concurrent.futures.Future", timeout: float, *, cancel: bool) -> None:
        """Wait for `fut` (its result or error is left in it) while connected and within `timeout`.
        cancel=True: a wait cut short cancels `fut` and raises (NotConnected / TimeoutError);
        cancel=False: `fut` goes on in the background and this returns."""
        end = time.monotonic() + timeout
        while True:
            try:
                fut.result(DETACH_POLL_S)
                return
            except FutureTimeout:
                pass
            except BaseException:  # noqa: BLE001 - the caller reads the outcome from fut
                if cancel:
                    raise
                return
            if self.connected and time.monotonic() < end:
                continue
            if not cancel:
                return
            fut.cancel()
            if not self.connected:
                raise NotConnected("NATS connection lost while publishing")
            raise TimeoutError(f"publishing did not finish within {timeout:.1f}s")

    @staticmethod
    async def _flush_within(pipe: Pipeline, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await pipe.flush()
        except TimeoutError:
            raise TimeoutError(f"acks did not all arrive within {timeout:.1f}s") from None

    def fetch_last(self, kind: str, subjects: list[str], *, timeout: float | None = None) -> list:
        """The newest message on each subject of stream `kind` (direct get), None where there is none."""
        return self.call(self._fetch_last(kind, subjects), self.config.fetch_timeout_s if timeout is None else timeout)

    async def _fetch_last(self, kind: str, subjects: list[str]) -> list:
        stream = S.stream(self.run, kind)
        js = self.cut_js if kind in P.CUT_KINDS else self.js

        async def one(subject: str):
            try:
                return await js.get_msg(stream, subject=subject, direct=True)
            except NotFoundError:
                return None

        return list(await asyncio.gather(*(one(s) for s in subjects)))

    def send_ack(self, final_step: int, *, resend: int = 0, timeout: float = 60.0) -> None:
        msg = codec.make("ack", run=self.run, island=self.island, gen=self.gen, final_step=final_step)
        self.call(publish_retry(self.js, S.ack(self.run, self.island), codec.encode("ack", msg),
                                S.ack_msg_id(self.island, self.gen, final_step, resend), counters=self._counters),
                  timeout)

    # ---- loop side -------------------------------------------------------------------------------

    async def _connect(self) -> None:
        cfg = self.config
        t0 = time.monotonic()
        logged = False
        while True:
            try:
                self.nc = await connect(
                    cfg.nats, name=f"yeto-island-{self.island}-{self.gen}",
                    # nats-py reads 0 as "no limit"; our 0 means "give up at the first loss".
                    max_reconnect_attempts=cfg.max_reconnects, reconnect_time_wait=cfg.reconnect_wait_s,
                    allow_reconnect=cfg.max_reconnects != 0, connect_timeout=5,
                    disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
                    closed_cb=self._on_closed, error_cb=self._on_error)
                break
            except Exception as exc:  # server not up yet: retry until connect_timeout_s
                if time.monotonic() - t0 >= cfg.connect_timeout_s:
                    raise IslandUnhealthy(f"cannot connect to NATS at {cfg.nats.url} within "
                                          f"{cfg.connect_timeout_s:.0f}s: {exc!r}") from exc
                if not logged:
                    log.warning("island %s: waiting for NATS at %s (%r)", self.island, cfg.nats.url, exc)
                    logged = True
                await asyncio.sleep(0.5)
        self.js, self.cut_js = cut_contexts(self.nc, cfg)
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # loop closed
                pass

        self.steplog.on_put = wake

    async def _on_disconnected(self) -> None:
        if self._closing:  # our own close(): not a network event, not counted
            return
        self._counters["disconnects"] += 1
        log.warning("island %s: NATS connection lost; reconnecting (training goes on)", self.island)

    async def _on_reconnected(self) -> None:
        self._counters["reconnects"] += 1
        log.warning("island %s: NATS reconnected", self.island)

    async def _on_closed(self) -> None:
        if not self._closing:
            self._gave_up = True

    async def _on_error(self, exc: Exception) -> None:
        self._counters["nats_errors"] += 1
        log.debug("island %s: nats error: %r", self.island, exc)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"yeto-{name}")

        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None and not self._closing:
                log.error("island %s: background task %s crashed: %r", self.island, name, t.exception())
                self._fatal = IslandUnhealthy(f"background task {name} crashed: {t.exception()!r}")

        task.add_done_callback(done)
        self._tasks.append(task)

    def _reject(self, what: str, exc: Exception) -> None:
        self._counters["rejected"] += 1
        self._counters[f"rejected.{getattr(exc, 'code', type(exc).__name__)}"] += 1
        text = f"{what}: {exc}"
        self.rejections.append(text)
        log.warning("island %s: rejected %s", self.island, text)

    # CTL: pulls and messages to this island.

    async def _ctl_pump(self, sub, kind: str) -> None:
        """Fetch from consumer `kind` ("pull" or "to"). Its name is the island's, not the process's:
        a batch is taken only once the consumer is known to be this generation's (an earlier process
        that lived on would otherwise read, and ack, a newer generation's messages), else handed back
        at once (nak). A consumer gone (removed by hand, by a racing close) is made again from the
        message after the last one taken; one taken over by another generation stops this process."""
        failures = 0
        check_at = time.monotonic() + OWNER_CHECK_S
        while not self._closing:
            if (failures >= 3 or time.monotonic() >= check_at) and self.connected:
                # An idle consumer shows nothing: look who owns it now and then (and after failures).
                failures, check_at = 0, time.monotonic() + OWNER_CHECK_S
                await self._check_consumer(kind, recreate=True)
                if self._fatal is not None:
                    return
            try:
                msgs = await sub.fetch(CTL_FETCH_BATCH, timeout=1.0)
                failures = 0
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # disconnected, consumer briefly unavailable: retry
                self._counters["ctl_fetch_errors"] += 1
                log.debug("island %s: CTL fetch (%s): %r", self.island, kind, exc)
                failures += 1
                await asyncio.sleep(0.5)
                continue
            if not msgs:
                continue
            if not await self._check_consumer(kind, recreate=False):
                for m in msgs:
                    try:
                        await m.nak()
                    except Exception:
                        pass
                if self._fatal is not None:
                    return
                await asyncio.sleep(0.5)
                continue
            for m in msgs:
                self._on_ctl(m.subject, m.data)
                try:
                    self._last_seq[kind] = max(self._last_seq.get(kind, 0), m.metadata.sequence.stream)
                except Exception:
                    pass
                try:
                    await m.ack()
                except Exception:  # redelivered later; the pull book keeps one copy
                    pass

    async def _check_consumer(self, kind: str, *, recreate: bool) -> bool:
        """True when consumer `kind` is this generation's. Another generation's: this process was
        superseded (fatal). Gone and `recreate`: made again (False: fetch again)."""
        try:
            exists, owner = await P.island_consumer_owner(self.js, self.run, self.island, kind)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # no answer now: hand the batch back, look again later
            log.debug("island %s: CTL consumer info (%s): %r", self.island, kind, exc)
            return False
        if owner == self.gen:
            return True
        name = S.island_consumer(self.island, kind)
        if exists:
            self._counters["ctl_superseded"] += 1
            self._fatal = Superseded(f"island {self.island}: generation {owner} (a newer process of this island) "
                                     f"took over its CTL consumer {name}; this process (generation {self.gen}) "
                                     f"stops")
            log.error("%s", self._fatal)
            return False
        if recreate:
            start = self._last_seq.get(kind, (self._hello_seq or 1) - 1) + 1
            try:
                await P.ensure_island_consumer(self.js, self.run, self.island, self.gen, kind, start, replace=False)
                self._counters["ctl_consumer_recreated"] += 1
                log.warning("island %s: CTL consumer %s was gone: made again from stream sequence %d",
                            self.island, name, start)
            except P.ConsumerTaken as exc:
                self._fatal = Superseded(f"island {self.island}: generation {exc.owner} took over its CTL consumer "
                                         f"{name}; this process (generation {self.gen}) stops")
            except Exception as exc:
                log.debug("island %s: re-creating CTL consumer %s: %r", self.island, name, exc)
        return False

    def _on_ctl(self, subject: str, data: bytes) -> None:
        try:
            kind, msg = codec.decode_typed(data, ISLAND_CTL_KINDS)
            if msg["run"] != self.run:
                raise WireError("message names another run", field="run", value=msg["run"])
            want = S.pull(self.run) if kind == "pull" else S.to_island(self.run, self.island)
            if subject != want:
                raise WireError(f"a {kind} message must arrive on {want}", field="subject", value=subject)
        except WireError as exc:
            self._reject(f"CTL message on {subject}", exc)
            return
        if kind == "pull":
            self._counters["pulls_received"] += 1
            self.pulls.put(msg)
            return
        if msg.get("gen") is None:
            # The syncer names the generation in every message to an island; one without it could
            # stop (shutdown, a fatal error) or finalize every generation of the island at once.
            self._reject(f"{kind} message on {subject}", WireError(
                f"a {kind} to an island must name its generation", field="gen", value=None, code="no_gen"))
            return
        if msg["gen"] != self.gen:
            self._counters["ctl_other_gen"] += 1
            return
        if kind == "error":
            log.error("island %s: syncer error %s (fatal=%s): %s", self.island, msg["code"], msg["fatal"], msg["message"])
            if msg["fatal"]:
                self._fatal = SyncerRefused(msg)
            elif msg["code"] in REHELLO_CODES:
                self._spawn(self._hello_again(msg["code"]), "rehello")
        self.control.put((kind, msg))

    async def _hello_again(self, code: str) -> None:
        """The syncer has no record of this generation (it resumed without its members, or the hello
        was lost with it): say hello again, same generation, so it admits this process. The CTL
        consumer already delivers everything since the first hello. Never raises (a failure is
        logged; the syncer asks again at its next chance)."""
        if self._hello is None:
            return
        self._rehellos += 1
        try:
            msg = codec.make("hello", self._hello, run=self.run, island=self.island, gen=self.gen)
            # A fresh Nats-Msg-Id per re-hello: the duplicate window would drop the first hello's.
            await publish_retry(self.js, S.hello(self.run, self.island), codec.encode("hello", msg),
                                f"{S.hello_msg_id(self.island, self.gen)}.again.{self._rehellos}",
                                counters=self._counters)
            self._counters["rehello"] += 1
            log.warning("island %s: the syncer does not know generation %s (%s): hello sent again", self.island,
                        self.gen, code)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self._counters["rehello_failed"] += 1
            log.warning("island %s: hello again failed: %r", self.island, exc)

    # BCAST / FINAL notices.

    def _cut_callback(self, kind: str):
        inbox = self.bcast if kind == "bcast_chunk" else self.final
        prefix = "bcast" if kind == "bcast_chunk" else "final"

        async def cb(msg) -> None:
            try:
                hdr = (msg.headers or {}).get(codec.CHUNK_HEADER)
                if hdr is None:
                    raise DecodeError("chunk message without its header", field=codec.CHUNK_HEADER, value=None)
                meta = codec.decode_header(kind, hdr)
                toks = S.parse(self.run, msg.subject)
                if meta["run"] != self.run:
                    raise WireError("chunk names another run", field="run", value=meta["run"])
                if toks != (prefix, str(meta["fragment"]), str(meta["chunk"])):
                    raise WireError("chunk header does not match its subject", field="subject", value=msg.subject)
                size = int((msg.headers or {}).get("Nats-Msg-Size", meta["nbytes"]))
                if size != meta["nbytes"]:
                    raise WireError(f"message holds {size} bytes", field="nbytes", value=meta["nbytes"])
            except (WireError, ValueError) as exc:
                self._reject(f"{kind} notice on {msg.subject}", exc)
                return
            inbox.put(ChunkNotice(kind, msg.subject, meta["fragment"], meta["chunk"], meta["version"], meta["nbytes"], meta))

        return cb

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

    async def _heartbeat_loop(self) -> None:
        seq = 0
        period = self.config.heartbeat_s
        final_at = time.monotonic() + FINAL_POLL_S
        while not self._closing:
            if self.connected and time.monotonic() >= final_at:
                final_at = time.monotonic() + FINAL_POLL_S
                await self._poll_final()
            if self.connected:
                msg = codec.make("heartbeat", run=self.run, island=self.island, gen=self.gen,
                                 local_step=self.local_step, step_time_s=self.step_time_s)
                try:
                    await publish_retry(self.js, S.heartbeat(self.run, self.island), codec.encode("heartbeat", msg),
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
            futs = []
            for step, line in items:
                try:
                    futs.append(await self.js.publish_async(
                        subject, line, headers={S.MSG_ID: S.steplog_msg_id(self.island, self.gen, step)},
                        wait_stall=timeout))
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
        if self._consumers and self.nc.is_connected:
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


__all__ = [
    "ChunkNotice",
    "CutInbox",
    "Inbox",
    "IslandClient",
    "IslandUnhealthy",
    "NotConnected",
    "PublishHandle",
    "Superseded",
    "SyncerRefused",
]
