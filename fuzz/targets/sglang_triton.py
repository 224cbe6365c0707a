"""SGLang's Triton attention kernels (sglang 0.5.23, sglang/kernels/ops/attention/): ``extend_attention_fwd``
(prefix contract) and ``decode_attention_fwd`` (unified contract), compiled on CUDA, under Triton's interpreter
on CPU. Both read a token pool through CSR page lists (:mod:`kvfuzz.contracts.model.csr`).

Where the kernels come from (:func:`prepare_sglang_runtime`), first that exists:

1. ``$KVFUZZ_SGLANG_TREE``: a folder holding :data:`KERNEL_FILES` (the wheel's own files, verbatim);
2. ``<sys.prefix>/share/kvfuzz/sglang/``, where ``make setup`` extracts them from the pinned wheel
   (:data:`SGLANG_VERSION`, downloaded with ``--no-deps``: none of SGLang's runtime is installed);
3. an installed ``sglang`` package (a GPU machine with SGLang; its own ``__init__`` files then run).

For 1 and 2, the package ``__init__`` files (which import SGLang's whole runtime) are replaced by empty
stand-in packages registered in ``sys.modules`` whose ``__path__`` is the tree, and ``sglang.srt.utils`` (whose
``__init__`` imports pillow, orjson, requests, ...) by a stand-in module with the five helpers the two kernel
files use (:func:`_srt_utils_standin`), behaving as sglang/srt/utils/common.py does on a CUDA or CPU build of
torch. ``sglang/srt/environ.py`` is real (standard library only).

On CPU the interpreter computes bf16 wrongly (triton-lang/triton#11584) and rounds fp32/fp16 -> fp8 downcasts
wrongly (triton-lang/triton#8322: a lost mantissa carry, no saturation): these targets declare fp16/fp32 on
CPU, fp16/bf16 on CUDA, and fp8 caches only where no kernel downcast to fp8 happens (:class:`SglangDecodeAttentionFwd`).

The family's home: the calls its kernels take (each a :class:`~kvfuzz.fuzz.targets.signature.KernelSignature`,
named ``sglang.<function>``: vLLM ships its own ``decode_attention_fwd``), listed in :data:`SIGNATURES` for the
guard, then the targets naming them. Importing this module imports neither sglang nor triton.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from kvfuzz.contracts.caches.layouts import CacheLayout, NHDLayout
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.calls.declaration import KernelDeclaration, KernelPath
from kvfuzz.contracts.calls.paged_call import CacheReads, CsrArgs, NewTokensCached, PagedCall, index_values, is_tensor
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.csr import token_slot_lists, token_table
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.padding import padding

from .base import NOT_LOADED, Availability, KernelCall, require_decode
from .decode_attention import DECODE_ATTENTION_FAMILY, stage1
from .signature import KernelSignature
from .triton_runtime import (
    TRITON_TOO_EARLY,
    VllmTritonTarget,
    on_cuda,
    poisoned_scratch,
    prepare_triton_runtime,
    sinks,
    triton_imported_too_early,
)

#: The SGLang release whose kernels kvfuzz pins (Makefile: SGLANG_PIN).
SGLANG_VERSION = "0.5.23"
#: Environment variable naming a folder with :data:`KERNEL_FILES` (e.g. carried to a GPU machine).
TREE_ENV = "KVFUZZ_SGLANG_TREE"
#: The wheel's files the two kernels need, verbatim (what ``make setup`` extracts).
KERNEL_FILES = (
    "sglang/kernels/ops/attention/decode_attention.py",
    "sglang/kernels/ops/attention/extend_attention.py",
    "sglang/kernels/ops/attention/score_mod.py",
    "sglang/srt/environ.py",
)
#: Packages whose real ``__init__`` imports SGLang's runtime: empty stand-ins over the tree.
_STANDIN_PACKAGES = ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention", "sglang.srt")
EXTEND_MODULE = "sglang.kernels.ops.attention.extend_attention"
DECODE_MODULE = "sglang.kernels.ops.attention.decode_attention"
_SETUP_HINT = (f"run `make setup` (extracts sglang=={SGLANG_VERSION}'s kernel files into "
               f"<sys.prefix>/share/kvfuzz/sglang/), set {TREE_ENV}=/path/to/tree, or pip install "
               f"sglang=={SGLANG_VERSION}")


# ---- the calls this family's kernels take: arguments (bound by parameter name) -> PagedCall, where each kernel
# lives, and what it needs of its caller (read off sglang 0.5.23; tests/fuzz/targets/test_declarations.py backs the
# claims) ------------------------------------------------------------------------------------------------------------

def _csr_call(kernel: str, contract: Contract, q: Any, csr: CsrArgs, qsl: Any, key: Any, value: Any,
              names: dict[str, str], **fields: Any) -> PagedCall:
    """A CSR call as a PagedCall: the pools viewed as ``[slots, 1, Hkv, D]`` (NHD, block_size 1), the token
    table the lists describe as its block table, and seq_lens = listed + new tokens (extend) or listed
    (decode); raw arguments that are not 1-D integer tensors leave block_table/seq_lens None (the CSR shape
    checks report them)."""
    ptr, idx = index_values(csr.kv_indptr), index_values(csr.kv_indices)
    table = seq_lens = None
    if ptr is not None and idx is not None and ptr.dim() == 1 and idx.dim() == 1 and len(ptr) >= 1:
        tt = token_table(ptr, idx)
        table, seq_lens = tt.table, tt.lens
        qo = index_values(qsl)
        if csr.listed == "prefix":  # extend: the new tokens come on top of the listed prefix
            seq_lens = (seq_lens + (qo[1:] - qo[:-1]).clamp(min=0) if qo is not None and qo.shape == ptr.shape
                        else None)
    pools = [p.unsqueeze(1) if is_tensor(p) and p.dim() == 3 else p for p in (csr.key_pool, csr.value_pool)]
    return PagedCall(kernel=kernel, contract=contract, layout=NHDLayout(), query=q, key_cache=pools[0],
                     value_cache=pools[1], block_table=table, query_start_loc=qsl, seq_lens=seq_lens, key=key,
                     value=value, names=names, kv_cache_dtype=None, csr=csr, **fields)


def _float_scale(x: Any) -> Any:
    return 1.0 if x is None else x


def sglang_extend_attention_fwd_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
    kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale=None,
    logit_cap=0.0, skip_prefix_custom_mask=True, sliding_window_size=-1, sinks=None, ..., page_size=1, ...)``
    (sglang/kernels/ops/attention/extend_attention.py, sglang 0.5.23; older releases under
    sglang/srt/layers/attention/triton_ops/ take the same names, the scales optional): prefix contract, the
    cached prefix through ``kv_indptr``/``kv_indices`` (token slots of ``k_buffer [slots, Hkv, D]``), the new
    tokens as ``k_extend``/``v_extend`` in ``qo_indptr`` order; ``max_len_extend`` plays max_query_len."""
    csr = CsrArgs(kv_indptr=args["kv_indptr"], kv_indices=args["kv_indices"], qo_indptr=args["qo_indptr"],
                  page_size=args.get("page_size", 1), key_pool=args["k_buffer"], value_pool=args["v_buffer"],
                  listed="prefix")
    sw = args.get("sliding_window_size", -1)
    return _csr_call(
        "sglang.extend_attention_fwd", Contract.PREFIX, args["q_extend"], csr, args["qo_indptr"],
        args.get("k_extend"), args.get("v_extend"),
        dict(query="q_extend", key="k_extend", value="v_extend", key_cache="k_buffer", value_cache="v_buffer",
             block_table="kv_indices", query_start_loc="qo_indptr", seq_lens="kv_indptr + qo_indptr lengths",
             max_query_len="max_len_extend"),
        max_query_len=args.get("max_len_extend"), k_scale=_float_scale(args.get("k_scale")),
        v_scale=_float_scale(args.get("v_scale")), new_tokens_cached=NewTokensCached.NONE,
        cache_reads=CacheReads.CTX, sliding_window=int(sw) + 1 if isinstance(sw, int) and sw > 0 else 0,
        has_sinks=args.get("sinks") is not None)


