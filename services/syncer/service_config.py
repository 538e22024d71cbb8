"""The syncer shell's configuration (`yeto syncer`'s flags, services/cmd_syncer.py): what the I/O shell
(services/syncer/service.py) runs with beside the round machine's own `SyncerConfig`."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from yeto.schemas.conn import ConnectOptions
from yeto.schemas.provision import RunLimits
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.lease import DEFAULT_TTL_S


@dataclass
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9


@dataclass
class ServiceConfig:
    machine: SyncerConfig
    outer: OuterConfig
    connect: ConnectOptions
    checkpoint_dir: Path
    resume: bool = False
    limits: RunLimits = field(default_factory=RunLimits)
    # A Tick at the machine's next_wakeup() and at least this often (a safety net: every Tick is taped)
    tick_s: float = 1.0
    status_every_s: float = 5.0
    # `--lease-ttl`: a standby takes over once the owner's lease did not move for this long (lease.py)
    lease_ttl_s: float = DEFAULT_TTL_S
    # `--state-store`: "jetstream" = the checkpoint and the run's state KV (state_store.py); "local": the checkpoint only
    state_store: str = "jetstream"
    # `--broadcast` (merge.BROADCAST_MODES) and `--checkpoint-writer` (merge.CKPT_WRITERS)
    broadcast: str = "cut-through"
    ckpt_writer: str = "inline"
    # `--push-memory-mib`: push bytes held from intake to the merge (intake.PushLedger); None = auto (by the session)
    push_memory_bytes: int | None = None
    # `--speculate`: sum a round's outer gradient while its pushes arrive (speculate.py; off until measured faster)
    speculate: bool = False
    # `--cover-coordinator`'s standby for shard 0: takes only a lease that lapsed (never becomes the coordinator)
    standby_only: bool = False


__all__ = ["OuterConfig", "ServiceConfig"]
