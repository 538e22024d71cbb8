"""What `yeto run set` may change in a running run, and the checks both sides apply (pure).

The operator sends a `settings` request (schemas/json/settings.schema.json) on `yeto.R.ctl.set`, a core
NATS request answered by every syncer shard that owns the run; each shard answers `settings_result`.
Only these keys change between rounds; everything the islands were pinned to (fragments, H, dtypes of
the session) stays as pinned. A key names the `yeto syncer` flag it overrides (dashes or underscores).

- machine keys override the round machine's SyncerConfig field of the same name: rounds launched (or
  restarted) after the change use them, a round in flight keeps its deadline;
- outer keys (`outer_lr`, `outer_momentum`) ride on each Merge the machine decides after the change.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from yeto.schemas.dtypes import PUSH_DTYPES
from yeto.schemas.errors import ConfigError

# key -> (kind, what it accepts); "factor" also takes off/none (the check is off), "count" also all/none
MACHINE_KEYS: dict[str, str] = {
    "quorum": "count",                 # K, the minimum members a round needs; all = every expected member
    "quorum_timeout_s": "seconds",
    "member_timeout_s": "seconds",
    "grace_ms": "nonneg",
    "max_token_factor": "factor1",     # >= 1, or off
    "push_norm_factor": "factor",      # > 1, or off
    "outlier_factor": "factor",        # > 1, or off
    "push_dtype": "dtype",             # the pushes of rounds launched afterwards (their pulls say it)
}
OUTER_KEYS: dict[str, str] = {
    "outer_lr": "positive",
    "outer_momentum": "unit",          # 0 <= momentum < 1
}
KEYS: tuple[str, ...] = tuple(sorted({**MACHINE_KEYS, **OUTER_KEYS}))
_OFF = ("off", "none", "null")


def normalize_key(key: str) -> str:
    k = key.strip().lstrip("-").replace("-", "_").lower()
    # the flags' names: --quorum-timeout, --member-timeout (the config fields end in _s)
    if k in ("quorum_timeout", "member_timeout"):
        k += "_s"
    if k not in KEYS:
        raise ConfigError(f"setting {key!r} cannot change at runtime; one of {', '.join(KEYS)}", field="key", value=key)
    return k


def _bad(key: str, why: str, value: Any) -> ConfigError:
    return ConfigError(f"{key} {why}", field=key, value=value)


def check_value(key: str, value: Any) -> Any:
    """`value` for `key` as the syncer uses it (None = off / all), or ConfigError naming key and value."""
    kind = {**MACHINE_KEYS, **OUTER_KEYS}[key]
    if kind == "dtype":
        if value not in PUSH_DTYPES:
            raise _bad(key, f"must be one of {', '.join(PUSH_DTYPES)}", value)
        return value
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF + ("all",)):
        if kind == "count" or kind.startswith("factor"):
            return None
        raise _bad(key, "must be a number, not off", value)
    if isinstance(value, str):
        try:
            value = float(value) if kind != "count" else int(value)
        except ValueError:
            raise _bad(key, "must be a number" + (" or off" if kind.startswith("factor") else ""), value) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(key, "must be a finite number", value)
    if kind == "count":
        if value != int(value) or value < 1:
            raise _bad(key, "must be an integer >= 1 (or all)", value)
        return int(value)
    value = float(value)
    ok = {"seconds": value > 0, "positive": value > 0, "nonneg": value >= 0, "unit": 0 <= value < 1,
          "factor": value > 1, "factor1": value >= 1}[kind]
    if not ok:
        why = {"seconds": "must be > 0 seconds", "positive": "must be > 0", "nonneg": "must be >= 0",
               "unit": "must be in [0, 1)", "factor": "must be > 1 (or off)", "factor1": "must be >= 1 (or off)"}[kind]
        raise _bad(key, why, value)
    return value


def check_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Every key known and every value in range: {key: value} normalized (sorted keys)."""
    if not isinstance(settings, Mapping) or not settings:
        raise ConfigError("set: give at least one key=value", field="set", value=settings)
    out: dict[str, Any] = {}
    for key in sorted(settings):
        k = normalize_key(str(key))
        out[k] = check_value(k, settings[key])
    return out


def parse_assignments(items: Iterable[str]) -> dict[str, Any]:
    """`key=value` words from the command line -> checked settings (ConfigError naming the word)."""
    raw: dict[str, str] = {}
    for word in items:
        key, eq, value = word.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ConfigError(f"{word!r} is not key=value", field="setting", value=word)
        raw[normalize_key(key)] = value.strip()
    return check_settings(raw)


def split(settings: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(machine keys, outer keys) of checked settings."""
    return ({k: v for k, v in settings.items() if k in MACHINE_KEYS},
            {k: v for k, v in settings.items() if k in OUTER_KEYS})
