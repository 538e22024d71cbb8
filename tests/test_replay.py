"""`yeto replay`: a real syncer's recorded inputs replay to identical actions, and a tape edited by hand is
reported at the first action that differs.

The run: a real nats-server, a real `yeto syncer` process (paced, not lockstep, so heartbeats and Ticks
drive it) and scripted islands; two rounds, one of them restarted by a quorum timeout, then
finalization. Its tape is read back by the real `yeto replay` command, from the broker and from an export.
Below it, the recorder and the replay on their own (no broker): batching, a lost batch, a recorded
exception, and the events' JSON form.
"""
from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
import torch

from yeto.services.syncer.replay import replay, segments
from tests.scripted import Heartbeater, close_run, start_run, tape, tiny_layout, wait_tape

pytestmark = pytest.mark.timeout(240)  # several `yeto replay` processes; 90 s ran out on a loaded machine

LAYOUT = tiny_layout(2, 16)


def yeto_replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "replay", *args], capture_output=True,
                          text=True, timeout=60)


async def _run_to_the_end(nats_url, run_id, tmp_path) -> None:
    syncer, isls, _ = await start_run(
        nats_url, run_id, ["a", "b"], tmp_path / "ckpt", "--islands", "2", "--fragments", "2", "--sync-every", "2",
        "--total-steps", "2", "--quorum-timeout", "3", "--grace-ms", "0", "--chunk-bytes", "1024",
        layout=LAYOUT)
    a, b = isls
    beats = [Heartbeater(isl, every_s=0.2, step_time_s=0.05).start() for isl in isls]
    try:
        gen = torch.Generator().manual_seed(5)
        # round 1: only a answers attempt 1; the quorum timeout restarts it, both answer attempt 2
        p1a = await a.expect_pull(1, attempt=1)
        await a.push(p1a, torch.randn(a.frag(0)["numel"], generator=gen), c_tokens=100)
        for isl, tokens in ((a, 100), (b, 300)):
            p = await isl.expect_pull(1, attempt=2, timeout=20)
            await isl.push(p, torch.randn(isl.frag(0)["numel"], generator=gen), c_tokens=tokens)
        for isl, tokens in ((a, 50), (b, 70)):
            p = await isl.expect_pull(2, timeout=20)
            await isl.push(p, torch.randn(isl.frag(1)["numel"], generator=gen), c_tokens=tokens)
        for isl in isls:
            _, man = await isl.expect(lambda k, m: k == "manifest", timeout=20)
            await isl.ack(man["final_step"])
        assert syncer.wait(30) == 0, syncer.output()[-3000:]
        await wait_tape(a.js, run_id, lambda r: r["detail"]["batch"] > 0, kind="input")
    finally:
        for hb in beats:
            await hb.stop()
        records = await tape(isls[0].js, run_id)
        syncer.stop()
    return records, syncer, isls


async def test_a_real_runs_tape_replays_identical_and_an_edited_one_names_the_first_difference(
        nats_url, run_id, tmp_path):
    records, syncer, isls = await _run_to_the_end(nats_url, run_id, tmp_path)
    try:
        kinds = [r["kind"] for r in records]
        assert "restart" in kinds and kinds.count("merge") == 2
        # From the broker, with an export of the tape on the way.
        export = tmp_path / "tape.jsonl"
        res = yeto_replay("--nats", nats_url, "--run", run_id, "--export", str(export))
    finally:
        await close_run(isls, None, run_id)
    assert res.returncode == 0, res.stdout + res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("replayed ") and last.endswith(" identical"), res.stdout
    n_events, n_actions = int(last.split()[1]), int(last.split()[3])
    # The inputs as recorded: every event fed, Ticks included; what they produced covers every tape record
    # the machine wrote (restart, dispositions, joins, ...) and more (pulls, members, merges).
    inputs = [r for r in records if r["kind"] == "input"]
    fed = sum(len(r["detail"].get("events", ())) for r in inputs)
    assert n_events == fed > 20
    assert n_actions == sum(len(s) for r in inputs for s in r["detail"].get("actions", {}).values()) > 20
    exported = [orjson.loads(line) for line in export.read_text().splitlines()]
    assert exported == records

    # The export replays the same.
    res = yeto_replay("--tape", str(export))
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == last, res.stdout + res.stderr
    # ... and without torch: the round machine and the replay are pure Python (torch made unimportable)
    res = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; "
                          "from yeto.services.cli import main; sys.exit(main(sys.argv[1:]))", "replay", "--tape",
                          str(export)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == last, res.stdout + res.stderr

    # Hand-edit one event: the c_tokens of b's accepted push in round 1, attempt 2. Every earlier event
    # replays as recorded; the first difference is the Merge that weighs it.
    lines = export.read_text().splitlines()
    edited_at = None
    seen = 0
    for n, line in enumerate(lines):
        rec = orjson.loads(line)
        if rec["kind"] != "input" or "events" not in rec["detail"]:
            continue
        for i, ev in enumerate(rec["detail"]["events"]):
            if (isinstance(ev, dict) and ev["type"] == "PushComplete" and ev["island"] == "b" and ev["step"] == 1
                    and ev["attempt"] == 2 and edited_at is None):
                ev["c_tokens"] = 301
                edited_at = seen + i
                lines[n] = orjson.dumps(rec).decode()
        seen += len(rec["detail"]["events"])
    assert edited_at is not None
    bad = tmp_path / "edited.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    res = yeto_replay("--tape", str(bad))
    assert res.returncode == 1, res.stdout + res.stderr
    out = res.stdout.strip().splitlines()[-1]
    assert "first differing action" in out and "expected Merge:" in out and "got Merge:" in out, out
    # The same through the library: the difference is at the edited event or at the first Merge after it.
    diff = replay(segments([orjson.loads(x) for x in lines])[0]).difference
    assert diff is not None and diff.event_index >= edited_at
    assert diff.expected.startswith("Merge:") and diff.got_action["type"] == "Merge"
    assert [m["c_tokens"] for m in diff.got_action["members"]] == [100, 301]
    assert f"at event #{diff.event_index} " in out


