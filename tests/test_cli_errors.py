"""docs/design.md §7: an operator's mistakes fail fast with one line that names the thing and what to do.

CLI-level, each against a real nats-server where one is involved (a dead broker is a real one killed -9):

- a broker that is down: `yeto run rm`, `yeto steplog tail --timeout 5`, `yeto syncer` and a demo island
  each end within their bound (20 s by default, YETO_CONNECT_TIMEOUT), naming the URL, in a few lines,
  without a traceback (before: 65 s of silence and a TimeoutError for the island, 29 tracebacks and no end
  for `run rm`, a warning every 2 s for ever for the syncer, `--timeout` ignored by the tail);
- `--nats http://…` or `nats:/host` is refused at once (exit 2) instead of retried for ever;
- an island whose creds file is missing exits 2 at once naming the path (before: retried as a network fault);
- a second `yeto broker` on a port a broker holds never prints "ready" and names the port (exit 2);
- a secured server that refuses the credentials: the connection fails at once saying so.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from yeto.services.broker import Broker, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_") and k != "NATS_URL"}
    return {**env, **extra}


def _start(argv: list[str], **env: str) -> tuple[subprocess.Popen, float]:
    return (subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=_env(**env)), time.monotonic())


@pytest.fixture
def dead_broker_url(tmp_path) -> str:
    """The address of a real nats-server that was killed -9 (nothing listens there any more)."""
    b = Broker(store_dir=tmp_path / "dead").start()
    url = b.url
    b.kill()
    return url


def test_every_command_against_a_dead_broker_ends_within_its_bound_naming_the_url(dead_broker_url, tmp_path):
    url = dead_broker_url
    procs = {
        "run rm": _start(["-m", "yeto.services.cli", "run", "rm", "r1", "--nats", url]),
        "steplog tail": _start(["-m", "yeto.services.cli", "steplog", "tail", "--run", "r1", "--timeout", "5",
                                "--nats", url]),
        "syncer": _start(["-m", "yeto.services.cli", "syncer", "--run", "r1", "--nats", url,
                          "--checkpoint-dir", str(tmp_path / "ck")]),
        "island": _start(["-m", "yeto.learner.demo", "--run", "r1", "--island", "a"], NATS_URL=url),
    }
    # the same imports with no connection: what a loaded machine adds before the 20 s wait even starts
    # (torch and the learner took 10+ s to import here while the whole suite ran on two cores)
    base, t_base = _start(["-c", "import yeto.learner.demo, yeto.services.cli"])
    base.communicate(timeout=120)
    startup = time.monotonic() - t_base
    # the island's own imports and model set-up run beside four other processes on two cores: its 20 s wait
    # plus the measured start-up, never under the other commands' bound (32.2 s against 31.1 failed in CI)
    bounds = {"run rm": 40, "steplog tail": 40, "syncer": 40, "island": max(40.0, startup + 25.0)}
    for name, (p, t0) in procs.items():
        try:
            out, _ = p.communicate(timeout=bounds[name] + 20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            pytest.fail(f"{name}: still running after {bounds[name] + 20}s against a dead broker:\n{out[-3000:]}")
        took = time.monotonic() - t0
        lines = out.strip().splitlines()
        print(f"{name}: exit {p.returncode} after {took:.1f}s (imports alone: {startup:.1f}s), {len(lines)} lines: "
              f"{lines[-1] if lines else ''}")
        assert p.returncode == 1, (name, out[-3000:])
        assert took <= bounds[name], (name, took, out[-3000:])
        assert url in out and "cannot connect to NATS" in out, (name, out[-3000:])
        assert "Traceback" not in out, (name, out[-3000:])
        assert len(lines) <= 10, (name, out[-3000:])


@pytest.mark.parametrize("url", ["http://127.0.0.1:4222", "nats:/127.0.0.1:4222"])
def test_a_url_that_is_not_nats_is_refused_at_once(url):
    for argv in (["-m", "yeto.services.cli", "syncer", "--run", "r1", "--nats", url],
                 ["-m", "yeto.services.cli", "run", "rm", "r1", "--nats", url]):
        p, t0 = _start(argv, YETO_CONNECT_TIMEOUT="300")   # refused before any wait (before: retried for ever)
        out, _ = p.communicate(timeout=200)
        assert p.returncode == 2, out[-3000:]
        assert time.monotonic() - t0 < 90, out
        assert repr(url) in out and "Traceback" not in out, out
        assert "nats://host:4222" in out, out


def test_an_island_whose_creds_file_is_missing_exits_2_naming_it(nats_url, tmp_path):
    missing = tmp_path / "no-such.creds"
    # a connect bound of 300 s: before, the missing file was retried like a network fault for all of it
    p, t0 = _start(["-m", "yeto.learner.demo", "--run", "r1", "--island", "a"], NATS_URL=nats_url,
                   YETO_NATS_CREDS=str(missing), YETO_CONNECT_TIMEOUT="300")
    out, _ = p.communicate(timeout=200)
    assert p.returncode == 2, out[-3000:]
    assert time.monotonic() - t0 < 90, out
    assert str(missing) in out and "cannot read it" in out and "Traceback" not in out, out


def test_a_second_broker_on_a_held_port_never_says_ready_and_names_the_port(tmp_path):
    port = free_port()
    with Broker(port=port, store_dir=tmp_path / "first"):
        p, _ = _start(["-m", "yeto.services.cli", "broker", "--port", str(port), "--store-dir", str(tmp_path / "second")])
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 2, out[-3000:]
    assert "broker ready" not in out, out   # (the line printed once a broker serves)
    assert f"port {port}" in out and "already in use" in out, out


async def test_a_secured_server_refusing_the_credentials_is_said_at_once(tmp_path):
    """A wrong identity is not a network fault: no waiting out the connect bound."""
    from yeto.schemas.conn import ConnectOptions, connect
    from yeto.schemas.errors import ConnectError

    conf = tmp_path / "auth.conf"
    conf.write_text('port: -1\nauthorization { user: alice, password: "right" }\n')
    port = free_port()
    b = Broker(port=port, store_dir=tmp_path / "s", config=conf).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectError) as ei:
            await connect(ConnectOptions(url=f"nats://alice:wrong@127.0.0.1:{port}"), within_s=20)
        assert time.monotonic() - t0 < 10
        msg = str(ei.value)
        assert "authorization violation" in msg and "wrong" not in msg and "alice:***@" in msg, msg
    finally:
        b.stop()


def test_more_fragments_than_tensors_is_refused_naming_the_tensor_count(nats_url, run_id, tmp_path):
    """The demo MLP has 6 tensors; --fragments 50 cannot pin a session: the island exits with one line
    naming the count, the syncer says so at ERROR (and keeps running: another island's hello is no reason
    for it to exit, nor a forged one)."""
    syncer, _ = _start(["-m", "yeto.services.cli", "syncer", "--nats", nats_url, "--run", run_id, "--fragments", "50",
                        "--sync-every", "50", "--islands", "1", "--small-limits", "--checkpoint-dir", str(tmp_path / "ck")])
    try:
        island, t0 = _start(["-m", "yeto.learner.demo", "--run", run_id, "--island", "a"], NATS_URL=nats_url)
        out, _ = island.communicate(timeout=120)
        assert island.returncode not in (0, None), out[-3000:]
        assert "the model has 6 non-empty tensors" in out and "--fragments / YETO_FRAGMENTS <= 6" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert syncer.poll() is None
    finally:
        syncer.terminate()
        s_out, _ = syncer.communicate(timeout=30)
    assert f"ERROR run {run_id} cannot pin its session on island a's model" in s_out.replace("yeto.syncer ", ""), \
        s_out[-3000:]


def test_a_refused_operation_in_a_secured_run_says_permission_denied_and_which_identity(tmp_path):
    """Before: a `nats: timeout` traceback, the violation only in one warning line."""
    from yeto.services.auth import init_auth, write_server_config

    run = "sec_rm"
    init_auth(run, ["a", "b"], tmp_path / "auth", init_island="a")
    conf = write_server_config([tmp_path / "auth"], tmp_path / "server.conf")
    with Broker(store_dir=tmp_path / "store", config=conf) as b:
        p, _ = _start(["-m", "yeto.services.cli", "run", "rm", run, "--nats", b.url,
                       "--nats-creds", str(tmp_path / "auth" / "a.creds")])
        out, _ = p.communicate(timeout=90)
        assert p.returncode == 1, out[-3000:]
        assert "yeto run rm: permission denied: publish to $js.api.stream.delete" in out.lower(), out[-3000:]
        assert "admin.creds" in out and str(tmp_path / "auth" / "a.creds") in out, out[-3000:]
        assert "Traceback" not in out and len(out.strip().splitlines()) <= 10, out[-3000:]
        # the identity it names does it
        p, _ = _start(["-m", "yeto.services.cli", "run", "rm", run, "--nats", b.url,
                       "--nats-creds", str(tmp_path / "auth" / "admin.creds")])
        out, _ = p.communicate(timeout=90)
        assert p.returncode == 0 and "nothing to remove" in out, out[-3000:]
