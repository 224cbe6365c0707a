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
    own = TorchFlexPaged.kernel_options
    for heads in (16, 24, 32, 64):
        for page in (16, 64):
            batch = Batch(query_lens=[1], ctx_lens=[0], num_heads=heads, num_kv_heads=1, head_size=16,
                          block_size=page, num_blocks=1, block_table=[[0]], dtype="float32")
            for label, opts in (("kvfuzz options", own), ("flex defaults", staticmethod(lambda b, d: None))):
                TorchFlexPaged.kernel_options = opts
                try:
                    properties.check(TorchFlexPaged(), Example(batch, Poison.NAN))
                    print(f"H={heads} Hkv=1 D=16 page={page} fp32, {label}: passed", flush=True)
                except Exception as e:  # what the probe is for: the error's words
                    tail = "".join(traceback.format_exception(e)).strip().splitlines()[-12:]
                    print(f"H={heads} Hkv=1 D=16 page={page} fp32, {label}: {type(e).__name__}", flush=True)
                    print("    " + "\n    ".join(line[:300] for line in tail), flush=True)
    TorchFlexPaged.kernel_options = own


if __name__ == "__main__":
    main()
