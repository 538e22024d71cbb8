"""The syncer's committed state in JetStream (docs/design.md §8, §11): what a standby on another host, with an empty
`--checkpoint-dir`, needs to continue the run — the committed params and momentum of every fragment,
the checkpoint manifest, and the merge intents — kept in the run's `ckpt` KV bucket (its `--replicas`),
a bucket of its own because only the syncer identity may read it: islands and observers read the state KV
(session, commit record, final manifest), and the observer is promised no weights (README "Secured runs"). The checkpoint directory stays the owner's working copy (resume reads it;
`yeto export` can too); this is what outlives the host.

Keys (per shard K; `<K>` is 0 with one shard):
  `ckpt.<K>.manifest`          the CheckpointState JSON and the chunk size
  `ckpt.<K>.f<F>.v<N>.p.<k>`   params of fragment F at version N, chunk k (raw little-endian f32)
  `ckpt.<K>.f<F>.v<N>.m.<k>`   its momentum, chunk k
  `ckpt.<K>.intent.f<F>`       the merge intent (checkpoint.CheckpointDir.write_intent), before a
                               cut-through version's first chunk goes out

Order, as in the directory: a version's chunks, then the manifest that names it, then the previous
version's chunks are purged; a crash in between leaves the old manifest naming complete old chunks (or a
leftover of chunks no manifest names, purged with that fragment's next commit but one). The save runs
before the commit record and the seal ("durable before the seal"), under the lease's guard. A restore
writes everything into a checkpoint directory, and the resume there checks every fragment against the
version digests it recorded.

Why KV keys and not the Object Store: nats-py's object store client is too slow for large objects
(docs/design.md §15.3); these are the same chunked, pipelined publishes the broadcast uses.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Awaitable, Callable

import orjson
import torch

from yeto.schemas import subjects as S
from yeto.schemas.provision import kv_put
from yeto.schemas.publish import Pipeline
from yeto.schemas.stream_configs import kv_stream_name
from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointState

log = logging.getLogger("yeto.syncer")

ELEM = 4   # f32


async def _no_guard() -> None:
    return None


class StateStore:
    def __init__(self, js, run_id: str, kv, counters: Counter, *, shard: int, chunk_bytes: int,
                 guard: Callable[[], Awaitable[None]] = _no_guard):
        self.js, self.run_id, self.kv, self.counters = js, run_id, kv, counters
        self.shard = shard
        self.chunk_elems = max(1, chunk_bytes // ELEM)
        self.guard = guard

    def key(self, *parts) -> str:
        return ".".join(["ckpt", str(self.shard), *map(str, parts)])

    def _chunks(self, t: torch.Tensor):
        flat = t.detach().reshape(-1)
        for k, off in enumerate(range(0, flat.numel(), self.chunk_elems)):
            yield k, flat[off: off + self.chunk_elems]

    async def save(self, state: CheckpointState, frags: dict[int, tuple[torch.Tensor, torch.Tensor]],
                   previous: dict[int, int]) -> float:
        """The new versions' params and momentum, then the manifest, then the older versions' chunks go.
        Returns the seconds it took (the commit's `state_store_s`)."""
        t0 = time.perf_counter()
        pipe = Pipeline(self.js, timeout=10.0, counters=self.counters)
        for fid, (params, momentum) in sorted(frags.items()):
            v = state.versions[fid]
            for kind, t in (("p", params), ("m", momentum)):
                for k, piece in self._chunks(t):
                    await self.guard()
                    key = self.key(f"f{fid}", f"v{v}", kind, k)
                    await pipe.put(S.kv_key(self.run_id, "ckpt", key), piece.contiguous().view(torch.uint8).numpy(),
                                   f"kv.state.{key}")
                    self.counters["state_store.chunks"] += 1
        await pipe.flush()
        await self.save_manifest(state)
        for fid, old in sorted(previous.items()):
            if old != state.versions.get(fid):
                await self._purge(fid, old)
        return time.perf_counter() - t0

    async def save_manifest(self, state: CheckpointState) -> None:
        await self.guard()
        await kv_put(self.js, self.run_id, "ckpt", self.key("manifest"),
                     orjson.dumps({"state": orjson.loads(state.to_json()), "chunk_elems": self.chunk_elems}),
                     counters=self.counters)

    async def put_intent(self, fid: int, intent: dict) -> None:
        await self.guard()
        await kv_put(self.js, self.run_id, "ckpt", self.key("intent", f"f{fid}"), orjson.dumps(intent),
                     counters=self.counters)

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

    async def restore_into(self, ckpt: CheckpointDir, session: dict, numels: dict[int, int]) -> CheckpointState:
        """Write the committed state kept here into `ckpt` (an empty directory): session, every fragment's
        params and momentum at its committed version, the manifest, the intents. `numels`: elements per
        fragment (the session's layout). Raises CheckpointError-like RuntimeError naming what is missing."""
        raw = await self._get(self.key("manifest"))
        if raw is None:
            raise RuntimeError(f"the state KV holds no checkpoint manifest ({self.key('manifest')})")
        doc = orjson.loads(raw)
        state = CheckpointState.from_json(orjson.dumps(doc["state"]))
        elems = int(doc["chunk_elems"])
        frags = {}
        for fid, v in sorted(state.versions.items()):
            n = numels[fid]
            pair = []
            for kind in ("p", "m"):
                t = torch.empty(n, dtype=torch.float32)
                raw_view = t.view(torch.uint8)
                for k, off in enumerate(range(0, n, elems)):
                    key = self.key(f"f{fid}", f"v{v}", kind, k)
                    data = await self._get(key)
                    want = min(elems, n - off) * ELEM
                    if data is None or len(data) != want:
                        raise RuntimeError(f"the state KV's {key} is {'missing' if data is None else f'{len(data)} bytes'}"
                                           f" (want {want}): the committed state of fragment {fid} is incomplete")
                    raw_view[off * ELEM: off * ELEM + want] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                pair.append(t)
            frags[fid] = (pair[0], pair[1])
        ckpt.write_session(session)
        ckpt.commit(state, frags)
        for fid in sorted(numels):
            intent = await self._get(self.key("intent", f"f{fid}"))
            if intent is not None:
                ckpt.write_intent(fid, orjson.loads(intent))
        self.counters["state_store.restored"] += 1
        return state
