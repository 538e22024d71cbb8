"""One run harness: what `yeto demo`, the tests, the benchmarks (bench/) and the soak tools (soak/) need to run
a broker, syncers and islands as real processes and read back what the run left.

  Child            one started process: its label, its log file, a wait for a line it prints (readiness),
                   signals to it or its whole process group, a clean stop
  wait_all         wait for children to exit; a failure names the child and ends with its log's tail
  stop_all         stop children (SIGTERM, then SIGKILL of what is left)
  RssWatch         peak RSS (VmHWM) and a VmRSS series of a set of processes, sampled from /proc
  vm_hwm, vm_rss   one process's peak and current RSS; peak_rss_self: this process's peak
  read_tape, tape_of, kv_json, wait_provisioned: readers of a run's EVENTS tape and state KV
  result_line, read_jsonl: an island's RESULT line, a step-log file

Processes log to files (not pipes): a file survives the process, the test or the bench, can be read by
anyone at any time, and cannot fill up and block a child the way an unread pipe does. Linux only (/proc).
"""
from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from yeto.services.broker import free_port, free_port_block  # noqa: F401  (the harness's port helpers)

MiB = 1 << 20


class ChildFailed(RuntimeError):
    """A child exited (or not) other than expected; the message names it and ends with its log's tail."""


