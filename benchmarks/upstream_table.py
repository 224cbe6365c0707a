"""The table of benchmarks/upstream_suites.sh: an upstream test file run plainly and under ``--kvfuzz-guard``.

Reads OUTDIR/runs.tsv (one line per test file, written by the script: file, plain junit XML, guard junit XML,
guard report JSON, start/end times of both runs, both exit codes; paths relative to OUTDIR) and writes
OUTDIR/upstream.md and OUTDIR/upstream.json. Per file: tests, passed plainly, passed/failed under the guard, the
tests the guard run failed that passed plainly (and how many of them the guard report names as failed by a
check), each check that fired with its severity (and category) and count, wall time plain vs guard.

The guard report (``--kvfuzz-guard-report PATH``): {"calls": {kernel: n}, "unchecked": {kernel: n},
"stopped": n, "failed_tests": [nodeid, ...], "records": [{"kernel", "caller", "test", "index",
"violations": [{"check", "severity", "category" (may be absent or null), "message"}]}]}. Where the run wrote
none (a plugin without the option, or a crash), the table says "no guard report".

Standard library only: it runs on the GPU machine with whatever Python is there.
Usage: python3 benchmarks/upstream_table.py OUTDIR
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

RUN_FIELDS = ("file", "plain_xml", "guard_xml", "guard_report", "plain_start", "plain_end", "guard_start",
              "guard_end", "plain_rc", "guard_rc")


def junit_address(nodeid: str) -> tuple[str, str]:
    """(classname, name) that pytest's junitxml writes for ``nodeid`` (its mangle_test_address)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def nodeid(file: str, classname: str, name: str) -> str:
    """The pytest node id of a junit test case of ``file`` (a path relative to the rootdir, as the script runs it)."""
    module = junit_address(file + "::x")[0]
    if classname == module:
        return f"{file}::{name}"
    if classname.startswith(module + "."):
        return "::".join([file, *classname[len(module) + 1:].split("."), name])
    return f"{classname}::{name}" if classname else name


