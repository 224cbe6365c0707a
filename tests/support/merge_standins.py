"""Merge targets for tests: the CUDA ``merge_attn_states`` op on a CPU (vLLM's real ``vllm._custom_ops`` wrapper over
a stand-in for ``torch.ops._C.merge_attn_states``: vLLM's own torch merge, ``_merge_attn_states_torch``, behind the
op's schema) and merges with a planted defect, the kernels of planted_merges.py (:class:`ExpDirect`,
:class:`PlusInfKept`, :class:`Bf16Weights`; campaigns load them by file: ``merge_standins.py:CLASS``). The planted
targets change only ``kernel``, so their reproducers' standalone.py call that module (PYTHONPATH: this folder)."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by file: planted_merges importable

from kvfuzz.fuzz.targets.base import Availability  # noqa: E402
from kvfuzz.fuzz.targets.vllm_merge import VllmCudaMerge, VllmTorchMerge  # noqa: E402

#: The calls the stand-in op saw, by argument name.
SEEN: list[dict] = []


def op_merge_attn_states(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse,
                         prefill_tokens_with_context, output_scale=None):
    """``_C::merge_attn_states`` in the schema's order (read off vllm/_C_stable_libtorch.abi3.so of vLLM 0.33.0), as
    vLLM's own torch merge computes it, with the op's dtype checks."""
    from vllm.v1.attention.ops.merge_attn_states import _merge_attn_states_torch

    SEEN.append(dict(locals()))
    assert prefix_output.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert prefix_lse.dtype == suffix_lse.dtype == torch.float32
    _merge_attn_states_torch(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                             prefill_tokens_with_context, output_scale)


def install_cuda_merge(monkeypatch) -> None:
    """The stand-in as ``torch.ops._C.merge_attn_states`` (undone after the test)."""
    from kvfuzz.fuzz.targets.triton_runtime import prepare_triton_runtime

    SEEN.clear()
    prepare_triton_runtime()
    monkeypatch.setattr(torch.ops._C, "merge_attn_states", op_merge_attn_states, raising=False)


class StandInCudaMerge(VllmCudaMerge):
    """``vllm.merge_attn_states_cuda`` on a CPU: vLLM's real ``_custom_ops`` wrapper over the stand-in op."""

    name = "test.merge_cuda_standin"
    capabilities = attrs.evolve(VllmCudaMerge.capabilities, devices=("cpu",))

    def availability(self):
        return Availability(True, "vllm._custom_ops over a torch stand-in for _C::merge_attn_states", "cpu")


class ExpDirect(VllmTorchMerge):
    name = "test.merge_exp_direct"
    kernel = ("planted_merges", "exp_direct")


class PlusInfKept(VllmTorchMerge):
    name = "test.merge_plus_inf_kept"
    kernel = ("planted_merges", "plus_inf_kept")


class Bf16Weights(VllmTorchMerge):
    name = "test.merge_bf16_weights"
    kernel = ("planted_merges", "bf16_weights")


__all__ = ["Bf16Weights", "ExpDirect", "PlusInfKept", "SEEN", "StandInCudaMerge", "install_cuda_merge",
           "op_merge_attn_states"]
