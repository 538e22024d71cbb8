"""The I/O shell shared by `yeto steplog tail`, `yeto exporter` and `yeto dashboard`: subscribe to a
run's STEPLOG and EVENTS streams and hand every message to an `Aggregator` and to listeners.

JetStream **ordered consumers** (ephemeral, no acks, the client re-creates them on a gap): a viewer
keeps no durable state on the server and two viewers never compete for messages. Deliver policy:
new messages (default), everything the streams hold (`from_start`), or from `since_s` seconds ago.
`core=True` uses plain core-NATS subscriptions instead (live only, nothing replayed; works even
where the viewer's user may not create consumers).

A message that fails to decode is counted by the Aggregator; an exception in a listener is counted
in `Feed.listener_errors` and logged: nothing a publisher sends stops the subscription.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import time
from dataclasses import dataclass
from typing import Callable

from yeto.schemas import subjects as S

from .aggregate import Aggregator, Record

log = logging.getLogger(__name__)

Listener = Callable[[Record | None, str, bytes], None]


@dataclass
class SourceOptions:
    run: str
    from_start: bool = False
    since_s: float | None = None
    island: str | None = None
    core: bool = False

    def steplog_subject(self) -> str:
        return S.steplog(self.run, self.island) if self.island else S.steplog_all(self.run)


def add_source_args(parser) -> None:
    """--from-start / --since / --island / --core (the CLI of every viewer)."""
    g = parser.add_argument_group("what to read")
    w = g.add_mutually_exclusive_group()
    w.add_argument("--from-start", action="store_true", help="replay everything the STEPLOG and EVENTS streams still hold, then follow")
    w.add_argument("--since", type=float, default=None, metavar="SECONDS", help="replay the last SECONDS, then follow")
    w.add_argument("--core", action="store_true", help="core NATS subscriptions: live only, no JetStream consumer")
    g.add_argument("--island", default=None, help="only this island's step log (syncer records stay run-wide)")


def source_options(args) -> SourceOptions:
    from yeto.schemas.ids import check_island

    island = check_island(args.island) if args.island else None
    return SourceOptions(run=args.run, from_start=args.from_start, since_s=args.since, island=island, core=args.core)


class Feed:
    """Aggregator + listeners; `on_message(subject, data)` is the one entry point of the shell for the
    streams, `on_state(key, value)` for the state KV (shard status and commit records)."""

    def __init__(self, agg: Aggregator):
        self.agg = agg
        self.listeners: list[Listener] = []
        self.listener_errors = 0
        self.received = 0
        self.state_received = 0

    def listen(self, fn: Listener) -> None:
        """Call `fn(record, subject, data)` for every message after the Aggregator saw it."""
        self.listeners.append(fn)

    def on_state(self, key: str, value: bytes | None, *, live: bool = False, seed: bool = True) -> bool:
        """`live`: the entry is an update that arrived now (not a value read at start), so its age
        starts now on this host's clock (see shards.py). `seed`: commit records raise the syncer's
        versions (not while replaying from the start)."""
        self.state_received += 1
        return self.agg.feed_state(key, value, seed=seed, seen_at=time.time() if live else None)

    def on_message(self, subject: str, data: bytes) -> Record | None:
        self.received += 1
        rec = self.agg.feed(subject, data)  # never raises on bad input: counted as malformed
        for fn in self.listeners:
            try:
                fn(rec, subject, data)
            except Exception:  # a viewer bug must not end the subscription; it is counted and logged
                self.listener_errors += 1
                log.exception("listener failed on %s", subject)
        return rec


def _deliver_kwargs(opts: SourceOptions) -> dict:
    from nats.js import api

    if opts.from_start:
        return {"deliver_policy": api.DeliverPolicy.ALL}
    if opts.since_s is not None:
        start = _dt.datetime.fromtimestamp(time.time() - max(0.0, opts.since_s), tz=_dt.timezone.utc)
        # nats-py sends opt_start_time as given: RFC 3339 with a Z, as the server parses it
        stamp = start.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"deliver_policy": api.DeliverPolicy.BY_START_TIME, "config": api.ConsumerConfig(opt_start_time=stamp)}
    return {"deliver_policy": api.DeliverPolicy.NEW}


async def wait_for_streams(js, run: str, *, poll_s: float = 1.0, timeout_s: float | None = None,
                           say: Callable[[str], None] | None = None) -> None:
    """Wait until the run's STEPLOG and EVENTS streams exist (the syncer creates them at start)."""
    from nats.js.errors import NotFoundError

    names = [S.stream(run, "STEPLOG"), S.stream(run, "EVENTS")]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    said = False
    while True:
        missing = []
        for name in names:
            try:
                await js.stream_info(name)
            except NotFoundError:
                missing.append(name)
        if not missing:
            return
        if not said and say is not None:
            say(f"waiting for run {run}: stream(s) {', '.join(missing)} do not exist yet (the syncer creates them at start)")
            said = True
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"run {run}: streams {', '.join(missing)} still missing after {timeout_s}s")
        await asyncio.sleep(poll_s)


