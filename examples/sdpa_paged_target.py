"""A user adapter in one file: torch's scaled_dot_product_attention over a paged NHD cache.

Run it with:  kvfuzz fuzz --target examples/sdpa_paged_target.py:SdpaPaged
or from a Hypothesis test:

    @given(kvfuzz.examples(SdpaPaged.capabilities))
    def test_sdpa_paged(example):
        kvfuzz.check_example(SdpaPaged(), example)

It reads each sequence's keys/values out of the paged cache through its block table (so it has the unified
contract: every seq_len position must be in the cache) and calls SDPA with a bottom-right causal mask.
"""

import torch
import torch.nn.functional as F

import kvfuzz


class SdpaPaged(kvfuzz.Target):
    name = "example.sdpa_paged"
    description = "torch SDPA on K/V gathered from a paged NHD cache (unified contract)"
    capabilities = kvfuzz.Capabilities(contract=kvfuzz.Contract.UNIFIED, devices=("cpu", "cuda"),
                                       dtypes=("float32", "float16", "bfloat16"), head_sizes=(32, 64, 128),
                                       block_sizes=(8, 16, 32))

    def availability(self):
        return kvfuzz.Availability(True, f"torch {torch.__version__}", "cuda" if torch.cuda.is_available() else "cpu")

    def layout(self, batch):
        return kvfuzz.NHDLayout()

    def build_call(self, batch, data, cache):
        dev = cache.key_cache.device
        out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=batch.torch_dtype, device=dev)
        kwargs = dict(query=data.query.to(dev), key_cache=cache.key_cache, value_cache=cache.value_cache,
                      block_table=batch.block_table_tensor(dev), seq_lens=batch.seq_lens_tensor(dev),
                      query_start_loc=batch.query_start_loc_tensor(dev),
                      # sm_scale, not scale: None when the batch draws the kernel's own default, so
                      # the kernel's default-scale code (1/sqrt(head_size) in SDPA) is what gets tested
                      scale=batch.sm_scale, output=out)
        return kvfuzz.KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out)

    def run(self, call):
        a = call.kwargs
        bs = a["key_cache"].shape[1]
        qsl, seq_lens = a["query_start_loc"].tolist(), a["seq_lens"].tolist()
        for i, seq_len in enumerate(seq_lens):
            pos = torch.arange(seq_len, device=a["output"].device)
            slots = a["block_table"][i, pos // bs].long() * bs + pos % bs
            k = a["key_cache"][slots // bs, slots % bs].transpose(0, 1)  # [Hkv, S, D]
            v = a["value_cache"][slots // bs, slots % bs].transpose(0, 1)
            q = a["query"][qsl[i]:qsl[i + 1]].transpose(0, 1)  # [H, Q, D]
            ql = q.shape[1]
            mask = pos[None, :] <= (seq_len - ql + torch.arange(ql, device=pos.device))[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a["scale"], enable_gqa=True)
            a["output"][qsl[i]:qsl[i + 1]] = o.transpose(0, 1)
        return a["output"]
