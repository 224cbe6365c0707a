"""Adapters whose kernel ends badly in every way a kernel can, on one head size out of three (64), loaded as
user adapters by path: the fault-injection suite of the campaign machinery (tests/fuzz/campaign/test_supervisor.py; also
test_replay.py, test_database.py and test_cli.py).

Every kernel call appends its pid to the file named by KVFUZZ_PLANTED_LOG (when set), before misbehaving, so a
test can count kernel calls against the campaign's example count and check every process is gone afterwards.
Correct (torch SDPA) otherwise."""

import ctypes
import os
import sys
import time
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from sdpa_paged_target import SdpaPaged  # noqa: E402

#: The head size on which the planted kernels misbehave.
BAD_HEAD = 64


def _log() -> None:
    path = os.environ.get("KVFUZZ_PLANTED_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")


class _Planted(SdpaPaged):
    """Base: logs each call, misbehaves on head size 64 (never instantiated itself: it sets no name)."""

    def misbehave(self, call) -> None:
        raise NotImplementedError

    def run(self, call):
        _log()
        if call.kwargs["query"].shape[-1] == BAD_HEAD:
            self.misbehave(call)
        return super().run(call)


class Correct(_Planted):
    name = "planted.correct"
    description = "correct SDPA that logs its calls"

    def misbehave(self, call) -> None:
        pass


class Slow(_Planted):
    name = "planted.slow"
    description = "correct SDPA taking 0.3 s per call"

    def misbehave(self, call) -> None:
        pass

    def run(self, call):
        _log()  # before the sleep: a test that kills the worker on seeing the call lands inside the kernel
        time.sleep(0.3)
        return SdpaPaged.run(self, call)


class Segfaults(_Planted):
    name = "planted.segfaults"
    description = "dereferences NULL (SIGSEGV) on head size 64"

    def misbehave(self, call) -> None:
        ctypes.string_at(0)


class Aborts(_Planted):
    name = "planted.aborts"
    description = "abort() (SIGABRT) on head size 64"

    def misbehave(self, call) -> None:
        os.abort()


class Exits0(_Planted):
    name = "planted.exits0"
    description = "os._exit(0) on head size 64"

    def misbehave(self, call) -> None:
        os._exit(0)


class Exits1(_Planted):
    name = "planted.exits1"
    description = "os._exit(1) on head size 64"

    def misbehave(self, call) -> None:
        os._exit(1)


class Exits3(_Planted):
    name = "planted.exits3"
    description = "os._exit(3) on head size 64"

    def misbehave(self, call) -> None:
        os._exit(3)


class RaisesSystemExit(_Planted):
    name = "planted.raises_system_exit"
    description = "raise SystemExit(3) on head size 64"

    def misbehave(self, call) -> None:
        raise SystemExit(3)


class RaisesRuntimeError(_Planted):
    name = "planted.raises_runtime_error"
    description = "raise RuntimeError on head size 64"

    def misbehave(self, call) -> None:
        raise RuntimeError("planted: unsupported head size 64")


#: Set once BreaksDevice's kernel has failed in this process: CUDA's sticky errors leave the context unusable,
#: so every later call of the process fails too, as this emulates on the CPU.
_DEVICE_BROKEN = []
STICKY = "CUDA error: an illegal memory access was encountered (planted)"


class BreaksDevice(_Planted):
    name = "planted.breaks_device"
    description = "raises CUDA's sticky illegal-memory-access error on head size 64; every later call fails too"

    def misbehave(self, call) -> None:
        _DEVICE_BROKEN.append(True)
        raise RuntimeError(STICKY)

    def build_call(self, batch, data, cache):  # in kvfuzz's prepare: as a dead CUDA context fails every op
        if _DEVICE_BROKEN:
            raise RuntimeError(STICKY)
        return super().build_call(batch, data, cache)


class FaultsOnce(_Planted):
    name = "planted.faults_once"
    description = ("raises CUDA's sticky illegal-memory-access error on the first kernel call of the campaign (the "
                   "file $KVFUZZ_PLANTED_MARK does not exist yet), as each MPS client of a GPU does when another "
                   "client's kernel faults; correct otherwise")

    error = STICKY

    def run(self, call):
        mark = Path(os.environ["KVFUZZ_PLANTED_MARK"])
        if not mark.exists():
            mark.touch()
            raise RuntimeError(self.error)
        return SdpaPaged.run(self, call)


class MpsBusyOnce(FaultsOnce):
    name = "planted.mps_busy_once"
    description = ("fails its first kernel call of the campaign with CUDA error 807, as a new MPS client does "
                   "while the server waits for the clients another's fault ended to exit; correct otherwise")
    error = ("CUDA error: MPS server is not ready to accept new MPS client requests (planted); Error 807: MPS "
             "server is not ready to accept new MPS client requests")


class RaisesMemoryError(_Planted):
    name = "planted.raises_memory_error"
    description = "raise MemoryError on head size 64"

    def misbehave(self, call) -> None:
        raise MemoryError("planted")


