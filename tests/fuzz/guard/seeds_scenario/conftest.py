"""tests/fuzz/guard/seeds_scenario holds test files written the way a kernel team writes them (bugs included), for
tests/fuzz/guard/test_guard.py to run under the kvfuzz pytest plugin in a subprocess. The normal test run must not
collect them: they run only when KVFUZZ_SEEDS_SCENARIO=1 is set (the subprocess sets it)."""

import contextlib
import os

import pytest

collect_ignore_glob = [] if os.environ.get("KVFUZZ_SEEDS_SCENARIO") == "1" else ["test_*.py"]


@pytest.fixture
def hand_over(request):
    """``kvfuzz_guard.new_kv(k, v)`` under the kvfuzz plugin, else a no-op: the test runs unchanged."""
    try:
        g = request.getfixturevalue("kvfuzz_guard")
    except pytest.FixtureLookupError:
        g = None
    return (lambda k, v: g.new_kv(k, v)) if g is not None else (lambda k, v: contextlib.nullcontext())
