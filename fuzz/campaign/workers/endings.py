"""Every way a process running examples can end, and whose fault each is.

A worker (or an isolated replay) runs one example at a time and tells its parent, over a pipe, which example
and which phase it is in ("prepare", "kernel", "check"). When it ends, its parent knows its exit status, whether
it said goodbye, whether the parent itself killed it (a hang, or a stop the user asked for) and what was in
flight. :func:`classify` turns that into an :class:`Ending`; :func:`finding_for` into a finding. Each
ending, how it shows, and the finding for the example in flight:

- finished: said goodbye, exit status 0. Finding: none.
- stopped: the user stopped the campaign and the parent ended the worker. Finding: none (the campaign is
  interrupted).
- hung: the parent killed it: an example ran past its timeout. Finding: phase kernel: kernel hang; else harness
  error. While a compiler runs under the process (:func:`compiler_running`: FlashInfer's JIT runs ninja and nvcc,
  Triton runs ptxas) the example is compiling, not hung: the parent gives it the timeout again, up to
  :data:`MAX_COMPILE_WAITS` times (once seen compiling, all of them: its first run may still be finishing when the
  compiler exits), and only then calls it a hang: check "compile timeout" while a compiler still runs.
- crashed: died by SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE, SIGSYS or SIGTRAP. Finding: phase kernel: kernel crash
  (the signal); else harness error.
- crashed: exited with :data:`~kvfuzz.fuzz.harness.isolation.DEVICE_ERROR_EXIT` without saying goodbye: the kernel
  (or, in prepare or check, a CUDA call of kvfuzz's) raised one of CUDA's sticky errors and the process ended
  itself, its device unusable. Finding: phase kernel: kernel crash ("CUDA error"); else harness error. Where other
  workers share its GPU (under CUDA MPS one client's fault ends them all), only after the example crashed a second
  worker too: the first time it is re-run by a new worker; in prepare or check never (re-run each time, lost after
  ``MAX_BYSTANDER_RERUNS``: the supervisor decides).
- exited: exited (any status, 0 included) without saying goodbye: ``os._exit``, ``exit()`` in C. Finding: phase
  kernel: kernel crash ("exit status N"); else harness error.
- killed: died by SIGKILL, SIGTERM, SIGINT, SIGHUP or another signal it did not raise itself (OOM killer, a user).
  Finding: none: the example is retried once in a fresh worker; killed again, it is lost.
- killed: exited with :data:`~kvfuzz.fuzz.harness.isolation.MPS_BUSY_EXIT`: the CUDA MPS server was not accepting
  clients (after another client's fault, until every client it ended has exited). Finding: none: the example runs
  again in a fresh worker, started a moment later, as often as it takes (bounded by the campaign).

A worker that ends without an example in flight (at start-up, between examples) gives no finding; the
supervisor reports it as a problem of the campaign.
"""

from __future__ import annotations

import enum
import signal
from pathlib import Path
from typing import Any

import attrs

from kvfuzz.contracts.checks.failures import Finding, HarnessError, KernelCrash, KernelHang
from kvfuzz.fuzz.harness.isolation import DEVICE_ERROR_EXIT, MPS_BUSY_EXIT
from kvfuzz.fuzz.harness.kernel_clock import COMPILERS

#: Signals a process raises on itself when code inside it breaks (a kernel's out-of-bounds access, abort()).
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT,
                           signal.SIGSYS, signal.SIGTRAP})


#: The detail of a process that ended itself because its kernel left the device unusable (harness.isolation).
DEVICE_ERROR = "CUDA error"
#: The detail of a process that found the CUDA MPS server not accepting clients (exit status
#: :data:`~kvfuzz.fuzz.harness.isolation.MPS_BUSY_EXIT`): killed from outside, in effect; its example is run again.
MPS_BUSY = "MPS server not ready"


#: How many times an example that runs past its timeout while compiling gets the timeout again (a FlashInfer
#: batch_prefill campaign, three campaigns sharing 16 cores on an H200 host, had two workers "hang" 300 s in their
#: first call of a new sliding-window specialization: its JIT compile).
MAX_COMPILE_WAITS = 4


def compiler_running(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The name of a compiler (:data:`~kvfuzz.fuzz.harness.kernel_clock.COMPILERS`: ``/proc/PID/stat``'s comm, at
    most 15 characters) among the descendants of process ``pid``, or None (none, or no
    ``/proc``). Reads each ``/proc/N/stat`` once (its comm and parent)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    try:
        entries = [d for d in proc.iterdir() if d.name.isdigit()]
    except OSError:
        return None
    for d in entries:
        try:
            stat = (d / "stat").read_text()
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(rest[1]), []).append(int(d.name))
            names[int(d.name)] = comm
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    stack, seen = [pid], {pid}
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in seen:
                if names[child] in COMPILERS:
                    return names[child]
                seen.add(child)
                stack.append(child)
    return None


