"""Top frames of a py-spy raw profile (``py-spy record -f raw``): inclusive share of samples per function, so
a profile of a kvfuzz worker reads as "reference 31%, materialize 17%, ...".

    python benchmarks/pyspy_top.py PROFILE.raw [--top 40] [--under TEXT]

``--under``: only frames containing this text, e.g. ``contracts/`` (py-spy shortens paths; default: every frame).
"""

from __future__ import annotations

import argparse
import collections


def top_frames(lines, under: str = "") -> tuple[int, list[tuple[str, int]]]:
    """``(samples, [(frame, samples including it), ...])`` most first, from raw lines ``"f1;f2;... count"``;
    a frame is ``"function (file:line)"`` as py-spy writes it, counted once per stack, line numbers dropped."""
    total, incl = 0, collections.Counter()
    for line in lines:
        stack, _, n = line.strip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        seen = set()
        for frame in stack.split(";"):
            name, _, where = frame.partition(" (")
            path = where.rsplit(":", 1)[0]
            key = f"{name} ({path.split('/site-packages/')[-1]})" if where else name
            if under and under not in frame:
                continue
            if key not in seen:
                seen.add(key)
                incl[key] += int(n)
    return total, incl.most_common()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--under", default="")
    a = ap.parse_args()
    with open(a.profile) as f:
        total, frames = top_frames(f, a.under)
    print(f"{total} samples")
    for key, n in frames[: a.top]:
        print(f"{n / max(1, total):6.1%}  {key}")


if __name__ == "__main__":
    main()
