"""Per-shard syncer status in the viewers (docs/design.md §10): `yeto steplog tail`, `yeto exporter` and
`yeto dashboard` read every `syncer` / `syncer.<K>` status record and `commit` / `commit.<K>` commit
record of the run's `state` KV and show, per shard, phase, rounds in flight, last commit and memory,
and a shard as missing when its record is absent or stale (15 s) or the coordinator says so.

Against a real nats-server: the records are hand-written into a provisioned run's state KV with
schemas.provision.kv_put, the way the syncer writes them; the viewers follow the KV live.
"""
from __future__ import annotations

import asyncio
import io
import time

import orjson
from rich.console import Console

from yeto.schemas.provision import kv_put
from yeto.services.steplog.aggregate import Aggregator
from yeto.services.steplog.consume import SourceOptions
from yeto.services.steplog.dashboard import Dashboard, serve_dashboard
from yeto.services.steplog.exporter import Exporter, serve_exporter
from yeto.services.steplog.shards import STALE_S, ShardBoard
from yeto.services.steplog.tail import render_text, tail
from tests.test_steplog_support import http_get, scrape, until


def status(shard: int | None, shards: int, *, age: float = 0.0, phase: str = "rounds", step: int = 7,
           versions: dict | None = None, flight: tuple = (9,), rss: int = 3 << 30, missing=(), exited=False) -> bytes:
    """A status record as the syncer writes it (services/syncer/status.py status_record + shard fields)."""
    rec = {"pid": 4242, "started_at": time.time() - 100, "updated_at": time.time() - age, "exited": exited,
           "phase": phase, "committed_step": step, "total_steps": 40,
           "versions": {str(f): v for f, v in (versions or {}).items()}, "live": ["a", "b"],
           "rounds_in_flight": [{"step": s, "fragment": (s - 1) % 4, "attempt": 1, "answered": 1, "expected": 2}
                                for s in flight],
           "counters": {"rejected": 0}, "rounds": {"merge": 3}}
    if shard is not None:
        rec.update(shard=shard, shards=shards, fragments=[f for f in range(4) if f % shards == shard], rss_bytes=rss)
        if shard == 0:
            rec["shards_missing"] = list(missing)
    return orjson.dumps(rec)


def commit(step: int, versions: dict) -> bytes:
    return orjson.dumps({"committed_step": step, "versions": {str(f): v for f, v in versions.items()},
                         "version_digests": {str(f): "ab" * 32 for f in versions}})


async def put(nc, run, key, value):
    await kv_put(nc.jetstream(), run, "state", key, value)


# ---------------------------------------------------------------------------------------- the board (pure)

def test_board_rows_missing_stale_exited_and_the_coordinators_word():
    b = ShardBoard()
    now = 1000.0
    assert b.rows(now) == []
    rec = lambda k, **kw: orjson.loads(status(k, 3, **kw))  # noqa: E731
    for k, kw in ((0, {"missing": [2]}), (1, {"age": STALE_S + 1})):
        r = rec(k, **kw)
        r["updated_at"] = now - kw.get("age", 0)
        assert b.put(f"syncer.{k}", orjson.dumps(r))
    assert b.put("commit.2", commit(6, {2: 1}))
    rows = {r.shard: r for r in b.rows(now)}
    assert sorted(rows) == [0, 1, 2] and rows[0].state == "ok" and rows[0].rss_bytes == 3 << 30
    assert rows[0].rounds_in_flight == [9] and rows[0].phase == "rounds"
    assert rows[1].state == "missing" and rows[1].reason == f"no status for {STALE_S + 1:.0f} s"
    assert rows[2].state == "missing" and "no status record (syncer.2)" in rows[2].reason
    assert "the coordinator counts it missing" in rows[2].reason
    assert rows[2].committed_step == 6 and rows[2].versions == {2: 1}  # the last commit, from commit.2
    # just under the threshold: not missing; an exited shard is not missing however old its record
    r = rec(1)
    r["updated_at"] = now - STALE_S + 0.5
    b.put("syncer.1", orjson.dumps(r))
    assert b.rows(now)[1].state == "ok"
    r = rec(1, exited=True, phase="done")
    r["updated_at"] = now - 3600
    b.put("syncer.1", orjson.dumps(r))
    assert b.rows(now)[1].state == "exited" and b.missing(now) == [2]
    # ... but one that exited before its final cut is missing (its fragments' rounds wait for it)
    r = rec(1, exited=True, phase="running")
    b.put("syncer.1", orjson.dumps(r))
    assert b.rows(now)[1].state == "missing" and b.rows(now)[1].reason == "exited in phase running"
    # deleted: missing again
    b.put("syncer.1", None)
    assert b.missing(now) == [1, 2]
    # the coordinator's list counts only while the coordinator itself reports
    b.put("commit.2", None)
    r = rec(2)
    r["updated_at"] = now
    b.put("syncer.2", orjson.dumps(r))
    assert b.missing(now) == [1, 2] and "coordinator" in b.rows(now)[2].reason
    r = rec(0, missing=[2])
    r["updated_at"] = now - STALE_S - 5
    b.put("syncer.0", orjson.dumps(r))
    rows = b.rows(now)
    assert b.missing(now) == [0, 1] and rows[2].state == "ok" and rows[0].reason.startswith("no status for")


