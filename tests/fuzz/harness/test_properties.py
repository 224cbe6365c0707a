"""The contract properties as plain @given tests, one per built-in target available here.

They run under Hypothesis profiles (conftest.py: dev, ci, fuzz; `pytest --hypothesis-profile fuzz`), under
pytest-xdist (`-n auto`), and under HypoFuzz unchanged (it runs any @given test; it is optional and never a
dependency). Poisons and value ranges are each target's gate_poisons and gate_value_ranges, as in `kvfuzz
check`."""

import attrs
import pytest
from hypothesis import HealthCheck, given, settings

from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.gate import CHECK_LIMITS
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.targets import BUILTIN, get_target
from kvfuzz.strategies import examples

pytestmark = pytest.mark.kernel


def _property(name):
    target = get_target(name)
    avail = target.availability()
    limits = attrs.evolve(CHECK_LIMITS, value_ranges=target.gate_value_ranges or CHECK_LIMITS.value_ranges)
    strategy = examples(target.gate_capabilities(), limits, target.gate_poisons or tuple(Poison))

    @pytest.mark.skipif(not avail.ok, reason=f"{name}: {avail.reason}")
    @settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # budget: the profile
    @given(strategy)
    def test(example):
        properties.check(target, example)

    test.__name__ = f"test_contract_property[{name}]"
    return test


for _name in BUILTIN:
    globals()[f"test_contract_property_{_name.replace('.', '_')}"] = _property(_name)
