"""CUDA MPS for a campaign's workers: one private MPS control daemon, so the workers sharing a GPU run their
kernels concurrently instead of time-slicing one CUDA context after another.

Without MPS every worker process has its own CUDA context and the GPU switches between them: measured on a lent
H100 (16 cores, vllm.unified_attention, warm Triton cache, benchmarks/gpu_scaling.sh, 45 s runs), 8 workers ran
161 examples/s and 16 workers only 187/s, each example waiting ~10 ms in the kernel call for 0.5 ms of kernel;
under MPS 8 workers ran 210/s and 14 workers 296/s (benchmarks/results/gpu-scaling-mps-h100.txt).

The daemon is the user's own (``nvidia-cuda-mps-control -d``, no root needed), its pipe and log folders in a
fresh ``/tmp/kvfuzz-mps-*`` folder (not under ``$TMPDIR``: the pipe is a Unix socket, whose path must be
short), announced to the workers through
``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` in this process's environment (spawned workers
inherit it), and told ``quit`` when the campaign ends. A campaign started under an MPS daemon the user runs
(``CUDA_MPS_PIPE_DIRECTORY`` already set) uses that one and starts none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import attrs

#: The MPS control program (NVIDIA's driver utilities put it on PATH next to nvidia-smi).
CONTROL = "nvidia-cuda-mps-control"
#: --mps values: auto (on CUDA when CONTROL is on PATH), on (fail when it cannot start), off.
MODES = ("auto", "on", "off")
ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
#: The pipe folders of per-GPU daemons (comma-separated, one per GPU index of the campaign): a worker on GPU ``i``
#: sets ``CUDA_MPS_PIPE_DIRECTORY`` to the ``i``-th (kvfuzz.fuzz.campaign.workers.worker).
PIPES_ENV = "KVFUZZ_MPS_PIPES"
#: Set (to "1") while one daemon kvfuzz started serves all the campaign's GPUs: it was started with the campaign's
#: ``CUDA_VISIBLE_DEVICES``, so it sees only those devices and a client names its GPU by its index among them ("0"
#: for a campaign on device "3"; the physical "3" is no device of that server: "No CUDA GPUs are available").
SHARED_ENV = "KVFUZZ_MPS_SHARED"
#: Environment: ``KVFUZZ_MPS_PER_GPU=0`` starts one daemon for all GPUs instead of one per GPU (a before/after for
#: benchmarks/gpu_multi_scaling.sh).
PER_GPU_ENV = "KVFUZZ_MPS_PER_GPU"


def visible_devices(gpus: int, env=None) -> list[str]:
    """The CUDA device of each GPU index ``0 .. gpus - 1`` of the campaign, as ``CUDA_VISIBLE_DEVICES`` names it:
    the entries of ``env``'s (default this process's) own ``CUDA_VISIBLE_DEVICES`` when it is set (a campaign on
    GPUs 2,3 puts its GPU 0 on device "2"), else the indices themselves."""
    env = os.environ if env is None else env
    mine = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return [mine[i] if i < len(mine) else str(i) for i in range(gpus)]


class MpsError(RuntimeError):
    """The MPS daemon could not be started (``--mps on``: the campaign cannot run as asked, exit 3)."""


@attrs.define
class Mps:
    """What a campaign decided about MPS: ``active`` (its workers run under a daemon), ``started`` (kvfuzz
    started that daemon and stops it in :meth:`stop`), ``note`` (one line for the console: why not, or which
    daemon), and the folder of a daemon kvfuzz started."""

    active: bool = False
    started: bool = False
    note: str = ""
    folder: Path | None = None
    _saved_env: dict = attrs.Factory(dict)
    #: pipe folders of the per-GPU daemons kvfuzz started (empty: one daemon, ``folder/pipe``)
    pipes: list = attrs.Factory(list)

    def stop(self) -> None:
        """Tell a daemon kvfuzz started to quit, restore the environment and remove its folder (idempotent; errors
        of a daemon already gone are ignored)."""
        if not self.started:
            return
        self.started = self.active = False
        for pipe in self.pipes or [None]:
            env = os.environ.copy() if pipe is None else {**os.environ, ENV[0]: str(pipe)}
            try:
                subprocess.run([CONTROL], input=b"quit\n", env=env, timeout=30,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            except (OSError, subprocess.SubprocessError):
                pass
        os.environ.pop(PIPES_ENV, None)
        os.environ.pop(SHARED_ENV, None)
        for name in ENV:
            if self._saved_env.get(name) is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = self._saved_env[name]
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def start_mps(mode: str, gpus: int) -> Mps:
    """Start a private MPS daemon for a campaign on ``gpus`` CUDA devices, as ``mode`` (:data:`MODES`) asks.

    Returns an :class:`Mps` (``active`` False with its reason when MPS is off, there is no GPU, the control
    program is missing or would not start under ``auto``). Raises MpsError under ``mode == "on"`` when it cannot
    start, and ValueError for an unknown mode. Sets ``CUDA_MPS_PIPE_DIRECTORY``/``CUDA_MPS_LOG_DIRECTORY`` in
    ``os.environ`` for the workers while active; :meth:`Mps.stop` undoes it."""
    if mode not in MODES:
        raise ValueError(f"--mps must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return Mps(note="MPS off (--mps off)")
    if not gpus:
        if mode == "on":
            raise MpsError("--mps on: no CUDA device here (MPS shares a GPU between the workers)")
        return Mps(note="")
    if os.environ.get(ENV[0]):
        return Mps(active=True, note=f"under the MPS daemon of {ENV[0]}={os.environ[ENV[0]]}")
    control = shutil.which(CONTROL)
    if control is None:
        why = f"{CONTROL} is not on PATH"
        if mode == "on":
            raise MpsError(f"--mps on: {why}")
        return Mps(note=f"no MPS ({why}): the workers time-slice the GPU")
    # under /tmp, not $TMPDIR: the pipe is a Unix socket, whose path must stay under ~100 bytes
    folder = Path(tempfile.mkdtemp(prefix="kvfuzz-mps-", dir="/tmp" if os.path.isdir("/tmp") else None))
    env = {ENV[0]: str(folder / "pipe"), ENV[1]: str(folder / "log")}
    # several GPUs: one daemon per GPU (its own pipe, CUDA_VISIBLE_DEVICES its GPU), so each GPU's clients have an
    # MPS server of their own (issue 40: two H200s under one daemon ran 1.55x one H200, not 2x)
    per_gpu = gpus > 1 and os.environ.get(PER_GPU_ENV, "1") != "0"
    daemons = [({ENV[0]: str(folder / f"pipe{i}"), ENV[1]: str(folder / f"log{i}"), "CUDA_VISIBLE_DEVICES": dev})
                for i, dev in enumerate(visible_devices(gpus))] if per_gpu else [env]
    started: list[dict] = []
    failed = None
    for d_env in daemons:
        for name in ENV:
            Path(d_env[name]).mkdir()
        try:
            done = subprocess.run([control, "-d"], env={**os.environ, **d_env}, timeout=30, capture_output=True)
            failed = done.returncode != 0 and (done.stderr or done.stdout).decode(errors="replace").strip() \
                or (done.returncode != 0 and f"exit status {done.returncode}")
        except (OSError, subprocess.SubprocessError) as e:
            failed = f"{type(e).__name__}: {e}"
        if failed:
            break
        started.append(d_env)
    if failed:
        if per_gpu and started:  # quit the daemons of the GPUs before the one that failed
            Mps(started=True, pipes=[d[ENV[0]] for d in started]).stop()
        shutil.rmtree(folder, ignore_errors=True)
        why = f"{CONTROL} -d failed: {str(failed).splitlines()[0][:200]}"
        if mode == "on":
            raise MpsError(f"--mps on: {why}")
        return Mps(note=f"no MPS ({why}): the workers time-slice the GPU")
    note = (f"MPS daemons started for the workers, one per GPU ({folder})" if per_gpu
            else f"MPS daemon started for the workers ({folder})")
    mps = Mps(active=True, started=True, note=note, folder=folder,
              saved_env={name: os.environ.get(name) for name in ENV},
              pipes=[d[ENV[0]] for d in daemons] if per_gpu else [])
    # this process (and a worker without a GPU index) sees GPU 0's daemon; a worker on GPU i picks pipe i
    os.environ.update({ENV[0]: daemons[0][ENV[0]], ENV[1]: daemons[0][ENV[1]]})
    if per_gpu:
        os.environ[PIPES_ENV] = ",".join(mps.pipes)
    else:
        os.environ[SHARED_ENV] = "1"
    return mps


__all__ = ["CONTROL", "MODES", "PER_GPU_ENV", "PIPES_ENV", "SHARED_ENV", "Mps", "MpsError", "start_mps",
           "visible_devices"]
