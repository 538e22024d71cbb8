"""Island configuration: `YETO_*` environment variables and/or keyword arguments (docs/design.md §5, §7).

`IslandConfig.from_env(**overrides)` reads the environment; keyword arguments win over it. Every bad
value raises ConfigError naming the attribute and, in the message, the variable it came from.

| attribute | variable | default | meaning |
|---|---|---|---|
| run | YETO_RUN | (required) | run id |
| island | YETO_ISLAND | (required) | island id |
| nats | YETO_NATS / NATS_URL, YETO_NATS_CREDS, YETO_TLS_CA | nats://127.0.0.1:4222 | connection |
| push_dtype | YETO_PUSH_DTYPE | auto | auto (take the session's), f32, bf16, q4 |
| bulk_dtype | YETO_BULK_DTYPE | auto | auto, f32, bf16 |
| alpha | YETO_DILOCO_ALPHA | 0.5 | θ = α·θ_local + (1−α)·Θ when a broadcast lands |
| lockstep | YETO_LOCKSTEP | off | deterministic test mode (blocks at due rounds) |
| initial_cut_timeout | YETO_DILOCO_INITIAL_CUT_TIMEOUT | 0 | seconds to install the cut before step 1 |
| step_log | YETO_DILOCO_STEP_LOG | none | file that also gets every step-log JSON line |
| heartbeat_s | YETO_HEARTBEAT_S | 2 | heartbeat period |
| max_reconnects | YETO_MAX_RECONNECTS | 60 | failed reconnects before the island gives up (-1: never) |
| reconnect_wait_s | YETO_RECONNECT_WAIT_S | 2 | pause between reconnect attempts |
| fetch_batch_bytes | YETO_FETCH_BATCH_BYTES | 16 MiB | bytes fetched per request at a boundary (≤ 32 MiB; the next batch is fetched while one is checked, so up to two are held) |
| steplog_queue | YETO_STEPLOG_QUEUE | 1024 | step-log events waiting for the network before drops |
| init_v0_timeout_s | YETO_INIT_V0_TIMEOUT | 600 | INIT island: wait this long for v0 after streaming INIT |
| lockstep_timeout_s | YETO_LOCKSTEP_TIMEOUT | 600 | lockstep: longest wait for a pull or a broadcast |
| final_timeout_s | YETO_FINAL_TIMEOUT | 600 | longest wait for the final cut after a manifest |
| shutdown_timeout_s | YETO_SHUTDOWN_TIMEOUT | 60 | longest wait for shutdown after the final ack |
| session_timeout_s | YETO_SESSION_TIMEOUT | none (forever) | wait for the run's streams and session record |
| push_timeout_s | YETO_PUSH_TIMEOUT | 120 | one push (all chunks acked) or one INIT fragment |
| fetch_timeout_s | YETO_FETCH_TIMEOUT | 60 | one fetch batch |
| progress | YETO_PROGRESS | on | tqdm bars (INIT, initial cut) on the sync rank |
| anchor_dir | YETO_ANCHOR_DIR | none (memory) | each rank keeps its anchors, staging and q4 residuals in files under `<dir>/<island>-rank<r>/` instead of RAM |
| domain | YETO_DOMAIN | none | the island's datacenter: the JetStream domain of the leaf node it connects to; the island keeps the run's mirror of the cut there and reads BCAST / FINAL from it |
| background | YETO_BACKGROUND_SYNC | on | the island reads cuts and sends pushes on a thread of its own; the boundary only snapshots a push and installs what was read (with several ranks the worker stages on them over a gloo group of its own: learner/stager.py) (learner/background.py) |
| staging_group | YETO_STAGING_GROUP | on | with several ranks over the whole world and `background` on, a second gloo group of the same ranks on which the worker stages versions and gathers pushes while the ranks train (learner/stager.py); off: the installing boundary hands the staging to the ranks |
| hub_domain | YETO_HUB_DOMAIN | hub | the hub's JetStream domain, where pushes, control and the KV buckets live (used with YETO_DOMAIN) |

Why α = 0.5 by default: α is the weight the island keeps on its own value. α = 0 would throw away
every inner step taken since the island's push for that round (the broadcast was computed without
them); α = 1 would never move towards the global model. Half and half keeps the recent local
progress while pulling each replica to the consensus every H/P steps, the usual streaming-DiLoCo
mixing choice; tune it per run.
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
