"""The island's NATS client and its configuration, against a real nats-server."""
from __future__ import annotations

import asyncio
import math
import time

import pytest
from nats.js import api
from nats.js.errors import NotFoundError

from yeto.learner.client import IslandClient
from yeto.learner.errors import IslandUnhealthy, SyncerRefused
from yeto.learner.config import ENV, IslandConfig
from yeto.learner.steplog import StepLog
from yeto.schemas import codec
from yeto.schemas import subjects as S
from yeto.schemas.conn import ConnectOptions
from yeto.schemas.errors import ConfigError, IdError, WireError
from yeto.schemas.layout import layout_fingerprint
from yeto.schemas.provision import RunLimits, provision_run, remove_run

from tests.island_support import until

ISLAND = "a"
LAYOUT = [{"name": "embed.weight", "shape": [4, 2], "dtype": "float32"},
          {"name": "layers.0.weight", "shape": [2, 2], "dtype": "float32"}]
HELLO = {"layout": LAYOUT, "layout_fingerprint": layout_fingerprint(LAYOUT), "push_dtype": "auto", "bulk_dtype": "bf16",
         "world": {"ranks": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1, "nodes": 1}, "host": "test-host"}


@pytest.fixture
async def js(nc, run_id):
    ctx = nc.jetstream()
    await provision_run(ctx, run_id, RunLimits.small(storage="memory"), log=lambda _: None)
    yield ctx
    await remove_run(ctx, run_id)


@pytest.fixture
def clients():
    made: list[IslandClient] = []
    yield made
    for c in made:
        c.close()


def config(run_id: str, url: str, **kw) -> IslandConfig:
    base = dict(progress=False, heartbeat_s=0.2, session_timeout_s=10, connect_timeout_s=10)
    base.update(kw)
    return IslandConfig(run=run_id, island=ISLAND, nats=ConnectOptions(url=url), **base)


async def provisioned(clients, run_id, nats_url, **kw) -> IslandClient:
    c = IslandClient(config(run_id, nats_url, **kw))
    clients.append(c)
    await asyncio.to_thread(c.start)
    await asyncio.to_thread(c.provision, dict(HELLO))
    return c


async def test_hello_and_heartbeats_arrive_valid_with_one_generation(js, run_id, nats_url, clients):
    c = await provisioned(clients, run_id, nats_url)
    c.local_step, c.step_time_s = 5, 0.125
    ctl = await js.pull_subscribe_bind(durable=S.SYNCER_CTL_CONSUMER, stream=S.stream(run_id, "CTL"))
    hb = await js.pull_subscribe_bind(durable=S.SYNCER_HB_CONSUMER, stream=S.stream(run_id, "HB"))
    got: list[tuple[str, dict, str]] = []
    deadline = time.monotonic() + 10
    for m in await ctl.fetch(1, timeout=5):
        await m.ack()
        got.append((*codec.decode_typed(m.data, ("hello",)), m.headers[S.MSG_ID]))
        assert m.subject == S.hello(run_id, ISLAND)
    while sum(k == "heartbeat" and m["local_step"] == 5 for k, m, _ in got) < 2 and time.monotonic() < deadline:
        for m in await hb.fetch(20, timeout=5):   # heartbeats have their own stream (HB)
            await m.ack()
            kind, msg = codec.decode_typed(m.data, ("heartbeat",))  # validates
            got.append((kind, msg, m.headers[S.MSG_ID]))
            assert m.subject == S.heartbeat(run_id, ISLAND)
    kinds = [k for k, _, _ in got]
    assert kinds[0] == "hello" and kinds.count("hello") == 1 and kinds.count("heartbeat") >= 2
    assert {m["gen"] for _, m, _ in got} == {c.gen}  # one generation, on every message
    hello = got[0][1]
    assert hello["layout"] == LAYOUT and hello["bulk_dtype"] == "bf16" and hello["push_dtype"] == "auto"
    assert got[0][2] == S.hello_msg_id(ISLAND, c.gen)
    beats = [(m, mid) for k, m, mid in got if k == "heartbeat"]
    assert beats[-1][0]["local_step"] == 5 and beats[-1][0]["step_time_s"] == 0.125
    assert len({mid for _, mid in beats}) == len(beats)  # one Nats-Msg-Id per heartbeat

    # The island's CTL consumers are this generation's, deliver from the hello on (its stream
    # sequence: the hello is the first message of CTL here), and go away with the client.
    for kind in S.ISLAND_CONSUMER_KINDS:
        info = await js.consumer_info(S.stream(run_id, "CTL"), S.island_consumer(ISLAND, kind))
        assert info.config.deliver_policy == api.DeliverPolicy.BY_START_SEQUENCE and info.config.opt_start_seq == 1
        assert info.config.metadata[S.ISLAND_GEN_KEY] == c.gen
    await asyncio.to_thread(c.close)
    assert c.counters["disconnects"] == 0  # its own close is not a lost connection
    for kind in S.ISLAND_CONSUMER_KINDS:
        with pytest.raises(NotFoundError):
            await js.consumer_info(S.stream(run_id, "CTL"), S.island_consumer(ISLAND, kind))


