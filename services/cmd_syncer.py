"""`yeto syncer`: the central syncer of a run (outer optimizer + round state machine)."""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import os
import sys
from pathlib import Path

from yeto.schemas import versions
from yeto.schemas.conn import ConnectOptions, add_connect_args
from yeto.schemas.dtypes import BULK_DTYPES, PUSH_DTYPES
from yeto.services.envflags import BadEnv, bad_env_values, env_value  # noqa: F401  (bad_env_values: tests)


def _env(name: str, default):
    return os.environ.get(name, default)


def _flag(parser, name: str, env: str, type_, default, help_: str, **kw):
    value = env_value(env, type_, default)
    parser.add_argument(name, type=type_, default=value, help=f"{help_} (env {env}; default %(default)s)", **kw)


def _choice_env(env: str, choices, default: str):
    """A dtype variable the islands share with the syncer: `auto` (their default, "the session's") is the
    syncer's own default here; anything else not in `choices` is reported naming the variable."""
    raw = os.environ.get(env)
    if raw is None or raw == "" or raw == "auto":
        return default
    if raw in choices:
        return raw
    return BadEnv(env, raw, f"must be one of {', '.join(choices)} (or auto)")


def _factor_or_off(text: str) -> float:
    """A factor flag's value: a number, or "off" (= 0, off); the range is SyncerConfig's to check."""
    if str(text).strip().lower() == "off":
        return 0.0
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 1, or 0 or off for off, got {text!r}") from None