STATE_INITIAL_WAIT_S = 5.0


async def watch_state(js, run: str, feed: Feed, *, initial_wait_s: float = STATE_INITIAL_WAIT_S,
                      seed: bool = True):
    """Follow the run's `state` KV (every key's newest value, then each write) into `feed.on_state`
    (`seed`: see there): the shards' status records (`syncer`, `syncer.<K>`) and commit records
    (`commit`, `commit.<K>`).

    One ordered consumer on the bucket's stream (what `nats kv watch` does; an observer identity may
    create it), callback-driven like the stream subscriptions. Returns the subscription once the
    values that were there at start are in (or after `initial_wait_s`), so the first screen already
    shows every shard. Deleted or purged keys arrive as None."""
    from nats.js import api

    bucket = S.kv_bucket(run, "state")
    prefix = f"$KV.{bucket}."
    initial = asyncio.Event()

    async def cb(msg):
        op = (msg.headers or {}).get("KV-Operation")
        key = msg.subject[len(prefix):] if msg.subject.startswith(prefix) else msg.subject
        try:
            feed.on_state(key, None if op in ("DEL", "PURGE") else msg.data, live=initial.is_set(), seed=seed)
        finally:
            try:
                if msg.metadata.num_pending == 0:
                    initial.set()
            except Exception:  # no JetStream metadata: nothing to count on
                initial.set()

    # An empty bucket sends nothing to wait for. (Stream info, not consumer info: an observer identity
    # may read the stream's info but not its consumers'.)
    if (await js.stream_info(f"KV_{bucket}")).state.messages == 0:
        initial.set()
    sub = await js.subscribe(prefix + ">", stream=f"KV_{bucket}", cb=cb, ordered_consumer=True,
                             deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)
    try:
        await asyncio.wait_for(initial.wait(), initial_wait_s)
    except asyncio.TimeoutError:  # the viewer works without the first batch; it fills in
        log.debug("state KV of run %s: initial values not all in after %.0f s", run, initial_wait_s)
    return sub


async def seed_versions(js, run: str, agg: Aggregator) -> bool:
    """Read the syncer's commit record (state KV key `commit`) so lag is right before the first merge."""
    import orjson

    try:
        kv = await js.key_value(S.kv_bucket(run, "state"))
        entry = await kv.get("commit")
        rec = orjson.loads(entry.value) if entry and entry.value else None
    except Exception as exc:  # bucket or key absent (run not started yet, or an old run): not an error
        log.debug("no commit record for run %s: %r", run, exc)
        return False
    if not isinstance(rec, dict) or not isinstance(rec.get("versions"), dict):
        return False
    try:
        agg.seed_versions(rec["versions"], rec.get("committed_step"))
    except (TypeError, ValueError) as exc:
        log.warning("run %s: commit record not understood (%r): ignored", run, exc)
        return False
    return True