def sglang_decode_attention_fwd_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse,
    num_kv_splits, max_kv_splits, sm_scale, k_scale, v_scale, logit_cap=0.0, sinks=None, ..., page_size=1,
    ...)`` (sglang/kernels/ops/attention/decode_attention.py, sglang 0.5.23; older releases under
    sglang/srt/layers/attention/triton_ops/, some without attn_lse or the scales): decode only, one query row
    per sequence (query_start_loc implicit, ``arange(N + 1)``); unified contract: ``kv_indices`` list every
    position, the current token's included (SGLang's backend writes it into the pool first). The new tokens
    can be compared with the pool only when handed over (``key``/``value`` ``[N, Hkv, D]``)."""
    q = args["q"]
    csr = CsrArgs(kv_indptr=args["kv_indptr"], kv_indices=args["kv_indices"], page_size=args.get("page_size", 1),
                  key_pool=args["k_buffer"], value_pool=args["v_buffer"], listed="all",
                  attn_logits=args.get("attn_logits"), attn_lse=args.get("attn_lse"),
                  num_kv_splits=args.get("num_kv_splits"), max_kv_splits=args.get("max_kv_splits"))
    n = int(q.shape[0]) if is_tensor(q) and q.dim() >= 1 else 0
    qsl = torch.arange(n + 1, dtype=torch.int32, device=q.device if is_tensor(q) else "cpu")
    call = _csr_call(
        "sglang.decode_attention_fwd", Contract.UNIFIED, q, csr, qsl, key, value,
        dict(query="q", key_cache="k_buffer", value_cache="v_buffer", block_table="kv_indices",
             query_start_loc="(implicit: one query row per sequence)", seq_lens="kv_indptr lengths"),
        k_scale=_float_scale(args.get("k_scale")), v_scale=_float_scale(args.get("v_scale")),
        new_tokens_cached=NewTokensCached.ALL if key is not None else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL, has_sinks=args.get("sinks") is not None)
    if is_tensor(call.seq_lens) and len(call.seq_lens) > n:  # q may cover only the first sequences
        call.seq_lens, call.block_table = call.seq_lens[:n], call.block_table[:n]
    return call


#: SGLang's Triton kernels: int32 or int64 indices; extend's grid from max_len_extend; Lv may differ from Lk.
EXTEND_ATTENTION_FWD = KernelSignature(
    "sglang.extend_attention_fwd", sglang_extend_attention_fwd_call, "extend_attention_fwd",
    (EXTEND_MODULE, "sglang.srt.layers.attention.triton_ops.extend_attention"),
    takes_new_kv=True, declaration=KernelDeclaration(paths=(
        KernelPath("SGLang's extend_attention_fwd Triton kernel", reads=frozenset({"max_query_len"}),
                   source="sglang/kernels/ops/attention/extend_attention.py extend_attention_fwd"),
    ), value_head_size_may_differ=True))
DECODE_ATTENTION_FWD = KernelSignature(
    "sglang.decode_attention_fwd", sglang_decode_attention_fwd_call, "decode_attention_fwd",
    (DECODE_MODULE, "sglang.srt.layers.attention.triton_ops.decode_attention"),
    takes_new_kv=False, declaration=KernelDeclaration(paths=(
        KernelPath("SGLang's decode_attention_fwd Triton kernels",
                   source="sglang/kernels/ops/attention/decode_attention.py decode_attention_fwd"),
    ), value_head_size_may_differ=True))

#: This family's checked kernels (the guard collects them through kvfuzz.fuzz.targets.registry.FAMILIES).
SIGNATURES = (EXTEND_ATTENTION_FWD, DECODE_ATTENTION_FWD)


# ---- where the kernels come from ------------------------------------------------------------------------------
def sglang_tree() -> Path | None:
    """The folder holding :data:`KERNEL_FILES` (``$KVFUZZ_SGLANG_TREE``, else ``<sys.prefix>/share/kvfuzz/
    sglang``), or None when neither has them."""
    env = os.environ.get(TREE_ENV)
    for root in ([Path(env)] if env else []) + [Path(sys.prefix) / "share" / "kvfuzz" / "sglang"]:
        if all((root / f).is_file() for f in KERNEL_FILES):
            return root
    return None


def missing_kernels() -> str | None:
    """Why SGLang's kernels cannot be imported here (what to install), or None when they can: a tree
    (:func:`sglang_tree`) or an installed sglang. A ``$KVFUZZ_SGLANG_TREE`` that lacks a file is named."""
    env = os.environ.get(TREE_ENV)
    if env:
        lacking = [f for f in KERNEL_FILES if not (Path(env) / f).is_file()]
        if lacking:
            return f"{TREE_ENV}={env} lacks {lacking[0]} (it must hold {', '.join(KERNEL_FILES)}); {_SETUP_HINT}"
    try:
        installed = importlib.util.find_spec("sglang") is not None
    except ValueError:  # "sglang" in sys.modules without a spec: kvfuzz's own stand-in, already set up
        installed = True
    if sglang_tree() is not None or installed:
        return None
    return f"SGLang's Triton attention kernels are not installed here: {_SETUP_HINT}"


def _srt_utils_standin() -> types.ModuleType:
    """``sglang.srt.utils`` with the five names decode_attention.py and extend_attention.py import, as
    sglang/srt/utils/common.py (0.5.23) defines them: ``is_hip`` (``torch.version.hip is not None``),
    ``is_cuda`` (``torch.cuda.is_available() and torch.version.cuda is not None``), ``is_gfx95_supported`` and
    ``is_gfx1250_supported`` (False off ROCm; kvfuzz does not model those AMD paths: False on ROCm too),
    ``get_device_core_count`` (the device's SM count, 0 without a GPU)."""
    m = types.ModuleType("sglang.srt.utils", "kvfuzz stand-in for sglang.srt.utils (the kernels' five helpers)")
    m.is_hip = lambda: torch.version.hip is not None
    m.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
    m.is_gfx95_supported = lambda: False
    m.is_gfx1250_supported = lambda: False
    m.get_device_core_count = lambda device_id=0: (
        torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0)
    return m


def _install_standins(tree: Path) -> None:
    for name in _STANDIN_PACKAGES:
        if name not in sys.modules:
            pkg = types.ModuleType(name, "kvfuzz stand-in package (the real __init__ imports SGLang's runtime)")
            pkg.__path__ = [str(tree.joinpath(*name.split(".")))]
            sys.modules[name] = pkg
    if "sglang.srt.utils" not in sys.modules:
        sys.modules["sglang.srt.utils"] = _srt_utils_standin()


@functools.cache
def prepare_sglang_runtime() -> str:
    """Make SGLang's two kernel modules importable; returns "cuda" or "cpu" (interpreted).

    Sets up Triton first (:func:`~kvfuzz.fuzz.targets.vllm_triton.prepare_triton_runtime`: the interpreter on
    a machine without CUDA). Raises RuntimeError when neither a kernel tree nor an installed sglang is found
    (the message says what to install), or when triton was imported without its interpreter on CPU.
    """
    real = sys.modules.get("sglang")
    if real is not None and getattr(real, "__file__", None):
        return prepare_triton_runtime()  # a real sglang is already imported: use it
    why = missing_kernels()
    if why is not None:
        raise RuntimeError(why)
    device = prepare_triton_runtime()
    tree = sglang_tree()
    if tree is not None:
        _install_standins(tree)
    return device


def kernel_function(module: str, name: str):
    """The kernel entry point ``name`` of ``module`` (after :func:`prepare_sglang_runtime`)."""
    prepare_sglang_runtime()
    return getattr(importlib.import_module(module), name)


def _pool(cache: torch.Tensor) -> torch.Tensor:
    """SGLang's token pool view ``[num_slots, Hkv, D]`` of an NHD cache ``[num_blocks, page_size, Hkv, D]``
    (sglang/srt/mem_cache/memory_pool.py ``MHATokenToKVPool``: one row per token slot, slot = page *
    page_size + offset; the same storage, so the cache kvfuzz wrote is the pool the kernel reads)."""
    return cache.flatten(0, 1)


class SglangTritonTarget(VllmTritonTarget):
    """Shared availability and running of SGLang's Triton kernels (the per-device dtypes of
    :class:`~kvfuzz.fuzz.targets.vllm_triton.VllmTritonTarget`)."""

    def availability(self) -> Availability:
        if importlib.util.find_spec("triton") is None:
            return Availability(False, "python package 'triton' is not installed (run `make setup`, or "
                                       "`pip install triton` on a GPU machine)")
        try:
            device = prepare_sglang_runtime()
        except RuntimeError as e:
            return Availability(False, str(e))
        where = "compiled (CUDA)" if device == "cuda" else "Triton interpreter (CPU)"
        tree = sglang_tree()
        src = f"sglang {SGLANG_VERSION} kernel files from {tree}" if tree else "the installed sglang"
        return Availability(True, f"{where}; {src}", device)

    def installed(self) -> Availability:
        """From what is installed: triton, the kernel files (:func:`missing_kernels`), and (on CPU) triton not
        yet imported without its interpreter; nothing is imported."""
        if importlib.util.find_spec("triton") is None:
            return Availability(False, "python package 'triton' is not installed (run `make setup`, or "
                                       "`pip install triton` on a GPU machine)")
        if triton_imported_too_early():
            return Availability(False, TRITON_TOO_EARLY)
        why = missing_kernels()
        if why is not None:
            return Availability(False, why)
        device = "cuda" if on_cuda() else "cpu"
        where = "compiled (CUDA)" if device == "cuda" else "Triton interpreter (CPU)"
        tree = sglang_tree()
        src = f"sglang {SGLANG_VERSION} kernel files in {tree}" if tree else "the installed sglang"
        return Availability(True, f"{where}; {src}: {NOT_LOADED}", device)

    def layout(self, batch: Batch) -> CacheLayout:
        return NHDLayout()

    def run(self, call: KernelCall) -> torch.Tensor:
        fn = kernel_function(*self.kernel)
        with np.errstate(all="ignore"):  # the interpreter's numpy warns on NaN poison and masked -inf rows
            fn(**call.kwargs)
        return call.output

    def path(self, batch: Batch) -> str:
        return "token" if batch.block_size == 1 else "paged"


class SglangExtendAttentionFwd(SglangTritonTarget):
    """``extend_attention_fwd`` (sglang/kernels/ops/attention/extend_attention.py, sglang 0.5.23), called as
    SGLang's Triton backend calls it (sglang/srt/layers/attention/triton_backend.py ``forward_extend``).

    Prefix contract: ``kv_indices`` list each sequence's cached prefix (``ctx_len`` token slots, in position
    order; :func:`~kvfuzz.contracts.model.csr.token_slot_lists`), the new tokens come as ``k_extend``/``v_extend``
    ``[T, Hkv, D]`` in ``qo_indptr`` order and are never read from the pool. Arguments: ``q_extend``/``o_extend``
    ``[T, H, D]``; ``k_buffer``/``v_buffer`` the pool ``[num_slots, Hkv, D]`` (3-D only: the kernel raises on a
    4-D paged view); ``qo_indptr`` = query_start_loc and ``kv_indptr`` int32 ``[N + 1]``, ``kv_indices`` int64
    (as the backend allocates them; int32 works the same, measured); ``custom_mask=None, is_causal=True,
    mask_indptr=None``; ``max_len_extend`` = the longest query; ``k_scale``/``v_scale`` Python floats (a tensor
    fails to compile: it becomes a pointer); ``sm_scale`` = ``batch.sm_scale`` (None: the kernel's
    ``1/sqrt(D)``); ``page_size`` = block size (token slots at every page size: it only changes the address
    arithmetic).

    Features in the kernel's conventions (measured against an fp64 reference, fp32 errors <= 1.2e-6):
    ``sliding_window_size = W - 1`` for kvfuzz's window of W keys (the kernel's window W' admits
    ``q_pos <= k_pos + W'``, W' + 1 keys; W' <= 0 disables it, so W = 1 cannot be expressed:
    ``min_sliding_window = 2``); ``logit_cap`` = softcap, applied after the scale; ``sinks`` fp32 ``[H]``, one
    logit per head in the softmax denominator.

    No fp8: the prefix loop rounds q and the probabilities to the cache's fp8 dtype (``tl.dot(q.to(k.dtype),
    k)``, ``p.to(v.dtype)``) by design, which kvfuzz's exact reference does not model, and under the CPU
    interpreter that downcast is itself wrong (errors 0.17-0.35 measured).
    """

    name = "sglang.extend_attention_fwd"
    checked_kernel = EXTEND_ATTENTION_FWD
    description = "SGLang Triton extend (prefill) attention over CSR kv_indices (prefix contract)"
    capabilities = Capabilities(
        contract=Contract.PREFIX,
        devices=("cpu", "cuda"),
        dtypes=("float16", "float32"),  # per device: see VllmTritonTarget
        head_sizes=(32, 40, 64, 80, 128),  # padded to a power of 2 inside (BLOCK_DMODEL)
        block_sizes=(1, 4, 16, 64),  # page_size: 1 is SGLang's default
        features=("sliding_window", "sinks", "softcap"),
        min_sliding_window=2,
        metadata="csr",
        shared_prefix_blocks=True,
    )

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        dev = cache.key_cache.device
        kv_indptr, kv_indices = token_slot_lists(batch, batch.ctx_lens).tensors(dev)
        k_extend, v_extend = (t.to(dev) for t in data.new_kv(batch))
        out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=batch.torch_dtype, device=dev)
        w = batch.sliding_window
        kwargs = dict(
            q_extend=data.query.to(dev), k_extend=k_extend, v_extend=v_extend, o_extend=out,
            k_buffer=_pool(cache.key_cache), v_buffer=_pool(cache.value_cache),
            qo_indptr=batch.query_start_loc_tensor(dev), kv_indptr=kv_indptr, kv_indices=kv_indices,
            custom_mask=None, is_causal=True, mask_indptr=None, max_len_extend=batch.max_query_len,
            k_scale=batch.k_scale, v_scale=batch.v_scale, sm_scale=batch.sm_scale,
            logit_cap=batch.softcap or 0.0, sliding_window_size=-1 if w is None else w - 1,
            sinks=sinks(data, dev), page_size=batch.block_size,
        )
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out, key=k_extend,
                          value=v_extend)

    def path(self, batch: Batch) -> str:
        return super().path(batch) + ("+prefix" if any(batch.ctx_lens) else "")


