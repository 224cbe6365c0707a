"""The example database a campaign keeps its failures in, so the next run (any worker, any host) replays them
first. Hypothesis's own databases, combined:

- default: a directory, ``OUT/hypothesis-db``;
- ``--db DIR``: that directory (several campaigns on one file system share it);
- ``--db redis://host:port/N``: a :class:`~hypothesis.database.MultiplexedDatabase` of the local directory
  and Redis (:mod:`hypothesis.extra.redis`), the Redis side wrapped in :class:`Tolerant`: a Redis outage
  mid-campaign is counted and reported but loses nothing, because every failure is also saved locally;
- ``kvfuzz check --db SPEC``: a :class:`~hypothesis.database.ReadOnlyDatabase` view, so the gate replays the
  corpus's failures but never writes to it.

:func:`open_database` raises :class:`DatabaseError` (naming the spec and the fix) when the database cannot be
used at all: a path that is a file, a Redis URL without the redis package, a Redis server that does not answer.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable

from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    InMemoryExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class DatabaseError(ValueError):
    """The example database named by ``--db`` cannot be used; the message says why and what to do."""


class Tolerant(ExampleDatabase):
    """A database whose errors (a network outage) are counted instead of raised: ``fetch`` yields nothing,
    ``save``/``delete``/``move`` do nothing. Use it inside a MultiplexedDatabase next to a local one.
    ``errors``: how many operations failed; ``last_error``: the last one, for the summary."""

    def __init__(self, inner: ExampleDatabase) -> None:
        super().__init__()
        self.inner = inner
        self.errors = 0
        self.last_error = ""
        self._lock = threading.Lock()

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"

    def fetch(self, key: bytes) -> Iterable[bytes]:
        try:
            values = list(self.inner.fetch(key))
        except Exception as e:  # the shared database is down: replay what the local one has
            self._failed(e)
            return
        yield from values

    def save(self, key: bytes, value: bytes) -> None:
        try:
            self.inner.save(key, value)
        except Exception as e:
            self._failed(e)

    def delete(self, key: bytes, value: bytes) -> None:
        try:
            self.inner.delete(key, value)
        except Exception as e:
            self._failed(e)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        try:
            self.inner.move(src, dest, value)
        except Exception as e:
            self._failed(e)

    def __repr__(self) -> str:
        return f"Tolerant({self.inner!r})"


def _redis(spec: str, ping: bool = True) -> ExampleDatabase:
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError:
        raise DatabaseError(f"--db {spec}: a Redis database needs the redis package "
                            "(pip install 'kvfuzz[redis]')") from None
    client = redis.Redis.from_url(spec, socket_connect_timeout=5, socket_timeout=10)
    if not ping:
        return RedisExampleDatabase(client)
    try:
        client.ping()
    except Exception as e:
        raise DatabaseError(f"--db {spec}: the Redis server does not answer ({type(e).__name__}: {e}); start it, "
                            "fix the URL, or leave --db out to keep the corpus in OUT/hypothesis-db") from None
    return RedisExampleDatabase(client)


def _directory(path: Path, spec: str) -> DirectoryBasedExampleDatabase:
    if path.exists() and not path.is_dir():
        raise DatabaseError(f"--db {spec}: {path} is a file, not a directory; name a directory (created if "
                            "missing) or a redis:// URL")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatabaseError(f"--db {spec}: cannot create the directory {path} ({e.strerror}); name a writable "
                            "directory") from None
    return DirectoryBasedExampleDatabase(str(path))


def open_database(spec: str | None, out: Path, ping: bool = True) -> ExampleDatabase:
    """The database of a campaign writing to ``out`` (see the module docstring). ``ping``: check that a Redis
    server answers (the supervisor, at start); a worker opens it unchecked, so a server lost after the start
    costs it only the shared corpus (the Tolerant part counts the errors), never the campaign. Raises
    DatabaseError."""
    if spec is None:
        return _directory(Path(out) / "hypothesis-db", str(Path(out) / "hypothesis-db"))
    if spec.startswith(REDIS_SCHEMES):
        return MultiplexedDatabase(_directory(Path(out) / "hypothesis-db", spec), Tolerant(_redis(spec, ping)))
    if not spec.strip():
        raise DatabaseError("--db '': name a directory or a redis:// URL, or leave --db out")
    return _directory(Path(spec), spec)


def read_only_view(spec: str | None) -> ExampleDatabase:
    """What ``kvfuzz check`` runs against: an in-memory database (its own findings, forgotten after the run)
    plus, with ``spec``, a read-only view of that corpus (its failures replay first; nothing is written)."""
    mem = InMemoryExampleDatabase()
    if spec is None:
        return mem
    if spec.startswith(REDIS_SCHEMES):
        shared: ExampleDatabase = _redis(spec)
    else:
        path = Path(spec)
        if not path.is_dir():
            raise DatabaseError(f"--db {spec}: no such directory (the gate reads a corpus, it does not create one)")
        shared = DirectoryBasedExampleDatabase(str(path))
    return MultiplexedDatabase(mem, ReadOnlyDatabase(shared))


def remote_errors(db: ExampleDatabase) -> tuple[int, str]:
    """``(errors, last error)`` of the Tolerant parts of ``db`` (0 and "" when it has none)."""
    parts = getattr(db, "_wrapped", (db,))
    tolerant = [p for p in parts if isinstance(p, Tolerant)]
    return sum(p.errors for p in tolerant), next((p.last_error for p in tolerant if p.last_error), "")


__all__ = ["DatabaseError", "Tolerant", "open_database", "read_only_view", "remote_errors"]
