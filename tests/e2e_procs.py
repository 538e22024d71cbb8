"""Real processes for the learner end-to-end tests: `python -m yeto.learner.demo` islands next to the real
`yeto syncer` (tests.scripted.SyncerProc), both services/run_harness.py Children, plus small readers of what
a run leaves behind (step-log files, RESULT lines, the state KV, the EVENTS tape).

Each island runs in its own session (process group), so a test can SIGKILL a whole data-parallel
island — the launcher and every gloo rank — at once, as a crashed node would die.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path

from nats.js.errors import NotFoundError

from yeto.services.run_harness import (  # noqa: F401  (kv_json, clean_env, tails: the tests' names for them)
    Child, ChildFailed, clean_env, kv_json, read_jsonl, tails, wait_all_async,
)
from tests.scripted import tape

# Fail fast instead of hanging for the production defaults (600 s) when a run goes wrong.
ISLAND_TIMEOUTS = {
    "YETO_SESSION_TIMEOUT": "60",
    "YETO_LOCKSTEP_TIMEOUT": "60",
    "YETO_FINAL_TIMEOUT": "60",
    "YETO_SHUTDOWN_TIMEOUT": "30",
    "YETO_INIT_V0_TIMEOUT": "60",
    "YETO_PUSH_TIMEOUT": "30",
    "YETO_PROGRESS": "0",
}


# The syncer's side of the same: a stuck round, a silent island or a missing final ack fails in a minute.
SYNCER_TIMEOUTS = ("--quorum-timeout", "60", "--member-timeout", "20", "--final-timeout", "60")


class IslandProc(Child):
    """One `python -m yeto.learner.demo` island (all its ranks, one process group), logging to files under
    `work`.

    `tag` names this process's files (a restarted island gets a new tag, so each generation has its
    own log and step-log file)."""

    def __init__(self, url: str, run: str, island: str, work: Path, *, ranks: int = 1, tag: str | None = None,
                 env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
        self.island = island
        self.tag = tag or island
        self.steplog = work / f"steplog-{self.tag}.jsonl"
        self.out = work / f"island-{self.tag}.safetensors"
        super().__init__(
            f"island {self.tag}",
            [sys.executable, "-P", "-m", "yeto.learner.demo", "--run", run, "--island", island, "--ranks", str(ranks),
             "--out", str(self.out), *args],
            work / f"island-{self.tag}.log", group=True,
            env=clean_env(YETO_NATS=url, YETO_RUN=run, YETO_ISLAND=island,
                          YETO_DILOCO_STEP_LOG=str(self.steplog), **ISLAND_TIMEOUTS, **(env or {})))

    def kill_group(self) -> None:
        """SIGKILL the launcher and every rank (one process group), then reap the launcher."""
        self.kill()

    def steplog_rows(self) -> list[dict]:
        """The step-log file's events; a torn last line (SIGKILL mid-write) is left out."""
        return read_jsonl(self.steplog)


def lockstep_islands(url: str, run: str, work: Path, *, alpha: float, batch: int, lr: float) -> dict[str, IslandProc]:
    """The two islands the reference e2e runs compare with their in-process references: `a` of one rank, `b` of two
    gloo ranks, lockstep, no step delay, the given blend alpha, batch and inner lr. Started."""
    env = {"YETO_LOCKSTEP": "1", "YETO_DILOCO_ALPHA": str(alpha)}
    args = ("--step-delay", "0", "--batch", str(batch), "--lr", str(lr))
    return {name: IslandProc(url, run, name, work, ranks=ranks, env=env, args=args).start()
            for name, ranks in (("a", 1), ("b", 2))}


async def wait_exit(procs: dict, timeout: float) -> dict[str, int]:
    """Wait (without blocking the event loop) until every process (IslandProc or SyncerProc) exited;
    their return codes. On timeout, fails naming who is still running with the tail of their output."""
    try:
        return await wait_all_async(procs, timeout)
    except ChildFailed as e:
        raise AssertionError(str(e)) from None


def assert_islands_hold_the_final_cut(ckpt: Path, out: Path, run: str, islands) -> None:
    """Export the syncer's checkpoint to `out`; every island saved exactly that cut (bitwise) and
    refused nothing."""
    import torch
    from safetensors.torch import load_file

    from yeto.services.cmd_export import export

    export(ckpt, out, run)
    final = load_file(str(out))
    for isl in islands:
        saved = load_file(str(isl.out))
        assert sorted(saved) == sorted(final)
        for n, value in final.items():
            assert torch.equal(saved[n], value), (isl.island, n)
        res = isl.result()
        assert res is not None and res["counters"]["rejected"] == 0, isl.output()[-3000:]


async def merges(js, run: str) -> list[dict]:
    """The merge records of the syncer's EVENTS tape, in commit order ([] before the syncer
    provisioned the run)."""
    try:
        return await tape(js, run, "merge")
    except NotFoundError:
        return []


async def wait_until(pred, timeout: float, what: str, poll: float = 0.1):
    """Poll an async predicate until it returns a truthy value (returned)."""
    deadline = time.monotonic() + timeout
    while True:
        got = await pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(poll)


@contextlib.contextmanager
def rank_processes(fn, args: tuple, nprocs: int, start_method: str = "spawn"):
    """`nprocs` gloo ranks running fn(rank, *args) (torch.multiprocessing); whatever is still alive
    when the block ends (a failed assertion included) is killed."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=start_method)
    try:
        yield ctx
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


async def join_ranks_and_syncer(ctx, syncer, timeout: float) -> None:
    """Wait for every rank to exit 0 (ctx.join raises on a failed rank) and then the syncer; on a
    timeout the syncer's output tail explains what the run was waiting for."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(ctx.join, 2):
        assert time.monotonic() < deadline, "islands did not finish:\n" + syncer.output()[-3000:]
    assert syncer.wait(30) == 0, syncer.output()[-3000:]


async def kv_keys(kv) -> set[str]:
    """The bucket's live keys, from its stream's subjects and a get each (a deleted or purged key has only its
    marker). Not nats-py's `kv.keys()`: its watcher can report none while the first entries are in flight
    (NoKeysError on a loaded machine; services/syncer/opening.py `_read_members` reads the same way)."""
    from nats.js.errors import KeyNotFoundError

    info = await kv._js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
    keys = set()
    for subject in info.state.subjects or {}:
        try:
            await kv.get(subject[len(kv._pre):])
        except KeyNotFoundError:
            continue
        keys.add(subject[len(kv._pre):])
    return keys
