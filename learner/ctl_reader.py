"""The island's CTL reading (docs/design.md §3.3, §5.1), on the client's loop thread: the two durable CTL
consumers, `pull-I` (pulls) and `isl-I` (manifest / error / shutdown sent to this island), fetched
into the client's inboxes, each message acked once it is in one; and the cut watchers' callback,
which turns BCAST / FINAL chunk headers into notices.

The consumer names are fixed per island so the server's permissions can confine an island to its
own (services/auth.py); a new process replaces them, and a process whose consumer another
generation took over stops (`Superseded`) instead of reading that generation's messages. Bad input
(malformed JSON, a schema violation, a header that does not match its subject, a manifest / error /
shutdown that does not name a generation) is rejected (counted, logged) and acked: redelivering it
would not make it valid. A non-fatal error `unknown_member` (the syncer has no record of this
generation, e.g. it resumed without its members) makes the reader say hello again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Callable

import nats.errors

from yeto.schemas import codec
from yeto.schemas import provision as P
from yeto.schemas import subjects as S
from yeto.schemas.errors import DecodeError, WireError
from yeto.schemas.messages import BcastChunk, FinalChunk, Hello
from yeto.schemas.publish import publish_retry

from .errors import Superseded, SyncerRefused
from .inbox import ChunkNotice, CutInbox, Inbox

log = logging.getLogger("yeto.island")

ISLAND_CTL_KINDS = ("pull", "manifest", "error", "shutdown")
# Non-fatal syncer error codes that mean "I have no record of you": the island says hello again.
REHELLO_CODES = frozenset({"unknown_member"})
CTL_FETCH_BATCH = 64
OWNER_CHECK_S = 5.0  # how often an idle CTL consumer's owner is looked at (see _ctl_pump)
# A pull names the version its round starts from (`base_version`), sealed on BCAST before the round launched. When
# the cut watcher has announced no such version of that fragment, the pull waits for the notice (the seal and the
# pull race on two consumers: it is usually in flight) up to CUT_NOTICE_WAIT_S; past that the watcher's server has
# likely stopped (a node restarted: its ordered consumer went with it), so the watcher is made again and the pull
# waits up to CUT_REWATCH_WAIT_S for its notices. Handed on before them, the pull would be answered with a base
# the syncer refuses as stale, and the round restarted (docs/design.md §7.1).
# Only a plausible gap is waited for (a node's restart costs a few versions; a pull claiming a base far ahead is
# garbage the pull book refuses), and the watcher is made again at most once per CUT_REWATCH_EVERY_S (pulls
# forged on an open broker must not keep it busy).
CUT_NOTICE_WAIT_S = 0.3
CUT_REWATCH_WAIT_S = 1.0
CUT_BEHIND_MAX = 16
CUT_REWATCH_EVERY_S = 2.0


class CtlReader:
    """One generation's CTL consumers and cut notices (see the module doc). `fatal` is set when this
    process must stop (superseded, refused by the syncer); `counters` is the client's (loop thread)."""

    def __init__(self, *, js, run: str, island: str, gen: str, hello: dict, counters: Counter,
                 pulls: Inbox, control: Inbox, bcast: CutInbox, final: CutInbox,
                 reject: Callable[[str, Exception], None], spawn: Callable, connected: Callable[[], bool],
                 on_fatal: Callable[[], None]):
        self.js, self.run, self.island, self.gen = js, run, island, gen
        self.counters = counters
        self.pulls, self.control, self.bcast, self.final = pulls, control, bcast, final
        self._reject, self._spawn, self._connected, self._on_fatal = reject, spawn, connected, on_fatal
        self._hello = dict(hello)  # the hello's fields, for a re-hello
        self._rehellos = 0
        self.consumers: dict[str, str] = {}  # kind ("pull" / "to") -> consumer name, once created
        self._hello_seq: int | None = None
        self._last_seq: dict[str, int] = {}  # kind -> stream sequence of the last message taken
        self._fatal: BaseException | None = None
        self.closing = False
        self._cut_js = None
        self._cut_subs: dict[str, object] = {}   # kind -> the cut watcher's subscription
        self._bcast_seen: dict[int, int] = {}    # fragment -> the newest version a BCAST notice announced
        self._rewatch_pulls = False               # pulls may re-create the BCAST watcher (read from the hub)
        self._rewatching: asyncio.Lock | None = None
        self._rewatched_at = float("-inf")

    @property
    def fatal(self) -> BaseException | None:
        return self._fatal

    @fatal.setter
    def fatal(self, exc: BaseException) -> None:
        self._fatal = exc
        self._on_fatal()

    async def start(self, hello_seq: int, cut_js, *, rewatch: bool = True) -> list:
        """Make the CTL consumers this generation's from the hello's stream sequence, start reading
        them, and watch BCAST / FINAL. Returns the cut subscriptions (the client closes them; `stop_watching`
        closes the ones made since). `rewatch`: a pull may re-create the BCAST watcher (see CUT_NOTICE_WAIT_S;
        not for a datacenter's mirror, which lags the hub by design)."""
        self._hello_seq = hello_seq
        self._cut_js, self._rewatch_pulls = cut_js, rewatch
        self._rewatching = asyncio.Lock()
        rep = await P.ensure_island_consumers(self.js, self.run, self.island, self.gen, start_seq=hello_seq)
        log.info("island %s: CTL consumers: %s", self.island, rep)
        for kind in S.ISLAND_CONSUMER_KINDS:
            name = S.island_consumer(self.island, kind)
            self.consumers[kind] = name
            sub = await self.js.pull_subscribe_bind(durable=name, stream=S.stream(self.run, "CTL"))
            self._spawn(self._ctl_pump(sub, kind), f"ctl-{kind}")
        return [await self._watch(kind) for kind in ("bcast_chunk", "final_chunk")]

    async def _watch(self, kind: str):
        """Watch BCAST or FINAL: an ordered consumer of the newest message of every chunk subject, then new ones."""
        stream, cfg = (("BCAST", P.bcast_consumer_config(self.run)) if kind == "bcast_chunk"
                       else ("FINAL", P.final_consumer_config(self.run)))
        sub = await self._cut_js.subscribe(cfg.filter_subject, stream=S.stream(self.run, stream), ordered_consumer=True,
                                           config=cfg, cb=self._cut_callback(kind))
        self._cut_subs[kind] = sub
        return sub

    async def _rewatch_bcast(self) -> None:
        """Make the BCAST watcher again: the newest chunk of every subject is announced anew (the inbox keeps the
        newest notice per subject, the reader reads no version twice)."""
        async with self._rewatching:
            old = self._cut_subs.get("bcast_chunk")
            if old is not None:
                try:
                    await old.unsubscribe()
                except Exception:  # noqa: BLE001 - its server is gone, or it was closed: a new one is made anyway
                    pass
            await self._watch("bcast_chunk")

    async def stop_watching(self) -> None:
        for sub in self._cut_subs.values():
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closed with the connection anyway
                pass
        self._cut_subs.clear()

    def _cut_behind(self, pull: dict) -> bool:
        seen = self._bcast_seen.get(pull.get("fragment"))
        return self._rewatch_pulls and seen is not None and isinstance(pull.get("base_version"), int) \
            and seen < pull["base_version"] <= seen + CUT_BEHIND_MAX

    async def _pull_after_cut(self, pull: dict) -> None:
        """Hand `pull` on once the BCAST watcher announced its base version (see CUT_NOTICE_WAIT_S), or after
        the waits in any case. Never raises: the pull is handed on whatever happens."""
        fid, base = pull["fragment"], pull["base_version"]
        loop = asyncio.get_running_loop()
        try:
            until = loop.time() + CUT_NOTICE_WAIT_S
            while self._bcast_seen.get(fid, -1) < base and loop.time() < until:
                await asyncio.sleep(0.02)
            if self._bcast_seen.get(fid, -1) < base and self._connected() and not self.closing \
                    and loop.time() - self._rewatched_at >= CUT_REWATCH_EVERY_S:
                self._rewatched_at = loop.time()
                self.counters["cut_rewatch"] += 1
                log.warning("island %s: round %s of fragment %s starts from version %s, which the cut watcher has not "
                            "announced (its server stopped?): watching BCAST again", self.island, pull.get("step"),
                            fid, base)
                await self._rewatch_bcast()
                until = loop.time() + CUT_REWATCH_WAIT_S
                while self._bcast_seen.get(fid, -1) < base and loop.time() < until:
                    await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the ordered consumer's own heartbeat check still re-creates it
            self.counters["cut_rewatch_failed"] += 1
            log.debug("island %s: watching BCAST again: %r", self.island, exc)
        finally:
            self.pulls.put(pull)

    async def _ctl_pump(self, sub, kind: str) -> None:
        """Fetch from consumer `kind` ("pull" or "to"). Its name is the island's, not the process's:
        a batch is taken only once the consumer is known to be this generation's (an earlier process
        that lived on would otherwise read, and ack, a newer generation's messages), else handed back
        at once (nak). A consumer gone (removed by hand, by a racing close) is made again from the
        message after the last one taken; one taken over by another generation stops this process."""
        failures = 0
        check_at = time.monotonic() + OWNER_CHECK_S
        while not self.closing:
            if (failures >= 3 or time.monotonic() >= check_at) and self._connected():
                # An idle consumer shows nothing: look who owns it now and then (and after failures).
                failures, check_at = 0, time.monotonic() + OWNER_CHECK_S
                await self._check_consumer(kind, recreate=True)
                if self.fatal is not None:
                    return
            try:
                msgs = await sub.fetch(CTL_FETCH_BATCH, timeout=1.0)
                failures = 0
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # disconnected, consumer briefly unavailable: retry
                self.counters["ctl_fetch_errors"] += 1
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
                if self.fatal is not None:
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

    async def after_reconnect(self) -> None:
        """After the client moved to another server (a node restarted or in lame duck mode: docs/design.md §7.1). A
        message the server handed to a fetch on the lost connection is redelivered only after the consumer's ack
        wait (30 s), and for that long its pull stays unanswered and its round waits (soak/rolling.py saw it). So a
        consumer of this generation that holds deliveries nobody acked is made again from the message after the
        last one taken, as when it is gone (`_check_consumer`): they come again at once. Never raises."""
        ctl = S.stream(self.run, "CTL")
        for kind, name in list(self.consumers.items()):
            try:
                info = await P.consumer_info_or_none(self.js, ctl, name)
                if info is None or P.consumer_owner(info) != self.gen or not info.num_ack_pending:
                    continue
                await self.js.delete_consumer(ctl, name)
                self.counters["ctl_consumer_reset"] += 1
                log.warning("island %s: CTL consumer %s held %d deliveries lost with the old connection: made again",
                            self.island, name, info.num_ack_pending)
                await self._check_consumer(kind, recreate=True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the ack wait still redelivers them
                log.debug("island %s: CTL consumer %s after a reconnect: %r", self.island, name, exc)

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
            self.counters["ctl_superseded"] += 1
            self.fatal = Superseded(f"island {self.island}: generation {owner} (a newer process of this island) "
                                     f"took over its CTL consumer {name}; this process (generation {self.gen}) "
                                     f"stops")
            log.error("%s", self.fatal)
            return False
        if recreate:
            start = self._last_seq.get(kind, (self._hello_seq or 1) - 1) + 1
            try:
                await P.ensure_island_consumer(self.js, self.run, self.island, self.gen, kind, start, replace=False)
                self.counters["ctl_consumer_recreated"] += 1
                log.warning("island %s: CTL consumer %s was gone: made again from stream sequence %d",
                            self.island, name, start)
            except P.ConsumerTaken as exc:
                self.fatal = Superseded(f"island {self.island}: generation {exc.owner} took over its CTL consumer "
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
            self.counters["pulls_received"] += 1
            if self._cut_behind(msg):
                self._spawn(self._pull_after_cut(msg), "pull-after-cut")
            else:
                self.pulls.put(msg)
            return
        if msg.get("gen") is None:
            # The syncer names the generation in every message to an island; one without it could
            # stop (shutdown, a fatal error) or finalize every generation of the island at once.
            self._reject(f"{kind} message on {subject}", WireError(
                f"a {kind} to an island must name its generation", field="gen", value=None, code="no_gen"))
            return
        if msg["gen"] != self.gen:
            self.counters["ctl_other_gen"] += 1
            return
        if kind == "error":
            log.error("island %s: syncer error %s (fatal=%s): %s", self.island, msg["code"], msg["fatal"], msg["message"])
            if msg["fatal"]:
                self.fatal = SyncerRefused(msg)
            elif msg["code"] in REHELLO_CODES and self._fatal is None:
                # an island the syncer refused (bad_layout, ...) stops: the syncer forgetting it is no reason
                # to say hello again and be refused once more
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
            msg = Hello(run=self.run, island=self.island, gen=self.gen, **self._hello)
            # A fresh Nats-Msg-Id per re-hello: the duplicate window would drop the first hello's.
            await publish_retry(self.js, S.hello(self.run, self.island), msg.encode(),
                                S.hello_again_msg_id(self.island, self.gen, self._rehellos),
                                counters=self.counters)
            self.counters["rehello"] += 1
            log.warning("island %s: the syncer does not know generation %s (%s): hello sent again", self.island,
                        self.gen, code)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self.counters["rehello_failed"] += 1
            log.warning("island %s: hello again failed: %r", self.island, exc)

    # BCAST / FINAL notices.

    def _cut_callback(self, kind: str):
        inbox = self.bcast if kind == "bcast_chunk" else self.final
        prefix = "bcast" if kind == "bcast_chunk" else "final"
        header = BcastChunk if kind == "bcast_chunk" else FinalChunk

        async def cb(msg) -> None:
            try:
                hdr = (msg.headers or {}).get(codec.CHUNK_HEADER)
                if hdr is None:
                    raise DecodeError("chunk message without its header", field=codec.CHUNK_HEADER, value=None)
                meta = header.from_header(hdr)
                toks = S.parse(self.run, msg.subject)
                if meta.run != self.run:
                    raise WireError("chunk names another run", field="run", value=meta.run)
                if toks != (prefix, str(meta.fragment), str(meta.chunk)):
                    raise WireError("chunk header does not match its subject", field="subject", value=msg.subject)
                size = int((msg.headers or {}).get("Nats-Msg-Size", meta.nbytes))
                if size != meta.nbytes:
                    raise WireError(f"message holds {size} bytes", field="nbytes", value=meta.nbytes)
            except (WireError, ValueError) as exc:
                self._reject(f"{kind} notice on {msg.subject}", exc)
                return
            if kind == "bcast_chunk":
                self._bcast_seen[meta.fragment] = max(meta.version, self._bcast_seen.get(meta.fragment, -1))
            inbox.put(ChunkNotice(kind, msg.subject, meta.fragment, meta.chunk, meta.version, meta.nbytes, meta.to_wire()))

        return cb


__all__ = ["CtlReader", "ISLAND_CTL_KINDS", "REHELLO_CODES"]
