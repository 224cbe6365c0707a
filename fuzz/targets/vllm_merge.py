"""vLLM's ``merge_attn_states``: the merge of two attention states (a part's output and log-sum-exp each) into the
attention of the whole context (vLLM 0.33.0, vllm/v1/attention/ops/merge_attn_states.py), in its two
implementations: the Triton kernel (vllm/v1/attention/ops/triton_merge_attn_states.py; runs on a CPU under Triton's
interpreter) and the CUDA op (``vllm._custom_ops.merge_attn_states`` -> ``torch.ops._C.merge_attn_states``, in
``vllm/_C_stable_libtorch.abi3.so``; the dispatcher takes it on CUDA for fp32 with ``head_size % 4 == 0`` and
fp16/bf16 with ``head_size % 8 == 0``).

Its callers hand it, per query token, the attention over the context (*prefix*) and over the new tokens (*suffix*):
MLA's chunked-context prefill (vllm/model_executor/layers/attention/mla_attention.py, the final merge; and
``accumulate_mla_context_chunk``, which merges in place: ``output`` is ``prefix_output`` and ``output_lse`` is
``prefix_lse``), and decode context parallelism in FLASH_ATTN (flash_attn.py ``_forward_with_dcp``: the
DCP-combined context, whose log-sum-exp is ``transpose(0, 1).contiguous()``, with the new tokens' attention). The
targets build exactly those calls from :mod:`kvfuzz.contracts.model.merge` (the parts of the batch's attention as a
kernel returns them) and draw, from the batch's seed (:func:`merge_path`), what varies between callers: an empty
part's log-sum-exp (FlashAttention 3's ``-inf`` or FlashAttention 2's ``+inf``), whether ``output_lse`` is written,
the in-place form, log-sum-exps as a transposed ``[num_tokens, num_heads]`` buffer, parts padded in the head dim
(a backend's ``[..., :v_head_dim]`` slice), ``prefill_tokens_with_context`` (None, or the first sequence's
tokens: the rest are copied from the suffix), and, on CUDA, other work sharing the GPU's SMs during the call
(:func:`side_load`: the in-place form races between warps only then, docs/findings.md 19).

Contract :attr:`~kvfuzz.contracts.model.contract.Contract.MERGE`; the property (kvfuzz.fuzz.harness.merge) checks
the arguments (kvfuzz.contracts.calls.merge_checks), that the parts are the batch's (ground truth), and the output
and merged log-sum-exp against the exact fp64 merge of the very inputs handed over (kvfuzz.contracts.checks.merge).
No guard signature: the call is no paged-attention call. Importing this module imports neither vllm nor triton.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, ClassVar

import attrs
import torch

from kvfuzz.contracts.caches.layouts import CacheLayout, NHDLayout
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.merge import MergeInputs

from .base import Availability, KernelCall, Target
from .triton_runtime import VllmTritonTarget, module_file, prepare_triton_runtime, quiet_vllm

#: The Triton merge's entry point.
TRITON_MERGE = ("vllm.v1.attention.ops.triton_merge_attn_states", "merge_attn_states")
#: The CUDA op's Python wrapper (vllm/_custom_ops.py) and the library it registers from.
CUDA_MERGE = ("vllm._custom_ops", "merge_attn_states")
CUDA_LIBRARY = "_C_stable_libtorch.abi3.so"
#: Head sizes declared: powers of two and not (the Triton kernel pads to the next power of two), MLA's value head
#: sizes (128; 512 for the absorbed latent; 192, DeepSeek's qk head size, for a context partial whose V a prefill
#: backend padded: FlashAttnPrefillBackend's ``requires_v_padding``), all multiples of 8 (the CUDA op's 16-byte
#: packs; 40, 80, 96 and 192 put a (token, head)'s threads across two warps there).
HEAD_SIZES = (32, 40, 64, 80, 96, 128, 192, 512)
#: The side stream's work (:func:`side_load`): fp32 elements of the buffer each call sweeps, and sweeps a call.
SIDE_LOAD_ELEMENTS = 1 << 26
SIDE_LOAD_SWEEPS = 4
_SIDE: dict[torch.device, tuple[Any, torch.Tensor]] = {}


def side_load(device: torch.device) -> bool:
    """Queue memory-bound work on a side CUDA stream of ``device`` (``SIDE_LOAD_SWEEPS`` in-place sweeps over a
    256 MiB fp32 buffer, allocated once per process and device) after what the current stream has queued, so the
    merge launched next shares the SMs with its small blocks, as kernels of another stream or of other processes
    under CUDA MPS do in serving. Returns whether it queued anything (False off CUDA). The buffer's values are never
    read."""
    if device.type != "cuda":
        return False
    if device not in _SIDE:
        _SIDE[device] = (torch.cuda.Stream(device), torch.ones(SIDE_LOAD_ELEMENTS, device=device))
    stream, buf = _SIDE[device]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(SIDE_LOAD_SWEEPS):
            buf.mul_(1.0)
    return True


@attrs.define
class MergeCall(KernelCall):
    """A merge call: :class:`~kvfuzz.fuzz.targets.base.KernelCall` and whether it runs beside a side stream's
    work (:attr:`MergePath.concurrent`)."""

    concurrent: bool = False


@attrs.frozen
class MergePath:
    """How one call is made (drawn from the batch's seed, :func:`merge_path`). empty_lse: an empty part's
    log-sum-exp. output_lse: ``output_lse`` written. in_place: ``output``/``output_lse`` are the prefix's own
    tensors (``accumulate_mla_context_chunk``). lse_transposed: the log-sum-exps are ``[T, H]`` buffers handed as
    ``.t()`` views. padded: the parts are ``[..., :D]`` slices of ``[T, H, D + 8]`` buffers. first_seq_only:
    ``prefill_tokens_with_context`` is the first sequence's token count (else None). concurrent: on CUDA, a side
    stream's work shares the SMs during the call (:func:`side_load`; nothing off CUDA)."""

    empty_lse: float
    output_lse: bool
    in_place: bool
    lse_transposed: bool
    padded: bool
    first_seq_only: bool
    concurrent: bool = False

    def describe(self) -> str:
        """``empty_lse=-inf,output_lse,in_place,...``: the convention and every variant that is on."""
        names = ("output_lse", "in_place", "lse_transposed", "padded", "first_seq_only", "concurrent")
        flags = [n for n in names if getattr(self, n)]
        return f"empty_lse={'+inf' if self.empty_lse > 0 else '-inf'}" + "".join(f",{f}" for f in flags)


def merge_path(batch: Batch) -> MergePath:
    """The call variant of ``batch`` (:class:`MergePath`), one bit of ``batch.seed`` each (so every variant and
    combination comes up, and a failure shrinks the seed with the rest)."""
    bits = [(batch.seed >> i) & 1 for i in range(7)]
    return MergePath(float("inf") if bits[0] else float("-inf"), bool(bits[1]), bool(bits[1] and bits[2]),
                     bool(bits[3]), bool(bits[4]), bool(bits[5]), bool(bits[6]))


class _Merge(Target):
    """What both merge targets share: the call (:meth:`build_call`), the path, the layout (none is read)."""

    upstream: ClassVar[tuple[str, str, str]] = ("vllm", "vllm/v1/attention/ops/merge_attn_states.py",
                                               "merge_attn_states")
    tiers = ("small",)

    def layout(self, batch: Batch) -> CacheLayout:
        return NHDLayout()  # no cache is read: a placeholder for the tools that name one

    def path(self, batch: Batch) -> str:
        """In place or not, the empty part's convention, and ``,concurrent`` on CUDA when a side stream's work runs
        beside the call (the other variants of :class:`MergePath` are argument layouts, not paths)."""
        p = merge_path(batch)
        loaded = ",concurrent" if p.concurrent and str(self.device).startswith("cuda") else ""
        return (f"{'in-place' if p.in_place else 'out-of-place'},empty_lse={'+inf' if p.empty_lse > 0 else '-inf'}"
                + loaded)

    @staticmethod
    def load(call: KernelCall) -> None:
        """Before the kernel: the side stream's work when the call is :attr:`MergeCall.concurrent` (on CUDA)."""
        if getattr(call, "concurrent", False):
            side_load(call.output.device)

    @staticmethod
    def empty_lse(batch: Batch) -> float:
        """The log-sum-exp an empty part is handed over with (:func:`merge_path`)."""
        return merge_path(batch).empty_lse

    def build_call(self, batch: Batch, data: BatchData, cache: MergeInputs) -> KernelCall:
        """``merge_attn_states`` kwargs for the parts ``cache`` (a :class:`MergeInputs`, rounded as a kernel returns
        them: :func:`~kvfuzz.contracts.model.merge.merge_inputs`), made as :func:`merge_path` says, on the
        target's device. ``KernelCall.key_cache``/``value_cache`` are the prefix and suffix outputs."""
        p = merge_path(batch)
        dev = self.device
        t, h, d = cache.prefix_output.shape

        def part(x: torch.Tensor) -> torch.Tensor:
            if not p.padded:
                return x.to(dev).clone()
            buf = torch.full((t, h, d + 8), float("nan"), dtype=x.dtype, device=dev)  # never read
            buf[..., :d] = x.to(dev)
            return buf[..., :d]

        def lse(x: torch.Tensor) -> torch.Tensor:
            if not p.lse_transposed:
                return x.to(dev).clone()
            return x.t().contiguous().to(dev).t()

        prefix, suffix = part(cache.prefix_output), part(cache.suffix_output)
        prefix_lse, suffix_lse = lse(cache.prefix_lse), lse(cache.suffix_lse)
        if p.in_place:
            output, output_lse = prefix, prefix_lse
        else:
            output = torch.empty((t, h, d), dtype=prefix.dtype, device=dev)
            output_lse = torch.empty((h, t), dtype=torch.float32, device=dev) if p.output_lse else None
        kwargs: dict[str, Any] = dict(output=output, prefix_output=prefix, prefix_lse=prefix_lse,
                                      suffix_output=suffix, suffix_lse=suffix_lse, output_lse=output_lse,
                                      prefill_tokens_with_context=batch.query_lens[0] if p.first_seq_only else None)
        return MergeCall(kwargs, NHDLayout(), prefix, suffix, output, concurrent=p.concurrent)


class VllmTritonMerge(_Merge, VllmTritonTarget):
    """vLLM's Triton ``merge_attn_states`` (module docstring): one program per (token, head); fp16/fp32 under the
    interpreter, fp16/bf16 compiled (:class:`~kvfuzz.fuzz.targets.triton_runtime.VllmTritonTarget`)."""

    name = "vllm.merge_attn_states"
    kernel = TRITON_MERGE
    sanitize_by_default = False
    description = "vLLM Triton merge_attn_states: two attention states merged by their log-sum-exps"
    capabilities = Capabilities(
        contract=Contract.MERGE, devices=("cpu", "cuda"), dtypes=("float16", "float32"), head_sizes=HEAD_SIZES,
        block_sizes=(16,),  # no cache: the batches' blocks are never read
    )

    def kernel_module(self) -> str:
        return TRITON_MERGE[0]

    def run(self, call: KernelCall) -> torch.Tensor:
        self.load(call)
        return super().run(call)


class VllmTorchMerge(_Merge):
    """vLLM's CPU ``merge_attn_states`` (``_merge_attn_states_torch`` in merge_attn_states.py: what the dispatcher
    takes on a CPU platform): fp32 torch arithmetic, any head size; fast enough for long CPU campaigns."""

    name = "vllm.merge_attn_states_cpu"
    kernel = ("vllm.v1.attention.ops.merge_attn_states", "_merge_attn_states_torch")
    description = "vLLM's torch merge_attn_states (its CPU platform path)"
    capabilities = Capabilities(contract=Contract.MERGE, devices=("cpu",), dtypes=("float32", "float16", "bfloat16"),
                                head_sizes=HEAD_SIZES, block_sizes=(16,))

    def installed(self) -> Availability:
        if module_file(self.kernel[0]) is None:
            return Availability(False, f"the installed vllm has no {self.kernel[0]} (kvfuzz pins vllm 0.33.0)")
        return Availability(True, f"torch (CPU); {self.kernel[0]}: installed, not loaded (--check loads it)")

    def availability(self) -> Availability:
        try:
            prepare_triton_runtime()  # importing vllm imports triton: its interpreter first on a CPU
            getattr(importlib.import_module(self.kernel[0]), self.kernel[1])
        except Exception as e:
            return Availability(False, f"importing {self.kernel[0]} failed: {type(e).__name__}: {e}")
        return Availability(True, f"torch (CPU); {self.kernel[0]}")

    def run(self, call: KernelCall) -> torch.Tensor:
        getattr(importlib.import_module(self.kernel[0]), self.kernel[1])(**call.kwargs)
        return call.output


class VllmCudaMerge(_Merge):
    """vLLM's CUDA ``merge_attn_states`` op through ``vllm._custom_ops.merge_attn_states`` (module docstring):
    fp32/fp16/bf16, head sizes multiples of 8. Needs a CUDA device and vLLM's ``_C_stable_libtorch`` extension
    (``kernels()`` returns the wrapper; a test hands a torch stand-in for the op on CPU)."""

    name = "vllm.merge_attn_states_cuda"
    kernel = CUDA_MERGE
    description = "vLLM CUDA merge_attn_states op (torch.ops._C, vllm._custom_ops)"
    capabilities = Capabilities(contract=Contract.MERGE, devices=("cuda",),
                                dtypes=("float16", "bfloat16", "float32"), head_sizes=HEAD_SIZES, block_sizes=(16,))

    def installed(self) -> Availability:
        if importlib.util.find_spec("vllm") is None:
            return Availability(False, "python package 'vllm' is not installed")
        if not torch.cuda.is_available():
            return Availability(False, "the CUDA merge_attn_states op runs on CUDA only; this machine has no CUDA "
                                       f"device (vLLM 0.33.0's vllm/{CUDA_LIBRARY})")
        if module_file("vllm._custom_ops") is None:
            return Availability(False, "the installed vllm has no vllm/_custom_ops.py")
        return Availability(True, f"CUDA; vllm/{CUDA_LIBRARY}: installed, not loaded (--check loads it)", "cuda")

    def availability(self) -> Availability:
        pre = self.installed()
        if not pre.ok:
            return pre
        try:
            quiet_vllm()
            importlib.import_module("vllm._C_stable_libtorch")
            importlib.import_module(CUDA_MERGE[0])
        except Exception as e:  # the extension fails to load: a wrong torch ABI, a missing CUDA library
            return Availability(False, f"loading vLLM's CUDA ops failed: {type(e).__name__}: {e}")
        if not hasattr(torch.ops._C, "merge_attn_states"):
            return Availability(False, "torch.ops._C has no merge_attn_states after loading vLLM's extension")
        return Availability(True, f"CUDA; vllm/{CUDA_LIBRARY}", "cuda")

    def kernels(self):
        """``vllm._custom_ops.merge_attn_states``."""
        return getattr(importlib.import_module(CUDA_MERGE[0]), CUDA_MERGE[1])

    def run(self, call: KernelCall) -> torch.Tensor:
        self.load(call)
        self.kernels()(**call.kwargs)
        return call.output


#: This family's targets (registry.BUILTIN lists them by name) and guard signatures (none: no paged call).
TARGETS = (VllmTritonMerge, VllmTorchMerge, VllmCudaMerge)
SIGNATURES = ()

__all__ = ["CUDA_LIBRARY", "CUDA_MERGE", "HEAD_SIZES", "SIDE_LOAD_ELEMENTS", "SIDE_LOAD_SWEEPS", "SIGNATURES",
           "TARGETS", "TRITON_MERGE", "MergeCall", "MergePath", "VllmCudaMerge", "VllmTorchMerge", "VllmTritonMerge",
           "merge_path", "side_load"]
