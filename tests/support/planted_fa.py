"""FlashAttention 2 and 4 targets with a planted defect, for a GPU campaign to find (benchmarks/gpu_fa.sh planted
CLASS; loaded by file, e.g. ``tests/support/planted_fa.py:AlibiDroppedOnDecodeFA2``):

- :class:`AlibiDroppedOnDecodeFA2`: the call leaves ``alibi_slopes`` out when every sequence of the batch is a decode
  (the kernel then computes attention without the bias);
- :class:`SinksDroppedOnDecodeFA4`: the call leaves ``s_aux`` (the sink logits) out when every sequence is a decode
  (the kernel's softmax then has no sink term in its denominator);
- :class:`QDescaleIgnoredFA3`: FA3's fp8 forward called with ``q_descale`` 1.0 whatever the checkpoint's query scale
  (``Batch.q_scale``): right while every query scale is 1.0, off by ``q_scale`` once one is calibrated.

On CPU, tests/fuzz/targets/test_vllm_fa2_fa4.py finds and shrinks the FA2 defect planted in the stand-in op, and
checks that kvfuzz's oracle catches the FA4 class over the stand-in (a decode with sinks fails, a prefill passes)."""

import torch

from kvfuzz.fuzz.targets.vllm_flash_attn import VllmFlashAttn2Varlen, VllmFlashAttn4Varlen, VllmFlashAttnVarlen


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


class QDescaleIgnoredFA3(VllmFlashAttnVarlen):
    name = "test.fa3_q_descale_ignored"

    def descales(self, batch, num_seqs, dev):
        d = super().descales(batch, num_seqs, dev)
        return dict(d, q_descale=torch.ones_like(d["q_descale"]))
