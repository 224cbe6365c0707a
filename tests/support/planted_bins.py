"""Torch paged-attention kernels wrong in one region of the shape space: the tests of coverage that steers and of the
structural-first shrink (issue 52; tests/fuzz/campaign/test_steering.py).

Both are :class:`~kvfuzz.fuzz.bench.paged_torch.PagedTorch` (correct paged attention in torch), wrong (the affected
rows scaled by 1.5) only where:

- :class:`WrongInOneBin`: the batch's longest context and longest query fall in one (ctx_len x query_len) log2 bin,
  contexts 256-511 by queries 64-127 (the coverage label ``"2^8 x 2^6"``): at the CPU sizes the test gives the
  serving tier (a 64-token budget) a mid-range context with a full-budget chunk, which its free draws almost never
  reach (as FA3's window bug sat in bins of large queries the serving tier's draws left nearly empty; issue 52);
- :class:`WrongPastLongContext`: on a prefill chunk (query_len >= 4) whose context is at least 384 keys, a
  serving-sized batch's trigger that one of tens of sequences holds.

Both declare the small and serving tiers, one head size and no features, so that what the tests compare is where the
draws go.
"""

import attrs

from kvfuzz.fuzz.bench.paged_torch import PagedTorch

_CAPS = attrs.evolve(PagedTorch.capabilities, dtypes=("float32",), head_sizes=(32,), kv_cache_dtypes=("auto",),
                     block_sizes=(16,), features=())


class WrongInOneBin(PagedTorch):
    name = "planted.wrong_in_one_bin"
    description = "torch paged attention wrong when the longest context is 256-511 and the longest query 64-127"
    tiers = ("small", "serving")
    capabilities = _CAPS
    CTX, QUERY = (256, 511), (64, 127)

    def run(self, call):
        out = super().run(call)
        qsl, seq_lens = call.kwargs["query_start_loc"].tolist(), call.kwargs["seq_lens"].tolist()
        queries = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
        ctx = max(s - q for s, q in zip(seq_lens, queries))
        if self.CTX[0] <= ctx <= self.CTX[1] and self.QUERY[0] <= max(queries) <= self.QUERY[1]:
            out.mul_(1.5)
        return out


class WrongPastLongContext(PagedTorch):
    name = "planted.wrong_past_long_context"
    description = "torch paged attention wrong on a prefill chunk of >= 4 tokens after >= 384 cached keys"
    tiers = ("small", "serving")
    capabilities = _CAPS
    MIN_CTX, MIN_QUERY = 384, 4

    def run(self, call):
        out = super().run(call)
        qsl, seq_lens = call.kwargs["query_start_loc"].tolist(), call.kwargs["seq_lens"].tolist()
        for i, seq_len in enumerate(seq_lens):
            q = qsl[i + 1] - qsl[i]
            if q >= self.MIN_QUERY and seq_len - q >= self.MIN_CTX:
                out[qsl[i]:qsl[i + 1]] *= 1.5
        return out
