"""What a running campaign keeps on disk for those who watch it and for its next start (:class:`Snapshots`):
``OUT/state.json`` (:class:`~kvfuzz.fuzz.campaign.store.journal.CampaignState`: chunks started per target, the
examples in flight, whether the campaign is running) and ``OUT/status.json`` (:meth:`Snapshots.status`: elapsed and
remaining time, examples per second over the last minutes, distinct failures, the memory each worker holds, each
target's counts and what each worker runs), written atomically at most every :data:`SNAPSHOT_SECONDS`, so a
campaign killed outright resumes with new seeds and retries what it had in flight, and a long one can be watched;
and, when the disk of ``--out`` fills, what is kept for a rerun and the one message that says so
(:meth:`Snapshots.disk_full_report`)."""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path

from kvfuzz.fuzz.campaign.store.journal import CampaignState, OutOfSpace, disk_full, write_json

#: Seconds between status/state snapshots.
SNAPSHOT_SECONDS = 2.0
#: A worker that dies without a word while ``--out`` has less free space than this died of the full disk (its
#: log is on it too): the supervisor ends the campaign as out of space instead of blaming the example.
FULL_BELOW_BYTES = 1 << 20


def out_nearly_full(out: Path) -> bool:
    """Whether ``out``'s file system has less than :data:`FULL_BELOW_BYTES` free (False when it cannot say)."""
    try:
        st = os.statvfs(out)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES


#: The windows of status.json's ``examples_per_s``: the last minute and the last five.
RATE_WINDOWS = {"last_1m": 60.0, "last_5m": 300.0}


