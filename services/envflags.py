"""Flag defaults from `YETO_*` environment variables, for every `yeto` command.

A variable that does not parse is kept aside as a `BadEnv` (never raised while the parsers are built, so
no other command, and no `--help`, breaks on it); `services.cli.main` reports it before the command runs,
naming the variable and the value (exit 2), unless the flag was given on the command line.
"""
from __future__ import annotations

import argparse
import os


class BadEnv:
    """A flag's default taken from a variable whose value does not parse."""

    def __init__(self, env: str, raw: str, why: str):
        self.env, self.raw, self.why = env, raw, why

    def __repr__(self) -> str:
        return f"{self.raw!r} (from {self.env}, which does not parse: {self.why})"

    def message(self) -> str:
        return f"{self.env}={self.raw!r} in the environment: {self.why}"


def env_value(env: str, type_, default):
    """`type_(os.environ[env])`, `type_(default)` when unset (None stays None), or a BadEnv."""
    raw = os.environ.get(env)
    if raw is None:
        return type_(default) if default is not None else None
    try:
        return type_(raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        return BadEnv(env, raw, str(exc) or f"not a valid {getattr(type_, '__name__', 'value')}")


def bad_env_values(args) -> list[str]:
    """One line per variable that did not parse (and whose flag was not given)."""
    return [v.message() for v in vars(args).values() if isinstance(v, BadEnv)]
