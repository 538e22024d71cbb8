"""How a syncer process comes to run its shard of a run (docs/design.md §8, §11): owning it (the lease, or
standing by), the committed state restored from JetStream onto an empty directory, and the round machine
started fresh or resumed from the checkpoint (interrupted merges redone, a shard's final cut re-recorded,
members read back). Part of the I/O shell (services/syncer/service.py), which it is mixed into: these
methods use the shell's connection, KV handles, cut and config, and run once, before the main loop.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import time

import orjson

from yeto.schemas import shards as SH
from yeto.schemas.versions import StateFormatError, check_state_format, software
from yeto.services.syncer.events import Tick
from yeto.services.syncer.rounds import RoundMachine
from yeto.services.syncer.checkpoint import FORMAT, CheckpointDir, CheckpointError
from yeto.services.syncer.intake import PushLedger
from yeto.services.syncer.lease import FlagMismatch, RunLease, lease_key, read_key
from yeto.services.syncer.recording import INPUT_KIND
from yeto.services.syncer.settings_desk import SettingsDesk
from yeto.services.syncer.state_store import WARM_DIR
from yeto.services.syncer.shard_watch import ShardRecordError, ShardWatch, parse_shard_final

log = logging.getLogger("yeto.syncer")


class SyncerError(RuntimeError):
    """A run this syncer cannot serve (refused session, incomplete checkpoint, ...): exit 2 with it."""


class Startup:
    async def _own_the_run(self) -> bool:
        """Take the run's lease, or stand by until it lapses (lease.py). False: the run finished meanwhile.
        A takeover continues the run from this syncer's checkpoint directory (as --resume does)."""
        mc = self.cfg.machine
        self.lease = RunLease(self.state_kv, lease_key(mc.shard, mc.shards), ttl_s=self.cfg.lease_ttl_s,
                              flags=self._run_flags(), label=f"syncer {self.label}".strip())
        if not self.cfg.resume and not self.ckpt.exists() and await self._run_finished():
            # A pod restarted (or a standby started) after the run ended: nothing to own, nothing to restore.
            log.info("run %s already finished (its final record is in the state KV; export the final cut with "
                     "`yeto export`): nothing to do", self.run_id)
            self.standby_done = True
            return False
        try:
            if self.cfg.standby_only:
                owner = False
                if not await self.lease.wait_for_holder(self._run_finished):
                    log.info("run %s finished before anybody held %s: nothing to cover", self.run_id,
                             self.lease.key)
                    self.standby_done = True
                    return False
            else:
                owner = await self.lease.acquire()
        except FlagMismatch as exc:
            raise SyncerError(f"run {self.run_id} is owned by a syncer with other run flags: {exc}") from None
        if not owner:
            warming = (asyncio.create_task(self._keep_warm())
                       if self.cut.store is not None and not self.ckpt.exists() else None)
            try:
                lapsed = await self.lease.wait_for_lapse(self._run_finished)
            finally:
                if warming is not None:
                    warming.cancel()
                    await asyncio.gather(warming, return_exceptions=True)
            if not lapsed:
                log.info("run %s finished while this syncer stood by: nothing to do", self.run_id)
                await asyncio.to_thread(shutil.rmtree, self.ckpt.path / WARM_DIR, True)
                self.standby_done = True
                return False
        commit = await self._kv_get(self.state_kv, self._key("commit"))
        if commit is not None and not self.ckpt.exists():
            # Another host's syncer committed (the previous owner, or this syncer's pod before it was moved)
            if self.cut.store is not None and await self.cut.store.has_state():
                await self._restore_from_jetstream()
            elif not owner and not self.cfg.resume:
                await self.lease.release()   # not ours to run: leave it to a syncer that holds the state
                raise SyncerError(
                    f"took over run {self.run_id}, but its committed state (step {commit.get('committed_step')}) "
                    f"is neither in the state KV (the owner ran with --state-store local) nor in {self.ckpt.path}: "
                    f"start the standby on the owner's directory (a volume both mount), or the owner again")
        if self.ckpt.exists() and not self.cfg.resume:
            # The same command twice is the whole HA set-up, and a restarted pod runs its command again: a
            # checkpoint directory that holds a checkpoint is continued (the resume checks it is this run's).
            log.info("run %s: %s holds a checkpoint: continuing from it (as --resume)", self.run_id, self.ckpt.path)
            self.cfg.resume = True
        # Fencing: the commit record is written revision-checked from now on, starting from its revision
        # now; a resumed owner rewrites it first (the old owner's next write then fails: cut.py).
        self.cut.commit_rev, _ = await read_key(self.state_kv, self._key("commit"))
        self.cut.guard = self._guard
        if self.cut.store is not None:   # what a save torn by the previous owner's death left (state_store.py)
            await self.cut.store.purge_unnamed()
        return True

    async def _keep_warm(self) -> None:
        """A standby's warm copy of the committed cut (state_store.py `warm`), refreshed every half lease TTL
        (at least every 2 s) until the takeover cancels it. Never raises: a pass that fails is tried again."""
        warm = CheckpointDir(self.ckpt.path / WARM_DIR)
        every = max(0.5, min(2.0, self.cfg.lease_ttl_s / 2))
        numels = None
        while True:
            if self.ckpt.exists():
                # The owner's checkpoint appeared in this directory: it is shared (a volume both mount), and the
                # takeover continues from those files; a warm copy beside them is only disk.
                await asyncio.to_thread(shutil.rmtree, warm.path, True)
                return
            try:
                if numels is None:
                    session = await self._kv_get(self.state_kv, "session")
                    if session is not None:
                        own = set(self.cfg.machine.own_fragments)
                        numels = {f["id"]: f["numel"] for f in session["fragments"] if f["id"] in own}
                if numels is not None:
                    n = await self.cut.store.warm(warm, numels)
                    if n:
                        log.info("standby: %d fragment version%s fetched into the warm copy %s", n,
                                 "s" if n > 1 else "", warm.path)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a cache: the takeover fetches what it lacks
                self.counters["state_store.warm_error"] += 1
                log.debug("standby: warming the cut failed: %r", exc)
            await asyncio.sleep(every)

    async def _restore_from_jetstream(self) -> None:
        """A takeover on a host without the previous owner's directory: the committed state from the state
        KV into this syncer's checkpoint directory, which the resume then continues (and checks)."""
        session = await self._kv_get(self.state_kv, "session")
        if session is None:
            raise SyncerError(f"run {self.run_id}: the state KV holds committed state but no session")
        numels = {f["id"]: f["numel"] for f in session["fragments"] if f["id"] in set(self.cfg.machine.own_fragments)}
        t0 = time.perf_counter()
        warm_path = self.ckpt.path / WARM_DIR
        before = self.counters["state_store.restored_warm"]
        try:
            state = await self.cut.store.restore_into(self.ckpt, session, numels,
                                                      warm=CheckpointDir(warm_path) if warm_path.is_dir() else None)
        except (RuntimeError, CheckpointError) as exc:
            raise SyncerError(f"run {self.run_id}: restoring the committed state from the state KV failed: {exc}") from None
        await asyncio.to_thread(shutil.rmtree, warm_path, True)
        log.warning("restored run %s's committed state (step %d, versions %s) from the state KV into %s in %.1f s "
                    "(%d of %d fragments from the standby's warm copy)", self.run_id, state.committed_step,
                    state.versions, self.ckpt.path, time.perf_counter() - t0,
                    self.counters["state_store.restored_warm"] - before, len(numels))

    async def _redo_interrupted_merges(self, state):
        """--resume: a cut-through merge the killed syncer had begun (its intent names the version after
        the checkpointed one; some of its chunks may be in BCAST, and islands may hold them) is done
        again from the same pushes, so that version number gets the same bytes. Returns the checkpoint
        state after those commits. When a push is gone (PUSH's max_age passed while the syncer was
        down) it cannot be: the round restarts as usual, and islands drop the early chunks they hold
        because the new chunks differ (the seal's digest would refuse a mix anyway)."""
        for fid in sorted(self.cut.frags):
            intent = await asyncio.to_thread(self.ckpt.read_intent, fid)
            if intent is None:
                continue
            merge = intent.get("merge") or {}
            if merge.get("version") != state.versions.get(fid, -1) + 1:
                continue   # stale: that version was committed (or never begun)
            log.warning("fragment %d version %d (step %d) was being merged and broadcast when the syncer stopped: "
                        "merging it again from the same pushes", fid, merge.get("version"), merge.get("step"))
            merger = self._new_merger()
            try:
                _done, seqs = await merger.redo(intent)
            except Exception as exc:  # noqa: BLE001 - a push is gone: the round restarts instead
                self.counters["merge_redo_failed"] += 1
                log.error("fragment %d version %d cannot be merged again (%r): its round restarts, and the chunks the "
                          "killed syncer sent are replaced", fid, merge.get("version"), exc)
                await self.tape.write({"kind": "error", "t": time.time(), "step": merge.get("step"), "fragment": fid,
                                       "reason": f"interrupted merge of version {merge.get('version')} not redone: {exc!r}"},
                                      kind="error")
                await asyncio.to_thread(self.ckpt.drop_intent, fid)
                self._unsealed.add(fid)
                # The restarted round gives this version number other bytes: new Nats-Msg-Ids for them.
                self.cut.reissue[fid] = (merge.get("version"), time.time_ns() // 1_000_000)
                continue
            self.counters["merge_redone"] += 1
            await merger.cleanup(fid, seqs)
            state = await asyncio.to_thread(self.ckpt.read_state)
        return state

    async def _start_machine(self) -> None:
        mc = self.cfg.machine
        kv_session = await self._kv_get(self.state_kv, "session")
        if mc.sharded:
            self.watch = ShardWatch(js=self.js, run_id=self.run_id, config=mc, state_kv=self.state_kv,
                                    members_kv=self.members_kv, queue=self.queue, cut=self.cut, tape=self.tape,
                                    counters=self.counters, machine=lambda: self.machine,
                                    status_every_s=self.cfg.status_every_s)
        if self.cfg.resume:
            if not self.ckpt.exists():
                raise SyncerError(f"--resume: no checkpoint in {self.ckpt.path} (missing checkpoint.json)")
            try:   # a state format this release cannot resume is a one-line refusal naming both formats
                state = self.ckpt.read_state()
            except CheckpointError as exc:
                raise SyncerError(f"--resume: {exc}") from None
            session = self.ckpt.read_session()
            if state.run != self.run_id:
                raise SyncerError(f"--resume: checkpoint {self.ckpt.path} belongs to run {state.run!r}, not {self.run_id!r}")
            if kv_session is not None and kv_session.get("session_fingerprint") != session["session_fingerprint"]:
                raise SyncerError(
                    f"--resume: checkpoint {self.ckpt.path} holds another layout (session fingerprint "
                    f"{session['session_fingerprint'][:12]}…) than run {self.run_id}'s state KV "
                    f"({kv_session.get('session_fingerprint', '?')[:12]}…)")
            if len(session["fragments"]) != mc.fragments:
                raise SyncerError(f"--resume: checkpoint has {len(session['fragments'])} fragments, --fragments is {mc.fragments}")
            own = list(mc.own_fragments)
            if mc.sharded and sorted(state.versions) != own:
                # Another shard's directory, or one written with another --shards.
                raise SyncerError(
                    f"--resume: checkpoint {self.ckpt.path} holds fragments {sorted(state.versions)}, {self.label} "
                    f"owns {own}: wrong --checkpoint-dir, --shard or --shards?")
            commit = await self._kv_get(self.state_kv, self._key("commit"))
            if commit is not None:
                try:
                    check_state_format(commit, f"the state KV's {self._key('commit')} record")
                except StateFormatError as exc:
                    raise SyncerError(f"--resume: {exc}") from None
            if commit is not None and int(commit.get("committed_step", 0)) > state.committed_step:
                raise SyncerError(
                    f"--resume: state KV says step {commit['committed_step']} is committed but checkpoint "
                    f"{self.ckpt.path} holds only step {state.committed_step}: wrong checkpoint directory?")
            self.cut.set_session(session)
            self.ledger = PushLedger(committed_step=state.committed_step, hold_bytes=self.push_budget())
            for fid, fr in self.cut.frags.items():
                try:
                    fr.params, fr.momentum = self.ckpt.load_fragment(fid, state.versions[fid], fr.numel)
                except (CheckpointError, KeyError) as exc:
                    raise SyncerError(f"--resume: checkpoint {self.ckpt.path} is incomplete: {exc}") from None
            # The checkpoint is the source of truth for bytes: check it against the digests it recorded
            # (and broadcast) before serving it again.
            digests = {}
            for fid in sorted(self.cut.frags):
                digests[fid] = await asyncio.to_thread(self.cut.bulk_digest, fid, session["bulk_dtype"])
                want = state.version_digests.get(fid)
                if want is not None and digests[fid] != want:
                    raise SyncerError(
                        f"--resume: checkpoint {self.ckpt.path} fragment {fid} version {state.versions[fid]} has "
                        f"version digest {digests[fid][:12]}…, the checkpoint recorded {want[:12]}…: corrupt checkpoint")
            if not state.final:
                state = await self._redo_interrupted_merges(state)
                digests.update({fid: state.version_digests[fid] for fid in self.cut.frags if fid in state.version_digests})
            members, member_revs = await self._read_members()
            final_record = state.final_record
            if state.final and final_record is None:
                # Marked final by a syncer that kept no finalization record (before records existed):
                # the run ended then.
                final_record = {"final_step": state.committed_step, "finished": True}
            # Attempts already published: those recorded at the last commit, and (state KV `pulls`,
            # written before each pull) those launched after it.
            published = dict(state.attempts)
            pulls = await self._kv_get(self.state_kv, self._key("pulls"))
            for k, a in ((pulls or {}).get("attempts") or {}).items():
                if int(k) > state.committed_step:
                    published[int(k)] = max(published.get(int(k), 0), int(a))
            restore = {"session": session, "versions": {str(k): v for k, v in state.versions.items()},
                       "committed_step": state.committed_step, "members": members, "now": time.time(),
                       "min_attempts": {str(s): a + 1 for s, a in published.items()}, "final": final_record}
            try:
                self.machine = RoundMachine.restore(
                    mc, session, state.versions, state.committed_step, members, now=restore["now"],
                    min_attempts={s: a + 1 for s, a in published.items()}, final=final_record,
                )
            except ValueError as exc:  # flags that contradict the checkpointed session
                raise SyncerError(f"--resume: {exc}") from None
            if self.watch is not None:
                self.watch.seed_members(member_revs)
            resumed_state = {"format": state.migrated_from or FORMAT, "software": state.software,
                             "migrated_from": state.migrated_from}
            if state.migrated_from is not None:
                log.warning("resuming state format %d (written by %s) with %s: migrated to format %d in memory; the "
                            "next commit writes format %d", state.migrated_from, state.software or "a release that did "
                            "not state it", software(), FORMAT, FORMAT)
            await self.tape.write(self.recorder.start(mc, restore, time.time(), resumed_state=resumed_state),
                                  kind=INPUT_KIND)
            self._attempts_seen.update(published)
            # Bring the state KV in line with the checkpoint (the checkpoint is written first).
            await self.cut.write_commit_record(state)
            # A crash between the durable commit and its tape records: write the ones the tape lacks.
            await self.tape.retape(state)
            if mc.sharded:
                await self._resume_shard_final(state, final_record)
            elif final_record is not None and not final_record.get("finished"):
                # Finalization continues: manifests carry the f32 cut's digests (the cut is in FINAL).
                self.cut.final_digests = {fid: await asyncio.to_thread(self.cut.bulk_digest, fid, "f32")
                                       for fid in sorted(self.cut.frags)}
            if final_record is not None and final_record.get("finished"):
                log.info("run %s already finished at step %d (final cut in FINAL; export it with `yeto export`): "
                         "nothing to do", self.run_id, state.committed_step)
                # A run finished by a syncer that wrote no final record (or lost it): write it now.
                if not mc.sharded:
                    self.cut.final_digests = {fid: await asyncio.to_thread(self.cut.bulk_digest, fid, "f32")
                                              for fid in sorted(self.cut.frags)}
                versions = state.versions if not mc.sharded else \
                    {int(k): int(v) for k, v in (final_record.get("versions") or {}).items()}
                await self.cut.write_final_kv(int(final_record.get("final_step", state.committed_step)), versions)
            # A crash between the durable commit and the end of its broadcast leaves BCAST without the
            # newest version: broadcast the checkpointed cut again. Same bytes, same Nats-Msg-Ids, so
            # JetStream drops what it already holds inside the duplicate window; islands ignore a
            # version they already hold.
            if not state.final:
                for fid in sorted(self.cut.frags):
                    # Over a killed merge's unsealed chunks the committed version must land, not be dropped
                    # as a duplicate of its first broadcast: new Nats-Msg-Ids (as a re-broadcast's).
                    resend = time.time_ns() // 1_000_000 if fid in self._unsealed else None
                    await self.cut.broadcast(fid, state.versions[fid], digests[fid], resend=resend)
            log.info("resumed run %s from %s at step %d, versions %s", self.run_id, self.ckpt.path,
                     state.committed_step, state.versions)
            nxt = mc.next_own_step(state.committed_step)
            await self.tape.write({"kind": "restart", "step": nxt, "fragment": mc.fragment_of(nxt),
                                   "attempt": 1, "reason": "syncer resumed from checkpoint"}, kind="restart")
            # `yeto run set`'s settings in force when the last owner stopped: back before the first round
            kept = SettingsDesk.kept_event(await self._kv_get(self.state_kv, self._key("settings")), time.time())
            self._apply((self._feed(kept) if kept is not None else []) + self._feed(Tick(now=time.time())))
        else:
            if self.ckpt.exists():
                raise SyncerError(
                    f"checkpoint directory {self.ckpt.path} already holds a checkpoint: pass --resume to continue "
                    f"it, or choose another --checkpoint-dir")
            if mc.coordinator and kv_session is not None:
                raise SyncerError(
                    f"run {self.run_id} already has a session in its state KV: pass --resume (with its checkpoint "
                    f"directory) or remove the run with `yeto run rm {self.run_id}`")
            if not mc.coordinator:
                # A follower adopts the session the coordinator pinned (a fresh follower may start
                # after it); but a commit of its own fragments means an earlier process of this shard
                # committed versions a fresh start would issue again with other bytes.
                commit = await self._kv_get(self.state_kv, self._key("commit"))
                if commit is not None:
                    raise SyncerError(
                        f"run {self.run_id}: {self.label} already committed (state KV {self._key('commit')}: step "
                        f"{commit.get('committed_step')}, versions {commit.get('versions')}): pass --resume with its "
                        f"checkpoint directory, or remove the run with `yeto run rm {self.run_id}`")
            self.machine = RoundMachine(mc)
            await self.tape.write(self.recorder.start(mc, None, time.time()), kind=INPUT_KIND)

    async def _resume_shard_final(self, state, final_record: dict | None) -> None:
        """Sharded --resume after this shard's final cut (or, on the coordinator, the manifest): the own
        fragments' f32 digests again (the cut is in FINAL: same bytes as the checkpoint's), `final.<K>`
        written again if the crash came before it, and on the coordinator every other shard's digests
        from their `final.<K>` records (needed for manifests and the run's `final` key)."""
        mc = self.cfg.machine
        if final_record is None:
            return
        own = {fid: await asyncio.to_thread(self.cut.bulk_digest, fid, "f32") for fid in sorted(self.cut.frags)}
        self.cut.final_digests.update(own)
        key = SH.final_key(self.shard)
        if await self._kv_get(self.state_kv, key) is None:
            step = int(final_record.get("final_step", state.committed_step))
            log.info("writing %s again: this shard stopped after its final cut, before recording it", key)
            await self.cut.write_shard_final_kv(step, dict(state.versions), own)
        if mc.coordinator and not final_record.get("shard_final"):
            # The manifest was recorded, so every shard's final record was in: read them back.
            for k in range(1, self.shards):
                e = await self._kv_entry(self.state_kv, SH.final_key(k))
                if e is None:
                    raise SyncerError(f"--resume: the manifest is recorded but the state KV lacks {SH.final_key(k)} "
                                      f"(shard {k}'s final cut digests): was the run's state KV removed?")
                try:
                    _, _, digs = parse_shard_final(k, e.value, fragments=mc.fragments, shards=self.shards)
                except ShardRecordError as exc:
                    raise SyncerError(f"--resume: state KV {SH.final_key(k)}: {exc}") from None
                self.cut.final_digests.update(digs)

    # ---- the machine loop -------------------------------------------------------------------------

    @staticmethod
    async def _kv_entry(kv, key: str):
        """The KV entry of `key`, None when absent or deleted (an empty value is a delete marker)."""
        from nats.js.errors import KeyNotFoundError

        try:
            e = await kv.get(key)
        except KeyNotFoundError:
            return None
        return e if e is not None and e.value else None

    @classmethod
    async def _kv_get(cls, kv, key: str):
        e = await cls._kv_entry(kv, key)
        return None if e is None else orjson.loads(e.value)

    async def _read_members(self) -> tuple[dict[str, dict], dict[str, int]]:
        """Every record of the members KV, and each one's revision. Read from the bucket's stream (its subjects, then a get per
        key) rather than nats-py's `kv.keys()`: that watcher can report no keys while the first
        entries are still in flight (NoKeysError right after connecting), and a resumed syncer that
        takes it for "no members" ignores every island. An error is retried, then stops the syncer;
        it is never read as an empty bucket."""
        from nats.js.errors import KeyNotFoundError

        kv = self.members_kv
        last_exc = None
        for attempt in range(10):
            try:
                info = await self.js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
                out, revs = {}, {}
                for subject in sorted(info.state.subjects or {}):
                    key = subject[len(kv._pre):]
                    try:
                        e = await kv.get(key)
                    except KeyNotFoundError:  # deleted or purged
                        continue
                    if e is not None and e.value:
                        out[key] = orjson.loads(e.value)
                        revs[key] = e.revision
                if info.state.messages and not info.state.subjects:
                    raise SyncerError(f"members bucket holds {info.state.messages} messages but listed no keys")
                return out, revs
            except Exception as exc:  # noqa: BLE001 - a broker that just came up, a timeout: retry
                last_exc = exc
                self.counters["members_read_retry"] += 1
                log.warning("reading the members KV failed (attempt %d): %r", attempt + 1, exc)
                await asyncio.sleep(min(0.2 * 2 ** attempt, 3.0))
        raise SyncerError(f"--resume: cannot read the members KV of run {self.run_id}: {last_exc!r}")
