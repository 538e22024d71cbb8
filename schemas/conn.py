"""One convention for every command's connection to NATS (DESIGN §7).

`--nats URL` (default `NATS_URL`, else nats://127.0.0.1:4222; user:password may sit in the URL),
`--nats-creds FILE`, `--tls-ca FILE`, `--run R`. `YETO_*` variables mirror the flags. Both `services`
and `learner` connect the same way, so this lives in the shared package.
"""
from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass

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


async def connect(opts: ConnectOptions, **extra):
    """Connect with nats-py; extra keyword arguments go to nats.connect (callbacks, reconnect policy)."""
    import nats

    kw = opts.kwargs()
    kw.update(extra)
    return await nats.connect(**kw)


def server_max_payload(nc) -> int:
    """The `max_payload` the server announced in its INFO (headers count toward it)."""
    return int(nc.max_payload)
