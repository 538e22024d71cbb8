"""`yeto steplog tail` against a real nats-server: JetStream ordered consumers on STEPLOG and EVENTS."""
from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys

import orjson
from rich.console import Console

from yeto.services.steplog.aggregate import Aggregator
from yeto.services.steplog.consume import SourceOptions
from yeto.services.steplog.tail import tail
from tests.test_steplog_support import MALFORMED, SyntheticRun, add_malformed, provision, publish_all, remove_run, scenario, until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _seen(agg: Aggregator) -> int:
    return sum(agg.kinds.values()) + agg.malformed + agg.filtered


async def test_tail_from_start_renders_every_field(nc, run):
    r = scenario(run)
    add_malformed(r)
    await publish_all(nc.jetstream(), r.msgs)
    buf = io.StringIO()
    console = Console(record=True, width=260, file=buf, force_terminal=False, color_system=None)
    agg = Aggregator(run)
    stop = asyncio.Event()
    task = asyncio.create_task(tail(nc, SourceOptions(run, from_start=True), console=console, agg=agg, stop=stop,
                                    refresh_hz=20))
    await until(lambda: _seen(agg) == len(r.msgs))
    stop.set()
    await asyncio.wait_for(task, 5)
    text = console.export_text()
    # the last frame Live printed holds every column and the values of both islands and both rounds
    frame = text[text.rindex(f"run {run}"):]
    a_row = " ".join(line for line in frame.splitlines() if line.startswith("│a "))
    for cell in ("9f3c2a7b1e4d6c08", "300 ms", "100 ms", "120 ms", "33%/40%", "0:1 1:1", "2/2", "1000 B Σ2.0 KiB",
                 "2.0 KiB Σ3.9 KiB", "600 B/300 B", "accepted 2 duplicate 1", "2.75"):
        assert cell in a_row, (cell, a_row)
    b_row = " ".join(line for line in frame.splitlines() if line.startswith("│b (left)"))
    assert "1 (1:1)" in b_row and "0:1 1:0" in b_row and "accepted 1 out_of_round 1" in b_row
    r2 = next(line for line in frame.splitlines() if line.startswith("│   2 │"))
    assert "1/1 (1)" in r2 and "3.50 s" in r2 and "4.25 s" in r2 and "committed" in r2
    assert f"malformed {MALFORMED}" in frame and "restarts 1  quorum timeouts 1" in frame
    assert agg.malformed == MALFORMED and agg.kinds["steplog"] == len(r.steplogs)


async def test_tail_live_only_sees_what_comes_after_it_starts(nc, run):
    r = scenario(run)
    js = nc.jetstream()
    before = 6  # joins, v0 commits and two step-1 events
    await publish_all(js, r.msgs, stop=before)
    agg = Aggregator(run)
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(tail(nc, SourceOptions(run), console=Console(file=io.StringIO()), agg=agg,
                                    ready=ready, stop=stop, refresh_hz=20))
    await asyncio.wait_for(ready.wait(), 10)
    await publish_all(js, r.msgs, start=before)
    await until(lambda: _seen(agg) == len(r.msgs) - before)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert agg.islands["a"].events == 3 and "join" not in agg.kinds  # steps 2..4 only, no joins
    assert agg.merges == 2


async def test_tail_island_filter_and_core_subscription(nc, run):
    r = scenario(run)
    agg = Aggregator(run, island="b")
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(tail(nc, SourceOptions(run, island="b", core=True), console=Console(file=io.StringIO()),
                                    agg=agg, ready=ready, stop=stop, refresh_hz=20))
    await asyncio.wait_for(ready.wait(), 10)
    await publish_all(nc.jetstream(), r.msgs)
    # the filter is on the subject: a's step log never reaches this viewer
    await until(lambda: _seen(agg) == len(r.events) + 4)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert set(agg.islands) == {"b"} and agg.islands["b"].events == 4 and agg.filtered == 0


async def test_tail_json_cli_prints_raw_events_and_counts_malformed(nc, run, nats_url):
    r = scenario(run)
    add_malformed(r)
    # broken messages first: each stream delivers in order, so all are read before the last valid one
    msgs = r.msgs[-MALFORMED:] + r.msgs[:-MALFORMED]
    await publish_all(nc.jetstream(), msgs)
    valid = len(r.steplogs) + len(r.events)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "yeto.services.cli", "steplog", "tail", "--run", run, "--nats", nats_url, "--from-start",
        "--json", "--count", str(valid), "--timeout", "30", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 40)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert len(lines) == valid
    got = [orjson.loads(line) for line in lines]
    # every line is one message exactly as published; per stream, in publish order
    assert [m for m in got if "kind" not in m] == r.steplogs
    assert [m for m in got if "kind" in m] == r.events
    assert f"skipped {MALFORMED} malformed" in err.decode()


async def test_tail_waits_for_the_run_to_be_provisioned(nc, run_id):
    js = nc.jetstream()
    agg = Aggregator(run_id)
    stop = asyncio.Event()
    console = Console(file=io.StringIO(), record=True, width=200)
    task = asyncio.create_task(tail(nc, SourceOptions(run_id), console=console, agg=agg, stop=stop, refresh_hz=20))
    await asyncio.sleep(0.3)
    assert not task.done()
    assert "waiting for run" in console.export_text(clear=False)
    r = SyntheticRun(run_id)
    r.step("a", 1, boundary_s=0.1, export_s=0.05, apply_s=0.02, versions={0: 0})
    await provision(js, run_id)
    try:
        await asyncio.sleep(1.5)  # the wait polls once a second
        await publish_all(js, r.msgs)
        await until(lambda: agg.kinds["steplog"] == 1)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await remove_run(js, run_id)
    assert agg.islands["a"].step == 1


async def test_tail_since_replays_a_recent_window(nc, run):
    r = scenario(run)
    await publish_all(nc.jetstream(), r.msgs)
    agg = Aggregator(run)
    stop = asyncio.Event()
    task = asyncio.create_task(tail(nc, SourceOptions(run, since_s=600), console=Console(file=io.StringIO()), agg=agg,
                                    stop=stop, refresh_hz=20))
    await until(lambda: _seen(agg) == len(r.msgs))
    # and a window that ends before the publishes holds nothing (by the server's receive time)
    late = Aggregator(run)
    stop2 = asyncio.Event()
    await asyncio.sleep(0.3)
    task2 = asyncio.create_task(tail(nc, SourceOptions(run, since_s=0.1), console=Console(file=io.StringIO()), agg=late,
                                     stop=stop2, refresh_hz=20))
    await asyncio.sleep(0.5)
    stop.set()
    stop2.set()
    await asyncio.wait_for(asyncio.gather(task, task2), 5)
    assert agg.merges == 2 and agg.kinds["steplog"] == len(r.steplogs)
    assert _seen(late) == 0