# ---- the recorder and the replay on their own (no broker): a golden scenario's events, recorded ----------

def _recorded(driver_events, *, max_events=7, drop_batch=None):
    """Feed `driver_events` to a fresh machine through an InputRecorder (small batches); the tape records."""
    from yeto.services.syncer.recording import InputRecorder
    from yeto.services.syncer.rounds import RoundMachine
    from tests.test_golden_rounds import config

    cfg = config()
    m, rec = RoundMachine(cfg), InputRecorder("p1", max_events=max_events)
    records = [rec.start(cfg, None, 0.0)]
    for ev in driver_events:
        try:
            out, err = m.handle(ev), None
        except ValueError as exc:   # a shell contract violation: recorded as such
            out, err = None, exc
        r = rec.add(ev, out, 0.0, error=err)
        if r is not None:
            records.append(r)
    if (last := rec.take(0.0)) is not None:
        records.append(last)
    return [r for r in records if r["detail"]["batch"] != drop_batch]


def _events():
    from yeto.services.syncer.events import event_from_json
    from tests.test_golden_rounds import normal_run

    return [event_from_json(s["event"]) for s in normal_run().steps]


def test_recorded_events_replay_identical_across_batches_with_ticks_kept_small():
    events = _events()
    records = _recorded(events)
    assert len(records) == 1 + -(-len(events) // 7)       # the start record, then batches of 7
    ticks = [e for r in records[1:] for e in r["detail"]["events"] if not isinstance(e, dict)]
    assert ticks and all(isinstance(t, float) for t in ticks)   # a Tick is its bare time
    (seg,) = segments(records)
    res = replay(seg)
    assert (res.identical, res.gap, res.events) == (True, None, len(events))
    assert res.actions == sum(len(s) for r in records[1:] for s in r["detail"]["actions"].values())


def test_a_lost_batch_stops_the_replay_there_and_says_so():
    events = _events()
    res = replay(segments(_recorded(events, drop_batch=2))[0])
    assert res.identical and res.events == 7 and "batch 2" in res.gap


def test_an_exception_of_the_machine_is_recorded_and_replayed():
    from yeto.services.syncer.events import MergeDone

    events = _events()
    bogus = MergeDone(step=9, fragment=0, version=9, merge_to_broadcast_s=0.1, now=1.0)   # no such merge: raises
    records = _recorded(events[:6] + [bogus] + events[6:])
    assert any("raise:ValueError" in sigs for r in records[1:] for sigs in r["detail"]["actions"].values())
    assert replay(segments(records)[0]).identical


def test_event_json_keeps_non_finite_floats_and_refuses_unknown_types_and_fields():
    from yeto.services.syncer.events import PushComplete, event_from_json, event_to_json

    ev = PushComplete("a", "a1" * 8, 0, 1, 1, 0, 0, 5, 5, 100, True, None, 1.5, norm=float("inf"), non_finite=0)
    js = orjson.loads(orjson.dumps(event_to_json(ev)))
    assert js["norm"] == "inf" and event_from_json(js) == ev
    with pytest.raises(ValueError, match="event type 'Nope'"):
        event_from_json({"type": "Nope"})
    with pytest.raises(ValueError, match="unknown fields"):
        event_from_json({**js, "extra": 1})
    with pytest.raises(ValueError, match="lacks field 'now'"):
        event_from_json({k: v for k, v in js.items() if k != "now"})