class Rates:
    """Examples counted over time, sampled at each snapshot, for the examples per second of the last minutes."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, examples: int) -> None:
        self._samples.append((now, examples))
        longest = max(RATE_WINDOWS.values())
        while len(self._samples) > 2 and self._samples[1][0] <= now - longest:
            self._samples.popleft()  # the oldest sample still at least the longest window old stays

    def per_second(self) -> dict[str, float | None]:
        """Per window: examples per second from the newest sample at least that old (the oldest, early in a
        campaign) to the last one; None before two samples."""
        if len(self._samples) < 2:
            return {name: None for name in RATE_WINDOWS}
        now, n = self._samples[-1]
        out = {}
        for name, window in RATE_WINDOWS.items():
            t0, n0 = next((s for s in reversed(self._samples) if s[0] <= now - window), self._samples[0])
            out[name] = round((n - n0) / (now - t0), 3) if now > t0 else None
        return out


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of process ``pid`` (``/proc/PID/statm``), or None (no such process, no /proc)."""
    if pid is None:
        return None
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Snapshots:
    """The state.json and status.json of the campaign in ``out`` (``state``: its CampaignState; ``duration``: its
    ``--duration`` in seconds, None without). ``clock``: ``time.monotonic``, or a stand-in for tests."""

    def __init__(self, out: Path, state: CampaignState, duration: float | None = None, clock=time.monotonic) -> None:
        self.out, self.state, self.duration, self.clock = Path(out), state, duration, clock
        self.started = clock()
        self.rates = Rates()
        self._at = -SNAPSHOT_SECONDS
        #: examples in flight when the disk filled (worker -> ``{"target", "example", "phase"}``): state.json keeps
        #: them, so a rerun with space retries them
        self.unfinished: dict[str, dict] = {}
        self.state_saved = True  # whether the final state.json was written (False: the last snapshot stands)

    def keep_unfinished(self, index: int, flight: dict | None) -> None:
        """Keep worker ``index``'s example in flight for a rerun (the disk filled)."""
        if flight is not None:
            self.unfinished[str(index)] = {"target": flight["target"], "example": flight["example"],
                                           "phase": flight["phase"]}

    def write(self, targets: list, slots: list, *, force: bool = False, final: bool = False,
              disk_full_now: bool = False) -> None:
        """Write state.json and status.json (atomically), at most every :data:`SNAPSHOT_SECONDS` unless ``force``.
        ``final``: the campaign ended; nothing is in flight any more (but what a full disk kept, and state.json
        stays "running" then, so a rerun retries it). Raises OutOfSpace naming the file that could not be
        written."""
        now = self.clock()
        if not (force or final) and now - self._at < SNAPSHOT_SECONDS:
            return
        self._at = now
        self.state.running = not final or disk_full_now
        self.state.in_flight = dict(self.unfinished) if final else {
            str(s.index): {"target": s.in_flight["target"], "example": s.in_flight["example"],
                           "phase": s.in_flight["phase"]}
            for s in slots if s.in_flight is not None}
        path = self.state.path
        try:
            self.state.save()
            if final:
                self.state_saved = True
            path = self.out / "status.json"
            write_json(path, self.status(targets, slots, now, final))
        except OSError as e:
            if not disk_full(e):
                raise
            if final and path == self.state.path:
                self.state_saved = False
            raise OutOfSpace(path, e) from e

    def status(self, targets: list, slots: list, now: float, final: bool = False) -> dict:
        """status.json's contents at ``now`` (docs/campaigns.md, "Watching a campaign"): ``elapsed_s`` since the
        campaign started; ``remaining_s`` until every target's ``--duration`` has run out, one target after another
        (None without one; shrinks may go on past it within their grace); ``examples`` and ``examples_per_s`` over
        the last minute and the last five (:class:`Rates`); ``distinct_failures``; ``memory``: per worker its pid,
        resident memory (``/proc``) and the CUDA memory its caching allocator reserves and has allocated (as the
        worker last reported it; None off CUDA), and their totals; each target's counts (``targets``) and the target
        each worker runs (``workers``)."""
        examples = sum(t.stats.examples for t in targets)
        self.rates.add(now, examples)
        remaining = None
        if self.duration is not None:  # the targets take the workers in turn (scheduling.py): their times add up
            ends = [max(0.0, (t.start or now) + self.duration - now) for t in targets if not t.stats.stopped]
            remaining = 0.0 if final or not ends else round(sum(ends), 1)
        workers = {str(s.index): {"pid": getattr(s.proc, "pid", None), "rss_bytes": None if final else rss_bytes(
            getattr(s.proc, "pid", None)), "gpu_reserved_bytes": (s.gpu_memory or (None, None))[0],
            "gpu_allocated_bytes": (s.gpu_memory or (None, None))[1]} for s in slots}
        totals = {k: sum(w[k] for w in workers.values() if w[k] is not None) if any(
            w[k] is not None for w in workers.values()) else None for k in ("rss_bytes", "gpu_reserved_bytes")}
        return {"updated": time.time(), "running": not final, "elapsed_s": round(now - self.started, 1),
                "remaining_s": remaining, "examples": examples, "examples_per_s": self.rates.per_second(),
                "distinct_failures": sum(len(t.stats.failures) for t in targets),
                "memory": {"workers": workers, **totals},
                "targets": [t.stats.to_dict() for t in targets],
                "workers": {str(s.index): (s.in_flight or {}).get("target") for s in slots}}

    def disk_full_report(self, message: str, targets: list) -> str:
        """The one message of a campaign stopped by a full disk (``message``: what could not be written): what was
        kept, how to go on."""
        found = [f.reproducer for t in targets for f in t.stats.failures.values() if f.reproducer]
        kept = [f"{self.state.path.name} as of its last snapshot" + ("" if self.state_saved else
                                                                     " (not updated at the end: no space)")]
        if found:
            kept.append(f"{len(found)} reproducer(s): " + ", ".join(str(p) for p in found))
        kept.append("the example database (hypothesis-db/)")
        retry = (f"retries the {len(self.unfinished)} example(s) that were in flight and "
                 if self.unfinished and self.state_saved else "")
        return (f"{message}; the campaign stopped. Kept in {self.out}: {'; '.join(kept)}. Free some space and run "
                f"the same command again: it {retry}continues with new seeds")


__all__ = ["FULL_BELOW_BYTES", "RATE_WINDOWS", "SNAPSHOT_SECONDS", "Rates", "Snapshots", "out_nearly_full",
           "rss_bytes"]