async def test_control_messages_are_routed_by_kind_subject_and_generation(js, run_id, nats_url, clients):
    async def send(subject: str, data: bytes, key: str):
        await js.publish(subject, data, headers={S.MSG_ID: key})

    def ctl(kind: str, **fields) -> bytes:
        return codec.encode(kind, codec.make(kind, run=run_id, **fields))

    pull = dict(fragment=0, step=1, attempt=1, seq=0, base_version=0, members=[{"island": ISLAND, "gen": "0" * 16}])
    await send(S.pull(run_id), ctl("pull", **pull), "early")  # before the hello: never meant for this process
    c = await provisioned(clients, run_id, nats_url)
    other = "f" * 16 if c.gen != "f" * 16 else "e" * 16
    to = S.to_island(run_id, ISLAND)
    await send(S.pull(run_id), ctl("pull", **dict(pull, step=3)), "p3")
    await send(to, ctl("shutdown", reason="for another generation", gen=other), "s-other")
    await send(to, ctl("shutdown", reason="without a generation"), "s-any")  # refused
    await send(to, ctl("shutdown", reason="for this island", gen=c.gen), "s-mine")
    await send(to, b"\xff not json", "junk")
    await send(to, ctl("pull", **dict(pull, step=5)), "pull-on-wrong-subject")
    await until(lambda: c.rejected_total() >= 3 and len(c.control) >= 1 and len(c.pulls) >= 1, what="routing")
    await asyncio.sleep(0.2)  # let anything that should not arrive have its chance
    assert [p["step"] for p in c.pulls.drain()] == [3]
    assert [(k, m["reason"]) for k, m in c.control.drain()] == [("shutdown", "for this island")]
    assert c.counters["ctl_other_gen"] == 1 and c.rejected_total() == 3 and c.counters["rejected.no_gen"] == 1
    assert any("pull message must arrive on" in r for r in c.rejections)
    c.check_health()  # all of that is survivable

    await send(to, ctl("error", code="layout_mismatch", message="not this model", fatal=True, field="layout"),
               "err-no-gen")  # refused: not acted on
    await send(to, ctl("error", code="layout_mismatch", message="not this model", fatal=True, field="layout",
                       gen=c.gen), "err")
    await until(lambda: len(c.control) >= 1, what="error")
    with pytest.raises(SyncerRefused, match="layout_mismatch"):
        c.check_health()
    assert c.counters["rejected.no_gen"] == 2