def test_a_record_seen_arriving_ages_on_the_viewers_clock_not_the_writers():
    b = ShardBoard()
    now = 5000.0
    skewed = orjson.loads(status(1, 2))
    skewed["updated_at"] = now - 3600  # the shard host's clock is an hour behind
    b.put("syncer.1", orjson.dumps(skewed), seen_at=now - 2)  # but it arrived 2 s ago
    assert b.rows(now)[1].state == "ok" and b.rows(now)[1].age_s == 2
    ahead = orjson.loads(status(1, 2))
    ahead["updated_at"] = now + 3600  # an hour ahead, and nothing new arrived for 20 s
    b.put("syncer.1", orjson.dumps(ahead), seen_at=now - 20)
    assert b.rows(now)[1].state == "missing" and b.rows(now)[1].reason == "no status for 20 s"
    b.put("syncer.1", orjson.dumps(ahead))  # read at start: only the writer's clock to go by
    assert b.rows(now)[1].state == "ok"


def test_board_refuses_records_of_the_wrong_shape_and_keeps_the_last_good_one():
    b = ShardBoard()
    assert b.put("syncer.1", status(1, 2))
    good = orjson.loads(status(1, 2))
    bad = [  # (key, value, what the error names)
        ("syncer.1", b"{not json", "syncer.1: "),
        ("syncer.1", status(0, 2), "field 'shard' is 0, the key names shard 1"),
        ("syncer.1", orjson.dumps({**good, "rss_bytes": -1}), "'rss_bytes' must be an integer >= 0, got -1"),
        ("syncer.1", orjson.dumps({**good, "versions": {"x": 1}}), "versions entry 'x'"),
        ("syncer.1", orjson.dumps({**good, "updated_at": "soon"}), "'updated_at' must be a finite number"),
        ("syncer.1", orjson.dumps({**good, "phase": ""}), "'phase' must be a non-empty string"),
        ("syncer.0", orjson.dumps({**orjson.loads(status(0, 2)), "shards_missing": [5]}), "'shards_missing'"),
        ("syncer", status(1, 2), "syncer: the unsharded key holds shard 1 of 2"),
        ("commit.1", b"[]", "commit.1: a commit record is an object"),
    ]
    for n, (key, value, why) in enumerate(bad, 1):
        assert b.put(key, value), key
        assert b.malformed == n and why in b.last_malformed, (why, b.last_malformed)
    assert b.status[1].rss_bytes == 3 << 30  # the good record stayed
    # other keys are not shard records and are left alone
    for key in ("session", "pulls.1", "final.1", "syncer.01", "syncer.x", "syncerx", "commits"):
        assert not b.put(key, b"{}"), key
    assert b.malformed == len(bad)


