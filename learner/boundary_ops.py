"""The events the boundary machine (learner/boundary.py) is fed and the operations it returns.

Events that start something: `Begin` (after the session, before the first step), `StepDone` (after
every optimizer step), `FinalShared` (every rank holds the final cut). A request operation names
the event type that answers it (`answer`); `VersionComplete` may be fed while a ReadBroadcasts or
ReadFinal is being carried out and is answered with the `Commit` to run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .pulls import PendingPull

# ---- events that start something --------------------------------------------------------------


@dataclass(frozen=True)
class Begin:
    now: float
    final_record: dict | None = None  # the run's final record (the run finished without this process)
    final_error: Exception | None = None  # a final record that did not decode
    committed: bool = False  # versions were committed already (INIT island: INIT is skipped)


@dataclass(frozen=True)
class StepDone:
    tokens: int
    loss: float | None
    now: float


@dataclass(frozen=True)
class FinalShared:
    now: float


# ---- answers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Control:
    messages: list  # [(kind, msg)]: manifest / final / shutdown / error, in arrival order
    now: float


@dataclass(frozen=True)
class ManifestChecked:
    heads: list | None  # chunk 0 header (dict, or None) of FINAL per fragment asked; None: not read


@dataclass(frozen=True)
class BroadcastsRead:
    applied: list  # fragments committed while reading
    now: float


@dataclass(frozen=True)
class VersionComplete:
    fragment: int
    version: int
    digest: str


@dataclass(frozen=True)
class Pulls:
    pulls: list  # decoded pull messages, in arrival order


@dataclass(frozen=True)
class Pushes:
    settled: list  # [(PendingPull, payload bytes, error text or None)] of pushes whose outcome is known
    connected: bool


@dataclass(frozen=True)
class PushHanded:
    error: str | None = None  # the push could not be handed over (the pull is pending again)


@dataclass(frozen=True)
class FinalRead:
    completed: list  # fragments of the final cut committed by this reading
    progressed: bool  # something was read (else wait for a notice)
    now: float


@dataclass(frozen=True)
class Tick:
    now: float


# ---- operations: acts -------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """Heartbeats report these from now on."""

    local_step: int
    step_time_s: float | None


@dataclass(frozen=True)
class CheckHealth:
    """Raise if the island must stop (the connection is gone for good, a fatal syncer error)."""


@dataclass(frozen=True)
class Commit:
    """Every rank installs the staged version: mode "first" (overwrite), "blend" or "final"."""

    fragment: int
    version: int
    digest: str
    mode: str


@dataclass(frozen=True)
class StreamInit:
    """The INIT island sends its weights (every fragment, bulk dtype)."""


@dataclass(frozen=True)
class BeginFinal:
    """Drop any half-read broadcast; read exactly these f32 versions from FINAL."""

    final_step: int
    want: dict  # fragment -> (version, version digest)


@dataclass(frozen=True)
class Ack:
    final_step: int
    resend: int  # 0: the first ack; n: the n-th re-send


@dataclass(frozen=True)
class StepLog:
    """The step-log event; the shell adds what it measured (times, bytes in, rank traffic)."""

    step: int
    versions: dict
    pending_pulls: int
    pushes: int
    applies: int
    bytes_out: int
    rejected: int
    loss: float | None
    extra: dict | None = None


@dataclass(frozen=True)
class Log:
    level: str
    text: str


@dataclass(frozen=True)
class End:
    """What was fed to start is done; `decision` is shared with every rank."""

    decision: dict


@dataclass(frozen=True)
class Fail:
    error: BaseException


# ---- operations: requests ---------------------------------------------------------------------


@dataclass(frozen=True)
class ReadControl:
    health: bool = True  # check health first
    answer: ClassVar[type] = Control


@dataclass(frozen=True)
class VerifyManifest:
    fragments: list  # read chunk 0's header on FINAL for each
    answer: ClassVar[type] = ManifestChecked


@dataclass(frozen=True)
class ReadBroadcasts:
    answer: ClassVar[type] = BroadcastsRead


@dataclass(frozen=True)
class TakePulls:
    answer: ClassVar[type] = Pulls


@dataclass(frozen=True)
class Reap:
    """Report the pushes whose acks are all in or that failed; and whether the connection is up."""

    answer: ClassVar[type] = Pushes


@dataclass(frozen=True)
class Push:
    """Export d = local − anchor of the pull's fragment and publish it (the header fields below)."""

    pull: PendingPull
    base_version: int
    local_step: int
    c_steps: int
    c_tokens: int
    answer: ClassVar[type] = PushHanded


@dataclass(frozen=True)
class ReadFinal:
    answer: ClassVar[type] = FinalRead


@dataclass(frozen=True)
class Wait:
    """Wait for input (a message, an ack, a reconnect) or a short poll, never past `deadline`."""

    what: str
    deadline: float
    on: tuple = ()  # what input ends it early: "control", "pulls", "bcast", "final", "pushes"
    answer: ClassVar[type] = Tick


REQUESTS = (ReadControl, VerifyManifest, ReadBroadcasts, TakePulls, Reap, Push, ReadFinal, Wait)

