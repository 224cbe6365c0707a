"""Helpers shared by the test modules: ``from support import ...`` (pyproject.toml puts tests/ on pytest's
``pythonpath``). The planted and broken adapters beside this file are loaded as users load theirs, by file
(:data:`SUPPORT` / "planted_endings.py" ``:CLASS``), or imported as ``support.<module>``."""

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvfuzz.fuzz.targets import get_target

#: The repository root: the working directory of every kvfuzz command a test runs, unless it names another, so
#: that a test does not depend on where pytest was started (``kvfuzz check`` reads ``regressions/`` from it).
ROOT = Path(__file__).resolve().parents[2]
#: This folder: the planted adapters (planted_*.py, broken_kernels.py) and stand-ins live here.
SUPPORT = Path(__file__).resolve().parent
#: The kvfuzz command, run as a user would but with this interpreter (the test environment's kvfuzz).
KVFUZZ = [sys.executable, "-m", "kvfuzz.fuzz.cli"]


def benchmark_script(name: str):
    """``benchmarks/NAME.py`` loaded as a module (the folder is no package: its scripts run from a checkout), for a
    test of a benchmark script's functions."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_benchmark(name: str, *args, timeout=600) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME.py ARGS`` from the checkout with this interpreter, output captured as text."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def kvfuzz(*args, cwd=ROOT, env=None, timeout=600, input=None) -> subprocess.CompletedProcess:
    """Run ``kvfuzz ARGS`` in a child process and wait for it: stdout and stderr captured as text.

    ``args`` may be paths (passed as ``str``). ``env`` is the child's whole environment (as for
    :func:`subprocess.run`; ``None`` inherits this one), ``input`` its stdin, ``timeout`` seconds before
    :class:`subprocess.TimeoutExpired` (generous: a test on a busy machine must not fail on time alone)."""
    return subprocess.run([*KVFUZZ, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout, input=input)


def start_kvfuzz(*args, cwd=ROOT, env=None, stderr=subprocess.PIPE, new_session=False) -> subprocess.Popen:
    """Start ``kvfuzz ARGS`` in a child process without waiting (to signal or kill it mid-run): stdout piped as
    text, stderr piped apart or, with ``stderr=subprocess.STDOUT``, into stdout; ``new_session``: in a process
    group of its own, to signal the group as a terminal's Ctrl-C does (``os.killpg``), with SIGINT's default action
    as a terminal's foreground job has it (a suite run as a background job of a shell, ``pytest &``, passes SIGINT
    ignored to its children, and Python keeps it ignored). The caller waits for it."""
    return subprocess.Popen([*KVFUZZ, *map(str, args)], stdout=subprocess.PIPE, stderr=stderr, text=True,
                            cwd=cwd, env=env, start_new_session=new_session,
                            preexec_fn=_foreground_signals if new_session else None)


def _foreground_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def available(target, *args):
    """The target ``target`` (a registered name, or a Target class instantiated with ``args``), or skip the test,
    naming why it cannot run here."""
    t = get_target(target) if isinstance(target, str) else target(*args)
    a = t.availability()
    if not a.ok:
        pytest.skip(f"{t.name} unavailable: {a.reason}")
    return t


def campaign_outcomes(out: Path) -> list:
    """Each example's labels, failure signature, agreement ratio and KV tokens, in order, in a 40-example
    vllm.cpu_attention campaign of seed 5 (zeros poison) writing under ``out``: two runs that must draw and decide
    alike (a Hypothesis internal replaced or not) compare these lists."""
    from kvfuzz.contracts.model.poison import Poison
    from kvfuzz.fuzz.campaign import engine
    from kvfuzz.fuzz.campaign.config import CampaignConfig

    seen = []
    end = engine._Counting.end

    def recording(self, target, outcome):
        seen.append((sorted(outcome.labels.items()), outcome.signature, repr(outcome.ratio), outcome.kv_tokens))
        end(self, target, outcome)

    engine._Counting.end = recording
    try:
        engine.fuzz_target(get_target("vllm.cpu_attention"), CampaignConfig(out=out, max_examples=40,
                                                                           poisons=(Poison.ZEROS,), seed=5))
    finally:
        engine._Counting.end = end
    return seen


def batch_of(lens, *, block_size=16, spare=0, reverse=False, pad_columns=0, **kw):
    """:func:`kvfuzz.contiguous_batch` of ``(query_len, ctx_len)`` pairs: sequence after sequence, each its
    ceil(seq_len / block_size) blocks. ``spare``: unused blocks past them; ``reverse``: block ids handed out from the
    highest down (the same table, mirrored ids); ``pad_columns``: extra all-zero columns in every row. ``kw``: any
    other Batch field. The conftest's ``make_batch`` fixture is this with its own defaults."""
    from kvfuzz.contracts.model.batch import contiguous_batch

    return contiguous_batch([q for q, _ in lens], [c for _, c in lens], block_size=block_size, spare_blocks=spare,
                            reverse=reverse, pad_columns=pad_columns, **kw)