HOST_ENV = ("YETO_COMPILE_CACHE",)


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any YETO_* variable of the caller's shell (a child reads only what it is given),
    unbuffered Python output (a log shows what a child did up to the moment it died), plus `extra`."""
    # YETO_COMPILE_CACHE is where this host keeps compiled merge loops, not a setting of the run: kept
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_") or k in HOST_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def result_line(text: str) -> dict | None:
    """An island's `RESULT {json}` line, decoded; None without one. The ranks of one island share its
    output, so another rank's text may share the line: decode just the JSON object after the marker."""
    for line in text.splitlines():
        i = line.find("RESULT {")
        if i >= 0:
            return json.JSONDecoder().raw_decode(line, i + len("RESULT "))[0]
    return None


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of a file (a step log); [] when it does not exist. A torn line (a process killed
    mid-write) is left out."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class Child:
    """One process of a run, logging stdout and stderr to `log` (appended: a restarted process's lines
    follow its previous life's).

    `group=True` starts it in a session of its own (its own process group): signals then reach every
    process it started too, so a data-parallel island's launcher and its ranks die together, as a crashed
    node's would. `group=False` keeps it in the caller's group (a Ctrl-C reaches it) and signals the
    process alone."""

    def __init__(self, label: str, cmd: list[str], log: Path, *, env: dict[str, str] | None = None,
                 cwd: Path | str | None = None, group: bool = True):
        self.label, self.cmd, self.log = label, [str(c) for c in cmd], Path(log)
        self.env, self.cwd, self.group = env, cwd, group
        self.proc: subprocess.Popen | None = None
        self._logf = None
        self._start_offset = 0
        self._followers: list[threading.Thread] = []

    def start(self, *extra: str) -> "Child":
        """Start it (with `extra` arguments after its command, for this start only)."""
        self.close_log()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, "ab")
        self._start_offset = self._logf.tell()  # wait_line looks at this life's lines only
        self.proc = subprocess.Popen(self.cmd + list(extra), stdout=self._logf, stderr=subprocess.STDOUT,
                                     cwd=self.cwd, env=self.env, start_new_session=self.group)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status; subprocess.TimeoutExpired when it runs past `timeout`."""
        return self.proc.wait(timeout)

    # ---- its output

    def output(self) -> str:
        """The whole log: every life of the process."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def this_life(self) -> str:
        """What the process printed since its last start (a log reused by a later run or a restart holds more)."""
        if not self.log.exists():
            return ""
        with open(self.log, "rb") as f:
            f.seek(self._start_offset)
            return f.read().decode(errors="replace")

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.this_life().splitlines()[-lines:])

    def result(self) -> dict | None:
        """Its `RESULT {json}` line of this life (see `result_line`)."""
        return result_line(self.this_life())

    def failure(self, what: str, lines: int = 25) -> ChildFailed:
        return ChildFailed(f"{self.label} {what}; its log ({self.log}) ends:\n{self.tail(lines)}")

    def wait_line(self, text: str, timeout: float) -> str:
        """Wait until this life of the process printed a line containing `text` (it is ready); the line.
        ChildFailed, naming it with its log's tail, when it exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.proc.poll()
            for raw in self.this_life().splitlines():
                if text in raw:
                    return raw
            if exited is not None:
                raise self.failure(f"exited with {exited} before printing {text!r}")
            if time.monotonic() > deadline:
                raise self.failure(f"did not print {text!r} within {timeout:.0f}s")
            time.sleep(0.05)

    def follow(self, show: Callable[[str], bool], prefix: str) -> threading.Thread:
        """Echo the log's new lines for which `show(line)` holds, as `prefix line`, until the process has
        exited and its last line was read (`join_followers` waits for that)."""
        def go():
            with open(self.log, "rb") as f:
                f.seek(self._start_offset)
                part = b""
                while True:
                    done = self.proc.poll() is not None   # before the read: nothing is written after exit
                    chunk = f.readline()
                    if chunk:
                        part += chunk
                        if part.endswith(b"\n"):
                            line = part.decode(errors="replace").rstrip()
                            part = b""
                            if show(line):
                                print(f"{prefix} {line}", flush=True)
                        continue
                    if done:
                        return
                    time.sleep(0.05)

        t = threading.Thread(target=go, daemon=True, name=f"follow {self.label}")
        t.start()
        self._followers.append(t)
        return t

    def join_followers(self, timeout: float = 5.0) -> None:
        for t in self._followers:
            t.join(timeout)

    # ---- signals and shutdown

    def send(self, sig: int) -> None:
        """Send `sig` to the process (to its whole group with group=True); gone already is fine."""
        try:
            if self.group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL (the whole group with group=True) and reap it: a crash, as the tests and soaks make one."""
        if self.proc is None:
            return
        self.send(signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, `grace` seconds to exit, then SIGKILL; with group=True the group is killed in any
        case (ranks may outlive their launcher). Closes the log."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.send(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if self.group or self.proc.poll() is None:
            self.send(signal.SIGKILL)
        self.proc.wait()
        self.close_log()

    def close_log(self) -> None:
        if self._logf is not None:
            self._logf.close()
            self._logf = None


def _named(children) -> dict[str, Child]:
    return dict(children) if isinstance(children, dict) else {c.label: c for c in children}


def tails(children, lines: int = 25) -> str:
    """Every child's log tail, each under its name."""
    return "\n".join(f"--- {name} ---\n{c.tail(lines)}" for name, c in _named(children).items())


def _check(kids: dict[str, Child]) -> None:
    """The first child that exited non-zero fails the wait at once: the others may be waiting for it."""
    for c in kids.values():
        rc = c.proc.poll()
        if rc is not None and rc != 0:
            raise c.failure(f"exited with {rc}")


def _still_running(kids: dict[str, Child], timeout: float, lines: int) -> ChildFailed:
    running = [n for n, c in kids.items() if c.proc.poll() is None]
    return ChildFailed(f"still running after {timeout:.0f}s: {running}\n" + tails(kids, lines))


def wait_all(children, timeout: float, *, check: bool = True, watch: "RssWatch | None" = None,
             lines: int = 25) -> dict[str, int]:
    """Wait until every child (a list, or a dict name -> Child) exited; their exit statuses by name.
    `check`: a non-zero exit raises ChildFailed at once, naming that child with its log's tail (the others
    may be waiting for it: a syncer that refused its flags leaves its islands waiting for a session). A child still
    running at `timeout` raises ChildFailed naming who with every log's tail. `watch` is polled while
    waiting (its peaks then include the last moments of a short process)."""
    kids = _named(children)
    deadline = time.monotonic() + timeout
    while any(c.proc.poll() is None for c in kids.values()):
        if check:
            _check(kids)
        if watch is not None:
            watch.poll()
        if time.monotonic() > deadline:
            raise _still_running(kids, timeout, lines)
        time.sleep(0.1)
    if check:
        _check(kids)
    return {name: c.proc.poll() for name, c in kids.items()}


async def wait_all_async(children, timeout: float, *, check: bool = False, lines: int = 25) -> dict[str, int]:
    """wait_all without blocking the event loop (a test's own NATS clients keep running)."""
    kids = _named(children)
    deadline = time.monotonic() + timeout
    while any(c.proc.poll() is None for c in kids.values()):
        if check:
            _check(kids)
        if time.monotonic() > deadline:
            raise _still_running(kids, timeout, lines)
        await asyncio.sleep(0.1)
    if check:
        _check(kids)
    return {name: c.proc.poll() for name, c in kids.items()}


def stop_all(children, grace: float = 5.0) -> None:
    """Stop every child, the last started first (islands before the syncer that waits for them)."""
    for c in reversed(list(_named(children).values())):
        c.stop(grace)


# --------------------------------------------------------------------------- memory, from /proc


def proc_status(pid: int | str, field: str) -> int | None:
    """A `kB` field of /proc/PID/status in bytes (pid "self": this process); None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def vm_hwm(pid: int | str = "self") -> int | None:
    """Peak RSS (the kernel's high-water mark) in bytes."""
    return proc_status(pid, "VmHWM")


def vm_rss(pid: int | str = "self") -> int | None:
    """RSS now, in bytes."""
    return proc_status(pid, "VmRSS")


def peak_rss_self() -> int:
    """This process's peak RSS in bytes (getrusage; ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def phase_peaks(series: list[tuple[float, int]], marks: list[tuple[str, float]]) -> dict[str, int]:
    """The highest sample of each phase; phase i spans [marks[i], marks[i+1]), the last one to the
    end. Samples before the first mark count for none; a phase without a sample is 0."""
    out = {name: 0 for name, _ in marks}
    for t, v in series:
        phase = None
        for name, start in marks:
            if t >= start:
                phase = name
        if phase is not None:
            out[phase] = max(out[phase], v)
    return out


class RssWatch:
    """Peak RSS (VmHWM) of named processes, read every `every_s` on a thread while they live. The
    kernel's high-water mark is exact: only what a process does in its last `every_s` may be missed. VmRSS
    is kept as a time series too, to tell in which phase of a run the peak came (`phase_peaks`)."""

    def __init__(self, every_s: float = 0.1):
        self.every_s = every_s
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.series: dict[str, list[tuple[float, int]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="rss watch")

    def add(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def add_children(self, children: Iterable[Child]) -> None:
        for c in children:
            self.add(c.label, c.pid)

    def poll(self) -> None:
        with self._lock:
            for name, pid in list(self.pids.items()):
                v = vm_hwm(pid)
                if v:
                    self.peak[name] = max(self.peak.get(name, 0), v)
                r = vm_rss(pid)
                if r:
                    self.series.setdefault(name, []).append((time.time(), r))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def phase_peaks(self, name: str, marks: list[tuple[str, float]]) -> dict[str, int]:
        """The highest VmRSS sampled in each phase (see `phase_peaks`)."""
        return phase_peaks(self.series.get(name, []), marks)

    def line(self) -> str:
        """`peak RSS a N MiB, b M MiB`: how every bench prints its processes' peaks."""
        return "peak RSS " + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in self.peak.items())

    def __enter__(self) -> "RssWatch":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.poll()
        self._stop.set()
        self._t.join()


# --------------------------------------------------------------------------- what a run leaves in NATS


async def read_tape(js, run: str, kind: str | None = None) -> list[dict]:
    """Every record of the syncer's EVENTS tape so far (optionally of one kind), by direct get per
    sequence: fine for a short run's tape; `tape_of` reads one kind of a long one."""
    import orjson

    from yeto.schemas import subjects as S

    info = await js.stream_info(S.stream(run, "EVENTS"))
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            m = await js.get_msg(S.stream(run, "EVENTS"), seq=seq)
        except Exception:  # a gap (none expected): skip it
            continue
        rec = orjson.loads(m.data)
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out


async def tape_of(js, run: str, kind: str) -> list[dict]:
    """The EVENTS tape's records of one kind, in order, through an ephemeral consumer filtered to the
    kind's subject (the whole tape holds every recorded input: thousands of records); [] before the run's
    streams exist."""
    import orjson
    from nats.js.errors import NotFoundError

    from yeto.schemas import subjects as S

    try:
        sub = await js.pull_subscribe(S.events(run, kind), stream=S.stream(run, "EVENTS"))
    except NotFoundError:
        return []
    out = []
    try:
        # fetch() waits out its timeout unless the batch fills: ask for exactly what is pending
        want = (await sub.consumer_info()).num_pending
        while len(out) < want:
            msgs = await sub.fetch(min(256, want - len(out)), timeout=10)
            out.extend(orjson.loads(m.data) for m in msgs)
    finally:
        await sub.unsubscribe()
    return out


async def kv_json(js, run: str, key: str) -> dict | None:
    """A JSON record of the run's `state` KV (session, commit, syncer), or None."""
    import orjson
    from nats.js.errors import KeyNotFoundError

    from yeto.schemas import subjects as S

    kv = await js.key_value(S.kv_bucket(run, "state"))
    try:
        e = await kv.get(key)
    except KeyNotFoundError:
        return None
    return orjson.loads(e.value) if e is not None and e.value else None


async def wait_provisioned(js, run: str, timeout: float = 60) -> None:
    """Until the syncer created the run's CTL stream and state KV (it provisions the run at start)."""
    from yeto.schemas import subjects as S

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            await js.stream_info(S.stream(run, "CTL"))
            await js.key_value(S.kv_bucket(run, "state"))
            return
        except Exception:
            await asyncio.sleep(0.1)
    raise TimeoutError(f"run {run} never provisioned within {timeout:.0f}s")
