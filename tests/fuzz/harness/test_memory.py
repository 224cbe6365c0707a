"""Device memory around big examples (kvfuzz.fuzz.harness.memory, kvfuzz.fuzz.campaign.runner): the size that
makes an example big, the campaign's device-memory lock, and an example that ran out of device memory outside
the kernel: run again alone on the device, a harness error only if it runs out again."""

import fcntl
import os
from pathlib import Path

import attrs
import pytest
import torch
from support.planted_targets import SdpaPaged

from kvfuzz import Batch, Poison
from kvfuzz.fuzz.campaign import engine, runner
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.harness import memory


def _batch(**kw) -> Batch:
    return Batch(query_lens=(1,), ctx_lens=(3,), num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
                 num_blocks=2, block_table=((1,),), **kw)


def test_cache_bytes_and_is_big():
    assert memory.cache_bytes(_batch(dtype="float32")) == 2 * 2 * 16 * 1 * 32 * 4
    assert memory.cache_bytes(_batch(dtype="float16")) == 2 * 2 * 16 * 32 * 2
    assert memory.cache_bytes(_batch(dtype="float16", kv_cache_dtype="fp8_e4m3")) == 2 * 2 * 16 * 32
    assert not memory.is_big(_batch(dtype="float32"))
    n = memory.BIG_EXAMPLE_BYTES // (2 * 16 * 32 * 4) + 1  # one block past 1 GiB
    assert memory.is_big(attrs.evolve(_batch(dtype="float32"), num_blocks=n))


def _try_lock(path):
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_the_device_memory_lock_admits_one_holder_at_a_time(tmp_path):
    with memory.device_memory_lock(tmp_path):
        assert not _try_lock(memory.lock_path(tmp_path))  # another open file (another worker): must wait
    assert _try_lock(memory.lock_path(tmp_path))


def test_the_device_memory_lock_is_per_gpu(tmp_path, monkeypatch):
    """A worker on GPU 1 holding its lock does not stop one on GPU 3 (each GPU's memory is its own), nor one whose
    CUDA_VISIBLE_DEVICES says 3 without KVFUZZ_DEVICE; another worker on GPU 1 waits."""
    monkeypatch.setenv("KVFUZZ_DEVICE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # under MPS every worker sees its GPU as 0
    with memory.device_memory_lock(tmp_path):
        assert not _try_lock(memory.lock_path(tmp_path, {"KVFUZZ_DEVICE": "1"}))
        assert _try_lock(memory.lock_path(tmp_path, {"KVFUZZ_DEVICE": "3"}))
        assert _try_lock(memory.lock_path(tmp_path, {"CUDA_VISIBLE_DEVICES": "3,1"}))
    assert memory.lock_path(tmp_path, {"KVFUZZ_DEVICE": "GPU-1a/2"}).name == "device-memory-gpu-GPU-1a_2.lock"
    assert memory.lock_path(tmp_path, {}).name == "device-memory-gpu-0.lock"


class _OutOfMemoryUnlessAlone(SdpaPaged):
    """Runs out of device memory building its call unless it holds the campaign's device-memory lock (as when
    other workers' big caches fill the GPU), or always (``always``)."""

    name = "planted.oom_unless_alone"
    out = None
    always = False
    attempts = 0

    def build_call(self, batch, data, cache):
        type(self).attempts += 1
        with open(memory.lock_path(self.out), "a+b") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                alone = False
            except BlockingIOError:
                alone = True  # the example holds the lock
        if self.always or not alone:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB (planted)")
        return super().build_call(batch, data, cache)


@pytest.mark.parametrize("always", [False, True])
def test_an_example_out_of_device_memory_runs_again_alone(tmp_path, always, monkeypatch):
    monkeypatch.setattr(runner, "OUT_OF_MEMORY_PAUSES", (0.0, 0.0, 0.0))  # the waits, not their length
    target = _OutOfMemoryUnlessAlone()
    type(target).out, type(target).always, type(target).attempts = tmp_path, always, 0
    stats = fuzz_target(target, CampaignConfig(out=tmp_path, max_examples=5, poisons=(Poison.ZEROS,), seed=1,
                                               stop_at_first_failure=True))
    if not always:  # each example: once without the lock (out of memory), once with it (passes)
        assert stats.examples == 5 and not stats.failures and target.attempts == 10
        return
    # out of memory alone on the device too, every retry: kvfuzz's, so never a finding nor a harness error; each
    # example is counted as skipped (the campaign exits 3 on it: tests/fuzz/campaign/test_memory_campaign.py)
    assert not stats.failures and stats.examples == 0
    assert stats.skipped_memory > 0 and target.attempts == stats.skipped_memory * (1 + len(runner.OUT_OF_MEMORY_PAUSES))
    assert stats.to_dict()["skipped_for_memory"] == stats.skipped_memory


class _WrongEverywhere(SdpaPaged):
    name = "planted.wrong_everywhere"

    def run(self, call):
        return super().run(call) + 1


def test_a_recorded_failure_lets_go_of_its_run(tmp_path):
    """A failure's Run (its caches: several GiB for a big-cache example) is dropped once its reproducer is written:
    kept, each worker that found one held its caches on the device for the rest of the campaign."""
    c = engine.Campaign(_WrongEverywhere(), CampaignConfig(out=tmp_path, poisons=(Poison.ZEROS,), seed=1,
                                                           structural_shrink=0))
    (record,) = c.run_chunk(0, 3)
    assert record.reproducer and (tmp_path / record.reproducer).exists() or Path(record.reproducer).exists()
    assert c.ledger.latest(record.signature)[2] is None
    assert c.runner.run is None


class _KernelOutOfMemoryUnlessAlone(SdpaPaged):
    """The kernel call itself runs out of device memory unless the example holds the device-memory lock (a user
    adapter's run() that allocates, on a GPU other workers filled), or always (``always``)."""

    name = "planted.kernel_oom_unless_alone"
    always = False
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted, in the kernel)")

    def run(self, call):
        if self.always or memory.RETRIES_OUT_OF_MEMORY.is_set():
            raise self.error
        return super().run(call)


