"""torch 2.11 (H200): compiled flex_attention whose score_mod closes over a Python float that changes between
calls fails on the second call with "InductorError: LoweringException: RuntimeError: unbacked_bindings"
(docs/findings.md, Finding 8). Needs a CUDA GPU. Output on an H200: cap 50.0 ok, cap 4.0 FAIL, cap 7.0 FAIL."""
import torch
from torch.nn.attention.flex_attention import flex_attention

f = torch.compile(flex_attention)
q = torch.randn(1, 2, 16, 32, device="cuda", dtype=torch.float16)
for cap in (50.0, 4.0, 7.0):
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    try:
        f(q, q, q, score_mod=score_mod); print("plain flex, cap", cap, "ok", flush=True)
    except Exception as e:
        print("plain flex, cap", cap, "FAIL", type(e).__name__, str(e).splitlines()[0][:200], flush=True)
