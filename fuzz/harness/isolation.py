"""The rules of a process that runs examples in isolation (a campaign's worker, an isolated replay's child), which
the campaign's workers and supervisor read and :func:`kvfuzz.fuzz.harness.run.run_kernel` follows: a stop request
(:data:`STOP`), the exit statuses such a process ends itself with when its GPU is unusable
(:data:`DEVICE_ERROR_EXIT`, 86) or the CUDA MPS server refuses it (:data:`MPS_BUSY_EXIT`, 87), and how a CUDA
error is told to be one of those (:func:`leaves_device_unusable`, :data:`MPS_NOT_READY`). The parent classifies
the endings (kvfuzz.fuzz.campaign.workers.endings). No torch import: the errors are read by their text."""

from __future__ import annotations

import os
import sys
import threading

#: Set when this process was asked to stop (SIGTERM, Ctrl-C): a KeyboardInterrupt then means "stop", not "the
#: kernel raised". The campaign sets it from its signal handlers and checks it at every example.
STOP = threading.Event()

#: Set in a process that exists to run examples in isolation (a campaign's worker, an isolated replay's child).
#: There a kernel error that leaves the device unusable ends the process (:data:`DEVICE_ERROR_EXIT`) instead of
#: becoming a finding in it: every later CUDA call of the process would fail, and the next example, its shrink
#: and its replay would be blamed on kvfuzz's prepare instead of on the kernel that broke the device.
ISOLATED = threading.Event()
#: The exit status of an isolated process whose kernel left the device unusable (read by
#: kvfuzz.fuzz.campaign.workers.endings as a kernel crash, "CUDA error").
DEVICE_ERROR_EXIT = 86
#: CUDA's sticky errors (cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert,
#: cudaErrorMisalignedAddress, cudaErrorIllegalInstruction, ...): after one, every call of the process's CUDA
#: context fails. Matched in the error text torch raises (torch.AcceleratorError, a RuntimeError,
#: "CUDA error: an illegal memory access was encountered"). Errors that leave the context usable (an invalid
#: launch configuration, out of memory) stay findings of the example, as before.
STICKY_DEVICE_ERRORS = ("illegal memory access", "unspecified launch failure", "device-side assert",
                        "misaligned address", "illegal instruction", "hardware stack error", "uncorrectable ECC")


def leaves_device_unusable(error: BaseException) -> bool:
    """Whether a kernel's exception is one of CUDA's sticky errors (:data:`STICKY_DEVICE_ERRORS`), after which
    the process's CUDA context is unusable."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(m in text for m in STICKY_DEVICE_ERRORS)


#: The exit status of an isolated process that could not reach its GPU because the CUDA MPS server was not
#: accepting clients (:data:`MPS_NOT_READY`): after one client's fault, the server refuses new clients until every
#: client it ended has exited. Nobody's fault: the parent runs the example again in a new process.
MPS_BUSY_EXIT = 87
#: CUDA error 807 (cudaErrorMpsServerNotReady), as torch words it.
MPS_NOT_READY = "MPS server is not ready"


def exit_if_mps_busy(error: BaseException) -> None:
    """In an isolated process (:data:`ISOLATED`), end it with :data:`MPS_BUSY_EXIT` when ``error`` says the MPS
    server is not accepting clients (:data:`MPS_NOT_READY`); returns otherwise."""
    if ISOLATED.is_set() and MPS_NOT_READY in str(error):
        print(f"kvfuzz: the CUDA MPS server is not accepting clients yet; ending this process\n{error}",
              file=sys.stderr, flush=True)
        os._exit(MPS_BUSY_EXIT)


def exit_if_device_unusable(error: BaseException, where: str, text: str | None = None) -> None:
    """In an isolated process (:data:`ISOLATED`), end it with :data:`DEVICE_ERROR_EXIT` when ``error`` left the
    device unusable (:func:`leaves_device_unusable`), after printing ``text`` (default: the error) to stderr;
    ``where`` names who raised it ("the kernel", "kvfuzz's prepare"). The parent classifies the ending by the
    example's phase (kvfuzz.fuzz.campaign.workers.endings). Under CUDA MPS one client's fault ends every client of
    the GPU, so an error in kvfuzz's own phases can be another worker's kernel fault: the supervisor re-runs such an
    example before it blames anyone. Returns otherwise."""
    exit_if_mps_busy(error)
    if ISOLATED.is_set() and leaves_device_unusable(error):
        print(f"kvfuzz: {where} left the device unusable; ending this process\n{text or error}", file=sys.stderr,
              flush=True)
        os._exit(DEVICE_ERROR_EXIT)


__all__ = ["DEVICE_ERROR_EXIT", "ISOLATED", "MPS_BUSY_EXIT", "MPS_NOT_READY", "STICKY_DEVICE_ERRORS", "STOP",
           "exit_if_device_unusable", "exit_if_mps_busy", "leaves_device_unusable"]
