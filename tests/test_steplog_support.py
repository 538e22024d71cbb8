"""Shared builders for the step-log dashboard tests (no tests here), `until` (a condition polled on
the loop) that the tail, dashboard, exporter and shard-status tests share, and `scrape` (an exporter's
/metrics over HTTP, `http_get`) that the exporter, dashboard and secured-run tests read metrics with; their `run` fixture (a
provisioned run) is tests/conftest.py's.

`SyntheticRun` builds step-log events and syncer tape records the way the islands and the syncer do:
`codec.make("steplog", ...)` for an island's per-step event (learner/steplog.make_event), and the
syncer's `_tape` record — {v, run, t} + the event's fields, `codec.encode("event", ...)` — on
`events.<kind>` with a `Nats-Msg-Id`. Every message is kept as (subject, bytes, msg id) so a test can
publish it to a real nats-server and also compute expected values independently of the Aggregator.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import orjson
from prometheus_client.parser import text_string_to_metric_families

from yeto.schemas import codec, subjects as S
from yeto.schemas.provision import RunLimits, provision_run, remove_run

GENS = {"a": "9f3c2a7b1e4d6c08", "b": "04b1e6d2c9a87f35"}
T0 = 1_718_035_200.0


def gen_of(island: str) -> str:
    return GENS.get(island) or f"{abs(hash(island)) % (1 << 64):016x}"


@dataclass
class SyntheticRun:
    run: str
    t: float = T0
    msgs: list[tuple[str, bytes, str]] = field(default_factory=list)  # (subject, data, msg id)
    steplogs: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    _key: itertools.count = field(default_factory=lambda: itertools.count(1))

    def tick(self, dt: float = 0.5) -> float:
        self.t += dt
        return self.t

    def step(self, island: str, step: int, *, boundary_s: float, export_s: float, apply_s: float,
             versions: dict[int, int], pushes: int = 0, applies: int = 0, bytes_out: int = 0, bytes_in: int = 0,
             scatter_bytes: int = 0, gather_bytes: int = 0, pending_pulls: int = 0, rejected: int = 0,
             loss: float | None = None, dropped: int = 0, gen: str | None = None) -> dict:
        fields = dict(run=self.run, island=island, gen=gen or gen_of(island), step=step, t=self.tick(),
                      boundary_s=boundary_s, export_s=export_s, apply_s=apply_s, pushes=pushes, applies=applies,
                      bytes_out=bytes_out, bytes_in=bytes_in, scatter_bytes=scatter_bytes, gather_bytes=gather_bytes,
                      versions={str(f): v for f, v in versions.items()}, pending_pulls=pending_pulls,
                      rejected=rejected, dropped=dropped)
        if loss is not None:
            fields["loss"] = loss
        msg = codec.make("steplog", fields)
        self.steplogs.append(msg)
        self.msgs.append((S.steplog(self.run, island), orjson.dumps(msg), S.steplog_msg_id(island, msg["gen"], step)))
        return msg

    def tape(self, kind: str, fields: dict | None = None, **kw) -> dict:
        rec = {"v": codec.PROTOCOL_VERSION, "run": self.run, "t": self.tick(0.1), "kind": kind}
        rec.update(fields or {})
        rec.update(kw)
        data = codec.encode("event", rec)
        msg = orjson.loads(data)
        self.events.append(msg)
        self.msgs.append((S.events(self.run, kind), data, S.event_msg_id(kind, f"test.{next(self._key)}")))
        return msg

    def raw(self, subject: str, data: bytes) -> None:
        """A message as a broken publisher would send it (not validated)."""
        self.msgs.append((subject, data, f"raw.{next(self._key)}"))


def member(island: str) -> dict:
    return {"island": island, "gen": gen_of(island)}


def scenario(run: str) -> SyntheticRun:
    """Two islands, two fragments: round 1 merges at once, round 2 times out once (attempt 2), island b
    falls behind on fragment 1. Numbers are chosen so every total is distinct."""
    r = SyntheticRun(run)
    r.tape("join", island="a", gen=gen_of("a"), reason="admitted")
    r.tape("join", island="b", gen=gen_of("b"), reason="admitted")
    r.tape("commit", step=0, fragment=0, version=0, detail={"version_digest": "0" * 64})
    r.tape("commit", step=0, fragment=1, version=0, detail={"version_digest": "1" * 64})
    r.step("a", 1, boundary_s=0.0, export_s=0.0, apply_s=0.0, versions={0: 0, 1: 0}, loss=3.5)
    r.step("b", 1, boundary_s=0.0, export_s=0.0, apply_s=0.0, versions={0: 0, 1: 0})
    # round 1, fragment 0
    r.step("a", 2, boundary_s=0.40, export_s=0.30, apply_s=0.05, versions={0: 0, 1: 0}, pushes=1, bytes_out=1000,
           gather_bytes=300, pending_pulls=1, loss=3.25)
    r.step("b", 2, boundary_s=0.90, export_s=0.70, apply_s=0.10, versions={0: 0, 1: 0}, pushes=1, bytes_out=1000,
           gather_bytes=300, pending_pulls=1)
    r.tape("disposition", {"try": 0}, step=1, fragment=0, attempt=1, island="a", gen=gen_of("a"), disposition="accepted",
           base_version=0, detail={"staleness": 0, "local_step": 2})
    r.tape("disposition", {"try": 0}, step=1, fragment=0, attempt=1, island="b", gen=gen_of("b"), disposition="accepted",
           base_version=0, detail={"staleness": 0, "local_step": 2})
    r.tape("disposition", {"try": 1}, step=1, fragment=0, attempt=1, island="a", gen=gen_of("a"), disposition="duplicate",
           reason="first valid push wins", base_version=0)
    r.tape("merge", step=1, fragment=0, attempt=1, base_version=0, version=1, expected=[member("a"), member("b")],
           responded=[member("a"), member("b")], quorum=2, staleness={"a": 0, "b": 0}, weights={"a": 4096, "b": 4096},
           quorum_s=1.25, grace_s=0.0, sync_s=1.75)
    r.tape("commit", step=1, fragment=0, version=1, detail={"version_digest": "2" * 64})
    r.step("a", 3, boundary_s=0.20, export_s=0.02, apply_s=0.15, versions={0: 1, 1: 0}, applies=1, bytes_in=2000,
           scatter_bytes=600, loss=3.0)
    r.step("b", 3, boundary_s=0.25, export_s=0.03, apply_s=0.18, versions={0: 1, 1: 0}, applies=1, bytes_in=2000,
           scatter_bytes=600, rejected=1)
    # round 2, fragment 1: attempt 1 misses its quorum, attempt 2 merges with a's push only
    r.tape("restart", step=2, fragment=1, attempt=2, base_version=0, expected=[member("a")], responded=[], quorum=1,
           reason="deadline passed below quorum: 0 of 2 needed answered attempt 1")
    r.tape("disposition", {"try": 0}, step=2, fragment=1, attempt=2, island="a", gen=gen_of("a"), disposition="accepted",
           base_version=0)
    r.tape("disposition", {"try": 0}, step=2, fragment=1, attempt=1, island="b", gen=gen_of("b"), disposition="out_of_round",
           reason="attempt 1 was restarted", base_version=0)
    r.tape("merge", step=2, fragment=1, attempt=2, base_version=0, version=1, expected=[member("a")],
           responded=[member("a")], quorum=1, staleness={"a": 0}, weights={"a": 4096}, quorum_s=3.5, grace_s=0.5,
           sync_s=4.25)
    r.tape("commit", step=2, fragment=1, version=1, detail={"version_digest": "3" * 64})
    r.step("a", 4, boundary_s=0.30, export_s=0.10, apply_s=0.12, versions={0: 1, 1: 1}, applies=1, pushes=1,
           bytes_out=1000, bytes_in=2000, loss=2.75, pending_pulls=0)
    r.step("b", 4, boundary_s=0.50, export_s=0.05, apply_s=0.0, versions={0: 1, 1: 0}, pending_pulls=2, dropped=3)
    r.tape("leave", island="b", gen=gen_of("b"), reason="no heartbeat for 31.0s")
    r.tape("error", reason="some_code: something odd", island="b", gen=gen_of("b"))
    return r


MALFORMED = 4


def add_malformed(r: SyntheticRun) -> None:
    """MALFORMED broken messages: not JSON, schema-invalid, island contradicting its subject, another run."""
    r.raw(S.steplog(r.run, "a"), b"{not json")
    bad = dict(r.steplogs[-1])
    bad.pop("boundary_s")
    r.raw(S.steplog(r.run, "a"), orjson.dumps(bad))
    r.raw(S.steplog(r.run, "a"), orjson.dumps(r.steplogs[-1]))  # b's event on a's subject
    other = dict(r.events[-1], run="someone_else")
    r.raw(S.events(r.run, "error"), orjson.dumps(other))


async def provision(js, run: str) -> None:
    await provision_run(js, run, RunLimits.small(storage="memory"), log=lambda _l: None)


async def publish_all(js, msgs, *, start: int = 0, stop: int | None = None) -> int:
    n = 0
    for subject, data, msg_id in msgs[start:stop]:
        ack = await js.publish(subject, data, headers={S.MSG_ID: msg_id}, timeout=5)
        assert not ack.duplicate, (subject, msg_id)
        n += 1
    return n


__all__ = ["SyntheticRun", "scenario", "add_malformed", "MALFORMED", "provision", "publish_all", "remove_run",
           "gen_of", "member", "T0"]


async def until(cond, timeout: float = 10.0, what: str = "condition"):
    """Poll `cond` (a function; its result may be awaitable) every 50 ms until it is truthy; return that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        val = cond()
        if asyncio.iscoroutine(val) or isinstance(val, asyncio.Future):
            val = await val
        if val:
            return val
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout} s")
        await asyncio.sleep(0.05)


async def http_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, dict, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)  # the server closes after one response
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels without run) -> value; also checks every sample names the run."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            out[(s.name, tuple(sorted((k, v) for k, v in labels.items() if k != "run")))] = (s.value, labels.get("run"))
    return out


async def scrape(port) -> dict:
    status, headers, body = await http_get(port, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return samples(body.decode())