class Hangs(_Planted):
    name = "planted.hangs"
    description = "never returns on head size 64"

    def misbehave(self, call) -> None:
        while True:
            time.sleep(0.5)


class CompilesSlowly(_Planted):
    """Correct, but its first call on head size 64 in each process runs a 'ninja' (a shell script of that name that
    sleeps KVFUZZ_PLANTED_COMPILE_S seconds, default 6) as FlashInfer's JIT compile does: slow, not hung."""

    name = "planted.compiles_slowly"
    description = "a 6 s 'ninja' child on its first head-size-64 call"
    compiled = False

    def misbehave(self, call) -> None:
        if CompilesSlowly.compiled:
            return
        import subprocess
        import tempfile

        ninja = Path(tempfile.mkdtemp()) / "ninja"
        ninja.write_text(f"#!/bin/sh\nsleep {os.environ.get('KVFUZZ_PLANTED_COMPILE_S', '6')}\n")
        ninja.chmod(0o755)
        subprocess.run([str(ninja)], check=True)
        CompilesSlowly.compiled = True


class SwallowsInterrupts(_Planted):
    """Correct, but its run sleeps 0.5 s and swallows KeyboardInterrupt (as code inside a kernel library can)."""

    name = "planted.swallows_interrupt_ending"
    description = "SDPA that swallows KeyboardInterrupt"

    def misbehave(self, call) -> None:
        pass

    def run(self, call):
        try:
            time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        return super().run(call)


class BuildCallRaises(Correct):
    """The adapter's build_call raises on head size 64: the adapter's bug, never the kernel's."""

    name = "planted.build_call_raises"
    description = "an adapter whose build_call raises ValueError on head size 64"

    def build_call(self, batch, data, cache):
        if batch.head_size == BAD_HEAD:
            raise ValueError("planted: this adapter cannot build head size 64")
        return super().build_call(batch, data, cache)


class Mixed(_Planted):
    """Ends differently on different inputs (the issue's 10-minute acceptance campaign): head size 64 with one
    sequence segfaults, with more aborts; head size 128 with one sequence exits with status 1, with more raises
    SystemExit; head size 32 with block size 32 hangs. Correct otherwise."""

    name = "planted.mixed"
    description = "segfaults, aborts, exits 1, raises SystemExit or hangs depending on the input"

    def run(self, call):
        _log()
        d = call.kwargs["query"].shape[-1]
        n = len(call.kwargs["seq_lens"])
        bs = call.kwargs["key_cache"].shape[1]
        if d == 64:
            ctypes.string_at(0) if n == 1 else os.abort()
        if d == 128:
            os._exit(1) if n == 1 else (_ for _ in ()).throw(SystemExit(3))
        if d == 32 and bs == 32:
            while True:
                time.sleep(0.5)
        return SdpaPaged.run(self, call)


