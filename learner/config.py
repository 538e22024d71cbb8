"""Island configuration: `YETO_*` environment variables and/or keyword arguments (docs/design.md §5, §7).

Owns `IslandConfig`, every setting an island reads, with its default and its check; the table of
attributes, variables and defaults is docs/island.md (the ms-swift plugin's own
variables: docs/megatron.md). `IslandConfig.from_env(**overrides)` reads the environment; keyword
arguments win over it.
Invariants: a bad value raises ConfigError naming the attribute and, in the message, the variable it
came from, before the island says hello; the config is read once and never changes while the island runs.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from yeto.schemas.conn import ConnectOptions
from yeto.schemas.dtypes import AUTO_DTYPE, BULK_DTYPES as _BULK, PUSH_DTYPES as _PUSH
from yeto.schemas.errors import ConfigError
from yeto.schemas.ids import check_island, check_run

_DOMAIN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a domain becomes a subject token ($JS.<domain>.API)
MiB = 1 << 20
MAX_FETCH_BATCH_BYTES = 32 * MiB  # docs/design.md §15.4: keep a batch well under the 64 MiB slow-consumer limit

PUSH_DTYPES = (AUTO_DTYPE, *_PUSH)
BULK_DTYPES = (AUTO_DTYPE, *_BULK)

# attribute -> environment variable (connection options come from ConnectOptions.from_env)
ENV = {
    "run": "YETO_RUN",
    "island": "YETO_ISLAND",
    "push_dtype": "YETO_PUSH_DTYPE",
    "bulk_dtype": "YETO_BULK_DTYPE",
    "alpha": "YETO_DILOCO_ALPHA",
    "lockstep": "YETO_LOCKSTEP",
    "initial_cut_timeout": "YETO_DILOCO_INITIAL_CUT_TIMEOUT",
    "step_log": "YETO_DILOCO_STEP_LOG",
    "heartbeat_s": "YETO_HEARTBEAT_S",
    "max_reconnects": "YETO_MAX_RECONNECTS",
    "reconnect_wait_s": "YETO_RECONNECT_WAIT_S",
    "fetch_batch_bytes": "YETO_FETCH_BATCH_BYTES",
    "steplog_queue": "YETO_STEPLOG_QUEUE",
    "init_v0_timeout_s": "YETO_INIT_V0_TIMEOUT",
    "lockstep_timeout_s": "YETO_LOCKSTEP_TIMEOUT",
    "final_timeout_s": "YETO_FINAL_TIMEOUT",
    "shutdown_timeout_s": "YETO_SHUTDOWN_TIMEOUT",
    "session_timeout_s": "YETO_SESSION_TIMEOUT",
    "push_timeout_s": "YETO_PUSH_TIMEOUT",
    "fetch_timeout_s": "YETO_FETCH_TIMEOUT",
    "connect_timeout_s": "YETO_CONNECT_TIMEOUT",
    "progress": "YETO_PROGRESS",
    "anchor_dir": "YETO_ANCHOR_DIR",
    "domain": "YETO_DOMAIN",
    "hub_domain": "YETO_HUB_DOMAIN",
    "background": "YETO_BACKGROUND_SYNC",
    "staging_group": "YETO_STAGING_GROUP",
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass
class IslandConfig:
    run: str
    island: str
    nats: ConnectOptions = field(default_factory=ConnectOptions)
    push_dtype: str = "auto"
    bulk_dtype: str = "auto"
    alpha: float = 0.5
    lockstep: bool = False
    initial_cut_timeout: float = 0.0
    step_log: str | None = None
    heartbeat_s: float = 2.0
    max_reconnects: int = 60
    reconnect_wait_s: float = 2.0
    fetch_batch_bytes: int = 16 * MiB
    steplog_queue: int = 1024
    init_v0_timeout_s: float = 600.0
    lockstep_timeout_s: float = 600.0
    final_timeout_s: float = 600.0
    shutdown_timeout_s: float = 60.0
    session_timeout_s: float | None = None
    push_timeout_s: float = 120.0
    fetch_timeout_s: float = 60.0
    connect_timeout_s: float = 20.0   # the first connection only (schemas.conn.connect)
    progress: bool = True
    anchor_dir: str | None = None
    # Island datacenters (docs/design.md §12): the leaf node's JetStream domain holding the cut's mirror, and the hub's.
    domain: str | None = None
    hub_domain: str = "hub"
    background: bool = True
    staging_group: bool = True
    host: str = field(default_factory=socket.gethostname)
    # The island's parallel layout for hello (informational); None: computed from the group size.
    world: dict | None = None

    def __post_init__(self):
        check_run(self.run)
        check_island(self.island)
        if not isinstance(self.nats, ConnectOptions):
            raise ConfigError("must be a schemas.conn.ConnectOptions", field="nats", value=self.nats)
        if self.push_dtype not in PUSH_DTYPES:
            self._bad("push_dtype", f"must be one of {PUSH_DTYPES}")
        if self.bulk_dtype not in BULK_DTYPES:
            self._bad("bulk_dtype", f"must be one of {BULK_DTYPES}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0:
            self._bad("alpha", "must be a number in [0, 1]")
        self.alpha = float(self.alpha)
        for name in ("initial_cut_timeout", "init_v0_timeout_s", "lockstep_timeout_s", "final_timeout_s",
                     "shutdown_timeout_s", "reconnect_wait_s"):
            self._seconds(name, allow_zero=True)
        for name in ("heartbeat_s", "push_timeout_s", "fetch_timeout_s", "connect_timeout_s"):
            self._seconds(name, allow_zero=False)
        if self.session_timeout_s is not None:
            self._seconds("session_timeout_s", allow_zero=False)
        m = self.max_reconnects
        if isinstance(m, bool) or not isinstance(m, int) or (m < 0 and m != -1):
            self._bad("max_reconnects", "must be a non-negative integer, or -1 for no limit")
        b = self.fetch_batch_bytes
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_FETCH_BATCH_BYTES:
            self._bad("fetch_batch_bytes", f"must be an integer in 1..{MAX_FETCH_BATCH_BYTES} (32 MiB)")
        q = self.steplog_queue
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            self._bad("steplog_queue", "must be a positive integer")
        if self.step_log is not None and not isinstance(self.step_log, (str, os.PathLike)):
            self._bad("step_log", "must be a path")
        if self.anchor_dir is not None:
            if not isinstance(self.anchor_dir, (str, os.PathLike)) or not os.fspath(self.anchor_dir):
                self._bad("anchor_dir", "must be a directory path")
            self.anchor_dir = os.fspath(self.anchor_dir)

        for name in ("domain", "hub_domain"):
            v = getattr(self, name)
            if (v is not None or name == "hub_domain") and not (isinstance(v, str) and _DOMAIN_RE.match(v)):
                self._bad(name, "must be a JetStream domain name: 1-64 letters, digits, '_' or '-'")

    def _bad(self, name: str, why: str) -> None:
        var = ENV.get(name)
        raise ConfigError(why + (f" (env {var})" if var else ""), field=name, value=getattr(self, name))

    def _seconds(self, name: str, *, allow_zero: bool) -> None:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or (v == 0 and not allow_zero):
            self._bad(name, "must be a number of seconds " + (">= 0" if allow_zero else "> 0"))
        setattr(self, name, float(v))

    # ---- environment ----------------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "IslandConfig":
        """Build from `env` (default os.environ) plus keyword overrides (which win)."""
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for name, var in ENV.items():
            if name in overrides or var not in env:
                continue
            kw[name] = _parse(name, var, env[var], types[name])
        if "nats" not in overrides:
            if env is os.environ:
                kw["nats"] = ConnectOptions.from_env()
            else:
                kw["nats"] = ConnectOptions(
                    url=env.get("YETO_NATS") or env.get("NATS_URL") or ConnectOptions.url,
                    creds=env.get("YETO_NATS_CREDS"), tls_ca=env.get("YETO_TLS_CA"))
        kw.update(overrides)
        for req in ("run", "island"):
            if req not in kw:
                raise ConfigError(f"is required: set {ENV[req]} or pass {req}=", field=req, value=None)
        return cls(**kw)


def _parse(name: str, var: str, text: str, typ: Any) -> Any:
    t = str(typ)
    text = text.strip()
    try:
        if t.startswith("bool"):
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(text)
        if t.startswith("int"):
            return int(text)
        if t.startswith("float | None"):
            return None if text.lower() in ("", "none", "inf", "forever") else float(text)
        if t.startswith("float"):
            return float(text)
        if t.startswith("str | None"):
            return text or None
        return text
    except ValueError:
        raise ConfigError(f"cannot parse {var}={text!r} as {t}", field=name, value=text) from None


__all__ = ["ENV", "IslandConfig", "MAX_FETCH_BATCH_BYTES"]
