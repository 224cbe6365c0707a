"""The anchor column of `kvfuzz bench bugs` (kvfuzz.fuzz.bench.bugs.upstream): the pytest plugin swaps the
re-injected kernel in before an upstream test file imports it, and the runner tells a suite that fails on the bug
from one that passes, and the fix's own regression tests from the tests that existed before it. The real upstream
files need CUDA; here stand-in files in a temporary tree ask which kernel they got."""

import subprocess
import sys

import pytest
from support import available

PLUGIN = "kvfuzz.fuzz.bench.bugs.upstream"

#: A stand-in test file: which functions did its imports bind, upstream's or the private re-injected copies?
PROBE = '''
import pytest
from vllm.v1.attention.ops import triton_unified_attention as attention
from vllm.v1.attention.ops.triton_attention_helpers import apply_softcap
from vllm.v1.attention.ops.triton_unified_attention import unified_attention


def _private(f):
    return getattr(f, "fn", f).__module__.startswith("kvfuzz_bug_")  # a Triton JITFunction wraps .fn


def test_softcap_does_not_overflow_on_large_scores():
    assert not _private(apply_softcap)


@pytest.mark.parametrize("case", ["0-None-32768-50.0-dtype0-None-16-128-num_heads0"])  # an id the -k selects
def test_triton_unified_attn(case):
    assert {_private(unified_attention), _private(attention.unified_attention)} == {%s}
'''


def _tree(tmp_path, body: str):
    f = tmp_path / "tests" / "kernels" / "attention" / "test_triton_unified_attention.py"
    f.parent.mkdir(parents=True)
    f.write_text(body)
    return tmp_path


def _pytest(tree, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=tree,
                          capture_output=True, text=True, timeout=600)


def test_the_plugin_swaps_kernel_and_helper_before_the_file_imports_them(tmp_path):
    available("vllm.unified_attention")
    tree = _tree(tmp_path, PROBE % "True")
    r = _pytest(tree, "-p", PLUGIN, "--kvfuzz-bug", "vllm-56579", "-k", "test_triton_unified_attn")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("kvfuzz: bug.vllm-56579 re-injected into vllm.v1.attention.ops.triton_attention_helpers, "
            "vllm.v1.attention.ops.triton_unified_attention") in r.stdout
    plain = _pytest(tree, "-k", "test_triton_unified_attn")  # without the plugin the same file gets upstream's kernel
    assert plain.returncode == 1 and "re-injected" not in plain.stdout


def test_an_unknown_bug_is_a_usage_error(tmp_path):
    r = _pytest(_tree(tmp_path, PROBE % "True"), "-p", PLUGIN, "--kvfuzz-bug", "vllm-1")
    assert r.returncode == 4 and "--kvfuzz-bug vllm-1: " in r.stderr and "bug.vllm-47305" in r.stderr, r.stderr


def test_run_upstream_separates_the_fixs_own_regression_test_from_older_tests(tmp_path):
    """The stand-in's regression test fails on the re-injected helper; its older test passes both ways: the
    suite fails, but only through the test the fix added."""
    available("vllm.unified_attention")
    from kvfuzz.fuzz.bench.bugs.upstream import run_upstream

    r = run_upstream("vllm-56579", _tree(tmp_path, PROBE % "_private(apply_softcap)"), workers=0)
    assert r["plain"]["passed"] == 2 and r["plain"]["failed"] == 0 and r["reinjected"]["injected"]
    assert r["newly_failed"] == [
        "tests.kernels.attention.test_triton_unified_attention::test_softcap_does_not_overflow_on_large_scores"]
    assert r["fails"] is True and r["fails_without_regression"] is False


def test_run_upstream_tells_an_older_test_that_fails(tmp_path, monkeypatch):
    """... from a tree named relative to the working directory, as `--tree .upstream/vllm-0.33.0` names it."""
    available("vllm.unified_attention")
    from kvfuzz.fuzz.bench.bugs.upstream import run_upstream

    _tree(tmp_path / "up", PROBE % "False")
    monkeypatch.chdir(tmp_path)
    r = run_upstream("vllm-56579", "up", workers=0)
    assert r["plain"]["failed"] == 0 and r["reinjected"]["failed"] == 2
    assert r["fails"] is True and r["fails_without_regression"] is True


def test_a_bug_without_a_runnable_file_says_why_and_a_missing_file_says_how_to_get_it(tmp_path):
    from kvfuzz.fuzz.bench.bugs.upstream import run_upstream

    r = run_upstream("sglang-2479", tmp_path)
    assert r["plain"] is None and r["fails"] is None and "SGLang runtime" in r["reading"]
    with pytest.raises(FileNotFoundError, match="make upstream-tests"):
        run_upstream("vllm-47305", tmp_path)
