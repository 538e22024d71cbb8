"""The syncer's committed state in JetStream (docs/design.md §8, §11): what a standby on another host, with an
empty `--checkpoint-dir`, needs to continue the run — the committed params and momentum of every fragment
(params alone in the sparse outer mode, which has none: §4.10), the checkpoint manifest, and the merge
intents — kept in the run's `ckpt` KV bucket (its `--replicas`; the keys: `StateStore`'s doc and §3.2), a
bucket of its own because only the syncer identity may read it. The checkpoint directory stays the owner's
working copy (resume and `yeto export` read it); this outlives the host. A standby keeps the cut warm (`warm`).
Invariants, as in the directory: a version's chunks, then the manifest that names it, then the previous
version's chunks are purged; a crash in between leaves the old manifest naming complete old chunks (or a
leftover of chunks no manifest names, which the next owner purges when it starts: `purge_unnamed`). The
save runs before the commit record and the seal ("durable before the seal"), under the lease's guard. A
restore writes everything into a checkpoint directory, and the resume there checks every fragment
against the version digests it recorded, warm or not.
KV keys and not the Object Store: nats-py's object store client is too slow for large objects
(docs/design.md §15.3); these are the same chunked, pipelined publishes the broadcast uses.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import Counter
from typing import Awaitable, Callable

import numpy as np
import orjson
import torch

from yeto.schemas import outer_mode as OM
from yeto.schemas import subjects as S
from yeto.schemas.provision import kv_put
from yeto.schemas.publish import Pipeline
from yeto.schemas.stream_configs import kv_stream_name
from yeto.services.syncer import state_chain as SC
from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointState, sha256_of

log = logging.getLogger("yeto.syncer")

ELEM = 4   # f32
FETCH_WINDOW = 16            # chunk gets in flight at once in a restore or a warm pass
WARM_DIR = ".standby-warm"   # inside the standby's checkpoint directory: same filesystem, so a takeover renames


class _Gone(RuntimeError):
    """A chunk the manifest named is not (or no longer) in the KV; the message names it."""


async def _no_guard() -> None:
    return None


class StateStore:
    """One shard's committed state in the `ckpt` KV (see the module doc). Keys (`<K>` is 0 with one shard):

      `ckpt.<K>.manifest`          the CheckpointState JSON and the chunk size
      `ckpt.<K>.f<F>.v<N>.p.<k>`   params of fragment F at version N, chunk k (raw little-endian f32)
      `ckpt.<K>.f<F>.v<N>.m.<k>`   its momentum, chunk k (none in the sparse mode)
      `ckpt.<K>.f<F>.v<N>.u.<k>`   the sparse mode with an f32 bulk: version N as the update message from
                                   N−1 (byte chunks of the same size), in place of its params; the
                                   manifest's `chains` names the full version and updates a reader
                                   needs (state_chain.py), and a save purges what no chain needs
      `ckpt.<K>.intent.f<F>`       the merge intent (checkpoint.CheckpointDir.write_intent), before a
                                   cut-through version's first chunk goes out
    """

    def __init__(self, js, run_id: str, kv, counters: Counter, *, shard: int, chunk_bytes: int,
                 guard: Callable[[], Awaitable[None]] = _no_guard):
        self.js, self.run_id, self.kv, self.counters = js, run_id, kv, counters
        self.shard = shard
        self.chunk_elems = max(1, chunk_bytes // ELEM)
        self.guard = guard
        # Per fragment the chain the last manifest this store read or wrote names (state_chain.py);
        # None until read (`_load_chains`): the next save's updates continue it, its purges follow it.
        self.chains: dict[int, SC.Chain] | None = None

    def key(self, *parts) -> str:
        return ".".join(["ckpt", str(self.shard), *map(str, parts)])

    def stream(self, fid: int, version: int, params: torch.Tensor, momentum: torch.Tensor | None) -> "StateStream":
        """A new version's chunks, put as they become final (StateStream): the merge puts them while it
        makes them, and `save` then only waits for their acks before the manifest. momentum None: the
        params only (the sparse mode)."""
        return StateStream(self, fid, version, params, momentum)

    async def put_chunk(self, pipe: Pipeline, fid: int, version: int, kind: str, k: int, piece: torch.Tensor,
                        attempt: int) -> None:
        await self.guard()
        key = self.key(f"f{fid}", f"v{version}", kind, k)
        await pipe.put(S.kv_key(self.run_id, "ckpt", key), piece.contiguous().view(torch.uint8).numpy(),
                       f"kv.state.{key}.{attempt}")
        self.counters["state_store.chunks"] += 1

    def plans_update(self, fid: int, version: int, full_every: int) -> bool:
        """Whether the save of `version` will write its update message, not its params, as far as the chain
        held tells (the merge then streams no params; `save` checks the digest too and, should it not
        match, puts the params whole)."""
        prev = (self.chains or {}).get(fid)
        return prev is not None and SC.writes_update(prev, version, prev.digests[-1], has_update=True,
                                                     full_every=full_every)

    async def save(self, state: CheckpointState, frags: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
                   previous: dict[int, int], streamed: dict[int, "StateStream"] | None = None, *,
                   updates: dict[int, bytes] | None = None, digests_before: dict[int, str] | None = None,
                   full_every: int = 1) -> float:
        """The new versions, then the manifest, then the chunks no chain needs any more go. `streamed`:
        fragments whose chunks the merge already put (StateStream): only their acks are waited for here;
        the others are put now — as their update message (`updates`, the sparse f32 mode) where
        state_chain.writes_update allows (`digests_before`: the digests of the versions before), else their
        params and momentum. Returns the seconds it took (the commit's `state_store_s`)."""
        t0 = time.perf_counter()
        if self.chains is None:
            await self._load_chains()
        streams = dict(streamed or {})
        for fid, st in streams.items():
            if st.version != state.versions[fid]:
                raise RuntimeError(f"fragment {fid}: version {st.version} was streamed, the commit names "
                                   f"{state.versions[fid]}")
        written: dict[int, SC.Chain] = {}
        pipe = None
        for fid, (params, momentum) in sorted(frags.items()):
            v, digest, old = state.versions[fid], state.version_digests.get(fid), self.chains.get(fid)
            if fid not in streams and SC.writes_update(old, v, (digests_before or {}).get(fid),
                                                       has_update=fid in (updates or {}), full_every=full_every):
                pipe = pipe or Pipeline(self.js, timeout=10.0, counters=self.counters)
                await self._put_update(pipe, fid, v, updates[fid])
                written[fid] = SC.extend(old, v, digest, len(updates[fid]))
                continue
            if fid not in streams:   # every chunk put now (each stream bounds its bytes in flight)
                streams[fid] = self.stream(fid, v, params, momentum)
                await streams[fid].put_ready(params.numel())
            written[fid] = SC.full(v, digest)
        for _, st in sorted(streams.items()):
            await st.flush()
        if pipe is not None:
            await pipe.flush()
        old_chains = dict(self.chains)
        await self.save_manifest(state, {**old_chains, **written})
        for fid, new in sorted(written.items()):
            gone = set(SC.purgeable(old_chains.get(fid), new))
            if fid in previous and previous[fid] not in new.versions:
                gone.add(previous[fid])
            for old in sorted(gone):
                await self._purge(fid, old)
        return time.perf_counter() - t0

    async def _put_update(self, pipe: Pipeline, fid: int, version: int, message: bytes) -> None:
        """Version `version` of `fid` as its update message, in byte chunks of the params' chunk size."""
        step = self.chunk_elems * ELEM
        buf = np.frombuffer(message, dtype=np.uint8)
        attempt = time.time_ns()   # a redone merge's other bytes under the same keys (StateStream's doc)
        for k, off in enumerate(range(0, max(1, len(buf)), step)):
            await self.guard()
            key = self.key(f"f{fid}", f"v{version}", "u", k)
            await pipe.put(S.kv_key(self.run_id, "ckpt", key), buf[off: off + step], f"kv.state.{key}.{attempt}")
            self.counters["state_store.update_chunks"] += 1
        self.counters["state_store.update_bytes"] += len(buf)

    async def save_manifest(self, state: CheckpointState, chains: dict[int, SC.Chain] | None = None) -> None:
        """The manifest naming `state`, with the chains of its fragments held as updates (`chains`; None:
        those held now, e.g. the final mark)."""
        if chains is None:
            if self.chains is None:
                await self._load_chains()
            chains = self.chains
        chains = {f: c for f, c in chains.items() if state.versions.get(f) == c.top}
        doc = {"state": orjson.loads(state.to_json()), "chunk_elems": self.chunk_elems}
        named = SC.to_manifest(chains, state.versions)
        if named:   # left out otherwise: a dense or bf16 run's manifest is as before, byte for byte
            doc["chains"] = named
        await self.guard()
        await kv_put(self.js, self.run_id, "ckpt", self.key("manifest"), orjson.dumps(doc), counters=self.counters)
        self.chains = chains

    async def _load_chains(self) -> None:
        m = await self._manifest()
        self.chains = {} if m is None else {f: m[2].get(f, SC.full(v, m[0].version_digests.get(f)))
                                            for f, v in m[0].versions.items()}

    async def put_intent(self, fid: int, intent: dict) -> None:
        await self.guard()
        await kv_put(self.js, self.run_id, "ckpt", self.key("intent", f"f{fid}"), orjson.dumps(intent),
                     counters=self.counters)

    async def purge_unnamed(self) -> int:
        """A new owner's clean-up: chunks of versions the manifest does not name (a save torn by a crash
        between its chunks and its manifest; a purge that failed) go now, not when that fragment's version
        after next commits. Returns the versions purged; never raises (a leftover costs bytes only)."""
        try:
            m = await self._manifest()
            if m is None:
                return 0
            state, _, chains = m
            self.chains = {f: chains.get(f, SC.full(v, state.version_digests.get(f))) for f, v in state.versions.items()}
            keep = SC.needed(chains, state.versions)
            stream = kv_stream_name(S.kv_bucket(self.run_id, "ckpt"))
            info = await self.js.stream_info(stream, subjects_filter=S.kv_key(self.run_id, "ckpt", self.key(">")))
            found: set[tuple[int, int]] = set()
            prefix = S.kv_key(self.run_id, "ckpt", self.key(""))
            for subject in info.state.subjects or {}:
                parts = subject[len(prefix):].split(".")   # f<F>, v<N>, p|m|u, <k>  (or manifest, intent.f<F>)
                if len(parts) == 4 and parts[0][:1] == "f" and parts[1][:1] == "v":
                    found.add((int(parts[0][1:]), int(parts[1][1:])))
            torn = sorted((f, v) for f, v in found if v not in keep.get(f, ()))
            for f, v in torn:
                await self._purge(f, v)
            self.counters["state_store.purged_unnamed"] += len(torn)
            if torn:
                log.info("purged %d version(s) the ckpt KV's manifest does not name: %s", len(torn), torn)
            return len(torn)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self.counters["state_store.purge_error"] += 1
            log.warning("purging unnamed versions from the ckpt KV failed: %r", exc)
            return 0

    async def _purge(self, fid: int, version: int) -> None:
        subject = S.kv_key(self.run_id, "ckpt", self.key(f"f{fid}", f"v{version}", ">"))
        try:
            await self.js.purge_stream(kv_stream_name(S.kv_bucket(self.run_id, "ckpt")), subject=subject)
        except Exception as exc:  # noqa: BLE001 - a leftover costs bytes, never correctness
            self.counters["state_store.purge_error"] += 1
            log.warning("purging fragment %d version %d from the state KV failed: %r", fid, version, exc)

    async def _get(self, key: str) -> bytes | None:
        from nats.js.errors import KeyNotFoundError
        try:
            e = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        return e.value or None

    async def has_state(self) -> bool:
        return await self._get(self.key("manifest")) is not None

    async def _manifest(self) -> tuple[CheckpointState, int, dict[int, SC.Chain]] | None:
        """The manifest's state, chunk size and chains (ChainError naming the key for a bad chain)."""
        raw = await self._get(self.key("manifest"))
        if raw is None:
            return None
        doc = orjson.loads(raw)
        state = CheckpointState.from_json(orjson.dumps(doc["state"]))
        return state, int(doc["chunk_elems"]), SC.from_manifest(doc, state.versions, state.version_digests,
                                                                self.key("manifest"))

    async def _fetch(self, fid: int, v: int, kind: str, n: int, elems: int, counter: str) -> torch.Tensor:
        """Fragment `fid` version `v`'s params ("p") or momentum ("m"), `n` elements, chunk by chunk."""
        t = torch.empty(n, dtype=torch.float32)
        raw_view = t.view(torch.uint8).numpy()   # written through numpy: no copy of the (read-only) payload
        offsets = list(range(0, n, elems))
        # FETCH_WINDOW gets in flight at once: one at a time, a restore waited a round trip per chunk
        # (1 GiB in 22 s on this machine); the window bounds what is held to FETCH_WINDOW chunks.
        for first in range(0, len(offsets), FETCH_WINDOW):
            ks = range(first, min(first + FETCH_WINDOW, len(offsets)))
            keys = [self.key(f"f{fid}", f"v{v}", kind, k) for k in ks]
            got = await asyncio.gather(*(self._get(key) for key in keys))
            for k, key, data in zip(ks, keys, got):
                off = offsets[k]
                want = min(elems, n - off) * ELEM
                if data is None or len(data) != want:
                    raise _Gone(f"the ckpt KV's {key} is {'missing' if data is None else f'{len(data)} bytes'}"
                                f" (want {want}): the committed state of fragment {fid} is incomplete")
                raw_view[off * ELEM: off * ELEM + want] = np.frombuffer(data, dtype=np.uint8)
                self.counters[counter] += 1
        return t

    async def _fetch_bytes(self, fid: int, v: int, nbytes: int, elems: int, counter: str) -> bytes:
        """Version `v`'s update message (`nbytes`, byte chunks of `elems` f32 values each)."""
        step = elems * ELEM
        offsets = list(range(0, max(1, nbytes), step))
        out = bytearray()
        for first in range(0, len(offsets), FETCH_WINDOW):
            ks = range(first, min(first + FETCH_WINDOW, len(offsets)))
            keys = [self.key(f"f{fid}", f"v{v}", "u", k) for k in ks]
            for k, key, data in zip(ks, keys, await asyncio.gather(*(self._get(key) for key in keys))):
                want = min(step, nbytes - offsets[k])
                if data is None or len(data) != want:
                    raise _Gone(f"the ckpt KV's {key} is {'missing' if data is None else f'{len(data)} bytes'}"
                                f" (want {want}): the update making version {v} of fragment {fid} is incomplete")
                out += data
                self.counters[counter] += 1
        return bytes(out)

    async def _params(self, fid: int, v: int, chain: SC.Chain | None, n: int, elems: int, session: dict | None,
                      counter: str, start: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Fragment `fid`'s params at committed version `v`: its `p` chunks, or (a chain, state_chain.py)
        the chain's full version, its digest checked, and the updates after it applied one by one, each
        result checked against its version digest. `start`: (u, params of version u) already held (a warm
        copy), the updates applied from there instead. ChainError / _Gone naming the key otherwise."""
        if chain is None or not chain.sizes:
            return await self._fetch(fid, v, "p", n, elems, counter)
        if session is None:
            raise SC.ChainError(f"fragment {fid} version {v} is held as updates: reading it needs the session")
        if start is not None and chain.base <= start[0] <= v:
            first, t = start
        else:
            first, t = chain.base, await self._fetch(fid, chain.base, "p", n, elems, counter)
            got = await asyncio.to_thread(sha256_of, t)
            if got != chain.digest(chain.base):
                raise SC.ChainError(f"the ckpt KV's {self.key(f'f{fid}', f'v{chain.base}', 'p')}.* hash to "
                                    f"{got[:12]}…, the manifest's chain recorded {chain.digest(chain.base)[:12]}…")
        frag = next(f for f in session["fragments"] if f["id"] == fid)
        spec = OM.from_session(session).spec
        for u in range(first + 1, v + 1):
            msg = await self._fetch_bytes(fid, u, chain.size(u), elems, counter)
            await asyncio.to_thread(SC.apply, t, msg, frag, spec, chain.digest(u),
                                    f"{self.key(f'f{fid}', f'v{u}', 'u')}.*")
        self.counters["state_store.chain_reads"] += 1
        return t

    async def warm(self, warm: CheckpointDir, numels: dict[int, int], *, momentum: bool = True,
                   session: dict | None = None) -> int:
        """One pass of a standby keeping the cut warm while it waits for the lease: every fragment of
        `numels` whose committed version `warm` (`<its checkpoint dir>/.standby-warm/`, the same file names
        as a checkpoint) lacks is fetched into it (params and momentum, each file written whole and
        renamed), once per version, and that fragment's older warm files go; a takeover then fetches only
        what was committed since its last pass and moves the rest into place (`restore_into(..., warm=)`).
        Streaming DiLoCo changes one fragment per round, so that is about one fragment, not the shard.
        Returns the fragments fetched. A version purged under the pass (a newer commit) is skipped: the
        next pass takes the newer one. `momentum=False` (the sparse mode): params only. A version held as
        updates (state_chain.py) is made from the warm copy's older version when it is in the chain (only the
        updates after it fetched), else from the chain's full version; that needs `session`."""
        m = await self._manifest()
        if m is None:
            return 0
        state, elems, chains = m
        fetched = 0
        for fid, v in sorted(state.versions.items()):
            if fid not in numels:
                continue
            paths = warm.files(fid, v, momentum=momentum)
            if all(q.is_file() for q in paths):
                continue
            try:
                if fid in chains:
                    tensors = [await self._warm_chain(warm, fid, v, chains[fid], numels[fid], elems, session)]
                else:
                    tensors = [await self._fetch(fid, v, kind, numels[fid], elems, "state_store.warm_chunks")
                               for kind in "pm"[:len(paths)]]
            except _Gone:
                self.counters["state_store.warm_moved_on"] += 1
                continue

            def write():
                warm.path.mkdir(parents=True, exist_ok=True)
                for path, t in zip(paths, tensors):
                    tmp = path.with_suffix(path.suffix + ".tmp")
                    with open(tmp, "wb") as f:   # no fsync: a cache, checked by digest before any use
                        f.write(memoryview(t.view(torch.uint8).numpy()))
                    os.replace(tmp, path)
                for old in warm.path.glob(f"frag-{fid}-v*"):
                    if old.name not in {q.name for q in paths}:
                        old.unlink(missing_ok=True)
            await asyncio.to_thread(write)
            fetched += 1
        return fetched

    async def _warm_chain(self, warm: CheckpointDir, fid: int, v: int, chain: SC.Chain, n: int, elems: int,
                          session: dict | None) -> torch.Tensor:
        """Version `v` from the newest warm file in `chain` (its updates after it), else from the chain's start."""
        held = sorted((int(q.name.rsplit("-v", 1)[1].split(".")[0]), q) for q in warm.path.glob(f"frag-{fid}-v*.params")
                      if q.stat().st_size == n * ELEM) if warm.path.is_dir() else []
        for u, q in reversed(held):
            if chain.base <= u < v:
                t = await asyncio.to_thread(_read_f32, q, n)
                try:
                    return await self._params(fid, v, chain, n, elems, session, "state_store.warm_chunks", start=(u, t))
                except SC.ChainError:   # the warm file was not version u's bytes after all: from the start
                    self.counters["state_store.warm_chain_restart"] += 1
                break
        return await self._params(fid, v, chain, n, elems, session, "state_store.warm_chunks")

    async def restore_into(self, ckpt: CheckpointDir, session: dict, numels: dict[int, int],
                           warm: CheckpointDir | None = None) -> CheckpointState:
        """Write the committed state kept here into `ckpt` (an empty directory): session, every fragment's
        params and momentum (params only when the session is sparse) at its committed version, the
        manifest, the intents. `numels`: elements per
        fragment (the session's layout). A fragment whose version `warm` holds (a standby's warm copy) is
        moved into place instead of fetched. Raises CheckpointError-like RuntimeError naming what is missing."""
        m = await self._manifest()
        if m is None:
            raise RuntimeError(f"the ckpt KV holds no checkpoint manifest ({self.key('manifest')})")
        state, elems, chains = m
        mom = OM.has_momentum(session)
        frags = {}
        moved = []
        for fid, v in sorted(state.versions.items()):
            n = numels[fid]
            if warm is not None and all(f.is_file() and f.stat().st_size == n * ELEM
                                        for f in warm.files(fid, v, momentum=mom)):
                moved.append(fid)
                continue
            if fid in chains and warm is not None:   # the warm copy's older version, if in the chain
                frags[fid] = (await self._warm_chain(warm, fid, v, chains[fid], n, elems, session), None)
                continue
            frags[fid] = (await self._params(fid, v, chains.get(fid), n, elems, session, "state_store.restore_chunks"),
                          await self._fetch(fid, v, "m", n, elems, "state_store.restore_chunks") if mom else None)
        ckpt.write_session(session)
        ckpt.path.mkdir(parents=True, exist_ok=True)
        for fid in moved:   # same filesystem (WARM_DIR is inside ckpt): renames, before the manifest names them
            v = state.versions[fid]
            for src, dst in zip(warm.files(fid, v, momentum=mom), ckpt.files(fid, v, momentum=mom)):
                os.replace(src, dst)
        self.counters["state_store.restored_warm"] += len(moved)
        ckpt.commit(dataclasses.replace(state, chains={}), frags)   # every fragment written full here
        for fid in sorted(numels):
            intent = await self._get(self.key("intent", f"f{fid}"))
            if intent is not None:
                ckpt.write_intent(fid, orjson.loads(intent))
        self.counters["state_store.restored"] += 1
        return state


def _read_f32(path, n: int) -> torch.Tensor:
    t = torch.empty(n, dtype=torch.float32)
    with open(path, "rb") as f:
        f.readinto(memoryview(t.view(torch.uint8).numpy()))
    return t


class StateStream:
    """One fragment's new version put into the ckpt KV chunk by chunk while the merge makes it, so the
    commit's `save` waits only for the last acks (measured with bench/round.py: the save after the merge
    loop was the round's largest stage, about 2 s of 5.7 at 256 MiB). `put_ready(done)` puts every chunk
    of params and momentum (params alone when momentum is None) whose elements are all final (the merge
    steps chunks in order, in place); `flush` puts the rest and waits for every ack.

    Safe before the manifest, as in `save`: chunks no manifest names are a torn save's leftover (the next
    owner's `purge_unnamed` removes them, a later save of that version overwrites them). The Nats-Msg-Id
    carries an attempt id of this stream: a redone merge that gives the same version other bytes (its
    round ran again) puts the same keys, and JetStream's duplicate window would drop them."""

    def __init__(self, store: StateStore, fid: int, version: int, params: torch.Tensor,
                 momentum: torch.Tensor | None):
        self.store, self.fid, self.version = store, fid, version
        self.params = params.detach().reshape(-1)
        self.kinds = (("p", self.params),) if momentum is None else (("p", self.params),
                                                                   ("m", momentum.detach().reshape(-1)))
        self.pipe = Pipeline(store.js, timeout=10.0, counters=store.counters)
        self.attempt = time.time_ns()
        self.next = 0            # index of the next chunk to put
        self.seconds = 0.0       # time spent putting (copies and publishes, not the acks at `flush`)

    async def put_ready(self, done: int) -> None:
        elems, n = self.store.chunk_elems, self.params.numel()
        while self.next * elems < n and min((self.next + 1) * elems, n) <= done:
            t0 = time.perf_counter()
            sl = slice(self.next * elems, min((self.next + 1) * elems, n))
            for kind, t in self.kinds:
                await self.store.put_chunk(self.pipe, self.fid, self.version, kind, self.next, t[sl], self.attempt)
            self.next += 1
            self.seconds += time.perf_counter() - t0

    async def flush(self) -> None:
        await self.put_ready(self.params.numel())
        await self.pipe.flush()