async def test_a_newer_generation_takes_the_consumers_and_the_older_process_stops_without_stealing(
        js, run_id, nats_url, clients):
    """The island's CTL consumers have fixed names (so the server's permissions can name them): a new
    process of the island replaces them. An older process still alive must neither read nor ack the
    new generation's messages: it hands back what it fetched and stops (Superseded), and its close
    leaves the new generation's consumers in place."""
    from yeto.learner.errors import Superseded

    old = await provisioned(clients, run_id, nats_url)
    new = await provisioned(clients, run_id, nats_url)
    assert old.gen != new.gen
    pull = dict(fragment=0, step=1, attempt=1, seq=0, base_version=0, members=[{"island": ISLAND, "gen": new.gen}])
    for step in (1, 2, 3):
        await js.publish(S.pull(run_id), codec.encode("pull", codec.make("pull", run=run_id, **dict(pull, step=step))),
                         headers={S.MSG_ID: f"p{step}"})
    shutdown = codec.make("shutdown", run=run_id, reason="the end", gen=new.gen)
    await js.publish(S.to_island(run_id, ISLAND), codec.encode("shutdown", shutdown), headers={S.MSG_ID: "s"})
    await until(lambda: len(new.pulls) >= 3 and len(new.control) >= 1, what="the new generation's messages")
    await asyncio.sleep(0.5)  # a copy that should not come has its chance
    # all of them, once (one the old process fetched and handed back comes after the others)
    assert sorted(p["step"] for p in new.pulls.drain()) == [1, 2, 3]
    assert [k for k, _ in new.control.drain()] == ["shutdown"]
    await until(lambda: old.ctl.fatal is not None, what="the old process noticing", timeout=20)
    with pytest.raises(Superseded, match=new.gen):
        old.check_health()
    assert len(old.pulls) == 0 and len(old.control) == 0 and old.counters["ctl_superseded"] >= 1
    await asyncio.to_thread(old.close)
    for kind in S.ISLAND_CONSUMER_KINDS:
        info = await js.consumer_info(S.stream(run_id, "CTL"), S.island_consumer(ISLAND, kind))
        assert info.config.metadata[S.ISLAND_GEN_KEY] == new.gen
    new.check_health()


async def test_a_consumer_removed_under_the_island_is_made_again_without_losing_or_repeating(
        js, run_id, nats_url, clients):
    c = await provisioned(clients, run_id, nats_url)
    pull = dict(fragment=0, step=1, attempt=1, seq=0, base_version=0, members=[{"island": ISLAND, "gen": c.gen}])

    async def send(step):
        await js.publish(S.pull(run_id), codec.encode("pull", codec.make("pull", run=run_id, **dict(pull, step=step))),
                         headers={S.MSG_ID: f"p{step}"})

    await send(1)
    await until(lambda: len(c.pulls) >= 1, what="pull 1")
    await js.delete_consumer(S.stream(run_id, "CTL"), S.island_pull_consumer(ISLAND))
    await send(2)
    await until(lambda: c.counters["ctl_consumer_recreated"] >= 1 and len(c.pulls) >= 2, what="pull 2", timeout=20)
    await asyncio.sleep(0.5)
    assert [p["step"] for p in c.pulls.drain()] == [1, 2]
    c.check_health()


async def test_the_runs_final_record_reaches_the_island_and_a_bad_one_is_counted_once(js, run_id, nats_url, clients):
    """The syncer leaves the final manifest in the state KV (`final`) as it exits a finished run; the
    client looks for it every few seconds and hands it over as a ("final", manifest) control message.
    A record that does not decode is refused, counted once however often it is read again."""
    from yeto.learner.client import FINAL_POLL_S

    c = await provisioned(clients, run_id, nats_url)
    assert await asyncio.to_thread(c.final_record) is None
    kv = await js.key_value(S.kv_bucket(run_id, "state"))
    await kv.put("final", b"{not a manifest")
    await until(lambda: c.rejected_total() == 1, what="the bad record refused", timeout=FINAL_POLL_S * 3)
    await asyncio.sleep(FINAL_POLL_S + 1)  # read again: not counted again
    assert c.rejected_total() == 1 and len(c.control) == 0
    with pytest.raises(WireError):
        await asyncio.to_thread(c.final_record)
    rec = codec.make("manifest", run=run_id, final_step=8, versions={"0": 4}, version_digests={"0": "ab" * 32})
    await kv.put("final", codec.encode("manifest", rec))
    await until(lambda: len(c.control) >= 1, what="the final record", timeout=FINAL_POLL_S * 3)
    kind, got = c.control.drain()[0]
    assert (kind, got) == ("final", rec)
    assert await asyncio.to_thread(c.final_record) == rec
    c.check_health()


