"""FlashInfer's paged attention (flashinfer-python 0.7.2.post1; CUDA only, its kernels JIT-compiled with nvcc
on first use of each configuration):

- ``flashinfer.batch_decode``: ``BatchDecodeWithPagedKVCacheWrapper`` (flashinfer/decode.py), decode only,
  unified contract: every sequence's ``kv_len`` tokens, the current one included, are in the pages.
- ``flashinfer.batch_decode_tc``: the same wrapper with ``use_tensor_cores=True`` (decode through the prefill
  kernels, every GQA group size; the CUDA-core decode dispatches 1, 2, 3, 4, 6, 8, 16 only).
- ``flashinfer.batch_prefill``: ``BatchPrefillWithPagedKVCacheWrapper`` (flashinfer/prefill.py) with
  ``causal=True``, unified contract: the new tokens were appended to the pages before attention, as vLLM's
  (vllm/v1/attention/backends/flashinfer.py) and SGLang's (flashinfer_backend.py) backends do
  (``append_paged_kv_cache`` / their own cache writer, then ``run``); decode sequences (qo_len 1) mix in.
- ``flashinfer.append_paged_kv_cache``: flashinfer/page.py's cache writer (writer contract, checked like
  vLLM's reshape_and_cache by :mod:`kvfuzz.fuzz.harness.writer`).

Metadata from kvfuzz's one batch model (:func:`kvfuzz.contracts.model.csr.page_lists`): page ids = the block
table's, ``kv_indptr`` over pages, ``kv_last_page_len`` in ``1 .. page_size``, ``qo_indptr`` =
query_start_loc; all int32 on the GPU, as FlashInfer's tests build them. A CSR tail (``Batch.csr_tail``,
entries past ``kv_indptr[-1]`` no kernel may read) is appended as page ids (``slot // page_size``: -1 and the
pool size stay out of range). Caches: :class:`~kvfuzz.contracts.caches.flashinfer_layouts.FlashInferLayout`,
NHD or HND, one 5-D tensor or a (k, v) tuple, chosen from the batch's seed (one wrapper per kv_layout).

Conventions (flashinfer/decode.py ``_plan_impl``/``run``): ``window_left = W - 1`` for kvfuzz's window of W
keys (FlashInfer's window is left-inclusive: a query at p sees keys p - window_left .. p), -1 for none;
``logits_soft_cap`` = softcap (``cap * tanh(scale * qk / cap)``), 0 for none; ``sm_scale`` = the batch's (None:
FlashInfer's default ``1/sqrt(head_dim)``); fp8 caches are ``torch.float8_e4m3fn``/``float8_e5m2`` tensors
holding ``k / k_scale``, with ``kv_data_type`` set in plan and ``k_scale``/``v_scale`` floats to run (run
multiplies ``sm_scale`` by ``k_scale`` and the output by ``v_scale``, after the kernel rounded it: the wrappers'
:data:`NUMERICS` declare that second rounding and the softcap's ``tanh.approx`` to the tolerance).

Caller checks (this family's home holds them): each target names its call's
:class:`~kvfuzz.fuzz.targets.signature.PageListSignature` (:data:`SIGNATURES`) as ``checked_kernel``, so every
campaign example also goes through the checks the guard's plan()/run() (or append) hooks apply
(:func:`check_call`: :func:`plan_of`, :func:`run_checks`, :func:`append_checks`). Importing this module does not
import flashinfer.

Compile keys: FlashInfer JIT-compiles one module per (q dtype, kv dtype, o dtype, index dtype, head_dim,
pos_encoding_mode, use_sliding_window, use_logits_soft_cap) (flashinfer/jit/attention/modules.py
``gen_batch_decode_module``/``gen_batch_prefill_module``); heads, GQA group, page size and the window's size are
runtime arguments. A campaign's pinned configurations (strategies/configs.py) fix those compile keys per chunk
and leave heads, page size and the window's size free (``runtime_fields``), so one chunk costs at most one
compile (tens of seconds; docs/benchmarks.md, "FlashInfer") and still draws every page size and GQA group. The JIT
cache is ``$FLASHINFER_WORKSPACE_BASE`` (FlashInfer's own default: the home directory); set it before the first
flashinfer import.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Mapping

import attrs
import torch

from kvfuzz.contracts.caches.flashinfer_layouts import FlashInferLayout
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.calls.page_contents import check_append, check_current_tokens
from kvfuzz.contracts.calls.page_lists import PagePlan, check_plan, check_run, make_plan
from kvfuzz.contracts.checks.reference import Numerics
from kvfuzz.contracts.checks.violations import Check, Violation
from kvfuzz.contracts.model.batch import Batch, positions
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.csr import page_lists
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.writer import WriterInputs, writer_inputs

from .base import NOT_LOADED, Availability, KernelCall, Target, require_decode, try_import
from .signature import PageListSignature

#: The release kvfuzz reads FlashInfer's API from (benchmarks/flashinfer_bundle.sh carries it).
FLASHINFER_VERSION = "0.7.2.post1"
CUDA_ONLY = ("FlashInfer's kernels run on CUDA only (JIT-compiled with nvcc); this machine has no CUDA device "
             "(on a GPU machine: pip install flashinfer-python==" + FLASHINFER_VERSION + ")")
#: Float workspace FlashInfer's examples allocate (128 MB, zero-initialized before first use).
WORKSPACE_BYTES = 128 * 1024 * 1024

#: The wrappers' arithmetic beyond the FlashAttention family (docs/tolerance.md, "Declared numerics"): the softcap is
#: ``tanh(logits * sm_scale / c)`` with ``math::tanh`` = PTX ``tanh.approx.f32`` (data/include/flashinfer/
#: attention/variants.cuh ``DefaultAttention::LogitsTransform``, math.cuh), and with an fp8 cache the kernels
#: accumulate P@V over the value codes and write the output in their units, rounded to the dtype, and run() then
#: does ``out *= v_scale`` on it (flashinfer/prefill.py ``BatchPrefillWithPagedKVCacheWrapper.run``, flashinfer/
#: decode.py ``BatchDecodeWithPagedKVCacheWrapper.run``: "TODO(Zihao): fused into kernel"), a second rounding.
NUMERICS = Numerics(tanh_approx=True, v_scale_after_output=True)

_HEAD_SIZES = (64, 128, 256)
_PAGE_SIZES = (1, 16, 5, 64, 8, 32, 3)


def _on_cuda() -> bool:
    return torch.cuda.is_available()


def _not_installed() -> str:
    return f"python package 'flashinfer' is not installed (pip install flashinfer-python=={FLASHINFER_VERSION}, " \
           "or source benchmarks/gpu_env.sh with .device/flashinfer.tgz carried)"


#: The attribute kvfuzz.fuzz.bench.bugs.package_copy sets on a patched copy of flashinfer (a re-injected bug's,
#: imported as ``flashinfer`` in its own process): the installed package's targets refuse to run it.
PATCHED_COPY_ATTR = "__kvfuzz_patched__"


def flashinfer_module():
    """``import flashinfer`` (raises ImportError/RuntimeError as flashinfer does)."""
    return importlib.import_module("flashinfer")


def layout_for(batch: Batch) -> FlashInferLayout:
    """The cache form a batch gets, from its seed: NHD/HND x one 5-D tensor / a (k, v) tuple."""
    return FlashInferLayout("NHD" if batch.seed % 2 == 0 else "HND", combined=(batch.seed // 2) % 2 == 0)


def page_list_tensors(batch: Batch, lens: tuple[int, ...], device, dtype=torch.int32,
                      tail: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kv_indptr [N + 1], kv_indices, kv_last_page_len [N])`` of positions ``0 .. lens[i]-1`` (page ids =
    block ids; :func:`~kvfuzz.contracts.model.csr.page_lists`), ``batch.csr_tail`` appended to the indices as
    page ids when ``tail``; ``dtype`` on ``device``."""
    pl = page_lists(batch, lens)
    idx = pl.page_indices
    if tail and batch.csr_tail:
        idx = torch.cat([idx, torch.tensor([t // batch.block_size for t in batch.csr_tail], dtype=torch.int64)])
    return (pl.page_indptr.to(device=device, dtype=dtype), idx.to(device=device, dtype=dtype),
            pl.last_page_len.to(device=device, dtype=dtype))


def window_left(batch: Batch) -> int:
    """FlashInfer's ``window_left`` for kvfuzz's window of W keys: ``W - 1`` (left-inclusive), -1 for none."""
    return -1 if batch.sliding_window is None else batch.sliding_window - 1


# ---- the calls this family checks: page lists in plan(), q and the cache in run(); the guard's FlashInfer hooks
# (kvfuzz.fuzz.guard.flashinfer) wrap them where FlashInfer defines them and run these same checks ---------------
def plan_of(kind: str, a: dict[str, Any], kv_layout: str = "NHD") -> PagePlan:
    """The :class:`PagePlan` of a plan() call's arguments by name (decode: flashinfer/decode.py
    ``BatchDecodeWithPagedKVCacheWrapper.plan`` names; prefill: flashinfer/prefill.py
    ``BatchPrefillWithPagedKVCacheWrapper.plan`` names) for a wrapper of ``kv_layout``. ``data_type`` (decode,
    deprecated) stands for both dtypes when given. Raises KeyError when a page-list argument is missing."""
    q_dt = a.get("q_data_type", "float16")
    kv_dt = a.get("kv_data_type")
    if a.get("data_type") is not None:
        q_dt = q_dt or a["data_type"]
        kv_dt = kv_dt or a["data_type"]
    if kind == "decode":
        return make_plan("decode", a["indptr"], a["indices"], a["last_page_len"], a["num_qo_heads"],
                         a["num_kv_heads"], a["head_dim"], a["page_size"], q_data_type=q_dt, kv_data_type=kv_dt,
                         kv_layout=kv_layout, window_left=a.get("window_left", -1))
    return make_plan("prefill", a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"],
                     a["num_qo_heads"], a["num_kv_heads"], a["head_dim_qk"], a["page_size"],
                     qo_indptr=a["qo_indptr"], q_data_type=q_dt, kv_data_type=kv_dt, kv_layout=kv_layout,
                     window_left=a.get("window_left", -1), causal=a.get("causal", False))


def run_checks(plan: PagePlan | None, a: dict[str, Any], kernel: str, new_kv: tuple | None = None,
               tokens: bool = True) -> list[Violation]:
    """What the run() hook checks: run()'s ``q`` and ``paged_kv_cache`` against ``plan``
    (:func:`~kvfuzz.contracts.calls.page_lists.check_run`) and, with the call's new tokens ``new_kv = (k, v)``
    (``[rows, Hkv, D]`` in qo_indptr order) and ``tokens``, the current tokens in the pages
    (:func:`~kvfuzz.contracts.calls.page_contents.check_current_tokens`, skipped after a memory-unsafe
    violation: the lists cannot be followed then)."""
    out = check_run(plan, a.get("q"), a.get("paged_kv_cache"), kernel)
    if new_kv is not None and tokens and plan is not None and not any(v.check.memory_unsafe for v in out):
        out += check_current_tokens(plan, a["paged_kv_cache"], new_kv[0], new_kv[1], a.get("k_scale"),
                                    a.get("v_scale"))
    return out


def append_checks(a: dict[str, Any]) -> list[Violation]:
    """What the append_paged_kv_cache hook checks (:func:`~kvfuzz.contracts.calls.page_contents.check_append`),
    on its arguments by name (flashinfer/page.py ``append_paged_kv_cache``)."""
    return check_append(a["append_key"], a["append_value"], a["batch_indices"], a["positions"], a["paged_kv_cache"],
                        a["kv_indices"], a["kv_indptr"], a["kv_last_page_len"], a.get("kv_layout", "NHD"))


def check_call(kernel: str, args: Mapping[str, Any], kv_layout: str = "NHD", key: Any = None,
               value: Any = None) -> list[Violation]:
    """Everything the hooks check on one call of ``kernel`` (a key of :data:`CHECKED_KERNELS`), from its
    arguments by name: for a wrapper, plan()'s (:func:`~kvfuzz.contracts.calls.page_lists.check_plan`) then
    run()'s (:func:`run_checks`, the current tokens when ``key``/``value`` ``[rows, Hkv, D]`` are given and the
    plan is well formed) for a wrapper of ``kv_layout``; for append_paged_kv_cache, :func:`append_checks`.
    Raises KeyError for an unknown kernel or a missing argument."""
    kind = CHECKED_KERNELS[kernel]
    if kind == "append":
        return append_checks(args)
    plan = plan_of(kind, args, kv_layout)
    out = check_plan(plan)
    sound = not any(v.check.memory_unsafe or v.check in (Check.KV_INDPTR, Check.INDEX_DTYPE) for v in out)
    return out + run_checks(plan, args, kernel, None if key is None else (key, value), tokens=sound)


BATCH_DECODE = PageListSignature("flashinfer.BatchDecodeWithPagedKVCacheWrapper", "decode",
                                 "BatchDecodeWithPagedKVCacheWrapper", "flashinfer", check_call)
BATCH_PREFILL = PageListSignature("flashinfer.BatchPrefillWithPagedKVCacheWrapper", "prefill",
                                  "BatchPrefillWithPagedKVCacheWrapper", "flashinfer", check_call)
APPEND_PAGED_KV_CACHE = PageListSignature("flashinfer.append_paged_kv_cache", "append", "append_paged_kv_cache",
                                          "flashinfer", check_call)

#: This family's checked calls (the guard collects them through kvfuzz.fuzz.targets.registry.FAMILIES).
SIGNATURES = (BATCH_DECODE, BATCH_PREFILL, APPEND_PAGED_KV_CACHE)
#: Checked call name -> its kind ("decode", "prefill", "append"): what :func:`check_call` dispatches on.
CHECKED_KERNELS = {s.name: s.kind for s in SIGNATURES}


# ---- the targets ----------------------------------------------------------------------------------------------
class FlashInferTarget(Target):
    """Shared availability (CUDA and an importable flashinfer), layouts and wrapper reuse."""

    #: Heads, page size and the window's size are run-time arguments of FlashInfer's modules (module docstring):
    #: a pinned chunk stays in one module (dtypes, head size, window and soft cap on or off) and draws them.
    runtime_fields = frozenset({"heads", "block_size", "window"})
    #: ``flashinfer`` attribute of the wrapper class (None for the writer).
    wrapper_class: str | None = None
    #: Constructor keywords of the wrapper besides the workspace and kv_layout (the tensor-core decode's
    #: ``use_tensor_cores=True``).
    wrapper_kwargs: dict = {}

    def __init__(self) -> None:
        self._wrappers: dict[str, object] = {}
        self._workspace: torch.Tensor | None = None

    def installed(self) -> Availability:
        if not _on_cuda():
            return Availability(False, CUDA_ONLY)
        if importlib.util.find_spec("flashinfer") is None:
            return Availability(False, _not_installed())
        return Availability(True, f"CUDA, JIT-compiled; flashinfer: {NOT_LOADED}", "cuda")

    def availability(self) -> Availability:
        if not _on_cuda():
            return Availability(False, CUDA_ONLY)
        if importlib.util.find_spec("flashinfer") is None:
            return Availability(False, _not_installed())
        fi, why = try_import("flashinfer", self.flashinfer)
        if why:
            return why
        version = getattr(fi, "__version__", "?")
        note = "" if version == FLASHINFER_VERSION else f" (kvfuzz read the API of {FLASHINFER_VERSION})"
        return Availability(True, f"CUDA, JIT-compiled; flashinfer {version}{note}", "cuda")

    def flashinfer(self):
        """The flashinfer module this target runs: the installed package (:func:`flashinfer_module`). Raises
        RuntimeError when the ``flashinfer`` of this process is a re-injected bug's patched copy
        (:data:`PATCHED_COPY_ATTR`): its kernels are not the installed package's."""
        fi = flashinfer_module()
        copy = getattr(fi, PATCHED_COPY_ATTR, None)
        if copy is not None:
            raise RuntimeError(f"flashinfer in this process is the patched copy of {copy}, not the installed "
                               f"package: run {self.name} in a process of its own")
        return fi

    def layout(self, batch: Batch) -> FlashInferLayout:
        return layout_for(batch)

    def wrapper(self, kv_layout: str, device: torch.device):
        """One wrapper per kv_layout (plan() is called for every call; the workspace is shared)."""
        key = f"{kv_layout}@{device}"
        if key not in self._wrappers:
            if self._workspace is None or self._workspace.device != device:
                self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            cls = getattr(self.flashinfer(), self.wrapper_class)
            self._wrappers[key] = cls(self._workspace, kv_layout, **self.wrapper_kwargs)
        return self._wrappers[key]

    def path(self, batch: Batch) -> str:
        lay = layout_for(batch)
        return f"{lay.kv_layout},{'5d' if lay.combined else 'kv-tuple'},{batch.kv_cache_dtype}"


#: kwargs of a wrapper call that go to plan(); the rest (q, paged_kv_cache, k_scale, v_scale) go to run().
DECODE_PLAN_ARGS = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                    "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "sm_scale")
PREFILL_PLAN_ARGS = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
                     "num_kv_heads", "head_dim_qk", "page_size", "causal", "pos_encoding_mode", "window_left",
                     "logits_soft_cap", "q_data_type", "kv_data_type", "sm_scale")
RUN_ARGS = ("q", "paged_kv_cache", "k_scale", "v_scale")


def _common(batch: Batch, data: BatchData, cache: CacheState) -> dict:
    fp8 = batch.fp8_dtype is not None
    lay = cache.layout if isinstance(cache.layout, FlashInferLayout) else layout_for(batch)
    return dict(
        num_qo_heads=batch.num_heads, num_kv_heads=batch.num_kv_heads, page_size=batch.block_size,
        pos_encoding_mode="NONE", window_left=window_left(batch), logits_soft_cap=batch.softcap or 0.0,
        q_data_type=batch.torch_dtype, kv_data_type=batch.cache_dtype, sm_scale=batch.sm_scale,
        q=data.query.to(cache.key_cache.device), paged_kv_cache=lay.paged_kv_cache(cache.key_cache, cache.value_cache),
        k_scale=batch.k_scale if fp8 else None, v_scale=batch.v_scale if fp8 else None,
    )


#: Group sizes FlashInfer's CUDA-core decode kernels are compiled for: flashinfer-python 0.7.2.post1's
#: flashinfer/data/include/flashinfer/utils.cuh ``DISPATCH_GQA_GROUP_SIZE`` (used by csrc/batch_decode.cu's plan
#: and run) dispatches 1, 2, 3, 4, 6, 8 and 16 (flashinfer-ai/flashinfer main, 2026-08: 1, 2, 3, 4, 6, 8); any
#: other raises "Unsupported group_size: N" (a RuntimeError from the JIT module;
#: regressions/flashinfer.batch_decode-configuration-rejected-* replays it). SGLang switches to the tensor-core
#: decode for such models (:class:`FlashInferBatchDecodeTC`).
DECODE_GQA_RATIOS = (1, 2, 3, 4, 6, 8, 16)
#: The tensor-core decode runs FlashInfer's prefill kernels, whose GQA group size is a runtime
#: ``uint_fastdiv group_size`` (flashinfer/data/include/flashinfer/attention/prefill.cuh): any group size;
#: declared for the sizes kvfuzz draws (at most 16 query heads).
TC_DECODE_GQA_RATIOS = tuple(range(1, 17))


class FlashInferBatchDecode(FlashInferTarget):
    """``BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout).plan(indptr, indices, last_page_len,
    num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode="NONE", window_left, logits_soft_cap,
    q_data_type, kv_data_type, sm_scale)`` then ``run(q [N, H, D], paged_kv_cache, k_scale=, v_scale=)``
    (flashinfer/decode.py; arguments after page_size by keyword: positional use is deprecated).

    Decode only, unified contract: the page lists cover all ``seq_len`` positions of every sequence, the current
    token's included (``last_page_len = (seq_len - 1) % page_size + 1``). Index tensors int32 on the GPU. The
    CUDA-core decode path (``use_tensor_cores=False``, the default) is what this target runs; it dispatches GQA
    group sizes 1, 2, 3, 4, 6, 8 and 16 only (:data:`DECODE_GQA_RATIOS`)."""

    name = "flashinfer.batch_decode"
    upstream = ("flashinfer", "flashinfer/decode.py", "BatchDecodeWithPagedKVCacheWrapper.run")
    description = "FlashInfer BatchDecodeWithPagedKVCacheWrapper over page lists (decode only, unified contract)"
    wrapper_class = "BatchDecodeWithPagedKVCacheWrapper"
    checked_kernel = BATCH_DECODE
    numerics = NUMERICS
    capabilities = Capabilities(
        contract=Contract.UNIFIED, devices=("cuda",), dtypes=("float16", "bfloat16"), head_sizes=_HEAD_SIZES,
        block_sizes=_PAGE_SIZES, kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"), decode_only=True,
        features=("sliding_window", "softcap"), metadata="csr", gqa_ratios=DECODE_GQA_RATIOS,
    )

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        require_decode(self.name, batch)
        dev = cache.key_cache.device
        indptr, indices, last = page_list_tensors(batch, batch.seq_lens, dev)
        kw = dict(indptr=indptr, indices=indices, last_page_len=last, head_dim=batch.head_size,
                  **_common(batch, data, cache))
        out = torch.empty((batch.num_seqs, batch.num_heads, batch.head_size), dtype=batch.torch_dtype, device=dev)
        return KernelCall(kw, cache.layout, cache.key_cache, cache.value_cache, out)

    def run(self, call: KernelCall) -> torch.Tensor:
        return _plan_and_run(self, call, DECODE_PLAN_ARGS)


class FlashInferBatchDecodeTC(FlashInferBatchDecode):
    """The tensor-core decode: ``BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout,
    use_tensor_cores=True)`` (a plain constructor flag, flashinfer/decode.py ``__init__``), then the same
    ``plan``/``run`` calls as :class:`FlashInferBatchDecode`. Its plan() (the ``use_tensor_cores`` branch of
    ``BatchDecodeWithPagedKVCacheWrapper.plan``) builds ``qo_indptr = arange(batch_size + 1)`` and runs FlashInfer's
    batch prefill kernels: ``get_batch_prefill_module("fa2", ...)`` for fp16/bf16 q and kv, and for an fp8 cache
    the backend ``determine_attention_backend`` picks (flashinfer/utils.py: FA3 needs an fp8 q, so fa2 here).
    Their GQA group size is a runtime argument, so every group size works (:data:`TC_DECODE_GQA_RATIOS`), as
    SGLang relies on for the group sizes the CUDA-core decode rejects. Same contract, page lists and checks
    (the guard wraps the same class); compile keys those of a prefill module."""

    name = "flashinfer.batch_decode_tc"
    upstream = ("flashinfer", "flashinfer/decode.py", "BatchDecodeWithPagedKVCacheWrapper.run (use_tensor_cores=True)")
    description = ("FlashInfer BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True): decode through the "
                   "prefill kernels, any GQA group size (unified contract)")
    wrapper_kwargs = {"use_tensor_cores": True}
    capabilities = attrs.evolve(FlashInferBatchDecode.capabilities, gqa_ratios=TC_DECODE_GQA_RATIOS)

    def path(self, batch: Batch) -> str:
        return f"tensor-cores,{super().path(batch)}"


class FlashInferBatchPrefill(FlashInferTarget):
    """``BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout).plan(qo_indptr, paged_kv_indptr,
    paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=True,
    pos_encoding_mode="NONE", window_left, logits_soft_cap, q_data_type, kv_data_type, sm_scale)`` then
    ``run(q [T, H, D], paged_kv_cache, k_scale=, v_scale=)`` (flashinfer/prefill.py).

    Unified contract: the page lists cover all ``seq_len = ctx_len + query_len`` positions, the new tokens
    appended before the call (vLLM's and SGLang's FlashInfer backends write them first); causal with the
    queries aligned to the end of each sequence (query j at position ``ctx_len + j``). Decode sequences (one
    query row) may be mixed in."""

    name = "flashinfer.batch_prefill"
    upstream = ("flashinfer", "flashinfer/prefill.py", "BatchPrefillWithPagedKVCacheWrapper.run")
    description = ("FlashInfer BatchPrefillWithPagedKVCacheWrapper, causal, over page lists with the new tokens "
                   "appended (unified contract)")
    wrapper_class = "BatchPrefillWithPagedKVCacheWrapper"
    checked_kernel = BATCH_PREFILL
    numerics = NUMERICS
    capabilities = Capabilities(
        contract=Contract.UNIFIED, devices=("cuda",), dtypes=("float16", "bfloat16"), head_sizes=_HEAD_SIZES,
        block_sizes=_PAGE_SIZES, kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),
        features=("sliding_window", "softcap"), metadata="csr",
    )

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        dev = cache.key_cache.device
        indptr, indices, last = page_list_tensors(batch, batch.seq_lens, dev)
        kw = dict(qo_indptr=batch.query_start_loc_tensor(dev).to(torch.int32), paged_kv_indptr=indptr,
                  paged_kv_indices=indices, paged_kv_last_page_len=last, head_dim_qk=batch.head_size, causal=True,
                  **_common(batch, data, cache))
        out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=batch.torch_dtype, device=dev)
        return KernelCall(kw, cache.layout, cache.key_cache, cache.value_cache, out)

    def run(self, call: KernelCall) -> torch.Tensor:
        return _plan_and_run(self, call, PREFILL_PLAN_ARGS)

    def path(self, batch: Batch) -> str:
        kinds = ("decode" if batch.decode_seqs else "") + ("+prefill" if batch.prefill_seqs else "")
        return f"{super().path(batch)},{kinds.strip('+')}"


def _plan_and_run(target: FlashInferTarget, call: KernelCall, plan_args: tuple[str, ...]) -> torch.Tensor:
    kw = call.kwargs
    lay: FlashInferLayout = call.layout
    w = target.wrapper(lay.kv_layout, call.key_cache.device)
    w.plan(**{a: kw[a] for a in plan_args})  # every argument by its name (positional options are deprecated)
    o = w.run(kw["q"], kw["paged_kv_cache"], k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    call.output.copy_(o)
    return call.output


class FlashInferAppendPagedKvCache(FlashInferTarget):
    """``append_paged_kv_cache(append_key [nnz, Hkv, D], append_value, batch_indices [nnz], positions [nnz],
    paged_kv_cache, kv_indices, kv_indptr [N + 1], kv_last_page_len [N], kv_layout)`` (flashinfer/page.py;
    csrc/page.cu). Writer contract: row r goes to position ``positions[r]`` of sequence ``batch_indices[r]``
    through the page lists, which already include the appended tokens (lists over ``seq_len``). Every index
    tensor int32 (the C++ side casts to ``int32_t*``); ``append_key``/``append_value`` in the cache's dtype
    (for fp8 caches the codes ``round_fp8(k / k_scale)``: FlashInfer's writer does not scale). FlashInfer has
    no padding rows, so the writer inputs' padding rows (slot -1) are left out."""

    name = "flashinfer.append_paged_kv_cache"
    upstream = ("flashinfer", "flashinfer/page.py", "append_paged_kv_cache")
    description = "FlashInfer append_paged_kv_cache: new tokens' k/v into the pages via page lists (writer)"
    checked_kernel = APPEND_PAGED_KV_CACHE
    capabilities = Capabilities(
        contract=Contract.WRITER, devices=("cuda",), dtypes=("float16", "bfloat16"), head_sizes=_HEAD_SIZES,
        block_sizes=_PAGE_SIZES, kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"), metadata="csr",
    )

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        dev = cache.key_cache.device
        inputs = writer_inputs(batch, data)
        real = inputs.token >= 0
        inputs = WriterInputs(inputs.key[real], inputs.value[real], inputs.slot_mapping[real], inputs.token[real],
                              inputs.cache_key[real], inputs.cache_value[real])
        seq, pos = positions(batch.query_lens, offsets=batch.ctx_lens)  # query order = the rows' token order
        indptr, indices, last = page_list_tensors(batch, batch.seq_lens, dev)
        lay = cache.layout if isinstance(cache.layout, FlashInferLayout) else layout_for(batch)
        ak = inputs.cache_key.to(device=dev, dtype=cache.key_cache.dtype).contiguous()
        av = inputs.cache_value.to(device=dev, dtype=cache.value_cache.dtype).contiguous()
        kwargs = dict(append_key=ak, append_value=av, batch_indices=seq.to(device=dev, dtype=torch.int32),
                      positions=pos.to(device=dev, dtype=torch.int32),
                      paged_kv_cache=lay.paged_kv_cache(cache.key_cache, cache.value_cache), kv_indices=indices,
                      kv_indptr=indptr, kv_last_page_len=last, kv_layout=lay.kv_layout, _inputs=inputs)
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, output=cache.key_cache,
                          key=ak, value=av)

    def run(self, call: KernelCall) -> torch.Tensor:
        fi = self.flashinfer()
        fi.append_paged_kv_cache(**{k: v for k, v in call.kwargs.items() if not k.startswith("_")})
        return call.key_cache


#: This family's built-in targets (kvfuzz.fuzz.targets.registry.BUILTIN lists them by name, in this order).
TARGETS = (FlashInferBatchDecode, FlashInferBatchDecodeTC, FlashInferBatchPrefill, FlashInferAppendPagedKvCache)

__all__ = ["APPEND_PAGED_KV_CACHE", "BATCH_DECODE", "BATCH_PREFILL", "CHECKED_KERNELS", "CUDA_ONLY",
           "DECODE_GQA_RATIOS", "DECODE_PLAN_ARGS", "FLASHINFER_VERSION", "FlashInferAppendPagedKvCache",
           "FlashInferBatchDecode", "FlashInferBatchDecodeTC", "FlashInferBatchPrefill", "FlashInferTarget",
           "NUMERICS", "PATCHED_COPY_ATTR", "PREFILL_PLAN_ARGS", "RUN_ARGS", "SIGNATURES", "TC_DECODE_GQA_RATIOS",
           "append_checks", "check_call", "layout_for", "page_list_tensors", "plan_of", "run_checks", "window_left"]
