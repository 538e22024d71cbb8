"""`yeto dashboard`: a web page with live charts of one run, fed by server-sent events.

GET /            the page (static/dashboard.html: hand-written canvas charts, inline JS, no CDN)
GET /events      SSE: one `snapshot` (every series so far), then a `delta` every `flush_s` while
                 anything arrived (new points + the current per-island and run numbers)
GET /state.json  the snapshot as plain JSON (scripts, debugging)

State lives in the pure `Aggregator` + `ChartModel`; this module only moves it to browsers. A viewer
too slow to take its deltas is dropped (its EventSource reconnects and gets a fresh snapshot) so one
stuck tab never grows the server's memory.
"""
from __future__ import annotations

import asyncio
import html
import logging
import time
from importlib import resources

import orjson

from .aggregate import Aggregator, ChartModel
from .consume import Feed, SourceOptions, follow
from .httpd import HttpServer, Response, Stream, sse

log = logging.getLogger(__name__)

SHARD_REFRESH_S = 2.0  # the shard table's refresh when nothing else arrives
CLIENT_QUEUE = 64  # deltas a viewer may fall behind before it is dropped
KEEPALIVE_S = 15.0


def page(run: str) -> bytes:
    text = resources.files(__package__).joinpath("static", "dashboard.html").read_text(encoding="utf-8")
    return text.replace("{{RUN}}", html.escape(run)).encode("utf-8")


class _Viewer:
    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=CLIENT_QUEUE)
        self.closed = False

    def close(self) -> None:
        """Dropped by the dashboard: its stream ends."""
        self.closed = True


class Dashboard:
    """Aggregator + ChartModel + SSE fan-out (no network here: `routes()` plugs into HttpServer)."""

    def __init__(self, run: str, *, island: str | None = None, max_points: int = 600, flush_s: float = 0.25):
        self.run = run
        self.agg = Aggregator(run, island=island)
        self.feed = Feed(self.agg)
        self.chart = ChartModel(self.agg, max_points=max_points, clock=time.time)
        self.feed.listen(lambda rec, _s, _d: self.chart.add(rec))
        self.flush_s = flush_s
        self.clients: set[_Viewer] = set()
        self.dropped_clients = 0
        self._seen = (0, 0)  # (feed.received, feed.state_received) at the last flush
        self._page = page(run)

    def flush(self, *, force: bool = False) -> int:
        """Send what arrived since the last flush to every viewer (with `force`, the current numbers even
        when nothing did); returns the number of viewers reached."""
        seen = (self.feed.received, self.feed.state_received)
        if seen == self._seen and not force:
            return 0
        self._seen = seen
        delta = self.chart.take_delta(force=True)
        data = sse("delta", orjson.dumps(delta).decode())
        reached = 0
        for v in list(self.clients):
            try:
                v.queue.put_nowait(data)
                reached += 1
            except asyncio.QueueFull:
                self.clients.discard(v)
                v.close()  # its stream ends; the browser reconnects and gets a fresh snapshot
                self.dropped_clients += 1
        return reached

    async def run_flusher(self) -> None:
        last_forced = time.monotonic()
        while True:
            await asyncio.sleep(self.flush_s)
            # A shard that goes silent sends nothing: refresh the shard rows (their age, and missing
            # past 15 s) every few seconds even when no message arrived.
            force = bool(self.agg.shards.shards()) and time.monotonic() - last_forced >= SHARD_REFRESH_S
            if force:
                last_forced = time.monotonic()
            self.flush(force=force)

    def snapshot(self) -> dict:
        return self.chart.snapshot()

    def _events(self, _q) -> Stream:
        # Flush first so the snapshot and the deltas that follow neither overlap nor miss a point
        # (no await between the flush, the snapshot and registering the viewer).
        self.flush()
        viewer = _Viewer()
        first = sse("snapshot", orjson.dumps(self.snapshot()).decode())
        self.clients.add(viewer)

        async def chunks():
            try:
                yield b"retry: 2000\n\n" + first
                while not viewer.closed:
                    try:
                        data = await asyncio.wait_for(viewer.queue.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        yield b": keepalive\n\n"
                        continue
                    yield data
            finally:
                self.clients.discard(viewer)

        return Stream(chunks())

    def routes(self) -> dict:
        return {
            "/": lambda _q: Response(200, self._page, "text/html; charset=utf-8"),
            "/events": self._events,
            "/state.json": lambda _q: Response(200, orjson.dumps(self.snapshot()), "application/json"),
            "/healthz": lambda _q: Response(200, b"ok\n"),
        }


async def serve_dashboard(nc, opts: SourceOptions, *, host: str = "127.0.0.1", port: int = 8080,
                          max_points: int = 600, flush_s: float = 0.25, stop: asyncio.Event | None = None,
                          started: asyncio.Future | None = None, dashboard: Dashboard | None = None) -> Dashboard:
    """Serve the page, subscribe, and push updates until `stop`; `started` gets the bound port as soon
    as it listens (the page shows "waiting for data" until the run's streams exist)."""
    dash = dashboard or Dashboard(opts.run, island=opts.island, max_points=max_points, flush_s=flush_s)
    server = HttpServer(dash.routes(), host, port)
    bound = await server.start()
    log.info("dashboard for run %s on http://%s:%d/", opts.run, host, bound)
    if started is not None and not started.done():
        started.set_result(bound)
    flusher = asyncio.create_task(dash.run_flusher())
    try:
        await follow(nc, opts, dash.feed, stop, say=log.warning)
    finally:
        flusher.cancel()
        await server.close()
    return dash