async def test_unknown_member_error_makes_the_island_say_hello_again(js, run_id, nats_url, clients):
    """A syncer that resumed without its members answers heartbeats with a non-fatal `unknown_member`
    error: the island sends its hello again (same generation, a fresh Nats-Msg-Id so the duplicate
    window does not swallow it), and keeps running. Before, it only counted the error."""
    c = await provisioned(clients, run_id, nats_url)
    ctl = await js.pull_subscribe_bind(durable=S.SYNCER_CTL_CONSUMER, stream=S.stream(run_id, "CTL"))

    async def hellos(want: int, timeout: float = 10.0) -> list[tuple[dict, str]]:
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < want and time.monotonic() < deadline:
            try:
                msgs = await ctl.fetch(20, timeout=1)
            except Exception:
                continue
            for m in msgs:
                await m.ack()
                kind, msg = codec.decode_typed(m.data, ("hello", "heartbeat", "ack"))
                if kind == "hello":
                    got.append((msg, m.headers[S.MSG_ID]))
        return got

    assert len(await hellos(1)) == 1
    err = codec.make("error", run=run_id, code="unknown_member", message="no record of you", fatal=False,
                     field="gen", gen=c.gen)
    await js.publish(S.to_island(run_id, ISLAND), codec.encode("error", err), headers={S.MSG_ID: "unknown-1"})
    again = await hellos(1)
    assert len(again) == 1
    msg, msg_id = again[0]
    assert msg["gen"] == c.gen and msg["layout"] == LAYOUT and msg_id != S.hello_msg_id(ISLAND, c.gen)
    await until(lambda: c.counters["rehello"] == 1, what="the re-hello's ack")
    c.check_health()  # non-fatal: the island goes on
    # another error code (non-fatal) does not trigger a hello
    other = dict(err, code="schema")
    await js.publish(S.to_island(run_id, ISLAND), codec.encode("error", other), headers={S.MSG_ID: "schema-1"})
    assert await hellos(1, timeout=2) == [] and c.counters["rehello"] == 1
    # once refused for good (a fatal error), an unknown_member that follows says no hello again
    fatal = dict(err, code="bad_layout", fatal=True, message="layout does not match the session")
    await js.publish(S.to_island(run_id, ISLAND), codec.encode("error", fatal), headers={S.MSG_ID: "fatal-1"})
    await until(lambda: c.ctl.fatal is not None, what="the fatal error")
    await js.publish(S.to_island(run_id, ISLAND), codec.encode("error", err), headers={S.MSG_ID: "unknown-2"})
    assert await hellos(1, timeout=3) == [] and c.counters["rehello"] == 1


async def test_step_log_events_validate_file_gets_the_same_lines_and_the_queue_drops(js, run_id, nats_url, clients,
                                                                                    tmp_path):
    path = tmp_path / "logs" / "steps.jsonl"
    c = IslandClient(config(run_id, nats_url, steplog_queue=3, step_log=str(path)))
    clients.append(c)

    def emit(step: int, loss: float | None) -> dict:
        return c.steplog.emit(step=step, boundary_s=0.01, export_s=0.0, apply_s=0.005, pushes=0, applies=1,
                              bytes_out=0, bytes_in=128, versions={"0": step}, pending_pulls=1, rejected=0, loss=loss)

    # Not connected yet: events wait in the bounded queue, the oldest are dropped and counted.
    for step in range(1, 11):
        emit(step, 1.0 / step)
    assert c.steplog.dropped == 7 and len(c.steplog) == 3
    await asyncio.to_thread(c.start)
    await asyncio.to_thread(c.provision, dict(HELLO))
    await until(lambda: c.counters["steplog_sent"] == 3, what="queued events sent")
    emit(11, float("nan"))  # NaN has no JSON form: sent as null

    sub = await js.subscribe(S.steplog(run_id, ISLAND), stream=S.stream(run_id, "STEPLOG"), ordered_consumer=True)
    published = [await sub.next_msg(timeout=10) for _ in range(4)]
    await sub.unsubscribe()
    events = [codec.decode("steplog", m.data) for m in published]  # valid against the schema
    assert [e["step"] for e in events] == [8, 9, 10, 11]
    assert [e["dropped"] for e in events] == [4, 5, 6, 7]
    assert {e["gen"] for e in events} == {c.gen} and events[-1]["loss"] is None
    assert math.isclose(events[0]["loss"], 1 / 8)
    assert [m.headers[S.MSG_ID] for m in published] == [S.steplog_msg_id(ISLAND, c.gen, s) for s in (8, 9, 10, 11)]
    lines = path.read_bytes().splitlines()
    assert len(lines) == 11  # the file is the complete record, drops only concern the network
    assert lines[7:] == [m.data for m in published]  # the same bytes
    # the message can reach the reader before its PubAck reaches the client: wait for the count
    await until(lambda: c.counters["steplog_sent"] == 4, what="the fourth event's ack")


