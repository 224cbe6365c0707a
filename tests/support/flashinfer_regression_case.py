"""How regressions/flashinfer.batch_decode-configuration-rejected-* was written (on a CPU machine: the call is
built, not run), so the committed case can be checked against it (tests/fuzz/guard/test_flashinfer_regression.py).

The case: the CUDA-core decode of flashinfer-python 0.7.2.post1 raised ``RuntimeError: ... Unsupported
group_size: 7`` for GQA group size 7 on an H100 (2026-11-23; flashinfer/data/csrc/batch_decode.cu's plan
dispatches through include/flashinfer/utils.cuh ``DISPATCH_GQA_GROUP_SIZE``: 1, 2, 3, 4, 6, 8, 16). Group size 7
is outside flashinfer.batch_decode's declaration, so a clear error is the expected answer (``kvfuzz fuzz
--undeclared``: "rejected: ..."); the case records that refusal so a replay on a GPU confirms it stays a clear
error (and would fail if the kernel started computing group size 7 wrongly)."""

from __future__ import annotations

from pathlib import Path

from kvfuzz.contracts.checks.failures import ConfigurationRejected
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
from kvfuzz.fuzz.targets import get_target

TARGET = "flashinfer.batch_decode"
#: What the refusal's first line must contain.
CHECK = "Unsupported group_size: 7"


def group_size_7_example() -> Example:
    """Two decodes, 7 query heads on 1 kv head (group size 7), head size 128, fp16, pages of 16."""
    b = Batch(query_lens=[1, 1], ctx_lens=[20, 5], num_heads=7, num_kv_heads=1, head_size=128, block_size=16,
              num_blocks=4, block_table=[[2, 0], [1, 0]], dtype="float16", seed=7)
    return Example(b, Poison.NAN)


def write_group_size_7_case(out: Path) -> Path:
    """Write the case under ``out``; returns its directory."""
    t = get_target(TARGET)
    e = group_size_7_example()
    outside = t.capabilities.outside(e.batch)
    finding = ConfigurationRejected(CHECK, (
        f"{TARGET} (the CUDA-core decode, flashinfer-python 0.7.2.post1) refuses GQA group size 7 with "
        f"'RuntimeError: ... {CHECK}' (group size 7 seen refused on an H100, 2026-11-23; this batch was written "
        "on a CPU): its DISPATCH_GQA_GROUP_SIZE covers 1, 2, 3, 4, 6, 8, 16. Outside the declaration, a clear error "
        "is the expected answer; flashinfer.batch_decode_tc (the tensor-core decode) takes group size 7."), {
        "outside": outside, "undeclared": True,
        "expected_outcome": ("rejected: RuntimeError: Error in function 'operator()' at batch_decode.cu:<line>: "
                             f"{CHECK}"),
        "seen_on": "an H100 (README, FlashInfer: measured 2026-11-23), flashinfer-python 0.7.2.post1, torch 2.11",
        "written_by": ("tests/support/flashinfer_regression_case.py write_group_size_7_case "
                       "(on a CPU: the call was built, not run)")})
    return write_reproducer(out, t, e, finding, None)
