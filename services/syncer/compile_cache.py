"""Where a compiled merge loop is kept between syncer starts (`YETO_COMPILE_CACHE`).

Compiling the fused outer-step loop with AOTInductor takes ~40 s of one core on a small host, once per
(member count, delta dtype, chunk length); without a cache every `yeto syncer` start pays it again. The
package it builds (`.pt2`) is kept here and a later start loads it in well under a second.
Invariants: a package is kept only after it passed the bitwise check against the eager twin (outer.py),
and is checked again at every load, so a stale or damaged file costs a rebuild, never a wrong bit. The
key holds everything the compiled code depends on: the loop's source, torch and Python versions, the
machine and its CPU's vector extensions (a package built with AVX-512 must never load on a host without
it: that is SIGILL, not an exception), the delta dtypes and the chunk length.
`YETO_COMPILE_CACHE`: a directory (default `$XDG_CACHE_HOME/yeto/outer`, else `~/.cache/yeto/outer`);
`0`/`off` keeps nothing on disk. Several syncers (shards of one host) may share it: each writes its own
temporary file and renames it into place, and any complete file is a valid one.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from typing import Callable

FORMAT = 1   # bump when the package's calling convention changes (outer.py's Step module)
_OFF = ("0", "off", "no", "false", "none")


def cache_dir() -> str | None:
    """The cache directory from the environment, or None when it is switched off."""
    v = os.environ.get("YETO_COMPILE_CACHE", "").strip()
    if v.lower() in _OFF:
        return None
    if v:
        return os.path.abspath(os.path.expanduser(v))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "yeto", "outer")


@functools.lru_cache(maxsize=1)   # read once: a merge looks up its package path every time it prepares
def _cpu_fingerprint() -> str:
    # torch's own view of the ISA it dispatches to, plus the kernel's list of CPU flags: two hosts that
    # share a home directory get separate packages unless their CPUs offer the same instructions.
    import torch

    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return f"{torch.backends.cpu.get_cpu_capability()}|{platform.machine()}|{flags}"


def package_path(source: str, dtypes: tuple[str, ...], numel: int) -> str | None:
    """The file that holds (or will hold) the package for this loop `source`, or None when caching is off."""
    d = cache_dir()
    if d is None:
        return None
    import torch

    key = "\n".join([str(FORMAT), torch.__version__, sys.version.split()[0], platform.system(), _cpu_fingerprint(),
                     ",".join(dtypes), str(numel), source])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(d, f"outer-{len(dtypes)}x{'-'.join(k.split('.')[-1] for k in dtypes)}-{numel}-{digest}.pt2")


def temp_path(path: str) -> str:
    """A file beside `path` that only this process and thread writes (renamed into place by `keep`)."""
    import threading

    os.makedirs(os.path.dirname(path), exist_ok=True)
    # AOTInductor wants a name ending in .pt2
    return f"{path[:-4]}.{os.getpid()}-{threading.get_ident()}.tmp.pt2"


def keep(tmp: str, path: str) -> None:
    """Move a checked package into place (atomic on one filesystem), and remove what builds killed
    mid-compile left behind (temporary files over an hour old: a compile takes about a minute)."""
    import glob
    import time

    os.replace(tmp, path)
    for stale in glob.glob(os.path.join(os.path.dirname(path), "outer-*.tmp.pt2")):
        try:
            if time.time() - os.stat(stale).st_mtime > 3600:
                os.unlink(stale)
        except OSError:
            pass


def discard(path: str, log_warning: Callable[[str], None] | None = None, why: str = "") -> None:
    """Remove a package that failed to load or to match its twin; the caller rebuilds it."""
    try:
        os.unlink(path)
    except OSError:
        return
    if log_warning is not None:
        log_warning(f"outer step: cached loop {path} removed ({why}); rebuilding it")


# ---- building in a helper process -------------------------------------------------------------------
#
# The syncer does not compile in its own process when a cache directory is set: a helper process
# (`python -m yeto.services.syncer.compile_cache PATH NUMEL DTYPE...`, its own session) builds, checks and
# keeps the package, and the syncer loads it when it appears. A syncer that finishes a short run, or is
# killed, before the compile is done still leaves the package for its next start (a compile thread in
# the syncer died with it), and no compile is in flight inside the syncer when it exits. One builder per
# package: a lock file beside it names the builder's host and pid; shards of one host wait for the same
# builder.

LOCK_STALE_S = 1800.0   # a lock older than this is a builder that died without removing it


def _lock_alive(lock: str) -> bool:
    import socket
    import time

    try:
        with open(lock, encoding="ascii") as f:
            host, _, pid = f.read().strip().partition(" ")
        age = time.time() - os.stat(lock).st_mtime
    except (OSError, ValueError):
        return False
    if age > LOCK_STALE_S:
        return False
    if host != socket.gethostname():   # another host's builder (a shared home directory): trust it
        return True
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


def _take_lock(lock: str) -> bool:
    import socket

    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _lock_alive(lock):
                return False
            try:   # a dead builder's lock
                os.unlink(lock)
            except OSError:
                pass
            continue
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}")
        return True
    return False


def build_elsewhere(path: str, dtypes: tuple[str, ...], numel: int, log, timeout_s: float = 1800.0) -> None:
    """Have a helper process build the package at `path` (unless one already is) and wait until it is
    there or the builder gave up (then the caller builds in process or uses the eager twin)."""
    import subprocess
    import time
    from importlib import metadata

    import yeto

    lock = path + ".lock"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    proc = None
    if not _lock_alive(lock):
        # The helper imports the yeto this process runs. Installed (a wheel or `pip install -e`), the
        # interpreter finds it as is; only a checkout used without installing needs the folder that holds
        # `yeto/` on the helper's path (that folder also holds the checkout's top-level names).
        env = dict(os.environ)
        try:
            metadata.distribution("yeto-nats")
        except metadata.PackageNotFoundError:
            root = os.path.dirname(os.path.dirname(os.path.abspath(yeto.__file__)))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        with open(path[:-4] + ".log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-P", "-m", "yeto.services.syncer.compile_cache", path, str(numel),
                                     *dtypes], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        log.info("outer step: building the loop for %d members x %d values in helper process %d (log %s)",
                 len(dtypes), numel, proc.pid, path[:-4] + ".log")
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        if (proc is None or proc.poll() is not None) and not _lock_alive(lock):
            break   # no builder left (ours finished or lost the lock to one that is done too)
        time.sleep(0.25)
    if proc is not None and proc.poll() is None and not os.path.exists(path):
        log.warning("outer step: the helper process %d has not built %s in %.0f s", proc.pid, path, timeout_s)


def _main(argv: list[str]) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path, numel, dtypes = argv[0], int(argv[1]), tuple(argv[2:])
    lock = path + ".lock"
    if not _take_lock(lock):
        return 0   # another builder holds it; the waiting syncers wait for that one
    try:
        from yeto.services.syncer.outer import _CompiledKernels, _LOOP_SOURCE

        if package_path(_LOOP_SOURCE, dtypes, numel) != path:   # another torch or source than the asker's
            print(f"compile_cache: {path} is not this interpreter's package for {dtypes} x {numel}", file=sys.stderr)
            return 2
        fn = _CompiledKernels.compile((dtypes, numel), here=True)
        return 0 if fn is not None and os.path.exists(path) else 1
    finally:
        try:
            os.unlink(lock)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
