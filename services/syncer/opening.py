"""The round machine a syncer process starts with (docs/design.md §8, §11): a fresh one, once the checks say
no earlier process of this shard committed; or one resumed from the checkpoint directory (`--resume`, or a
takeover: services/syncer/run_claim.py), checked against the run's state KV and the digests it recorded,
with interrupted merges redone, the commit record and the tape brought in line with the checkpoint, a
shard's final cut re-recorded, the members read back and the checkpointed cut broadcast again. Runs once,
before the shell's main loop (services/syncer/service.py), in two steps: `open` reads and checks what the
run left and builds the machine (the shell holds it from then on, so an exit on a failure further on still
writes its status record), `settle` then brings the state KV, the tape and BCAST in line with the checkpoint.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import orjson

from yeto.schemas import shards as SH
from yeto.schemas.versions import StateFormatError, check_state_format, software
from yeto.services.syncer.checkpoint import FORMAT, CheckpointError, CheckpointState
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.cut import CutPublisher
from yeto.services.syncer.errors import SyncerError
from yeto.services.syncer.events import Reconfigure
from yeto.services.syncer.intake import PushLedger
from yeto.services.syncer.kv_reads import kv_entry, kv_json
from yeto.services.syncer.merge import Merger
from yeto.services.syncer.model_store import ModelStore
from yeto.services.syncer.recording import INPUT_KIND, InputRecorder
from yeto.services.syncer.rounds import RoundMachine
from yeto.services.syncer.settings_desk import SettingsDesk
from yeto.services.syncer.shard_watch import ShardRecordError, parse_shard_final
from yeto.services.syncer.tape import TapeWriter

log = logging.getLogger("yeto.syncer")


@dataclass(frozen=True)
class Resumed:
    """What `settle` needs of a resume's checks: the checkpoint state after the redone merges, the version
    digests checked, the finalization record, and what the tape's first input record says."""
    state: CheckpointState
    digests: dict[int, str]
    final_record: dict | None
    restore: dict
    resumed_state: dict
    unsealed: frozenset[int]   # fragments whose BCAST holds a killed merge's unsealed chunks


@dataclass(frozen=True)
class Opened:
    """What the shell runs with: the machine, and on a resume (`resumed`) the attempts already published
    (step -> highest) and the members records' revisions the machine holds (a follower's ShardWatch feeds
    only newer ones)."""
    machine: RoundMachine
    resumed: Resumed | None = None
    attempts: dict[int, int] = field(default_factory=dict)
    member_revs: dict[str, int] = field(default_factory=dict)


