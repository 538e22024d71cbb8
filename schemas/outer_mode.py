"""The run's outer mode as the syncer pins it and islands read it (docs/design.md §4.10). Pure, no I/O.

Owns the optional `outer` object of the session record (schemas/json/session.schema.json): absent = the
dense DiLoCo outer step (every pin written before this field existed); present = `{"mode": "sparseloco",
tile, k, chunk_1d, k_1d, value_bits, beta[, full_every]}`, the compression spec (schemas/sparse_spec.SparseSpec),
the islands' error-feedback decay and how often BCAST carries a full cut (schemas/sparse_bcast.py). The outer lr stays the syncer's (`--outer-lr`, runtime settings).
`check_outer` turns `yeto syncer`'s flags into that object (ConfigError naming the flag and the value);
`from_session` reads it back (a pinned object that does not check is a WireError naming the field);
`pin` adds it to a session record and folds it into the session fingerprint, so a resume or a shard with
another mode is refused as another session.
Invariant: dense pins stay byte for byte as before (no key, the same fingerprint); so do sparse pins at the
default `full_every` (the key is written only when it is not the default).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError, WireError
from .sparse_spec import SparseSpec

DENSE = "diloco"
SPARSE = "sparseloco"
MODES = (DENSE, SPARSE)
SPEC_FIELDS = ("tile", "k", "chunk_1d", "k_1d", "value_bits")
# The `yeto syncer` flag of each pinned field (what an operator's error names).
FLAGS = {"tile": "--sparse-tile", "k": "--sparse-k", "chunk_1d": "--sparse-chunk-1d", "k_1d": "--sparse-k-1d",
         "value_bits": "--sparse-value-bits", "beta": "--sparse-beta", "full_every": "--sparse-full-every"}
DEFAULT_BETA = 0.95
# A full cut on BCAST every so many versions (schemas/sparse_bcast.py); the others go out as update messages.
DEFAULT_FULL_EVERY = 16
MAX_FULL_EVERY = 4096


@dataclass(frozen=True)
class SparseOuter:
    """A sparse run's pinned settings: the compression spec, the error-feedback decay β and the period of
    BCAST's full cuts (`full_every` versions)."""

    spec: SparseSpec
    beta: float
    full_every: int = DEFAULT_FULL_EVERY

    def to_pin(self) -> dict:
        pin = {"mode": SPARSE, **{f: getattr(self.spec, f) for f in SPEC_FIELDS}, "beta": self.beta}
        if self.full_every != DEFAULT_FULL_EVERY:
            pin["full_every"] = self.full_every
        return pin


def _message(exc: ConfigError) -> str:
    """The error's own words, without the "(field ..., value ...)" it appended (a new error names its own)."""
    return str(exc).rsplit(" (field ", 1)[0]


def _build(fields: Mapping[str, Any], name_of) -> SparseOuter:
    """SparseOuter from tile, k, chunk_1d, k_1d, value_bits, beta; ConfigError naming `name_of(field)`."""
    for f in SPEC_FIELDS:
        v = fields.get(f)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError("must be an integer", field=name_of(f), value=v)
    try:
        spec = SparseSpec(**{f: fields[f] for f in SPEC_FIELDS})
    except ConfigError as exc:   # SparseSpec names `sparse.<field>`: say the operator's name for it
        f = (exc.field or "sparse.tile").split(".")[-1]
        raise ConfigError(_message(exc), field=name_of(f), value=exc.value) from None
    beta = fields.get("beta")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) \
            or not 0.0 <= beta <= 1.0:
        raise ConfigError("must be a number in [0, 1]", field=name_of("beta"), value=beta)
    every = fields.get("full_every", DEFAULT_FULL_EVERY)
    if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_FULL_EVERY:
        raise ConfigError(f"must be an integer in [1, {MAX_FULL_EVERY}]", field=name_of("full_every"), value=every)
    return SparseOuter(spec, float(beta), every)


def check_outer(mode: str, *, tile: int = 64, k: int = 64, chunk_1d: int = 64, k_1d: int = 64,
                value_bits: int = 2, beta: float = DEFAULT_BETA,
                full_every: int = DEFAULT_FULL_EVERY) -> dict | None:
    """`yeto syncer --outer MODE` and its `--sparse-*` flags -> the pin's `outer` object (None: dense)."""
    if mode not in MODES:
        raise ConfigError(f"must be one of {', '.join(MODES)}", field="--outer", value=mode)
    if mode == DENSE:
        return None
    return _build(dict(tile=tile, k=k, chunk_1d=chunk_1d, k_1d=k_1d, value_bits=value_bits, beta=beta,
                       full_every=full_every),
                  FLAGS.__getitem__).to_pin()


def parse_pin(outer: Mapping | None, *, where: str = "outer") -> SparseOuter | None:
    """A pinned `outer` object -> SparseOuter (None: dense); WireError naming `where.<field>`."""
    if outer is None:
        return None
    if not isinstance(outer, Mapping) or outer.get("mode") != SPARSE:
        raise WireError(f"must name mode {SPARSE!r} (absent = dense)", field=f"{where}.mode",
                        value=outer.get("mode") if isinstance(outer, Mapping) else outer)
    try:
        return _build(outer, lambda f: f"{where}.{f}")
    except ConfigError as exc:
        raise WireError(_message(exc), field=exc.field, value=exc.value) from None


def from_session(session: Mapping) -> SparseOuter | None:
    """The run's sparse settings from its session record, or None for a dense run."""
    return parse_pin(session.get("outer"))


def has_momentum(session: Mapping) -> bool:
    """Whether the run's syncer keeps an outer momentum (and writes it durably): the dense mode only."""
    return session.get("outer") is None


def pin(session: dict, outer: Mapping | None) -> dict:
    """`session` with `outer` pinned and folded into its fingerprint; a dense run's session unchanged."""
    if outer is None:
        return session
    parse_pin(outer)
    body = json.dumps([session["session_fingerprint"], dict(outer)], sort_keys=True, separators=(",", ":"))
    return {**session, "outer": dict(outer), "session_fingerprint": hashlib.sha256(body.encode()).hexdigest()}


__all__ = ["DEFAULT_FULL_EVERY", "DENSE", "FLAGS", "MAX_FULL_EVERY", "MODES", "SPARSE", "SparseOuter", "check_outer", "from_session", "has_momentum", "parse_pin", "pin"]
