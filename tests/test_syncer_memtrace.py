"""services/syncer/memtrace.py (`YETO_MEM_TRACE`): the phase marks' line format, the level parse, and
that a mark is silent when off and one log line of this process's own RSS when on."""
from __future__ import annotations

import logging

from yeto.services.syncer import memtrace

MiB = 1 << 20


def test_a_mark_line_names_the_phase_rss_hwm_and_each_size_in_mib():
    line = memtrace.format_mark("merge step 3 begins", {"VmRSS": 700 * MiB, "VmHWM": 900 * MiB},
                                {"fragments": 512 * MiB, "pushes_held": 64 * MiB, "init_pending": 0})
    assert line == ("memtrace merge step 3 begins: rss 700 MiB hwm 900 MiB | fragments 512 pushes_held 64 "
                    "init_pending 0")
    assert memtrace.format_mark("start", {}, {}) == "memtrace start: rss 0 MiB hwm 0 MiB"


def test_the_level_is_off_unless_set_and_a_bad_value_means_on(monkeypatch):
    for raw, want in ((None, 0), ("", 0), ("0", 0), ("1", 1), ("2", 2), ("yes", 1)):
        if raw is None:
            monkeypatch.delenv("YETO_MEM_TRACE", raising=False)
        else:
            monkeypatch.setenv("YETO_MEM_TRACE", raw)
        assert memtrace.level() == want, raw


def test_a_mark_logs_this_processes_rss_only_when_on(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="yeto.syncer")
    monkeypatch.setattr(memtrace, "_LEVEL", 0)
    memtrace.mark("off", fragments=1)
    assert not [r for r in caplog.records if "memtrace" in r.getMessage()]
    monkeypatch.setattr(memtrace, "_LEVEL", 1)
    memtrace.mark("on", fragments=3 * MiB)
    (rec,) = [r for r in caplog.records if "memtrace" in r.getMessage()]
    own = memtrace.proc_status_bytes()
    assert own["VmRSS"] > 0 and own["VmHWM"] >= own["VmRSS"]
    assert rec.getMessage().startswith("memtrace on: rss ") and rec.getMessage().endswith("| fragments 3")
