"""Focused draws (strategies/focus.py): a batch aimed at a coverage bin lands in it, and its choices replay unchanged in
the free strategy (so Hypothesis's shrink and the example database work on it there); the serving tier's cheaper
draw; a permuted block table drawn as one seed (no overrun of Hypothesis's choice buffer)."""

import random

import pytest
from hypothesis.control import BuildContext
from hypothesis.errors import StopTest
from hypothesis.internal.conjecture.data import ConjectureData, Status

from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.fuzz.harness.coverage import SHAPE_DIMENSIONS, labels
from kvfuzz.fuzz.targets import get_target
from kvfuzz.strategies.batches import block_tables, examples, permutation
from kvfuzz.strategies.configs import KernelConfig
from kvfuzz.strategies.focus import Focus, aim_pin, bin_range, log2_bin
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.serving import DECODE_TOKENS, serving_examples
from kvfuzz.strategies.tiers import tier_limits

CAPS = Capabilities(contract=Contract.UNIFIED, devices=("cuda",), dtypes=("float16",),
                    head_sizes=(64, 128, 192, 256), block_sizes=(16, 32), features=("sliding_window", "softcap"))
DECODE = Capabilities(contract=Contract.UNIFIED, devices=("cuda",), dtypes=("float16",), head_sizes=(128,),
                      block_sizes=(16,), decode_only=True)


def _draw(strategy, data):
    with BuildContext(data, wrapped_test=None):
        return data.draw(strategy)


def _focused_and_replayed(strategy, free, n, seed=0):
    """``n`` examples of ``strategy`` (fresh random draws), each with the example its choices give in ``free``
    (None where they do not replay: another example, a misaligned or missing choice)."""
    out, i = [], 0
    while len(out) < n:
        data = ConjectureData(random=random.Random(f"{seed}:{i}"))
        i += 1
        try:
            example = _draw(strategy, data)
        except StopTest:
            continue
        replay = ConjectureData.for_choices(data.choices)
        try:
            again = _draw(free, replay)
        except StopTest:
            again = None
        out.append((example, again if replay.misaligned_at is None else None))
    return out


SMALL, SERVING, LONG = (tier_limits(t, Limits()) for t in ("small", "serving", "long"))


@pytest.mark.parametrize("caps,limits,focus", [
    (CAPS, SMALL, Focus.of_bins("2^5 x 2^3", "128 x 2^4")),
    (CAPS, SMALL, Focus.of_bins("0 x 2^0")),
    (CAPS, SMALL, Focus.of_bins("0 x 2^4", "64 x none")),
    (CAPS, SMALL, Focus.of_bins("2^6 x 2^5")),
    (CAPS, SERVING, Focus.of_bins("2^9 x 2^6", "192 x 2^8")),  # Finding 12's region (FA3's window)
    (CAPS, SERVING, Focus.of_bins("2^16 x 2^13")),  # the largest: one 8192-token chunk, no decodes
    (CAPS, SERVING, Focus.of_bins("2^3 x 2^0", "256 x none")),
    (CAPS, SERVING, Focus.of_bins("0 x 2^2", "256 x 2^9")),
    (CAPS, LONG, Focus.of_bins("2^16 x 2^4")),
    (DECODE, SERVING, Focus.of_bins("2^12 x 2^0")),
    (DECODE, SMALL, Focus.of_bins("2^2 x 2^0")),
])
def test_a_focused_draw_lands_in_its_bin_and_replays_in_the_free_strategy(caps, limits, focus):
    make = serving_examples if limits is SERVING else examples
    shape = f"{log2_bin(focus.ctx_len[0])} x {log2_bin(focus.query_len[0])}" if focus.lengths else None
    target = get_target("vllm.cpu_attention")  # labels need a target only for its path
    for example, again in _focused_and_replayed(make(caps, limits, focus=focus), make(caps, limits), 25):
        assert again == example  # the same choices, the same example in the free strategy
        b = example.batch
        lab = labels(target, b)
        if shape is not None:
            assert lab[SHAPE_DIMENSIONS[0]] == shape, b.summary()
        if focus.head_size is not None:
            assert b.head_size == focus.head_size
        if focus.window == (0, 0):
            assert b.sliding_window is None
        elif focus.window is not None:
            assert focus.window[0] <= b.sliding_window <= focus.window[1]


