"""A sanitized child's warm-up: before it tells its worker it is ready, the child prepares (generates the data of and
materializes) a few tiny examples of its target without calling the kernel under test, so the torch CUDA kernels
that preparing an example uses are loaded, and instrumented by memcheck, before the first real example.

Why: under compute-sanitizer memcheck each CUDA module is loaded and instrumented at its first call (CUDA's lazy
loading), and a child's first example paid that inside the GPU's sanitized slot and the campaign's sanitizer time
share: on an H200 a child's first unified_attention example took 11.8-18.9 s, nearly all of it the child's
``materialize`` phase, where later examples took 0.12-0.28 s (docs/benchmarks.md, "Where a sanitized example's
seconds go"). The worker starts its child in the background and fuzzes unsanitized until the ready marker, so time
spent here is off the slot. The kernel under test is not called: the warm-up must not be where a memory-safety
report comes from (nothing the parent reads before the ready marker is attributed to an example).
"""

from __future__ import annotations

import time

from kvfuzz.contracts.model.batch import contiguous_batch
from kvfuzz.contracts.model.example import Example


def warm_examples(capabilities) -> list[Example]:
    """Tiny examples covering what selects different preparation kernels: one decode and one 2-token prefill (two
    decodes on a decode-only target) after 3 cached tokens for each declared ``dtype`` x ``kv_cache_dtype`` (up to
    two of each; fp8 caches quantize and copy with other kernels; an fp8 cache at ``k_scale = v_scale = 0.5``), and
    one decode long enough (at least 2**16 KV elements) that its data is drawn on the device
    (kvfuzz.fuzz.harness.run.reference_device). One query head per kv head, the first declared head and block
    sizes, latent where the target is (``value_head_size``). At most 5 examples."""
    head_size = capabilities.head_sizes[0]
    fields = {"block_size": capabilities.block_sizes[0], "num_heads": 1, "num_kv_heads": 1, "head_size": head_size,
              "value_head_size": capabilities.value_head_size}  # a latent (MLA) target's batches are latent
    queries = [1, 1] if capabilities.decode_only else [1, 2]
    out = []
    for dtype in capabilities.dtypes[:2]:
        for kv in capabilities.kv_cache_dtypes[:2]:
            scales = {} if kv == "auto" else {"k_scale": 0.5, "v_scale": 0.5}
            out.append(Example(contiguous_batch(queries, [3, 3], dtype=dtype, kv_cache_dtype=kv, **scales, **fields)))
    long_ctx = -(-(1 << 16) // head_size)
    out.append(Example(contiguous_batch([1], [long_ctx], dtype=capabilities.dtypes[0], **fields)))
    return out


def warm_up(target, prepare=None) -> dict:
    """Prepare each of :func:`warm_examples` for ``target`` (``prepare``: default
    :func:`kvfuzz.fuzz.harness.properties.prepare`), then wait for the device. Returns ``{"warm": seconds,
    "warm_errors": examples whose preparation raised}``: an example the target rejects (a layout that cannot hold
    it, a combination it refuses) costs nothing but its count, and the child serves all the same."""
    import torch

    if prepare is None:
        from kvfuzz.fuzz.harness.properties import prepare
    began, errors = time.perf_counter(), 0
    for example in warm_examples(target.capabilities):
        try:
            prepare(target, example)
        except Exception:  # the warm-up only loads kernels: a real example's preparation reports its own errors
            errors += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {"warm": time.perf_counter() - began, "warm_errors": errors}


__all__ = ["warm_examples", "warm_up"]
