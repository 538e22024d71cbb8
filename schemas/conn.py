"""One convention for every command's connection to NATS (docs/design.md §7).

`--nats URL` (default `NATS_URL`, else nats://127.0.0.1:4222; user:password may sit in the URL),
`--nats-creds FILE`, `--tls-ca FILE`, `--run R`. `YETO_*` variables mirror the flags. Both `services`
and `learner` connect the same way, so this lives in the shared package.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import ssl
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from .errors import ConfigError
from .ids import check_run

DEFAULT_URL = "nats://127.0.0.1:4222"


def env_default(name: str, default=None):
    return os.environ.get(name, default)


@dataclass
class ConnectOptions:
    url: str = DEFAULT_URL
    creds: str | None = None
    tls_ca: str | None = None
    name: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, name: str | None = None) -> "ConnectOptions":
        return cls(url=args.nats, creds=args.nats_creds, tls_ca=args.tls_ca, name=name)

    @classmethod
    def from_env(cls, name: str | None = None) -> "ConnectOptions":
        return cls(
            url=os.environ.get("YETO_NATS") or os.environ.get("NATS_URL") or DEFAULT_URL,
            creds=os.environ.get("YETO_NATS_CREDS"),
            tls_ca=os.environ.get("YETO_TLS_CA"),
            name=name,
        )

    def kwargs(self) -> dict:
        kw: dict = {"servers": [u.strip() for u in self.url.split(",") if u.strip()]}
        if self.creds:
            # `yeto auth init` writes a bare nkey seed; a JWT .creds file (nsc) goes to user_credentials.
            pub = _nkey_seed_public(self.creds)
            if pub is None:
                kw["user_credentials"] = self.creds
            else:
                kw["nkeys_seed"] = self.creds
                # Replies (JetStream API answers, fetched messages) come to an inbox only this key may
                # read: with the shared _INBOX.> one island could read another's or the syncer's replies.
                kw["inbox_prefix"] = nkey_inbox_prefix(pub)
        if self.tls_ca:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            kw["tls"] = ctx
        if self.name:
            kw["name"] = self.name
        return kw


def nkey_inbox_prefix(public_key: str) -> str:
    """The inbox prefix of a connection made with nkey user `public_key` (services/auth.py permits it)."""
    return f"_INBOX_{public_key}"


def _nkey_seed_public(path: str) -> str | None:
    """The public key of a bare nkey user seed file; None for anything else (a JWT .creds file)."""
    try:
        with open(path, "rb") as f:
            seed = bytearray(f.read(4096).strip())
    except OSError as exc:
        raise ConfigError(f"--nats-creds / YETO_NATS_CREDS: cannot read it: {exc.strerror}", field="nats_creds",
                          value=path) from None
    if not seed.startswith(b"SU") or b"\n" in seed:
        return None
    import nkeys

    kp = nkeys.from_seed(seed)
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()


def add_connect_args(parser: argparse.ArgumentParser, *, run: bool = True, run_required: bool = True) -> None:
    """Add --nats, --nats-creds, --tls-ca (and --run) with YETO_* / NATS_URL defaults."""
    g = parser.add_argument_group("connection")
    g.add_argument(
        "--nats",
        default=os.environ.get("YETO_NATS") or os.environ.get("NATS_URL") or DEFAULT_URL,
        help="NATS server URL(s), comma separated; user:password@ allowed (env YETO_NATS or NATS_URL; default %(default)s)",
    )
    g.add_argument("--nats-creds", default=os.environ.get("YETO_NATS_CREDS"), help="NATS credentials file (env YETO_NATS_CREDS)")
    g.add_argument("--tls-ca", default=os.environ.get("YETO_TLS_CA"), help="CA bundle for TLS to NATS (env YETO_TLS_CA)")
    if run:
        default_run = os.environ.get("YETO_RUN")
        g.add_argument(
            "--run",
            type=check_run,
            default=default_run,
            required=run_required and default_run is None,
            help="run id, [A-Za-z0-9_-]+ (env YETO_RUN)",
        )


# URL schemes nats-py speaks (a bare host:port means nats://)
SCHEMES = ("nats", "tls", "ws", "wss")
CONNECT_TIMEOUT_ENV = "YETO_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S = 20.0


def check_urls(url: str) -> list[str]:
    """The servers of `--nats`, each checked before any connection attempt: a scheme nats-py speaks and a
    host (`http://…` or `nats:/host` were retried for ever as if the network were down)."""
    from urllib.parse import urlsplit

    servers = [u.strip() for u in str(url).split(",") if u.strip()]
    if not servers:
        raise ConfigError("--nats / NATS_URL: no server URL given", field="nats", value=url)
    for u in servers:
        parts = urlsplit(u if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/", u) else f"nats://{u}")
        if parts.scheme not in SCHEMES:
            raise ConfigError(f"--nats / NATS_URL: {u!r} is not a NATS URL: the scheme must be one of "
                              f"{', '.join(s + '://' for s in SCHEMES)} (e.g. nats://host:4222)", field="nats", value=u)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if not parts.hostname or port == -1:
            raise ConfigError(f"--nats / NATS_URL: {u!r} names no host (or a bad port): write it as "
                              f"{parts.scheme}://host:4222", field="nats", value=u)
    return servers


def redact(url: str) -> str:
    """The URL(s) for a message: a password in user:password@ shown as ***."""
    return re.sub(r"(://[^:/@,]*):[^@/,]*@", r"\1:***@", str(url))


# Permission violations the server reported on this process's connections, newest last: (op, subject).
# nats-py only logs them and lets the request time out; a command turns the timeout into this news.
DENIED: list[tuple[str, str]] = []
_DENIED_RE = re.compile(r'permissions violation for (publish|subscription) (?:to|on) "([^"]*)"', re.I)


def note_denied(exc) -> tuple[str, str] | None:
    """Record a permissions violation the server sent (None if `exc` is not one)."""
    m = _DENIED_RE.search(str(exc))
    if m is None:
        return None
    DENIED.append((m.group(1).lower(), m.group(2)))
    del DENIED[:-16]
    return DENIED[-1]


def _refused(exc) -> bool:
    """The server refused the identity (nats-py reports it as AuthorizationError or as a plain Error)."""
    from nats.errors import AuthorizationError

    return isinstance(exc, AuthorizationError) or "authorization violation" in str(exc).lower()


def connect_bound_s(env=None) -> float:
    """How long a command waits for its first connection (`YETO_CONNECT_TIMEOUT`, seconds, default 20)."""
    raw = (os.environ if env is None else env).get(CONNECT_TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_CONNECT_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise ConfigError(f"{CONNECT_TIMEOUT_ENV} must be a number of seconds > 0", field=CONNECT_TIMEOUT_ENV, value=raw)
    return v


async def connect(opts: ConnectOptions, *, within_s: float | None = None, **extra):
    """Connect with nats-py; extra keyword arguments go to nats.connect (callbacks, reconnect policy).

    The first connection is bounded (`within_s`, default `YETO_CONNECT_TIMEOUT` or 20 s): nats-py alone
    retries a dead address for its whole reconnect budget (60 x 2 s, or for ever), in silence. Past the
    bound, or at once when the server refuses the credentials, a ConnectError names the URL and what to do.
    Once connected, reconnects follow the caller's policy. A bad URL or creds file is a ConfigError first."""
    import logging

    from .errors import ConnectError

    check_urls(opts.url)
    bound = connect_bound_s() if within_s is None else float(within_s)
    kw = opts.kwargs()
    kw.update(extra)
    where = redact(opts.url)
    user_error_cb = kw.get("error_cb")
    state = {"connected": False, "last": None, "warned": False}
    refused = asyncio.Event()

    async def on_error(exc):
        if state["connected"]:
            denied = note_denied(exc)
            if user_error_cb is not None:
                await user_error_cb(exc)
            elif denied is not None:
                logging.getLogger("yeto.conn").warning("permission denied: %s to %s (identity %s)", *denied,
                                                       opts.creds or "none")
            else:   # one line (nats-py's own default logs a traceback for each)
                logging.getLogger("yeto.conn").warning("nats at %s: %r", where, exc)
            return
        state["last"] = exc   # before the first connection: said once, then kept for the one message
        if _refused(exc):
            refused.set()
        elif not state["warned"]:
            state["warned"] = True
            logging.getLogger("yeto.conn").warning("waiting for NATS at %s (up to %.0fs, %s): %r", where, bound,
                                                   CONNECT_TIMEOUT_ENV, exc)

    kw["error_cb"] = on_error
    user_ldm_cb = kw.get("lame_duck_mode_cb")

    async def on_lame_duck():
        # The server is about to stop (lame duck mode: a planned restart, docs/design.md §7.1). nats-py only
        # reports it; move to another server of the pool now, while this one still routes the replies of what
        # is in flight (a publish whose ack is lost is re-sent after the reconnect, schemas/publish.py), not at
        # its eviction up to lame_duck_duration later. With one server there is nowhere to go: stay.
        others = [u for u in nc.servers if nc.connected_url is None or u.netloc != nc.connected_url.netloc]
        if others:
            logging.getLogger("yeto.conn").info("nats at %s: the server enters lame duck mode; moving to another",
                                                redact(str(nc.connected_url.geturl() if nc.connected_url else where)))
            await nc.force_reconnect()
        if user_ldm_cb is not None:
            await user_ldm_cb()

    kw["lame_duck_mode_cb"] = on_lame_duck

    def after_connect(cb):
        # a half-open client closed below must not tell the caller it was disconnected or closed
        async def forward(*a):
            if state["connected"]:
                await cb(*a)
        return forward

    for name in ("disconnected_cb", "closed_cb", "reconnected_cb"):
        if kw.get(name) is not None:
            kw[name] = after_connect(kw[name])
    deadline = asyncio.get_running_loop().time() + bound
    while True:
        nc = _client_class()()   # nats.NATS, with requests that survive a move (above)
        attempt = asyncio.ensure_future(nc.connect(**kw))
        stop = asyncio.ensure_future(refused.wait())
        left = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait({attempt, stop}, timeout=max(left, 0.0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if attempt.done() and attempt.exception() is None:
            state["connected"] = True
            return nc
        if not attempt.done():
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
        else:
            state["last"] = attempt.exception()
        try:
            await asyncio.wait_for(nc.close(), 2)
        except BaseException:  # noqa: BLE001 - a half-open client: nothing to keep
            pass
        last = state["last"]
        if refused.is_set() or _refused(last):
            who = f"the credentials in {opts.creds}" if opts.creds else "a connection without credentials"
            raise ConnectError(f"NATS at {where} refused {who} (authorization violation): pass the identity "
                               f"`yeto auth init` made for this process with --nats-creds / YETO_NATS_CREDS")
        if asyncio.get_running_loop().time() >= deadline:
            why = f": {last!r}" if last is not None else ""
            raise ConnectError(f"cannot connect to NATS at {where} within {bound:.0f}s{why}; is the broker running "
                               f"there? ({CONNECT_TIMEOUT_ENV} sets how long to wait)")
        await asyncio.sleep(min(0.5, max(deadline - asyncio.get_running_loop().time(), 0.0)))


MOVE_POLL_S = 0.1   # how often a request in flight looks whether its client moved to another server


async def across_moves(nc, make: Callable[[], Awaitable[Any]], *, tries: int = 3) -> Any:
    """Await `make()`, a request (a direct get, a JetStream API call), asked again at once when its client
    moves to another server while it waits (a node in lame duck mode or restarting, docs/design.md §7.1): its
    reply went to the connection left behind and never comes, and waiting out the request's own timeout cost
    islands 5 s and the syncer 30 s at a broker roll. The last try is waited out as usual. `nc` None: plain.
    Every client `connect` makes asks its requests this way."""
    for _ in range(tries - 1 if nc is not None else 0):
        moved_from = nc.stats["reconnects"]
        task = asyncio.ensure_future(make())
        try:
            while not task.done() and nc.stats["reconnects"] == moved_from:
                await asyncio.wait({task}, timeout=MOVE_POLL_S)
        except asyncio.CancelledError:
            # our caller gave up (its own deadline): the request must not live on unawaited and end in
            # "Task exception was never retrieved" (an island's log, a chaos run with a node killed)
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return await make()


@functools.cache
def _client_class():
    import nats.aio.client

    base = nats.aio.client.Client

    class Client(base):
        """nats-py's client, its requests (JetStream API calls, direct gets, KV reads, JetStream publishes: all
        go through `request`) asked again when it moves to another server (`across_moves`). A request asked
        twice is one the server may see twice: JetStream publishes carry a Nats-Msg-Id, the rest read, or
        are revision-checked writes whose callers read a refused one back."""

        async def request(self, subject, payload=b"", timeout=0.5, old_style=False, headers=None):
            return await across_moves(self, lambda: base.request(self, subject, payload, timeout=timeout,
                                                                 old_style=old_style, headers=headers))

    return Client


def server_max_payload(nc) -> int:
    """The `max_payload` the server announced in its INFO (headers count toward it)."""
    return int(nc.max_payload)
