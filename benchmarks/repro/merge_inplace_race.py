#!/usr/bin/env python3
"""vLLM 0.33.0's Triton merge_attn_states (vllm/v1/attention/ops/triton_merge_attn_states.py), called in place as
accumulate_mla_context_chunk (vllm/model_executor/layers/attention/mla_attention.py) calls it: ``output`` is
``prefix_output`` and ``output_lse`` is ``prefix_lse``. Each program (token, head) loads ``prefix_lse``, stores the
merged log-sum-exp to ``output_lse`` and then scales the head's elements; the warps of one program do not wait for
each other, so a warp that loads ``prefix_lse`` after another warp has stored the merged value there weighs its
share of the head with the merged log-sum-exp in place of the prefix's. Its elements come out wrong, with a weight
that this script identifies.

Needs torch, triton and vLLM 0.33.0 (no kvfuzz), and a GPU (Triton's CPU interpreter runs one program at a time
and never shows it). Exit 1 while the race reproduces (in place wrong, out of place right), 0 when no in-place call
went wrong, 2 when it cannot run here. Usage: python standalone.py [TRIALS]"""

import sys

try:
    import torch
    from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states
except ImportError as e:
    print(f"cannot run here: {e} (pip install vllm==0.33.0)")
    sys.exit(2)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRIALS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
T, H = 64, 32


def exact(p, plse, s, slse):
    """The merge in fp64: out = (e^plse p + e^slse s) / (e^plse + e^slse), per (token, head)."""
    m = torch.maximum(plse, slse)
    wp, ws = torch.exp(plse - m), torch.exp(slse - m)
    wp, ws = (wp / (wp + ws)).t()[..., None], (ws / (wp + ws)).t()[..., None]
    return p.double() * wp + s.double() * ws, (torch.log(torch.exp(plse - m) + torch.exp(slse - m)) + m)


def main() -> int:
    total_in_place = total_out_of_place = 0
    for head_size in (512, 256, 128):
        bad_in, bad_out, explained = 0, 0, 0
        for trial in range(TRIALS):
            g = torch.Generator().manual_seed(trial)
            p = torch.randn(T, H, head_size, generator=g).half()
            s = torch.randn(T, H, head_size, generator=g).half()
            plse = torch.randn(H, T, generator=g) * 2
            slse = torch.randn(H, T, generator=g) * 2
            ref, ref_lse = exact(p, plse.double(), s, slse.double())
            # in place, as accumulate_mla_context_chunk: output is prefix_output, output_lse is prefix_lse
            out, out_lse = p.to(DEV).clone(), plse.to(DEV).clone()  # copies: the call writes them
            merge_attn_states(output=out, prefix_output=out, prefix_lse=out_lse, suffix_output=s.to(DEV),
                              suffix_lse=slse.to(DEV), output_lse=out_lse)
            # out of place (vLLM's test_merge_attn_states.py calls it only so): the control
            out2, lse2 = torch.empty_like(p, device=DEV), torch.empty_like(plse, device=DEV)
            merge_attn_states(output=out2, prefix_output=p.to(DEV), prefix_lse=plse.to(DEV), suffix_output=s.to(DEV),
                              suffix_lse=slse.to(DEV), output_lse=lse2)
            for o, count in ((out, "in"), (out2, "out")):
                err = (o.double().cpu() - ref).abs().amax(-1)  # [T, H]
                rows = (err > 1e-2).nonzero().tolist()  # fp16 rounding is < 1e-3 here; the race errs by ~0.1
                if count == "in":
                    bad_in += len(rows)
                    for t, h in rows:  # the weight the wrong elements were given: the merged LSE read as prefix's
                        merged = ref_lse[h, t]
                        w_race = 1 / (1 + torch.exp(merged - slse[h, t].double()))
                        d = (s[t, h] - p[t, h]).double()
                        wrong = (o[t, h].double().cpu() - ref[t, h]).abs() > 1e-2
                        w_seen = ((o[t, h].double().cpu() - p[t, h].double()) * d)[wrong].sum() / (d * d)[wrong].sum()
                        explained += bool(abs(w_seen - w_race) < 2e-2)
                        if bad_in <= 3 and rows.index([t, h]) < 1:
                            print(f"  head_size {head_size} trial {trial}: token {t} head {h}: {int(wrong.sum())} of "
                                  f"{head_size} elements wrong, suffix weight {float(w_seen):.4f} where exact is "
                                  f"{float(1 / (1 + torch.exp(plse[h, t].double() - slse[h, t].double()))):.4f} "
                                  f"and the merged LSE read as the prefix's gives {float(w_race):.4f}")
                else:
                    bad_out += len(rows)
        print(f"head_size {head_size}, fp16, {T} tokens x {H} heads, {TRIALS} calls each: in place {bad_in} wrong "
              f"(token, head) rows ({explained} explained by the merged LSE read as the prefix's), out of place "
              f"{bad_out}")
        total_in_place += bad_in
        total_out_of_place += bad_out
    print(f"device: {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu (interpreter: no race possible)'}")
    if total_in_place and not total_out_of_place:
        print("REPRODUCED: the in-place merge is wrong where the out-of-place one is right")
        return 1
    print("not reproduced" + (" (the out-of-place control is wrong too: something else)" if total_out_of_place else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
