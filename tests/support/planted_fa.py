"""FlashAttention 2 and 4 targets with a planted defect, for a GPU campaign to find (benchmarks/gpu_fa.sh planted
CLASS; loaded by file, e.g. ``tests/support/planted_fa.py:AlibiDroppedOnDecodeFA2``):

- :class:`AlibiDroppedOnDecodeFA2`: the call leaves ``alibi_slopes`` out when every sequence of the batch is a decode
  (the kernel then computes attention without the bias);
- :class:`SinksDroppedOnDecodeFA4`: the call leaves ``s_aux`` (the sink logits) out when every sequence is a decode
  (the kernel's softmax then has no sink term in its denominator).

On CPU, tests/fuzz/targets/test_vllm_fa2_fa4.py finds and shrinks the FA2 defect planted in the stand-in op, and
checks that kvfuzz's oracle catches the FA4 class over the stand-in (a decode with sinks fails, a prefill passes)."""

from kvfuzz.fuzz.targets.vllm_flash_attn import VllmFlashAttn2Varlen, VllmFlashAttn4Varlen


class AlibiDroppedOnDecodeFA2(VllmFlashAttn2Varlen):
    name = "test.fa2_alibi_dropped_on_decode"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        if batch.max_query_len == 1:
            call.kwargs["alibi_slopes"] = None
        return call


class SinksDroppedOnDecodeFA4(VllmFlashAttn4Varlen):
    name = "test.fa4_sinks_dropped_on_decode"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        if batch.max_query_len == 1:
            call.kwargs["s_aux"] = None
        return call
