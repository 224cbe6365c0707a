"""Helpers shared by the test modules (importable because tests/ has no __init__.py: pytest puts it on
sys.path)."""

import pytest

from kvfuzz.fuzz.targets import get_target


def available(name):
    """The built-in target ``name``, or skip the test, naming why it cannot run here."""
    t = get_target(name)
    a = t.availability()
    if not a.ok:
        pytest.skip(f"{name} unavailable: {a.reason}")
    return t
