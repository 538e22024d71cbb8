"""INIT from the INIT island's sync rank (docs/design.md §5.6): every fragment's values gathered from
the owners chunk by chunk (`RankOps.export`, a collective of the island group, on the training thread)
and published by a background thread from a short queue, so gathering and publishing overlap."""
from __future__ import annotations

import logging
import queue
import threading
import time

from yeto.schemas import codec
from yeto.schemas import subjects as S
from yeto.schemas.dtypes import as_bytes_view, packed_nbytes
from yeto.schemas.messages import init_chunk

from .progress import progress_bar
from .rank_ops import ExportOp

log = logging.getLogger("yeto.island")

INIT_QUEUE_CHUNKS = 4  # packed INIT chunks waiting for the publisher thread on rank 0


def stream_init(wire, lead) -> None:
    """INIT: every fragment in the bulk dtype on init.F, gathered chunk by chunk (`wire`: the sync
    rank's IslandWire, `lead`: announces an operation to the ranks and runs rank 0's part): the main
    thread gathers (collective), a background thread publishes."""
    dtype = wire.session["bulk_dtype"]
    run, gen, island = wire.config.run, wire.gen, wire.config.island
    fids = sorted(wire.frags)
    total_bytes = sum(packed_nbytes(dtype, wire.frags[f]["numel"]) for f in fids)
    bar = progress_bar(total_bytes, f"INIT {wire.config.island}", wire.config.progress)
    q: queue.Queue = queue.Queue(maxsize=INIT_QUEUE_CHUNKS)
    err: list[BaseException] = []
    sent = [0]

    def publisher() -> None:
        for fid in fids:
            spans = wire.ops.spans(fid, dtype)
            ended = [False]

            def items():
                while True:
                    x = q.get()
                    if x is None:
                        ended[0] = True
                        return
                    s, packed = x
                    payload = as_bytes_view(packed)  # zero copy: the publisher copies it once
                    # island + gen: the syncer builds version 0 from one process's chunks only
                    meta = init_chunk(spans, s.index, payload, run=run, island=island, gen=gen, fragment=fid,
                                      dtype=dtype)
                    yield (S.init(run, fid), payload, S.init_msg_id(fid, s.index, gen),
                           {codec.CHUNK_HEADER: meta.header()})
                    bar.update(s.nbytes)

            try:
                if not err:
                    sent[0] += wire.client.publish_stream(items(), timeout=wire.config.push_timeout_s)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                err.append(exc)
            while not ended[0]:  # drain what the gather still produces for this fragment
                if q.get() is None:
                    ended[0] = True

    t0 = time.monotonic()
    thread = threading.Thread(target=publisher, name="yeto-init", daemon=True)
    thread.start()
    ended = 0
    try:
        for fid in fids:
            for s, packed in lead(ExportOp(fid, dtype, "init")):
                if not err:
                    q.put((s, packed))
            q.put(None)
            ended += 1
    except BaseException as exc:
        err.append(exc)
        for _ in range(len(fids) - ended):  # release the publisher: no more chunks are coming
            q.put(None)
        raise
    finally:
        thread.join(timeout=wire.config.push_timeout_s * len(fids) + 10)
        bar.close()
    if err:
        raise err[0]
    wire.count("init_bytes", sent[0])
    log.info("island %s: INIT sent %d bytes in %d fragments in %.1fs", wire.config.island, sent[0], len(fids),
             time.monotonic() - t0)


__all__ = ["INIT_QUEUE_CHUNKS", "stream_init"]