@pytest.mark.parametrize("always", [False, True])
def test_a_kernel_out_of_memory_runs_again_alone(tmp_path, always, monkeypatch):
    """A kernel that ran out of device memory without the lock is re-run holding it: no finding (and no Hypothesis
    FlakyFailure from a first call that hit a full GPU). Out of memory alone on the device too, it is the
    kernel's finding."""
    monkeypatch.setattr(runner, "OUT_OF_MEMORY_PAUSES", (0.0,))
    monkeypatch.setattr(_KernelOutOfMemoryUnlessAlone, "always", always)
    stats = fuzz_target(_KernelOutOfMemoryUnlessAlone(), CampaignConfig(
        out=tmp_path, max_examples=4, poisons=(Poison.ZEROS,), seed=1, stop_at_first_failure=True,
        structural_shrink=0))
    assert not memory.RETRIES_OUT_OF_MEMORY.is_set()
    if not always:
        assert stats.examples == 4 and not stats.failures and not stats.skipped_memory
        return
    (failure,) = stats.failures.values()
    assert failure.blame == "kernel" and "OutOfMemoryError" in failure.check


def test_out_of_memory_is_told_by_type_and_by_cudas_words():
    assert memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert memory.is_out_of_memory(RuntimeError("CUDA driver error: out of memory"))  # Triton's module load
    assert memory.is_out_of_memory(RuntimeError("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'"))
    assert not memory.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not memory.is_out_of_memory(RuntimeError("the cache is out of memory order"))  # no CUDA in it
    assert not memory.is_out_of_memory(ValueError("CUDA out of memory"))
    assert not memory.device_full()  # no CUDA here: never full


STABLE_ABI_FAILURE = ('torch_call_dispatcher( "aten::new_empty", "", stack.data(), TORCH_ABI_VERSION) API call failed '
                      'at /opt/venv/lib/python3.12/site-packages/torch/include/torch/csrc/stable/ops.h, line 961')


def test_a_stable_abi_extensions_failed_allocation_counts_as_memory_only_once_cuda_is_in_use(monkeypatch):
    # FA3's words on an H100 (an 8-sequence call whose split accumulators took 7.9 GB beside 15 other workers)
    assert not memory.is_out_of_memory(RuntimeError(STABLE_ABI_FAILURE))  # no CUDA in use: the kernel's own error
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert memory.is_out_of_memory(RuntimeError(STABLE_ABI_FAILURE))
    other_op = STABLE_ABI_FAILURE.replace("aten::new_empty", "aten::index_select")
    assert not memory.is_out_of_memory(RuntimeError(other_op))  # not an allocation
    assert not memory.is_out_of_memory(ValueError(STABLE_ABI_FAILURE))


