"""The global model as a syncer holds it (docs/design.md §4.6, §4.7, §11): the session, every own fragment's
f32 params and momentum, and their durable copies — the checkpoint directory (checkpoint.py), the committed
state kept in JetStream for a standby on another host (`--state-store jetstream`, state_store.py) and the
state KV's `commit` record, written revision-checked once this process owns the run (fencing, lease.py).

This store is their only writer: INIT chunks (intake), a resume's load and a failed redo's reload, the
merge's outer step (`update`, span by span, in place) and the durable half of every commit all go through
its methods. What the islands read of the model — BCAST, FINAL, the manifests — is the cut publisher's
(services/syncer/cut.py), which reads the params here and asks this store to make a version durable
before its seal goes out.

Syncer shards (schemas/shards.py): a shard's store holds its own fragments only (`set_session` keeps
those), so params and momentum take memory per shard; its commit record is `commit.<K>`.
The sparse outer mode (docs/design.md §4.10) has no momentum: a fragment's is None, and neither the
checkpoint nor the state KV holds one (`OM.has_momentum`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import orjson
import torch

from yeto.schemas import outer_mode as OM
from yeto.schemas import shards as SH, versions
from yeto.schemas.chunks import VersionDigest, chunk_plan
from yeto.schemas.dtypes import pack
from yeto.schemas.provision import kv_put
from yeto.services.syncer import state_chain as SC
from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointState, VersionFiles
from yeto.services.syncer.lease import Fenced
from yeto.services.syncer.state_store import WARM_DIR, StateStore, StateStream


def _chain_of(state: CheckpointState, fid: int) -> SC.Chain | None:
    """The chain `state` keeps fragment `fid` as (a full version alone where it names none)."""
    if fid in state.chains:
        return state.chains[fid]
    v = state.versions.get(fid)
    return None if v is None else SC.full(v, state.version_digests.get(fid))


def _digest_before(state: CheckpointState, fid: int, version: int) -> str | None:
    return state.version_digests.get(fid) if state.versions.get(fid) == version - 1 else None


@dataclass(frozen=True)
class Frag:
    """One own fragment: its size, and its params and momentum once INIT or a checkpoint gave them (momentum
    None in the sparse mode). Frozen: the store replaces a fragment's record when it loads other tensors,
    and steps the tensors in place."""
    numel: int
    params: torch.Tensor | None = None
    momentum: torch.Tensor | None = None


async def _no_guard() -> None:
    """No lease (a store used on its own: tests, tools)."""


class ModelStore:
    def __init__(self, js, run_id: str, counters: Counter, ckpt: CheckpointDir, *, shard: int = 0, shards: int = 1,
                 state_store: StateStore | None = None, guard: Callable[[], Awaitable[None]] = _no_guard):
        self.js, self.run_id, self.counters, self.ckpt = js, run_id, counters, ckpt
        self.shard, self.shards = shard, shards
        # The committed state kept in JetStream for a standby on another host (state_store.py); None: the
        # checkpoint directory only (`--state-store local`).
        self.state_store = state_store
        # Before every durable write: raises Fenced once the lease is not ours to trust (lease.py).
        self.guard = guard
        # Fencing: the commit record's revision this owner wrote last (None: unconditional writes, until `fence`).
        self.commit_rev: int | None = None
        self.session: dict | None = None
        self.frags: dict[int, Frag] = {}          # this shard's fragments (every fragment with one shard)

    # ---- what it holds (read by intake, the merge, the publisher) --------------------------------------

    def owns(self, fid: int) -> bool:
        return SH.owns(fid, self.shard, self.shards)

    def bulk_digest(self, fid: int, dtype: str) -> str:
        fr = self.frags[fid]
        h = VersionDigest()
        for s in chunk_plan(fr.numel, dtype, self.session["chunk_bytes"]):
            h.update(pack(fr.params[s.elem_offset: s.elem_offset + s.elem_count], dtype))
        return h.hexdigest()

    def read_state(self) -> CheckpointState:
        return self.ckpt.read_state()

    @property
    def momentum(self) -> bool:
        """Whether this run keeps an outer momentum (dense) or not (sparse): what is held and written."""
        return OM.has_momentum(self.session)

    # ---- the session and the tensors ------------------------------------------------------------------

    def set_session(self, session: dict) -> None:
        self.session = session
        for f in session["fragments"]:
            if self.owns(f["id"]) and f["id"] not in self.frags:   # another shard's fragment never takes memory here
                self.frags[f["id"]] = Frag(numel=f["numel"])

    def write_session(self, session: dict) -> None:
        """The pinned (or adopted) session into the checkpoint directory (a file the resume reads)."""
        self.ckpt.write_session(session)

    def init_chunk(self, fid: int, elem_offset: int, values: torch.Tensor) -> None:
        """INIT: one chunk of version 0's params (momentum starts at zero; none in the sparse mode)."""
        fr = self.frags[fid]
        params = fr.params
        if params is None:
            params = torch.zeros(fr.numel, dtype=torch.float32)
            self.frags[fid] = Frag(fr.numel, params,
                                   torch.zeros(fr.numel, dtype=torch.float32) if self.momentum else None)
        params[elem_offset: elem_offset + values.numel()] = values

    def load(self, versions: dict[int, int], chains: dict | None = None) -> None:
        """--resume: every own fragment's params and momentum at `versions` from the checkpoint directory
        (CheckpointError when a file is missing or short, KeyError when a fragment has no version);
        `chains`: the manifest's (a version kept as updates: state_chain.py)."""
        for fid, fr in list(self.frags.items()):
            self.frags[fid] = Frag(fr.numel, *self.ckpt.load_fragment(fid, versions[fid], fr.numel,
                                                                      momentum=self.momentum,
                                                                      chain=(chains or {}).get(fid)))

    async def reload(self, fid: int, version: int) -> None:
        """Back to a checkpointed version, read again from its files (a redo that failed may have stepped
        some spans) rather than a whole copy held beside the fragment."""
        fr = self.frags[fid]
        chain = self.ckpt.read_state().chains.get(fid) if self.ckpt.exists() else None
        params, momentum = await asyncio.to_thread(self.ckpt.load_fragment, fid, version, fr.numel,
                                                   momentum=self.momentum, chain=chain)
        self.frags[fid] = Frag(fr.numel, params, momentum)

    def update(self, fid: int, elem_offset: int, elem_count: int,
               step: Callable[[torch.Tensor, torch.Tensor | None], Any]):
        """The merge's outer step on one span, in place: `step(params[span], momentum[span])` (momentum None in
        the sparse mode), whose result is returned. The spans' new bytes are then packed, written and
        broadcast before the next commit of this fragment (the commit order: one merge of a fragment at a time)."""
        fr = self.frags[fid]
        sl = slice(elem_offset, elem_offset + elem_count)
        return step(fr.params[sl], None if fr.momentum is None else fr.momentum[sl])

    # ---- the durable copies ---------------------------------------------------------------------------

    def version_files(self, fid: int, version: int, *, thread: bool) -> VersionFiles:
        """The new version's checkpoint files, written span by span as the merge makes them."""
        fr = self.frags[fid]
        return VersionFiles(self.ckpt, fid, version, fr.params, fr.momentum, thread=thread)

    def _full_every(self) -> int:
        outer = OM.from_session(self.session)
        return 1 if outer is None else outer.full_every

    def state_stream(self, fid: int, version: int, *, update: bool = False) -> StateStream | None:
        """The new version put into the state store span by span as the merge makes it (None: no store, or
        `update` — the merge makes the version's update message — and the store will keep that instead:
        state_chain.py)."""
        if self.state_store is None or (update and self.state_store.plans_update(fid, version, self._full_every())):
            return None
        fr = self.frags[fid]
        return self.state_store.stream(fid, version, fr.params, fr.momentum)

    async def write_intent(self, fid: int, intent: dict) -> None:
        """A merge's inputs, durable before its first chunk goes out (checkpoint.CheckpointDir.write_intent),
        and in the state store too: a standby on another host must redo the merge the same way."""
        await asyncio.to_thread(self.ckpt.write_intent, fid, intent)
        if self.state_store is not None:
            await self.state_store.put_intent(fid, intent)

    def drop_intent(self, fid: int) -> None:
        self.ckpt.drop_intent(fid)

    def dir_plans_update(self, fid: int, version: int) -> bool:
        """Whether the checkpoint directory will keep `version` as its update message (the merge then
        streams no params file): the chain rule of state_chain.py on the directory's manifest."""
        prev = self.ckpt.read_state() if self.ckpt.exists() else None
        return prev is not None and SC.writes_update(_chain_of(prev, fid), version, _digest_before(prev, fid, version),
                                                     has_update=True, full_every=self._full_every())

    def next_state(self, new_versions: dict[int, int], digests: dict[int, str], *, step: int,
                   attempts: dict[int, int], records: list[dict],
                   updates: dict[int, bytes] | None = None) -> tuple[CheckpointState, CheckpointState | None]:
        """The checkpoint state after committing `new_versions` (their digests) at `step`, and the one before.
        `updates`: fragments whose update message may be kept instead of params (state_chain.py)."""
        prev = self.ckpt.read_state() if self.ckpt.exists() else None
        chains = {f: c for f, c in (prev.chains if prev else {}).items() if f not in new_versions}
        for fid, v in new_versions.items():
            old = _chain_of(prev, fid) if prev else None
            if SC.writes_update(old, v, _digest_before(prev, fid, v) if prev else None,
                                has_update=fid in (updates or {}), full_every=self._full_every()):
                chains[fid] = SC.extend(old, v, digests[fid], len(updates[fid]))
        vers = dict(prev.versions) if prev else {}
        vdig = dict(prev.version_digests) if prev else {}
        vers.update(new_versions)
        vdig.update(digests)
        state = CheckpointState(
            run=self.run_id, session_fingerprint=self.session["session_fingerprint"],
            layout_fingerprint=self.session["layout_fingerprint"],
            committed_step=max(step, prev.committed_step if prev else 0), versions=vers, version_digests=vdig,
            attempts={s: a for s, a in attempts.items() if s > step}, chains=chains,
            tape=list(records) + [{"kind": "commit", "t": time.time(), "step": step, "fragment": fid, "version": v,
                                   "detail": {"version_digest": digests[fid]}} for fid, v in new_versions.items()],
        )
        return state, prev

    async def save_checkpoint(self, state: CheckpointState, fids, streamed: dict[int, VersionFiles],
                              updates: dict[int, bytes] | None = None) -> None:
        """The new versions' files (streamed ones only fsynced and renamed; `updates`: the update messages
        of the versions the state's chains keep so) and the manifest naming them;
        older files stay until `prune` (the version is out by then)."""
        await self.guard()   # a deposed owner writes no checkpoint (lease.py): the directory may be a standby's too
        frags = {fid: (self.frags[fid].params, self.frags[fid].momentum) for fid in fids}
        await asyncio.to_thread(self.ckpt.commit, state, frags, streamed, prune=False, updates=updates)

    async def save_state_store(self, state: CheckpointState, fids, prev: CheckpointState | None,
                               stored: dict[int, StateStream] | None, updates: dict[int, bytes] | None = None) -> float:
        """The new versions into the state store (those the merge streamed: their acks only; `updates`: the
        sparse mode's update messages, kept instead of the params where the chain allows), then its
        manifest; returns the seconds it took (0 without a store)."""
        if self.state_store is None:
            return 0.0
        frags = {fid: (self.frags[fid].params, self.frags[fid].momentum) for fid in fids}
        previous = {fid: prev.versions[fid] for fid in fids if prev and fid in prev.versions}
        before = {fid: prev.version_digests.get(fid) for fid in fids
                  if prev and prev.versions.get(fid) == state.versions[fid] - 1}
        return await self.state_store.save(state, frags, previous, streamed=stored, updates=updates,
                                           digests_before=before, full_every=self._full_every())

    async def prune(self, state: CheckpointState, fids) -> None:
        await asyncio.to_thread(self.ckpt.prune, state, fids)

    async def mark_final(self, record: dict) -> CheckpointState:
        """The checkpoint (and the state store's manifest) marked final with the machine's finalization record."""
        def write():
            st = dataclasses.replace(self.ckpt.read_state(), final=True, final_record=dict(record))
            self.ckpt.commit(st, {})
            return st
        st = await asyncio.to_thread(write)
        if self.state_store is not None:
            await self.state_store.save_manifest(st)
        return st

    def fence(self, commit_rev: int) -> None:
        """This process owns the run now (services/syncer/run_claim.py): the commit record is written
        revision-checked from `commit_rev`, the revision it holds now (see put_commit_record)."""
        self.commit_rev = commit_rev

    async def write_commit_record(self, state: CheckpointState) -> None:
        # stamped with the state format and this release (schemas/versions.py): a record without them is format 1
        rec = versions.stamp({"committed_step": state.committed_step,
                              "versions": {str(k): v for k, v in state.versions.items()},
                              "version_digests": {str(k): v for k, v in state.version_digests.items()}})
        await self.put_commit_record(orjson.dumps(rec))

    async def put_commit_record(self, value: bytes) -> None:
        """The commit record, revision-checked once this process owns the run (`fence`, lease.py): a new
        owner rewrites it first, so a deposed owner's write (and with it the seal, which follows it) fails
        instead of landing after the takeover."""
        from nats.js.errors import APIError

        await self.guard()
        key = SH.state_key("commit", self.shard, self.shards)
        try:
            ack = await kv_put(self.js, self.run_id, "state", key, value, counters=self.counters,
                               expected_rev=self.commit_rev)
        except APIError as exc:
            if self.commit_rev is not None and exc.err_code in (10071, 10164):
                raise Fenced(f"the state KV's {key!r} record moved on from revision {self.commit_rev} (another "
                             f"syncer owns the run now): this process publishes nothing more") from None
            raise
        if self.commit_rev is not None:
            self.commit_rev = ack.seq

    # ---- a takeover's copy of the committed state (state_store.py) ------------------------------------

    @property
    def warm_path(self):
        return self.ckpt.path / WARM_DIR

    async def has_stored_state(self) -> bool:
        return self.state_store is not None and await self.state_store.has_state()

    async def warm(self, numels: dict[int, int], *, momentum: bool = True, session: dict | None = None) -> int:
        """A standby's pass over the warm copy (state_store.StateStore.warm); the fragments fetched.
        `momentum`: the run's session keeps one (dense); a standby may hold no session yet, so it is told
        (`session`: what reading a version held as updates needs)."""
        return await self.state_store.warm(CheckpointDir(self.warm_path), numels, momentum=momentum,
                                           session=session)

    async def drop_warm(self) -> None:
        await asyncio.to_thread(shutil.rmtree, self.warm_path, True)

    async def restore(self, session: dict, numels: dict[int, int]) -> CheckpointState:
        """The committed state from the state store into the (empty) checkpoint directory, the warm copy's
        fragments moved into place; the warm copy goes after."""
        warm = self.warm_path
        state = await self.state_store.restore_into(self.ckpt, session, numels,
                                                    warm=CheckpointDir(warm) if warm.is_dir() else None)
        await self.drop_warm()
        return state

    async def purge_unnamed(self) -> None:
        if self.state_store is not None:   # what a save torn by the previous owner's death left (state_store.py)
            await self.state_store.purge_unnamed()
