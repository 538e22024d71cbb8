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
            kw["nkeys_seed" if _is_nkey_seed(self.creds) else "user_credentials"] = self.creds
        if self.tls_ca:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            kw["tls"] = ctx
        if self.name:
            kw["name"] = self.name
        return kw


def _is_nkey_seed(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4096).strip()
    except OSError as exc:
        raise ValueError(f"--nats-creds / YETO_NATS_CREDS: cannot read {path!r}: {exc.strerror}") from None
    return head.startswith(b"SU") and b"\n" not in head


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