def compile_wait(pid: int, waits: int) -> tuple[bool, str | None]:
    """At the timeout of an example whose process is ``pid`` and that has had ``waits`` compile waits: whether it
    gets the timeout again (a compiler runs under it, or one did at an earlier timeout: its first run may not have
    returned the moment the compiler exits; at most :data:`MAX_COMPILE_WAITS` waits), and the compiler running now
    (None: none). The one rule of a campaign's supervisor and of ``kvfuzz replay``."""
    tool = compiler_running(pid)
    return (tool is not None or waits > 0) and waits < MAX_COMPILE_WAITS, tool


class EndingKind(enum.Enum):
    FINISHED = "finished"
    STOPPED = "stopped"
    HUNG = "hung"
    CRASHED = "crashed"
    EXITED = "exited"
    KILLED = "killed"


@attrs.frozen
class Ending:
    """kind: :class:`EndingKind`. detail: the signal's name ("SIGSEGV") or "exit status N" or "timeout".
    exitcode: as multiprocessing reports it (negative: killed by that signal)."""

    kind: EndingKind
    detail: str
    exitcode: int | None

    @property
    def loses_the_example(self) -> bool:
        """Killed from outside: the example in flight did not get an answer (it is retried)."""
        return self.kind is EndingKind.KILLED


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def classify(exitcode: int | None, *, said_goodbye: bool, killed_for_hang: bool = False,
             stopping: bool = False) -> Ending:
    """The ending of a process that exited with ``exitcode`` (multiprocessing's: negative for a signal)."""
    if killed_for_hang:
        return Ending(EndingKind.HUNG, "timeout", exitcode)
    if said_goodbye and exitcode == 0:
        return Ending(EndingKind.FINISHED, "exit status 0", exitcode)
    if exitcode is not None and exitcode < 0:
        sig = -exitcode
        if sig in CRASH_SIGNALS:
            return Ending(EndingKind.CRASHED, signal_name(sig), exitcode)
        if stopping:
            return Ending(EndingKind.STOPPED, signal_name(sig), exitcode)
        return Ending(EndingKind.KILLED, signal_name(sig), exitcode)
    if stopping and said_goodbye:
        return Ending(EndingKind.STOPPED, f"exit status {exitcode}", exitcode)
    if exitcode == DEVICE_ERROR_EXIT and not said_goodbye:
        return Ending(EndingKind.CRASHED, DEVICE_ERROR, exitcode)
    if exitcode == MPS_BUSY_EXIT and not said_goodbye:
        return Ending(EndingKind.KILLED, MPS_BUSY, exitcode)
    return Ending(EndingKind.EXITED, f"exit status {exitcode}", exitcode)


def finding_for(ending: Ending, phase: str | None, details: dict[str, Any] | None = None,
                timeout: float | None = None) -> Finding | None:
    """The finding for the example that was in flight in ``phase`` when the process ended this way, or None
    (finished, stopped, killed from outside, or nothing in flight). The check names the ending ("SIGSEGV",
    "exit status 1", "timeout"), so distinct endings are distinct failures."""
    if phase is None or ending.kind in (EndingKind.FINISHED, EndingKind.STOPPED, EndingKind.KILLED):
        return None
    details = {"phase": phase, "exitcode": ending.exitcode, **(details or {})}
    in_kernel = phase == "kernel"
    if ending.kind is EndingKind.HUNG:
        details["timeout_s"] = timeout  # what a replay waits before it calls the same case a hang
        after = f" after {timeout:g} s" if timeout is not None else ""
        if in_kernel and details.get("compiling"):
            waited = f" after {(MAX_COMPILE_WAITS + 1) * timeout:g} s" if timeout is not None else ""
            return KernelHang("compile timeout", f"the kernel's first call was still compiling ({details['compiling']})"
                              f"{waited}; its process was killed", details)
        if in_kernel:
            return KernelHang("timeout", f"the kernel did not return{after}; its process was killed", details)
        return HarnessError(f"hung in {phase}", f"the process hung outside the kernel call (in {phase}){after}: "
                            "kvfuzz or the target's adapter is stuck, not the kernel", details)
    how = ("ended itself: a CUDA error left its device unusable (the worker log has the error)"
           if ending.detail == DEVICE_ERROR else f"died by {ending.detail}" if ending.kind is EndingKind.CRASHED
           else f"exited ({ending.detail}) without finishing")
    if in_kernel:
        return KernelCrash(ending.detail, f"the process {how} while the kernel was running", details)
    return HarnessError(f"{ending.detail} in {phase}", f"the process {how} outside the kernel call (in {phase}): "
                        "kvfuzz or the target's adapter, not the kernel", details)


__all__ = ["CRASH_SIGNALS", "DEVICE_ERROR", "MAX_COMPILE_WAITS", "MPS_BUSY", "Ending", "EndingKind",
           "classify", "compile_wait", "compiler_running", "finding_for", "signal_name"]
