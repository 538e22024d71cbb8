"""The shell's side of `yeto run set`: requests in, answers out, the settings in force kept for a successor.

Owns the core NATS subscription on `yeto.R.ctl.set` (subscribed only while this process owns its shard,
so a standby never answers) and the requests waiting for the machine's ApplySettings. A request is
validated (schemas/json/settings.schema.json) before it becomes a Reconfigure event; a malformed one is
answered with the error, counted and never reaches the machine. What the machine put in force goes to
the state KV key `settings` (`settings.<K>` sharded): a syncer that resumes or takes over reads it and
feeds it back as a Reconfigure with id "kept" before its first round.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import orjson

from yeto.schemas import codec, subjects as S
from yeto.schemas.errors import WireError
from yeto.schemas.provision import kv_put
from yeto.services.syncer.actions import ApplySettings
from yeto.services.syncer.events import Reconfigure

log = logging.getLogger("yeto.syncer")

KEPT = "kept"
MAX_WAITING = 64   # answers owed at once: more requests than this in flight are answered busy


class SettingsDesk:
    def __init__(self, nc, js, run_id: str, counters: Counter, queue, *, shard: int, shards: int, key: str):
        self.nc, self.js, self.run_id, self.counters, self.queue = nc, js, run_id, counters, queue
        self.shard, self.shards, self.key = shard, shards, key
        self.waiting: dict[str, list[str]] = {}   # request id -> reply subjects
        self.sub = None

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(S.settings(self.run_id), cb=self._on_request)

    async def stop(self) -> None:
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self.sub = None

    @staticmethod
    def kept_event(kept: Any, now: float) -> Reconfigure | None:
        """The Reconfigure that restores what the state KV kept (None: nothing kept or unreadable)."""
        if not isinstance(kept, dict) or not isinstance(kept.get("settings"), dict) or not kept["settings"]:
            return None
        return Reconfigure(KEPT, dict(kept["settings"]), "state KV", now)

    async def _answer(self, reply: str, **fields: Any) -> None:
        if not reply:
            return
        msg = codec.make("settings_result", run=self.run_id, shard=self.shard, shards=self.shards, **fields)
        try:
            await self.nc.publish(reply, codec.encode("settings_result", msg))
        except Exception as exc:  # noqa: BLE001 - the requester times out and may ask again (same id)
            self.counters["settings.answer_error"] += 1
            log.warning("answering a settings request failed: %r", exc)

    async def _on_request(self, msg) -> None:
        try:
            _, m = codec.decode_typed(msg.data, allowed=("settings",))
            if m["run"] != self.run_id:
                raise WireError("run does not match the subject's run", field="run", value=m["run"])
        except WireError as exc:
            self.counters["rejected.settings"] += 1
            log.warning("settings request refused: %s", exc)
            bad_id = "invalid"
            await self._answer(msg.reply, id=bad_id, ok=False, error=str(exc)[:1024],
                               **({"field": str(exc.field)[:64]} if exc.field is not None else {}),
                               **({"value": str(exc.value)[:256]} if exc.value is not None else {}))
            return
        if len(self.waiting) >= MAX_WAITING and m["id"] not in self.waiting:
            self.counters["settings.busy"] += 1
            await self._answer(msg.reply, id=m["id"], ok=False, error="too many settings requests in flight")
            return
        self.waiting.setdefault(m["id"], []).append(msg.reply)
        log.info("settings request %s from %s: %s", m["id"], m.get("by", "?"), m["set"])
        await self.queue.put(Reconfigure(m["id"], dict(m["set"]), m.get("by", ""), time.time()))

    async def apply(self, a: ApplySettings) -> None:
        """Carry out the machine's answer: keep what is in force, then answer whoever asked."""
        if a.ok and (a.changed or a.id == KEPT):
            await kv_put(self.js, self.run_id, "state", self.key,
                         orjson.dumps({"settings": a.settings, "step": a.step, "id": a.id, "t": time.time()}),
                         counters=self.counters)
            log.warning("runtime settings in force from step %d: %s", a.step, a.settings)
        elif not a.ok:
            log.warning("settings request %s refused: %s", a.id, a.error)
        for reply in self.waiting.pop(a.id, ()):
            fields: dict[str, Any] = {"id": a.id, "ok": a.ok, "step": a.step}
            if a.ok:
                fields.update(changed=a.changed, settings=a.settings)
            else:
                fields.update({k: v for k, v in (("error", a.error), ("field", a.field), ("value", a.value))
                               if v is not None})
            await self._answer(reply, **fields)
