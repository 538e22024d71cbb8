"""The syncer's tape writer: records on the run's EVENTS stream (`yeto.R.events.<kind>`), in order.

A commit's records (per-version Nats-Msg-Ids) must reach the tape, so they ride out a cluster leader
election (seconds); every other record gets a short direct budget (intake never stalls on one), and one
that misses it waits in an in-order backlog that a background task retries with the long budget instead
of being dropped (docs/design.md §4.9). Bounded: past TAPE_BACKLOG_MAX waiting records a new one is dropped
(counter `tape_dropped`). `retape` writes the last commit's records that a syncer killed between its
commit and its tape write left out.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections import Counter

from yeto.schemas import codec, subjects as S
from yeto.schemas.errors import WireError
from yeto.schemas.publish import publish_retry
from yeto.services.syncer.checkpoint import CheckpointState

log = logging.getLogger("yeto.syncer")

TAPE_DIRECT_ATTEMPTS = 3
# ... and how long such a record waits out "no responders" (EVENTS without a leader) before the backlog
# takes it: publish_retry's default (an election, 20 s) stalled intake for 20 s per record.
TAPE_DIRECT_ELECTION_S = 1.0
TAPE_RETRY_ATTEMPTS = 40
TAPE_BACKLOG_MAX = 10_000
TAPE_FLUSH_AT_EXIT_S = 20.0


class TapeWriter:
    def __init__(self, js, run_id: str, counters: Counter, prefix: str, *, shard: int | None = None):
        self.js, self.run_id, self.counters, self.prefix = js, run_id, counters, prefix
        # A syncer shard (sharded runs only) names itself in every record's detail but the inputs'
        # (their detail is the recorder's; the segment's config names the shard).
        self.shard = shard
        self._seq = 0
        self._backlog: collections.deque[tuple[str, bytes, str]] = collections.deque()
        self._retrier: asyncio.Task | None = None

    def next_key(self) -> str:
        self._seq += 1
        return f"{self.prefix}.{self._seq}"

    async def write(self, event: dict, *, kind: str, msg_id: str | None = None) -> None:
        rec = {"v": codec.PROTOCOL_VERSION, "run": self.run_id, "t": time.time()}
        rec.update(event)
        if self.shard is not None and kind != "input" and isinstance(rec.get("detail", {}), dict):
            rec["detail"] = {**rec.get("detail", {}), "shard": self.shard}
        try:
            data = codec.encode("event", rec)
        except WireError as exc:
            self.counters["tape_invalid"] += 1
            log.error("tape record does not validate (%s): %r", exc, rec)
            return
        # A commit's records (per-version msg ids) must reach the tape, so they ride out a cluster
        # leader election (seconds); other records keep a short budget: intake never stalls on them,
        # and one that misses it goes to the backlog (see TAPE_DIRECT_ATTEMPTS), same Nats-Msg-Id.
        subject, mid = S.events(self.run_id, kind), msg_id or S.event_msg_id(kind, self.next_key())
        if msg_id is None and self._backlog:
            self._defer(subject, data, mid)  # behind the records still waiting: the tape keeps its order
            return
        try:
            if msg_id is not None:
                await publish_retry(self.js, subject, data, mid, counters=self.counters, attempts=TAPE_RETRY_ATTEMPTS)
            else:
                await publish_retry(self.js, subject, data, mid, counters=self.counters, attempts=TAPE_DIRECT_ATTEMPTS,
                                    election_s=TAPE_DIRECT_ELECTION_S)
        except Exception as exc:
            if msg_id is None:
                self._defer(subject, data, mid)
                return
            self.counters["tape_error"] += 1
            log.warning("tape publish failed: %r", exc)

    def _defer(self, subject: str, data: bytes, mid: str) -> None:
        if len(self._backlog) >= TAPE_BACKLOG_MAX:
            self.counters["tape_dropped"] += 1
            log.warning("tape backlog full (%d records waiting): record dropped", len(self._backlog))
            return
        if not self._backlog:
            log.warning("tape publish failed: records wait in a backlog, retried in order")
        self._backlog.append((subject, data, mid))
        self.counters["tape_deferred"] += 1
        if self._retrier is None or self._retrier.done():
            self._retrier = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._backlog:
            subject, data, mid = self._backlog[0]
            try:
                await publish_retry(self.js, subject, data, mid, counters=self.counters, attempts=TAPE_RETRY_ATTEMPTS)
                self.counters["tape_retried"] += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a minute of failures: this record is lost, the next ones may land
                self.counters["tape_error"] += 1
                log.warning("tape publish failed for good: %r", exc)
            self._backlog.popleft()
        log.info("tape backlog written")

    async def flush(self) -> None:
        """At exit: give the backlog a bounded time to land (the last records, e.g. the final's)."""
        task = self._retrier
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), TAPE_FLUSH_AT_EXIT_S)
        except Exception:  # noqa: BLE001 - timed out (or failed): what is left is lost, counted
            self.counters["tape_dropped"] += len(self._backlog)
            log.warning("exiting with %d tape records not written", len(self._backlog))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _shard_taped(self, kind: str, recs: list[dict]) -> set[str] | None:
        import nats.js.errors

        try:
            last = await self.js.get_msg(S.stream(self.run_id, "EVENTS"), subject=S.events(self.run_id, kind))
        except nats.js.errors.NotFoundError:
            return set()
        except Exception as exc:  # noqa: BLE001 - fall back to the last-record rule (dedup still covers)
            log.warning("reading the tape's %s records failed: %r", kind, exc)
            return None
        since = min(float(r.get("t", time.time())) for r in recs) - 300.0
        try:
            return await self._taped_since(kind, since, last.seq)
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning("reading the tape's %s records failed: %r", kind, exc)
            return None

    @staticmethod
    def record_msg_id(rec: dict) -> str:
        # one per committed (fragment, version): a resumed syncer re-taping it is dropped as a duplicate
        return S.event_msg_id(rec["kind"], f"{rec['fragment']}.{rec['version']}")

    async def _taped_since(self, kind: str, since: float, last_seq: int) -> set[str] | None:
        """Sharded: the Nats-Msg-Ids of the `kind` records taped from `since` (unix seconds) up to
        stream sequence `last_seq` (headers only); None when they cannot be read in time."""
        import datetime

        from nats.js.api import ConsumerConfig, DeliverPolicy

        seen: set[str] = set()
        done = asyncio.Event()

        async def on_msg(msg) -> None:
            seen.add((msg.headers or {}).get(S.MSG_ID))
            if msg.metadata.sequence.stream >= last_seq:
                done.set()

        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, headers_only=True,
                             opt_start_time=datetime.datetime.fromtimestamp(since, datetime.timezone.utc))
        sub = await self.js.subscribe(S.events(self.run_id, kind), stream=S.stream(self.run_id, "EVENTS"),
                                      ordered_consumer=True, config=cfg, cb=on_msg)
        try:
            await asyncio.wait_for(done.wait(), 10)
        except asyncio.TimeoutError:
            return None
        finally:
            await sub.unsubscribe()
        return seen

    async def retape(self, state: CheckpointState) -> None:
        """Tape the last commit's records that the tape lacks (the syncer died between the commit and
        the tape write). Records of one kind are taped in order, so the last record on a kind's subject
        tells which are in; Nats-Msg-Id dedup covers a record taped while this runs. A syncer shard
        shares the kind's subject with the other shards (the last record may be another's): it reads
        which records were taped since its commit (a few minutes of slack for clocks) instead, so a
        resume after the duplicate window never tapes a commit twice."""
        by_kind: dict[str, list[dict]] = {}
        for rec in state.tape:
            by_kind.setdefault(rec["kind"], []).append(rec)
        for kind, recs in by_kind.items():
            ids = [self.record_msg_id(r) for r in recs]
            if self.shard is not None:
                seen = await self._shard_taped(kind, recs)
                if seen is not None:
                    for rec, mid in zip(recs, ids):
                        if mid not in seen:
                            self.counters["tape.replayed"] += 1
                            log.info("taping %s record of fragment %s version %s again: the syncer stopped before "
                                     "it was taped", kind, rec.get("fragment"), rec.get("version"))
                            await self.write(dict(rec), kind=kind, msg_id=mid)
                    continue
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
                await self.write(dict(rec), kind=kind, msg_id=mid)