@pytest.mark.parametrize("full", [False, True])
def test_a_kernel_out_of_memory_on_a_device_others_filled_is_skipped_not_the_kernels(tmp_path, full, monkeypatch):
    """Triton's "CUDA driver error: out of memory" is out of memory too: re-run alone; still out of memory alone,
    it is the kernel's finding while the device has room (a kernel asking for too much), and skipped, never a
    finding, while the device is full all the same (a flex_attention call of one decode token on an H200 that
    other campaigns and a test suite had filled had been reported as a kernel crash)."""
    monkeypatch.setattr(runner, "OUT_OF_MEMORY_PAUSES", (0.0,))
    monkeypatch.setattr(_KernelOutOfMemoryUnlessAlone, "always", True)
    monkeypatch.setattr(_KernelOutOfMemoryUnlessAlone, "error", RuntimeError("CUDA driver error: out of memory"))
    monkeypatch.setattr(memory, "device_full", lambda: full)
    stats = fuzz_target(_KernelOutOfMemoryUnlessAlone(), CampaignConfig(
        out=tmp_path, max_examples=3, poisons=(Poison.ZEROS,), seed=1, stop_at_first_failure=True,
        structural_shrink=0))
    if full:
        assert not stats.failures and stats.examples == 0 and stats.skipped_memory == 3
        return
    (failure,) = stats.failures.values()
    assert failure.blame == "kernel" and "RuntimeError" in failure.check and not stats.skipped_memory


def test_an_event_outside_hypothesiss_test_is_dropped_not_raised():
    """The structural shrink runs examples outside Hypothesis's test, where hypothesis.event() raises
    InvalidArgument: an out-of-memory skip there had ended two workers on an H200 (a harness error each)."""
    import hypothesis
    from hypothesis.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        hypothesis.event("skipped: out of device memory")
    runner.note("skipped: out of device memory")  # no error


def test_releases_a_request_reaches_every_worker_of_the_gpu_and_waits_for_their_answers(tmp_path, monkeypatch):
    """memory.Releases: a worker asks; another of the same GPU gives its cache back at its next poll and answers;
    one on another GPU is not asked; the asker waits for the answer, not for a dead worker's file."""
    monkeypatch.setattr(memory, "RELEASE_WAIT_SECONDS", 0.2)
    given = []
    other = memory.Releases(tmp_path, release=lambda: given.append("other"), env={"KVFUZZ_DEVICE": "0"})
    far = memory.Releases(tmp_path, release=lambda: given.append("far"), env={"KVFUZZ_DEVICE": "1"})
    me = memory.Releases(tmp_path, release=lambda: given.append("me"), env={"KVFUZZ_DEVICE": "0"})
    assert not other.poll() and not far.poll() and given == []  # nothing asked yet
    # a live worker's answer file that has not seen the request: the asker waits, then goes on, counting it late
    (tmp_path / memory.ACK_NAME.format("0", os.getppid())).write_text("0 1")
    (tmp_path / memory.ACK_NAME.format("0", 2**22 + 7)).write_text("0 1")  # no such process: ignored
    assert me.request() == 1 and given == ["me"]
    assert not (tmp_path / memory.ACK_NAME.format("0", 2**22 + 7)).exists()  # the dead worker's file: removed
    assert other.poll() and given == ["me", "other"] and not other.poll()  # once per request
    assert not far.poll() and "far" not in given
    (tmp_path / memory.ACK_NAME.format("0", os.getppid())).write_text("1 0")  # it holds nothing now: not waited on
    assert me.request() == 0
    other.close()
    assert not (tmp_path / memory.ACK_NAME.format("0", os.getpid())).exists()


def test_releases_an_idle_worker_holds_nothing_and_a_missing_out_asks_nobody(tmp_path):
    given = []
    r = memory.Releases(tmp_path, release=lambda: given.append(1), env={})
    r.idle()
    assert given == [1] and (tmp_path / memory.ACK_NAME.format("0", os.getpid())).read_text() == "0 0"
    assert not r.poll() and (tmp_path / memory.ACK_NAME.format("0", os.getpid())).read_text() == "0 1"
    assert memory.Releases(None, release=lambda: given.append(2)).request() == 0 and given == [1, 2]


def test_releases_trim_gives_back_what_is_cached_past_the_workers_share(monkeypatch):
    """Between examples a worker keeps at most WORKER_CACHE_SHARE of the GPU over its workers cached, unused;
    nothing off CUDA."""
    given = []
    r = memory.Releases(None, release=lambda: given.append(1), workers=4)
    assert not r.trim()  # CUDA never used here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 << 30}))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 1 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: (1 << 30) + (10 << 30))  # cap: 0.5 * 80 / 4 = 10
    assert not r.trim() and given == []
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: (1 << 30) + (11 << 30))
    assert r.trim() and given == [1]


def test_footprint_says_the_caches_and_nothing_of_a_device_never_used():
    assert memory.footprint(_batch(dtype="float32")) == {"cache_bytes": memory.cache_bytes(_batch(dtype="float32"))}
