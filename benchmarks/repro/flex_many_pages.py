"""torch's experimental PagedAttention at many pages, without kvfuzz: one decode (ctx 0), 16 heads over 4, D 128,
bf16, page 64, its one page the last of N pages; builds the logical block mask, converts it
(``convert_logical_block_mask``) and runs compiled ``flex_attention`` with vLLM's kernel options. On an H200
(2026-11-29, benchmarks/results/sweep-baseline-h200.txt) it passed at 1,000, 65,535, 65,536, 65,537 and 70,000 pages,
so the "CUDA error in prepare" a torch.flex_paged campaign met at 65,537 pages was kvfuzz's own (its materializer).
Usage: python3 benchmarks/repro/flex_many_pages.py N [cuda|cpu]  (each N in its own process: a CUDA error is sticky)
Prints one line: ok (and whether the output is finite), or the stage that failed and the error."""
import sys
import traceback

import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

n_pages = int(sys.argv[1])
dev = sys.argv[2] if len(sys.argv) > 2 else "cuda"
page, H, Hkv, D = 64, 16, 4, 128
stage = "paged"
try:
    pa = PagedAttention(n_pages, page, 1, device=dev)
    last = n_pages - 1
    pa.page_table[0, 0] = last
    pa.physical_to_logical[0, last] = 0
    pa.capacity[0] = page
    stage = "create_block_mask"
    def mask_mod(b, h, q, kv):
        return kv <= q
    logical = create_block_mask(mask_mod, 1, None, 1, page, device=dev, BLOCK_SIZE=(16, page))
    stage = "convert_logical_block_mask"
    bm = pa.convert_logical_block_mask(logical, torch.arange(1, device=dev), torch.tensor([1], device=dev))
    if dev == "cuda":
        torch.cuda.synchronize()
    stage = "flex_attention"
    q = torch.randn(1, H, 1, D, dtype=torch.bfloat16, device=dev)
    k = torch.randn(1, Hkv, n_pages * page, D, dtype=torch.bfloat16, device=dev)
    fn = torch.compile(flex_attention) if dev == "cuda" else flex_attention
    out = fn(q, k, k, block_mask=bm, enable_gqa=True,
             kernel_options={"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": page})
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"n_pages {n_pages}: ok, out finite {bool(out.isfinite().all())}")
except Exception as e:
    print(f"n_pages {n_pages}: FAILED in {stage}: {type(e).__name__}: {str(e)[:300]}")
    traceback.print_exc(limit=-4)