def _mib_or_auto(text) -> float | None:
    """--push-memory-mib's value: MiB (a number >= 0), or "auto" (None: sized by the fragments owned)."""
    if text is None or str(text).strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of MiB >= 0 or auto, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of MiB >= 0 or auto, got {text!r}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser(
        "syncer", help="run the syncer of a run",
        description="The central syncer: owns the global model split into fragments, runs streaming-DiLoCo rounds "
                    "(pull, quorum, merge, f32 Nesterov outer step, durable commit, broadcast) and finalization.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_connect_args(p)
    g = p.add_argument_group("run shape")
    _flag(g, "--islands", "YETO_ISLANDS", int, 2, "islands admitted before version 0 is committed")
    _flag(g, "--fragments", "YETO_FRAGMENTS", int, 1, "fragments P the model is split into (one round each, round-robin)")
    _flag(g, "--sync-every", "YETO_SYNC_EVERY", int, 8, "H: inner steps between two syncs of one fragment (a multiple of P); round t is due at local step t*H/P")
    _flag(g, "--total-steps", "YETO_TOTAL_STEPS", int, 10, "global rounds to commit before finalization")
    _flag(g, "--init-island", "YETO_INIT_ISLAND", str, None, "island whose weights initialize the run (default: the first admitted)")
    g = p.add_argument_group("shards (one run's model spread over several syncer processes by fragment)")
    _flag(g, "--shard", "YETO_SHARD", int, 0,
          "this process's shard K: it owns fragments f with f mod N == K (their rounds, params, momentum, "
          "checkpoint); shard 0 also owns admission, liveness, the members KV, manifests and shutdown")
    _flag(g, "--shards", "YETO_SHARDS", int, 1, "syncer shards N of the run (1..--fragments); every shard needs the same "
          "run flags")
    g = p.add_argument_group("rounds")
    _flag(g, "--pipeline", "YETO_PIPELINE", int, 1, "rounds in flight at most, per shard (never two on one fragment)")
    _flag(g, "--quorum", "YETO_QUORUM", int, None, "pushes needed to merge a round (default: every expected member)")
    _flag(g, "--quorum-timeout", "YETO_QUORUM_TIMEOUT", float, 900.0, "seconds a round may stay below quorum before it restarts with attempt+1")
    _flag(g, "--grace-ms", "YETO_GRACE_MS", float, 10000.0, "cap of the adaptive grace window after quorum (ms)")
    _flag(g, "--grace-gamma", "YETO_GRACE_GAMMA", float, 1.0, "gamma of the adaptive grace window")
    _flag(g, "--max-base-lag", "YETO_MAX_BASE_LAG", int, 1, "versions a push's base may lag the current one before it is stale")
    _flag(g, "--member-timeout", "YETO_MEMBER_TIMEOUT", float, 30.0, "seconds without a heartbeat before an island counts as gone")
    _flag(g, "--final-timeout", "YETO_FINAL_TIMEOUT", float, 600.0, "seconds to wait for final acks")
    g.add_argument("--strict", action="store_true", default=_env("YETO_STRICT", "0") == "1",
                   help="fixed-roster lockstep mode: a round waits for every member, no attempt bumps (env YETO_STRICT=1)")
    g.add_argument("--equal-weights", action="store_true", default=_env("YETO_EQUAL_WEIGHTS", "0") == "1",
                   help="weight every push 1 instead of its token count (env YETO_EQUAL_WEIGHTS=1)")
    g = p.add_argument_group("defence in depth (a compromised or buggy island)")
    _flag(g, "--max-push-norm", "YETO_MAX_PUSH_NORM", float, None,
          "quarantine a push whose L2 norm exceeds this (off when unset; pushes holding NaN/Inf are always quarantined)")
    _flag(g, "--outlier-factor", "YETO_OUTLIER_FACTOR", float, None,
          "quarantine a push whose norm exceeds this many times the round's median push norm (> 1; needs 3 or "
          "more pushes in the round; off when unset)")
    _flag(g, "--max-token-factor", "YETO_MAX_TOKEN_FACTOR", float, 4.0,
          "cap each push's claimed c_tokens at F x the round's lower median tokens per step (c_tokens / c_steps) "
          "x its c_steps, those steps at most F x the round's lower median c_steps, F being this factor, "
          "fractions honoured exactly (>= 1; 0 = off)")
    # Not _flag: argparse converts a string default with `type`, so a bad YETO_PUSH_NORM_FACTOR is refused
    # like a bad flag (naming --push-norm-factor and the value), not with a traceback.
    g.add_argument("--push-norm-factor", type=_factor_or_off, default=_env("YETO_PUSH_NORM_FACTOR", "4"),
                   help="quarantine a push whose L2 norm exceeds this many times the reference norm of its fragment: "
                        "the lower median over the round's members of each one's recent merged push norms (its "
                        "last 8, and this push); on by default, needs no tuning and judges from two islands on; a "
                        "quarantined member is excused from the round's quorum (> 1; 0 or off = off) "
                        "(env YETO_PUSH_NORM_FACTOR; default %(default)s)")
    g = p.add_argument_group("outer optimizer")
    _flag(g, "--outer-lr", "YETO_OUTER_LR", float, 0.7, "outer learning rate")
    _flag(g, "--outer-momentum", "YETO_OUTER_MOMENTUM", float, 0.9, "outer Nesterov momentum (diloco only)")
    g.add_argument("--outer", default=_env("YETO_OUTER", "diloco"), metavar="{diloco,sparseloco}",
                   help="outer mode, pinned in the session so islands follow it: diloco (dense pushes, Nesterov "
                        "outer step) or sparseloco (islands push Q(TopK(error feedback)) messages; the syncer takes "
                        "the clipped per-coordinate mean times --outer-lr, no momentum; docs/design.md §4.10) "
                        "(env YETO_OUTER; default %(default)s)")
    _flag(g, "--sparse-tile", "YETO_SPARSE_TILE", int, 64, "sparseloco: side of a 2-D tile (tile*tile <= 4096)")
    _flag(g, "--sparse-k", "YETO_SPARSE_K", int, 64, "sparseloco: values kept per full 2-D tile")
    _flag(g, "--sparse-chunk-1d", "YETO_SPARSE_CHUNK_1D", int, 64, "sparseloco: values per chunk of a 1-D tensor")
    _flag(g, "--sparse-k-1d", "YETO_SPARSE_K_1D", int, 64, "sparseloco: values kept per full 1-D chunk")
    _flag(g, "--sparse-value-bits", "YETO_SPARSE_VALUE_BITS", int, 2, "sparseloco: bits per kept value (1, 2, 4, 8)")
    _flag(g, "--sparse-beta", "YETO_SPARSE_BETA", float, 0.95, "sparseloco: the islands' error-feedback decay in [0, 1]")
    _flag(g, "--sparse-full-every", "YETO_SPARSE_FULL_EVERY", int, 16,
          "sparseloco: a full cut on BCAST every N versions, pinned with the session (1..4096)")
    g = p.add_argument_group("wire")
    g.add_argument("--push-dtype", choices=PUSH_DTYPES, default=_choice_env("YETO_PUSH_DTYPE", PUSH_DTYPES, "f32"),
                   help="dtype of pushes (env YETO_PUSH_DTYPE, where `auto`, the islands' default, means this "
                        "default; default %(default)s)")
    g.add_argument("--bulk-dtype", choices=BULK_DTYPES, default=_choice_env("YETO_BULK_DTYPE", BULK_DTYPES, "f32"),
                   help="dtype of INIT and broadcasts (env YETO_BULK_DTYPE, `auto` as for --push-dtype; "
                        "default %(default)s)")
    _flag(g, "--chunk-bytes", "YETO_CHUNK_BYTES", int, 1 << 20, "chunk size in bytes (bounded by the server's max_payload minus header room)")
    g.add_argument("--broadcast", choices=("cut-through", "with-commit", "after-commit"),
                   default=_env("YETO_BROADCAST", "cut-through"),
                   help="when a new version's chunks go to BCAST: cut-through (each as soon as it is merged), "
                        "with-commit (after the merge, while the version is made durable), "
                        "after-commit (all after the durable commit). In the first two the last chunk (the seal, "
                        "with the version digest) goes out once the version is durable, so islands never install what "
                        "is not committed (env YETO_BROADCAST; default %(default)s)")
    p.add_argument("--speculate", choices=("on", "off"), default=_env("YETO_SPECULATE", "off"),
                   help="sum each round's outer gradient chunk by chunk while its pushes arrive, for the members and "
                        "weights the round will most likely merge; the merge adopts the sums only when its Merge is "
                        "exactly that one (else merges from the pushes as with off). The same bytes either way; "
                        "off by default until it measures faster (bench/README.md) (env YETO_SPECULATE; default "
                        "%(default)s)")
    g = p.add_argument_group("state")
    g.add_argument("--checkpoint-dir", default=_env("YETO_CHECKPOINT_DIR", None),
                   help="directory of the params+momentum checkpoint, one per shard (env YETO_CHECKPOINT_DIR; default "
                        "./yeto-data/<run>/syncer, ./yeto-data/<run>/syncer-s<K> with --shards > 1)")
    g.add_argument("--checkpoint-writer", choices=("inline", "thread", "whole"),
                   default=_env("YETO_CHECKPOINT_WRITER", "inline"),
                   help="how a merge writes the new version's checkpoint files: inline (each chunk into the page "
                        "cache right after its outer step; the commit fsyncs once), thread (the same on a writer "
                        "thread beside the merge: for hosts with idle cores), whole (all at the commit) "
                        "(env YETO_CHECKPOINT_WRITER; default %(default)s)")
    g.add_argument("--push-memory-mib", type=_mib_or_auto, default=env_value("YETO_PUSH_MEMORY_MIB", _mib_or_auto, "auto"),
                   help="MiB of pushes kept in memory from their arrival to their merge (first come, first kept); the merge "
                        "reads the rest back from the PUSH stream, one direct get per chunk. 0 reads every chunk back. auto: "
                        "half the f32 bytes of the fragments this syncer owns (with --shards N, its own share), at "
                        "least 64 and at most 1024 MiB (env YETO_PUSH_MEMORY_MIB; default auto)")
    g.add_argument("--resume", action="store_true", default=_env("YETO_RESUME", "0") == "1",
                   help="continue from the checkpoint directory and the durable consumers (env YETO_RESUME=1). "
                        "A run killed mid-round continues with the round in flight (a new attempt; a merge whose chunks "
                        "had begun to go out is done again from the same pushes: the same bytes); one killed during "
                        "finalization sends the manifest again to the islands that have not acked and waits for them; "
                        "a finished run (every ack in, or --final-timeout passed) exits 0 at once and changes nothing "
                        "(its final cut stays in FINAL; `yeto export` writes it)")
    g.add_argument("--small-limits", action="store_true", default=_env("YETO_SMALL_LIMITS", "0") == "1",
                   help="provision the run with small stream byte limits (tests, demos)")
    _flag(g, "--replicas", "YETO_REPLICAS", int, 1,
          "replicas of every stream and KV bucket of the run (3 on a 3-node NATS cluster); a run provisioned "
          "with other replicas is refused, never changed")
    _flag(g, "--lease-ttl", "YETO_SYNCER_LEASE_TTL", float, 10.0,
          "seconds: one syncer owns a run (per shard) through a lease in its state KV, refreshed every third of "
          "this; a second `yeto syncer` for the run stands by and takes over once the owner's lease has not "
          "moved for this long (it was killed, paused or cut off; a paused owner that wakes publishes nothing "
          "more and exits 4)")
    g.add_argument("--cover-coordinator", action="store_true",
                   default=_env("YETO_SYNCER_COVER_COORDINATOR", "0") == "1",
                   help="sharded, shard K > 0: also stand by for the coordinator (shard 0) in this process, with a "
                        "warm copy of its committed state, and take its role and fragments over if its owner dies "
                        "and no other standby is first (this host then holds both shards' params and momentum; "
                        "needs --state-store jetstream) (env YETO_SYNCER_COVER_COORDINATOR=1)")
    g.add_argument("--state-store", default=_env("YETO_STATE_STORE", "jetstream"),
                   help="where the committed params, momentum and merge intents are kept besides --checkpoint-dir: "
                        "jetstream (the run's state KV, with its --replicas: a standby or a rescheduled syncer on "
                        "another host continues the run from it) or local (the checkpoint directory only) "
                        "(env YETO_STATE_STORE; default %(default)s)")
    _flag(g, "--status-every", "YETO_STATUS_EVERY", float, 5.0,
          "seconds between status lines and updates of the state KV key `syncer` (phase, versions, counters)")
    g.add_argument("--log-level", default=_env("YETO_LOG_LEVEL", "INFO"))
    p.set_defaults(func=run)


def coordinator_cover(cfg, ckpt: Path, args):
    """The ServiceConfig of the coordinator's standby that `--cover-coordinator` runs beside this shard:
    the same run flags as shard 0 (whose lease checks them), a checkpoint directory of its own next to this
    shard's, its own connection name."""
    import dataclasses

    mc0 = dataclasses.replace(cfg.machine, shard=0)
    return dataclasses.replace(cfg, machine=mc0, checkpoint_dir=ckpt.parent / f"{ckpt.name}-cover-s0",
                               connect=ConnectOptions.from_args(args, name=f"yeto-syncer-{args.run}-s0-cover"),
                               standby_only=True)


async def _with_cover(own, cover_cfg) -> int:
    """This shard's syncer and, beside it, a standby for shard 0 (the coordinator). Each logs under its own
    shard's label; the cover's failure never stops this shard's syncer. Exit: this shard's code, else the
    cover's (a takeover that could not finish the run)."""
    from yeto.schemas.provision import ProvisionError
    from yeto.services.syncer.service import SyncerService
    from yeto.services.syncer.errors import SyncerError

    async def covering() -> int:
        SHARD_LABEL.set(cover_cfg.machine.shard)
        try:
            return await SyncerService(cover_cfg).run()
        except (SyncerError, ProvisionError) as exc:
            logging.getLogger("yeto.syncer").error("the coordinator's cover: %s", exc)
            return 2

    SHARD_LABEL.set(own.cfg.machine.shard)
    rc_own, rc_cover = await asyncio.gather(own.run(), asyncio.create_task(covering()))
    return rc_own or rc_cover


# The shard a log line comes from, for a process that runs two shards (--cover-coordinator): each one's
# tasks and threads inherit it (asyncio copies the context into tasks and to_thread).
SHARD_LABEL: "contextvars.ContextVar[int | None]" = contextvars.ContextVar("yeto_shard_label", default=None)


class _ShardLabel(logging.Filter):
    def __init__(self, shards: int, default: int):
        super().__init__()
        self.shards, self.default = shards, default

    def filter(self, record: logging.LogRecord) -> bool:
        from yeto.schemas import shards as SH

        k = SHARD_LABEL.get()
        record.shard_label = SH.label(self.default if k is None else k, self.shards)
        return True


def run(args) -> int:
    bad = bad_env_values(args)
    if bad:
        for line in bad:
            print(f"yeto syncer: {line}", file=sys.stderr)
        return 2
    from yeto.schemas import shards as SH
    from yeto.schemas.outer_mode import check_outer
    from yeto.schemas.provision import ProvisionError, RunLimits
    from yeto.services.syncer.config import SyncerConfig
    from yeto.services.syncer.service import SyncerService
    from yeto.services.syncer.service_config import OuterConfig, ServiceConfig
    from yeto.services.syncer.errors import SyncerError

    # Every log line of a shard names it (several shards' logs often end up side by side).
    label = SH.label(args.shard, args.shards) if isinstance(args.shard, int) and isinstance(args.shards, int) \
        and args.shards >= 1 else ""
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(name)s " + ("[%(shard_label)s] " if label else "") + "%(levelname)s %(message)s",
                        stream=sys.stderr)
    if label:
        for h in logging.getLogger().handlers:
            h.addFilter(_ShardLabel(args.shards, args.shard))
    try:
        outer = check_outer(args.outer, tile=args.sparse_tile, k=args.sparse_k, chunk_1d=args.sparse_chunk_1d,
                            k_1d=args.sparse_k_1d, value_bits=args.sparse_value_bits, beta=args.sparse_beta,
                            full_every=args.sparse_full_every)
        mc = SyncerConfig(
            run=args.run, islands=args.islands, fragments=args.fragments, sync_every=args.sync_every,
            total_steps=args.total_steps, pipeline=args.pipeline, quorum=args.quorum,
            quorum_timeout_s=args.quorum_timeout, grace_ms=args.grace_ms, grace_gamma=args.grace_gamma,
            strict=args.strict, max_base_lag=args.max_base_lag, equal_weights=args.equal_weights,
            push_dtype=args.push_dtype, bulk_dtype=args.bulk_dtype, chunk_bytes=args.chunk_bytes,
            init_island=args.init_island, member_timeout_s=args.member_timeout, final_timeout_s=args.final_timeout,
            max_push_norm=args.max_push_norm, outlier_factor=args.outlier_factor,
            max_token_factor=None if args.max_token_factor == 0 else args.max_token_factor,
            push_norm_factor=None if args.push_norm_factor == 0 else args.push_norm_factor,
            shard=args.shard, shards=args.shards, software=versions.software(), outer=outer,
        )
    except ValueError as exc:
        print(f"yeto syncer: {exc}", file=sys.stderr)
        return 2
    ckpt = Path(args.checkpoint_dir or os.path.join("yeto-data", args.run,
                                                    "syncer" if mc.shards == 1 else f"syncer-s{mc.shard}"))
    try:
        limits = RunLimits.small(replicas=args.replicas) if args.small_limits else RunLimits(replicas=args.replicas)
    except ValueError as exc:  # ConfigError names the field and the value
        print(f"yeto syncer: --replicas: {exc}", file=sys.stderr)
        return 2
    for flag, value, allowed in (("--broadcast", args.broadcast, ("cut-through", "with-commit", "after-commit")),
                                 ("--checkpoint-writer", args.checkpoint_writer, ("inline", "thread", "whole")),
                                 ("--speculate", args.speculate, ("on", "off"))):
        if value not in allowed:   # an environment default escapes argparse's choices
            print(f"yeto syncer: {flag} must be one of {', '.join(allowed)}, got {value!r}", file=sys.stderr)
            return 2
    if mc.outer is not None and args.speculate == "on":
        print("yeto syncer: --speculate on sums dense pushes; it is for --outer diloco, got --outer sparseloco",
              file=sys.stderr)
        return 2
    cfg = ServiceConfig(machine=mc, outer=OuterConfig(lr=args.outer_lr, momentum=args.outer_momentum),
                        connect=ConnectOptions.from_args(args, name=f"yeto-syncer-{args.run}"
                                                         + (f"-s{mc.shard}" if mc.sharded else "")),
                        checkpoint_dir=ckpt, resume=args.resume, limits=limits, broadcast=args.broadcast,
                        ckpt_writer=args.checkpoint_writer, speculate=args.speculate == "on")
    if not (args.status_every > 0):
        print(f"yeto syncer: --status-every must be a number > 0, got {args.status_every!r}", file=sys.stderr)
        return 2
    cfg.status_every_s = args.status_every
    if not (args.lease_ttl >= 1):
        print(f"yeto syncer: --lease-ttl must be a number of seconds >= 1, got {args.lease_ttl!r}", file=sys.stderr)
        return 2
    cfg.lease_ttl_s = args.lease_ttl
    if args.state_store not in ("jetstream", "local"):
        print(f"yeto syncer: --state-store (YETO_STATE_STORE) must be jetstream or local, got {args.state_store!r}",
              file=sys.stderr)
        return 2
    cfg.state_store = args.state_store
    cfg.push_memory_bytes = None if args.push_memory_mib is None else int(args.push_memory_mib * (1 << 20))
    cover = None
    if args.cover_coordinator:
        if not mc.sharded or mc.shard == 0:
            print("yeto syncer: --cover-coordinator is for a follower shard (--shard K > 0 of --shards N > 1), "
                  f"got --shard {mc.shard} --shards {mc.shards}", file=sys.stderr)
            return 2
        if cfg.state_store != "jetstream":
            print("yeto syncer: --cover-coordinator needs --state-store jetstream (the coordinator's committed state "
                  "is restored from it on this host)", file=sys.stderr)
            return 2
        cover = coordinator_cover(cfg, ckpt, args)
    rc = 1
    try:
        rc = asyncio.run(SyncerService(cfg).run() if cover is None else _with_cover(SyncerService(cfg), cover))
    except (SyncerError, ProvisionError) as exc:  # a conflicting run, replicas the server cannot place
        print(f"yeto syncer: {exc}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        rc = 130
    finally:
        # A short run can end while the merge loop still compiles in the background: leave without the
        # interpreter's finalization, which can abort around that thread (services/syncer/outer.py).
        from yeto.services.syncer.outer import exit_now_if_compiling

        exit_now_if_compiling(rc)
    return rc
