"""Server-enforced permissions of `yeto auth init` (issue 17), against a real nats-server started with
the generated config (the shipped services/nats.conf settings + the users of three runs + TLS).

Every negative check has its positive twin on the same subject or API call, so a refusal can only come
from the permissions, not from a typo in the test; and every refusal is the server's own
"Permissions Violation" (reported to the client's error callback).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js import api
from nats.js.errors import NotFoundError

from schemas import codec, subjects as S
from schemas.conn import ConnectOptions, connect
from schemas.provision import RunLimits, island_consumer_config, provision_run
from services.auth import init_auth, write_server_config
from services.broker import Broker
from tests.e2e_procs import SYNCER_TIMEOUTS, IslandProc, clean_env, kv_json, tails, wait_exit, wait_until
from tests.scripted import ROOT, SyncerProc

GEN = "0123456789abcdef"


class Secured:
    def __init__(self, base: Path):
        tag = uuid.uuid4().hex[:6]
        self.runs = {"e2e": f"se_{tag}", "r1": f"s1_{tag}", "r2": f"s2_{tag}"}
        self.dirs = {k: base / k for k in self.runs}
        init_auth(self.runs["e2e"], ["a", "b"], self.dirs["e2e"], init_island="a", tls=True)
        init_auth(self.runs["r1"], ["a", "b"], self.dirs["r1"], init_island="a")
        init_auth(self.runs["r2"], ["x"], self.dirs["r2"])
        self.ca = str(self.dirs["e2e"] / "tls" / "ca.pem")
        conf = write_server_config([self.dirs["e2e"], self.dirs["r1"], self.dirs["r2"]], base / "server.conf")
        self.log = base / "server.log"
        self.broker = Broker(store_dir=base / "store", config=conf, log_file=self.log)

    def creds(self, key: str, identity: str) -> str:
        return str(self.dirs[key] / f"{identity}.creds")

    async def conn(self, key: str, identity: str, errors: list | None = None, **kw):
        """A connection as `identity` of run `key`; server errors (permission violations) go to `errors`."""
        async def on_error(exc):
            if errors is not None:
                errors.append(str(exc))

        opts = ConnectOptions(url=self.broker.url, creds=self.creds(key, identity), tls_ca=self.ca,
                              name=f"test-{key}-{identity}")
        return await connect(opts, error_cb=on_error, allow_reconnect=False, connect_timeout=5, **kw)

    def server_violations(self) -> list[str]:
        return [ln for ln in self.log.read_text(errors="replace").splitlines() if "Violation" in ln]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    s = Secured(tmp_path_factory.mktemp("secured"))
    s.broker.start()
    try:
        yield s
    finally:
        s.broker.stop()


@pytest.fixture(scope="module")
async def provisioned(secured):
    """Runs r1 and r2 provisioned by their own syncer identity (so that identity can provision)."""
    for key in ("r1", "r2"):
        nc = await secured.conn(key, "syncer")
        try:
            await provision_run(nc.jetstream(timeout=10), secured.runs[key], RunLimits.small())
        finally:
            await nc.close()
    return secured


# ---- the run goes through: the permissions are not too tight -------------------------------------

H, P, ROUNDS = 8, 2, 12


@pytest.mark.timeout(240)
async def test_a_real_run_through_the_secured_broker_finishes_normally(secured, tmp_path):
    """The real syncer, two learner.demo islands and `yeto steplog tail`, each with its own identity,
    over TLS: the run provisions, initializes, merges every round, finalizes and exits 0, and the server
    logged no permission violation at all (so no identity lacks a permission the code uses)."""
    run = secured.runs["e2e"]
    url = secured.broker.url
    tls = ("--tls-ca", secured.ca)
    before = len(secured.server_violations())
    syncer = SyncerProc(url, run, tmp_path / "ckpt", "--islands", "2", "--fragments", str(P), "--sync-every", str(H),
                        "--total-steps", str(ROUNDS), "--init-island", "a", *SYNCER_TIMEOUTS,
                        "--nats-creds", secured.creds("e2e", "syncer"), *tls, log=tmp_path / "syncer.log").start()
    islands = {name: IslandProc(url, run, name, tmp_path, args=("--step-delay", "0.05"),
                                env={"YETO_NATS_CREDS": secured.creds("e2e", name), "YETO_TLS_CA": secured.ca}).start()
               for name in ("a", "b")}
    tail_out = tmp_path / "tail.jsonl"
    with open(tail_out, "wb") as out:
        tail = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "steplog", "tail", "--json", "--count", "6", "--timeout", "150",
             "--nats", url, "--run", run, "--nats-creds", secured.creds("e2e", "observer"), *tls],
            stdout=out, stderr=subprocess.PIPE, cwd=ROOT, env=clean_env())
        procs = {"syncer": syncer, **islands}
        try:
            rcs = await wait_exit(procs, 180)
            tail_rc = await asyncio.to_thread(tail.wait, 60)
        finally:
            for p in procs.values():
                p.stop()
            if tail.poll() is None:
                tail.kill()
    assert rcs == {"syncer": 0, "a": 0, "b": 0}, tails(procs)
    nc = await secured.conn("e2e", "observer")
    try:
        commit = await kv_json(nc.jetstream(timeout=10), run, "commit")
    finally:
        await nc.close()
    assert commit["committed_step"] == ROUNDS
    for name, isl in islands.items():
        assert isl.result() is not None, isl.output()[-2000:]
    # the observer read the step logs and the tape with its read-only identity
    assert tail_rc == 0, tail.stderr.read().decode(errors="replace")[-2000:]
    events = [json.loads(ln) for ln in tail_out.read_text().splitlines() if ln.strip()]
    assert len(events) >= 6
    assert secured.server_violations()[before:] == []
