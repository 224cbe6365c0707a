"""Hypothesis's mutator groups in one pass (fuzz/campaign/engine.py, mutator_groups): the groups Hypothesis's own
visitor computes, in its order, for kvfuzz's batches and for spans inside unique collections, and a campaign draws
and decides exactly what it did with Hypothesis's."""

import functools
import random

from hypothesis import strategies as st
from hypothesis.control import BuildContext
from hypothesis.internal.conjecture import data as conjecture
from hypothesis.internal.conjecture.data import ConjectureData, Spans, _mutator_groups
from support import campaign_outcomes

from kvfuzz.fuzz.campaign import engine
from kvfuzz.fuzz.campaign.engine import fast_mutator_groups, mutator_groups
from kvfuzz.fuzz.targets import get_target
from kvfuzz.strategies.batches import examples
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.serving import serving_examples
from kvfuzz.strategies.tiers import tier_limits


def _spans(strategy, seed: int) -> Spans:
    data = ConjectureData(random=random.Random(seed))
    try:
        with BuildContext(data, wrapped_test=None):
            data.draw(strategy)
    except Exception:  # a rejected draw still has its spans
        pass
    data.freeze()
    return data.spans


def _their_mutator_groups(self):  # Hypothesis's Spans.mutator_groups
    return _mutator_groups(self).run()


_their_mutator_groups.__name__ = "mutator_groups"


def test_the_groups_are_hypothesis_own_in_its_order():
    caps = get_target("vllm.cpu_attention").capabilities
    strategies = [examples(caps, Limits()), serving_examples(caps, tier_limits("serving")),
                  # spans inside a unique collection are left out, the collection's own kept
                  st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 9), unique=True)), min_size=2),
                  st.lists(st.lists(st.integers(0, 3), unique=True, min_size=1), min_size=3)]
    compared = 0
    for strategy in strategies:
        for seed in range(25):
            spans = _spans(strategy, seed)
            theirs = _mutator_groups(spans).run()
            assert mutator_groups(spans) == theirs, seed
            compared += bool(theirs)
    assert compared > 50


def test_a_changed_group_is_told_apart():
    spans = _spans(examples(get_target("vllm.cpu_attention").capabilities, Limits()), 3)
    ours = mutator_groups(spans)
    assert ours == _mutator_groups(spans).run() and len(ours) >= 2
    assert ours[::-1] != _mutator_groups(spans).run()  # the order counts (the mutator draws a group by index)


def test_installed_once_and_a_campaign_runs_the_same_examples(tmp_path, monkeypatch):
    # Hypothesis's own (an earlier campaign in this process may have installed ours)
    original = functools.cached_property(_their_mutator_groups)
    original.__set_name__(Spans, "mutator_groups")
    monkeypatch.setattr(conjecture.Spans, "mutator_groups", original)
    monkeypatch.setattr(engine, "fast_mutator_groups", lambda: None)
    plain = campaign_outcomes(tmp_path / "plain")
    assert conjecture.Spans.__dict__["mutator_groups"] is original
    monkeypatch.undo()
    monkeypatch.setattr(conjecture.Spans, "mutator_groups", original)  # put back when the test ends
    fast = campaign_outcomes(tmp_path / "fast")
    installed = conjecture.Spans.__dict__["mutator_groups"]
    assert isinstance(installed, functools.cached_property) and installed.func is mutator_groups
    fast_mutator_groups()  # once: a second call leaves it
    assert conjecture.Spans.__dict__["mutator_groups"] is installed
    assert len(plain) >= 40 and fast == plain
