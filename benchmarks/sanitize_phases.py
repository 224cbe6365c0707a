"""Where a campaign's sanitized examples spent their time: the ``sanitize`` stage by phase, from summary.json's
``time.sanitize`` (fuzz/campaign/stages.py ``SanitizeTable``; the phases: docs/fuzzing.md, "Where a sanitized
example's time goes").

For each summary.json named: the campaign's line (examples, first failure, the stage's seconds against the workers'
wall time), its children's starts, where its hits were confirmed (the standby or a fresh child, and why), then per
target a table with a row per phase and a column per group of examples (all, first example, new config, seen config,
no report, skipped, shrink), each cell ``seconds/examples`` (the examples the phase occurred in), and the mean
seconds of a sanitized example per group.

Usage: python benchmarks/sanitize_phases.py OUT/summary.json [...]   (benchmarks/gpu_sanitize_phases.sh runs it)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvfuzz.fuzz.campaign.stages import SANITIZE_GROUPS
from kvfuzz.fuzz.harness.sanitizer import PHASES


def lines_of(summary: dict, name: str) -> list[str]:
    """The printed lines for one campaign's ``summary`` (``name``: how to call it)."""
    time = summary.get("time") or {}
    wall, stage = time.get("wall_s") or 0.0, (time.get("seconds") or {}).get("sanitize", 0.0)
    targets = {t["target"]: t for t in summary.get("targets", [])}
    out = [f"{name}: wall {wall:.0f} s of worker time ({time.get('workers', '?')} workers), sanitize stage "
           f"{stage:.1f} s ({100 * stage / wall if wall else 0:.1f}%)"]
    for s in time.get("sanitize") or []:
        t = targets.get(s["target"], {})
        skipped = s.get("groups", {}).get("skipped", {}).get("examples", 0)
        out.append(f"  {s['target']}: {t.get('examples', '?')} examples, first failure {t.get('first_failure_s')} s; "
                   f"due for the sanitizer {s['examples']} (sanitized {s['examples'] - skipped}, skipped {skipped}), "
                   f"{s['seconds']:.1f} s")
        st = s.get("starts") or {}
        if st.get("count"):
            out.append(f"  children started: {st['count']}, {st.get('seconds', 0):.1f} s spawn to ready (in the "
                       f"child: target loaded {st.get('target', 0):.1f} s, CUDA context {st.get('cuda', 0):.1f} s, "
                       f"warm-up {st.get('warm', 0):.1f} s with {st.get('warm_errors', 0):.0f} example(s) refused)")
        if s.get("confirms"):
            out.append("  hits confirmed in: " + ", ".join(f"{w} {n}" for w, n in sorted(s["confirms"].items())))
        groups = [("all", s)] + [(g, s["groups"][g]) for g in SANITIZE_GROUPS if g in s.get("groups", {})]
        out.append("  " + f"{'phase':12}" + "".join(f"{g:>16}" for g, _ in groups))
        for phase in PHASES:
            if any(phase in row.get("phases", {}) for _, row in groups):
                out.append("  " + f"{phase:12}" + "".join(
                    f"{_cell(row['phases'].get(phase)):>16}" for _, row in groups))
        out.append("  " + f"{'examples':12}" + "".join(f"{row['examples']:>16}" for _, row in groups))
        out.append("  " + f"{'seconds':12}" + "".join(f"{row['seconds']:>16.2f}" for _, row in groups))
        out.append("  " + f"{'s/example':12}" + "".join(
            f"{row['seconds'] / row['examples'] if row['examples'] else 0:>16.3f}" for _, row in groups))
    if not time.get("sanitize"):
        out.append("  no sanitized run")
    return out


def _cell(phase: dict | None) -> str:
    return "-" if not phase else f"{phase['seconds']:.2f}/{phase['count']}"


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    for p in paths:
        try:
            summary = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            print(f"{p}: no summary ({e})")
            continue
        print("\n".join(lines_of(summary, str(Path(p).parent.name))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
