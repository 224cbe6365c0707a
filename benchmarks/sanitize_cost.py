"""The memory-safety oracle's cost, from two timestamped campaign logs of the same target and seed, one with the
oracle off (``--sanitize 0``) and one with the default (``--sanitize auto``), run at the same time on two GPUs of
one host (benchmarks/gpu_soak.sh writes such logs: the epoch second before every line; the campaign prints a
progress line every 10 s: ``TARGET: N examples, R/s, F distinct failures, ...``).

A finding's shrink takes workers away from exploring, so whole-run examples/s charge the oracle for what it found.
This compares examples/s over the window both runs spent exploring with no failure found yet: from each run's
first progress line to the last progress line before either run's first failure (or the end). Prints one JSON
object: per run, examples and seconds in the window and the rate; the whole-run rate; and the cost
(1 - sanitized rate / unsanitized rate).

Usage: python3 benchmarks/sanitize_cost.py OFF.log AUTO.log
"""

from __future__ import annotations

import json
import re
import sys

PROGRESS = re.compile(r"^(\d+) \S+: (\d+) examples, [\d.]+/s, (\d+) distinct failures")


def progress(path: str) -> tuple[int, list[tuple[int, int, int]]]:
    """(the first line's epoch second, [(seconds since it, examples, distinct failures), ...])."""
    start, rows = None, []
    with open(path, errors="replace") as f:
        for line in f:
            stamp = line.split(" ", 1)[0]
            if start is None and stamp.isdigit():
                start = int(stamp)
            m = PROGRESS.match(line)
            if m and start is not None:
                rows.append((int(m[1]) - start, int(m[2]), int(m[3])))
    if start is None or len(rows) < 2:
        sys.exit(f"{path}: fewer than two progress lines (is it a gpu_soak.sh log?)")
    return start, rows


def main(off_path: str, auto_path: str) -> None:
    runs = {"off": progress(off_path)[1], "auto": progress(auto_path)[1]}
    clean_until = min(next((t for t, _, f in rows if f), rows[-1][0] + 1) for rows in runs.values())
    out = {}
    for name, rows in runs.items():
        window = [r for r in rows if r[0] < clean_until]
        (t0, n0, _), (t1, n1, _) = window[0], window[-1]
        out[name] = {"window_s": [t0, t1], "examples": n1 - n0, "rate": round((n1 - n0) / max(1, t1 - t0), 1),
                     "whole_run_rate": round(rows[-1][1] / max(1, rows[-1][0]), 1)}
    out["cost"] = round(1 - out["auto"]["rate"] / out["off"]["rate"], 3) if out["off"]["rate"] else None
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
