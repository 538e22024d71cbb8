"""The syncer's checkpoint directory: the source of truth for the bytes of every committed version.

One pair of raw little-endian f32 files per fragment and version (`frag-F-vN.params`, `frag-F-vN.momentum`;
the params alone in the sparse outer mode, docs/design.md §4.10, where with an f32 bulk a version between
full cuts is `frag-F-vN.update`, named by the manifest's `chains`: state_chain.py) and `checkpoint.json`,
which names the current files, the version per fragment, the committed global step and the session
fingerprint; a merge streams its new version into them as it goes (`VersionFiles`), and a cut-through merge
records its **intent** first (`write_intent`; the seal and the intent: docs/design.md §8).
Invariants: a commit writes the new fragment files (fsync), then replaces `checkpoint.json` atomically
(write, fsync, rename, fsync the directory), then deletes the files no chain needs: a crash at any point
leaves either the old or the new version complete, never a mix, so a restarted syncer never re-issues a
version number with different bytes. What a crash leaves behind (a `*.tmp` file, files the manifest never
named) is never read, and the fragment's next commit deletes it. A file that cannot be used (missing, torn,
not the manifest's format) raises CheckpointError naming it. Files, not the Object Store (§15.3).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import orjson
import torch

from yeto.schemas import versions
from yeto.services.syncer import state_chain as SC

MANIFEST = "checkpoint.json"
# The state format written (schemas/versions.py): `format` and `software` on the manifest and the intents.
# Format 1 (yeto-nats 0.1.0 before versioned state) is read and migrated in memory.
FORMAT = versions.STATE_FORMAT


WRITEBACK_BYTES = 16 << 20  # per file: start the kernel's writeback of what was written every this many bytes
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    """libc's sync_file_range (Linux; the os module has no binding), else None: then the commit's fsync
    writes everything, as before."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing `nbytes` at `offset` of `fd` to disk (does not wait, never fails:
    only the fsync that follows is a promise)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class CheckpointError(RuntimeError):
    """A checkpoint file is missing or unusable; the message names the file."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tensor(path: Path, t: torch.Tensor) -> None:
    assert sys.byteorder == "little", "checkpoint files are little-endian f32"
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_tensor_bytes(t))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(torch.uint8).numpy())


class VersionFiles:
    """A fragment's new version written chunk by chunk while the merge runs: `add(offset, count)` (in
    order, after the chunk's outer step; the slices must not change until `finish`) writes the chunk's
    params and momentum (None: no momentum file) into `frag-F-vN.params.tmp` / `.momentum.tmp`; `finish`
    (in CheckpointDir.commit) waits for the writes, fsyncs the files once and renames them. `thread=True` writes on a thread of
    its own beside the merge (add only queues the chunk); else add writes inline. `seconds`: time spent
    writing (page cache); `wait_s`: how long `finish` waited for a writer thread still behind.
    `abort` closes and deletes the .tmp files (a failed merge; a crash leaves them to the next commit).

    The files stay `*.tmp` (page cache) until the commit, which only fsyncs both, renames them and writes
    the manifest: the order and crash semantics of the module doc hold (until the renames the files are
    `*.tmp` leftovers, after them files no manifest names, and the manifest is replaced only after both
    are durable). While it streams it asks the kernel to start writing each file back every
    `WRITEBACK_BYTES` (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`: it starts the writes, waits for
    nothing), so the commit's fsync finds the data mostly on disk already (512 MiB here: fsync 0.15 ->
    0.01 s, the writes +0.05 s)."""

    def __init__(self, ckpt: "CheckpointDir", fragment: int, version: int, params: torch.Tensor,
                 momentum: torch.Tensor | None, *, thread: bool = False):
        assert sys.byteorder == "little", "checkpoint files are little-endian f32"
        if momentum is not None and params.numel() != momentum.numel():
            raise CheckpointError(f"fragment {fragment}: params hold {params.numel()} values, momentum {momentum.numel()}")
        ckpt.path.mkdir(parents=True, exist_ok=True)
        self.fragment, self.version, self.numel = fragment, version, params.numel()
        self.params, self.momentum = params, momentum
        self.tensors = (params,) if momentum is None else (params, momentum)
        self.final = ckpt.files(fragment, version, momentum=momentum is not None)
        self.tmp = tuple(q.with_suffix(q.suffix + ".tmp") for q in self.final)
        # "wb": a leftover of an earlier attempt at this version (a crash) is truncated, never appended to
        self._f = [open(q, "wb") for q in self.tmp]
        self.done = 0            # elements handed to add
        self.written = 0         # elements written
        self.flushed = 0         # elements whose writeback was started (start_writeback)
        self.seconds = 0.0
        self.wait_s = 0.0
        self._error: BaseException | None = None
        self._q: queue.SimpleQueue | None = None
        self._thread = None
        if thread:
            self._q = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name=f"ckpt-frag-{fragment}-v{version}", daemon=True)
            self._thread.start()

    def add(self, elem_offset: int, elem_count: int) -> None:
        if elem_offset != self.done or elem_offset + elem_count > self.numel:
            raise CheckpointError(f"fragment {self.fragment} version {self.version}: chunk of elements "
                                  f"{elem_offset}..{elem_offset + elem_count} streamed out of order (expected from "
                                  f"{self.done}, {self.numel} in all)")
        self.done += elem_count
        if self._q is not None:
            self._q.put((elem_offset, elem_count))
        else:
            self._write(elem_offset, elem_count)

    def _write(self, elem_offset: int, elem_count: int) -> None:
        t0 = time.perf_counter()
        sl = slice(elem_offset, elem_offset + elem_count)
        for f, t in zip(self._f, self.tensors):
            f.write(_tensor_bytes(t[sl]))
        self.written += elem_count
        if (self.written - self.flushed) * 4 >= WRITEBACK_BYTES or self.written == self.numel:
            for f in self._f:  # unbuffered for chunks this size; flush() makes sure of it
                f.flush()
                start_writeback(f.fileno(), self.flushed * 4, (self.written - self.flushed) * 4)
            self.flushed = self.written
        self.seconds += time.perf_counter() - t0

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._error is None:       # after a failure, drain the queue without writing
                try:
                    self._write(*item)
                except BaseException as exc:  # noqa: BLE001 - raised by finish
                    self._error = exc

    def _join(self) -> None:
        if self._thread is not None:
            t0 = time.perf_counter()
            self._q.put(None)
            self._thread.join()
            self._thread = None
            self.wait_s += time.perf_counter() - t0

    def finish(self) -> None:
        """Both files durable under their final names (not yet named by the manifest)."""
        self._join()
        if self._error is not None:
            raise CheckpointError(f"writing {' / '.join(q.name for q in self.tmp)} failed: {self._error!r}")
        if self.written != self.numel:
            raise CheckpointError(f"fragment {self.fragment} version {self.version}: {self.written} of {self.numel} "
                                  f"values streamed to {self.tmp[0].name}; the version is not complete")
        for f in self._f:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for tmp, final in zip(self.tmp, self.final):
            os.replace(tmp, final)

    def abort(self) -> None:
        self._join()
        for f in self._f:
            f.close()
        for q in self.tmp:
            q.unlink(missing_ok=True)


def _read_tensor(path: Path, numel: int) -> torch.Tensor:
    size = path.stat().st_size
    if size != numel * 4:
        raise CheckpointError(f"{path} holds {size} bytes, expected {numel * 4} ({numel} f32 values)")
    t = torch.empty(numel, dtype=torch.float32)
    with open(path, "rb") as f:
        f.readinto(memoryview(t.view(torch.uint8).numpy()))
    return t


@dataclass
class CheckpointState:
    run: str
    session_fingerprint: str
    layout_fingerprint: str
    committed_step: int = 0
    versions: dict[int, int] = field(default_factory=dict)
    version_digests: dict[int, str] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)  # highest attempt used per step in flight at the last commit
    final: bool = False
    # The tape records of the last commit (merge + commit), written with it: a syncer killed before
    # they reached the EVENTS tape writes them on resume (same Nats-Msg-Ids, so never twice).
    tape: list[dict] = field(default_factory=list)
    # The finalization record (rounds.RecordFinal): targets, acks, finished.
    final_record: dict | None = None
    # The sparse mode's fragments kept as a full version and updates (state_chain.py); written only when
    # not empty, so a dense or bf16 manifest is as before.
    chains: dict[int, SC.Chain] = field(default_factory=dict)
    # Who wrote the state read (None: not stated, format 1) and the older format it was migrated from
    # (None: read as written). Provenance, not state: not compared, never written back (to_json states
    # this process's release and format).
    software: str | None = field(default=None, compare=False)
    migrated_from: int | None = field(default=None, compare=False)

    def to_json(self) -> bytes:
        return orjson.dumps({
            "format": FORMAT,
            "software": versions.software(),
            "run": self.run,
            "session_fingerprint": self.session_fingerprint,
            "layout_fingerprint": self.layout_fingerprint,
            "committed_step": self.committed_step,
            "versions": {str(k): v for k, v in self.versions.items()},
            "version_digests": {str(k): v for k, v in self.version_digests.items()},
            "attempts": {str(k): v for k, v in self.attempts.items()},
            "final": self.final,
            "tape": self.tape,
            "final_record": self.final_record,
            **({"chains": SC.to_manifest(self.chains, self.versions)} if self.chains else {}),
        }, option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes) -> "CheckpointState":
        d = orjson.loads(data)
        if not isinstance(d, dict) or "format" not in d:   # format 1 has the field too: anything else is not ours
            raise CheckpointError(f"not a checkpoint manifest (no 'format' field in {type(d).__name__})")
        try:
            d = versions.migrate_state(d, "the checkpoint manifest")
        except versions.StateFormatError as exc:
            raise CheckpointError(str(exc)) from None
        try:
            chains = SC.from_manifest(d, {int(k): int(v) for k, v in d["versions"].items()},
                                      {int(k): v for k, v in d.get("version_digests", {}).items()}, "the manifest")
        except SC.ChainError as exc:
            raise CheckpointError(str(exc)) from None
        return cls(
            chains=chains,
            run=d["run"],
            session_fingerprint=d["session_fingerprint"],
            layout_fingerprint=d["layout_fingerprint"],
            committed_step=int(d["committed_step"]),
            versions={int(k): int(v) for k, v in d["versions"].items()},
            version_digests={int(k): v for k, v in d.get("version_digests", {}).items()},
            attempts={int(k): int(v) for k, v in d.get("attempts", {}).items()},
            final=bool(d.get("final", False)),
            tape=list(d.get("tape") or []),
            final_record=d.get("final_record"),
            software=d.get("software"),
            migrated_from=d.get("migrated_from"),
        )


class CheckpointDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def exists(self) -> bool:
        return (self.path / MANIFEST).is_file()

    def files(self, fragment: int, version: int, *, momentum: bool = True) -> tuple[Path, ...]:
        """The version's files: params and momentum, or (`momentum=False`, the sparse mode) params alone."""
        p = self.path / f"frag-{fragment}-v{version}.params"
        return (p, self.path / f"frag-{fragment}-v{version}.momentum") if momentum else (p,)

    def update_path(self, fragment: int, version: int) -> Path:
        """A version kept as its update message from the version before (state_chain.py)."""
        return self.path / f"frag-{fragment}-v{version}.update"

    def session_path(self) -> Path:
        return self.path / "session.json"

    def write_session(self, session: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.session_path().with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(session, option=orjson.OPT_INDENT_2))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.session_path())
        _fsync_dir(self.path)

    def read_session(self) -> dict:
        path = self.session_path()
        try:
            session = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(f"no session in {self.path} (missing {path.name})") from None
        except orjson.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not JSON ({exc})") from None
        if not isinstance(session, dict):
            raise CheckpointError(f"{path} holds a {type(session).__name__}, not a session record")
        return session

    def read_state(self) -> CheckpointState:
        path = self.path / MANIFEST
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint in {self.path} (missing {MANIFEST})") from None
        try:
            return CheckpointState.from_json(data)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        except KeyError as exc:
            raise CheckpointError(f"{path} lacks the field {exc.args[0]!r}") from None
        except (ValueError, TypeError, AttributeError) as exc:  # orjson.JSONDecodeError is a ValueError
            raise CheckpointError(f"{path} is not a checkpoint manifest ({type(exc).__name__}: {exc})") from None

    def commit(
        self,
        state: CheckpointState,
        fragments: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
        streamed: dict[int, VersionFiles] | None = None,
        *,
        prune: bool = True,
        updates: dict[int, bytes] | None = None,
    ) -> None:
        """Durably write the given fragments' params and momentum (None: none, no file) at state.versions,
        then the manifest.
        `streamed`: fragments whose new version the merge already wrote (VersionFiles): only fsynced
        and renamed here; the others are written whole. Then the older files go (`prune`; False:
        the caller prunes later)."""
        self.path.mkdir(parents=True, exist_ok=True)
        streamed = streamed or {}
        for fid, vf in streamed.items():
            if fid not in fragments or vf.version != state.versions.get(fid) or vf.fragment != fid:
                raise CheckpointError(f"streamed files of fragment {vf.fragment} version {vf.version} do not belong "
                                      f"to this commit (versions {state.versions})")
        for fid, (params, momentum) in fragments.items():
            if fid in streamed:
                streamed[fid].finish()
                continue
            chain = state.chains.get(fid)
            if chain is not None and chain.top == state.versions[fid] and chain.top != chain.base:
                if fid not in (updates or {}):   # the state's chain says so: never a version without its bytes
                    raise CheckpointError(f"fragment {fid} version {chain.top}: the manifest keeps it as an update, "
                                          f"none was given")
                _write_bytes(self.update_path(fid, chain.top), updates[fid])
                continue
            p, m = self.files(fid, state.versions[fid])
            _write_tensor(p, params)
            if momentum is not None:
                _write_tensor(m, momentum)
        tmp = self.path / (MANIFEST + ".tmp")
        with open(tmp, "wb") as f:
            f.write(state.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / MANIFEST)
        _fsync_dir(self.path)
        if prune:
            self.prune(state, fragments)

    def prune(self, state: CheckpointState, fragments: Iterable[int]) -> None:
        """Delete the files of `fragments` that `state` (committed) no longer names: older versions and
        what a crash left. Callers that commit with prune=False run it once the version is out (off the path
        to the state KV record and the seal; a crash before that leaves them to the next commit)."""
        for fid in fragments:
            chain = state.chains.get(fid)
            keep = ({q.name for q in self.files(fid, chain.base)} | {self.update_path(fid, v).name for v in
                                                                      chain.versions[1:]} if chain is not None
                    else {q.name for q in self.files(fid, state.versions[fid])})
            for old in self.path.glob(f"frag-{fid}-v*"):
                if old.name not in keep:
                    old.unlink(missing_ok=True)

    def intent_path(self, fragment: int) -> Path:
        return self.path / f"intent-{fragment}.json"

    def write_intent(self, fragment: int, intent: dict) -> None:
        """Durably record a cut-through merge's inputs before its first chunk is sent (`intent-F.json`: the
        Merge action, the pushes' stream sequences and chunk digests, the outer hyper-parameters and the
        attempts; written, fsynced, renamed). A cut-through merge sends a version's chunks before it is
        durable, so a resumed syncer that finds an intent for the version after the checkpointed one redoes
        that merge from the same pushes (they stay in PUSH until the commit) on the same checkpointed params
        and momentum: the same bytes. An intent for a version already committed is stale and ignored (the
        next one replaces it)."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.intent_path(fragment)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(orjson.dumps({"format": FORMAT, "software": versions.software(), "fragment": fragment, **intent}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.path)

    def read_intent(self, fragment: int) -> dict | None:
        """The fragment's last merge intent, or None (none written, or a torn one: a crash before its
        rename leaves only the .tmp file, and then no chunk of that merge was sent)."""
        path = self.intent_path(fragment)
        try:
            d = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except orjson.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not JSON ({exc})") from None
        if not isinstance(d, dict) or "format" not in d or d.get("fragment") != fragment:
            raise CheckpointError(f"{path} is not a merge intent of fragment {fragment}")
        try:   # an intent of format 1 (0.1.0 before versioned state) has the same fields
            return versions.migrate_state(d, str(path))
        except versions.StateFormatError as exc:
            raise CheckpointError(str(exc)) from None

    def drop_intent(self, fragment: int) -> None:
        self.intent_path(fragment).unlink(missing_ok=True)

    def load_fragment(self, fragment: int, version: int, numel: int, *, momentum: bool = True,
                      chain: SC.Chain | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The version's params and momentum (`momentum=False`: the params and None, the sparse mode).
        `chain` (the manifest's for this fragment, ending at `version`): its full version's params with
        the updates after it applied (`apply_step_`), each result checked against its version digest."""
        if chain is not None and chain.top == version and chain.top != chain.base:
            params, _ = self.load_fragment(fragment, chain.base, numel, momentum=False)
            if sha256_of(params) != chain.digest(chain.base):
                raise CheckpointError(f"{self.files(fragment, chain.base)[0]} does not hash to the digest the "
                                      f"manifest's chain recorded for version {chain.base}")
            session = self.read_session()
            frag = next(f for f in session["fragments"] if f["id"] == fragment)
            from yeto.schemas import outer_mode as OM

            spec = OM.from_session(session).spec
            for v in chain.versions[1:]:
                path = self.update_path(fragment, v)
                try:
                    data = path.read_bytes()
                except FileNotFoundError:
                    raise CheckpointError(f"checkpoint {self.path} lacks {path.name} (fragment {fragment}'s chain "
                                          f"{chain.base}..{chain.top})") from None
                try:
                    SC.apply(params, data, frag, spec, chain.digest(v), str(path))
                except SC.ChainError as exc:
                    raise CheckpointError(str(exc)) from None
            return params, None
        files = self.files(fragment, version, momentum=momentum)
        if not all(q.is_file() for q in files):
            raise CheckpointError(f"checkpoint {self.path} lacks fragment {fragment} version {version} "
                                  f"({', '.join(q.name for q in files)})")
        got = [_read_tensor(q, numel) for q in files]
        return got[0], (got[1] if momentum else None)


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(t.contiguous().view(torch.uint8).numpy())).hexdigest()
