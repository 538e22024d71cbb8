"""The island's CTL reading (docs/design.md §3.3, §5.1), on the client's loop thread: the two durable CTL
consumers, `pull-I` (pulls) and `isl-I` (manifest / error / shutdown sent to this island), fetched into
the client's inboxes, each message acked once it is in one. BCAST / FINAL notices are not read here
(`learner/cut_notices.py`).

Invariants: a batch is taken only from a consumer this generation owns (names are fixed per island so
server permissions can confine an island to its own, services/auth.py); a process whose consumer another
generation took over stops (`Superseded`). Bad input (malformed JSON, a schema violation, a message on
the wrong subject, a manifest / error / shutdown that names no generation) is rejected (counted, logged)
and acked: redelivering it would not make it valid. A non-fatal `unknown_member` error makes the reader
say hello again.
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
from yeto.schemas.errors import WireError
from yeto.schemas.messages import Hello
from yeto.schemas.publish import publish_retry

from .errors import Superseded, SyncerRefused
from .inbox import Inbox

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
    """One generation's CTL consumers (see the module doc). `fatal` is set when this process must stop
    (superseded, refused by the syncer); `counters` is the client's (loop thread)."""

    def __init__(self, *, js, run: str, island: str, gen: str, hello: dict, counters: Counter,
                 pulls: Inbox, control: Inbox,
                 reject: Callable[[str, Exception], None], spawn: Callable, connected: Callable[[], bool],
                 on_fatal: Callable[[], None]):
        self.js, self.run, self.island, self.gen = js, run, island, gen
        self.counters = counters
        self.pulls, self.control = pulls, control
        self._reject, self._spawn, self._connected, self._on_fatal = reject, spawn, connected, on_fatal
        self._hello = dict(hello)  # the hello's fields, for a re-hello
        self._rehellos = 0
        self.consumers: dict[str, str] = {}  # kind ("pull" / "to") -> consumer name, once created
        self._hello_seq: int | None = None
        self._last_seq: dict[str, int] = {}  # kind -> stream sequence of the last message taken
        self._fatal: BaseException | None = None
        self.closing = False
        self._cuts = None                  # the CutWatcher a pull may wait for (None: pulls go on at once)
        self._rewatched_at = float("-inf")

    def stop_reading(self) -> None:
        """The client is closing: the pumps stop at their next turn, and no pull waits for a cut."""
        self.closing = True

    @property
    def fatal(self) -> BaseException | None:
        return self._fatal

    @fatal.setter
    def fatal(self, exc: BaseException) -> None:
        self._fatal = exc
        self._on_fatal()

    async def start(self, hello_seq: int, cuts=None) -> None:
        """Make the CTL consumers this generation's from the hello's stream sequence and start reading
        them. `cuts`: the process's CutWatcher (learner/cut_notices.py) a pull waits for when it names a base
        version not yet announced (see CUT_NOTICE_WAIT_S); None for a datacenter's mirror, which lags the hub
        by design."""
        self._hello_seq = hello_seq
        self._cuts = cuts
        rep = await P.ensure_island_consumers(self.js, self.run, self.island, self.gen, start_seq=hello_seq)
        log.info("island %s: CTL consumers: %s", self.island, rep)
        for kind in S.ISLAND_CONSUMER_KINDS:
            name = S.island_consumer(self.island, kind)
            self.consumers[kind] = name
            sub = await self.js.pull_subscribe_bind(durable=name, stream=S.stream(self.run, "CTL"))
            self._spawn(self._ctl_pump(sub, kind), f"ctl-{kind}")

    def _cut_behind(self, pull: dict) -> bool:
        if self._cuts is None or not self._cuts.announced(pull.get("fragment")):
            return False
        seen = self._cuts.seen(pull["fragment"])
        return isinstance(pull.get("base_version"), int) and seen < pull["base_version"] <= seen + CUT_BEHIND_MAX

    async def _pull_after_cut(self, pull: dict) -> None:
        """Hand `pull` on once the BCAST watcher announced its base version (see CUT_NOTICE_WAIT_S), or after
        the waits in any case. Never raises: the pull is handed on whatever happens."""
        fid, base = pull["fragment"], pull["base_version"]
        loop = asyncio.get_running_loop()
        try:
            until = loop.time() + CUT_NOTICE_WAIT_S
            while self._cuts.seen(fid) < base and loop.time() < until:
                await asyncio.sleep(0.02)
            if self._cuts.seen(fid) < base and self._connected() and not self.closing \
                    and loop.time() - self._rewatched_at >= CUT_REWATCH_EVERY_S:
                self._rewatched_at = loop.time()
                self.counters["cut_rewatch"] += 1
                log.warning("island %s: round %s of fragment %s starts from version %s, which the cut watcher has not "
                            "announced (its server stopped?): watching BCAST again", self.island, pull.get("step"),
                            fid, base)
                await self._cuts.rewatch_bcast()
                until = loop.time() + CUT_REWATCH_WAIT_S
                while self._cuts.seen(fid) < base and loop.time() < until:
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


__all__ = ["CtlReader", "ISLAND_CTL_KINDS", "REHELLO_CODES"]
