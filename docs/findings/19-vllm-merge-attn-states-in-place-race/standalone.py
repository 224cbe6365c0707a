#!/usr/bin/env python3
"""vLLM 0.33.0's merge_attn_states called in place, as accumulate_mla_context_chunk
(vllm/model_executor/layers/attention/mla_attention.py) calls it for an MLA context chunk that continues a
sequence: ``output`` is ``prefix_output`` and ``output_lse`` is ``prefix_lse``. Both forms read ``prefix_lse`` in
several warps while one of them stores the merged log-sum-exp there, with nothing ordering the two:

- the CUDA op (``vllm._custom_ops.merge_attn_states``, csrc/attention/merge_attn_states.cu, in
  vllm/_C_stable_libtorch.abi3.so), which vLLM's dispatcher (v1/attention/ops/merge_attn_states.py) picks on NVIDIA
  for fp16/bf16/fp32 outputs with head sizes that are multiples of 8 (8 elements of 16 bits a thread: a (token,
  head) takes head_size / 8 threads, which straddle two warps at 40, 80, 96, 192 and 576);
- the Triton kernel (v1/attention/ops/triton_merge_attn_states.py; ROCm before CDNA3, other sizes and dtypes), one
  program per (token, head) whose warps each load ``prefix_lse``.

A warp that loads ``prefix_lse`` after another has stored the merged value there weighs its share of the head with
the merged log-sum-exp in place of the prefix's; this script checks each wrong row against that weight. It happens
when other work shares the SMs (another stream, or other processes under CUDA MPS); alone on the GPU it was never
seen.

Needs torch, vLLM 0.33.0 (no kvfuzz) and an NVIDIA GPU. Exit 1 while the race reproduces (in place wrong, out of
place right), 0 when no in-place call went wrong, 2 when it cannot run here.
Usage: python standalone.py [TRIALS] [LOAD] [OP] [SIZES]
  TRIALS  calls per head size (default 300), 64 tokens x 32 heads each
  LOAD    ``stream`` (default): before each merge a side stream gets memory-bound work whose small blocks share the
          SMs with the merge's; ``none``: the merges alone
  OP      ``cuda`` (default: the op vLLM runs on NVIDIA) or ``triton``
  SIZES   comma-separated HEAD_SIZE:DTYPE pairs (default 192:bfloat16,80:bfloat16,40:bfloat16,128:float16; 192 is
          DeepSeek's MLA context output where V is padded to the qk head size, FlashAttention 2's prefill path)"""

import sys

OP = sys.argv[3] if len(sys.argv) > 3 else "cuda"
if OP not in ("triton", "cuda"):
    print(f"OP must be triton or cuda, not {OP!r}")
    sys.exit(2)
try:
    import torch

    if OP == "cuda":
        import vllm._C_stable_libtorch  # noqa: F401  (registers torch.ops._C.merge_attn_states)
        from vllm._custom_ops import merge_attn_states
    else:
        from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states
except ImportError as e:
    print(f"cannot run here: {e} (needs vLLM 0.33.0 with its CUDA extensions, and an NVIDIA GPU)")
    sys.exit(2)

DEV = "cuda"
if not torch.cuda.is_available():  # Triton's CPU interpreter runs one program at a time: no race to see
    print("cannot run here: needs an NVIDIA GPU")
    sys.exit(2)
TRIALS = int(sys.argv[1]) if len(sys.argv) > 1 else 300
LOAD = sys.argv[2] if len(sys.argv) > 2 else "stream"
if LOAD not in ("none", "stream"):
    print(f"LOAD must be none or stream, not {LOAD!r}")
    sys.exit(2)
SIZES = sys.argv[4] if len(sys.argv) > 4 else "192:bfloat16,80:bfloat16,40:bfloat16,128:float16"
T, H = 64, 32


def exact(p, plse, s, slse):
    """The merge in fp64: out = (e^plse p + e^slse s) / (e^plse + e^slse), per (token, head)."""
    m = torch.maximum(plse, slse)
    wp, ws = torch.exp(plse - m), torch.exp(slse - m)
    wp, ws = (wp / (wp + ws)).t()[..., None], (ws / (wp + ws)).t()[..., None]
    return p.double() * wp + s.double() * ws, (torch.log(torch.exp(plse - m) + torch.exp(slse - m)) + m)


