"""A sanitized child's warm-up: before it tells its worker it is ready, the child prepares (generates the data of and
materializes) a few tiny examples of its target without calling the kernel under test, so the torch CUDA kernels
that preparing an example uses are loaded, and instrumented by memcheck, before the first real example.

Why: under compute-sanitizer memcheck each CUDA module is loaded and instrumented at its first call (CUDA's lazy
loading), and a child's first example paid that inside the GPU's sanitized slot and the campaign's sanitizer time
share: on an H200 a child's first unified_attention example took 11.8-18.9 s, nearly all of it the child's
``materialize`` phase, where later examples took 0.12-0.28 s (docs/benchmarks.md, "Where a sanitized example's
seconds go"). The worker starts its child in the background and fuzzes unsanitized until the ready marker, so time
spent here is off the slot. The kernel under test is not called: the warm-up must not be where a memory-safety
report comes from (the parent drops what the child prints before its ready marker:
kvfuzz.fuzz.harness.sanitizer.SanitizedChild).
"""

from __future__ import annotations

import itertools
import time

import attrs

from kvfuzz.contracts.model.batch import contiguous_batch
from kvfuzz.contracts.model.example import Example

#: At most this many (dtype, kv_cache_dtype) pairs are warmed up (plus one example drawn on the device).
MAX_PAIRS = 7


def warm_pairs(capabilities) -> list[tuple[str, str]]:
    """The (``dtype``, ``kv_cache_dtype``) pairs warmed up: first a diagonal in which every declared dtype and every
    declared kv_cache_dtype occurs (each selects other torch kernels: a cast, an fp8 quantize and copy), then the
    rest of their product, in declaration order, without a dtype the cache dtype does not take (``fp8_dtypes``), at
    most :data:`MAX_PAIRS`."""
    dtypes, kvs = capabilities.dtypes, capabilities.kv_cache_dtypes
    diagonal = list(dict.fromkeys((dtypes[i % len(dtypes)], kvs[i % len(kvs)])
                                  for i in range(max(len(dtypes), len(kvs)))))
    rest = [p for p in itertools.product(dtypes, kvs) if p not in diagonal]
    return [(d, k) for d, k in diagonal + rest if d in capabilities.dtypes_for(k)][:MAX_PAIRS]


def warm_examples(capabilities) -> list[Example]:
    """Tiny examples, one for each of :func:`warm_pairs` (an fp8 cache at ``k_scale = v_scale = 0.5``): one decode
    and one 2-token prefill (two decodes on a decode-only target) after 3 cached tokens; then one decode long enough
    (at least 2**16 KV elements) that its data is drawn on the device (kvfuzz.fuzz.harness.run.reference_device).
    One query head per kv head, the first declared head and block sizes (of those the pair's kv_cache_dtype takes),
    latent where the target is (``value_head_size``). At most :data:`MAX_PAIRS` + 1 examples."""
    head_size = capabilities.head_sizes[0]
    fields = {"block_size": capabilities.block_sizes[0], "num_heads": 1, "num_kv_heads": 1, "head_size": head_size,
              "value_head_size": capabilities.value_head_size}  # a latent (MLA) target's batches are latent
    queries = [1, 1] if capabilities.decode_only else [1, 2]
    out = []
    for dtype, kv in warm_pairs(capabilities):
        scales = {} if kv == "auto" else {"k_scale": 0.5, "v_scale": 0.5}
        fit = {"head_size": (capabilities.head_sizes_for(kv) or (head_size,))[0],  # an fp8 cache's own sizes
               "block_size": (capabilities.block_sizes_for(kv) or (fields["block_size"],))[0]}
        out.append(Example(contiguous_batch(queries, [3, 3], dtype=dtype, kv_cache_dtype=kv, **scales,
                                            **{**fields, **fit})))
    long_ctx = -(-(1 << 16) // head_size)
    out.append(Example(contiguous_batch([1], [long_ctx], dtype=capabilities.dtypes[0], **fields)))
    return out


def warm_up(target, prepare=None, exact=None) -> dict:
    """Prepare each of :func:`warm_examples` for ``target`` as the child prepares a real example (``exact``: what
    makes its batch exact, the child's kvfuzz.fuzz.harness.sanitizer.exact_batch; ``prepare``: default
    :func:`kvfuzz.fuzz.harness.properties.prepare`), then wait for the device. Returns ``{"warm": seconds,
    "warm_errors": n}``, ``n`` the examples whose preparation raised (an example the target rejects: a layout that
    cannot hold it, a combination it refuses), or 1 when the examples could not be made or the device wait raised.
    Never raises an Exception: the warm-up only loads kernels, and the child serves all the same."""
    began, errors = time.perf_counter(), 0
    try:
        import torch

        if prepare is None:
            from kvfuzz.fuzz.harness.properties import prepare
        examples = warm_examples(target.capabilities)
    except Exception:  # a declaration these examples cannot be built from: nothing warmed, the child goes on
        return {"warm": time.perf_counter() - began, "warm_errors": 1}
    for example in examples:
        try:
            prepare(target, attrs.evolve(example, batch=exact(example.batch)) if exact else example)
        except Exception:  # a real example's preparation reports its own errors
            errors += 1
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:  # an asynchronous error of the warm-up; the first real example meets the device as it is
        errors += 1
    return {"warm": time.perf_counter() - began, "warm_errors": errors}


__all__ = ["MAX_PAIRS", "warm_examples", "warm_pairs", "warm_up"]
