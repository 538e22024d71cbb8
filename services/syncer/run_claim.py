"""How a syncer process comes to own its shard of a run (docs/design.md §11): it takes the run's lease, or
stands by (keeping a warm copy of the committed cut) until the owner's lease lapses; on a host without the
previous owner's checkpoint directory it restores the committed state from JetStream onto the empty one;
and it fences the commit record from the revision it found. Runs once, before the round machine starts
(services/syncer/opening.py), for the I/O shell (services/syncer/service.py), which holds the lease after.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

from yeto.schemas import outer_mode as OM
from yeto.schemas import shards as SH
from yeto.services.syncer.checkpoint import CheckpointError
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.errors import SyncerError
from yeto.services.syncer.kv_reads import kv_json
from yeto.services.syncer.lease import FlagMismatch, RunLease, lease_key, read_key
from yeto.services.syncer.model_store import ModelStore

log = logging.getLogger("yeto.syncer")


def run_flags(mc: SyncerConfig) -> dict:
    """The run flags every syncer of a run must agree on (a standby with others refuses to start)."""
    return {"islands": mc.islands, "fragments": mc.fragments, "sync_every": mc.sync_every,
            "total_steps": mc.total_steps, "push_dtype": mc.push_dtype, "bulk_dtype": mc.bulk_dtype,
            "shards": mc.shards, "strict": mc.strict}


@dataclass(frozen=True)
class Claimed:
    """The run is this process's now. `resume`: continue from the checkpoint directory (`--resume`, or a
    directory that holds a checkpoint: the same command twice is the whole HA set-up)."""
    resume: bool


class RunClaim:
    """Owns the run or stands by (`claim`). The lease is built here and held by the shell from the start
    (`lease`): it refreshes it, releases it at a clean exit and closes it whatever happens."""

    def __init__(self, mc: SyncerConfig, *, state_kv, model: ModelStore, counters: Counter,
                 resume: bool, standby_only: bool, lease_ttl_s: float, label: str):
        self.mc, self.state_kv, self.model, self.counters = mc, state_kv, model, counters
        self.ckpt = model.ckpt   # read here (does it hold a checkpoint?); the model store writes it
        self.resume, self.standby_only, self.lease_ttl_s, self.label = resume, standby_only, lease_ttl_s, label
        self.run_id = mc.run
        self.lease = RunLease(state_kv, lease_key(mc.shard, mc.shards), ttl_s=lease_ttl_s, flags=run_flags(mc),
                              label=f"syncer {label}".strip())

    def _key(self, name: str) -> str:
        return SH.state_key(name, self.mc.shard, self.mc.shards)

    async def finished(self) -> bool:
        """A standby's question: has the run (this shard) finished, so that there is nothing to take over?
        A follower shard is done once its final cut is recorded; the coordinator once the run's `final`."""
        key = SH.final_key(self.mc.shard) if self.mc.sharded and not self.mc.coordinator else "final"
        try:
            return await kv_json(self.state_kv, key) is not None
        except Exception:  # noqa: BLE001 - no answer now: ask again at the next poll
            return False

    async def claim(self) -> Claimed | None:
        """Take the run's lease, or stand by until it lapses (lease.py). None: the run finished meanwhile
        (nothing to do). A takeover continues the run from this syncer's checkpoint directory (as --resume)."""
        if not self.resume and not self.ckpt.exists() and await self.finished():
            # A pod restarted (or a standby started) after the run ended: nothing to own, nothing to restore.
            log.info("run %s already finished (its final record is in the state KV; export the final cut with "
                     "`yeto export`): nothing to do", self.run_id)
            return None
        try:
            if self.standby_only:
                owner = False
                if not await self.lease.wait_for_holder(self.finished):
                    log.info("run %s finished before anybody held %s: nothing to cover", self.run_id,
                             self.lease.key)
                    return None
            else:
                owner = await self.lease.acquire()
        except FlagMismatch as exc:
            raise SyncerError(f"run {self.run_id} is owned by a syncer with other run flags: {exc}") from None
        if not owner:
            warming = (asyncio.create_task(self._keep_warm())
                       if self.model.state_store is not None and not self.ckpt.exists() else None)
            try:
                lapsed = await self.lease.wait_for_lapse(self.finished)
            finally:
                if warming is not None:
                    warming.cancel()
                    await asyncio.gather(warming, return_exceptions=True)
            if not lapsed:
                log.info("run %s finished while this syncer stood by: nothing to do", self.run_id)
                await self.model.drop_warm()
                return None
        resume = self.resume
        commit = await kv_json(self.state_kv, self._key("commit"))
        if commit is not None and not self.ckpt.exists():
            # Another host's syncer committed (the previous owner, or this syncer's pod before it was moved)
            if await self.model.has_stored_state():
                await self._restore_from_jetstream()
            elif not owner and not resume:
                await self.lease.release()   # not ours to run: leave it to a syncer that holds the state
                raise SyncerError(
                    f"took over run {self.run_id}, but its committed state (step {commit.get('committed_step')}) "
                    f"is neither in the state KV (the owner ran with --state-store local) nor in {self.ckpt.path}: "
                    f"start the standby on the owner's directory (a volume both mount), or the owner again")
        if self.ckpt.exists() and not resume:
            # The same command twice is the whole HA set-up, and a restarted pod runs its command again: a
            # checkpoint directory that holds a checkpoint is continued (the resume checks it is this run's).
            log.info("run %s: %s holds a checkpoint: continuing from it (as --resume)", self.run_id, self.ckpt.path)
            resume = True
        # Fencing: the commit record is written revision-checked from now on, starting from its revision
        # now; a resumed owner rewrites it first (the old owner's next write then fails: model_store.py).
        rev, _ = await read_key(self.state_kv, self._key("commit"))
        self.model.fence(rev)
        await self.model.purge_unnamed()   # what a save torn by the previous owner's death left (state_store.py)
        return Claimed(resume=resume)

    async def _keep_warm(self) -> None:
        """A standby's warm copy of the committed cut (state_store.py `warm`), refreshed every half lease TTL
        (at least every 2 s) until the takeover cancels it. Never raises: a pass that fails is tried again."""
        every = max(0.5, min(2.0, self.lease_ttl_s / 2))
        numels, momentum, session = None, True, None
        while True:
            if self.ckpt.exists():
                # The owner's checkpoint appeared in this directory: it is shared (a volume both mount), and the
                # takeover continues from those files; a warm copy beside them is only disk.
                await self.model.drop_warm()
                return
            try:
                if numels is None:
                    session = await kv_json(self.state_kv, "session")
                    if session is not None:
                        own = set(self.mc.own_fragments)
                        numels = {f["id"]: f["numel"] for f in session["fragments"] if f["id"] in own}
                        momentum = OM.has_momentum(session)   # the sparse mode stores none
                if numels is not None:
                    n = await self.model.warm(numels, momentum=momentum, session=session)
                    if n:
                        log.info("standby: %d fragment version%s fetched into the warm copy %s", n,
                                 "s" if n > 1 else "", self.model.warm_path)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a cache: the takeover fetches what it lacks
                self.counters["state_store.warm_error"] += 1
                log.debug("standby: warming the cut failed: %r", exc)
            await asyncio.sleep(every)

    async def _restore_from_jetstream(self) -> None:
        """A takeover on a host without the previous owner's directory: the committed state from the state
        KV into this syncer's checkpoint directory, which the resume then continues (and checks)."""
        session = await kv_json(self.state_kv, "session")
        if session is None:
            raise SyncerError(f"run {self.run_id}: the state KV holds committed state but no session")
        numels = {f["id"]: f["numel"] for f in session["fragments"] if f["id"] in set(self.mc.own_fragments)}
        t0 = time.perf_counter()
        before = self.counters["state_store.restored_warm"]
        try:
            state = await self.model.restore(session, numels)
        except (RuntimeError, CheckpointError) as exc:
            raise SyncerError(f"run {self.run_id}: restoring the committed state from the state KV failed: {exc}") from None
        log.warning("restored run %s's committed state (step %d, versions %s) from the state KV into %s in %.1f s "
                    "(%d of %d fragments from the standby's warm copy)", self.run_id, state.committed_step,
                    state.versions, self.ckpt.path, time.perf_counter() - t0,
                    self.counters["state_store.restored_warm"] - before, len(numels))
