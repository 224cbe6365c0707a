"""The human-readable campaign report: ``kvfuzz report OUT`` turns ``OUT/summary.json`` into
``OUT/report.md`` with coverage plots (PNG, matplotlib's Agg backend) where a picture reads better than a
table: kernel paths, batch mixes, GQA ratios, lengths against block boundaries and the modeled ROCm routing,
one bar chart per target, and the shapes each target reached (longest context by longest query, head size by window,
on log2 bins) as tables, with heat maps where matplotlib is installed, each marking the bins the target declares and
no example reached, and each size tier's share of the examples and of the time. Failures and rejections are tables
with links to their reproducers, each with how long its shrinks took."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvfuzz.contracts.checks.oracles import check_label
from kvfuzz.fuzz.harness.coverage import SHAPE_DIMENSIONS

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


def _tier_table(tiers: dict[str, dict]) -> list[str]:
    """Each size tier's share of a target's examples and of its workers' time (kernel and harness seconds)."""
    examples = sum(t.get("examples", 0) for t in tiers.values())
    seconds = {name: t.get("kernel_s", 0.0) + t.get("harness_s", 0.0) for name, t in tiers.items()}
    total = sum(seconds.values())
    lines = ["", "Size tiers, their share of the examples and of the workers' time (kernel and harness):", "",
             "| tier | examples | share of examples | seconds | share of time |", "|---|---|---|---|---|"]
    for name, t in sorted(tiers.items(), key=lambda kv: -kv[1].get("examples", 0)):
        n = t.get("examples", 0)
        lines.append(f"| {name} | {n} | {100 * n / examples if examples else 0:.1f}% | {seconds[name]:.1f} | "
                     f"{100 * seconds[name] / total if total else 0:.1f}% |")
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


def write_report(out: Path) -> Path:
    """Write ``out/report.md`` (and ``out/coverage-<target>.png``) from ``out/summary.json``.

    Raises FileNotFoundError naming the missing summary (run ``kvfuzz fuzz --out DIR`` first)."""
    summary_file = out / "summary.json"
    if not summary_file.exists():
        raise FileNotFoundError(f"{summary_file} does not exist: run `kvfuzz fuzz --out {out}` first")
    summary = json.loads(summary_file.read_text())
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
            lines.append(f"| {name} | {f['kind']} | {f.get('blame', '')} | {check_label(f.get('check', ''))} | "
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
        png = plot_coverage(t, out / f"coverage-{_slug(t['target'])}.png")
        if png is not None:
            lines.append(f"![coverage of {t['target']}]({png.name})")
        if len(t.get("tiers", {})) > 1:
            lines += _tier_table(t["tiers"])
        for dim in SHAPE_DIMENSIONS:
            if t.get("coverage", {}).get(dim) or t.get("bins", {}).get(dim):
                lines += _shape_table(dim, t.get("coverage", {}).get(dim, {}), t.get("bins", {}).get(dim))
        shapes = plot_shapes(t, out / f"shapes-{_slug(t['target'])}.png")
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
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


__all__ = ["PLOTTED", "plot_coverage", "plot_shapes", "shape_grid", "write_report"]
