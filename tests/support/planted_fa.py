"""A FlashAttention 2 target with a planted defect, for a GPU campaign to find (benchmarks/gpu_fa.sh planted;
loaded by file: ``tests/support/planted_fa.py:AlibiDroppedOnDecodeFA2``): the call leaves ``alibi_slopes`` out when
every sequence of the batch is a decode (the kernel then computes attention without the bias). On CPU the same
defect, planted in the stand-in op, is found and shrunk by tests/fuzz/targets/test_vllm_fa2_fa4.py."""

from kvfuzz.fuzz.targets.vllm_flash_attn import VllmFlashAttn2Varlen


class AlibiDroppedOnDecodeFA2(VllmFlashAttn2Varlen):
    name = "test.fa2_alibi_dropped_on_decode"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        if batch.max_query_len == 1:
            call.kwargs["alibi_slopes"] = None
        return call
