"""What a campaign keeps on disk, and how: written atomically, read tolerantly, guarded by a lock.

- :func:`write_json` writes a file whole or not at all (a temporary file in the same folder, flushed, then
  ``os.replace``): a campaign killed mid-write leaves the previous version, never half of one.
- :func:`read_json` reads a state file back; a torn or foreign one (invalid JSON, the wrong shape) is moved
  aside to ``NAME.corrupt`` with a warning and treated as absent, so one bad file never breaks every later run.
- :class:`OutLock` holds ``OUT/.kvfuzz.lock`` (``fcntl.flock``) for a campaign's lifetime: a second campaign on
  the same ``--out`` is refused, naming the holder. The kernel releases the lock when its process dies, so a
  stale lock from a dead campaign is taken over without ceremony.
- A full disk is an ending like any other: :func:`disk_full` tells an ``OSError`` of a full disk or quota,
  :class:`OutOfSpace` carries it out of a campaign (a ``BaseException``, as ``KeyboardInterrupt``: Hypothesis
  stops at once instead of shrinking it, and no ``except Exception`` takes it for the kernel's or the adapter's
  error), and the supervisor ends the campaign with exit status 3, keeping what it wrote (docs/campaigns.md).
- :class:`CampaignState` (``OUT/state.json``): per target, how many chunks of seeds were started (a resumed
  campaign continues with new seeds), whether the campaign is running, and the examples in flight per worker
  (what a campaign killed outright was doing; the next run retries them).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import attrs


class StateFileWarning(UserWarning):
    """A state file was torn or unreadable and was set aside."""


#: errno values of a write that failed for want of space: the device is full, or the user's quota is spent.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` is an error of a full disk (ENOSPC) or a spent quota (EDQUOT): an OSError with that errno, or
    an error of Rust code (safetensors' ``SafetensorError``) whose message ends in Rust's ``(os error N)``."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno in DISK_FULL_ERRNOS
    return isinstance(e, Exception) and any(f"(os error {n})" in str(e) for n in DISK_FULL_ERRNOS)


class OutOfSpace(BaseException):
    """A campaign could not write ``path``: no space left on its device (or quota). A ``BaseException``, as
    ``KeyboardInterrupt`` is, so that Hypothesis re-raises it at once instead of shrinking it, and no
    ``except Exception`` in a harness takes it for an adapter's or a kernel's error."""

    def __init__(self, path: Path | str, error: OSError | None = None) -> None:
        self.path = str(path)
        self.error = error
        why = error.strerror if error is not None and error.strerror else "No space left on device"
        super().__init__(f"{why.lower()}: could not write {self.path}")


@contextlib.contextmanager
def stop_when_full(path: Path | str):
    """Turn an error of a full disk (:func:`disk_full`) raised inside the block into :class:`OutOfSpace` naming
    ``path``; any other error passes unchanged."""
    try:
        yield
    except Exception as e:
        if disk_full(e):
            raise OutOfSpace(path, e if isinstance(e, OSError) else None) from e
        raise


def write_json(path: Path, obj: Any, *, fsync: bool = False) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`write_text`; ``fsync``: also survive a machine crash, at
    ~ms cost). Non-finite floats are written as the strings "nan", "inf", "-inf" (JSON has no NaN).

    Raises OSError when the file cannot be written (a full disk: ENOSPC, see :func:`disk_full`); ``path`` then
    keeps its previous version and the temporary file is removed."""
    write_text(path, json.dumps(json_safe(obj), indent=1, allow_nan=False) + "\n", fsync=fsync)


def write_text(path: Path | str, text: str, *, fsync: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary file in the same folder, renamed over it
    (``fsync``: flushed to the disk first, so it also survives a machine crash). Raises OSError when it cannot be
    written; ``path`` then keeps its previous version and the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()  # inside the try: a full disk shows here (or at close), not in a later, silent close
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats as strings and anything else JSON cannot hold as ``str``."""
    if isinstance(obj, float):
        if obj != obj:
            return "nan"
        if obj in (float("inf"), float("-inf")):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def read_json(path: Path, default: Any = None, *, expect: type = dict,
              warn: Callable[[str], None] | None = None) -> Any:
    """The JSON in ``path``, or ``default`` when it is missing. A file that does not parse, or whose top level
    is not ``expect``, is renamed to ``PATH.corrupt`` (kept for inspection) and ``default`` is returned, with a
    warning through ``warn`` (default: :class:`StateFileWarning`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return default
    try:
        obj = json.loads(text)
        if not isinstance(obj, expect):
            raise ValueError(f"top level is {type(obj).__name__}, expected {expect.__name__}")
    except ValueError as e:
        aside = path.with_name(path.name + ".corrupt")
        os.replace(path, aside)
        msg = f"{path} was unreadable ({e}); moved it to {aside} and started without it"
        (warn or (lambda m: warnings.warn(m, StateFileWarning, stacklevel=3)))(msg)
        return default
    return obj


class OutLocked(RuntimeError):
    """Another live campaign holds this output directory."""


class OutLock:
    """An exclusive lock on a campaign's output directory, held while the campaign runs.

    ``acquire`` raises :class:`OutLocked` naming the holder's pid and start time when another live process
    holds it (a lock left by a dead process is free: flock locks die with their process), and
    :class:`OutOfSpace` when the holder's line cannot be written for want of space."""

    NAME = ".kvfuzz.lock"

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / self.NAME
        self._fd: int | None = None

    def acquire(self) -> "OutLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutLocked(f"{self.path.parent} is in use by another kvfuzz campaign ({holder}); wait for it to "
                            f"finish, stop it, or give this one another --out") from None
        self._fd = fd
        try:
            with stop_when_full(self.path):
                os.ftruncate(fd, 0)
                os.write(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@attrs.define
class CampaignState:
    """``OUT/state.json``. chunks: target -> how many chunks of seeds were started (chunk ``k`` of a campaign
    with seed ``s`` uses Hypothesis seed ``s * 100_003 + k``). running: the campaign had not ended cleanly
    (its supervisor was killed). in_flight: worker -> the example it was running (``{"target", "example",
    "fault"}``) at the last snapshot."""

    path: Path
    seed: int = 0
    chunks: dict[str, int] = attrs.Factory(dict)
    running: bool = False
    in_flight: dict[str, dict] = attrs.Factory(dict)

    @classmethod
    def load(cls, out: Path, seed: int, warn: Callable[[str], None] | None = None) -> "CampaignState":
        """The state of the last campaign in ``out`` (a fresh one if there is none or it is unreadable). Chunks
        are per seed: a campaign with another ``--seed`` starts at chunk 0."""
        path = Path(out) / "state.json"
        d = read_json(path, {}, warn=warn)
        chunks = d.get("chunks", {}) if d.get("seed") == seed else {}
        try:
            chunks = {str(k): int(v) for k, v in chunks.items()}
        except (AttributeError, TypeError, ValueError):
            chunks = {}
        in_flight = d.get("in_flight", {}) if isinstance(d.get("in_flight"), dict) else {}
        return cls(path, seed, chunks, bool(d.get("running", False)), in_flight)

    def save(self) -> None:
        write_json(self.path, {"seed": self.seed, "chunks": self.chunks, "running": self.running,
                               "in_flight": self.in_flight})


__all__ = ["CampaignState", "DISK_FULL_ERRNOS", "OutLock", "OutLocked", "OutOfSpace", "StateFileWarning", "disk_full",
           "json_safe", "read_json", "stop_when_full", "write_json", "write_text"]
