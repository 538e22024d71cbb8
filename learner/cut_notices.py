"""BCAST / FINAL notices (docs/design.md §3.6, §5.1), on the client's loop thread: an ordered consumer per
stream (headers only: the chunk bytes stay in JetStream until the sync rank fetches them at a boundary)
turns every chunk header into a `ChunkNotice` in the client's cut inboxes.

Invariants: a notice only says "look": nothing in it is installed (the cut reader decides from the chunks
it fetches). A header that does not decode, names another run, does not match its subject or its size
is rejected (counted, logged) and dropped; the island trains on.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from yeto.schemas import codec
from yeto.schemas import provision as P
from yeto.schemas import sparse_bcast as SB
from yeto.schemas import subjects as S
from yeto.schemas.errors import DecodeError, WireError
from yeto.schemas.messages import BcastChunk, FinalChunk

from .inbox import ChunkNotice, CutInbox


class CutWatcher:
    """The BCAST and FINAL watchers of one island process on `cut_js` (the hub's, or an island datacenter's
    mirrors), and the newest version BCAST announced per fragment (`seen`): a pull that names a base version
    beyond it waits for its notice (learner/ctl_reader.py, docs/design.md §7.1)."""

    KINDS = ("bcast_chunk", "final_chunk")

    def __init__(self, cut_js, run: str, *, bcast: CutInbox, final: CutInbox,
                 reject: Callable[[str, Exception], None]):
        self.cut_js, self.run = cut_js, run
        self._inboxes = {"bcast_chunk": bcast, "final_chunk": final}
        self._reject = reject
        self._subs: dict[str, object] = {}    # kind -> its watcher's subscription
        self._seen: dict[int, int] = {}       # fragment -> the newest version a BCAST notice announced
        self._rewatching = asyncio.Lock()

    async def start(self) -> list:
        """Watch both streams; returns the subscriptions (the client closes them; `stop` closes the ones
        made since)."""
        return [await self._watch(kind) for kind in self.KINDS]

    def seen(self, fragment: int) -> int:
        """The newest version of `fragment` a BCAST notice announced (-1: none yet)."""
        return self._seen.get(fragment, -1)

    def announced(self, fragment) -> bool:
        return fragment in self._seen

    async def _watch(self, kind: str):
        """An ordered consumer of the newest message of every chunk subject, then of new ones."""
        stream, cfg = (("BCAST", P.bcast_consumer_config(self.run)) if kind == "bcast_chunk"
                       else ("FINAL", P.final_consumer_config(self.run)))
        sub = await self.cut_js.subscribe(cfg.filter_subject, stream=S.stream(self.run, stream),
                                          ordered_consumer=True, config=cfg, cb=self._callback(kind))
        self._subs[kind] = sub
        return sub

    async def rewatch_bcast(self) -> None:
        """Make the BCAST watcher again (its server stopped: the ordered consumer went with it): the newest
        chunk of every subject is announced anew (the inbox keeps the newest notice per subject, the reader
        reads no version twice)."""
        async with self._rewatching:
            old = self._subs.get("bcast_chunk")
            if old is not None:
                try:
                    await old.unsubscribe()
                except Exception:  # noqa: BLE001 - its server is gone, or it was closed: a new one is made anyway
                    pass
            await self._watch("bcast_chunk")

    async def stop(self) -> None:
        for sub in self._subs.values():
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closed with the connection anyway
                pass
        self._subs.clear()

    def _callback(self, kind: str):
        check = notice_callback(kind, self.run, self._inboxes[kind], self._reject)

        async def cb(msg) -> None:
            notice = await check(msg)
            if notice is not None and kind == "bcast_chunk":
                self._seen[notice.fragment] = max(notice.version, self.seen(notice.fragment))

        return cb


def notice_callback(kind: str, run: str, inbox: CutInbox, reject: Callable[[str, Exception], None]):
    """The message callback that checks one `kind` chunk header and puts its notice in `inbox` (returned;
    None when rejected)."""
    prefix = "bcast" if kind == "bcast_chunk" else "final"
    header = BcastChunk if kind == "bcast_chunk" else FinalChunk

    async def cb(msg) -> ChunkNotice | None:
        try:
            hdr = (msg.headers or {}).get(codec.CHUNK_HEADER)
            if hdr is None:
                raise DecodeError("chunk message without its header", field=codec.CHUNK_HEADER, value=None)
            meta = header.from_header(hdr)
            toks = S.parse(run, msg.subject)
            if meta.run != run:
                raise WireError("chunk names another run", field="run", value=meta.run)
            # a sparse update's chunk (schemas/sparse_bcast.py) lives on bcast.F.u<slot>-<chunk>
            if kind == "bcast_chunk" and meta.encoding is not None:
                tok = SB.parse_update_token(toks[2]) if len(toks) == 3 else None
                ok = tuple(toks[:2]) == (prefix, str(meta.fragment)) and tok is not None and tok[1] == meta.chunk
            else:
                ok = toks == (prefix, str(meta.fragment), str(meta.chunk))
            if not ok:
                raise WireError("chunk header does not match its subject", field="subject", value=msg.subject)
            size = int((msg.headers or {}).get("Nats-Msg-Size", meta.nbytes))
            if size != meta.nbytes:
                raise WireError(f"message holds {size} bytes", field="nbytes", value=meta.nbytes)
        except (WireError, ValueError) as exc:  # ValueError: S.parse, int() of a forged size header
            reject(f"{kind} notice on {msg.subject}", exc)
            return None
        notice = ChunkNotice(kind, msg.subject, meta.fragment, meta.chunk, meta.version, meta.nbytes, meta.to_wire())
        inbox.put(notice)
        return notice

    return cb


__all__ = ["CutWatcher", "notice_callback"]