def test_a_pin_wins_over_a_focus_and_aim_pin_moves_it_where_it_can():
    pin = KernelConfig("float16", 8, 2, 64, "auto", 16, {"sliding_window"}, 5)
    focus = Focus.of_bins("2^4 x 2^2", "128 x 2^5")
    for example, again in _focused_and_replayed(examples(CAPS, SMALL, pin=pin, focus=focus), examples(CAPS, SMALL),
                                                10):
        assert again == example and example.batch.head_size == 64 and example.batch.sliding_window == 5
    moved = aim_pin(pin, focus, CAPS)
    assert moved.head_size == 128 and moved.sliding_window == 32
    assert aim_pin(pin, Focus.of_bins(None, "64 x none"), CAPS).features == frozenset()
    assert aim_pin(pin, Focus.of_bins(None, "96 x none"), CAPS).head_size == 64  # not declared: kept
    assert aim_pin(None, focus, CAPS) is None and aim_pin(pin, None, CAPS) is pin


def test_bins_and_focus_round_trip():
    assert [bin_range(x) for x in ("0", "2^0", "2^9", "192")] == [(0, 0), (1, 1), (512, 1023), (192, 192)]
    assert bin_range("none") is None
    f = Focus.of_bins("2^9 x 2^6", "192 x none")
    assert f == Focus((512, 1023), (64, 127), 192, (0, 0))
    assert Focus.from_dict(f.to_dict()) == f and Focus.from_dict(Focus().to_dict()) == Focus()
    assert f.summary() == "ctx 512-1023, query 64-127, head_size 192, window 0-0" and Focus().summary() == "free"


def test_serving_draws_no_more_than_one_choice_per_decode_slot_flag():
    assert DECODE_TOKENS == tuple(sorted(DECODE_TOKENS)) and DECODE_TOKENS[0] == 0  # off first, then by tokens
    assert DECODE_TOKENS.count(0) == len(DECODE_TOKENS) // 2  # half the slots out of the batch, as a flag gave
    strategy = serving_examples(CAPS, SERVING)
    sizes = []
    for i in range(40):
        data = ConjectureData(random=random.Random(i))
        try:
            _draw(strategy, data)
        except StopTest:
            pass
        assert data.status is not Status.OVERRUN  # a permutation of 10k blocks drew 10k choices and overran
        sizes.append(len(data.choices))
    assert max(sizes) < 260  # 32 decode slots of 3 choices (4 plus a tuple's before), 3 chunk slots of 8


def test_a_permuted_block_table_is_one_seed_and_the_identity_at_zero():
    assert permutation(6, 0) == list(range(6))
    assert sorted(permutation(50_000, 7)) == list(range(50_000)) and permutation(50_000, 7) != list(range(50_000))

    def permuted(seed, needed=(3, 2)):  # the choices: "permuted", no spare blocks or columns, high id 1, the seed
        data = ConjectureData.for_choices((2, 0, 0, 1, seed))
        return _draw(block_tables(needed), data), data

    (num_blocks, table, arrangement), data = permuted(0)
    assert arrangement == "permuted" and num_blocks == 5 and table == [[0, 1, 2], [3, 4, 0]]  # shrunk: contiguous
    ids = permutation(5, 7)
    assert permuted(7)[0][1] == [ids[:3], ids[3:] + [0]]
    (_, table, _), data = permuted(7, (4000, 3000))
    assert len(data.choices) == 5 and sorted(table[0] + table[1][:3000]) == list(range(7000))
