"""A worker's host heap between tasks (kvfuzz.fuzz.campaign.workers.worker.trim_heap): under the worker's malloc
settings a freed block stays in the heap, so the largest example a worker ever ran would set its RSS for the rest
of its life (issue 49's soak); between tasks, freed heap resident beyond HEAP_KEEP goes back to the system. Each
case runs in a child process: the malloc settings are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvfuzz.fuzz.campaign.workers import worker

#: What a big example does in a tuned worker: a block of ``argv[1]`` MiB allocated, written and freed, with a small
#: block allocated after it that stays (so the freed block is inside the heap, below its top); then
#: trim_heap(keep = ``argv[2]`` MiB). Prints the RSS before and after the trim, whether it trimmed, and the faults
#: that writing the same block again takes.
HEAP_PROBE = """
import ctypes, json, resource, sys
from pathlib import Path
from kvfuzz.fuzz.campaign.workers.worker import heap_retained, trim_heap, tune_malloc
if not tune_malloc() or heap_retained() is None:
    print(json.dumps(None)); sys.exit(0)
def rss():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssAnon:"))
    return int(line.split()[1]) >> 10
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = int(sys.argv[1]) << 20
big = libc.malloc(size)
ctypes.memset(big, 1, size)
small = libc.malloc(4096)  # stays: the freed block is not the heap's top
libc.free(big)
before = rss()
trimmed = trim_heap(int(sys.argv[2]) << 20)
after = rss()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
again = libc.malloc(size)
ctypes.memset(again, 1, size)
print(json.dumps({"before": before, "after": after, "trimmed": trimmed,
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}))
"""


def _probe(block_mib: int, keep_mib: int) -> dict:
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE, str(block_mib), str(keep_mib)], capture_output=True,
                         text=True, check=True, timeout=120)
    result = json.loads(out.stdout)
    if result is None:
        pytest.skip("the C library is not glibc 2.33 or later (no mallinfo2)")
    return result


def test_freed_heap_past_the_bound_goes_back_between_tasks():
    """A 300 MiB block freed inside the heap stays resident under the worker's settings; past HEAP_KEEP (64 MiB
    here) trim_heap gives it back, and writing it again faults its pages in anew."""
    r = _probe(300, 64)
    assert r["before"] >= 300 and r["trimmed"], r
    assert r["before"] - r["after"] >= 250, r
    assert r["faults"] > 250 * 256 // 2, r  # 4 KiB pages (huge pages would take fewer): the pages were given back


def test_freed_heap_within_the_bound_stays_for_the_next_example():
    """Under the bound nothing is given back: the next example reuses the freed block without faulting."""
    r = _probe(100, 256)
    assert not r["trimmed"] and r["before"] - r["after"] < 10, r
    assert r["faults"] < 1000, r


def test_no_glibc_no_trim(monkeypatch):
    """Where heap_retained cannot tell (not glibc, no /proc), trim_heap does nothing and says so."""
    monkeypatch.setattr(worker, "heap_retained", lambda: None)
    assert worker.trim_heap(0) is False
