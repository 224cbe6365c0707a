"""A standby for confirmations: one sanitized child started beside a worker's long-lived one
(kvfuzz.fuzz.harness.sanitizer.SanitizedChild), warmed up and kept idle, that runs no example until a hit of the
long-lived child is to be confirmed; it then runs that example as its only one and ends, and a new standby starts.

Why: the long-lived child is a screen; a hit it reports is decided in a child that has run no other example, whose
whole report (its ERROR SUMMARY included) cannot belong to another example. That child was started for the hit
(:func:`~kvfuzz.fuzz.harness.sanitizer.sanitize`) and cost 20.5-25.2 s on an H200: spawn, imports, the CUDA context
and torch's kernels loaded under memcheck, inside the GPU's sanitized slot, the largest part of vllm#56862's time to
first failure (docs/benchmarks.md, "The child's warm-up, before and after"). The standby pays that start in the
background, off the slot, before the hit.

Why it is as honest as a fresh child: the standby is a fresh child started earlier. It runs with
:func:`~kvfuzz.fuzz.harness.sanitizer.sanitize`'s compute-sanitizer options (not the screen's), has run no example
(its warm-up, kvfuzz.fuzz.harness.sanitizer_warmup, prepares tiny examples and never calls the kernel under test),
runs the hit's example alone and ends: its ERROR SUMMARY counts that example's errors only, and
:func:`~kvfuzz.fuzz.harness.sanitizer_report.verdict` decides it as it decides a fresh child's report. A standby whose
warm-up printed any memcheck error is not used (its summary would count them): "not clean".

A standby that cannot decide is counted where the confirmation ran (:data:`CONFIRMS`, summary.json's
``time.sanitize`` ``confirms``), ended, and the example is confirmed by a fresh child as before: it died (before its
ready marker, before it took the example, or without an ERROR SUMMARY), it hung (no ready marker within
``start_timeout``, or no end within ``timeout`` after the example), or it was not clean. After :data:`MAX_LOST`
standbys in a row were lost a worker starts no more (``given up``): each confirmation is a fresh child. So a lost
standby costs time, never an example nor a verdict. Memory: one more child per sanitizing worker (a CUDA context
and an idle Python process with the target loaded), and never two standbys: a new one starts after the last one
ended. On by default since a GPU measured it beside fresh confirmations (benchmarks/gpu_standby_ab.sh,
benchmarks/results/standby-ab-h200.txt: vllm#56862 first at 35.7-62.0 s against 55.4-82.9 s, 4.7-7.7 s for three
confirmations against 19.3-21.3 s for one or two, +3.0-3.7 GiB of host memory under the sanitizers of 6 workers).
``KVFUZZ_SANITIZE_STANDBY=0`` turns it off (every confirmation in a fresh child, the behaviour before); ``1`` or
unset starts the standby with the long-lived child (a hit soon after the long-lived child is ready finds its standby
ready too); ``ready`` once the long-lived child is ready (the two starts do not share the host and GPU; a hit before
the standby is ready waits for the rest of its start, less than a fresh child's whole start).
"""

from __future__ import annotations

import json
import os
import queue
import time
from pathlib import Path

from kvfuzz.contracts.checks.failures import HarnessError
from kvfuzz.fuzz.harness.sanitizer import MARK, TIMEOUT_S, SanitizedChild, sanitize
from kvfuzz.fuzz.harness.sanitizer_report import parse_memcheck, verdict

#: Environment variable: ``0`` turns the standby off (every hit confirmed in a fresh child, started for it);
#: ``ready`` starts it once the long-lived child is ready, not with it; unset or ``1``: with it (:func:`screen`).
ENV = "KVFUZZ_SANITIZE_STANDBY"
#: Standbys lost in a row (died, hung, not clean) after which a worker starts no more.
MAX_LOST = 3
#: Where a confirmation ran (SanitizedChild.last["confirm"]): in the standby; in a fresh child because the standby
#: is off; in a fresh child because the standby died, hung, was not clean, was not started (not yet, or its start
#: failed), or this worker gave up on standbys.
CONFIRMS = ("standby", "fresh", "fresh: standby died", "fresh: standby hung", "fresh: standby not clean",
            "fresh: standby not started", "fresh: standby given up")


