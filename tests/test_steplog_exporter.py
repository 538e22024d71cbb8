"""`yeto exporter` against a real nats-server: scrape /metrics over HTTP and check the values against
sums computed here from the published events (not from the Aggregator)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from yeto.services.steplog.consume import SourceOptions
from yeto.services.steplog.exporter import Exporter, serve_exporter
from tests.test_steplog_support import (MALFORMED, add_malformed, provision, publish_all, remove_run, scenario,
                                       http_get, scrape)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def _until_scraped(port, name, labels, value, timeout=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = await scrape(port)
        if got.get((name, labels), (None,))[0] == value:
            return got
        if loop.time() > deadline:
            raise AssertionError(f"{name}{labels} never reached {value}: {got.get((name, labels))}")
        await asyncio.sleep(0.05)


async def test_scrape_shows_histograms_counters_and_gauges(nc, run):
    r = scenario(run)
    add_malformed(r)
    await publish_all(nc.jetstream(), r.msgs)
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    exp = Exporter(run)
    task = asyncio.create_task(serve_exporter(nc, SourceOptions(run, from_start=True), port=0, stop=stop,
                                              started=started, exporter=exp))
    port = await asyncio.wait_for(started, 10)
    try:
        m = await _until_scraped(port, "yeto_exporter_messages_total", (), len(r.msgs))
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)

    assert all(name.startswith("yeto_") for name, _ in m), sorted({n for n, _ in m if not n.startswith("yeto_")})
    assert {run_ for _v, run_ in m.values()} == {run}  # every sample is labelled with the run

    def v(name, **labels):
        return m[(name, tuple(sorted((k, str(x)) for k, x in labels.items())))][0]

    for isl in ("a", "b"):
        mine = [e for e in r.steplogs if e["island"] == isl]
        for field in ("boundary", "export", "apply"):
            assert v(f"yeto_island_{field}_seconds_count", island=isl) == len(mine)
            assert v(f"yeto_island_{field}_seconds_sum", island=isl) == pytest.approx(sum(e[f"{field}_s"] for e in mine))
        # the 0.25 s bucket of boundary time counts the events at or under 0.25 s
        assert v("yeto_island_boundary_seconds_bucket", island=isl, le="0.25") == sum(e["boundary_s"] <= 0.25 for e in mine)
        for key in ("pushes", "applies", "bytes_out", "bytes_in", "scatter_bytes", "gather_bytes", "rejected"):
            assert v(f"yeto_island_{key}_total", island=isl) == sum(e[key] for e in mine), key
        assert v("yeto_island_steplog_events_total", island=isl) == len(mine)
        assert v("yeto_island_step", island=isl) == mine[-1]["step"]
        assert v("yeto_island_pending_pulls", island=isl) == mine[-1]["pending_pulls"]
        for f, ver in mine[-1]["versions"].items():
            assert v("yeto_island_version", island=isl, fragment=f) == ver
    assert v("yeto_island_steplog_dropped", island="b") == 3
    assert v("yeto_island_loss", island="a") == 2.75
    assert ("yeto_island_loss", (("island", "b"),)) not in m  # b never reported a loss
    merges = [e for e in r.events if e["kind"] == "merge"]
    assert v("yeto_round_latency_seconds_count") == len(merges)
    assert v("yeto_round_latency_seconds_sum") == pytest.approx(sum(e["sync_s"] for e in merges))
    assert v("yeto_round_latency_seconds_bucket", le="2.5") == sum(e["sync_s"] <= 2.5 for e in merges)
    assert v("yeto_round_quorum_seconds_sum") == pytest.approx(sum(e["quorum_s"] for e in merges))
    for e in {(e["island"], e["disposition"]) for e in r.events if e["kind"] == "disposition"}:
        want = sum(1 for x in r.events if x["kind"] == "disposition" and (x["island"], x["disposition"]) == e)
        assert v("yeto_dispositions_total", island=e[0], disposition=e[1]) == want
    assert v("yeto_quorum_timeouts_total") == 1 and v("yeto_round_restarts_total") == 1
    assert v("yeto_merges_total") == 2 and v("yeto_syncer_errors_total") == 1
    assert v("yeto_syncer_events_total", kind="commit") == 4
    assert v("yeto_syncer_version", fragment="0") == 1 and v("yeto_syncer_version", fragment="1") == 1
    assert v("yeto_island_version_lag", island="b", fragment="1") == 1
    assert v("yeto_island_version_lag", island="a", fragment="1") == 0
    assert v("yeto_island_version_lag_max", island="b") == 1
    assert v("yeto_committed_step") == 2 and v("yeto_islands") == 2
    assert sum(val for (name, _), (val, _r) in m.items() if name == "yeto_steplog_malformed_total") == MALFORMED
    assert v("yeto_steplog_malformed_total", stream="steplog", reason="subject_mismatch") == 1


async def test_exporter_cli_serves_before_the_run_exists_then_follows_it(nc, run_id, nats_url):
    """The command as compose runs it: listening at once (Prometheus sees the target up), waiting for
    the syncer to provision the run, then following new events."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "yeto.services.cli", "exporter", "--run", run_id, "--nats", nats_url, "--port", "0",
        "--log-level", "WARNING", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    js = nc.jetstream()
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert "/metrics" in line, line
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        m = await scrape(port)
        assert m[("yeto_islands", ())][0] == 0
        status, _h, body = await http_get(port, "/nope")
        assert status == 404
        await provision(js, run_id)
        r = scenario(run_id)
        # deliver-new: publish until the exporter's consumer exists and sees one (it polls for the streams)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while (await scrape(port)).get(("yeto_island_steplog_events_total", (("island", "a"),)), (0,))[0] == 0:
            assert loop.time() < deadline, "exporter never picked up the run"
            r.step("a", len(r.steplogs) + 1, boundary_s=0.5, export_s=0.25, apply_s=0.125, versions={0: 0}, pushes=1)
            await publish_all(js, r.msgs, start=len(r.msgs) - 1)
            await asyncio.sleep(0.3)
    finally:
        proc.terminate()
        _out, err = await asyncio.wait_for(proc.communicate(), 10)
        await remove_run(js, run_id)
    assert b"waiting for run" in err
    assert proc.returncode == 0, err.decode()  # SIGTERM closes the port and the connection cleanly
