"""What fills every cache slot a caller's contract leaves unwritten (no torch here: the CLI lists the names)."""

from __future__ import annotations

import enum


class Poison(enum.Enum):
    """What fills every cache slot the materializer did not write.

    NAN and INF: uninitialised memory; a kernel that lets an unwritten slot reach its output shows it at once.
    STALE: large finite values, as a freed block's previous owner leaves behind; a wrong read becomes a wrong
    (but finite) answer. ZEROS: a zero-initialised cache, as most kernel tests use; the gentlest.
    """

    NAN = "nan"
    INF = "inf"
    STALE = "stale"
    ZEROS = "zeros"


__all__ = ["Poison"]
