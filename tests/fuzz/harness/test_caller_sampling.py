"""When the caller checks run (docs/checks.md, "When the caller checks run"): every call with a caller fault or to a
target that is not a built-in class itself; a built-in target's own call on the first call of its shape and on a
hash-selected share of the others; and, whatever ran before the kernel, on every failing example, so a broken cache
is a caller violation even when its call skipped the checks before the kernel."""

import pytest
import torch
from support import batch_of

from kvfuzz.contracts.checks.failures import CallerContractViolation
from kvfuzz.contracts.checks.violations import Check
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.mutants import get_mutant
from kvfuzz.fuzz.harness import attention, caller
from kvfuzz.fuzz.harness.faults import get_fault
from kvfuzz.fuzz.targets import get_target

NAME = "vllm.cpu_attention"


def _target():
    t = get_target(NAME)
    if not t.availability().ok:
        pytest.skip(t.availability().reason)
    return t


def _batch(seed, lens=((3, 5), (1, 9))):
    return batch_of(list(lens), block_size=16, spare=1, num_heads=4, num_kv_heads=2, head_size=64, dtype="float32",
                    seed=seed)


def _selected(seed) -> bool:
    return caller._hash_selected(_batch(seed))


@pytest.fixture
def fresh(monkeypatch):
    """No call shape checked yet in this process, and the default share."""
    monkeypatch.setattr(caller, "_SHAPES_CHECKED", set())
    monkeypatch.setattr(caller, "CALLER_CHECK_EVERY", 16)


def test_only_builtin_classes_themselves_are_sampled():
    t = get_target("vllm.unified_attention")

    class Sub(type(t)):
        name = "tests.sub"

    assert caller.is_builtin(t)
    assert not caller.is_builtin(Sub())
    assert not caller.is_builtin(get_mutant("mutant.base"))


def test_first_call_of_a_shape_then_a_hash_selected_share(fresh):
    t = get_target("vllm.unified_attention")
    skipped = next(s for s in range(100) if not _selected(s))
    chosen = next(s for s in range(100) if _selected(s))
    assert caller.caller_checks_due(t, _batch(skipped))  # the first of its shape
    assert not caller.caller_checks_due(t, _batch(skipped))
    assert caller.caller_checks_due(t, _batch(chosen))
    assert caller.caller_checks_due(t, _batch(skipped, lens=((1, 9),)))  # another shape: decode only
    # a caller fault, a subclass, or a share of 1: every call
    assert caller.caller_checks_due(t, _batch(skipped), get_fault("decode-ctx-only"))
    assert caller.caller_checks_due(type("Sub", (type(t),), {"name": "tests.sub"})(), _batch(skipped))
    caller.CALLER_CHECK_EVERY = 1
    assert caller.caller_checks_due(t, _batch(skipped))


def test_a_passing_example_whose_checks_are_not_due_runs_none(fresh, monkeypatch):
    t = _target()
    seen = []
    monkeypatch.setattr(attention, "caller_checks_due", lambda *a: False)
    monkeypatch.setattr(attention, "caller_violations", lambda *a: seen.append(a) or [])
    run = attention.check_example(t, Example(_batch(1), Poison.STALE))
    assert run.output is not None and not seen and run.timings.check_caller < 1.0


def test_a_failing_example_runs_the_checks_it_skipped(fresh, monkeypatch):
    """A NaN written over a token the contract requires: the kernel's output is non-finite, and the checks that did
    not run before the kernel name the caller (what the kernel computed is in the finding)."""
    t = _target()
    monkeypatch.setattr(attention, "caller_checks_due", lambda *a: False)
    b = _batch(2)

    def break_cache(batch, data, cache):
        slot = batch.slots(torch.tensor([1]), torch.tensor([4]))  # sequence 1, a context position
        nan = torch.full((1, batch.num_kv_heads, batch.head_size), float("nan"))
        cache.layout.write(cache.key_cache, cache.value_cache, slot, nan, nan)

    run = attention.prepare(t, Example(b, Poison.STALE), after_materialize=break_cache)
    with pytest.raises(CallerContractViolation) as info:
        attention.check_example(t, run.example, run=run)
    f = info.value
    assert f.check == Check.UNIFIED.value
    assert (f.details["violations"][0]["seq"], f.details["violations"][0]["position"]) == (1, 4)
    assert f.details["kernel"]["outcome"] == "non-finite"
