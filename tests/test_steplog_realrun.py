"""The dashboards fed by a real run: `yeto demo` (real syncer, island a of one process, island b of two
gloo ranks, real nats-server) leaves its step-log and event streams on the broker; the tail, the
exporter and the web page read them from the start. Expected values come from the islands' own
step-log files (YETO_DILOCO_STEP_LOG, written by the island next to each publish) and from the
demo's summary line — not from the aggregator under test."""
from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from yeto.services.steplog.aggregate import Aggregator
from yeto.services.steplog.consume import SourceOptions
from yeto.services.steplog.exporter import Exporter, serve_exporter
from yeto.services.steplog.tail import tail
from tests.test_steplog_dashboard import ARTIFACTS, Served, browser  # noqa: F401  (browser: a fixture)
from tests.test_steplog_support import scrape, until as _until


def _steplog(demo_run, island: str) -> list[dict]:
    path = Path(demo_run["workdir"]) / f"steplog-{island}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def logs(demo_run):
    out = {isl: _steplog(demo_run, isl) for isl in ("a", "b")}
    for isl, rows in out.items():
        assert len(rows) >= 10, f"island {isl} wrote only {len(rows)} step-log lines"
    return out


async def test_tail_renders_a_real_run(nc, demo_run, logs):
    run = demo_run["run"]
    agg = Aggregator(run)
    stop = asyncio.Event()
    buf = io.StringIO()
    console = Console(record=True, width=260, file=buf, force_terminal=False, color_system=None)
    task = asyncio.create_task(tail(nc, SourceOptions(run, from_start=True), console=console, agg=agg, stop=stop,
                                    refresh_hz=20))
    rounds = demo_run["summary"]["rounds"]
    await _until(lambda: agg.kinds["steplog"] == sum(map(len, logs.values())) and agg.merges == rounds,
                 timeout=20, what="every step-log event and merge")
    await asyncio.sleep(0.2)  # one more frame after the last event
    stop.set()
    await asyncio.wait_for(task, 5)
    assert agg.malformed == 0, agg.last_malformed
    for isl, rows in logs.items():
        st = agg.islands[isl]
        last = rows[-1]
        assert st.events == len(rows) and st.step == last["step"]
        assert st.gen == last["gen"]
        for field in ("pushes", "applies", "bytes_out", "bytes_in"):
            assert st.totals[field] == sum(r[field] for r in rows), field
        assert st.versions == {int(f): v for f, v in last["versions"].items()}
    assert all(r.status == "committed" for r in agg.rounds.values()) and len(agg.rounds) == rounds
    text = console.export_text()
    frame = text[text.rindex(f"run {run}"):]
    for isl, rows in logs.items():
        row = " ".join(line for line in frame.splitlines() if line.startswith(f"│{isl} "))
        assert row, f"no row for island {isl} in:\n{frame}"
        assert f" {rows[-1]['step']} " in row, (rows[-1]["step"], row)
    committed = [line for line in frame.splitlines() if "committed" in line]
    assert committed, frame


async def test_exporter_scrape_matches_the_step_logs(nc, demo_run, logs):
    run = demo_run["run"]
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    exp = Exporter(run)
    server = asyncio.create_task(serve_exporter(nc, SourceOptions(run, from_start=True), port=0, stop=stop,
                                                started=started, exporter=exp))
    try:
        port = await asyncio.wait_for(started, 10)
        rounds = demo_run["summary"]["rounds"]
        await _until(lambda: exp.agg.kinds["steplog"] == sum(map(len, logs.values())) and exp.agg.merges == rounds,
                     timeout=20, what="every step-log event and merge")
        m = await scrape(port)
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)
    assert m[("yeto_merges_total", ())][0] == rounds
    assert m[("yeto_round_latency_seconds_count", ())][0] == rounds
    for isl, rows in logs.items():
        lab = (("island", isl),)
        assert m[("yeto_island_steplog_events_total", lab)][0] == len(rows)
        assert m[("yeto_island_step", lab)][0] == rows[-1]["step"]
        for field in ("pushes", "applies", "bytes_out", "bytes_in"):
            assert m[(f"yeto_island_{field}_total", lab)][0] == sum(r[field] for r in rows), field
        assert m[("yeto_island_boundary_seconds_count", lab)][0] == len(rows)
        assert m[("yeto_island_boundary_seconds_sum", lab)][0] == pytest.approx(sum(r["boundary_s"] for r in rows))
        assert m[("yeto_island_export_seconds_sum", lab)][0] == pytest.approx(sum(r["export_s"] for r in rows))
        assert sum(r["pushes"] for r in rows) > 0 and sum(r["applies"] for r in rows) > 0
        for fid, v in rows[-1]["versions"].items():
            assert m[("yeto_island_version", (("fragment", fid), ("island", isl)))][0] == v
    assert not any(name == "yeto_steplog_malformed_total" and m[(name, lab)][0] for name, lab in m)


async def test_dashboard_draws_a_real_run(nc, demo_run, logs, browser):  # noqa: F811
    run = demo_run["run"]
    async with Served(nc, run) as srv:
        total = sum(map(len, logs.values()))
        await _until(lambda: srv.dash.agg.kinds["steplog"] == total, timeout=20, what="events read")
        await asyncio.to_thread(browser.open, srv.url)

        async def drawn():
            s = await asyncio.to_thread(browser.eval, "window.yetoDash && yetoDash.stats()")
            want = {isl: len(rows) for isl, rows in logs.items()}
            return s if (s and s["islands"] == want and s["rounds"] == demo_run["summary"]["rounds"]
                         and s["drawn"].get("boundary") == total) else None

        s = await _until(drawn, timeout=20, what="the real run drawn")
        assert s["errors"] == 0 and s["malformed"] == 0
        assert s["drawn"]["split"] >= 1 and s["drawn"]["rounds"] >= demo_run["summary"]["rounds"]
        legend = await asyncio.to_thread(browser.eval, "[...document.querySelectorAll('#legend span')].map(e => e.textContent)")
        assert legend == ["a", "b"]
        ARTIFACTS.mkdir(exist_ok=True)
        await asyncio.to_thread(browser.screenshot, ARTIFACTS / "steplog-dashboard-demo.png")
