"""Provisioning of a run's streams, buckets and consumers, against a real nats-server."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.js import api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError

from yeto.schemas import subjects as S
from yeto.schemas.errors import ConfigError, WireError
from yeto.schemas.ids import new_generation
from yeto.schemas.provision import (
    ProvisionConflict,
    RunLimits,
    RunNotProvisioned,
    bcast_consumer_config,
    check_run,
    ConsumerTaken,
    config_conflicts,
    ensure_island_consumer,
    ensure_island_consumers,
    final_consumer_config,
    island_consumer_config,
    kv,
    kv_configs,
    provision_run,
    push_max_bytes_for,
    remove_island_consumers,
    remove_run,
    stream_configs,
    syncer_consumer_configs,
)

ROOT = Path(__file__).resolve().parents[1]
LIMITS = RunLimits.small()
ALL_STREAMS = [S.stream("X", k) for k in S.STREAM_KINDS]


@pytest.fixture
async def js(nc, run_id):
    """A JetStream context; the test's run is removed afterwards so reservations don't pile up."""
    ctx = nc.jetstream()
    yield ctx
    await remove_run(ctx, run_id)


def _expected_labels(run: str) -> set[str]:
    labels = {f"stream {S.stream(run, k)}" for k in S.STREAM_KINDS}
    labels |= {f"kv {S.kv_bucket(run, k)}" for k in S.KV_KINDS}
    labels |= {
        f"consumer {S.stream(run, kind)}/{name}" for name, (kind, _) in syncer_consumer_configs(run).items()
    }
    return labels


# ---- pure ------------------------------------------------------------------------------------------

def test_run_limits_validate_and_push_sizing():
    assert RunLimits().push_max_bytes == 8 * 1024**3
    assert push_max_bytes_for(2, 4, 1000) == 12000  # pipeline × members × bytes × 1.5
    assert push_max_bytes_for(1, 1, 3, slack=1.0) == 3
    with pytest.raises(ConfigError) as e:
        push_max_bytes_for(0, 4, 1000)
    assert e.value.field == "pipeline"
    # The server refuses a duplicate window longer than max age: caught before it gets there.
    with pytest.raises(ConfigError) as e:
        RunLimits(duplicate_window_s=120, steplog_max_age_s=60)
    assert e.value.field == "steplog_max_age_s" and e.value.value == 60
    with pytest.raises(ConfigError) as e:
        RunLimits(push_max_bytes=-1)
    assert e.value.field == "push_max_bytes"
    with pytest.raises(ConfigError) as e:
        RunLimits(storage="disk")
    assert e.value.field == "storage"


def test_config_conflicts_ignore_server_normalization_but_catch_real_differences():
    cfgs = stream_configs("R", LIMITS)
    push = cfgs["PUSH"]
    assert config_conflicts(push, push) == []
    # What the server sends back for "unset": None / -1 / 0 must read as the same thing.
    assert config_conflicts(cfgs["BCAST"].evolve(max_bytes=None, max_age=None, allow_direct=True), cfgs["BCAST"]) == []
    assert config_conflicts(push.evolve(discard="old", max_bytes=1), push) == [
        ("discard", "old", "new"), ("max_bytes", 1, LIMITS.push_max_bytes)]
    c = syncer_consumer_configs("R")[S.SYNCER_CTL_CONSUMER][1]
    # One filter sent as filter_subjects may come back as filter_subject: same filter.
    one = c.evolve(filter_subjects=[S.pull("R")])
    assert config_conflicts(c.evolve(filter_subjects=None, filter_subject=S.pull("R")), one, "consumer") == []
    assert [f for f, *_ in config_conflicts(one, c, "consumer")] == ["filter"]


def test_island_consumer_configs_are_per_island_with_one_filter_and_start_at_the_hello():
    gen = new_generation()
    pull = island_consumer_config("R", "a", gen, "pull", start_seq=17)
    to = island_consumer_config("R", "a", gen, "to", start_seq=17)
    # fixed names, one filter subject each (so both travel in the create subject the rules name)
    assert (pull.name, pull.durable_name, pull.filter_subject, pull.filter_subjects) == ("pull-a", "pull-a", S.pull("R"), None)
    assert (to.name, to.durable_name, to.filter_subject, to.filter_subjects) == ("isl-a", "isl-a", S.to_island("R", "a"), None)
    assert pull.metadata == to.metadata == {S.ISLAND_GEN_KEY: gen}
    assert to.deliver_policy == api.DeliverPolicy.BY_START_SEQUENCE and to.opt_start_seq == 17
    assert island_consumer_config("R", "a", gen, "to").deliver_policy == api.DeliverPolicy.ALL
    with pytest.raises(WireError):
        island_consumer_config("R", "a", "not-a-gen", "to")
    with pytest.raises(WireError):
        island_consumer_config("R", "a.b", gen, "to")
    with pytest.raises(WireError):
        island_consumer_config("R", "a", gen, "to", start_seq=0)
    with pytest.raises(ValueError):
        island_consumer_config("R", "a", gen, "all")
    assert final_consumer_config("R", 3).filter_subject == "yeto.R.final.3.*"
    assert bcast_consumer_config("R").filter_subject == S.bcast_all("R")


# ---- against the server ----------------------------------------------------------------------------

async def test_provisioning_twice_changes_nothing(js, run_id):
    first = await provision_run(js, run_id, LIMITS, log=lambda _: None)
    assert set(first.created) == _expected_labels(run_id) and first.existing == []
    names = [S.stream(run_id, k) for k in S.STREAM_KINDS] + [f"KV_{S.kv_bucket(run_id, k)}" for k in S.KV_KINDS]
    before = {n: await js.stream_info(n) for n in names}
    cons = [(S.stream(run_id, kind), name) for name, (kind, _) in syncer_consumer_configs(run_id).items()]
    cons_before = {c: await js.consumer_info(*c) for c in cons}

    second = await provision_run(js, run_id, LIMITS, log=lambda _: None)
    assert second.created == [] and not second.changed
    assert set(second.existing) == _expected_labels(run_id)
    for n in names:
        after = await js.stream_info(n)
        assert after.created == before[n].created, n
        assert after.config == before[n].config, n
    for c in cons:
        after = await js.consumer_info(*c)
        assert after.created == cons_before[c].created and after.config == cons_before[c].config, c


async def test_streams_read_back_with_their_retention_and_limits(js, run_id):
    limits = RunLimits.small(push_max_bytes=3 * 1024 * 1024, steplog_max_age_s=3600, duplicate_window_s=90)
    await provision_run(js, run_id, limits, log=lambda _: None)

    async def cfg(kind):
        return (await js.stream_info(S.stream(run_id, kind))).config

    for kind in S.STREAM_KINDS:
        c = await cfg(kind)
        assert c.duplicate_window == 90.0, kind
        assert c.storage == "file" and c.subjects == S.stream_subjects(run_id, kind), kind
    push = await cfg("PUSH")
    assert (push.retention, push.discard, push.max_bytes, push.allow_direct) == ("limits", "new", 3 * 1024 * 1024, True)
    assert push.max_age == limits.push_max_age_s > 0
    bcast, final = await cfg("BCAST"), await cfg("FINAL")
    for c in (bcast, final):
        assert (c.retention, c.max_msgs_per_subject, c.allow_direct, c.discard) == ("limits", 1, True, "old")
    assert (await cfg("INIT")).retention == "workqueue"
    steplog = await cfg("STEPLOG")
    assert (steplog.retention, steplog.max_age, steplog.max_bytes) == ("limits", 3600.0, limits.steplog_max_bytes)
    ctl = await cfg("CTL")
    assert (ctl.retention, ctl.max_age) == ("limits", limits.ctl_max_age_s)
    events = await cfg("EVENTS")
    assert (events.retention, events.max_age) == ("limits", limits.events_max_age_s)

    members = (await js.stream_info(f"KV_{S.kv_bucket(run_id, 'members')}")).config
    state = (await js.stream_info(f"KV_{S.kv_bucket(run_id, 'state')}")).config
    assert (members.max_msgs_per_subject, state.max_msgs_per_subject) == (1, 5)
    assert members.max_age == 0 and state.max_age == 0  # no TTL: docs/design.md §15.6

    ctl_c = (await js.consumer_info(S.stream(run_id, "CTL"), S.SYNCER_CTL_CONSUMER)).config
    assert sorted(ctl_c.filter_subjects) == sorted(S.syncer_ctl_filters(run_id)) and ctl_c.ack_policy == "explicit"
    push_c = (await js.consumer_info(S.stream(run_id, "PUSH"), S.SYNCER_PUSH_CONSUMER)).config
    assert push_c.headers_only is True and push_c.ack_policy == "explicit" and push_c.deliver_subject is None
    init_c = (await js.consumer_info(S.stream(run_id, "INIT"), S.SYNCER_INIT_CONSUMER)).config
    assert init_c.ack_policy == "explicit" and init_c.deliver_subject is None  # pull


@pytest.mark.parametrize("field,hand_made", [
    ("max_age", dict(max_age=3600.0)),
    ("retention", dict(retention=api.RetentionPolicy.INTEREST)),
])
async def test_conflicting_stream_is_refused_and_left_unchanged(js, run_id, field, hand_made):
    wanted = stream_configs(run_id, LIMITS)["CTL"]
    await js.add_stream(wanted.evolve(metadata=None, description=None, **hand_made))
    before = await js.stream_info(wanted.name)

    with pytest.raises(ProvisionConflict) as e:
        await provision_run(js, run_id, LIMITS, log=lambda _: None)
    assert (e.value.stream, e.value.field) == (wanted.name, field)
    assert wanted.name in str(e.value) and field in str(e.value)
    assert e.value.wanted == (LIMITS.ctl_max_age_s if field == "max_age" else "limits")

    after = await js.stream_info(wanted.name)
    assert after.created == before.created and after.config == before.config
    with pytest.raises(NotFoundError):  # nothing else was created either
        await js.stream_info(S.stream(run_id, "PUSH"))


async def test_conflicting_bucket_and_consumer_are_refused(js, run_id):
    await provision_run(js, run_id, LIMITS, push_headers_only=False, log=lambda _: None)
    with pytest.raises(ProvisionConflict) as e:
        await provision_run(js, run_id, LIMITS, log=lambda _: None)
    assert e.value.field == "headers_only" and S.SYNCER_PUSH_CONSUMER in e.value.what
    info = await js.consumer_info(S.stream(run_id, "PUSH"), S.SYNCER_PUSH_CONSUMER)
    assert not info.config.headers_only  # unchanged

    with pytest.raises(ProvisionConflict) as e:
        await provision_run(js, run_id, RunLimits.small(state_history=7), push_headers_only=False, log=lambda _: None)
    assert (e.value.field, e.value.existing, e.value.wanted) == ("history", 5, 7)
    assert S.kv_bucket(run_id, "state") in str(e.value)


async def test_same_msg_id_is_stored_once(js, run_id):
    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    subj = S.hello(run_id, "a")
    hdr = {S.MSG_ID: S.hello_msg_id("a", new_generation())}
    a1 = await js.publish(subj, b"{}", headers=dict(hdr))
    a2 = await js.publish(subj, b"{}", headers=dict(hdr))
    assert not a1.duplicate and a2.duplicate and a2.seq == a1.seq
    assert (await js.stream_info(S.stream(run_id, "CTL"))).state.messages == 1


async def test_full_push_stream_refuses_with_10077(js, run_id):
    await provision_run(js, run_id, RunLimits.small(push_max_bytes=4096), log=lambda _: None)
    subj = S.push(run_id, "a", 0)
    gen = new_generation()
    ack = await js.publish(subj, b"x" * 3000, headers={S.MSG_ID: S.push_msg_id("a", gen, 0, 1, 0, 0, 0)})
    with pytest.raises(APIError) as e:
        await js.publish(subj, b"y" * 3000, headers={S.MSG_ID: S.push_msg_id("a", gen, 0, 1, 0, 0, 1)})
    assert e.value.err_code == 10077
    # discard new: the stored push is intact and readable by sequence (direct get, as the merge does)
    msg = await js.get_msg(S.stream(run_id, "PUSH"), seq=ack.seq, direct=True)
    assert msg.data == b"x" * 3000
    assert (await js.stream_info(S.stream(run_id, "PUSH"))).state.messages == 1


async def test_pipeline_stores_raw_bytes_of_tensors_arrays_and_views(js, run_id):
    """Pipeline.put takes any buffer: a bf16 / f32 CPU tensor, a NumPy array or a memoryview lands as
    its raw little-endian bytes (not element by element), in publish order, each under its msg id."""
    import numpy as np
    import torch

    from yeto.schemas.publish import Pipeline

    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    gen = new_generation()
    t32 = torch.linspace(-3, 3, 1000, dtype=torch.float32)
    payloads = [t32, t32.to(torch.bfloat16), np.arange(300, dtype=np.int16), memoryview(b"abc" * 100)]
    expected = [t32.numpy().tobytes(), t32.to(torch.bfloat16).view(torch.int16).numpy().tobytes(),
                np.arange(300, dtype=np.int16).tobytes(), b"abc" * 100]
    pipe = Pipeline(js, max_bytes=3000, max_msgs=2, timeout=5.0)
    subj = S.push(run_id, "a", 0)
    for i, p in enumerate(payloads):
        await pipe.put(subj, p, S.push_msg_id("a", gen, 0, 1, 0, 0, i))
    await pipe.flush()
    got = []
    for seq in range(1, len(payloads) + 1):
        got.append((await js.get_msg(S.stream(run_id, "PUSH"), seq=seq, direct=True)).data)
    assert got == expected
    with pytest.raises(WireError, match="contiguous"):
        await pipe.put(subj, t32.view(10, 100).t(), S.push_msg_id("a", gen, 0, 1, 0, 0, 9))


async def test_bcast_keeps_newest_per_chunk_and_cut_reader_sees_it(js, run_id, nc):
    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    name = S.stream(run_id, "BCAST")
    for version, data in ((1, b"v1"), (2, b"v2")):
        await js.publish(S.bcast(run_id, 0, 0), data, headers={S.MSG_ID: S.bcast_msg_id(0, version, 0)})
    await js.publish(S.bcast(run_id, 0, 1), b"c1", headers={S.MSG_ID: S.bcast_msg_id(0, 2, 1)})
    assert (await js.stream_info(name)).state.messages == 2
    assert (await js.get_last_msg(name, S.bcast(run_id, 0, 0))).data == b"v2"

    # The island cut reader: ordered consumer, last per subject, then new; headers only (notices).
    cfg = bcast_consumer_config(run_id, 0)
    sub = await js.subscribe(cfg.filter_subject, stream=name, ordered_consumer=True, config=cfg)
    got = [await sub.next_msg(timeout=5) for _ in range(2)]
    assert sorted(m.subject for m in got) == [S.bcast(run_id, 0, 0), S.bcast(run_id, 0, 1)]
    assert all(m.data == b"" for m in got)
    sizes = {m.subject: m.headers.get("Nats-Msg-Size") for m in got}
    assert sizes[S.bcast(run_id, 0, 0)] == "2"
    await js.publish(S.bcast(run_id, 0, 0), b"v3!", headers={S.MSG_ID: S.bcast_msg_id(0, 3, 0)})
    new = await sub.next_msg(timeout=5)
    assert new.subject == S.bcast(run_id, 0, 0) and new.headers.get("Nats-Msg-Size") == "3"
    await sub.unsubscribe()


async def test_check_run_waits_until_provisioned(js, run_id):
    lines: list[str] = []
    waiter = asyncio.create_task(check_run(js, run_id, timeout_s=20, log=lines.append, poll_s=0.05))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    assert lines and "waiting" in lines[0] and S.stream(run_id, "PUSH") in lines[0]
    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    await asyncio.wait_for(waiter, 10)
    assert "provisioned" in lines[-1]


async def test_check_run_times_out_naming_what_is_missing_and_creates_nothing(js, run_id):
    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    await js.delete_stream(S.stream(run_id, "STEPLOG"))
    await js.delete_key_value(S.kv_bucket(run_id, "state"))
    t0 = time.monotonic()
    with pytest.raises(RunNotProvisioned) as e:
        await check_run(js, run_id, timeout_s=0.3, log=lambda _: None, poll_s=0.05)
    assert time.monotonic() - t0 < 3
    assert e.value.missing == [f"stream {S.stream(run_id, 'STEPLOG')}", f"kv {S.kv_bucket(run_id, 'state')}"]
    assert S.stream(run_id, "STEPLOG") in str(e.value) and S.kv_bucket(run_id, "state") in str(e.value)
    with pytest.raises(NotFoundError):
        await js.stream_info(S.stream(run_id, "STEPLOG"))


async def test_island_consumers_see_pulls_and_their_own_messages_only(js, run_id):
    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    ga, gb = new_generation(), new_generation()
    ctl = S.stream(run_id, "CTL")
    rep = await ensure_island_consumers(js, run_id, "a", ga)
    assert rep.created == [f"consumer {ctl}/pull-a", f"consumer {ctl}/isl-a"]
    await ensure_island_consumers(js, run_id, "b", gb)
    again = await ensure_island_consumers(js, run_id, "a", ga)
    assert again.created == [] and len(again.existing) == 2

    info = await js.consumer_info(ctl, S.island_to_consumer("a"))
    assert info.config.filter_subject == S.to_island(run_id, "a") and not info.config.filter_subjects
    assert info.config.ack_policy == "explicit" and info.config.metadata[S.ISLAND_GEN_KEY] == ga

    for subj in (S.heartbeat(run_id, "a"), S.pull(run_id), S.to_island(run_id, "a"), S.to_island(run_id, "b")):
        await js.publish(subj, b"{}")
    for island in ("a", "b"):
        got = []
        for kind in S.ISLAND_CONSUMER_KINDS:
            sub = await js.pull_subscribe_bind(S.island_consumer(island, kind), stream=ctl)
            msgs = await sub.fetch(10, timeout=1)
            for m in msgs:
                await m.ack()
            got += [(kind, m.subject) for m in msgs]
            await sub.unsubscribe()
        assert sorted(got) == sorted([("pull", S.pull(run_id)), ("to", S.to_island(run_id, island))])


async def test_island_consumers_start_at_the_hellos_sequence(js, run_id):
    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    await js.publish(S.pull(run_id), b"before")
    hello = await js.publish(S.hello(run_id, "a"), b"{}")
    await js.publish(S.pull(run_id), b"after")
    gen = new_generation()
    await ensure_island_consumers(js, run_id, "a", gen, start_seq=hello.seq)
    sub = await js.pull_subscribe_bind(S.island_pull_consumer("a"), stream=S.stream(run_id, "CTL"))
    msgs = await sub.fetch(10, timeout=1)
    assert [m.data for m in msgs] == [b"after"]
    await sub.unsubscribe()


async def test_a_new_generation_takes_the_consumers_over_and_an_old_one_cannot_take_them_back(js, run_id):
    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    ctl = S.stream(run_id, "CTL")
    g1, g2 = new_generation(), new_generation()
    await ensure_island_consumers(js, run_id, "a", g1)
    await ensure_island_consumers(js, run_id, "a-b", g1)  # another island whose name starts alike
    hello = await js.publish(S.hello(run_id, "a"), b"{}")
    rep = await ensure_island_consumers(js, run_id, "a", g2, start_seq=hello.seq)
    assert rep.created == [f"consumer {ctl}/pull-a", f"consumer {ctl}/isl-a"]
    for name in ("pull-a", "isl-a"):
        info = await js.consumer_info(ctl, name)
        assert info.config.metadata[S.ISLAND_GEN_KEY] == g2 and info.config.opt_start_seq == hello.seq
    with pytest.raises(ConsumerTaken) as taken:
        await ensure_island_consumer(js, run_id, "a", g1, "to", replace=False)
    assert taken.value.owner == g2
    # closing the old process removes nothing of the new one; the new one's close removes its own
    assert await remove_island_consumers(js, run_id, "a", g1) == []
    assert await remove_island_consumers(js, run_id, "a", g2) == ["pull-a", "isl-a"]
    left = {c.name for c in await js.consumers_info(ctl)}
    assert left == {S.SYNCER_CTL_CONSUMER, "pull-a-b", "isl-a-b"}


async def test_kv_helper_returns_the_runs_bucket(js, run_id):
    with pytest.raises(BucketNotFoundError):
        await kv(js, run_id, "state")
    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    state = await kv(js, run_id, "state")
    await state.put("session", b"{}")
    assert (await state.get("session")).value == b"{}"
    assert state._stream == f"KV_{S.kv_bucket(run_id, 'state')}"


async def test_remove_run_and_cli_run_rm(js, run_id, nats_url):
    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    env = dict(os.environ)
    cmd = [sys.executable, "-P", "-m", "yeto.services.cli", "run", "rm", run_id, "--nats", nats_url]
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    for name in [S.stream(run_id, k) for k in S.STREAM_KINDS] + [S.kv_bucket(run_id, k) for k in S.KV_KINDS]:
        assert name in text
    for kind in S.STREAM_KINDS:
        with pytest.raises(NotFoundError):
            await js.stream_info(S.stream(run_id, kind))
    assert await remove_run(js, run_id) == []


async def test_concurrent_provisioning_agrees_or_conflicts(js, run_id):
    quiet = dict(log=lambda _: None)
    same = await asyncio.gather(provision_run(js, run_id, LIMITS, **quiet), provision_run(js, run_id, LIMITS, **quiet))
    assert all(set(r.created + r.existing) == _expected_labels(run_id) for r in same)
    await remove_run(js, run_id)
    # Two syncers started with different limits at the same moment: exactly one wins, the other is
    # told why, and the winner's stream is the one on the server.
    results = await asyncio.gather(
        provision_run(js, run_id, LIMITS, **quiet),
        provision_run(js, run_id, RunLimits.small(ctl_max_age_s=3600), **quiet),
        return_exceptions=True,
    )
    errors = [r for r in results if isinstance(r, Exception)]
    assert len(errors) == 1 and isinstance(errors[0], ProvisionConflict), results
    assert errors[0].field == "max_age"
    winner_age = LIMITS.ctl_max_age_s if errors[0] is results[1] else 3600
    assert (await js.stream_info(S.stream(run_id, "CTL"))).config.max_age == winner_age


# ---- replicas (docs/design.md §7) ------------------------------------------------------------------

def test_replicas_reach_every_stream_and_bucket_config():
    lim = RunLimits.small(replicas=3)
    assert {k: c.num_replicas for k, c in stream_configs("R", lim).items()} == {k: 3 for k in S.STREAM_KINDS}
    assert {k: c.replicas for k, c in kv_configs("R", lim).items()} == {k: 3 for k in S.KV_KINDS}
    assert config_conflicts(stream_configs("R", LIMITS)["PUSH"], stream_configs("R", lim)["PUSH"]) == [
        ("num_replicas", 1, 3)]
    for bad in (0, 6, "3", True):
        with pytest.raises(ConfigError) as e:
            RunLimits(replicas=bad)
        assert e.value.field == "replicas"


async def test_syncer_replicas_flag_reports_a_run_provisioned_with_other_replicas(js, run_id, tmp_path, nats_url):
    """`yeto syncer --replicas 3` against a run provisioned with 1 replica (here: a single server)
    exits 2 naming each stream and bucket with both values, and changes nothing."""
    await provision_run(js, run_id, LIMITS, push_headers_only=False, log=lambda _: None)  # as the syncer does
    names = [S.stream(run_id, k) for k in S.STREAM_KINDS] + [f"KV_{S.kv_bucket(run_id, k)}" for k in S.KV_KINDS]
    before = {n: await js.stream_info(n) for n in names}
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env["YETO_REPLICAS"] = "3"  # the variable, as docker-compose passes it
    cmd = [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", nats_url, "--run", run_id, "--small-limits",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    text = out.decode()
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text and "headers_only" not in text, text[-3000:]  # replicas are the only difference
    for kind in S.STREAM_KINDS:
        assert f"stream {S.stream(run_id, kind)}: num_replicas is 1 on the server, this run wants 3" in text, text[-3000:]
    for kind in S.KV_KINDS:
        assert f"kv {S.kv_bucket(run_id, kind)}: replicas is 1 on the server, this run wants 3" in text, text[-3000:]
    for n in names:
        after = await js.stream_info(n)
        assert after.created == before[n].created and after.config == before[n].config, n

    # A value out of range is refused before anything is asked of the server, naming flag and value.
    cmd[-2:] = ["--replicas", "7", "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 2 and "replicas" in out.decode() and "7" in out.decode(), out.decode()[-2000:]


async def test_kv_put_writes_the_runs_bucket_once_per_call(js, run_id):
    from yeto.schemas.provision import kv_put

    await provision_run(js, run_id, LIMITS, log=lambda _: None)
    ack = await kv_put(js, run_id, "state", "probe", b'{"x": 1}')
    entry = await (await kv(js, run_id, "state")).get("probe")
    assert entry.value == b'{"x": 1}' and entry.revision == ack.seq
    with pytest.raises(WireError) as e:
        await kv_put(js, run_id, "nope", "probe", b"")
    assert (e.value.field, e.value.value) == ("kind", "nope")


@pytest.mark.e2e
@pytest.mark.timeout(60)
async def test_provisioning_asks_again_when_the_jetstream_api_did_not_answer(tmp_path, run_id, caplog):
    # a standby's provisioning request lost with a killed node waited out its timeout and the syncer exited 1
    # (soak/chaos.py --cluster 3 --standby); here the server is stopped (SIGSTOP) past the first try's timeout
    import signal

    from yeto.schemas.conn import ConnectOptions, connect
    from yeto.services.broker import Broker

    with Broker(store_dir=tmp_path / "b") as b:
        nc = await connect(ConnectOptions(url=b.url))
        js = nc.jetstream(timeout=0.5)
        b.proc.send_signal(signal.SIGSTOP)
        try:
            task = asyncio.ensure_future(provision_run(js, run_id))
            await asyncio.sleep(0.8)                 # the first try times out meanwhile
        finally:
            b.proc.send_signal(signal.SIGCONT)
        report = await asyncio.wait_for(task, 20)
        assert "asking again (2 of 3)" in caplog.text and report.created, (caplog.text, report)
        await check_run(js, run_id)
        await remove_run(js, run_id)
        await nc.close()
