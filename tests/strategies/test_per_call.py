"""kvfuzz.strategies.per_call: a composite drawn per call makes the composite's choices, spans and span labels (issue
51: the campaign's draws are unchanged, Hypothesis's mutator groups spans by label), without a strategy built and
validated per call."""

from __future__ import annotations

import random

import pytest
from hypothesis import strategies as st
from hypothesis.control import BuildContext
from hypothesis.internal.conjecture.data import ConjectureData

from kvfuzz.strategies.batches import block_tables, block_tables_per_call
from kvfuzz.strategies.per_call import PerCall, per_call
from kvfuzz.strategies.states import _shared_prefixes_per_call, shared_prefixes


def _record(strategy, seed: int):
    """The value drawn from ``strategy`` inside an outer span (as inside a batch), the choices made and every span
    (label, start, end), from a fresh ConjectureData of ``seed``."""
    data = ConjectureData(random=random.Random(seed))
    with BuildContext(data, wrapped_test=None):
        value = data.draw(st.tuples(st.integers(0, 3), strategy, st.integers(0, 3)))
    data.freeze()
    return value, data.choices, [(s.label, s.start, s.end) for s in data.spans]


CASES = [
    (shared_prefixes, _shared_prefixes_per_call, ([[0, 1, 2, 0], [3, 4, 5, 6], [7, 8, 0, 0], [9, 10, 11, 0]],
                                                  [40, 50, 20, 33], 16)),
    (block_tables, block_tables_per_call, ((3, 1, 4, 1, 5), 6)),
    (block_tables, block_tables_per_call, ((700, 1, 4000), 2)),
]


@pytest.mark.parametrize("composite,drawn,args", CASES, ids=["shared_prefixes", "block_tables", "serving_tables"])
def test_a_per_call_draw_is_the_composites_draw_choice_for_choice_and_span_for_span(composite, drawn, args):
    for seed in range(40):
        assert _record(drawn(*args), seed) == _record(composite(*args), seed), seed


def test_a_per_call_strategy_is_valid_from_the_start_and_never_empty():
    s = block_tables_per_call((2, 3), 1)
    assert isinstance(s, PerCall) and not s.is_empty and not s.has_reusable_values
    s.validate()  # nothing to compute
    assert s.label == block_tables((2, 3), 1).wrapped_strategy.label


def test_per_call_refuses_a_strategy_that_is_not_a_composite():
    with pytest.raises(TypeError, match="does not build a composite strategy"):
        per_call(st.integers, 0, 1)
