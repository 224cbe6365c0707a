"""Seeded draws that depend on the seed alone, not on what the process has imported.

Hypothesis (since 6.131) draws, about one choice in twenty, a constant it collected from every "local" module in
``sys.modules``: every file outside site-packages and the standard library, which for an editable install is all
of kvfuzz, and also the private copy of a re-injected bug's kernel (hypothesis/internal/conjecture/providers.py,
``_get_local_constants``, rescanned whenever ``sys.modules`` grows). So the same campaign seed drew other
examples after other imports: a campaign of ``bug.vllm-30887`` bounded at 150 examples found the bug at the 60th
alone and not at all after the other tests of its file had imported more of kvfuzz (tests/fuzz/bench/test_bugs.py),
and a worker that had imported another target drew otherwise than a fresh one. :func:`seed_only` takes that pool
out of kvfuzz's seeded runs (campaign chunks, relation runs); Hypothesis's own constants, fixed per release, stay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def seed_only() -> Iterator[None]:
    """Within the block, Hypothesis draws no constant from the process's local modules, so a run under ``@seed``
    draws the same examples whatever was imported before or during it; on exit the pool is Hypothesis's again
    (a user's own Hypothesis tests in the same process keep it). Its cache of permitted constants is emptied on
    entry and exit, so no choice made under one pool is drawn under the other. Not thread-safe: one seeded run
    at a time in a process, as kvfuzz's workers run them. A Hypothesis without the pool (before 6.131): nothing
    to do."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # pragma: no cover - a Hypothesis without local constants
        yield
        return
    pooled = getattr(providers, "_get_local_constants", None)
    cache = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)
    if pooled is None or cache is None:  # pragma: no cover - internals moved: draws as Hypothesis does
        yield
        return
    none = Constants()
    providers._get_local_constants = lambda: none
    cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = pooled
        cache.clear()


__all__ = ["seed_only"]
