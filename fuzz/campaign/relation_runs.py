"""Metamorphic relations (:mod:`kvfuzz.fuzz.harness.relations`) run as Hypothesis properties: each (target,
relation) pair is one ``@given`` property over ``kvfuzz.strategies.examples`` (no example database, no
deadline, seeded); an example the relation does not apply to is rejected; a violation is shrunk (within a
time limit; after that the best example so far is kept) and returned with its minimal batch and message."""

from __future__ import annotations

import json
import time

import attrs
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis import seed as hseed

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness.relations import Relation, RelationViolation, example_key
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.strategies.batches import examples
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.seeding import seed_only

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
        res.message = ("cache writers are checked by the writer property"
                       if not target.capabilities.contract.is_attention
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
        with seed_only():  # the draws depend on the seed, not on what this process imported
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


__all__ = ["RELATION_LIMITS", "RelationResult", "check_relation"]
