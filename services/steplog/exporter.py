"""`yeto exporter`: a Prometheus endpoint for one run, fed from its STEPLOG and EVENTS streams.

Two parts:

* `RunMetrics` — histograms observed per event (boundary / export / apply time per island, round
  latency and time to quorum per merge) and a collector that reads counters and gauges straight from
  the `Aggregator` at scrape time, so the exposition and the terminal table can never disagree.
* `serve_exporter` — the shell: subscribe, feed, answer GET /metrics.

Every metric is named `yeto_*` and labelled `run` (and `island`, `fragment`, `disposition`, `kind`,
`shard` where they apply). The `yeto_syncer_shard_*` gauges come from the syncer processes' status
and commit records in the run's `state` KV, one `shard` label value per shard ("0" unsharded). Counters count what this exporter has seen since it started (with --from-start:
since the streams' retention window began); Prometheus' rate() handles the reset at a restart.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .aggregate import STEPLOG, Aggregator, Record
from .consume import Feed, SourceOptions, follow
from .httpd import HttpServer, Response

log = logging.getLogger(__name__)

# Boundary phases run from a few ms (a tiny model) to minutes (GB fragments over a slow link);
# rounds from under a second to the quorum timeout (15 min by default).
BOUNDARY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 900, 1800)

# steplog per-step counter -> (metric name without _total, help)
ISLAND_COUNTERS = {
    "pushes": ("yeto_island_pushes", "Pushes sent by the island."),
    "applies": ("yeto_island_applies", "Broadcast versions applied by the island."),
    "bytes_out": ("yeto_island_bytes_out", "Bytes the island published to NATS."),
    "bytes_in": ("yeto_island_bytes_in", "Bytes the island fetched from NATS."),
    "scatter_bytes": ("yeto_island_scatter_bytes", "Bytes the island's rank 0 sent to its peer ranks."),
    "gather_bytes": ("yeto_island_gather_bytes", "Bytes the island's rank 0 received from its peer ranks."),
    "rejected": ("yeto_island_rejected", "Broadcasts or pulls the island refused."),
}


class _StateCollector(Collector):
    def __init__(self, agg: Aggregator, feed: Feed | None, clock: Callable[[], float] = time.time):
        self.agg = agg
        self.feed = feed
        self.clock = clock

    def collect(self) -> Iterable:
        a, run = self.agg, self.agg.run
        isl = ["run", "island"]

        def counter(name, doc, labels=("run",)):
            return CounterMetricFamily(name, doc, labels=list(labels))

        def gauge(name, doc, labels=("run",)):
            return GaugeMetricFamily(name, doc, labels=list(labels))

        # ---- per island
        fams = {k: counter(n, d, isl) for k, (n, d) in ISLAND_COUNTERS.items()}
        events = counter("yeto_island_steplog_events", "Step-log events received from the island.", isl)
        step = gauge("yeto_island_step", "The island's latest local step.", isl)
        pending = gauge("yeto_island_pending_pulls", "Pulls the island has not answered yet.", isl)
        dropped = gauge("yeto_island_steplog_dropped", "Step-log events the island dropped (its send queue was full), per process.", isl)
        last_t = gauge("yeto_island_last_event_timestamp_seconds", "Unix time of the island's latest step-log event.", isl)
        loss = gauge("yeto_island_loss", "The island's latest training loss.", isl)
        version = gauge("yeto_island_version", "Version of each fragment the island holds.", isl + ["fragment"])
        lag = gauge("yeto_island_version_lag", "Versions the island is behind the syncer, per fragment.", isl + ["fragment"])
        lag_max = gauge("yeto_island_version_lag_max", "Versions the island is behind the syncer on its worst fragment.", isl)
        gens = gauge("yeto_island_generations", "Connection generations seen for the island (>1: its process restarted).", isl)
        disp = counter("yeto_dispositions", "Push dispositions recorded by the syncer.", isl + ["disposition"])
        for name, st in sorted(a.islands.items()):
            lv = [run, name]
            for k, fam in fams.items():
                fam.add_metric(lv, st.totals[k])
            events.add_metric(lv, st.events)
            gens.add_metric(lv, st.gens)
            for d, n in sorted(st.dispositions.items()):
                disp.add_metric(lv + [d], n)
            if st.events == 0:
                continue
            step.add_metric(lv, st.step)
            pending.add_metric(lv, st.pending_pulls)
            dropped.add_metric(lv, st.dropped)
            last_t.add_metric(lv, st.t)
            if st.loss is not None:
                loss.add_metric(lv, st.loss)
            for f, v in sorted(st.versions.items()):
                version.add_metric(lv + [str(f)], v)
            per = st.lag(a.syncer_versions)
            for f, n in per.items():
                lag.add_metric(lv + [str(f)], n)
            if per:
                lag_max.add_metric(lv, max(per.values()))
        yield from fams.values()
        yield from (events, step, pending, dropped, last_t, loss, version, lag, lag_max, gens, disp)

        # ---- run / syncer
        def one(fam, value, extra=()):
            fam.add_metric([run, *extra], value)
            return fam

        yield one(counter("yeto_quorum_timeouts", "Rounds that missed their quorum deadline (restart, or strict-mode error)."), a.quorum_timeouts)
        yield one(counter("yeto_round_restarts", "Round restarts with a new attempt."), a.restarts)
        yield one(counter("yeto_merges", "Rounds merged."), a.merges)
        yield one(counter("yeto_syncer_resumes", "Times the syncer resumed from its checkpoint."), a.syncer_resumes)
        yield one(counter("yeto_syncer_errors", "Error records on the syncer's tape."), a.errors)
        kinds = counter("yeto_syncer_events", "Syncer tape records by kind.", ("run", "kind"))
        for k, n in sorted(a.kinds.items()):
            if k != STEPLOG:
                kinds.add_metric([run, k], n)
        yield kinds
        sv = gauge("yeto_syncer_version", "The syncer's newest committed version per fragment.", ("run", "fragment"))
        for f, v in sorted(a.syncer_versions.items()):
            sv.add_metric([run, str(f)], v)
        yield sv
        if a.committed_step is not None:
            yield one(gauge("yeto_committed_step", "The newest committed global step."), a.committed_step)
        yield one(gauge("yeto_islands", "Islands seen."), len(a.islands))
        mal = counter("yeto_steplog_malformed", "Messages skipped by this exporter: not JSON, not valid, or not matching their subject.",
                      ("run", "stream", "reason"))
        for (stream, reason), n in sorted(a.malformed_by.items()):
            mal.add_metric([run, stream, reason], n)
        yield mal
        yield from self._shards(run, gauge, counter)
        if self.feed is not None:
            yield one(counter("yeto_exporter_messages", "Messages this exporter received (valid or not)."), self.feed.received)


    def _shards(self, run: str, gauge, counter) -> Iterable:
        """Per syncer process (label `shard`; "0" for an unsharded syncer), from the state KV status and
        commit records. Staleness is judged at scrape time against this host's clock."""
        a = self.agg
        rows = a.shard_rows(self.clock())
        lab = ("run", "shard")
        shards = gauge("yeto_syncer_shards", "Syncer processes (shards) of the run, from their status records.")
        shards.add_metric([run], len(rows))
        yield shards
        up = gauge("yeto_syncer_shard_up", "1 while the shard's status record is fresh and it has not exited.", lab)
        missing = gauge("yeto_syncer_shard_missing", "1 when the shard's status record is absent, older than 15 s "
                        "(and it did not exit), or the coordinator counts it missing.", lab)
        exited = gauge("yeto_syncer_shard_exited", "1 when the shard's last status record says it exited.", lab)
        phase = gauge("yeto_syncer_shard_phase", "The shard's phase (value 1 on the phase it reports).", lab + ("phase",))
        step = gauge("yeto_syncer_shard_committed_step", "The newest step the shard committed (its own rounds).", lab)
        flight = gauge("yeto_syncer_shard_rounds_in_flight", "Rounds the shard has in flight.", lab)
        rss = gauge("yeto_syncer_shard_rss_bytes", "The shard process's peak resident memory.", lab)
        age = gauge("yeto_syncer_shard_status_age_seconds", "Seconds since the shard's status record was written.", lab)
        ver = gauge("yeto_syncer_shard_version", "The shard's committed version per fragment it owns.", lab + ("fragment",))
        for r in rows:
            lv = [run, str(r.shard)]
            up.add_metric(lv, 1 if r.state == "ok" else 0)
            missing.add_metric(lv, 1 if r.state == "missing" else 0)
            exited.add_metric(lv, 1 if r.state == "exited" else 0)
            if r.phase is not None:
                phase.add_metric(lv + [r.phase], 1)
                flight.add_metric(lv, len(r.rounds_in_flight))
            if r.committed_step is not None:
                step.add_metric(lv, r.committed_step)
            if r.rss_bytes is not None:
                rss.add_metric(lv, r.rss_bytes)
            if r.age_s is not None:
                age.add_metric(lv, r.age_s)
            for f, v in sorted(r.versions.items()):
                ver.add_metric(lv + [str(f)], v)
        yield from (up, missing, exited, phase, step, flight, rss, age, ver)
        bad = counter("yeto_syncer_state_malformed", "State KV shard records this exporter skipped (not JSON or wrong shape).")
        bad.add_metric([run], a.shards.malformed)
        yield bad