async def subscribe(nc, opts: SourceOptions, feed: Feed, *, say: Callable[[str], None] | None = None,
                    wait_timeout_s: float | None = None) -> list:
    """Subscribe to the step log (all islands, or one) and the syncer's tape; returns the subscriptions."""

    async def cb(msg):
        feed.on_message(msg.subject, msg.data)

    subjects = [(opts.steplog_subject(), "STEPLOG"), (S.events_all(opts.run), "EVENTS")]
    if opts.core:
        return [await nc.subscribe(subject, cb=cb) for subject, _ in subjects]
    js = nc.jetstream()
    await wait_for_streams(js, opts.run, say=say, timeout_s=wait_timeout_s)
    subs = []
    # the shards' status and commit records; with --from-start the replayed merges set the versions
    try:
        subs.append(await watch_state(js, opts.run, feed, seed=not opts.from_start))
    except Exception as exc:  # no state bucket yet, or no right to read it: the step log still shows
        log.warning("run %s: not following the state KV (syncer shard status): %r", opts.run, exc)
        if not opts.from_start:
            await seed_versions(js, opts.run, feed.agg)
    for subject, kind in subjects:
        subs.append(await js.subscribe(subject, stream=S.stream(opts.run, kind), cb=cb, ordered_consumer=True,
                                       **_deliver_kwargs(opts)))
    return subs


async def connect(args, name: str):
    """Connect as every viewer does: reconnect forever (a dashboard outlives a broker restart)."""
    from yeto.schemas.conn import ConnectOptions, connect as _connect

    async def on_error(exc):
        log.warning("nats: %r", exc)

    from yeto.schemas.conn import connect_bound_s

    # `--timeout` (tail) bounds the whole command, the wait for the broker included
    within = connect_bound_s()
    if getattr(args, "timeout", None):
        within = min(within, float(args.timeout))
    return await _connect(ConnectOptions.from_args(args, name=name), within_s=within, max_reconnect_attempts=-1,
                          reconnect_time_wait=1, error_cb=on_error)


async def follow(nc, opts: SourceOptions, feed: Feed, stop: asyncio.Event | None, *,
                 say: Callable[[str], None] | None = None) -> None:
    """Subscribe, then wait for `stop` (which also ends a wait for the run's streams); unsubscribe."""
    stop = stop or asyncio.Event()
    sub_task = asyncio.ensure_future(subscribe(nc, opts, feed, say=say))
    stop_task = asyncio.ensure_future(stop.wait())
    subs: list = []
    try:
        await asyncio.wait({sub_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if sub_task.done():
            subs = sub_task.result()
            await stop_task
    finally:
        for t in (sub_task, stop_task):
            if not t.done():
                t.cancel()
        await asyncio.gather(sub_task, stop_task, return_exceptions=True)
        for s in subs:
            try:
                await s.unsubscribe()
            except Exception:  # connection already closing: the server drops the ordered consumer anyway
                pass


def add_server_args(parser, *, port: int, port_env: str, host_env: str) -> None:
    """--port / --host / --log-level of a viewer that serves HTTP (`yeto exporter`, `yeto dashboard`)."""
    import os

    from yeto.services.envflags import env_value

    parser.add_argument("--port", type=int, default=env_value(port_env, int, port),
                        help=f"HTTP port (env {port_env}; 0 picks a free one)")
    parser.add_argument("--host", default=os.environ.get(host_env, "127.0.0.1"),
                        help=f"listen address (env {host_env}; 0.0.0.0 in a container)")
    parser.add_argument("--log-level", default=os.environ.get("YETO_LOG_LEVEL", "INFO"))


def run_server(args, command: str, serve: Callable, announce: Callable[[int], str]) -> int:
    """The shell of a viewer that serves HTTP until SIGTERM / Ctrl-C: connect, `await serve(nc, opts,
    started=..., stop=...)`, print `announce(port)` once listening. Returns the process exit code."""
    import signal
    import sys

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    opts = source_options(args)

    async def go():
        nc = await connect(args, name=f"yeto-{command}-{args.run}")
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # `docker stop` / Ctrl-C: close the port and the connection
            loop.add_signal_handler(sig, stop.set)
        started = loop.create_future()
        started.add_done_callback(lambda f: print(announce(f.result()), flush=True))
        try:
            await serve(nc, opts, started=started, stop=stop)
        finally:
            await nc.close()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"yeto {command}: {exc}", file=sys.stderr)
        return 2
    return 0
