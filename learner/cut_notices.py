"""BCAST / FINAL notices (docs/design.md §3.6, §5.1), on the client's loop thread: an ordered consumer per
stream (headers only: the chunk bytes stay in JetStream until the sync rank fetches them at a boundary)
turns every chunk header into a `ChunkNotice` in the client's cut inboxes.

Invariants: a notice only says "look": nothing in it is installed (the cut reader decides from the chunks
it fetches). A header that does not decode, names another run, does not match its subject or its size
is rejected (counted, logged) and dropped; the island trains on.
"""
from __future__ import annotations

from typing import Callable

from yeto.schemas import codec
from yeto.schemas import provision as P
from yeto.schemas import subjects as S
from yeto.schemas.errors import DecodeError, WireError
from yeto.schemas.messages import BcastChunk, FinalChunk

from .inbox import ChunkNotice, CutInbox


async def watch_cuts(cut_js, run: str, *, bcast: CutInbox, final: CutInbox,
                     reject: Callable[[str, Exception], None]) -> list:
    """Watch BCAST and FINAL on `cut_js` (the hub's, or an island datacenter's mirrors). Returns the
    subscriptions (the client closes them)."""
    subs = []
    for kind, stream, cfg, inbox in (("bcast_chunk", "BCAST", P.bcast_consumer_config(run), bcast),
                                     ("final_chunk", "FINAL", P.final_consumer_config(run), final)):
        subs.append(await cut_js.subscribe(
            cfg.filter_subject, stream=S.stream(run, stream), ordered_consumer=True, config=cfg,
            cb=notice_callback(kind, run, inbox, reject)))
    return subs


def notice_callback(kind: str, run: str, inbox: CutInbox, reject: Callable[[str, Exception], None]):
    """The message callback that checks one `kind` chunk header and puts its notice in `inbox`."""
    prefix = "bcast" if kind == "bcast_chunk" else "final"
    header = BcastChunk if kind == "bcast_chunk" else FinalChunk

    async def cb(msg) -> None:
        try:
            hdr = (msg.headers or {}).get(codec.CHUNK_HEADER)
            if hdr is None:
                raise DecodeError("chunk message without its header", field=codec.CHUNK_HEADER, value=None)
            meta = header.from_header(hdr)
            toks = S.parse(run, msg.subject)
            if meta.run != run:
                raise WireError("chunk names another run", field="run", value=meta.run)
            if toks != (prefix, str(meta.fragment), str(meta.chunk)):
                raise WireError("chunk header does not match its subject", field="subject", value=msg.subject)
            size = int((msg.headers or {}).get("Nats-Msg-Size", meta.nbytes))
            if size != meta.nbytes:
                raise WireError(f"message holds {size} bytes", field="nbytes", value=meta.nbytes)
        except (WireError, ValueError) as exc:  # ValueError: S.parse, int() of a forged size header
            reject(f"{kind} notice on {msg.subject}", exc)
            return
        inbox.put(ChunkNotice(kind, msg.subject, meta.fragment, meta.chunk, meta.version, meta.nbytes, meta.to_wire()))

    return cb


__all__ = ["notice_callback", "watch_cuts"]
