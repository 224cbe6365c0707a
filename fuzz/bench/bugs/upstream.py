"""The anchor column of ``kvfuzz bench bugs``: does the upstream project's own test file fail on the re-injected
kernel?

Two parts:

- A pytest plugin (``python -m pytest -p kvfuzz.fuzz.bench.bugs.upstream --kvfuzz-bug vllm-47305 FILE``) that,
  before any conftest or test module is imported, loads the bug's re-injected modules (:mod:`.patching`: private
  copies, the installed package is never edited) and registers them under the upstream module names in
  ``sys.modules`` and as attributes of their packages. The upstream test file's own ``from vllm.v1.attention.ops...
  import ...`` then binds the re-injected kernel; nothing in the test file changes. A line at the session's start
  names the bug and the modules swapped (a line printed even under ``-q``), so a run that did not inject is visible.
- :func:`run_upstream`: the test file (``UPSTREAM_TESTS``: the file, the ``-k`` selection, the tests the fix itself
  added) run twice in child processes from the upstream source tree, once plainly (the pinned kernel must pass)
  and once with the bug re-injected; the failures of the second run, split into the fix's own regression tests
  and the tests that existed before it.

The upstream files are never copied into this project: ``make upstream-tests`` unpacks vLLM 0.33.0's test files
from its source distribution into the ignored ``.upstream/`` folder (benchmarks/upstream_tests.sh). The files need
CUDA (their tensors are made on ``current_platform.device_type``): run them on a GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import attrs

_PLUGIN = __name__


@attrs.frozen
class UpstreamTest:
    """Bug ``bug``'s anchor: ``file`` (relative to the upstream source tree; None when no runnable file exists),
    ``select`` (pytest ``-k``: the tests that exercise the re-injected kernel), ``regression`` (substrings of the
    test ids the upstream fix itself added: a suite from before the fix did not have them), ``reading`` (what the
    file's inputs cover, from reading it, and why it cannot run when ``file`` is None)."""

    bug: str
    file: str | None
    select: str | None
    reading: str
    regression: tuple[str, ...] = ()


UPSTREAM_TESTS: dict[str, UpstreamTest] = {t.bug: t for t in (
    UpstreamTest("bug.vllm-47305", "tests/kernels/attention/test_prefix_prefill.py",
                 # of the file's 396 chunked_prefill_paged_decode tests, the fp16 ones at head size 128, MHA and
                 # the auto cache (6 on one GPU: 3 windows x causal or not); the others differ in what they draw
                 # only by dtype, head size, GQA and fp8, none of which makes the unwritten tail non-finite
                 "test_contexted_kv_attention and not alibi and not f32 and chunked_prefill_paged_decode and auto "
                 "and 128 and 1-64",
                 "the caches are zero-filled (torch.zeros) past what the test writes, so the unmasked tail loads "
                 "finite zeros: 0 x 0 hides the bug"),
    UpstreamTest("bug.vllm-56579", "tests/kernels/attention/test_triton_unified_attention.py",
                 # the fix's own test and the 12 softcap-50 cases of the grid without a window, bf16, 32768 blocks
                 "softcap_does_not_overflow or (test_triton_unified_attn[ and -None-32768-50.0-dtype0-None-16-128-)",
                 "test_triton_unified_attn draws randn queries and keys (scores of a few units, far below 88 x "
                 "softcap 50); the fix added test_softcap_does_not_overflow_on_large_scores (scores up to 1e4)",
                 regression=("test_softcap_does_not_overflow_on_large_scores",)),
    UpstreamTest("bug.vllm-47671", "tests/kernels/attention/test_triton_decode_attention.py",
                 "576",  # the 42 cases of its largest head size (576: the largest offsets); the full file is 117
                 "its caches hold 16384 tokens x 32 heads x 576 dims ~ 3e8 elements < 2**31: the int32 page offset "
                 "never wraps"),
    UpstreamTest("bug.vllm-30887", "tests/kernels/attention/test_triton_unified_attention.py",
                 # the 12 cases of the grid with window 64, no softcap, bf16, 32768 blocks
                 "test_triton_unified_attn[ and -None-32768-None-dtype0-64-16-128-",
                 "its key and value caches are randn in every block: the keys outside the window hold finite values, "
                 "and 0 x a finite V hides the missing V mask (the PR added no test)"),
    UpstreamTest("bug.sglang-2479", None, None,
                 "not runnable: SGLang 0.5.23 ships no source distribution with tests, and its "
                 "test/srt/test_triton_attention_kernels.py imports the SGLang runtime (sglang.srt.utils, "
                 "sglang.test.test_utils), which kvfuzz does not install. Read: test_decode_attention only checks "
                 "that the call runs ('TODO: correctness test'); test_grouped_decode_attention compares the normal "
                 "and grouped kernels, which share the stage-2 merge the bug is in"),
)}


def inject(bug_name: str) -> list[str]:
    """Load bug ``bug_name``'s re-injected modules and register them under the upstream names (``sys.modules``
    and the parent package's attribute); returns the upstream module names swapped. Call before the code under
    test imports them. Raises KeyError for an unknown bug, :class:`~.patching.PatchDoesNotApply` when the patch
    no longer applies, RuntimeError when the kernels' runtime cannot be prepared."""
    from kvfuzz.fuzz.bench.bugs import BUGS, get_bug

    full = bug_name if bug_name.startswith("bug.") else f"bug.{bug_name}"
    if full not in BUGS:
        raise KeyError(f"unknown bug {bug_name!r}; known: {', '.join(sorted(BUGS))}")
    bug = BUGS[full]
    get_bug(full)._prepare()  # Triton (and SGLang's kernel tree) as the target itself prepares them
    bug.kernel()  # loads the patched module and, where there is one, the kernel module's private copy
    swapped = [bug.patched_module] + ([bug.kernel_module] if bug.kernel_module else [])
    for name in swapped:
        _alias(name, sys.modules[bug.private_name(name)])
    return swapped


def _alias(name: str, module: types.ModuleType) -> None:
    import importlib

    parent, _, leaf = name.rpartition(".")
    sys.modules[name] = module
    if parent:
        setattr(importlib.import_module(parent), leaf, module)


# ---- the pytest plugin ---------------------------------------------------------------------------------------

def pytest_addoption(parser) -> None:
    parser.addoption("--kvfuzz-bug", default=None, metavar="SLUG",
                     help="kvfuzz: re-inject this upstream bug (e.g. vllm-47305) before the tests import the kernel")


def pytest_load_initial_conftests(early_config, parser, args) -> None:
    name = early_config.known_args_namespace.kvfuzz_bug
    if not name:
        return
    import pytest

    try:
        early_config._kvfuzz_bug = (name, inject(name))
    except (KeyError, ValueError, RuntimeError, FileNotFoundError) as e:
        raise pytest.UsageError(f"--kvfuzz-bug {name}: {e}") from None


def pytest_sessionstart(session) -> None:
    """Say what was swapped, even under ``-q`` (the line the runner looks for)."""
    injected = getattr(session.config, "_kvfuzz_bug", None)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if injected is not None and reporter is not None:
        name, swapped = injected
        reporter.write_line(f"kvfuzz: bug.{name.removeprefix('bug.')} re-injected into {', '.join(swapped)}")


# ---- the runner ----------------------------------------------------------------------------------------------

def _junit(path: Path) -> dict:
    """Counts and failing test ids of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    failed, passed, skipped = [], 0, 0
    for case in root.iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(tid)
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return {"tests": passed + len(failed) + skipped, "passed": passed, "failed": len(failed), "skipped": skipped,
            "failed_ids": failed}


def _pytest(tree: Path, test: UpstreamTest, bug: str | None, workers: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvfuzz-upstream-") as d:
        xml = Path(d) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree),
               f"--junitxml={xml}", test.file]
        if test.select:
            cmd += ["-k", test.select]
        if workers:
            cmd += ["-n", str(workers)]
        if bug:
            cmd += ["-p", _PLUGIN, "--kvfuzz-bug", bug]
        start = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=timeout,
                               env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        except subprocess.TimeoutExpired:
            return {"rc": None, "timed_out": True, "seconds": round(time.monotonic() - start, 1)}
        out = {"rc": p.returncode, "timed_out": False, "seconds": round(time.monotonic() - start, 1),
               "injected": f"kvfuzz: bug.{bug} re-injected" in p.stdout if bug else None}
        if xml.exists():
            out.update(_junit(xml))
        else:
            out["error"] = (p.stdout + p.stderr)[-2000:]
        return out


def run_upstream(name: str, tree: Path, workers: int = 8, timeout: float = 600.0) -> dict:
    """Bug ``name``'s upstream test file (:data:`UPSTREAM_TESTS`) in ``tree``, plainly and re-injected; returns
    ``{"bug", "file", "select", "reading", "plain", "reinjected", "fails", "fails_without_regression"}`` (the
    two runs' counts and failing ids; ``fails``: the re-injected run failed a test the plain run passed;
    ``fails_without_regression``: one of those is not among the tests the fix added). A bug without a runnable
    file gets ``plain``/``reinjected`` None. Raises FileNotFoundError when the file is not in ``tree`` (run
    ``make upstream-tests``)."""
    test = UPSTREAM_TESTS[name if name.startswith("bug.") else f"bug.{name}"]
    tree = Path(tree).resolve()  # pytest runs in it: a relative --rootdir would be read from there again
    out = {"bug": test.bug, "file": test.file, "select": test.select, "reading": test.reading,
           "regression_tests": list(test.regression), "plain": None, "reinjected": None, "fails": None,
           "fails_without_regression": None}
    if test.file is None:
        return out
    if not (Path(tree) / test.file).exists():
        raise FileNotFoundError(f"{Path(tree) / test.file} is missing: run `make upstream-tests` (or pass the "
                                "vLLM 0.33.0 source tree)")
    plain = _pytest(Path(tree), test, None, workers, timeout)
    bugged = _pytest(Path(tree), test, test.bug.removeprefix("bug."), workers, timeout)
    new = sorted(set(bugged.get("failed_ids", [])) - set(plain.get("failed_ids", [])))
    out.update(plain=plain, reinjected=bugged, newly_failed=new,
               fails=bool(new) if "failed_ids" in bugged else None,
               fails_without_regression=any(not any(r in t for r in test.regression) for t in new)
               if "failed_ids" in bugged else None)
    return out


__all__ = ["UPSTREAM_TESTS", "UpstreamTest", "inject", "pytest_addoption", "pytest_load_initial_conftests",
           "pytest_sessionstart", "run_upstream"]
