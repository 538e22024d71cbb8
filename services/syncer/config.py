"""The round machine's configuration (`SyncerConfig`, checked at construction: a bad flag is a one-line
error at start-up) and the constants its rules use."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from yeto.schemas import outer_mode as OM
from yeto.schemas import shards as SH
from yeto.schemas.codec import load_schema
from yeto.schemas.dtypes import BULK_DTYPES, PUSH_DTYPES
from yeto.schemas.errors import ConfigError

_CHUNK_BYTES_RANGE = tuple(load_schema("session")["properties"]["chunk_bytes"][k] for k in ("minimum", "maximum"))

FIRST_ATTEMPT = 1
EMA_ALPHA = 0.3
UNKNOWN_MEMBER = "unknown_member"   # SendError code: the island must send hello again (non-fatal)
DISPOSITIONS = ("accepted", "duplicate", "unexpected_member", "future_base", "stale_base", "out_of_round", "invalid",
                "quarantined")
# Refusals of a slot's own push: the island saw its push acknowledged and will not answer this attempt again.
HOPELESS_DISPOSITIONS = ("future_base", "stale_base", "invalid", "quarantined")
# The outlier rule needs this many accepted pushes in a round: with two, neither is a reference.
OUTLIER_MIN_PUSHES = 3
# The norm bound (`push_norm_factor`, on by default): each island's last NORM_HISTORY merged push norms
# per fragment make its reference value, and it judges only with values from NORM_MIN_ISLANDS islands
# or more (one island alone is no reference for itself: a single-island run is never judged).
NORM_HISTORY = 8
NORM_MIN_ISLANDS = 2
# Probation: for NORM_PROBATION_STEPS global steps after the norm bound quarantined an island's push, that
# island's pushes are judged against NORM_PROBATION_SHARE x the factor (at least 1). Without it a steady 5x
# pusher got in whenever its true delta was under 0.8 x the others' (7 of 24 rounds in a loaded CI run),
# and each 5x merge enlarged the next honest deltas, hence the reference: the eval loss ran 15x a clean run's.
NORM_PROBATION_STEPS = 16
NORM_PROBATION_SHARE = 0.5
# Restart this soon once quorum is out of reach (capped by the quorum timeout).
HOPELESS_RESTART_S = 2.0


@dataclass(frozen=True)
class SyncerConfig:
    run: str
    islands: int                      # N: live members needed before version 0
    fragments: int                    # P
    sync_every: int                   # H: inner steps between two syncs of one fragment, multiple of P
    total_steps: int                  # global rounds to commit before finalization
    pipeline: int = 1                 # rounds in flight at most (never two on one fragment)
    quorum: int | None = None         # K; None = every expected member
    quorum_timeout_s: float = 900.0   # a round below quorum this long after launch restarts
    grace_ms: float = 10_000.0        # cap of the adaptive grace window
    grace_gamma: float = 1.0          # γ
    grace_tau: int | None = None      # τ, inner steps a push may lag; None = H/P
    strict: bool = False              # lockstep test mode
    max_base_lag: int = 1             # a push whose base is older than current - lag is stale
    equal_weights: bool = False
    push_dtype: str = "f32"
    bulk_dtype: str = "f32"
    chunk_bytes: int = 1 << 20
    init_island: str | None = None    # None = the first admitted hello's island
    member_timeout_s: float = 30.0
    final_timeout_s: float = 600.0
    launch_lead_steps: int = 1
    max_push_norm: float | None = None     # quarantine a push whose L2 norm exceeds this; None = off
    outlier_factor: float | None = None    # quarantine a push above this x the round's median norm; None = off
    max_token_factor: float | None = 4.0   # cap a c_tokens claim (tokens per step and steps, pushes.py); None = off
    push_norm_factor: float | None = 4.0   # quarantine a push above this x the members' reference norm; None = off
    shard: int = 0                    # this process's shard K (schemas/shards.py): it owns fragments f mod N == K
    shards: int = 1                   # N; 1 = one syncer owns everything (and every name is the unsharded one)
    # The syncer's release ("yeto-nats X.Y.Z", schemas/versions.py), stated in the session it pins; a
    # config field, not read by the shell at pin time, so a replay pins the same session. None = not stated.
    software: str | None = None
    # `--outer sparseloco`: the session's `outer` object (schemas/outer_mode.py, checked here), pinned with
    # the session; None = the dense DiLoCo outer step. A dict, so the start record and replay carry it as is.
    outer: dict | None = None

    def __post_init__(self) -> None:
        def bad(flag: str, why: str, value: Any) -> None:
            raise ConfigError(f"{flag} {why}", field=flag, value=value)

        for name in ("islands", "fragments", "sync_every", "total_steps", "pipeline", "chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad("--" + name.replace("_", "-"), "must be an integer >= 1", value)
        # The session record's schema bounds the chunk size: checked here so a bad flag is a one-line
        # error at start-up, not a schema error when the first hello arrives.
        lo, hi = _CHUNK_BYTES_RANGE
        if not lo <= self.chunk_bytes <= hi:
            bad("--chunk-bytes", f"must be between {lo} and {hi} (the session schema's bounds)", self.chunk_bytes)
        if self.sync_every % self.fragments:
            bad("--sync-every", f"(H) must be a multiple of --fragments (P = {self.fragments})", self.sync_every)
        if self.quorum is not None and (not isinstance(self.quorum, int) or self.quorum < 1):
            bad("--quorum", "must be an integer >= 1 (or unset for all)", self.quorum)
        for name in ("quorum_timeout_s", "member_timeout_s", "final_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                bad("--" + name.replace("_", "-"), "must be a number > 0", value)
        for name in ("grace_ms", "grace_gamma"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                bad("--" + name.replace("_", "-"), "must be a number >= 0", value)
        for name in ("grace_tau", "max_base_lag", "launch_lead_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                bad("--" + name.replace("_", "-"), "must be an integer >= 0", value)
        # Defence in depth: None = off. A factor of 1 would quarantine half of every round as outliers.
        for name, low, low_ok, off in (("max_push_norm", 0.0, False, "unset"), ("outlier_factor", 1.0, False, "unset"),
                                       ("max_token_factor", 1.0, True, "0"), ("push_norm_factor", 1.0, False, "0 or off")):
            value = getattr(self, name)
            if value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not (number and (value > low or (low_ok and value == low))):
                bad("--" + name.replace("_", "-"), f"must be a number {'>=' if low_ok else '>'} {low:g} ({off} for off)",
                    value)
        SH.check(self.shard, self.shards, self.fragments)
        if self.push_dtype not in PUSH_DTYPES:
            bad("--push-dtype", f"must be one of {PUSH_DTYPES}", self.push_dtype)
        if self.bulk_dtype not in BULK_DTYPES:
            bad("--bulk-dtype", f"must be one of {BULK_DTYPES}", self.bulk_dtype)
        try:
            OM.parse_pin(self.outer)
        except ValueError as exc:
            bad("--outer", f"settings refused: {exc}", self.outer)

    @property
    def sparse(self) -> "OM.SparseOuter | None":
        """The sparse mode's settings, or None for the dense outer step."""
        return OM.parse_pin(self.outer)

    @property
    def steps_per_round(self) -> int:
        """H/P: inner steps between two consecutive rounds (of different fragments)."""
        return self.sync_every // self.fragments

    @property
    def tau(self) -> int:
        return self.steps_per_round if self.grace_tau is None else self.grace_tau

    def fragment_of(self, step: int) -> int:
        """Round t (1-based) targets fragment (t-1) mod P."""
        return (step - 1) % self.fragments

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    @property
    def coordinator(self) -> bool:
        """Shard 0 owns what is global (admission, liveness, members KV, manifests): schemas/shards.py."""
        return self.shard == SH.COORDINATOR

    @property
    def own_fragments(self) -> tuple[int, ...]:
        return SH.own_fragments(self.fragments, self.shard, self.shards)

    def owns(self, fragment: int) -> bool:
        return SH.owns(fragment, self.shard, self.shards)

    def owns_step(self, step: int) -> bool:
        return SH.owns_step(step, self.fragments, self.shard, self.shards)

    def next_own_step(self, after: int) -> int:
        """The first step > `after` whose round this shard runs (rounds cycle through the fragments,
        so one comes within P steps)."""
        t = after + 1
        while not self.owns_step(t):
            t += 1
        return t

