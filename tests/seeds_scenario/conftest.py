"""tests/seeds_scenario holds test files written the way a kernel team writes them (bugs included), for
tests/test_guard.py to run under the kvfuzz pytest plugin in a subprocess. The normal test run must not
collect them: they run only when KVFUZZ_SEEDS_SCENARIO=1 is set (the subprocess sets it)."""

import os

collect_ignore_glob = [] if os.environ.get("KVFUZZ_SEEDS_SCENARIO") == "1" else ["test_*.py"]
