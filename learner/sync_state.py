"""The sync rank's per-fragment bookkeeping (docs/design.md §5.5) — pure, no I/O, no tensors.

`SyncState` holds, per fragment of the session, the version the island holds, that version's digest,
and the inner-step and token counters since it was installed (a push's merge weight, a pull's
readiness). The values themselves — each rank's staging, anchor (raw Θ of the held version) and q4
residual — live on the ranks, per piece (`learner.anchors.AnchorStore`). Invariants: versions held only
grow; one version number has one digest (`ProtocolError` otherwise); installing resets the counters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from yeto.schemas.errors import ConfigError, FieldError, WireError


class ProtocolError(FieldError):
    """The island's own bookkeeping broke an invariant: a bug, fatal to the island. Not a WireError (a
    receiver counts and drops those and trains on), and never raised for what was read off the wire:
    that is refused and counted as a WireError (`cut_reader.VersionConflict`)."""

    code = "protocol"


def check_count(value: Any, field: str) -> int:
    """`value`, a count read off the wire (WireError when it is not a non-negative integer)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError("must be a non-negative integer", field=field, value=value)
    return value


def session_numels(session: Mapping) -> dict[int, int]:
    frags = session.get("fragments")
    if not isinstance(frags, list) or not frags:
        raise WireError("session must list its fragments", field="fragments", value=frags)
    out = {}
    for i, f in enumerate(frags):
        fid, n = f.get("id"), f.get("numel")
        if isinstance(fid, bool) or not isinstance(fid, int) or fid in out:
            raise WireError("fragment id must be a unique integer", field=f"fragments.{i}.id", value=fid)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise WireError("fragment numel must be a positive integer", field=f"fragments.{i}.numel", value=n)
        out[fid] = n
    return out


# ---- per-fragment bookkeeping ----------------------------------------------------------------------

@dataclass
class FragmentState:
    fid: int
    numel: int
    version: int | None = None  # None until the first version is installed
    digest: str | None = None  # version digest (sha256 of the bulk-dtype bytes) of `version`
    c_steps: int = 0  # inner steps since the version was installed
    c_tokens: int = 0  # tokens trained since the version was installed (the push's merge weight)

    @property
    def steps_since_reset(self) -> int:
        # The push counter and the readiness counter count the same thing: steps since the anchor.
        return self.c_steps

    def install(self, version: int, digest: str) -> None:
        """Hold `version` (SyncState.installed checked it is new): the counters start again."""
        self.version, self.digest = version, digest
        self.c_steps = self.c_tokens = 0

    def step(self, tokens: int) -> None:
        self.c_steps += 1
        self.c_tokens += tokens


class SyncState:
    """The island's view of every fragment of the session (see the module doc)."""

    def __init__(self, session: Mapping, island: str, gen: str, alpha: float):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ConfigError("alpha must be a number in [0, 1]", field="alpha", value=alpha)
        self.island = island
        self.gen = gen
        self.alpha = float(alpha)
        self.states: dict[int, FragmentState] = {fid: FragmentState(fid, n) for fid, n in session_numels(session).items()}

    def _state(self, fid: int) -> FragmentState:
        st = self.states.get(fid)
        if st is None:
            raise ProtocolError(f"no such fragment in the session (ids {sorted(self.states)})", field="fragment",
                                value=fid)
        return st

    def accept_version(self, fid: int, version: int, digest: str) -> str:
        """Classify a broadcast version without changing state: "new" (newer than the one held, or
        the first), "same" (the version held, same digest), "old" (older: ignored).
        Raises ProtocolError for the version held with another digest (the reader refuses such
        chunks before they get here)."""
        st = self._state(fid)
        check_count(version, "version")
        if st.version is None or version > st.version:
            return "new"
        if version < st.version:
            return "old"
        if digest != st.digest:
            raise ProtocolError(f"fragment {fid} version {version} arrived with digest {st.digest} before",
                                field="version_digest", value=digest)
        return "same"

    def needs_local(self, fid: int) -> bool:
        """Whether installing the next version blends (a version is held), else it overwrites."""
        return self._state(fid).version is not None

    def installed(self, fid: int, version: int, digest: str) -> str:
        """Record that every rank installed `version` (its values are now the ranks' anchors).
        Returns how it was installed: "first" (overwrite) or "blend". Counters reset."""
        st = self._state(fid)
        if self.accept_version(fid, version, digest) != "new":
            raise ProtocolError(f"fragment {fid} already holds version {st.version}", field="version", value=version)
        mode = "blend" if st.version is not None else "first"
        st.install(version, digest)
        return mode

    def note_step(self, tokens: int) -> None:
        """One inner step of `tokens` tokens completed: every fragment's counters grow."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:  # the trainer's count
            raise ValueError(f"tokens must be a non-negative integer, not {tokens!r}")
        for st in self.states.values():
            st.step(tokens)

    def ready(self, fid: int) -> bool:
        """A pull of this fragment can be answered: a version (so anchors) is held and a local step
        was taken since."""
        st = self.states.get(fid)
        return st is not None and st.version is not None and st.c_steps >= 1

    def versions(self) -> dict[str, int]:
        """{fragment id (as a string, for JSON): version held} for the step log; unversioned ones absent."""
        return {str(fid): st.version for fid, st in sorted(self.states.items()) if st.version is not None}

    def version(self, fid: int) -> int | None:
        return self._state(fid).version


__all__ = ["FragmentState", "ProtocolError", "SyncState", "check_count", "session_numels"]