def main() -> int:
    total_in_place = total_out_of_place = 0
    side = torch.cuda.Stream() if LOAD == "stream" else None
    load = torch.ones(1 << 26, device=DEV) if side is not None else None  # 256 MiB of fp32
    try:
        configs = [(int(size), getattr(torch, dtype)) for size, dtype in (c.split(":") for c in SIZES.split(","))]
    except (ValueError, AttributeError):
        print(f"SIZES must be HEAD_SIZE:DTYPE pairs separated by commas (e.g. 192:bfloat16), not {SIZES!r}")
        return 2
    for head_size, dtype in configs:
        bad_in, bad_out, explained = 0, 0, 0
        for trial in range(TRIALS):
            g = torch.Generator().manual_seed(trial)
            p = torch.randn(T, H, head_size, generator=g).to(dtype)
            s = torch.randn(T, H, head_size, generator=g).to(dtype)
            plse = torch.randn(H, T, generator=g) * 2
            slse = torch.randn(H, T, generator=g) * 2
            ref, ref_lse = exact(p, plse.double(), s, slse.double())
            # in place, as accumulate_mla_context_chunk: output is prefix_output, output_lse is prefix_lse
            out, out_lse = p.to(DEV).clone(), plse.to(DEV).clone()  # copies: the call writes them
            if side is not None:  # queued on the side stream first, so it is running when the merge starts
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(4):
                        load.mul_(1.0000001)
            merge_attn_states(output=out, prefix_output=out, prefix_lse=out_lse, suffix_output=s.to(DEV),
                              suffix_lse=slse.to(DEV), output_lse=out_lse)
            # out of place (vLLM's test_merge_attn_states.py calls it only so): the control
            out2, lse2 = torch.empty_like(p, device=DEV), torch.empty_like(plse, device=DEV)
            merge_attn_states(output=out2, prefix_output=p.to(DEV), prefix_lse=plse.to(DEV), suffix_output=s.to(DEV),
                              suffix_lse=slse.to(DEV), output_lse=lse2)
            for o, count in ((out, "in"), (out2, "out")):
                err = (o.double().cpu() - ref).abs().amax(-1)  # [T, H]
                rows = (err > 3e-2).nonzero().tolist()  # 16-bit rounding is < 1e-2 here; the race errs by ~0.1
                if count == "in":
                    bad_in += len(rows)
                    for t, h in rows:  # the weight the wrong elements were given: the merged LSE read as prefix's
                        merged = ref_lse[h, t]
                        w_race = 1 / (1 + torch.exp(merged - slse[h, t].double()))
                        d = (s[t, h] - p[t, h]).double()
                        wrong = (o[t, h].double().cpu() - ref[t, h]).abs() > 3e-2
                        w_seen = ((o[t, h].double().cpu() - p[t, h].double()) * d)[wrong].sum() / (d * d)[wrong].sum()
                        explained += bool(abs(w_seen - w_race) < 3e-2)
                        if bad_in <= 3 and rows.index([t, h]) < 1:
                            print(f"  head_size {head_size} trial {trial}: token {t} head {h}: {int(wrong.sum())} of "
                                  f"{head_size} elements wrong, suffix weight {float(w_seen):.4f} where exact is "
                                  f"{float(1 / (1 + torch.exp(plse[h, t].double() - slse[h, t].double()))):.4f} "
                                  f"and the merged LSE read as the prefix's gives {float(w_race):.4f}")
                else:
                    bad_out += len(rows)
        print(f"{OP}: head_size {head_size}, {str(dtype)[6:]}, load {LOAD}, {T} tokens x {H} heads, {TRIALS} calls "
              f"each: in place {bad_in} wrong "
              f"(token, head) rows ({explained} explained by the merged LSE read as the prefix's), out of place "
              f"{bad_out}")
        total_in_place += bad_in
        total_out_of_place += bad_out
    print(f"device: {torch.cuda.get_device_name()}")
    if total_in_place and not total_out_of_place:
        print("REPRODUCED: the in-place merge is wrong where the out-of-place one is right")
        return 1
    print("not reproduced" + (" (the out-of-place control is wrong too: something else)" if total_out_of_place else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