class CrashesWhenReshaped(_Planted):
    """Raises SystemExit (a failing example) when a used block sits at or past 2**16 elements with head size 128,
    and exits the process when one does with a smaller head size: what the structural shrink's "smaller head
    size, block ids scaled to keep their offsets" candidate is (Hypothesis lowers the head size with the ids
    kept, which ends the trigger). Block sizes 16 and 32 only, so that the scaled ids stay within the
    strategies' bounds."""

    name = "planted.crashes_when_reshaped"
    description = "SystemExit on a far block at head size 128, os._exit on one at a smaller head size"
    capabilities = attrs.evolve(SdpaPaged.capabilities, block_sizes=(16, 32))

    def run(self, call):
        _log()
        nb, bs, hkv, d = call.kwargs["key_cache"].shape
        table, seq_lens = call.kwargs["block_table"], call.kwargs["seq_lens"].tolist()
        top = max(int(table[i, : -(-n // bs)].max()) for i, n in enumerate(seq_lens))
        if top * bs * hkv * d >= 1 << 16:
            raise SystemExit(3) if d == 128 else os._exit(1)
        return SdpaPaged.run(self, call)


class ExitsWhileHypothesisShrinks(_Planted):
    """Raises SystemExit (a failing example) on a batch with a prefill at head size 128, and exits the process on
    the smallest prefill (one sequence, one head, 2 new tokens after 1 cached one: the smallest a "prefill"
    shrinks to) at head size 64, which the free draws almost never make and Hypothesis's shrink walks toward: the
    structural-first pass (sequences and lengths, the head size kept) shrinks the failure, then Hypothesis's
    shrink kills the worker."""

    name = "planted.exits_while_hypothesis_shrinks"
    description = "SystemExit on a prefill at head size 128, os._exit on the smallest prefill at head size 64"

    def run(self, call):
        _log()
        q, d = call.kwargs["query"], call.kwargs["query"].shape[-1]
        queries = (call.kwargs["query_start_loc"][1:] - call.kwargs["query_start_loc"][:-1]).tolist()
        if d == 128 and max(queries) >= 2:
            raise SystemExit(3)
        if d == BAD_HEAD and queries == [2] and q.shape[1] == 1 and call.kwargs["seq_lens"].tolist() == [3]:
            os._exit(1)
        return SdpaPaged.run(self, call)


class SkipsLastRow(Correct):
    """Leaves the output row of the batch's last query token unwritten (as a kernel with an off-by-one grid
    would): whatever torch.empty held there."""

    name = "planted.skips_last_row"
    description = "SDPA that never writes its last output row"

    def run(self, call):
        out = call.kwargs["output"]
        keep = out[-1].clone()
        super().run(call)
        out[-1] = keep
        return out


class SlowWrong(_Planted):
    """0.4 s per call, and wrong (the output plus one) on head size 64 with two sequences or more: a failure that
    Hypothesis finds in a few examples and whose shrinks (Hypothesis's, then the structural one) take minutes,
    to hold a campaign to --duration (tests/fuzz/campaign/test_duration.py)."""

    name = "planted.slow_wrong"
    description = "0.4 s per call; adds 1 to the output on head size 64 with 2+ sequences"

    def run(self, call):
        _log()
        time.sleep(0.4)
        out = SdpaPaged.run(self, call)
        return out + 1 if call.kwargs["query"].shape[-1] == BAD_HEAD and len(call.kwargs["seq_lens"]) > 1 else out


class AlwaysWrong(_Planted):
    """Wrong on every call, the output plus one: every example fails the same way, the first one drawn included, so a
    campaign started again on the same --out finds the failure again whatever it draws
    (tests/fuzz/campaign/test_found_before.py)."""

    name = "planted.always_wrong"
    description = "adds 1 to the output of every call"

    def run(self, call):
        _log()
        return SdpaPaged.run(self, call) + 1


class OutOfMemoryInPrepare(Correct):
    """kvfuzz's prepare runs out of device memory on head size 64, every time (the adapter's build_call raises
    ``torch.OutOfMemoryError``, as a GPU that other workers filled): kvfuzz's, never a finding."""

    name = "planted.out_of_memory_in_prepare"
    description = "build_call raises torch.OutOfMemoryError on head size 64"

    def build_call(self, batch, data, cache):
        if batch.head_size == BAD_HEAD:
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB (planted)")
        return super().build_call(batch, data, cache)


class PrepareFaultsTwice(Correct):
    """kvfuzz's prepare meets CUDA's sticky error twice on the same example, its first (as a bystander does, under
    CUDA MPS, each time another client's kernel faults: a shrink of that kernel faults again and again); written
    to the file $KVFUZZ_PLANTED_MARK, one line (the batch) per time. Correct otherwise."""

    name = "planted.prepare_faults_twice"
    description = "build_call raises CUDA's sticky error twice on the campaign's first example"

    def build_call(self, batch, data, cache):
        mark = Path(os.environ["KVFUZZ_PLANTED_MARK"])
        seen = mark.read_text().splitlines() if mark.exists() else []
        if not seen or (len(seen) < 2 and seen[0] == repr(batch)):
            with open(mark, "a") as f:
                f.write(repr(batch) + "\n")
            raise RuntimeError(STICKY)
        return super().build_call(batch, data, cache)


class FillsUnlessReleased(Correct):
    """A device of 10 units shared by a campaign's workers (the files of directory $KVFUZZ_PLANTED_DEVICE), with a
    caching allocator's habit: what a worker's largest example took stays held by that worker until kvfuzz gives
    its cached memory back (``release_memory``). Each worker's first example takes 6 units, every later one 1, so
    a second worker's first example finds the device full of the first's cache, though nothing is running on it:
    build_call raises ``torch.OutOfMemoryError`` (kvfuzz's own phase). Correct otherwise. Each worker's held units
    are in ``held-<pid>``; the check and the claim are one step (a lock on ``device.lock``)."""

    name = "planted.fills_unless_released"
    description = "a 10-unit device: each worker's first example caches 6 units until its memory is released"
    CAPACITY, FIRST, LATER = 10, 6, 1
    examples = 0

    def _held(self) -> Path:
        return Path(os.environ["KVFUZZ_PLANTED_DEVICE"]) / f"held-{os.getpid()}"

    def build_call(self, batch, data, cache):
        import fcntl

        import torch

        need = self.FIRST if type(self).examples == 0 else self.LATER
        device = Path(os.environ["KVFUZZ_PLANTED_DEVICE"])
        with open(device / "device.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            others = sum(int(p.read_text() or 0) for p in device.glob("held-*") if p != self._held())
            if others + need > self.CAPACITY:
                raise torch.OutOfMemoryError(f"CUDA out of memory: {need} units wanted, {others} cached by other "
                                             f"workers of a {self.CAPACITY}-unit device (planted)")
            mine = int(self._held().read_text() or 0) if self._held().exists() else 0
            self._held().write_text(str(max(mine, need)))
        type(self).examples += 1
        return super().build_call(batch, data, cache)

    def release_memory(self):
        self._held().write_text("0")
