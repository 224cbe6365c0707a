"""``kvfuzz targets``: every target, its contract and declaration, and whether it runs here.

Whether it runs here is told from what is installed (``Target.installed``: packages, files, the torch version),
without importing a kernel library, so the command is fast; ``--check`` loads each kernel
(``Target.availability``, as ``kvfuzz fuzz`` does) and says what loading said. A target that cannot tell without
loading (``installed`` returns None: adapters of other packages, by default) is loaded either way."""

from __future__ import annotations

import json

import click
from rich.markup import escape
from rich.table import Table

from kvfuzz.fuzz.cli.common import console


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--check", is_flag=True,
              help="Load each kernel to say whether it runs here (slow: imports every kernel library). Without "
                   "it, whether a target runs is told from what is installed, and says it was not loaded.")
def targets(as_json: bool, check: bool) -> None:
    """List the targets, their contracts and declarations (the production cache states each declares, e.g.
    freed_window_blocks, under "states"; the size tiers it runs, under "tiers"; what an fp8 cache narrows, its dtypes,
    head and block sizes and GQA groups, beside the kv_cache_dtypes), and whether they run here. Piped, one
    tab-separated line per target."""
    from kvfuzz.fuzz.targets import get_target, registered

    rows = []
    for name in registered():
        t = get_target(name)
        a = None if check else t.installed()
        loaded = a is None
        if a is None:
            a = t.availability()
        c = t.capabilities
        contract = c.contract.value
        contract += " (decode-only)" if c.decode_only else ""
        contract += " [CSR]" if c.metadata == "csr" else ""
        contract += f" [latent: values = keys[:{c.value_head_size}]]" if c.value_head_size is not None else ""
        rows.append({"name": name, "contract": contract, "metadata": c.metadata,
                     "shared_prefix_blocks": c.shared_prefix_blocks, "devices": list(c.devices),
                     "dtypes": list(c.dtypes), "head_sizes": list(c.head_sizes), "block_sizes": list(c.block_sizes),
                     "kv_cache_dtypes": list(c.kv_cache_dtypes), "kv_cache": _kv_cell(c),
                     "fp8_dtypes": _listed(c.fp8_dtypes), "fp8_head_sizes": _listed(c.fp8_head_sizes),
                     "fp8_block_sizes": _listed(c.fp8_block_sizes), "fp8_gqa_ratios": _listed(c.fp8_gqa_ratios),
                     "features": sorted(c.features),
                     "exclusive": [sorted(p) for p in c.exclusive], "states": list(c.states),
                     "tiers": list(t.size_tiers()), "available": a.ok, "loaded": loaded,
                     "device": a.device, "reason": a.reason, "description": t.description})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not console.is_terminal:  # piped (grep, a log): one whole line per target, tab-separated, nothing cut
        click.echo("\t".join(("target", "contract", "dtypes", "kv_cache_dtypes", "head_sizes", "block_sizes",
                              "features", "states", "tiers", "here")))
        for r in rows:
            click.echo("\t".join((r["name"], r["contract"], ",".join(r["dtypes"]), r["kv_cache"],
                                  ",".join(map(str, r["head_sizes"])), ",".join(map(str, r["block_sizes"])),
                                  ",".join(r["features"]) or "-", ",".join(r["states"]) or "-",
                                  ",".join(r["tiers"]), ("yes: " if r["available"] else "no: ") + r["reason"])))
        return
    table = Table(title="kvfuzz targets")
    for col in ("target", "contract", "dtypes", "kv cache", "head sizes", "block sizes", "features", "states", "tiers",
                "here"):
        table.add_column(col, overflow="fold")
    for r in rows:
        here = f"[green]yes[/]: {escape(r['reason'])}" if r["available"] else f"[red]no[/]: {escape(r['reason'])}"
        table.add_row(r["name"], r["contract"], ",".join(r["dtypes"]), r["kv_cache"],
                      ",".join(map(str, r["head_sizes"])), ",".join(map(str, r["block_sizes"])),
                      ",".join(r["features"]) or "-", ",".join(r["states"]) or "-",
                      ",".join(r["tiers"]), here)
    console.print(table)


def _listed(values):
    return None if values is None else list(values)


def _kv_cell(c) -> str:
    """The kv_cache_dtypes, and what an fp8 cache narrows (its dtypes, head and block sizes), e.g.
    ``auto,fp8,fp8_e4m3 (fp8: bfloat16; head sizes 32,64)``."""
    cell = ",".join(c.kv_cache_dtypes)
    if c.kv_cache_dtypes == ("auto",):
        return cell
    narrowed = [", ".join(c.dtypes_for("fp8")) if c.fp8_dtypes is not None else "",
                "head sizes " + ",".join(map(str, c.head_sizes_for("fp8"))) if c.fp8_head_sizes is not None else "",
                "block sizes " + ",".join(map(str, c.block_sizes_for("fp8"))) if c.fp8_block_sizes is not None
                else "",
                "GQA " + ",".join(map(str, c.fp8_gqa_ratios)) if c.fp8_gqa_ratios is not None else ""]
    narrowed = [n for n in narrowed if n]
    return cell + (f" (fp8: {'; '.join(narrowed)})" if narrowed else "")


__all__ = ["targets"]
