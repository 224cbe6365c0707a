"""``kvfuzz relations``: every metamorphic relation (:mod:`kvfuzz.fuzz.harness.relations`, run by
:mod:`kvfuzz.fuzz.campaign.relation_runs`) as its own Hypothesis property on every target, and a table of which hold.

Each (target, relation) pair is one ``@given`` property over ``kvfuzz.strategies.examples`` (no example
database, no deadline, seeded by ``--seed``); an example the relation does not apply to is rejected. A
violation is shrunk (within ``--shrink-time`` seconds; after that the best example so far is kept) and
reported with its minimal batch and message. Exit 1 if any relation is violated (``--no-design`` leaves
the design properties, batch invariance and determinism, out of the exit status), 2 on bad usage.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.cli.common import console, unique, writable_file_option, write_output


def _cell(r) -> str:
    if r.outcome == "holds":
        return f"[green]holds[/] ({r.examples})"
    if r.outcome == "violated":
        return "[yellow]not satisfied[/]" if r.design_property else "[red]VIOLATED[/]"
    if r.outcome == "error":
        return "[red]error[/]"
    return "[dim]n/a[/]"


@click.command("relations")
@click.option("--target", "target_names", multiple=True,
              help="Target name (repeatable); default: every available attention target.")
@click.option("--relation", "relation_names", multiple=True,
              help="Relation (repeatable); default: all of poison-invariance[nan], poison-invariance[inf], "
                   "poison-invariance[stale], block-relocation, batch-order, batch-invariance, determinism, "
                   "decode-prefill.")
@click.option("--max-examples", default=10, show_default=True, type=click.IntRange(1),
              help="Examples per (target, relation).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the example generation.")
@click.option("--poison", "poison_names", multiple=True, type=click.Choice([p.value for p in Poison]),
              help="Poison of the unread slots for the relations other than poison-invariance (default: "
                   "stale, under which a read of a wrong slot changes the answer; the poison-invariance "
                   "relations set their own).")
@click.option("--shrink-time", default=60.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds each violation may spend shrinking.")
@click.option("--no-design", is_flag=True,
              help="Leave the design properties (batch invariance, determinism) out of the exit status.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=writable_file_option,
              help="Also write the results as JSON.")
def relations(target_names, relation_names, max_examples, seed, poison_names, shrink_time, no_design, json_path):
    """Check metamorphic relations (bit-exact where the kernel is deterministic) on the targets.

    A violated relation marked "not satisfied" is a design property many correct kernels lack (batch
    invariance, determinism); VIOLATED is a bug in the output. Exit 1 if any relation is violated."""
    from kvfuzz.fuzz.campaign.relation_runs import check_relation
    from kvfuzz.fuzz.harness.relations import RELATIONS
    from kvfuzz.fuzz.targets import BUILTIN, get_target

    relation_names = unique(relation_names, "--relation")
    target_names = unique(target_names, "--target")
    unknown = [r for r in relation_names if r not in RELATIONS]
    if unknown:
        raise click.BadParameter(f"unknown relation(s) {unknown}; relations: {', '.join(RELATIONS)}",
                                 param_hint="--relation")
    rels = [RELATIONS[r] for r in relation_names] if relation_names else list(RELATIONS.values())
    targets = []
    try:
        for name in target_names or BUILTIN:
            t = get_target(name)
            a = t.availability()
            if not a.ok:
                if target_names:
                    raise click.BadParameter(f"target {name} cannot run here: {a.reason}", param_hint="--target")
                continue
            if not t.capabilities.contract.is_attention and not target_names:
                continue
            if any(x.name == t.name for x in targets):
                raise click.BadParameter(f"{name} loads target {t.name!r}, named already; name it once",
                                         param_hint="--target")
            targets.append(t)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--target") from None
    poisons = tuple(Poison(p) for p in unique(poison_names, "--poison")) or (Poison.STALE,)
    results = []
    for t in targets:
        for r in rels:
            res = check_relation(t, r, max_examples, seed, poisons=poisons, shrink_time=shrink_time)
            console.print(escape(f"{t.name} {r.name}: {res.outcome} ({res.examples} examples, "
                                 f"{res.seconds:.1f} s)"), highlight=False)
            results.append(res)

    table = Table(title="kvfuzz relations (examples checked in parentheses)")
    table.add_column("target", overflow="fold")
    for r in rels:
        table.add_column(escape(r.name + (" (design)" if r.design_property else "")), overflow="fold")
    for t in targets:
        table.add_row(escape(t.name), *[_cell(x) for x in results if x.target == t.name])
    console.print(table)
    for x in results:
        if x.outcome in ("violated", "error"):
            kind = "design property not satisfied" if x.design_property and x.outcome == "violated" else x.outcome
            console.print(f"[bold]{escape(x.target)} {escape(x.relation)}[/]: {kind}", highlight=False)
            if x.example is not None:
                poison = "" if x.relation.startswith("poison-invariance") else f" poison={x.example.poison.value}"
                console.print(escape(f"  minimal batch: {x.example.batch.summary()} seed={x.example.batch.seed}"
                                     f"{poison} block_table={[list(r) for r in x.example.batch.block_table]}"),
                              highlight=False)
            console.print(f"  {escape(x.message)}", highlight=False)
    if json_path is not None:
        write_output(json_path, json.dumps([x.to_dict() for x in results], indent=2), "--json")
    failed = [x for x in results if x.outcome == "error" or
              (x.outcome == "violated" and not (no_design and x.design_property))]
    sys.exit(1 if failed else 0)


__all__ = ["relations"]
