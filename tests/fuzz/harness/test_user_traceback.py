"""What a user sees when ``kvfuzz.check_example`` fails inside their own Hypothesis test (the README's snippet):
pytest in a child process on a small user test file, the README's SDPA adapter with its last token off by 1%.
The Finding and the shrunk example are shown; kvfuzz's own frames (and check_example's docstring) are not,
unless the error is not a Finding (a broken adapter keeps every frame)."""

import subprocess
import sys

from support import ROOT

USER_TEST = f'''
import sys
sys.path.insert(0, {str(ROOT / "examples")!r})
from hypothesis import given, settings
import kvfuzz
from sdpa_paged_target import SdpaPaged


class OffByOnePercent(SdpaPaged):
    name = "user.off_by_one_percent"

    def run(self, call):
        out = super().run(call)
        out[-1] *= 1.01
        return out


class BrokenAdapter(SdpaPaged):
    name = "user.broken_adapter"

    def build_call(self, batch, data, cache):
        raise ValueError("my adapter is broken")


@settings(max_examples=5, derandomize=True, database=None)
@given(kvfuzz.examples(SdpaPaged.capabilities))
def test_planted_last_token(example):
    kvfuzz.check_example(OffByOnePercent(), example)


@settings(max_examples=2, derandomize=True, database=None)
@given(kvfuzz.examples(SdpaPaged.capabilities))
def test_broken_adapter(example):
    kvfuzz.check_example(BrokenAdapter(), example)
'''


def _failures(tmp_path) -> dict[str, str]:
    (tmp_path / "test_user_kernel.py").write_text(USER_TEST)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--tb=long",
                        "test_user_kernel.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    sections = r.stdout.split("_ test_")  # pytest's header of each failure: "____ test_name ____"
    return {name: next(s for s in sections if s.lstrip().startswith(name)) for name in
            ("planted_last_token", "broken_adapter")}


def test_a_finding_in_a_users_test_shows_the_finding_not_kvfuzz_internals(tmp_path):
    out = _failures(tmp_path)
    planted = out["planted_last_token"]
    assert "KernelMismatch: [kernel mismatch] agreement with the fp64 reference" in planted, planted
    assert "Failing test case: test_planted_last_token(" in planted and "query_lens=" in planted, planted
    assert "kvfuzz.check_example(OffByOnePercent(), example)" in planted, planted
    for internal in ("fuzz/harness/", "def check_example", "Run one example", "agreement(batch"):
        assert internal not in planted, (internal, planted)
    # not a Finding: kvfuzz's frames stay, down to the adapter's line
    broken = out["broken_adapter"]
    assert "ValueError: my adapter is broken" in broken and "fuzz/harness/" in broken, broken
