"""kvfuzz.fuzz.campaign.workers.mps: the private MPS daemon of a campaign, driven through a stand-in
nvidia-cuda-mps-control on PATH that records how it was called (no GPU needed)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvfuzz.fuzz.campaign.config import MAX_WORKERS_PER_GPU, MAX_WORKERS_PER_GPU_MPS, default_workers
from kvfuzz.fuzz.campaign.workers.mps import CONTROL, ENV, MpsError, start_mps

STAND_IN = """#!/bin/sh
# records: its arguments, the pipe folder it was given, and what came on stdin
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "{log}"
if [ "$1" = "-d" ]; then exit {start_status}; fi
cat >> "{log}"
"""


def _stand_in(tmp_path: Path, monkeypatch, start_status: int = 0) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    prog = bin_dir / CONTROL
    prog.write_text(STAND_IN.format(log=log, start_status=start_status))
    prog.chmod(prog.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return log


def test_starts_a_private_daemon_and_quits_it(tmp_path, monkeypatch):
    log = _stand_in(tmp_path, monkeypatch)
    mps = start_mps("auto", gpus=1)
    assert mps.active and mps.started
    pipe = os.environ[ENV[0]]
    assert Path(pipe).is_dir() and Path(os.environ[ENV[1]]).is_dir()
    assert f"args=-d pipe={pipe}" in log.read_text()
    mps.stop()
    calls = log.read_text()
    assert f"args= pipe={pipe}" in calls and "quit" in calls  # quit went to the same daemon
    assert ENV[0] not in os.environ and ENV[1] not in os.environ  # the environment is restored
    assert not Path(pipe).exists()
    mps.stop()  # idempotent: no second quit
    assert log.read_text().count("quit") == 1


def test_auto_without_the_program_or_a_gpu_runs_without_mps(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control
    monkeypatch.delenv(ENV[0], raising=False)
    mps = start_mps("auto", gpus=1)
    assert not mps.active and "not on PATH" in mps.note
    assert not start_mps("auto", gpus=0).active
    with pytest.raises(MpsError, match="not on PATH"):
        start_mps("on", gpus=1)
    with pytest.raises(MpsError, match="no CUDA device"):
        start_mps("on", gpus=0)


def test_a_daemon_that_will_not_start(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, start_status=3)
    mps = start_mps("auto", gpus=1)
    assert not mps.active and "failed" in mps.note
    assert ENV[0] not in os.environ
    with pytest.raises(MpsError, match="failed"):
        start_mps("on", gpus=1)


def test_the_users_daemon_is_used_not_started(tmp_path, monkeypatch):
    log = _stand_in(tmp_path, monkeypatch)
    monkeypatch.setenv(ENV[0], str(tmp_path / "theirs"))
    mps = start_mps("on", gpus=1)
    assert mps.active and not mps.started and "theirs" in mps.note
    mps.stop()
    assert not log.exists()  # never called: not ours to start or stop
    assert os.environ[ENV[0]] == str(tmp_path / "theirs")


def test_off_and_bad_modes(tmp_path, monkeypatch):
    log = _stand_in(tmp_path, monkeypatch)
    assert not start_mps("off", gpus=1).active
    assert not log.exists()
    with pytest.raises(ValueError):
        start_mps("sometimes", gpus=1)


def test_default_workers_under_mps():
    assert default_workers(1, cpus=16, mps=True) == 14  # 16 - 2
    assert default_workers(1, cpus=32, mps=True) == MAX_WORKERS_PER_GPU_MPS == 28  # 32 - 2, capped
    assert default_workers(2, cpus=32, mps=True) == 30  # 2 x (32 - 2) / 2: two cores for the host, not per GPU
    assert default_workers(1, cpus=16) == MAX_WORKERS_PER_GPU
    assert default_workers(2, cpus=16, mps=True) == 2 * 7
    assert default_workers(4, cpus=8, mps=True) == 4  # one per GPU at least
    assert default_workers(0, cpus=16, mps=True) == default_workers(0, cpus=16)  # no GPU: MPS changes nothing


@pytest.mark.cli_text
def test_mps_on_without_a_gpu_exits_3(tmp_path):
    from support import kvfuzz

    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--max-examples", "1", "--mps", "on",
               "--out", str(tmp_path / "out"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "--mps on: no CUDA device here" in r.stdout + r.stderr


def test_the_daemons_folder_is_short_whatever_tmpdir_is(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch)
    long_tmp = tmp_path / ("t" * 100)
    long_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    mps = start_mps("auto", gpus=1)
    try:
        assert mps.active and len(os.environ[ENV[0]]) < 100, os.environ[ENV[0]]
    finally:
        mps.stop()


def test_several_gpus_get_a_daemon_each_and_workers_their_gpus_pipe(tmp_path, monkeypatch):
    """Issue 40: two GPUs under one daemon ran 1.55x one GPU. Each GPU now gets its own daemon (its pipe folder,
    CUDA_VISIBLE_DEVICES its device: the campaign's i-th), and a worker on GPU i talks to daemon i."""
    from kvfuzz.fuzz.campaign.workers.mps import PIPES_ENV
    from kvfuzz.fuzz.campaign.workers.worker import gpu_environment

    log = _stand_in(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    mps = start_mps("auto", gpus=2)
    try:
        assert mps.active and len(mps.pipes) == 2 and "one per GPU" in mps.note
        started = [line for line in log.read_text().splitlines() if line.startswith("args=-d")]
        assert started == [f"args=-d pipe={p}" for p in mps.pipes]
        env = dict(os.environ)
        gpu_environment(1, env)
        # the daemon sees only its GPU, its clients' device 0: without the mask a client's torch counted the
        # host's 4 GPUs (NVML) against CUDA's 1 and died at lazy init ("device=1, num_gpus=1", H200 host)
        assert env["CUDA_VISIBLE_DEVICES"] == "0" and env[ENV[0]] == mps.pipes[1]
        assert env["KVFUZZ_DEVICE"] == "3"  # the physical GPU, for a child outside MPS (the sanitizer's)
    finally:
        mps.stop()
    assert log.read_text().count("quit") == 2 and PIPES_ENV not in os.environ and ENV[0] not in os.environ
    env = {}
    gpu_environment(1, env)  # no mask, no per-GPU daemons: the index itself
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "KVFUZZ_DEVICE": "1"}
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    gpu_environment(1, env)  # the campaign's own mask: its second device
    assert env == {"CUDA_VISIBLE_DEVICES": "3", "KVFUZZ_DEVICE": "3"}


def test_one_daemon_clients_name_their_gpu_by_its_index_among_the_daemons_devices(tmp_path, monkeypatch):
    """A one-GPU campaign on device "3" (CUDA_VISIBLE_DEVICES=3, as one campaign per GPU of a 4-GPU host runs):
    kvfuzz's daemon inherits that mask and sees one device, so a worker that set CUDA_VISIBLE_DEVICES=3 found "No CUDA
    GPUs are available" (every worker, H200 host). Its workers now name the server's device 0; without kvfuzz's
    daemon (MPS off) the physical device is kept."""
    from kvfuzz.fuzz.campaign.workers.mps import SHARED_ENV
    from kvfuzz.fuzz.campaign.workers.worker import gpu_environment

    _stand_in(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    mps = start_mps("auto", gpus=1)
    try:
        assert mps.active and os.environ.get(SHARED_ENV) == "1"
        env = dict(os.environ)
        gpu_environment(0, env)
        assert env["CUDA_VISIBLE_DEVICES"] == "0" and env[ENV[0]] == os.environ[ENV[0]]
        assert env["KVFUZZ_DEVICE"] == "3"
    finally:
        mps.stop()
    assert SHARED_ENV not in os.environ
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    gpu_environment(0, env)  # no daemon of kvfuzz's: the campaign's own device
    assert env == {"CUDA_VISIBLE_DEVICES": "3", "KVFUZZ_DEVICE": "3"}

