"""What a running campaign keeps on disk for those who watch it and for its next start (:class:`Snapshots`):
``OUT/state.json`` (:class:`~kvfuzz.fuzz.campaign.store.journal.CampaignState`: chunks started per target, the
examples in flight, whether the campaign is running) and ``OUT/status.json`` (each target's counts and what each
worker runs), written atomically at most every :data:`SNAPSHOT_SECONDS`, so a campaign killed outright resumes
with new seeds and retries what it had in flight; and, when the disk of ``--out`` fills, what is kept for a rerun
and the one message that says so (:meth:`Snapshots.disk_full_report`)."""

from __future__ import annotations

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


class Snapshots:
    """The state.json and status.json of the campaign in ``out`` (``state``: its CampaignState)."""

    def __init__(self, out: Path, state: CampaignState) -> None:
        self.out, self.state = Path(out), state
        self._at = 0.0
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
        now = time.monotonic()
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
            write_json(path, {"updated": time.time(), "running": not final,
                              "targets": [t.stats.to_dict() for t in targets],
                              "workers": {str(s.index): (s.in_flight or {}).get("target") for s in slots}})
        except OSError as e:
            if not disk_full(e):
                raise
            if final and path == self.state.path:
                self.state_saved = False
            raise OutOfSpace(path, e) from e

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


__all__ = ["FULL_BELOW_BYTES", "SNAPSHOT_SECONDS", "Snapshots", "out_nearly_full"]
