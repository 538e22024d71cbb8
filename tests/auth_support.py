"""Secured runs against real nats-servers: what the permission tests share (tests/test_auth_permissions.py,
tests/test_hostile_island_e2e.py, tests/test_leaf_secure.py). No tests here.

`secured_broker` serves the users of `yeto auth init` directories (services/auth.py) and logs to a file;
`connect_as` connects as one identity and collects the server's errors; `wait_violation` waits for the
server's own "Permissions Violation" on such a connection, and `violations` reads the ones a server logged,
so a refusal a test asserts can only come from the permissions.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from yeto.schemas.conn import ConnectOptions, connect
from yeto.services.auth import write_server_config
from yeto.services.broker import Broker


def secured_broker(base: Path, auth_dirs: list[Path]) -> tuple[Broker, Path]:
    """A broker (not started) serving the users of `auth_dirs` (and TLS where the first has a certificate),
    its store and config under `base`, and the log file it writes."""
    conf = write_server_config(auth_dirs, base / "server.conf")
    log = base / "server.log"
    return Broker(store_dir=base / "store", config=conf, log_file=log), log


async def connect_as(url: str, creds: str, *, name: str, tls_ca: str | None = None, errors: list | None = None, **kw):
    """A connection as the identity of `creds`, never reconnecting; the server's errors (permission
    violations) are appended to `errors`."""
    async def on_error(exc):
        if errors is not None:
            errors.append(str(exc))

    opts = ConnectOptions(url=url, creds=creds, tls_ca=tls_ca, name=name)
    return await connect(opts, error_cb=on_error, allow_reconnect=False, connect_timeout=5, **kw)


async def wait_violation(errors: list, kind: str, subject: str, timeout: float = 5.0) -> str:
    """Wait for the server's `Permissions Violation for <kind> to "<subject>"` among a connection's errors."""
    want = f'permissions violation for {kind} to "{subject}"'.lower()   # nats-py lower-cases the -ERR line
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in errors:
            if want in e.lower():
                return e
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {want!r} from the server; errors seen: {errors}")


def violations(*logs: Path) -> list[str]:
    """The permission violations the servers logged."""
    return [ln for log in logs for ln in log.read_text(errors="replace").splitlines() if "Violation" in ln]
