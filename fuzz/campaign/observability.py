"""Hypothesis observability output (for Tyche, https://github.com/tyche-pbt/tyche-extension), behind
``kvfuzz fuzz --observability``: every test case Hypothesis runs is written as one JSON line to
``<out>/observed/<date>_testcases.jsonl`` (and info lines to ``..._info.jsonl``), the format Hypothesis
itself writes under ``.hypothesis/observed/`` when HYPOTHESIS_EXPERIMENTAL_OBSERVABILITY is set. Each line
carries the example's events (kernel path, batch mix, GQA, boundary lengths, modeled ROCm routing), its
target() score and its outcome.

Uses hypothesis.internal.observability (callbacks and to_jsonable): Hypothesis's own mechanism, internal
but stable across 6.1xx."""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
from pathlib import Path

from hypothesis.internal.observability import with_observability_callback
from hypothesis.strategies._internal.utils import to_jsonable


@contextlib.contextmanager
def observe_to(directory: Path, prefix: str = ""):
    """Within the block, write Hypothesis observations as JSON lines under ``directory`` (file names start with
    ``prefix``: one set of files per worker process)."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    day = datetime.date.today().isoformat()

    def deliver(observation, thread_id=None) -> None:
        kind = "testcases" if observation.type == "test_case" else "info"
        line = json.dumps(to_jsonable(observation, avoid_realization=False)) + "\n"
        with lock, open(directory / f"{prefix}{day}_{kind}.jsonl", "a") as f:
            f.write(line)

    with with_observability_callback(deliver, all_threads=True):
        yield directory


__all__ = ["observe_to"]
