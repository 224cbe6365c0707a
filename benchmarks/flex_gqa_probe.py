"""Does torch.flex_paged's compiled flex_attention fail at a GQA group of 64 because of kvfuzz's fixed kernel options
(``TorchFlexPaged.kernel_options``) or in flex itself? An H200 sweep (2026-11-28) met "InductorError: SubprocException"
on one decode, 64 query heads over 1 kv head, head size 16, fp32, page 64. This runs that batch (and groups 16, 24
and 32 beside it) with the target's options and with flex's defaults, printing each outcome and the error's last
lines. On a CUDA machine: python3 benchmarks/flex_gqa_probe.py (after benchmarks/gpu_env.sh)."""

import traceback

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.targets import torch_flex
from kvfuzz.fuzz.targets.torch_flex import TorchFlexPaged


def main() -> None:
    assert torch_flex.on_cuda(), "needs a CUDA device"
    own = TorchFlexPaged.__dict__["kernel_options"]  # the staticmethod itself, to put back as it was
    cases = [dict(query_lens=[1], num_heads=h, num_kv_heads=1, head_size=16, block_size=p, dtype="float32")
             for h in (16, 24, 32, 64) for p in (16, 64)]
    # the next sweep's crash (2026-11-28, H200): a 16-token prefill, 64 heads over 4, head size 256, page 128, fp16
    cases.append(dict(query_lens=[16], num_heads=64, num_kv_heads=4, head_size=256, block_size=128, dtype="float16"))
    for kw in cases:
        batch = Batch(ctx_lens=[0], num_blocks=1, block_table=[[0]], **kw)
        name = (f"H={kw['num_heads']}/{kw['num_kv_heads']} D={kw['head_size']} q={kw['query_lens'][0]} "
                f"page={kw['block_size']} {kw['dtype']}")
        for label, opts in (("kvfuzz options", own), ("flex defaults", staticmethod(lambda b, d: None))):
            TorchFlexPaged.kernel_options = opts
            try:
                properties.check(TorchFlexPaged(), Example(batch, Poison.ZEROS))
                print(f"{name}, {label}: passed", flush=True)
            except Exception as e:  # what the probe is for: the error's words
                tail = "".join(traceback.format_exception(e)).strip().splitlines()[-12:]
                print(f"{name}, {label}: {type(e).__name__}", flush=True)
                print("    " + "\n    ".join(line[:300] for line in tail), flush=True)
    TorchFlexPaged.kernel_options = own


if __name__ == "__main__":
    main()