class Standby(SanitizedChild):
    """A child under ``compute-sanitizer --tool memcheck`` (``--serve``, as the long-lived child) started and left
    idle until :meth:`run_once`. Its options are :func:`~kvfuzz.fuzz.harness.sanitizer.sanitize`'s (memcheck's own
    defaults, ``--print-limit 20``): it is a fresh child for one example, not a screen. What it prints before its
    ready marker is kept (:attr:`before`): a warm-up with memcheck errors makes it not clean."""

    FLAGS = ("--print-limit", "20")

    def __init__(self, spec: str, sanitizer: str | None = None, timeout: float = TIMEOUT_S):
        super().__init__(spec, sanitizer, timeout)
        #: the lines it printed before its ready marker (memcheck's banner, its warm-up's output)
        self.before: list[str] = []

    def start(self) -> None:
        """Start it without waiting (its start, warm-up included, runs in the background)."""
        self._start()

    def _ready_marker(self, at: float, line: str) -> bool:
        if super()._ready_marker(at, line):
            return True
        self.before.append(line)
        return False

    def run_once(self, example, start_timeout: float) -> str | None:
        """Run ``example`` as this child's only example and let it end; its whole report decides, as
        :func:`~kvfuzz.fuzz.harness.sanitizer_report.verdict` decides a fresh child's (returns when clean, raises
        MemorySafetyError, DeviceFull or HarnessError), and None is returned. When it cannot decide, returns why
        ("died", "hung", "not clean": the module docstring), the child ended. Waits at most ``start_timeout``
        seconds for its ready marker and ``timeout`` for its end after the example is sent."""
        lost = self._wait_ready(start_timeout)
        if lost is None and (self.started is None or not self.running):
            lost = "died"  # it ended before its ready marker, or after it while idle
        elif lost is None and self._unclean():
            lost = "not clean"
        if lost is not None:
            self.close(kill=True)
            return lost
        path = Path(self._dir) / "example.json"
        path.write_text(json.dumps(example.to_dict()))
        try:
            self._proc.stdin.write(f"{path}\n")
            self._proc.stdin.close()  # its only example: it ends after it, and memcheck prints its ERROR SUMMARY
        except OSError:
            self.close(kill=True)
            return "died"
        lines, end = [], time.monotonic() + self.timeout
        while True:
            try:
                _, line = self._lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                self.close(kill=True)
                return "hung"
            if line is None:
                break
            if not line.startswith(MARK):
                lines.append(line)
        proc, text = self._proc, "\n".join(lines)
        self.close()
        if parse_memcheck(text).error_count is None:
            return "died"  # no ERROR SUMMARY: not a report (a fresh child decides)
        verdict(text, f"{self.exe or 'compute-sanitizer'} (standby)", proc.returncode)
        return None

    def _wait_ready(self, timeout: float) -> str | None:
        """Read its lines until its ready marker: None when it came, "died" when its output ended or its process
        did first (the program under a killed compute-sanitizer may hold the output open), "hung" after ``timeout``
        seconds."""
        end = time.monotonic() + timeout
        while not self._ready:
            try:
                at, line = self._lines.get(timeout=min(0.5, max(0.0, end - time.monotonic())))
            except queue.Empty:
                if not self.running:
                    return "died"
                if time.monotonic() >= end:
                    return "hung"
                continue
            if line is None:
                return "died"
            self._ready_marker(at, line)
        return None

    def _unclean(self) -> bool:
        """Whether memcheck reported an error before its ready marker (its warm-up's, counted in its summary)."""
        report = parse_memcheck("\n".join(self.before))
        return bool(report.accesses or report.other or report.error_count)