class RunOpening:
    def __init__(self, mc: SyncerConfig, *, resume: bool, js, state_kv, members_kv, model: ModelStore,
                 publisher: CutPublisher, ledger: PushLedger, tape: TapeWriter, recorder: InputRecorder,
                 counters: Counter, label: str, new_merger: Callable[[], Merger], push_budget: Callable[[], int]):
        self.mc, self.resume, self.js, self.state_kv, self.members_kv = mc, resume, js, state_kv, members_kv
        self.model, self.publisher, self.ledger, self.tape, self.recorder = model, publisher, ledger, tape, recorder
        self.ckpt = model.ckpt   # read here (the checkpoint a resume continues); the model store writes it
        self.counters, self.label = counters, label
        self.new_merger = new_merger      # a merger as the shell builds them (the redo of an interrupted merge)
        self.push_budget = push_budget    # the push bytes the ledger keeps, once the session is known
        self.run_id = mc.run

    def _key(self, name: str) -> str:
        """This shard's state KV key `name`: `<name>.<K>` when sharded (schemas/shards.py)."""
        return SH.state_key(name, self.mc.shard, self.mc.shards)

    async def open(self) -> Opened:
        kv_session = await kv_json(self.state_kv, "session")
        if self.resume:
            return await self._resume(kv_session)
        mc = self.mc
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
            commit = await kv_json(self.state_kv, self._key("commit"))
            if commit is not None:
                raise SyncerError(
                    f"run {self.run_id}: {self.label} already committed (state KV {self._key('commit')}: step "
                    f"{commit.get('committed_step')}, versions {commit.get('versions')}): pass --resume with its "
                    f"checkpoint directory, or remove the run with `yeto run rm {self.run_id}`")
        machine = RoundMachine(mc)
        await self.tape.write(self.recorder.start(mc, None, time.time()), kind=INPUT_KIND)
        return Opened(machine)

    async def _resume(self, kv_session: dict | None) -> Opened:
        mc = self.mc
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
        if session.get("outer") != mc.outer:
            raise SyncerError(f"--resume: checkpoint {self.ckpt.path} was pinned with outer "
                              f"{session.get('outer') or 'diloco (dense)'}, this syncer's --outer gives "
                              f"{mc.outer or 'diloco (dense)'}")
        if len(session["fragments"]) != mc.fragments:
            raise SyncerError(f"--resume: checkpoint has {len(session['fragments'])} fragments, --fragments is {mc.fragments}")
        own = list(mc.own_fragments)
        if mc.sharded and sorted(state.versions) != own:
            # Another shard's directory, or one written with another --shards.
            raise SyncerError(
                f"--resume: checkpoint {self.ckpt.path} holds fragments {sorted(state.versions)}, {self.label} "
                f"owns {own}: wrong --checkpoint-dir, --shard or --shards?")
        commit = await kv_json(self.state_kv, self._key("commit"))
        if commit is not None:
            try:
                check_state_format(commit, f"the state KV's {self._key('commit')} record")
            except StateFormatError as exc:
                raise SyncerError(f"--resume: {exc}") from None
        if commit is not None and int(commit.get("committed_step", 0)) > state.committed_step:
            raise SyncerError(
                f"--resume: state KV says step {commit['committed_step']} is committed but checkpoint "
                f"{self.ckpt.path} holds only step {state.committed_step}: wrong checkpoint directory?")
        self.model.set_session(session)
        self.ledger.resume(state.committed_step, hold_bytes=self.push_budget())
        try:
            self.model.load(state.versions, state.chains)
        except (CheckpointError, KeyError) as exc:
            raise SyncerError(f"--resume: checkpoint {self.ckpt.path} is incomplete: {exc}") from None
        # The checkpoint is the source of truth for bytes: check it against the digests it recorded
        # (and broadcast) before serving it again.
        digests = {}
        for fid in sorted(self.model.frags):
            digests[fid] = await asyncio.to_thread(self.model.bulk_digest, fid, session["bulk_dtype"])
            want = state.version_digests.get(fid)
            if want is not None and digests[fid] != want:
                raise SyncerError(
                    f"--resume: checkpoint {self.ckpt.path} fragment {fid} version {state.versions[fid]} has "
                    f"version digest {digests[fid][:12]}…, the checkpoint recorded {want[:12]}…: corrupt checkpoint")
        unsealed: set[int] = set()
        if not state.final:
            state = await self._redo_interrupted_merges(state, unsealed)
            digests.update({fid: state.version_digests[fid] for fid in self.model.frags if fid in state.version_digests})
        members, member_revs = await self._read_members()
        final_record = state.final_record
        if state.final and final_record is None:
            # Marked final by a syncer that kept no finalization record (before records existed):
            # the run ended then.
            final_record = {"final_step": state.committed_step, "finished": True}
        # Attempts already published: those recorded at the last commit, and (state KV `pulls`,
        # written before each pull) those launched after it.
        published = dict(state.attempts)
        pulls = await kv_json(self.state_kv, self._key("pulls"))
        for k, a in ((pulls or {}).get("attempts") or {}).items():
            if int(k) > state.committed_step:
                published[int(k)] = max(published.get(int(k), 0), int(a))
        restore = {"session": session, "versions": {str(k): v for k, v in state.versions.items()},
                   "committed_step": state.committed_step, "members": members, "now": time.time(),
                   "min_attempts": {str(s): a + 1 for s, a in published.items()}, "final": final_record}
        try:
            machine = RoundMachine.restore(
                mc, session, state.versions, state.committed_step, members, now=restore["now"],
                min_attempts={s: a + 1 for s, a in published.items()}, final=final_record,
            )
        except ValueError as exc:  # flags that contradict the checkpointed session
            raise SyncerError(f"--resume: {exc}") from None
        resumed = Resumed(state, digests, final_record, restore, unsealed=frozenset(unsealed), resumed_state={
            "format": state.migrated_from or FORMAT, "software": state.software, "migrated_from": state.migrated_from})
        return Opened(machine, resumed, attempts=published, member_revs=member_revs)

    async def settle(self, opened: Opened) -> Reconfigure | None:
        """After a resume (nothing to do after a fresh start): the tape's first input record, the state KV
        and the tape in line with the checkpoint, a finished or finishing run's final records, the committed
        cut broadcast again. Returns what the machine is fed before its first round besides a Tick: `yeto
        run set`'s settings in force when the last owner stopped (None: none kept)."""
        if opened.resumed is None:
            return None
        mc, r = self.mc, opened.resumed
        state, final_record = r.state, r.final_record
        if state.migrated_from is not None:
            log.warning("resuming state format %d (written by %s) with %s: migrated to format %d in memory; the "
                        "next commit writes format %d", state.migrated_from, state.software or "a release that did "
                        "not state it", software(), FORMAT, FORMAT)
        await self.tape.write(self.recorder.start(mc, r.restore, time.time(), resumed_state=r.resumed_state),
                              kind=INPUT_KIND)
        # Bring the state KV in line with the checkpoint (the checkpoint is written first).
        await self.model.write_commit_record(state)
        # A crash between the durable commit and its tape records: write the ones the tape lacks.
        await self.tape.retape(state)
        if mc.sharded:
            await self._resume_shard_final(state, final_record)
        elif final_record is not None and not final_record.get("finished"):
            # Finalization continues: manifests carry the f32 cut's digests (the cut is in FINAL).
            self.publisher.add_final_digests(await self.publisher.final_cut_digests())
        if final_record is not None and final_record.get("finished"):
            log.info("run %s already finished at step %d (final cut in FINAL; export it with `yeto export`): "
                     "nothing to do", self.run_id, state.committed_step)
            # A run finished by a syncer that wrote no final record (or lost it): write it now.
            if not mc.sharded:
                self.publisher.add_final_digests(await self.publisher.final_cut_digests())
            versions = state.versions if not mc.sharded else \
                {int(k): int(v) for k, v in (final_record.get("versions") or {}).items()}
            await self.publisher.write_final_kv(int(final_record.get("final_step", state.committed_step)), versions)
        # A crash between the durable commit and the end of its broadcast leaves BCAST without the
        # newest version: broadcast the checkpointed cut again. Same bytes, same Nats-Msg-Ids, so
        # JetStream drops what it already holds inside the duplicate window; islands ignore a
        # version they already hold.
        if not state.final:
            for fid in sorted(self.model.frags):
                # Over a killed merge's unsealed chunks the committed version must land, not be dropped
                # as a duplicate of its first broadcast: new Nats-Msg-Ids (as a re-broadcast's).
                resend = time.time_ns() // 1_000_000 if fid in r.unsealed else None
                await self.publisher.broadcast(fid, state.versions[fid], r.digests[fid], resend=resend)
        log.info("resumed run %s from %s at step %d, versions %s", self.run_id, self.ckpt.path,
                 state.committed_step, state.versions)
        nxt = mc.next_own_step(state.committed_step)
        await self.tape.write({"kind": "restart", "step": nxt, "fragment": mc.fragment_of(nxt),
                               "attempt": 1, "reason": "syncer resumed from checkpoint"}, kind="restart")
        # `yeto run set`'s settings in force when the last owner stopped: back before the first round
        return SettingsDesk.kept_event(await kv_json(self.state_kv, self._key("settings")), time.time())

    async def _redo_interrupted_merges(self, state: CheckpointState, unsealed: set[int]) -> CheckpointState:
        """--resume: a cut-through merge the killed syncer had begun (its intent names the version after
        the checkpointed one; some of its chunks may be in BCAST, and islands may hold them) is done
        again from the same pushes, so that version number gets the same bytes. Returns the checkpoint
        state after those commits. When a push is gone (PUSH's max_age passed while the syncer was
        down) it cannot be: the round restarts as usual, and islands drop the early chunks they hold
        because the new chunks differ (the seal's digest would refuse a mix anyway)."""
        for fid in sorted(self.model.frags):
            intent = await asyncio.to_thread(self.ckpt.read_intent, fid)
            if intent is None:
                continue
            merge = intent.get("merge") or {}
            if merge.get("version") != state.versions.get(fid, -1) + 1:
                continue   # stale: that version was committed (or never begun)
            log.warning("fragment %d version %d (step %d) was being merged and broadcast when the syncer stopped: "
                        "merging it again from the same pushes", fid, merge.get("version"), merge.get("step"))
            merger = self.new_merger()
            try:
                _done, seqs = await merger.redo(intent)
            except Exception as exc:  # noqa: BLE001 - a push is gone: the round restarts instead
                self.counters["merge_redo_failed"] += 1
                log.error("fragment %d version %d cannot be merged again (%r): its round restarts, and the chunks the "
                          "killed syncer sent are replaced", fid, merge.get("version"), exc)
                await self.tape.write({"kind": "error", "t": time.time(), "step": merge.get("step"), "fragment": fid,
                                       "reason": f"interrupted merge of version {merge.get('version')} not redone: {exc!r}"},
                                      kind="error")
                await asyncio.to_thread(self.model.drop_intent, fid)
                unsealed.add(fid)
                # The restarted round gives this version number other bytes: new Nats-Msg-Ids for them.
                self.publisher.reissue_version(fid, merge.get("version"), time.time_ns() // 1_000_000)
                continue
            self.counters["merge_redone"] += 1
            await merger.cleanup(fid, seqs)
            state = await asyncio.to_thread(self.ckpt.read_state)
        return state

    async def _resume_shard_final(self, state: CheckpointState, final_record: dict | None) -> None:
        """Sharded --resume after this shard's final cut (or, on the coordinator, the manifest): the own
        fragments' f32 digests again (the cut is in FINAL: same bytes as the checkpoint's), `final.<K>`
        written again if the crash came before it, and on the coordinator every other shard's digests
        from their `final.<K>` records (needed for manifests and the run's `final` key)."""
        mc = self.mc
        if final_record is None:
            return
        own = await self.publisher.final_cut_digests()
        self.publisher.add_final_digests(own)
        key = SH.final_key(mc.shard)
        if await kv_json(self.state_kv, key) is None:
            step = int(final_record.get("final_step", state.committed_step))
            log.info("writing %s again: this shard stopped after its final cut, before recording it", key)
            await self.publisher.write_shard_final_kv(step, dict(state.versions), own)
        if mc.coordinator and not final_record.get("shard_final"):
            # The manifest was recorded, so every shard's final record was in: read them back.
            for k in range(1, mc.shards):
                e = await kv_entry(self.state_kv, SH.final_key(k))
                if e is None:
                    raise SyncerError(f"--resume: the manifest is recorded but the state KV lacks {SH.final_key(k)} "
                                      f"(shard {k}'s final cut digests): was the run's state KV removed?")
                try:
                    _, _, digs = parse_shard_final(k, e.value, fragments=mc.fragments, shards=mc.shards)
                except ShardRecordError as exc:
                    raise SyncerError(f"--resume: state KV {SH.final_key(k)}: {exc}") from None
                self.publisher.add_final_digests(digs)

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
