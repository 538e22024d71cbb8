"""services/run_harness.py, the one run harness of the demo, the tests, the benches and the soak tools, on real
processes: a child that prints its ready line, one that dies early (the error names it and ends with its log),
the RSS watch seeing a process allocate, a clean stop that kills a child's whole process group."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from yeto.services.run_harness import (
    Child, ChildFailed, RssWatch, clean_env, free_port, peak_rss_self, phase_peaks, read_jsonl, result_line, stop_all,
    vm_hwm, wait_all,
)

pytestmark = pytest.mark.e2e

MiB = 1 << 20


def py(label: str, code: str, tmp_path, **kw) -> Child:
    return Child(label, [sys.executable, "-c", code], tmp_path / f"{label}.log", env=clean_env(), **kw)


def test_wait_line_returns_the_ready_line(tmp_path):
    c = py("ready", "import time; print('warming up'); time.sleep(0.3); print('ready on port 7'); time.sleep(30)",
           tmp_path).start()
    try:
        assert c.wait_line("ready on", timeout=20) == "ready on port 7"
        assert c.poll() is None
    finally:
        c.stop(grace=1)
    assert c.poll() is not None


def test_a_child_that_dies_early_is_named_with_its_log_tail(tmp_path):
    c = py("doomed", "import sys; print('loading the model'); sys.exit(3)", tmp_path).start()
    with pytest.raises(ChildFailed) as err:
        c.wait_line("ready", timeout=20)
    msg = str(err.value)
    assert "doomed exited with 3" in msg and "loading the model" in msg, msg
    c.stop()


def test_wait_all_names_the_failed_child_and_the_one_still_running(tmp_path):
    ok = py("fine", "print('done')", tmp_path).start()
    bad = py("broken", "raise SystemExit('no session record')", tmp_path).start()
    waiting = py("waiting", "import time; time.sleep(60)", tmp_path).start()
    t0 = time.monotonic()
    with pytest.raises(ChildFailed) as err:  # at once, not after the one still waiting for it
        wait_all([ok, bad, waiting], timeout=50)
    assert time.monotonic() - t0 < 30
    assert "broken exited with 1" in str(err.value) and "no session record" in str(err.value)
    waiting.stop(grace=1)
    assert wait_all([ok, bad, waiting], timeout=5, check=False) == {"fine": 0, "broken": 1, "waiting": -signal.SIGTERM}

    slow = py("slow", "import time; print('still here'); time.sleep(60)", tmp_path).start()
    try:
        with pytest.raises(ChildFailed) as err:
            wait_all({"slow one": slow}, timeout=1)
        assert "still running after 1s: ['slow one']" in str(err.value)
    finally:
        slow.stop(grace=1)


def test_rss_watch_sees_a_process_allocate(tmp_path):
    # 'allocating' comes half a second before the allocation: the test's mark for that phase is taken once it
    # sees the line (polled, late under load), and must not fall after the first allocated pages were sampled
    code = ("import time; print('ready', flush=True); time.sleep(0.5); print('allocating', flush=True); "
            "time.sleep(0.5); b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0)")
    c = py("allocator", code, tmp_path).start()
    with RssWatch(every_s=0.05) as watch:
        watch.add("allocator", c.pid)
        c.wait_line("ready", timeout=20)
        before = vm_hwm(c.pid)
        marks = [("idle", time.time())]
        c.wait_line("allocating", timeout=30)
        marks.append(("allocated", time.time()))
        wait_all([c], timeout=30, watch=watch)
    assert watch.peak["allocator"] - before >= 180 * MiB, (watch.peak, before)
    phases = watch.phase_peaks("allocator", marks)
    assert phases["allocated"] - phases["idle"] >= 150 * MiB, phases
    assert "allocator" in watch.line() and watch.line().startswith("peak RSS ")
    assert peak_rss_self() >= 10 * MiB  # this interpreter, with torch-free imports, is well above that


def test_stop_kills_the_whole_group_and_kill_is_a_crash(tmp_path):
    # the child starts a grandchild that ignores SIGTERM: a clean stop must leave neither behind
    code = ("import subprocess, sys, time; "
            "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); print(\"grandchild up\", flush=True); time.sleep(120)']); "
            "print('grandchild', g.pid, flush=True); time.sleep(120)")
    c = py("launcher", code, tmp_path).start()
    line = c.wait_line("grandchild ", timeout=20)
    c.wait_line("grandchild up", timeout=20)
    grandchild = int(line.split()[1])
    c.stop(grace=1)
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "the grandchild outlived the clean stop"
    assert c.poll() == -signal.SIGTERM

    crash = py("crash", "import time; print('up', flush=True); time.sleep(60)", tmp_path).start()
    crash.wait_line("up", timeout=20)
    crash.kill()
    assert crash.poll() == -signal.SIGKILL
    stop_all([crash])  # stopping what already died is fine


def test_a_restart_appends_to_the_log_and_waits_on_its_own_lines(tmp_path):
    c = py("twice", "print('ready')", tmp_path).start()
    assert c.wait(20) == 0
    c.cmd = [sys.executable, "-c", "import time; time.sleep(0.5); print('second life')"]
    c.start()
    with pytest.raises(ChildFailed):  # the first life's `ready` does not count for the second
        c.wait_line("ready", timeout=10)
    assert c.output().splitlines() == ["ready", "second life"]
    assert c.tail() == "second life" and c.result() is None
    c.stop()


def test_follow_echoes_the_lines_it_is_asked_for(tmp_path, capsys):
    c = py("talker", "print('noise'); print('[step 1] loss 0.5'); print('RESULT {\"steps\": 1} trailing')",
           tmp_path).start()
    c.follow(lambda line: line.startswith("["), "[island a]")
    assert c.wait(20) == 0
    c.join_followers()
    assert capsys.readouterr().out == "[island a] [step 1] loss 0.5\n"
    assert c.result() == {"steps": 1} and result_line("nothing here") is None


def test_small_pieces(tmp_path):
    p = tmp_path / "steps.jsonl"
    p.write_text('{"t": 1}\n{"t": 2}\n{"t": 3, "torn')
    assert read_jsonl(p) == [{"t": 1}, {"t": 2}] and read_jsonl(tmp_path / "none.jsonl") == []
    assert phase_peaks([(0.5, 9), (1.0, 1), (1.5, 5), (2.0, 7)], [("a", 1.0), ("b", 2.0), ("c", 3.0)]) == \
        {"a": 5, "b": 7, "c": 0}
    os.environ["YETO_SOMETHING"] = "1"
    try:
        env = clean_env(YETO_RUN="r")
        assert "YETO_SOMETHING" not in env and env["YETO_RUN"] == "r" and env["PYTHONUNBUFFERED"] == "1"
    finally:
        del os.environ["YETO_SOMETHING"]
    assert 1024 <= free_port() < 65536


def _alive(pid: int) -> bool:
    """Alive and not a zombie (a zombie still answers kill 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
