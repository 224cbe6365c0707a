"""``kvfuzz relations``: every metamorphic relation (:mod:`kvfuzz.fuzz.relations`) as its own Hypothesis
property on every target, and a table of which hold.

Each (target, relation) pair is one ``@given`` property over ``kvfuzz.strategies.examples`` (no example
database, no deadline, seeded by ``--seed``); an example the relation does not apply to is rejected. A
violation is shrunk (within ``--shrink-time`` seconds; after that the best example so far is kept) and
reported with its minimal batch and message. Exit 1 if any relation is violated (``--no-design`` leaves
the design properties, batch invariance and determinism, out of the exit status), 2 on bad usage.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import attrs
import click
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, seed as hseed, settings
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvfuzz.contracts.example import Example
from kvfuzz.contracts.materialize import Poison
from kvfuzz.strategies.batches import Limits, examples

from .findings import Finding
from .relations import RELATIONS, Relation, RelationViolation, example_key
from .targets import BUILTIN, get_target
from .targets.base import Target

console = Console(width=None if sys.stdout.isatty() else 200)

#: Small batches: several kernel calls per example, and the Triton interpreter takes 0.3-2 s per call.
RELATION_LIMITS = Limits(max_num_seqs=3, max_ctx_len=40, max_query_len=12, max_num_heads=4, max_spare_blocks=3)


@attrs.define
class RelationResult:
    """outcome: "holds", "violated", "not applicable" or "error" (the kernel raised, or kvfuzz did)."""

    target: str
    relation: str
    outcome: str
    examples: int = 0
    seconds: float = 0.0
    design_property: bool = False
    message: str = ""
    example: Example | None = None

    def to_dict(self) -> dict:
        d = attrs.asdict(self, filter=lambda a, v: a.name != "example")
        if self.example is not None:
            d["batch"] = self.example.batch.summary()
            d["poison"] = self.example.poison.value
            d["example"] = self.example.to_dict()
        return d


def check_relation(target: Target, relation: Relation, max_examples: int = 10, seed: int = 0,
                   limits: Limits = RELATION_LIMITS, poisons: tuple[Poison, ...] = (Poison.STALE,),
                   shrink_time: float = 60.0) -> RelationResult:
    """Run ``relation`` as a Hypothesis property on ``target``; never raises for a finding."""
    res = RelationResult(target.name, relation.name, "holds", design_property=relation.design_property)
    start = time.monotonic()
    if not relation.applies_to_target(target):
        res.outcome = "not applicable"
        res.message = ("cache writers are checked by the writer property" if target.kind == "cache-writer"
                       else "no batch this target accepts can be checked")
        return res
    memo: dict[str, BaseException | None] = {}
    first_failure: list[float] = []

    def body(example: Example) -> None:
        key = example_key(example)
        if key in memo:  # replays (Hypothesis's final run, shrink revisits) give the stored outcome
            if memo[key] is not None:
                raise memo[key]
            return
        if not relation.applies(target, example.batch):
            reject()
        if first_failure and time.monotonic() - first_failure[0] > shrink_time:
            return  # shrink budget spent: new candidates pass, so the shrinker stops at the best so far
        res.examples += 1
        try:
            relation.check(target, example)
        except Finding as f:
            memo[key] = f
            first_failure[:] = first_failure or [time.monotonic()]
            raise
        memo[key] = None

    body.__name__ = body.__qualname__ = "relation_" + "".join(c if c.isalnum() else "_" for c in
                                                              f"{target.name}_{relation.name}")
    test = settings(database=None, deadline=None, max_examples=max_examples, derandomize=False,
                    phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck),
                    verbosity=Verbosity.quiet, report_multiple_bugs=False, print_blob=False)(
        hseed(seed)(given(examples(target.capabilities, limits, poisons))(body)))
    try:
        test()
        if res.examples == 0:
            res.outcome = "not applicable"
            res.message = "no generated example applied"
    except Finding as f:
        failing = [k for k, v in memo.items() if v is f]
        res.example = Example.from_dict(json.loads(failing[0])) if failing else None
        res.outcome = "violated" if isinstance(f, RelationViolation) else "error"
        res.message = f.message
    except Exception as e:  # kvfuzz's own error: report, do not hide the other results
        res.outcome = "error"
        res.message = f"{type(e).__name__}: {e}"
    res.seconds = time.monotonic() - start
    return res


def _cell(r: RelationResult) -> str:
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
              help=f"Relation (repeatable); default: all of {', '.join(RELATIONS)}.")
@click.option("--max-examples", default=10, show_default=True, type=click.IntRange(1),
              help="Examples per (target, relation).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the example generation.")
@click.option("--poison", "poison_names", multiple=True, type=click.Choice([p.value for p in Poison]),
              help="Poison of the unread slots for the relations other than poison-invariance (default: "
                   "stale, under which a read of a wrong slot changes the answer; the poison-invariance "
                   "relations set their own).")
@click.option("--shrink-time", default=60.0, show_default=True, type=float,
              help="Seconds each violation may spend shrinking.")
@click.option("--no-design", is_flag=True,
              help="Leave the design properties (batch invariance, determinism) out of the exit status.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the results as JSON.")
def relations(target_names, relation_names, max_examples, seed, poison_names, shrink_time, no_design, json_path):
    """Check metamorphic relations (bit-exact where the kernel is deterministic) on the targets.

    A violated relation marked "not satisfied" is a design property many correct kernels lack (batch
    invariance, determinism); VIOLATED is a bug in the output. Exit 1 if any relation is violated."""
    unknown = [r for r in relation_names if r not in RELATIONS]
    if unknown:
        raise click.UsageError(f"unknown relation(s) {unknown}; relations: {', '.join(RELATIONS)}")
    rels = [RELATIONS[r] for r in relation_names] if relation_names else list(RELATIONS.values())
    targets: list[Target] = []
    try:
        for name in target_names or BUILTIN:
            t = get_target(name)
            a = t.availability()
            if not a.ok:
                if target_names:
                    raise click.UsageError(f"target {name} cannot run here: {a.reason}")
                continue
            if t.kind == "cache-writer" and not target_names:
                continue
            targets.append(t)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    poisons = tuple(Poison(p) for p in poison_names) or (Poison.STALE,)
    results: list[RelationResult] = []
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
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps([x.to_dict() for x in results], indent=2))
    failed = [x for x in results if x.outcome == "error" or
              (x.outcome == "violated" and not (no_design and x.design_property))]
    sys.exit(1 if failed else 0)


__all__ = ["RELATION_LIMITS", "RelationResult", "check_relation", "relations"]