class SglangDecodeAttentionFwd(SglangTritonTarget):
    """``decode_attention_fwd`` (sglang/kernels/ops/attention/decode_attention.py, sglang 0.5.23), called as
    SGLang's Triton backend calls it (sglang/srt/layers/attention/triton_backend.py ``forward_decode``, after
    it wrote the current token into the pool).

    Decode only, unified contract: ``kv_indices`` list all ``seq_len`` token slots of each sequence, the
    current token's included, and the kernel attends to every listed slot (no causal mask). Arguments:
    ``q``/``o`` ``[N, H, D]``; ``k_buffer``/``v_buffer`` the pool ``[num_slots, Hkv, D]``; ``kv_indptr`` int32,
    ``kv_indices`` int64; ``attn_logits`` fp32 ``[N, H, max_kv_splits, D]`` (last dim exactly Dv: the kernel
    addresses the LSE as ``offset // Lv``) and ``attn_lse`` fp32 ``[N, H, max_kv_splits]``, both filled with the
    example's poison (the backend allocates them with ``torch.empty``); ``num_kv_splits`` int32 ``[N]`` (see
    :meth:`num_kv_splits`); ``sm_scale`` = the scale in effect (required); ``k_scale``/``v_scale`` Python floats;
    ``logit_cap`` = softcap; ``sinks`` fp32 ``[H]``; ``page_size`` = block size. No window argument (SGLang's
    backend windows a decode by listing fewer slots). A batch with CUDA-graph pads (``Batch.num_pad_seqs``) is
    called as SGLang's ``CudaGraphRunner`` pads it: each pad a decode of seq_len 1 listing token slot 0
    (:mod:`kvfuzz.contracts.model.padding`), its own q row, scratch rows and one KV split.

    Two stage-1 kernels: ``_fwd_kernel_stage1`` for MHA (``H == Hkv``), ``_fwd_grouped_kernel_stage1``
    otherwise; ``_fwd_kernel_stage2`` merges the splits. fp8 caches (the pool holds ``k / k_scale`` as
    float8): declared for MHA only (``fp8_gqa_ratios=(1,)``), where the kernel multiplies fp8 keys by q
    without converting q; the grouped kernel rounds q and the probabilities to the fp8 dtype by design
    (``q.to(K_Buffer.dtype.element_ty)``, ``p.to(v.dtype)``), which the exact reference does not model (and the
    CPU interpreter's fp8 downcast is wrong besides).
    """

    name = "sglang.decode_attention_fwd"
    checked_kernel = DECODE_ATTENTION_FWD
    #: docs/findings.md, Finding 9: the MHA path rounds each q.k product to the input dtype, which wide logits ("large",
    #: "dominant") turn into errors past the envelope; the gate draws the other ranges, `kvfuzz fuzz` all
    gate_value_ranges = ("normal", "equal")
    description = "SGLang Triton split-KV decode attention over CSR kv_indices (decode only, unified contract)"
    capabilities = Capabilities(
        **DECODE_ATTENTION_FAMILY,
        block_sizes=(1, 4, 16, 64),
        kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),
        fp8_gqa_ratios=(1,),
        features=("sinks", "softcap"),
        metadata="csr",
        # SGLang's CudaGraphRunner pads decode batches (seq_len_fill_value 1 for the Triton backend)
        cuda_graph_padding="sglang",
    )

    def __init__(self, max_kv_splits: int | None = None) -> None:
        super().__init__()
        self.max_kv_splits = max_kv_splits or (8 if on_cuda() else 4)
        if self.max_kv_splits < 1:
            raise ValueError(f"max_kv_splits must be >= 1, got {max_kv_splits}")

    def num_kv_splits(self, batch: Batch) -> list[int]:
        """Per sequence, from its own length only: ``1 + (seq_len - 1) % max_kv_splits`` (1 .. max_kv_splits as
        lengths vary, so batches mix split counts and splits run empty, full and partial; max_kv_splits: 4
        interpreted, 8 compiled, the backend's default ``triton_attention_num_kv_splits``). SGLang's backend
        fills every sequence with max_kv_splits when it cannot count SMs and otherwise picks counts from the
        whole batch (``get_num_kv_splits``); a per-sequence rule keeps kvfuzz's batch-order relation about the
        kernel, not about the split choice."""
        return [1 + (n - 1) % self.max_kv_splits for n in batch.seq_lens]

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        require_decode(self.name, batch)
        dev = cache.key_cache.device
        pad = padding(batch, self.capabilities.cuda_graph_padding)  # CUDA-graph pads, as SGLang's runner pads
        n, h, d, s = pad.num_seqs, batch.num_heads, batch.head_size, self.max_kv_splits
        kv_indptr, kv_indices = pad.token_slots(*token_slot_lists(batch, batch.seq_lens).tensors(dev))
        out = torch.empty((n, h, d), dtype=batch.torch_dtype, device=dev)
        kwargs = dict(
            q=pad.query(data.query.to(dev)), k_buffer=_pool(cache.key_cache), v_buffer=_pool(cache.value_cache),
            o=out,
            kv_indptr=kv_indptr, kv_indices=kv_indices,
            attn_logits=poisoned_scratch((n, h, s, d), cache, batch.seed + 3),
            attn_lse=poisoned_scratch((n, h, s), cache, batch.seed + 4),
            num_kv_splits=torch.tensor(self.num_kv_splits(batch) + [1] * pad.num_pads, dtype=torch.int32,
                                       device=dev),
            max_kv_splits=s, sm_scale=batch.scale, k_scale=batch.k_scale, v_scale=batch.v_scale,
            logit_cap=batch.softcap or 0.0, sinks=sinks(data, dev), page_size=batch.block_size,
        )
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out)

    def path(self, batch: Batch) -> str:
        return f"{stage1(batch)},{super().path(batch)},max_kv_splits={self.max_kv_splits}"


#: This family's built-in targets (kvfuzz.fuzz.targets.registry.BUILTIN lists them by name, in this order).
TARGETS = (SglangExtendAttentionFwd, SglangDecodeAttentionFwd)

__all__ = ["DECODE_ATTENTION_FWD", "DECODE_MODULE", "EXTEND_ATTENTION_FWD", "EXTEND_MODULE", "KERNEL_FILES",
           "SGLANG_VERSION", "SIGNATURES", "TREE_ENV", "SglangDecodeAttentionFwd", "SglangExtendAttentionFwd",
           "SglangTritonTarget", "kernel_function", "missing_kernels", "prepare_sglang_runtime",
           "sglang_decode_attention_fwd_call", "sglang_extend_attention_fwd_call", "sglang_tree"]
