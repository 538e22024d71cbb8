"""Runtime settings: `yeto run set` applied between two events (rules of `RoundMachine`).

Rule functions of services/syncer/rounds.RoundMachine over (state, config, output): see machine_state.py.

- **Checked, then applied whole or not at all**: every key and value (schemas/run_settings.py), then the
  machine config they make (SyncerConfig's own checks, e.g. a quorum above --islands is refused there).
  A refusal changes nothing and answers ApplySettings(ok=False) naming the field and the value.
- **When**: at once, between two events (the machine goes on with the config returned). Rounds launched or restarted afterwards take the new deadline,
  quorum, grace and checks; a round in flight keeps the deadline it has. The outer learning rate and
  momentum go with every Merge decided afterwards (`Merge.outer`), so the shell never reads them late.
- **Once per id**: a retried request (same id) is answered again, not applied twice. The shell feeds the
  settings its state KV kept as id "kept" at start: a successor continues with them.
- **Taped** (`settings` record) like every input, so `yeto replay` reproduces a run with changes.
"""
from __future__ import annotations

import dataclasses

from yeto.schemas.errors import ConfigError
from yeto.schemas.run_settings import MACHINE_KEYS, check_settings
from yeto.services.syncer.actions import ApplySettings
from yeto.services.syncer.events import Reconfigure
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.machine_state import MachineState, Output


KEEP_IDS = 64   # request ids remembered for retries (a retry comes seconds after, not 64 changes later)


def on_reconfigure(s: MachineState, cfg: SyncerConfig, out: Output, ev: Reconfigure, now: float, *,
                   base: SyncerConfig) -> SyncerConfig | None:
    """The config the machine goes on with (`base`, the flags, with every runtime setting in force), or
    None when nothing changed (a repeated id, a refusal)."""
    if ev.id in s.settings_ids:
        s.counters["settings.repeated"] += 1
        out.emit(ApplySettings(ev.id, True, s.committed_step, {}, dict(s.settings)))
        return None
    try:
        changed = check_settings(ev.settings)
        for key in ("outer_momentum", "push_dtype"):
            if base.outer is not None and key in changed:
                # the sparse outer mode (docs/design.md §4.10) has no momentum, and its pushes are messages
                raise ConfigError(f"{key} does not apply in the sparse outer mode (--outer sparseloco)",
                                  field=key, value=changed[key])
        if "push_dtype" in changed:
            if s.session is None:
                raise ConfigError("push_dtype changes only once the session is pinned (start the syncer with "
                                  "--push-dtype for the first rounds)", field="push_dtype", value=changed["push_dtype"])
            if "q4" in (changed["push_dtype"], s.session.get("push_dtype")) and \
                    changed["push_dtype"] != s.session.get("push_dtype"):
                # q4 keeps an error-feedback residual per fragment on the island, and the island's push mode is
                # chosen for it at start: it is the session's or nothing
                raise ConfigError(f"push_dtype switches between f32 and bf16 at runtime; q4 only as the session's "
                                  f"(--push-dtype at start; the session's is {s.session.get('push_dtype')})",
                                  field="push_dtype", value=changed["push_dtype"])
        machine = {k: v for k, v in changed.items() if k in MACHINE_KEYS}
        config = dataclasses.replace(base, **{**_machine_settings(s), **machine})
    except ConfigError as exc:
        s.counters["settings.refused"] += 1
        field = str(exc.field) if exc.field is not None else None
        value = None if exc.value is None else str(exc.value)[:256]
        out.tape("settings", now, step=s.committed_step, reason=f"refused: {exc}",
                      detail={"id": ev.id, "by": ev.by, "set": dict(ev.settings), "field": field})
        out.emit(ApplySettings(ev.id, False, s.committed_step, error=str(exc)[:1024], field=field, value=value))
        return None
    s.settings = dict(sorted({**s.settings, **changed}.items()))
    s.settings_ids = (s.settings_ids + [ev.id])[-KEEP_IDS:]
    s.counters["settings.applied"] += 1
    out.tape("settings", now, step=s.committed_step,
                  reason="kept from the state KV" if ev.id == "kept" else f"set by {ev.by or 'an operator'}",
                  detail={"id": ev.id, "by": ev.by, "changed": changed, "settings": dict(s.settings)})
    out.emit(ApplySettings(ev.id, True, s.committed_step, changed, dict(s.settings)))
    return config


def _machine_settings(s: MachineState) -> dict:
    return {k: v for k, v in s.settings.items() if k in MACHINE_KEYS}
