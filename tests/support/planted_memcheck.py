"""A torch paged-attention kernel with a planted out-of-bounds read that only a memory checker sees, and a
stand-in for compute-sanitizer that runs the program (tests/fuzz/harness/test_sanitizer.py).

:class:`HalfTileOverrun` computes the right output (it is :class:`~kvfuzz.fuzz.bench.paged_torch.PagedTorch`) but,
like vLLM#56862's unified_attention (a block-table entry loaded past the row on the final tile), "reads" past its
block table whenever a sequence's seq_len is even: in a sanitized child (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, as
kvfuzz.fuzz.harness.sanitizer sets it) it prints the access as compute-sanitizer memcheck would.
:data:`FAKE_SANITIZER` is a compute-sanitizer that runs its program, passes its output through and ends with an
``ERROR SUMMARY`` counting the invalid accesses printed.
"""

import os

from kvfuzz.fuzz.bench.paged_torch import PagedTorch

ACCESS = """========= Invalid __global__ read of size 4 bytes
=========     at kernel_half_tile+0x40 in /planted/half_tile.py:7
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f0000000204 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f0000000200 of size 4 bytes
========="""

FAKE_SANITIZER = """#!{python}
import subprocess, sys
args = sys.argv[1:]
program = args[args.index({python!r}):]  # compute-sanitizer's own options come first
print("========= COMPUTE-SANITIZER", flush=True)
p = subprocess.Popen(program, stdout=subprocess.PIPE, text=True, bufsize=1)
errors = 0
for line in p.stdout:
    errors += "Invalid __global__" in line
    print(line, end="", flush=True)
p.wait()
print(f"========= ERROR SUMMARY: {{errors}} error{{'' if errors == 1 else 's'}}", flush=True)
sys.exit(p.returncode)
"""


class HalfTileOverrun(PagedTorch):
    name = "planted.half_tile_overrun"
    description = "torch paged attention, right output, an out-of-bounds read (seen by memcheck) at even seq_len"

    def run(self, call):
        out = super().run(call)
        if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1" and any(
                n % 2 == 0 for n in call.kwargs["seq_lens"].tolist()):
            print(ACCESS, flush=True)
        return out
