"""docs/design.md §7: an environment variable that does not parse is the user's mistake, reported as such.

Before, `yeto syncer`'s flag defaults were converted while the parsers were built, so `YETO_FRAGMENTS=four`
in a launch script broke every `yeto` command (even `yeto export --help`) with a ValueError traceback.
Now the value is kept aside and `yeto syncer` alone refuses it: exit 2, naming the variable and the value.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from yeto.services.cli import build_parser
from yeto.services.cmd_syncer import bad_env_values


def _yeto(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


@pytest.mark.e2e
def test_a_bad_syncer_variable_breaks_no_other_command():
    proc = _yeto("export", "--help", YETO_FRAGMENTS="four")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_yeto_syncer_refuses_a_variable_that_does_not_parse_naming_it_and_its_value():
    # the broker address is a closed port: the refusal must come before any connection attempt
    proc = _yeto("syncer", "--run", "r", "--nats", "nats://127.0.0.1:9", YETO_FRAGMENTS="four", YETO_ISLANDS="2.5")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "YETO_FRAGMENTS='four' in the environment" in proc.stderr, proc.stderr
    assert "YETO_ISLANDS='2.5' in the environment" in proc.stderr, proc.stderr


def test_a_good_variable_is_the_default_and_a_flag_given_overrides_a_bad_one(monkeypatch):
    monkeypatch.setenv("YETO_FRAGMENTS", "3")
    args = build_parser().parse_args(["syncer", "--run", "r"])
    assert args.fragments == 3 and bad_env_values(args) == []
    monkeypatch.setenv("YETO_FRAGMENTS", "four")
    args = build_parser().parse_args(["syncer", "--run", "r"])
    assert [line.split(" in the environment")[0] for line in bad_env_values(args)] == ["YETO_FRAGMENTS='four'"]
    args = build_parser().parse_args(["syncer", "--run", "r", "--fragments", "2"])
    assert args.fragments == 2 and bad_env_values(args) == []


@pytest.mark.e2e
def test_the_dtype_variables_the_islands_share_take_auto_and_name_themselves_when_bad(monkeypatch):
    # docs/island.md's table gives YETO_PUSH_DTYPE=auto as the default; one environment for both sides works
    monkeypatch.setenv("YETO_PUSH_DTYPE", "auto")
    monkeypatch.setenv("YETO_BULK_DTYPE", "auto")
    args = build_parser().parse_args(["syncer", "--run", "r"])
    assert (args.push_dtype, args.bulk_dtype) == ("f32", "f32") and bad_env_values(args) == []
    monkeypatch.setenv("YETO_PUSH_DTYPE", "bf16")
    assert build_parser().parse_args(["syncer", "--run", "r"]).push_dtype == "bf16"
    proc = _yeto("syncer", "--run", "r", "--nats", "nats://127.0.0.1:9", YETO_PUSH_DTYPE="fp8")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "YETO_PUSH_DTYPE='fp8' in the environment: must be one of f32, bf16, q4" in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_every_commands_variables_are_reported_by_that_command_alone():
    # YETO_BROKER_PORT was int()-ed while the parsers were built: every command died on it
    proc = _yeto("export", "--help", YETO_BROKER_PORT="abc", YETO_DASHBOARD_PORT="x")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _yeto("broker", "--store-dir", "/nonexistent/never-made", YETO_BROKER_PORT="abc")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("yeto broker: YETO_BROKER_PORT='abc' in the environment"), proc.stderr
    proc = _yeto("dashboard", "--run", "r", YETO_DASHBOARD_PORT="x")
    assert proc.returncode == 2 and "yeto dashboard: YETO_DASHBOARD_PORT='x' in the environment" in proc.stderr, \
        proc.stderr
    # the flag given wins over its broken variable
    proc = _yeto("broker", "--port", "4222", "--cluster", "-1", YETO_BROKER_PORT="abc")
    assert proc.returncode == 2 and "--cluster must be 0" in proc.stderr, proc.stderr


def test_push_memory_is_auto_by_default_a_number_when_given_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.delenv("YETO_PUSH_MEMORY_MIB", raising=False)
    args = build_parser().parse_args(["syncer", "--run", "r"])
    assert args.push_memory_mib is None                               # auto: sized by the fragments owned
    assert build_parser().parse_args(["syncer", "--run", "r", "--push-memory-mib", "0"]).push_memory_mib == 0.0
    assert build_parser().parse_args(["syncer", "--run", "r", "--push-memory-mib", "AUTO"]).push_memory_mib is None
    monkeypatch.setenv("YETO_PUSH_MEMORY_MIB", "512")
    assert build_parser().parse_args(["syncer", "--run", "r"]).push_memory_mib == 512.0
    monkeypatch.setenv("YETO_PUSH_MEMORY_MIB", "-3")
    bad = bad_env_values(build_parser().parse_args(["syncer", "--run", "r"]))
    assert len(bad) == 1 and "YETO_PUSH_MEMORY_MIB='-3'" in bad[0] and "or auto" in bad[0], bad
