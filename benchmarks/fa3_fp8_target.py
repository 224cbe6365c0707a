"""FlashAttention 3 with fp8 KV caches only: ``vllm.flash_attn_varlen``'s declaration narrowed to its fp8 part
(kv_cache_dtype fp8/fp8_e4m3, bf16, the fp8 head sizes), so a campaign spends all its time there. A kvfuzz adapter,
loaded by file as a user loads theirs:

    kvfuzz fuzz --target benchmarks/fa3_fp8_target.py:FA3Fp8 --duration 5m --baseline kvfuzz-baseline.toml

(run on a lent H200 beside a default FA3 campaign, with `--baseline`: benchmarks/results/fa3-fp8-h200.txt).
"""

import attrs

from kvfuzz.fuzz.targets.vllm_flash_attn import VllmFlashAttnVarlen


class FA3Fp8(VllmFlashAttnVarlen):
    """``vllm.flash_attn_varlen`` (FA3 as vLLM's FLASH_ATTN backend calls it) drawing fp8 caches only."""

    name = "vllm.flash_attn_varlen.fp8"
    description = "FlashAttention 3, fp8 KV caches only (benchmarks/fa3_fp8_target.py)"
    capabilities = attrs.evolve(
        VllmFlashAttnVarlen.capabilities, dtypes=("bfloat16",), kv_cache_dtypes=("fp8", "fp8_e4m3"),
        head_sizes=VllmFlashAttnVarlen.capabilities.head_sizes_for("fp8"))
