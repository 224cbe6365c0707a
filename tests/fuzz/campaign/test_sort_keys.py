"""The Pareto front's sort keys remembered (fuzz/campaign/engine.py, SortKeys): the same keys as Hypothesis's own,
computed once per choice sequence, and a campaign draws and decides exactly what it did without them."""

from hypothesis.internal.conjecture import pareto, shrinker
from support import campaign_outcomes

from kvfuzz.fuzz.campaign import engine
from kvfuzz.fuzz.campaign.engine import SortKeys


def test_a_key_is_computed_once_per_sequence_and_never_handed_to_another():
    calls = []

    def key(nodes):
        calls.append(nodes)
        return (len(nodes), tuple(nodes))

    keys = SortKeys(key, size=2)
    a, b, c = (1, 2), (3,), (4, 5, 6)
    assert keys(a) == key(a) and keys(a) == (2, (1, 2))
    assert len(calls) == 2  # the second keys(a) was remembered (one call above is the test's own)
    keys(b), keys(c)
    assert len(keys._memo) == 2 and id(a) not in keys._memo  # the oldest forgotten past ``size``
    # an id that now names another sequence (the first one freed) is computed afresh, not taken from the memo
    keys._memo[id(a)] = ((9, 9), "another sequence's key")
    assert keys(a) == (2, (1, 2))
    # a sequence that may still change (a list: a run in progress) is never remembered
    live = [7]
    keys(live)
    live.append(8)
    assert keys(live) == (2, (7, 8))



def test_a_campaign_runs_the_same_examples_with_the_keys_remembered(tmp_path, monkeypatch):
    monkeypatch.setattr(pareto, "sort_key", shrinker.sort_key)
    monkeypatch.setattr(engine, "remember_sort_keys", lambda: None)
    plain = campaign_outcomes(tmp_path / "plain")
    monkeypatch.undo()
    monkeypatch.setattr(pareto, "sort_key", shrinker.sort_key)  # put back when the test ends
    remembered = campaign_outcomes(tmp_path / "remembered")
    assert isinstance(pareto.sort_key, SortKeys) and pareto.sort_key._memo  # installed by the campaign, and used
    assert len(plain) >= 40 and remembered == plain
