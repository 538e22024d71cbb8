"""Syncer shards: which shard owns which fragment and round, and the names that are per shard.

Pure (no I/O). Shard K of N owns fragment f when f mod N == K, so round t (fragment (t-1) mod P)
belongs to shard ((t-1) mod P) mod N. Shard 0 is the **coordinator**: it alone owns what is global
(session pinning and admission, the members KV, heartbeats and liveness, the pacing estimates in the
members records, the manifest, acks and shutdown). With one shard (the default) every name is the
one an unsharded syncer always used, so a run started before shards existed resumes unchanged.
"""
from __future__ import annotations

from yeto.schemas.errors import ConfigError

COORDINATOR = 0


def check(shard: object, shards: object, fragments: int | None = None) -> None:
    """Raise ConfigError naming the flag when --shard/--shards cannot work (with --fragments P)."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ConfigError("--shards must be an integer >= 1", field="--shards", value=shards)
    if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < shards:
        raise ConfigError(f"--shard must be an integer in 0..{shards - 1} (--shards {shards})", field="--shard",
                          value=shard)
    if fragments is not None and shards > fragments:
        raise ConfigError(f"--shards {shards} exceeds --fragments {fragments}: a shard would own no fragment",
                          field="--shards", value=shards)


def shard_of(fragment: int, shards: int) -> int:
    return fragment % shards


def owns(fragment: int, shard: int, shards: int) -> bool:
    return fragment % shards == shard


def own_fragments(fragments: int, shard: int, shards: int) -> tuple[int, ...]:
    return tuple(f for f in range(fragments) if f % shards == shard)


def owns_step(step: int, fragments: int, shard: int, shards: int) -> bool:
    """Round t (1-based) targets fragment (t-1) mod P."""
    return ((step - 1) % fragments) % shards == shard


def state_key(name: str, shard: int, shards: int) -> str:
    """A per-shard key of the `state` KV (`syncer`, `commit`, `pulls`): the plain name with one shard,
    `<name>.<K>` with several."""
    return name if shards == 1 else f"{name}.{shard}"


def final_key(shard: int) -> str:
    """State KV key where shard K records its published f32 final cut (several shards only):
    {"shard", "final_step", "versions" {f: v}, "version_digests" {f: sha256 hex}}."""
    return f"final.{shard}"


def consumer(base: str, shard: int, shards: int) -> str:
    """A shard's durable consumer name: the unsharded name with one shard, `<base>-s<K>` with several."""
    return base if shards == 1 else f"{base}-s{shard}"


def label(shard: int, shards: int) -> str:
    """How logs and the tape name a shard ("" when unsharded)."""
    return "" if shards == 1 else f"shard {shard}/{shards}"
