"""Does FlashAttention 3's ``get_scheduler_metadata`` accept head size 512? vLLM 0.33.0's
``FlashAttentionMetadataBuilder.__init__`` (vllm/v1/attention/backends/flash_attn.py) sets ``aot_schedule =
get_flash_attn_version() == 3`` without the layer's head size, True on SM90, so ``build()`` calls FA3's scheduler with
``headdim=512`` for a head-512 layer that then runs FA4. Calls it at head sizes 128, 256 and 512, bf16 and e4m3, pages
16 and 64, and prints each answer (``ok`` with the metadata's shape and first entries, or ``RAISES`` and the error).
On a CUDA machine after benchmarks/gpu_env.sh with FA3 carried (``make device-bundle FA3=1``):
python3 benchmarks/fa3_scheduler_probe.py"""
import torch
from vllm.vllm_flash_attn.flash_attn_interface import get_scheduler_metadata

dev = "cuda"
seqlens = torch.tensor([100, 50, 700], dtype=torch.int32, device=dev)
cuq = torch.tensor([0, 1, 2, 40], dtype=torch.int32, device=dev)
for hd in (128, 256, 512):
    for dt in (torch.bfloat16, torch.float8_e4m3fn):
        for ps in (16, 64):
            try:
                m = get_scheduler_metadata(batch_size=3, max_seqlen_q=38, max_seqlen_k=700, num_heads_q=8,
                                           num_heads_kv=1, headdim=hd, cache_seqlens=seqlens, qkv_dtype=dt,
                                           cu_seqlens_q=cuq, page_size=ps, causal=True, window_size=(-1, -1),
                                           num_splits=0)
                torch.cuda.synchronize()
                print("headdim", hd, dt, "page", ps, "ok", tuple(m.shape), m[:8].tolist())
            except Exception as e:  # noqa: BLE001 - the probe reports every ending
                print("headdim", hd, dt, "page", ps, "RAISES", type(e).__name__,
                      str(e).splitlines()[0][:200])
