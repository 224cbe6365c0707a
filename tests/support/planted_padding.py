"""Planted kernels for the CUDA-graph padding state (kvfuzz.contracts.model.padding), on the torch paged-attention
base (kvfuzz.fuzz.bench.paged_torch.PagedTorch) called as vLLM's FULL CUDA graphs call unified_attention: pads
of seq_len 0 and query_len 0, the null block, one query row per pad past query_start_loc[-1].

PaddedTorch is correct. PadRowNaN maps output rows to sequences one to one, as a decode kernel's grid does, and
normalizes by an empty softmax denominator for a pad (0 / 0: NaN in the pad row). LastSeqTakesTrailingRows
ends the last sequence's query at the query's last row (q.shape[0]) instead of query_start_loc[-1]: right
without pads, wrong for the last real sequence when pads follow it. PadWritesNullBlock writes into the null
block (slot 0) when a pad is present: a padded call must leave the cache as it was.
"""

import attrs
import torch

from kvfuzz.contracts.model.padding import padding
from kvfuzz.fuzz.bench.paged_torch import PagedTorch
from kvfuzz.fuzz.targets.base import KernelCall


class PaddedTorch(PagedTorch):
    name = "planted.padded_torch"
    description = "torch paged attention, called with vLLM's CUDA-graph padding (correct)"
    capabilities = attrs.evolve(PagedTorch.capabilities, dtypes=("float32", "float16"), cuda_graph_padding="vllm")

    def build_call(self, batch, data, cache) -> KernelCall:
        dev = cache.key_cache.device
        pad = padding(batch, self.capabilities.cuda_graph_padding)
        out = torch.zeros((pad.num_rows, batch.num_heads, batch.head_size), dtype=batch.torch_dtype, device=dev)
        kwargs = dict(query=pad.query(data.query.to(dev)), key_cache=cache.key_cache, value_cache=cache.value_cache,
                      block_table=pad.block_table_tensor(dev), seq_lens=pad.seq_lens_tensor(dev),
                      query_start_loc=pad.query_start_loc_tensor(dev), scale=batch.sm_scale, output=out,
                      k_scale=batch.k_scale, v_scale=batch.v_scale, sliding_window=batch.sliding_window,
                      softcap=batch.softcap, alibi_slopes=batch.alibi_slopes_tensor(dev))
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out)


class PadRowNaN(PaddedTorch):
    name = "planted.pad_row_nan"
    description = "writes 0/0 into the row of a seq_len-0 pad (a row per sequence, an empty denominator)"

    def run(self, call: KernelCall) -> torch.Tensor:
        out = super().run(call)
        seq_lens = call.kwargs["seq_lens"].tolist()
        for i, n in enumerate(seq_lens):
            if n == 0 and i < out.shape[0]:
                empty = torch.zeros(out.shape[1:], dtype=torch.float32)
                out[i] = (empty / empty.sum(dim=-1, keepdim=True)).to(out.dtype)  # 0 / 0
        return out


class LastSeqTakesTrailingRows(PaddedTorch):
    name = "planted.last_seq_takes_trailing_rows"
    description = "ends the last sequence's query at q.shape[0], not query_start_loc[-1]"

    def run(self, call: KernelCall) -> torch.Tensor:
        a = call.kwargs
        qsl = a["query_start_loc"].clone()
        rows = a["query"].shape[0]
        last = max(i for i in range(len(qsl) - 1) if qsl[i + 1] > qsl[i])  # the last sequence with rows
        qsl[last + 1:] = rows
        return super().run(attrs.evolve(call, kwargs={**a, "query_start_loc": qsl}))


class PadWritesNullBlock(PaddedTorch):
    name = "planted.pad_writes_null_block"
    description = "stores something in the null block (slot 0) for each seq_len-0 pad"

    def run(self, call: KernelCall) -> torch.Tensor:
        out = super().run(call)
        if 0 in call.kwargs["seq_lens"].tolist():
            call.kwargs["value_cache"][0, 0] = 0.5
        return out


class PadNaNAndMagnitudes(PadRowNaN):
    """PadRowNaN's pad rows (vllm#57017's 0/0) plus a precision bug that only larger magnitudes show, as Finding 3
    on vllm.triton_mla_decode's one-head batches: NaN in every real row when a query element passes 16 (only the
    "extreme" range draws one: "normal" stays within 3.46, "large" within 13.9), else the real rows off by 1/4
    when a written key passes 3.5 ("large", "dominant")."""

    name = "planted.pad_nan_and_magnitudes"
    description = "NaN pad rows, NaN real rows at extreme queries, real rows off by 1/4 at large keys"

    def run(self, call: KernelCall) -> torch.Tensor:
        out = super().run(call)
        real = int(call.kwargs["query_start_loc"][-1])
        keys = torch.nan_to_num(call.kwargs["key_cache"].float(), nan=0.0, posinf=0.0, neginf=0.0)
        if float(call.kwargs["query"].float().abs().max()) > 16:
            out[:real] = float("nan")
        elif float(keys.abs().max()) > 3.5:
            out[:real] += 0.25
        return out