def test_step_log_queue_is_thread_safe_and_bounded():
    import threading

    log = StepLog("r", "i", "0" * 16, maxlen=50)
    threads = [threading.Thread(target=lambda: [log.put(s, b"x") for s in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(log) == 50 and log.dropped == 3950 and log.emitted == 4000
    assert len(log.pop_all()) == 50 and len(log) == 0


@pytest.mark.e2e
async def test_check_health_raises_only_after_the_configured_failed_reconnects(tmp_path):
    from yeto.services.broker import Broker

    broker = Broker(store_dir=tmp_path / "store").start()
    c = IslandClient(IslandConfig(run="r", island=ISLAND, nats=ConnectOptions(url=broker.url), max_reconnects=2,
                                  reconnect_wait_s=0.3, progress=False, connect_timeout_s=10))
    try:
        await asyncio.to_thread(c.start)
        gen = c.gen
        assert c.connected
        broker.stop()
        await until(lambda: not c.connected, what="disconnect")
        c.check_health()  # down but still reconnecting: healthy, training goes on
        await until(lambda: c._gave_up, timeout=15, what="giving up")
        with pytest.raises(IslandUnhealthy, match="gave up after 2 failed reconnects"):
            c.check_health()
        assert c.gen == gen
    finally:
        c.close()
        broker.stop()


def test_config_from_env_and_validation(monkeypatch):
    env = {"YETO_RUN": "r1", "YETO_ISLAND": "i-1", "NATS_URL": "nats://h:1", "YETO_PUSH_DTYPE": "q4",
           "YETO_BULK_DTYPE": "bf16", "YETO_DILOCO_ALPHA": "0.3", "YETO_LOCKSTEP": "1",
           "YETO_DILOCO_INITIAL_CUT_TIMEOUT": "12.5", "YETO_DILOCO_STEP_LOG": "/tmp/x.jsonl", "YETO_HEARTBEAT_S": "0.5",
           "YETO_MAX_RECONNECTS": "-1", "YETO_FETCH_BATCH_BYTES": str(8 << 20), "YETO_ANCHOR_DIR": "/scratch/yeto"}
    c = IslandConfig.from_env(env)
    assert c.anchor_dir == "/scratch/yeto"
    assert (c.run, c.island, c.nats.url, c.push_dtype, c.bulk_dtype) == ("r1", "i-1", "nats://h:1", "q4", "bf16")
    assert (c.alpha, c.lockstep, c.initial_cut_timeout, c.step_log) == (0.3, True, 12.5, "/tmp/x.jsonl")
    assert (c.heartbeat_s, c.max_reconnects, c.fetch_batch_bytes) == (0.5, -1, 8 << 20)
    assert IslandConfig.from_env(dict(env, YETO_NATS="nats://y:2")).nats.url == "nats://y:2"  # YETO_NATS first
    assert IslandConfig.from_env(env, alpha=0.9).alpha == 0.9  # keywords win
    d = IslandConfig.from_env({"YETO_RUN": "r", "YETO_ISLAND": "i"})
    assert (d.push_dtype, d.bulk_dtype, d.alpha, d.lockstep, d.initial_cut_timeout, d.heartbeat_s) == \
        ("auto", "auto", 0.5, False, 0.0, 2.0)
    assert d.step_log is None and d.max_reconnects == 60 and d.anchor_dir is None
    assert IslandConfig.from_env(dict(env, YETO_ANCHOR_DIR="")).anchor_dir is None  # empty: in memory
    monkeypatch.setenv("YETO_RUN", "from-os")
    monkeypatch.setenv("YETO_ISLAND", "isl")
    monkeypatch.setenv("YETO_NATS", "nats://os:3")
    o = IslandConfig.from_env()
    assert (o.run, o.island, o.nats.url) == ("from-os", "isl", "nats://os:3")

    for var, value, field in (("YETO_DILOCO_ALPHA", "1.5", "alpha"), ("YETO_PUSH_DTYPE", "fp8", "push_dtype"),
                              ("YETO_BULK_DTYPE", "q4", "bulk_dtype"), ("YETO_HEARTBEAT_S", "0", "heartbeat_s"),
                              ("YETO_HEARTBEAT_S", "abc", "heartbeat_s"), ("YETO_LOCKSTEP", "maybe", "lockstep"),
                              ("YETO_FETCH_BATCH_BYTES", str(64 << 20), "fetch_batch_bytes"),
                              ("YETO_MAX_RECONNECTS", "-5", "max_reconnects")):
        with pytest.raises(ConfigError) as err:
            IslandConfig.from_env(dict(env, **{var: value}))
        assert err.value.field == field and var in str(err.value)
    with pytest.raises(IdError):
        IslandConfig.from_env(dict(env, YETO_ISLAND="a.b"))
    with pytest.raises(ConfigError) as err:
        IslandConfig.from_env({"YETO_ISLAND": "i"})
    assert err.value.field == "run"
    assert set(ENV.values()) >= {"YETO_RUN", "YETO_ISLAND", "YETO_PUSH_DTYPE", "YETO_BULK_DTYPE", "YETO_DILOCO_ALPHA",
                                 "YETO_LOCKSTEP", "YETO_DILOCO_INITIAL_CUT_TIMEOUT", "YETO_DILOCO_STEP_LOG",
                                 "YETO_HEARTBEAT_S", "YETO_MAX_RECONNECTS"}


def test_cut_inbox_keeps_the_newest_notice_per_chunk_subject():
    from yeto.learner.inbox import ChunkNotice, CutInbox

    def notice(fid: int, chunk: int, version: int) -> ChunkNotice:
        return ChunkNotice("bcast_chunk", f"yeto.r.bcast.{fid}.{chunk}", fid, chunk, version, 8, {})

    inbox = CutInbox()
    # the last to arrive wins, whatever version it claims: the stream holds that one (a forged v3
    # overwritten by the real v2 must not hide it)
    for n in (notice(0, 0, 1), notice(0, 1, 1), notice(0, 0, 3), notice(0, 0, 2), notice(1, 0, 1)):
        inbox.put(n)
    assert len(inbox) == 3
    assert sorted((n.fragment, n.chunk, n.version) for n in inbox.drain()) == [(0, 0, 2), (0, 1, 1), (1, 0, 1)]
    assert len(inbox) == 0 and inbox.drain() == []


async def test_a_pull_ahead_of_the_cut_watcher_waits_for_its_notice_and_a_lost_watcher_is_made_again(
        js, run_id, nats_url, clients):
    """docs/design.md §7.1: a pull names its base version, sealed on BCAST before the round launched. Its notice
    in flight: the pull waits for it. The watcher lost (its server stopped; here its subscription is dropped under
    it, and no heartbeat check has noticed yet): made again, and the pull is handed on after the notice, so the
    boundary reads the version before it answers instead of pushing on a base the syncer refuses."""
    import hashlib

    from yeto.learner import ctl_reader
    from yeto.schemas.messages import BcastChunk

    c = await provisioned(clients, run_id, nats_url)

    async def seal(version: int) -> None:
        data = bytes([version]) * 8
        meta = BcastChunk(run=run_id, fragment=0, version=version, dtype="f32", chunk=0, chunks=1, offset=0, nbytes=8,
                          total=8, digest=hashlib.sha256(data).hexdigest()[:16], version_digest="0" * 64)
        await js.publish(S.bcast(run_id, 0, 0), data, headers={codec.CHUNK_HEADER: meta.header(),
                                                               S.MSG_ID: f"v{version}"})

    def pull(step: int, base: int) -> bytes:
        return codec.encode("pull", codec.make("pull", run=run_id, fragment=0, step=step, attempt=1, seq=0,
                                               base_version=base, members=[{"island": ISLAND, "gen": c.gen}]))

    def arrivals():
        """What reached the inboxes, in order: ("bcast", version) / ("pull", base)."""
        return [("bcast", n.version) for n in c.bcast.drain()] + [("pull", p["base_version"]) for p in c.pulls.drain()]

    await seal(1)
    await until(lambda: len(c.bcast) >= 1, what="the notice of version 1")
    assert arrivals() == [("bcast", 1)]
    # the pull and the seal it starts from race (two consumers): a pull that outruns the notice waits for it
    await js.publish(S.pull(run_id), pull(3, 2), headers={S.MSG_ID: "p3"})
    await asyncio.sleep(0.1)
    await seal(2)
    await until(lambda: len(c.pulls) >= 1, what="the pull of round 3")
    assert arrivals() == [("bcast", 2), ("pull", 2)] and c.counters["cut_rewatch"] == 0
    # the watcher lost: a pull past what it announced makes it again, and waits for its notices
    await c.cuts._subs["bcast_chunk"].unsubscribe()
    await seal(3)
    t0 = time.monotonic()
    await js.publish(S.pull(run_id), pull(5, 3), headers={S.MSG_ID: "p5"})
    await until(lambda: len(c.pulls) >= 1, what="the pull of round 5")
    took = time.monotonic() - t0
    assert arrivals() == [("bcast", 3), ("pull", 3)] and c.counters["cut_rewatch"] == 1
    assert ctl_reader.CUT_NOTICE_WAIT_S <= took < ctl_reader.CUT_NOTICE_WAIT_S + ctl_reader.CUT_REWATCH_WAIT_S
    # and it keeps watching
    await seal(4)
    await until(lambda: len(c.bcast) >= 1, what="the notice of version 4")
    assert arrivals() == [("bcast", 4)]


async def test_deliveries_lost_with_a_connection_come_again_at_once_after_the_reconnect(js, run_id):
    """docs/design.md §7.1: a pull the server handed to a fetch on a connection that then went away (its node
    restarted) would come again only after the consumer's 30 s ack wait; after the reconnect the reader makes
    the consumer again from the message after the last one taken, and it comes at once."""
    from collections import Counter

    from yeto.learner.ctl_reader import CtlReader
    from yeto.learner.inbox import Inbox
    from yeto.schemas import provision as P

    gen = "c" * 16
    await P.ensure_island_consumers(js, run_id, ISLAND, gen, start_seq=1)
    reader = CtlReader(js=js, run=run_id, island=ISLAND, gen=gen, hello={}, counters=Counter(), pulls=Inbox(),
                       control=Inbox(), reject=lambda *a: None, spawn=None,
                       connected=lambda: True, on_fatal=lambda: None)
    reader.consumers = {kind: S.island_consumer(ISLAND, kind) for kind in S.ISLAND_CONSUMER_KINDS}
    pull = dict(fragment=0, step=1, attempt=1, seq=0, base_version=0, members=[{"island": ISLAND, "gen": gen}])
    await js.publish(S.pull(run_id), codec.encode("pull", codec.make("pull", run=run_id, **pull)),
                     headers={S.MSG_ID: "p1"})
    ctl = S.stream(run_id, "CTL")
    lost = await js.pull_subscribe_bind(durable=S.island_pull_consumer(ISLAND), stream=ctl)
    assert len(await lost.fetch(1, timeout=5)) == 1          # delivered, never acked: lost with its connection
    await lost.unsubscribe()
    assert (await js.consumer_info(ctl, S.island_pull_consumer(ISLAND))).num_ack_pending == 1
    await reader.after_reconnect()
    assert reader.counters["ctl_consumer_reset"] == 1 and reader.counters["ctl_consumer_recreated"] == 1
    again = await js.pull_subscribe_bind(durable=S.island_pull_consumer(ISLAND), stream=ctl)
    t0 = time.monotonic()
    (m,) = await again.fetch(1, timeout=5)
    assert time.monotonic() - t0 < 2.0 and codec.decode_typed(m.data, ("pull",))[1]["step"] == 1
    owner = P.consumer_owner(await js.consumer_info(ctl, S.island_pull_consumer(ISLAND)))
    assert owner == gen                                       # still this generation's
    await m.ack()
    await asyncio.sleep(0.2)
    await reader.after_reconnect()                            # nothing unacked: the consumer is left alone
    assert reader.counters["ctl_consumer_reset"] == 1


def test_a_calls_own_timeout_is_reported_as_itself_not_as_the_calls_deadline():
    """On Python 3.11 a NATS request's timeout and a future's wait timeout are one class: a request that timed out
    (its reply lost with a move, say) was reported as 'did not finish within 60.0s' seconds after it began
    (soak/rolling.py). The deadline's own message is kept for a call still running at the deadline."""
    import concurrent.futures

    from yeto.learner.client import Fetch

    done = concurrent.futures.Future()
    done.set_exception(TimeoutError("nats: timeout"))
    with pytest.raises(TimeoutError, match="^nats: timeout$"):
        Fetch(done, 60.0).result()
    running = concurrent.futures.Future()
    with pytest.raises(TimeoutError, match="did not finish within 0.1s"):
        Fetch(running, 0.1).result()
    assert running.cancelled()
