"""Hypothesis guidance (fuzz/campaign/runner.py, ExampleRunner.body): every passing example reports its agreement
error's largest ratio to its bound to ``hypothesis.target()``, so the targeted phase climbs towards a failure."""

import hypothesis

from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.campaign.runner import TARGET_LABEL
from kvfuzz.fuzz.targets import get_target


def test_passing_examples_report_error_over_bound_to_hypothesis(tmp_path, monkeypatch):
    scores = []
    real = hypothesis.target

    def recording(observation, *, label=""):
        scores.append((label, observation))
        return real(observation, label=label)

    monkeypatch.setattr(hypothesis, "target", recording)
    stats = fuzz_target(get_target("mutant.base"), CampaignConfig(out=tmp_path, max_examples=6,
                                                                  poisons=(Poison.ZEROS,), seed=3))
    assert stats.examples == 6 and not stats.failures
    assert len(scores) == 6 and {label for label, _ in scores} == {TARGET_LABEL} == {"error/bound"}
    assert all(0.0 <= v < 1.0 for _, v in scores)  # a passing example's error is within its bound
    assert any(v > 0.0 for _, v in scores)  # and measured, not a constant