class StandbyConfirmer:
    """Confirms the hits of a worker's long-lived child (kvfuzz.fuzz.harness.sanitizer.SanitizedChild's
    ``confirmer``) in a :class:`Standby`, keeping one started (:meth:`prestart`: with the long-lived child, or
    once it is ready with ``after_ready``, and after each confirmation). ``timeout``: a standby's seconds for its
    example, as a fresh child's; ``start_timeout``: the most a confirmation waits for a standby's ready marker.
    :attr:`lost`: standbys lost in a row."""

    def __init__(self, spec: str, sanitizer: str | None = None, timeout: float = TIMEOUT_S,
                 start_timeout: float = TIMEOUT_S, after_ready: bool = False):
        self.spec, self.exe, self.timeout, self.start_timeout = spec, sanitizer, timeout, start_timeout
        self.after_ready = after_ready
        self.standby: Standby | None = None
        self.lost = 0

    def prestart(self, screen_ready: bool = True) -> None:
        """Start a standby in the background unless one is there (idle, starting, or ended unused: the next
        confirmation classifies it) or this worker gave up on them (:data:`MAX_LOST`); with ``after_ready``, not
        while the long-lived child is still starting (``screen_ready`` False: its start is not slowed by the
        standby's). A standby that cannot be started (no process to be had) is one lost; the long-lived child goes
        on."""
        if self.after_ready and not screen_ready:
            return
        if self.standby is None and self.lost < MAX_LOST:
            standby = Standby(self.spec, self.exe, self.timeout)
            try:
                standby.start()
            except (OSError, HarnessError):
                standby.close(kill=True)
                self.lost += 1
                return
            self.standby = standby

    def confirm(self, target, example, last: dict) -> None:
        """Decide ``example`` (the long-lived child's hit) as :func:`~kvfuzz.fuzz.harness.sanitizer.sanitize`
        does: in the standby, else (it died, hung, was not clean; none) in a fresh child. Sets ``last["confirm"]``
        to where it ran (:data:`CONFIRMS`); a new standby starts once this one ended."""
        standby, self.standby = self.standby, None
        try:
            if standby is None:  # none started yet (after_ready), none could be, or this worker gave up on them
                why = "given up" if self.lost >= MAX_LOST else "not started"
            else:
                why = self._in_standby(standby, example, last)
            if why is not None:
                last["confirm"] = f"fresh: standby {why}"
                sanitize(target, example, self.spec, self.exe, self.timeout)
        finally:
            self.prestart()  # the next one: one standby at a time, started after this one ended

    def _in_standby(self, standby: Standby, example, last: dict) -> str | None:
        last["confirm"] = "standby"
        why = None
        try:
            why = standby.run_once(example, self.start_timeout)
        finally:  # a report decided (returned or raised): the standbys work again; else one more lost
            standby.close(kill=True)
            self.lost = 0 if why is None else self.lost + 1
        return why

    def close(self) -> None:
        """End the standby, if one is there (it never ran an example: nothing is lost)."""
        standby, self.standby = self.standby, None
        if standby is not None:
            standby.close(kill=True)


def standby_mode() -> str:
    """``$KVFUZZ_SANITIZE_STANDBY`` checked: ``0``, ``1`` (also when unset) or ``ready``. Raises ValueError naming the
    variable and its values otherwise (the fuzz command checks it before any worker starts: exit 2)."""
    mode = os.environ.get(ENV, "").strip() or "1"
    if mode not in ("0", "1", "ready"):
        raise ValueError(f"{ENV}={mode!r}: use 0 (confirm each hit in a fresh child), 1 (a standby, the default) or "
                         "ready (a standby started once the long-lived child is ready)")
    return mode


def screen(spec: str) -> SanitizedChild:
    """A campaign worker's long-lived child for target ``spec`` (not started), its hits confirmed by a
    :class:`StandbyConfirmer` unless ``$KVFUZZ_SANITIZE_STANDBY`` is ``0`` (unset or ``1``: its standby starts with
    it; ``ready``: once it is ready); with ``0``, in a fresh child each (no confirmer). Any other value raises
    ValueError (:func:`standby_mode`). Its caller closes both
    (kvfuzz.fuzz.campaign.runner.SanitizerSchedule.close)."""
    mode = standby_mode()
    if mode == "0":
        return SanitizedChild(spec, confirmer=None)
    return SanitizedChild(spec, confirmer=StandbyConfirmer(spec, after_ready=mode == "ready"))


__all__ = ["CONFIRMS", "ENV", "MAX_LOST", "Standby", "StandbyConfirmer", "screen", "standby_mode"]
