"""When the caller checks run (docs/checks.md, "When the caller checks run"): every call with a caller fault or to a
target that is not a built-in class itself; a built-in target's own call on the first call of its shape and on a
hash-selected share of the others; and, whatever ran before the kernel, on every failing example, so a broken cache
is a caller violation even when its call skipped the checks before the kernel."""

import pytest
import torch
from support import batch_of

from kvfuzz.contracts.checks.failures import CallerContractViolation, NonFiniteOutput
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
    monkeypatch.setattr(caller, "_SHAPES_CHECKED", {})
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


def test_the_shapes_remembered_are_bounded_and_the_least_recent_go_first(fresh, monkeypatch):
    """A CPU campaign draws a new configuration at nearly every example: the process remembers SHAPES_KEPT shapes,
    not every shape it ever saw; one it forgot is a first call again."""
    monkeypatch.setattr(caller, "SHAPES_KEPT", 4)
    t = get_target("vllm.unified_attention")
    skipped = next(s for s in range(100) if not _selected(s))

    def shaped(heads):
        return batch_of([(3, 5), (1, 9)], block_size=16, spare=1, num_heads=heads, num_kv_heads=1, head_size=64,
                        dtype="float32", seed=skipped)

    assert caller.caller_checks_due(t, shaped(1))
    for heads in range(2, 60):
        assert caller.caller_checks_due(t, shaped(heads))  # each a new shape: a first call
        assert not caller.caller_checks_due(t, shaped(1))  # seen last but one: remembered, not due
        assert len(caller._SHAPES_CHECKED) <= 4
    assert not caller.caller_checks_due(t, shaped(57))  # among the 4 seen last
    assert caller.caller_checks_due(t, shaped(2))  # forgotten long ago: a first call again


def test_a_passing_example_whose_checks_are_not_due_runs_none(fresh, monkeypatch):
    t = _target()
    seen = []
    monkeypatch.setattr(attention, "caller_checks_due", lambda *a: False)
    monkeypatch.setattr(attention, "caller_violations", lambda *a: seen.append(a) or [])
    run = attention.check_example(t, Example(_batch(1), Poison.STALE))
    assert run.output is not None and not seen and run.timings.check_caller < 1.0


def _break(batch, cache, seq=1, pos=4):
    """NaN over dim 0 of one held position's key, by a torch in-place write (the CPU op's "vec" packing: the K slab
    of a block is [D, block_size])."""
    slot = int(batch.slots(torch.tensor([seq]), torch.tensor([pos])))
    blk, off = divmod(slot, batch.block_size)
    kc = cache.key_cache
    kc.flatten(2).unflatten(2, (batch.head_size, batch.block_size))[blk, :, 0, off] = float("nan")


def _sampled_out(monkeypatch):
    monkeypatch.setattr(attention, "caller_checks_due", lambda *a: False)


def test_a_run_changed_after_prepare_is_checked_before_the_kernel(fresh, monkeypatch):
    """A test (or any caller) that breaks a prepared run before handing it over: the checks run before the kernel,
    sampled or not, as every call's did."""
    t = _target()
    _sampled_out(monkeypatch)
    order = []
    checks = attention.caller_violations
    monkeypatch.setattr(attention, "caller_violations", lambda *a: order.append("checks") or checks(*a))
    run = attention.prepare(t, Example(_batch(2), Poison.STALE))
    assert run.prepared == run.fingerprint()
    _break(run.example.batch, run.cache)
    assert run.prepared != run.fingerprint()
    kernel = attention.run_kernel
    monkeypatch.setattr(attention, "run_kernel", lambda *a, **k: order.append("kernel") or kernel(*a, **k))
    with pytest.raises(CallerContractViolation) as info:
        attention.check_example(t, run.example, run=run)
    assert order == ["checks", "kernel"]
    assert info.value.check == Check.UNIFIED.value and info.value.details["kernel"]["outcome"] == "non-finite"


def test_a_failing_pristine_run_is_checked_as_it_was_before_the_kernel(fresh, monkeypatch):
    """kvfuzz's own call breaks the contract (here: its build_call writes NaN over a token), the checks were sampled
    out, the kernel's output is non-finite: the finding is the caller's, with what the kernel computed."""
    t = _target()
    _sampled_out(monkeypatch)
    build = t.build_call

    def broken_build(batch, data, cache):
        _break(batch, cache)
        return build(batch, data, cache)

    monkeypatch.setattr(t, "build_call", broken_build)
    with pytest.raises(CallerContractViolation) as info:
        attention.check_example(t, Example(_batch(2), Poison.STALE))
    f = info.value
    assert f.check == Check.UNIFIED.value
    assert (f.details["violations"][0]["seq"], f.details["violations"][0]["position"]) == (1, 4)
    assert f.details["kernel"]["outcome"] == "non-finite"


def test_a_kernel_that_writes_into_its_cache_is_not_the_callers_fault(fresh, monkeypatch):
    """The kernel overwrites a token of its own cache and returns NaN: the call was correct before it ran, so the
    finding is the kernel's non-finite output, as when the checks ran before the kernel."""
    t = _target()
    _sampled_out(monkeypatch)
    run_op = t.run

    def writes_cache(call):
        out = run_op(call)
        _break(b, run.cache)
        out[0, 0, 0] = float("nan")
        return out

    b = _batch(3)
    run = attention.prepare(t, Example(b, Poison.STALE))
    monkeypatch.setattr(t, "run", writes_cache)
    with pytest.raises(NonFiniteOutput):
        attention.check_example(t, run.example, run=run)
    assert caller.caller_violations(t, run)  # the cache as the kernel left it does break the contract
