"""The syncer's checkpoint directory: the source of truth for the bytes of every committed version.

One pair of raw little-endian f32 files per fragment and version (`frag-F-vN.params`,
`frag-F-vN.momentum`) and `checkpoint.json`, which names the current files, the version per fragment,
the committed global step and the session fingerprint. A commit writes the new fragment files (fsync),
then replaces `checkpoint.json` atomically (write, fsync, rename, fsync the directory), then deletes the
fragment's older files: a crash at any point leaves either the old or the new version complete, never a
mix, so a restarted syncer never re-issues a version number with different bytes. What a crash leaves
behind (a `*.tmp` file, the new version's files the manifest never named) is never read, and the
fragment's next commit deletes it. A file that cannot be used (missing, torn, not the manifest's
format) raises CheckpointError naming it.

Files, not the Object Store: its client is too slow for GB objects (NATS-NOTES).
"""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import torch

MANIFEST = "checkpoint.json"
FORMAT = 1


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
        f.write(memoryview(t.detach().contiguous().view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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

    def to_json(self) -> bytes:
        return orjson.dumps({
            "format": FORMAT,
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
        }, option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes) -> "CheckpointState":
        d = orjson.loads(data)
        if d.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint format {d.get('format')!r} is not {FORMAT}")
        return cls(
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
        )


class CheckpointDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def exists(self) -> bool:
        return (self.path / MANIFEST).is_file()

    def files(self, fragment: int, version: int) -> tuple[Path, Path]:
        return (self.path / f"frag-{fragment}-v{version}.params", self.path / f"frag-{fragment}-v{version}.momentum")

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
        fragments: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Durably write the given fragments' params and momentum at state.versions, then the manifest."""
        self.path.mkdir(parents=True, exist_ok=True)
        for fid, (params, momentum) in fragments.items():
            p, m = self.files(fid, state.versions[fid])
            _write_tensor(p, params)
            _write_tensor(m, momentum)
        tmp = self.path / (MANIFEST + ".tmp")
        with open(tmp, "wb") as f:
            f.write(state.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / MANIFEST)
        _fsync_dir(self.path)
        # Only now are older versions of these fragments unreferenced.
        for fid in fragments:
            keep = {q.name for q in self.files(fid, state.versions[fid])}
            for old in self.path.glob(f"frag-{fid}-v*"):
                if old.name not in keep:
                    old.unlink(missing_ok=True)

    def load_fragment(self, fragment: int, version: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        p, m = self.files(fragment, version)
        if not p.is_file() or not m.is_file():
            raise CheckpointError(f"checkpoint {self.path} lacks fragment {fragment} version {version} ({p.name}, {m.name})")
        return _read_tensor(p, numel), _read_tensor(m, numel)


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(t.contiguous().view(torch.uint8).numpy())).hexdigest()