class RunMetrics:
    """Prometheus metrics of one run (see the module doc). `observe(rec)` after each accepted record."""

    def __init__(self, agg: Aggregator, feed: Feed | None = None, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.time):
        self.agg = agg
        self.registry = registry or CollectorRegistry(auto_describe=False)
        labels = ["run", "island"]
        h = lambda name, doc, lab, b: Histogram(name, doc, lab, registry=self.registry, buckets=b)  # noqa: E731
        self.boundary = h("yeto_island_boundary_seconds", "Time inside the sync boundary, per step.", labels, BOUNDARY_BUCKETS)
        self.export = h("yeto_island_export_seconds", "Time exporting pushes (gather + pack + send), per step.", labels, BOUNDARY_BUCKETS)
        self.apply = h("yeto_island_apply_seconds", "Time applying broadcasts (fetch + blend + scatter), per step.", labels, BOUNDARY_BUCKETS)
        self.round_latency = h("yeto_round_latency_seconds", "Round launch to commit (merge records' sync_s).", ["run"], ROUND_BUCKETS)
        self.quorum_time = h("yeto_round_quorum_seconds", "Round launch to quorum (merge records' quorum_s).", ["run"], ROUND_BUCKETS)
        self.registry.register(_StateCollector(agg, feed, clock))

    def observe(self, rec: Record | None) -> None:
        if rec is None:
            return
        m, run = rec.msg, self.agg.run
        if rec.stream == STEPLOG:
            self.boundary.labels(run, m["island"]).observe(m["boundary_s"])
            self.export.labels(run, m["island"]).observe(m["export_s"])
            self.apply.labels(run, m["island"]).observe(m["apply_s"])
        elif m["kind"] == "merge":
            if m.get("sync_s") is not None:
                self.round_latency.labels(run).observe(m["sync_s"])
            if m.get("quorum_s") is not None:
                self.quorum_time.labels(run).observe(m["quorum_s"])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class Exporter:
    """Aggregator + Feed + RunMetrics, and the HTTP routes that expose them (no network here)."""

    def __init__(self, run: str, *, island: str | None = None, clock: Callable[[], float] = time.time):
        self.run = run
        self.agg = Aggregator(run, island=island)
        self.feed = Feed(self.agg)
        self.metrics = RunMetrics(self.agg, self.feed, clock=clock)
        self.feed.listen(lambda rec, _s, _d: self.metrics.observe(rec))

    def routes(self) -> dict:
        return {
            "/metrics": lambda _q: Response(200, self.metrics.exposition(), CONTENT_TYPE_LATEST),
            "/": lambda _q: Response(200, f"yeto exporter for run {self.run}: scrape /metrics\n".encode()),
            "/healthz": lambda _q: Response(200, b"ok\n"),
        }


async def serve_exporter(nc, opts: SourceOptions, *, host: str = "127.0.0.1", port: int = 9464,
                         stop: asyncio.Event | None = None, started: asyncio.Future | None = None,
                         exporter: Exporter | None = None) -> Exporter:
    """Serve /metrics and subscribe until `stop`; `started` gets the bound port as soon as it listens
    (before the run's streams exist: Prometheus sees the target up while the run is not provisioned)."""
    exp = exporter or Exporter(opts.run, island=opts.island)
    server = HttpServer(exp.routes(), host, port)
    bound = await server.start()
    log.info("exporter for run %s on http://%s:%d/metrics", opts.run, host, bound)
    if started is not None and not started.done():
        started.set_result(bound)
    try:
        await follow(nc, opts, exp.feed, stop, say=log.warning)
    finally:
        await server.close()
    return exp
