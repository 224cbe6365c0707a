"""The human-readable campaign report: ``kvfuzz report OUT`` turns ``OUT/summary.json`` into
``OUT/report.md`` with coverage plots (PNG, matplotlib's Agg backend) where a picture reads better than a
table: kernel paths, batch mixes, GQA ratios, lengths against block boundaries and the modeled ROCm routing,
one bar chart per target, and the shapes each target reached (longest context by longest query, head size by window,
on log2 bins) as tables, with heat maps where matplotlib is installed, each marking the bins the target declares and
no example reached, and each size tier's share of the examples and of the time. Failures and rejections are tables
with links to their reproducers, each with how long its shrinks took.

summary.json is validated before anything is written (:func:`read_summary`: a missing, torn or foreign file names the
field and the fix), and every file is written atomically (a temporary file beside it, then ``os.replace``): a full
disk or a read-only folder leaves the previous report.md and PNGs whole, never a truncated one, and raises
:class:`ReportError`."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from kvfuzz.contracts.checks.oracles import check_label
from kvfuzz.fuzz.campaign.store.journal import disk_full
from kvfuzz.fuzz.harness.coverage import SHAPE_DIMENSIONS
from kvfuzz.fuzz.harness.sanitizer import PHASES

PLOTTED = ("path", "mix", "gqa", "seq_len", "rocm gfx90a/gfx942/gfx950", "rocm gfx11/gfx12", "undeclared")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def plot_coverage(target: dict, path: Path) -> Path | None:
    """One figure, one horizontal bar chart per coverage dimension; None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = [(d, c) for d, c in target.get("coverage", {}).items() if d in PLOTTED and c]
    if not dims:
        return None
    fig, axes = plt.subplots(len(dims), 1, figsize=(8, 1.2 + 0.45 * sum(min(len(c), 12) for _, c in dims)),
                             squeeze=False)
    for ax, (dim, counts) in zip(axes[:, 0], dims):
        items = sorted(counts.items(), key=lambda kv: -kv[1])[:12]
        labels = [k for k, _ in items][::-1]
        values = [v for _, v in items][::-1]
        ax.barh(labels, values, color="#4c72b0")
        ax.set_title(dim, fontsize=10, loc="left")
        ax.tick_params(labelsize=8)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v}", va="center", fontsize=7)
    fig.suptitle(f"{target['target']}: {target['examples']} examples", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bin_key(b: str) -> tuple[int, int | str]:
    """Sort key of a bin label: "0", "2^k" (by k), a plain integer, "none" last."""
    if b == "0":
        return (0, -1)
    if b.startswith("2^"):
        return (0, int(b[2:]))
    return (0, int(b)) if b.isdigit() else (1, b)


def shape_grid(counts: dict[str, int], declared: dict[str, int] | None = None
               ) -> tuple[list[str], list[str], dict[tuple[str, str], int]]:
    """``(rows, cols, cells)`` of a shape dimension's counts (``{"2^10 x 2^5": 3, ...}``,
    :data:`~kvfuzz.fuzz.harness.coverage.SHAPE_DIMENSIONS`): every log2 bin from the smallest to the largest seen
    or ``declared`` (summary.json's ``bins``: the bins the target declares, kvfuzz.fuzz.campaign.steering) on each
    axis (a bin in between that no example reached is a row or column of zeros), and the counts."""
    cells = {tuple(k.split(" x ", 1)): n for k, n in counts.items()}
    keys = set(cells) | {tuple(k.split(" x ", 1)) for k in declared or {}}

    def axis(values: set[str]) -> list[str]:
        pows = sorted((v for v in values if v.startswith("2^")), key=_bin_key)
        out = [v for v in values if not v.startswith("2^") and v != "none"]
        if pows:  # fill the gaps between log2 bins
            out += [f"2^{k}" for k in range(int(pows[0][2:]), int(pows[-1][2:]) + 1)]
        return sorted(set(out), key=_bin_key) + (["none"] if "none" in values else [])

    return axis({r for r, _ in keys}), axis({c for _, c in keys}), cells


def _cell(n: int, declared: bool | None) -> str:
    """A table cell: the count, **0** for a bin never reached that is declared (or with no declaration to go by),
    ``·`` for one no tier of the target draws."""
    return str(n) if n else ("**0**" if declared is not False else "·")


def _shape_table(dim: str, counts: dict[str, int], declared: dict[str, int] | None = None) -> list[str]:
    rows, cols, cells = shape_grid(counts, declared)
    a, b = dim.split(" x ")
    zero = ("**0**: declared, never reached; ·: not declared (no tier of the target draws it)" if declared
            else "**0**: never reached")
    lines = ["", f"Examples per ({a}, {b}) on log2 bins ({zero}; {a} down, {b} across; a batch counts "
             "at its longest context and query):" if dim == SHAPE_DIMENSIONS[0] else
             f"Examples per ({a}, {b}) ({b} on log2 bins; {zero}):", "",
             f"| {a} \\ {b} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r} | " + " | ".join(
            _cell(cells.get((r, c), 0), None if declared is None else f"{r} x {c}" in declared) for c in cols) + " |")
    if declared:
        empty = [k for k, n in declared.items() if not counts.get(k)]
        lines += ["", f"Declared bins never reached: {len(empty)} of {len(declared)}"
                  + (f" ({', '.join(empty[:12])}{', ...' if len(empty) > 12 else ''})." if empty else ".")]
    return lines


def _tier_table(stages: dict[str, dict]) -> list[str]:
    """Each size tier's share of a target's examples and of its workers' time, from its stage table (summary.json's
    ``stages``, kvfuzz.fuzz.campaign.stages.StageTable: the examples drawn, and every second of its tasks, shrinks
    included): the same numbers as "Where the time went"."""
    examples = sum(row.get("examples", 0) for row in stages.values())
    seconds = {name: sum(row.get("seconds", {}).values()) for name, row in stages.items()}
    total = sum(seconds.values())
    lines = ["", "Size tiers, their share of the examples and of the workers' time (every stage, shrinks included):",
             "", "| tier | examples | share of examples | seconds | share of time |", "|---|---|---|---|---|"]
    for name, row in sorted(stages.items(), key=lambda kv: -kv[1].get("examples", 0)):
        n = row.get("examples", 0)
        lines.append(f"| {name} | {n} | {100 * n / examples if examples else 0:.1f}% | {seconds[name]:.1f} | "
                     f"{100 * seconds[name] / total if total else 0:.1f}% |")
    return lines


def _chunk_kinds(chunks: dict[str, dict]) -> list[str]:
    """A steered campaign's chunks by kind (summary.json's ``chunks``: free, and focused on an empty or near-miss
    bin): how many, their examples, and their share of the chunks' seconds (hand-out to end, per worker)."""
    total = sum(row.get("seconds", 0.0) for row in chunks.values())
    lines = ["", "Chunks, free and aimed at a bin (steering), their examples and their share of the workers' chunk "
             "time:",
             "", "| chunks | count | examples | seconds | share of time |", "|---|---|---|---|---|"]
    for name, row in sorted(chunks.items()):
        sec = row.get("seconds", 0.0)
        lines.append(f"| {name} | {row.get('chunks', 0)} | {row.get('examples', 0)} | {sec:.1f} | "
                     f"{100 * sec / total if total else 0:.1f}% |")
    return lines


def plot_shapes(target: dict, path: Path) -> Path | None:
    """Heat maps of the shape dimensions (:func:`shape_grid`), or None without matplotlib or shapes: colours on
    a log scale with a colour bar, each cell's count written in it, a declared bin never reached marked red with a
    0 and one no tier draws left grey (0 and 1 look nothing alike)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm

    bins = target.get("bins", {})
    dims = [(d, target.get("coverage", {}).get(d), bins.get(d)) for d in SHAPE_DIMENSIONS]
    dims = [(d, c, b) for d, c, b in dims if c or b]
    if not dims:
        return None
    fig, axes = plt.subplots(1, len(dims), figsize=(7 * len(dims), 6), squeeze=False)
    for ax, (dim, counts, declared) in zip(axes[0], dims):
        rows, cols, cells = shape_grid(counts or {}, declared)
        grid = np.array([[cells.get((r, c), 0) for c in cols] for r in rows], dtype=float)
        empty = np.array([[not cells.get((r, c)) and (declared is None or f"{r} x {c}" in declared)
                           for c in cols] for r in rows])
        ax.imshow(np.where(grid > 0, np.nan, 0.0), cmap=ListedColormap(["#eeeeee"]), aspect="auto", origin="lower")
        ax.imshow(np.where(empty, 1.0, np.nan), cmap=ListedColormap(["#f4b6b6"]), aspect="auto", origin="lower")
        image = ax.imshow(np.where(grid > 0, grid, np.nan), cmap="viridis", aspect="auto", origin="lower",
                          norm=LogNorm(vmin=1, vmax=max(2.0, grid.max())))
        fig.colorbar(image, ax=ax, label="examples (log scale)")
        small = 6 if len(rows) * len(cols) > 150 else 7
        for (i, j), n in np.ndenumerate(grid):
            if n or empty[i, j]:
                ax.text(j, i, f"{int(n)}", ha="center", va="center", fontsize=small,
                        color="#b00000" if not n else ("white" if n < grid.max() ** 0.5 else "black"))
        ax.set_xticks(range(len(cols)), cols, fontsize=7, rotation=90)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        a, b = dim.split(" x ")
        ax.set_xlabel(b)
        ax.set_ylabel(a)
        ax.set_title("red 0: declared, never reached; grey: not declared", fontsize=8)
    fig.suptitle(f"{target['target']}: shapes reached", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def time_section(summary: dict) -> list[str]:
    """The report's "Where the time went" section, from summary.json's ``time`` (written by the supervisor:
    kvfuzz.fuzz.campaign.stages.time_table): per target and size tier, its share of the workers' wall time, its
    examples and the mean milliseconds per example of each stage; then the workers' start-up and idle time. Empty
    for a summary without it."""
    time = summary.get("time") or {}
    wall, rows = time.get("wall_s") or 0.0, time.get("rows") or []
    if not wall:
        return []
    stages = [s for s in time.get("stages", []) if any(s in r.get("ms", {}) for r in rows)]
    lines = ["", "## Where the time went", "",
             f"{time.get('workers', 1)} worker(s), {wall:.1f} s of worker time (each worker from its start to its "
             "end). Per target and size tier: its share of that time, its examples, and the mean milliseconds per "
             "example of each stage (docs/campaigns.md, \"Where the time goes\").", "",
             "| target | tier | share | examples | " + " | ".join(stages) + " |", "|---" * (4 + len(stages)) + "|"]
    for r in rows:
        ms = r.get("ms", {})
        lines.append(f"| {r['target']} | {r['tier']} | {100 * r.get('share', 0.0):.1f}% | {r.get('examples', 0)} | "
                     + " | ".join(f"{ms[s]:.2f}" if s in ms else "-" for s in stages) + " |")
    rest = [f"{s} {100 * time['seconds'][s] / wall:.1f}%" for s in ("startup", "idle") if s in time.get("seconds", {})]
    if rest:
        lines += ["", "Outside any target: " + ", ".join(rest) + " of the workers' time."]
    return lines + _sanitize_table(time.get("sanitize") or [])


def _sanitize_table(targets: list[dict]) -> list[str]:
    """The ``sanitize`` stage by phase (summary.json's ``time.sanitize``, kvfuzz.fuzz.campaign.stages.SanitizeTable):
    per target, its examples with a sanitized run in all and per group, each phase's seconds and the examples it
    occurred in; then its children's starts and where its hits were confirmed. Empty without sanitized runs."""
    if not targets:
        return []
    phases = [p for p in PHASES if any(p in g.get("phases", {}) for t in targets for g in t.get("groups", {}).values())]
    lines = ["", "Sanitized runs (`--sanitize`): the `sanitize` stage by phase, per group of examples: each phase's "
             "seconds and (in brackets) the examples it occurred in; `shrink`: a shrink's sanitized runs, counted in "
             "the `shrink` stage (docs/fuzzing.md, \"Where a sanitized example's time goes\").", "",
             "| target | group | examples | seconds | " + " | ".join(phases) + " |", "|---" * (4 + len(phases)) + "|"]
    for t in targets:
        for group, row in [("all", t), *t.get("groups", {}).items()]:
            cells = [f"{row['phases'][p]['seconds']:.2f} ({row['phases'][p]['count']})" if p in row.get("phases", {})
                     else "-" for p in phases]
            lines.append(f"| {t['target']} | {group} | {row.get('examples', 0)} | {row.get('seconds', 0.0):.2f} | "
                         + " | ".join(cells) + " |")
    for t in targets:
        st = t.get("starts") or {}
        if st.get("count"):
            lines.append(f"\n{t['target']}: {st['count']} sanitized child(ren) started, {st.get('seconds', 0):.1f} s "
                         f"from spawn to ready (of it, in the child: the target loaded {st.get('target', 0):.1f} s, "
                         f"the CUDA context {st.get('cuda', 0):.1f} s, the warm-up {st.get('warm', 0):.1f} s with "
                         f"{st.get('warm_errors', 0):.0f} example(s) refused).")
        if t.get("confirms"):  # where the long-lived child's hits were confirmed (sanitizer_standby.CONFIRMS)
            lines.append(f"\n{t['target']}: hits confirmed in " + ", ".join(
                f"{where}: {n}" for where, n in sorted(t["confirms"].items())) + ".")
    return lines


class ReportError(Exception):
    """The report cannot be written: summary.json is missing or malformed, or the folder cannot take the files
    (``full``: the disk is full, exit 3 in the CLI; otherwise the input or the folder is at fault, exit 2). The
    message names the file, the field and the fix."""

    def __init__(self, message: str, full: bool = False) -> None:
        super().__init__(message)
        self.full = full


#: What each target entry of summary.json must hold for a report: field -> (types, what it is).
_TARGET_FIELDS = {"target": (str, "the target's name"), "examples": (int, "a count"),
                  "examples_per_s": ((int, float), "a number"), "kernel_s": ((int, float), "seconds"),
                  "harness_s": ((int, float), "seconds"), "failures": (list, "a list of failures")}
_FIX = "write it again with `kvfuzz fuzz --out DIR` (a campaign writes summary.json when it ends)"


def _bad(path: Path, field: str, problem: str) -> ReportError:
    return ReportError(f"{path}, field {field!r}: {problem}; {_FIX}")


def read_summary(out: Path) -> dict:
    """``out/summary.json`` read and checked for what a report needs (every target's name, counts, times and
    failures; the coverage and the declared space, when present, objects of counts). Raises ReportError naming
    the file, the field and the fix."""
    path = Path(out) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{path} does not exist: run `kvfuzz fuzz --out {out}` first") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"{path} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    except ValueError as e:
        raise ReportError(f"{path} is not valid JSON ({e}): torn or edited; {_FIX}") from None
    if not isinstance(summary, dict):
        raise ReportError(f"{path} holds a JSON {type(summary).__name__}, not an object; {_FIX}")
    if not isinstance(summary.get("targets"), list):
        raise _bad(path, "targets", "is missing" if "targets" not in summary else "is not a list")
    for i, t in enumerate(summary["targets"]):
        if not isinstance(t, dict):
            raise _bad(path, f"targets[{i}]", "is not an object")
        for field, (types, what) in _TARGET_FIELDS.items():
            if field not in t:
                raise _bad(path, f"targets[{i}].{field}", "is missing")
            if not isinstance(t[field], types) or isinstance(t[field], bool):
                raise _bad(path, f"targets[{i}].{field}", f"is {type(t[field]).__name__}, expected {what}")
        for j, f in enumerate(t["failures"]):
            if not isinstance(f, dict) or not isinstance(f.get("kind"), str):
                raise _bad(path, f"targets[{i}].failures[{j}].kind", "is missing or not a string")
        for field in ("coverage", "declared"):
            dims = t.get(field, {})
            if not isinstance(dims, dict) or not all(
                    isinstance(c, dict) and all(isinstance(n, int) for n in c.values()) for c in dims.values()):
                raise _bad(path, f"targets[{i}].{field}", "is not an object of {value: count} objects")
        if not isinstance(t.get("paths", {}), dict) or not isinstance(t.get("rejections", {}), dict):
            raise _bad(path, f"targets[{i}].paths", "is not an object of counts")
    return summary


@contextlib.contextmanager
def atomic_file(path: Path):
    """Yield a temporary path beside ``path`` (same suffix: matplotlib picks the format from it) to write, then put
    it in place with ``os.replace``; the temporary file is removed if anything fails. A full disk or a folder that
    cannot be written raises ReportError."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        if tmp.exists():
            os.replace(tmp, path)
    except OSError as e:
        raise ReportError(f"cannot write {path}: {e.strerror or e}" + (
            "; free some space and run `kvfuzz report` again (the previous report is kept whole)" if disk_full(e)
            else "; make the folder writable, or copy the campaign's folder somewhere writable"),
            full=disk_full(e)) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _plot(plot, target: dict, path: Path, lines: list[str]) -> Path | None:
    """``plot(target, path)`` drawn atomically (:func:`atomic_file`); a plot that fails otherwise (matplotlib) is left
    out with a line in the report, never the report's end."""
    try:
        with atomic_file(path) as tmp:
            drawn = plot(target, tmp)
    except ReportError:
        raise
    except ImportError:
        lines.append(f"(plot {path.name} not drawn: matplotlib is not installed; pip install 'kvfuzz[report]')")
        return None
    except Exception as e:  # a plotting problem: the tables stand without the picture
        lines.append(f"(plot {path.name} not drawn: {type(e).__name__}: {e})")
        return None
    return path if drawn is not None else None


def write_report(out: Path) -> Path:
    """Write ``out/report.md`` (and ``out/coverage-<target>.png``, ``out/shapes-<target>.png``) from
    ``out/summary.json``, each file atomically.

    Raises ReportError: summary.json missing or malformed (the field named), or a file that cannot be written
    (``full`` for a full disk)."""
    out = Path(out)
    summary = read_summary(out)
    try:
        lines = _report_lines(summary, out)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # what read_summary does not check in detail
        raise ReportError(f"{out / 'summary.json'} holds something a report cannot read ({type(e).__name__}: "
                          f"{e}); {_FIX}") from None
    report = out / "report.md"
    with atomic_file(report) as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    return report


def _report_lines(summary: dict, out: Path) -> list[str]:
    """report.md's lines, the plots drawn beside it (:func:`write_report`)."""
    lines = ["# kvfuzz campaign report", ""]
    flags = [f"seed {summary.get('seed')}", f"workers {summary.get('workers', 1)}"]
    if summary.get("caller_fault"):
        flags.append(f"caller fault `{summary['caller_fault']}`")
    if summary.get("interrupted"):
        flags.append("**interrupted**")
    if summary.get("exit_status") is not None:
        flags.append(f"exit status {summary['exit_status']}")
    if summary.get("baseline"):
        flags.append(f"baseline `{summary['baseline']}` ({summary.get('known_failures', 0)} known, "
                     f"{summary.get('new_failures', 0)} new)")
    lines += [", ".join(flags), "", "| target | examples | examples/s | kernel share | distinct failures |",
              "|---|---|---|---|---|"]
    for t in summary["targets"]:
        total = t["kernel_s"] + t["harness_s"]
        share = f"{100 * t['kernel_s'] / total:.0f}%" if total else "-"
        lines.append(f"| {t['target']} | {t['examples']} | {t['examples_per_s']:.2f} | {share} | "
                     f"{len(t['failures'])} |")
    lines += time_section(summary)
    failures = [(t["target"], f) for t in summary["targets"] for f in t["failures"] if not f.get("known")]
    known = [(t["target"], f) for t in summary["targets"] for f in t["failures"] if f.get("known")]
    if known:
        lines += ["", "## Known findings (baseline)", "",
                  "Accepted in the baseline: found and counted, not failures of this campaign.", "",
                  "| target | known | kind | check | count | reproducer (first hit) |", "|---|---|---|---|---|---|"]
        for name, f in known:
            repro = f.get("reproducer")
            link = f"[{Path(repro).name}]({Path(repro).name})" if repro else "-"
            lines.append(f"| {name} | {f['known']} | {f['kind']} | {check_label(f.get('check', ''))} | "
                         f"{f.get('count', 1)} | {link} |")
    lines += ["", "## Failures" + (" (new)" if summary.get("baseline") else ""), ""]
    if failures:
        lines += ["| target | kind | blame | check | count | minimal batch | shrink: structural first + Hypothesis "
                  "+ structural after | reproducer |", "|---|---|---|---|---|---|---|---|"]
        for name, f in failures:
            repro = f.get("reproducer")
            link = f"[{Path(repro).name}]({Path(repro).name})" if repro else "-"
            took = f.get("shrink") or {}
            shrink = (" + ".join(f"{took.get(k, 0):.1f}" for k in ("structural_first", "hypothesis", "structural"))
                      + " s") if took else "-"
            kind = f"{f['kind']} (found before)" if f.get("found_before") else f["kind"]
            lines.append(f"| {name} | {kind} | {f.get('blame', '')} | {check_label(f.get('check', ''))} | "
                         f"{f.get('count', 1)} | {f.get('batch', '')} | {shrink} | {link} |")
        for name, f in failures:
            lines += ["", f"**{name}: {f['kind']}** — {f.get('message', '')}"]
    else:
        lines.append("None.")
    for p in summary.get("problems", []):
        lines += ["", f"**Problem**: {p}"]
    for w in summary.get("warnings", []):
        lines += ["", f"Warning: {w}"]
    for t in summary["targets"]:
        lines += ["", f"## {t['target']}", ""]
        png = _plot(plot_coverage, t, out / f"coverage-{_slug(t['target'])}.png", lines)
        if png is not None:
            lines.append(f"![coverage of {t['target']}]({png.name})")
        if len(t.get("stages", {})) > 1:
            lines += _tier_table(t["stages"])
        if "focused" in t.get("chunks", {}):
            lines += _chunk_kinds(t["chunks"])
        for dim in SHAPE_DIMENSIONS:
            if t.get("coverage", {}).get(dim) or t.get("bins", {}).get(dim):
                lines += _shape_table(dim, t.get("coverage", {}).get(dim, {}), t.get("bins", {}).get(dim))
        shapes = _plot(plot_shapes, t, out / f"shapes-{_slug(t['target'])}.png", lines)
        if shapes is not None:
            lines += ["", f"![shapes of {t['target']}]({shapes.name})"]
        if t.get("declared"):
            lines += ["", "Declared parameter space, examples per value (0: never drawn):", "",
                      "| dimension | values |", "|---|---|"]
            states = {"production states": t["bins"]["states"]} if t.get("bins", {}).get("states") else {}
            for dim, counts in {**t["declared"], **states}.items():
                cells = ", ".join(f"{v}: {n}" if n else f"**{v}: 0**" for v, n in counts.items())
                lines.append(f"| {dim} | {cells or '-'} |")
        if t.get("rejections"):
            lines += ["", "Undeclared configurations rejected with an error (expected):", "",
                      "| error | count |", "|---|---|"]
            lines += [f"| `{m}` | {n} |" for m, n in t["rejections"].items()]
    return lines


__all__ = ["PLOTTED", "ReportError", "atomic_file", "plot_coverage", "plot_shapes", "read_summary", "shape_grid",
           "time_section", "write_report"]
