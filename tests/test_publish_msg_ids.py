"""docs/design.md §3.5, message-id squatting, at the publish layer, against a real nats-server: JetStream de-duplicates
by Nats-Msg-Id per stream whatever the subject, so another identity publishing on *its own* subject of a
shared stream (CTL, PUSH, INIT, STEPLOG) can take the ids our messages will use. A first publish answered
`duplicate` is re-sent under a fresh id and counted; our own re-sends still collapse; streams nobody else
writes to keep today's behaviour."""
from __future__ import annotations

from collections import Counter

import pytest

from yeto.schemas import subjects as S
from yeto.schemas.provision import RunLimits, provision_run, remove_run
from yeto.schemas.publish import Pipeline, fresh_msg_id, publish_retry


@pytest.fixture
async def js(nc, run_id):
    js = nc.jetstream(timeout=10)
    await provision_run(js, run_id, RunLimits.small(), log=lambda _: None)
    try:
        yield js
    finally:
        await remove_run(js, run_id)


async def _msgs(js, run, subject):
    info = await js.stream_info(S.stream(run, "CTL" if ".ctl." in subject else "PUSH"), subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def test_an_id_taken_on_another_subject_of_the_stream_is_re_sent_under_a_fresh_id(js, run_id):
    pull_id = S.pull_msg_id(0, 7, 1, 0)
    squat = await js.publish(S.hello(run_id, "b"), b"{}", headers={S.MSG_ID: pull_id})   # b's own subject
    assert not squat.duplicate
    plain = await js.publish(S.pull(run_id), b"pull", headers={S.MSG_ID: pull_id})
    assert plain.duplicate, "JetStream drops it: the hole this guards"
    counters: Counter = Counter()
    ack = await publish_retry(js, S.pull(run_id), b"pull", pull_id, counters=counters)
    assert not ack.duplicate and ack.seq > squat.seq
    assert counters["publish.msg_id_taken"] == 1
    assert await _msgs(js, run_id, S.pull(run_id)) == 1
    got = await js.get_msg(S.stream(run_id, "CTL"), ack.seq)
    assert got.data == b"pull" and got.headers[S.MSG_ID].startswith(pull_id + ".x")
    # our own re-send of the same message still collapses (same id: this process sent it already)
    again = await publish_retry(js, S.pull(run_id), b"pull", pull_id, counters=counters)
    assert again.duplicate and counters["publish.msg_id_taken"] == 1
    assert await _msgs(js, run_id, S.pull(run_id)) == 1


async def test_pipelined_pushes_with_taken_ids_all_land(js, run_id):
    ids = [S.push_msg_id("a", "a1" * 8, 0, 3, 1, 0, k) for k in range(6)]
    for mid in ids[::2]:                                   # b takes every other chunk id of a's next push
        await js.publish(S.push(run_id, "b", 0), b"x", headers={S.MSG_ID: mid})
    counters: Counter = Counter()
    pipe = Pipeline(js, counters=counters, timeout=5.0)
    for k, mid in enumerate(ids):
        await pipe.put(S.push(run_id, "a", 0), bytes([k]) * 8, mid)
    await pipe.flush()
    assert counters["publish.msg_id_taken"] == 3
    assert await _msgs(js, run_id, S.push(run_id, "a", 0)) == 6
    # re-sending the whole push (a try that timed out) stores nothing twice
    pipe = Pipeline(js, counters=counters, timeout=5.0)
    for k, mid in enumerate(ids):
        await pipe.put(S.push(run_id, "a", 0), bytes([k]) * 8, mid)
    await pipe.flush()
    assert counters["publish.msg_id_taken"] == 3
    assert await _msgs(js, run_id, S.push(run_id, "a", 0)) == 6


async def test_streams_only_the_syncer_writes_keep_plain_dedup(js, run_id):
    # BCAST takes only the syncer's writes in a secured run: a duplicate there is the syncer's own re-send
    # (e.g. a resumed syncer re-broadcasting the same version), never re-sent under another id.
    mid = S.bcast_msg_id(0, 1, 0)
    await js.publish(S.bcast(run_id, 0, 0), b"v1", headers={S.MSG_ID: mid})
    counters: Counter = Counter()
    ack = await publish_retry(js, S.bcast(run_id, 0, 0), b"v1", mid, counters=counters)
    assert ack.duplicate and counters["publish.msg_id_taken"] == 0


def test_shared_streams_are_the_ones_islands_write_to():
    run = "r"
    assert all(S.in_shared_stream(s) for s in (S.pull(run), S.hello(run, "a"), S.heartbeat(run, "a"), S.ack(run, "a"),
                                               S.to_island(run, "a"), S.push(run, "a", 0), S.init(run, 0),
                                               S.steplog(run, "a")))
    assert not any(S.in_shared_stream(s) for s in (S.bcast(run, 0, 0), S.final(run, 0, 0), S.events(run, "merge"),
                                                   S.kv_key(run, "state", "commit")))
    a, b = fresh_msg_id("x"), fresh_msg_id("x")
    assert a != b and a.startswith("x.x") and len(a) == len("x.x") + 16