def read_junit(path: Path) -> dict[tuple[str, str], str] | None:
    """{(classname, name): "passed" | "failed" | "error" | "skipped"} of a junit XML file; None if absent/unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    outcomes = {}
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        outcome = ("failed" if "failure" in tags else "error" if "error" in tags
                   else "skipped" if "skipped" in tags else "passed")
        key = (case.get("classname", ""), case.get("name", ""))
        # a test failing in teardown after passing appears twice: keep the worse outcome
        if outcomes.get(key) in (None, "passed", "skipped"):
            outcomes[key] = outcome
    return outcomes


def read_report(path: Path) -> dict | None:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def _counts(outcomes: dict | None) -> dict | None:
    if outcomes is None:
        return None
    c = Counter(outcomes.values())
    return {"tests": len(outcomes), "passed": c["passed"], "failed": c["failed"] + c["error"],
            "skipped": c["skipped"]}


def _seconds(start: str, end: str) -> float | None:
    try:
        return round(float(end) - float(start), 2)
    except ValueError:
        return None


def checks_fired(report: dict) -> list[dict]:
    """Each (check, severity, category) that fired: violations, guarded calls and tests it fired in."""
    violations, calls, tests = Counter(), {}, {}
    for record in report.get("records") or []:
        for v in record.get("violations") or []:
            key = (v.get("check"), v.get("severity"), v.get("category"))
            violations[key] += 1
            calls.setdefault(key, set()).add((record.get("test"), record.get("index"), record.get("kernel")))
            tests.setdefault(key, set()).add(record.get("test"))
    order = sorted(violations, key=lambda k: (k[1] != "error", -violations[k], str(k[0])))
    return [{"check": k[0], "severity": k[1], "category": k[2], "violations": violations[k],
             "calls": len(calls[k]), "tests": len(tests[k])} for k in order]


def summarize(run: dict, outdir: Path) -> dict:
    plain = read_junit(outdir / run["plain_xml"])
    guard = read_junit(outdir / run["guard_xml"])
    report = read_report(outdir / run["guard_report"]) if run["guard_report"] else None
    newly = sorted(k for k, o in (guard or {}).items()
                   if o in ("failed", "error") and (plain or {}).get(k) == "passed")
    plain_s = _seconds(run["plain_start"], run["plain_end"])
    guard_s = _seconds(run["guard_start"], run["guard_end"])
    row = {
        "file": run["file"],
        "plain": _counts(plain), "guard": _counts(guard),
        "plain_rc": int(run["plain_rc"]), "guard_rc": int(run["guard_rc"]),
        "failed_by_guard_passed_plainly": [nodeid(run["file"], c, n) for c, n in newly],
        "plain_seconds": plain_s, "guard_seconds": guard_s,
        "ratio": round(guard_s / plain_s, 2) if plain_s and guard_s is not None else None,
        "guard_report": report is not None,
    }
    if report is not None:
        by_check = {junit_address(t) for t in report.get("failed_tests") or []}
        row.update({
            "checks": checks_fired(report),
            "calls": report.get("calls") or {},
            "unchecked": report.get("unchecked") or {},
            "stopped": report.get("stopped", 0),
            "failed_tests_in_report": len(report.get("failed_tests") or []),
            # of the tests failed under the guard but passed plainly, those the report says a check failed
            "failed_by_check_passed_plainly": sum(1 for k in newly if k in by_check),
        })
    return row


def _cell_counts(counts: dict | None, key: str, rc: int) -> str:
    return f"no junit (rc {rc})" if counts is None else str(counts[key])


def markdown(rows: list[dict]) -> str:
    lines = ["| file | tests | passed plainly | passed / failed under guard | failed under guard, passed plainly "
             "| checks fired (severity, count) | wall plain | wall guard | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plain, guard = r["plain"], r["guard"]
        tests = _cell_counts(plain, "tests", r["plain_rc"])
        under = ("no junit (rc %d)" % r["guard_rc"] if guard is None
                 else f"{guard['passed']} / {guard['failed']}")
        newly = str(len(r["failed_by_guard_passed_plainly"]))
        if r["guard_report"]:
            newly += f" ({r['failed_by_check_passed_plainly']} by a check)"
            checks = "; ".join(
                f"{c['check']} ({c['severity']}{', ' + c['category'] if c['category'] else ''}, "
                f"{c['violations']}× in {c['tests']} tests)" for c in r["checks"]) or "none"
        else:
            checks = "no guard report"
        fmt = lambda s: "–" if s is None else f"{s:.1f} s"  # noqa: E731
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        lines.append(f"| {r['file']} | {tests} | {_cell_counts(plain, 'passed', r['plain_rc'])} | {under} | "
                     f"{newly} | {checks} | {fmt(r['plain_seconds'])} | {fmt(r['guard_seconds'])} | {ratio} |")
    details = []
    for r in rows:
        if r["failed_by_guard_passed_plainly"]:
            shown = r["failed_by_guard_passed_plainly"][:10]
            more = len(r["failed_by_guard_passed_plainly"]) - len(shown)
            details.append(f"\n{r['file']}: failed under the guard, passed plainly: " + ", ".join(shown)
                           + (f" and {more} more" if more else ""))
        if r["guard_report"] and (r["unchecked"] or r["stopped"]):
            details.append(f"\n{r['file']}: guarded calls {r['calls']}, unchecked {r['unchecked']}, "
                           f"stopped {r['stopped']}")
    return "\n".join(lines) + "\n" + "".join(details) + ("\n" if details else "")


def read_runs(outdir: Path) -> list[dict]:
    runs = []
    for line in (outdir / "runs.tsv").read_text().splitlines():
        if line.strip():
            runs.append(dict(zip(RUN_FIELDS, line.split("\t"), strict=True)))
    return runs


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    outdir = Path(argv[0])
    rows = [summarize(run, outdir) for run in read_runs(outdir)]
    text = markdown(rows)
    (outdir / "upstream.md").write_text(text)
    (outdir / "upstream.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