def test_unsharded_record_of_today_is_one_shard():
    b = ShardBoard()
    b.put("syncer", status(None, 1, versions={0: 2, 1: 1}))
    b.put("commit", commit(5, {0: 2, 1: 2}))
    (row,) = b.rows(time.time())
    # the status record (step 7) is newer than the commit record on the step, older on fragment 1
    assert (row.shard, row.shards, row.state, row.committed_step, row.versions) == (0, 1, "ok", 7, {0: 2, 1: 2})
    assert row.rss_bytes is None


# ---------------------------------------------------------------------------------------- against NATS

async def test_tail_shows_each_shard_and_the_missing_one(nc, run):
    await put(nc, run, "session", b"{}")  # other keys of the bucket are ignored
    await put(nc, run, "syncer.0", status(0, 2, versions={0: 3, 2: 2}, flight=(9, 11), rss=5 << 30))
    await put(nc, run, "commit.0", commit(7, {0: 3, 2: 2}))
    await put(nc, run, "commit.1", commit(8, {1: 2, 3: 2}))
    agg = Aggregator(run)
    ready, stop = asyncio.Event(), asyncio.Event()
    console = Console(record=True, width=240, file=io.StringIO(), force_terminal=False, color_system=None)
    task = asyncio.create_task(tail(nc, SourceOptions(run), console=console, agg=agg, ready=ready, stop=stop,
                                    refresh_hz=20))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        # the values present at start are in before the first screen
        assert set(agg.shards.status) == {0} and set(agg.shards.commits) == {0, 1}
        assert agg.syncer_versions == {0: 3, 1: 2, 2: 2, 3: 2}  # lag is right before the first merge
        text = render_text(agg)
        row0 = next(line for line in text.splitlines() if line.startswith("│    0 │"))
        for cell in ("ok", "rounds", "7", "9 11", "0:3 2:2", "5.0 GiB"):
            assert cell in row0, (cell, row0)
        row1 = next(line for line in text.splitlines() if line.startswith("│    1 │"))
        assert "MISSING (no status record (syncer.1))" in row1 and "8" in row1 and "1:2 3:2" in row1, row1
        assert "syncer shard missing: 1" in text and "syncer shards (2)" in text
        # shard 1 starts reporting: the live watch brings it in
        await put(nc, run, "syncer.1", status(1, 2, versions={1: 3, 3: 2}, step=10, flight=(), rss=4 << 30))
        await until(lambda: 1 in agg.shards.status, what="syncer.1 seen")
        assert agg.syncer_versions[1] == 3 and agg.committed_step == 10  # a status record's versions are committed
        row1 = next(line for line in render_text(agg).splitlines() if line.startswith("│    1 │"))
        assert "ok" in row1 and "10" in row1 and "1:3 3:2" in row1 and "4.0 GiB" in row1, row1
        assert "missing" not in render_text(agg).split("syncer shards")[0]
        # a live update is fresh when it arrives, whatever the writer's clock says
        await put(nc, run, "syncer.1", status(1, 2, versions={1: 3, 3: 2}, step=10, flight=(), rss=4 << 30, age=3600))
        await until(lambda: agg.shards.status[1].updated_at < time.time() - 3000, what="the skewed record seen")
        row1 = next(line for line in render_text(agg).splitlines() if line.startswith("│    1 │"))
        assert "ok" in row1 and "MISSING" not in row1, row1
        # ... and goes silent: 20 s later it is missing again (judged at render time)
        text = render_text(agg, now=time.time() + 20)
        row1 = next(line for line in text.splitlines() if line.startswith("│    1 │"))
        assert "MISSING (no status for 2" in row1, row1
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_exporter_labels_every_shard_metric_by_shard(nc, run):
    await put(nc, run, "syncer.0", status(0, 3, versions={0: 3, 3: 2}, flight=(9, 11), rss=5 << 30, missing=[1]))
    await put(nc, run, "syncer.1", status(1, 3, versions={1: 3}, step=8, flight=(10,), rss=2 << 30))
    await put(nc, run, "commit.2", commit(6, {2: 2}))
    exp = Exporter(run)
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_exporter(nc, SourceOptions(run), port=0, stop=stop, started=started, exporter=exp))
    port = await asyncio.wait_for(started, 10)
    try:
        await until(lambda: len(exp.agg.shards.status) == 2 and 2 in exp.agg.shards.commits, what="records seen")
        m = await scrape(port)

        def val(name, **labels):
            return m[(name, tuple(sorted(labels.items())))][0]

        assert val("yeto_syncer_shards") == 3
        assert [val("yeto_syncer_shard_missing", shard=str(k)) for k in range(3)] == [0, 1, 1]
        assert [val("yeto_syncer_shard_up", shard=str(k)) for k in range(3)] == [1, 0, 0]
        assert val("yeto_syncer_shard_rss_bytes", shard="0") == 5 << 30 and val("yeto_syncer_shard_rss_bytes", shard="1") == 2 << 30
        assert val("yeto_syncer_shard_rounds_in_flight", shard="0") == 2
        assert val("yeto_syncer_shard_committed_step", shard="1") == 8 and val("yeto_syncer_shard_committed_step", shard="2") == 6
        assert val("yeto_syncer_shard_version", shard="0", fragment="3") == 2
        assert val("yeto_syncer_shard_version", shard="2", fragment="2") == 2
        assert val("yeto_syncer_shard_phase", shard="1", phase="rounds") == 1
        assert ("yeto_syncer_shard_rss_bytes", (("shard", "2"),)) not in m  # no record, no memory figure
        assert m[("yeto_syncer_shards", ())][1] == run
        # the coordinator no longer counts shard 1 missing, shard 2 reports, and a bad record is counted
        await put(nc, run, "syncer.0", status(0, 3, versions={0: 3, 3: 2}, missing=[]))
        await put(nc, run, "syncer.2", status(2, 3, versions={2: 2}, step=6))
        await put(nc, run, "syncer.1", b"{torn")
        await until(lambda: exp.agg.shards.malformed == 1 and 2 in exp.agg.shards.status, what="updates seen")
        m = await scrape(port)
        assert [val("yeto_syncer_shard_missing", shard=str(k)) for k in range(3)] == [0, 0, 0]
        assert val("yeto_syncer_state_malformed_total") == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_dashboard_state_has_the_shard_rows(nc, run):
    await put(nc, run, "syncer.0", status(0, 2, versions={0: 3, 2: 2}, rss=5 << 30))
    await put(nc, run, "syncer.1", status(1, 2, versions={1: 3, 3: 2}, age=30))  # stale
    dash = Dashboard(run, flush_s=0.05)
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_dashboard(nc, SourceOptions(run), port=0, stop=stop, started=started,
                                               dashboard=dash))
    port = await asyncio.wait_for(started, 10)
    try:
        await until(lambda: len(dash.agg.shards.status) == 2, what="records seen")
        code, _, body = await http_get(port, "/state.json")
        assert code == 200
        rows = orjson.loads(body)["shards"]
        assert [(r["shard"], r["state"]) for r in rows] == [(0, "ok"), (1, "missing")]
        assert rows[0]["rss_bytes"] == 5 << 30 and rows[0]["versions"] == {"0": 3, "2": 2}
        assert rows[1]["reason"].startswith("no status for 3") and rows[1]["age_s"] >= 30
        code, _, page = await http_get(port, "/")
        assert b'id="t-shards"' in page and b"renderShards" in page
        # a state record alone (no step-log message) reaches the open pages as a delta
        seen = dash._seen
        await put(nc, run, "syncer.1", status(1, 2, versions={1: 4, 3: 2}))
        await until(lambda: dash._seen != seen, what="a flush for the state record")
        assert dash.chart.take_delta(force=True)["shards"][1]["state"] == "ok"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
