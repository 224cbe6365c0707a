"""kvfuzz's runtime guard over FlashAttention 4 calls made by vLLM 0.33.0's own FLASH_ATTN backend on Hopper: the
guard (kvfuzz.fuzz.guard, mode "record") must record nothing on the backend's correct calls and must record the
planted caller fault. vLLM's only FA4 test runs on Blackwell; on an H200 (SM90) vLLM picks FA4 itself for head size
512 (vllm/v1/attention/backends/fa_utils.py ``get_flash_attn_version``: "FA3 does not support head_size=512 on SM90:
upgrading FlashAttention 3 -> 4"; FA4 compiles on SM90 at 64/128/256/512 only: docs/findings.md, Finding 18).

The contracts and where they come from (vLLM 0.33.0, read off the installed files):
- the call: vllm/v1/attention/backends/flash_attn.py ``FlashAttentionImpl.forward`` (through
  ``FA4DenseAttentionKernel.__call__`` into vllm/vllm_flash_attn/flash_attn_interface.py ``flash_attn_varlen_func``,
  ``fa_version=4``), the strided K/V views of one ``[NB, Hkv, BS, 2D]`` cache, descales ``.expand((N, Hkv))``;
- the write: ``FlashAttentionImpl.do_kv_cache_update`` (``reshape_and_cache_flash`` at ``slot_mapping``;
  ``forward_includes_kv_cache_update = False``): every ``seq_len`` position is in the cache when FA4 runs (the
  unified contract, kvfuzz.fuzz.targets.vllm_flash_attn);
- the metadata: ``FlashAttentionMetadata`` as ``FlashAttentionMetadataBuilder.build`` fills it for an eager,
  no-DCP batch (``max_num_splits`` 0, ``causal`` True; FA4's wrapper ignores ``scheduler_metadata``);
- the version: ``FlashAttentionImpl.__init__`` -> ``get_flash_attn_version`` with no VllmConfig set
  (``attention_config.flash_attn_version`` None); fp8: ``uses_sm90_fa4_fp8_kv_dequant`` (e4m3 K/V, fp16/bf16
  query, no q_descale), ``FlashAttentionBackend._get_sm90_fa4_fp8_kv_block_size`` (head 512, block 64).

How the backend is loaded: ``import vllm.v1.attention.backends.flash_attn`` where vLLM is fully installed; else (the
``--no-deps`` installs of ``make setup`` and of the GPU bundle lack pydantic and transformers) the installed
flash_attn.py is executed as its module with each failing vLLM import replaced: ``vllm.config`` by a module whose
``get_current_vllm_config_or_none()`` returns None (no config, as above), ``AttentionImpl`` by a base that sets what
``AttentionImplBase.__new__`` sets without DCP/PCP groups (world size 1, rank 0), ``AttentionType`` by its values,
other names (config classes, builders' helpers this script does not run) by inert placeholders. ``forward``,
``do_kv_cache_update``, ``__init__`` and the FA4 kernel wrapper are vLLM's code as installed. The cache write is
vLLM's ``reshape_and_cache_flash`` op where ``torch.ops._C_cache_ops`` has it, else vLLM's Triton
``triton_reshape_and_cache_flash`` (the GPU bundle carries no ``vllm/_C``).

``--standin`` (this CPU): tests/support/hopper_standins.py ``install_fa2_fa4`` (vLLM's real flash_attn_interface.py
over a torch FA4 ``_flash_attn_fwd`` with FA4's SM90 checks), the platform reporting SM 9.0 and FA3's extension as
present (so ``get_flash_attn_version`` takes its SM90 route to 4), the Triton write interpreted. Not exercised on
CPU: the compiled FA4 kernels (CuTe DSL JIT), ``vllm/_C``'s cache op, and the real import of the backend module
(pydantic/transformers absent here), hence the source-executed module; the metadata builder is not run (it needs
a VllmConfig), the metadata is hand-made with the fields ``build`` fills.

Cases (head 512, 8 query over 2 kv heads, query_lens [1, 1, 37, 5], ctx_lens [300, 17, 0, 129], :data:`CASES`):
bf16 block 16, fp16 block 64, window 64, fp32 sinks, fp8 e4m3 at block 64 (k_scale 0.5, v_scale 0.25, bf16 query),
and ``planted``: bf16 with sequence 0's decode token not written (:func:`plant`). Outputs are compared with an fp64
reference (causal over ctx + query, GQA, window, sinks, the fp8 cache dequantized).

Usage: python3 benchmarks/fa4_backend_guard.py [--standin]   (GPU: source benchmarks/gpu_env.sh first)
Prints where the backend and writer came from, then one line a case: name, fa_version, guard calls, records, max
abs error against the reference (printed, not asserted beyond finiteness), and each planted record's message.
Exit codes: 0 every expectation held; 1 one failed (FA version not 4, a record on a correct call, no record on the
planted one, a call the guard did not count or could not check, a non-finite output); 2 setup failed.
"""

import __future__

import argparse
import ast
import contextlib
import enum
import importlib
import sys
import types
from pathlib import Path

import torch

#: The byte every unwritten cache slot holds: finite in each dtype (fp16 0x7B7B = 61,280, bf16 ~1.3e36, e4m3 352), so
#: a slot a call reads but masks adds 0 x finite. The first H200 run (2026-11-29, benchmarks/results/
#: fa4-backend-guard-h200.txt) filled 0x7F, NaN in fp16 and e4m3: the fp16 and fp8 cases at block 64 came out NaN
#: from the tail of a sequence's last page (docs/findings.md, Finding 17, at head size 512 and pages of 64), while
#: the guard's verdicts were right in every case.
FILL_BYTE = 0x7B

ROOT = Path(__file__).resolve().parents[1]
BACKEND = "vllm.v1.attention.backends.flash_attn"
H, HKV, D = 8, 2, 512
QUERY_LENS, CTX_LENS = [1, 1, 37, 5], [300, 17, 0, 129]
CASES = {  # name: (dtype, block_size, kv_cache_dtype, sliding_window, sinks, k_scale, v_scale, planted)
    "bf16": (torch.bfloat16, 16, "auto", None, False, 1.0, 1.0, False),
    "fp16-block64": (torch.float16, 64, "auto", None, False, 1.0, 1.0, False),
    "window64": (torch.bfloat16, 16, "auto", 64, False, 1.0, 1.0, False),
    "sinks": (torch.bfloat16, 16, "auto", None, True, 1.0, 1.0, False),
    "fp8-e4m3": (torch.bfloat16, 64, "fp8_e4m3", None, False, 0.5, 0.25, False),
    "planted": (torch.bfloat16, 16, "auto", None, False, 1.0, 1.0, True),
}


class _Placeholder(type):
    """A vLLM name whose module does not import here: usable as a base, subscript, attribute or annotation."""

    def __getattr__(cls, name):
        return cls

    def __getitem__(cls, item):
        return cls


class AttentionType(str, enum.Enum):  # vllm/v1/attention/backend.py
    DECODER, ENCODER, ENCODER_ONLY, ENCODER_DECODER = "decoder", "encoder", "encoder_only", "encoder_decoder"


class AttentionImpl:
    """What vllm/v1/attention/backend.py ``AttentionImplBase.__new__`` sets without DCP/PCP groups."""

    dcp_world_size, dcp_rank, pcp_world_size, pcp_rank, total_cp_world_size, total_cp_rank = 1, 0, 1, 0, 1, 0
    need_to_return_lse_for_decode = False

    def get_impl_variants(self):
        return (self,)


def source_backend(mp) -> types.ModuleType:
    """vLLM's installed flash_attn.py executed as its module, failing vLLM imports replaced (module docstring)."""
    from kvfuzz.fuzz.targets.triton_runtime import module_file

    path = module_file(BACKEND)
    mod = types.ModuleType(BACKEND)
    mod.__file__, body = str(path), []
    standins = {"AttentionImpl": AttentionImpl, "AttentionType": AttentionType}
    for node in ast.parse(path.read_text(), str(path)).body:
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm")):
            body.append(node)
            continue
        try:
            src = importlib.import_module(node.module)
        except Exception:
            src = None
        for a in node.names:
            val = getattr(src, a.name, None)
            mod.__dict__[a.asname or a.name] = val if val is not None else standins.get(
                a.name, _Placeholder(a.name, (), {}))
    mp.setitem(sys.modules, BACKEND, mod)
    code = compile(ast.Module(body, []), str(path), "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)
    exec(code, mod.__dict__)
    if "flash_attn_varlen_func" not in mod.__dict__:  # `if is_flash_attn_varlen_func_available():` (CUDA only)
        from vllm.v1.attention.backends import fa_utils
        from vllm.vllm_flash_attn import flash_attn_interface as fa

        mod.flash_attn_varlen_func, mod.get_scheduler_metadata = fa.flash_attn_varlen_func, fa.get_scheduler_metadata
        mod.flash_attn_supports_sinks = fa_utils.flash_attn_supports_sinks
        mod.compile_flash_attn_varlen_func_from_specs = None
    return mod


def standin_writer(triton_writer):
    """``triton_writer`` for a 16-bit cache; for an fp8 one ``reshape_and_cache_flash`` in torch: ``x / scale``
    cast to e4m3 at ``slot_mapping``, slot -1 skipped."""
    def write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
        if kv_cache_dtype == "auto":
            return triton_writer(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
        keep = slot_mapping >= 0
        s, bs = slot_mapping[keep], key_cache.shape[1]
        for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            cache.view(torch.float8_e4m3fn)[s // bs, s % bs] = (x[:len(keep)][keep].float() / scale).to(
                torch.float8_e4m3fn)
    return write


def setup(stack, standin: bool) -> tuple[types.ModuleType, str, str]:
    """The backend module, where it came from, and which cache writer it uses."""
    import pytest

    mp = stack.enter_context(pytest.MonkeyPatch.context())
    if standin:
        sys.path.insert(0, str(ROOT / "tests"))
        from support import hopper_standins

        iface = hopper_standins.install_fa2_fa4(mp)  # first: it readies Triton's interpreter before vLLM imports
        from vllm.platforms import current_platform
        from vllm.platforms.interface import DeviceCapability

        mp.setattr(iface, "FA3_AVAILABLE", True)  # the stand-in is FA3's extension: vLLM's SM90 route (3 -> 4)
        mp.setattr(type(current_platform), "get_device_capability",
                   classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
    else:
        from kvfuzz.fuzz.targets.triton_runtime import quiet_vllm

        quiet_vllm()
    why = "vllm.config imports"
    try:
        importlib.import_module("vllm.config")
    except Exception as e:  # pydantic absent: no VllmConfig can be current anyway
        why = f"importing vllm.config: {type(e).__name__}: {e}"
        stub, cache = types.ModuleType("vllm.config"), types.ModuleType("vllm.config.cache")
        stub.__path__, stub.cache = [], cache
        stub.get_current_vllm_config_or_none = lambda: None
        cache.get_kv_cache_dtype_handler = lambda name: None  # no out-of-tree kv-cache dtype plugins
        mp.setitem(sys.modules, "vllm.config", stub)
        mp.setitem(sys.modules, "vllm.config.cache", cache)
    try:
        mod, where = importlib.import_module(BACKEND), "imported"
    except Exception:
        mod = source_backend(mp)
        where = f"executed from {mod.__file__} ({why})"
    try:
        getattr(torch.ops._C_cache_ops, "reshape_and_cache_flash")
        writer = "vllm._C reshape_and_cache_flash"
    except (AttributeError, RuntimeError):
        from kvfuzz.fuzz.targets.cache_writers import _kernel_module

        triton_writer = _kernel_module().triton_reshape_and_cache_flash
        writer = "vLLM's triton_reshape_and_cache_flash"
        if standin:  # the Triton interpreter's fp32 -> e4m3 store is not the GPU's (seen: -2 stored as -1)
            triton_writer, writer = standin_writer(triton_writer), writer + " (interpreted; fp8: a torch cast)"
        mp.setattr(mod, "reshape_and_cache_flash", triton_writer, raising=False)
    return mod, where, writer


def reference(q, k_seqs, v_seqs, scale, window, sinks) -> torch.Tensor:
    """fp64 causal attention per sequence over its ctx + query keys (GQA, window of ``window`` keys, sinks)."""
    outs = []
    for qi, k, v in zip(q, k_seqs, v_seqs):
        n, s = k.shape[0], qi.shape[0]
        k, v = k.double().repeat_interleave(H // HKV, 1), v.double().repeat_interleave(H // HKV, 1)
        logits = torch.einsum("qhd,khd->hqk", qi.double(), k) * scale
        pos, j = torch.arange(s)[:, None] + n - s, torch.arange(n)[None, :]
        visible = (j <= pos) & ((j > pos - window) if window else True)
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            logits = torch.cat([logits, sinks.double()[:, None, None].expand(H, s, 1)], -1)
        p = torch.softmax(logits, -1)[..., :n]
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
    return torch.cat(outs)


def plant(new_slots: list[int]) -> None:
    """The planted caller fault: sequence 0's decode token not written (slot -1, which reshape_and_cache_flash skips,
    as a test that pads its slot mapping wrongly)."""
    new_slots[0] = -1


def run_case(mod, name, dtype, bs, kv_dtype, window, with_sinks, k_scale, v_scale, planted, dev):
    from kvfuzz.fuzz.guard import guard

    g0 = torch.Generator().manual_seed(len(name))
    fp8 = kv_dtype != "auto"
    sinks = torch.randn(H, generator=g0) * 2 if with_sinks else None
    impl = mod.FlashAttentionImpl(H, D, D ** -0.5, HKV, None, window, kv_dtype,
                                  sinks=None if sinks is None else sinks.to(dev))
    layer = torch.nn.Module()
    layer._q_scale, layer._k_scale, layer._v_scale = (torch.tensor(s, dtype=torch.float32, device=dev)
                                                      for s in (1.0, k_scale, v_scale))
    seq_lens = [c + q for c, q in zip(CTX_LENS, QUERY_LENS)]
    per = [-(-n // bs) for n in seq_lens]
    nb = sum(per) + 3  # spare blocks, and a shuffled table
    ids = torch.randperm(nb, generator=g0)[:sum(per)].tolist()
    table = torch.zeros(len(seq_lens), max(per), dtype=torch.int32)
    rows, at = [], 0
    for i, n in enumerate(per):
        table[i, :n] = torch.tensor(ids[at:at + n], dtype=torch.int32)
        rows.append(ids[at:at + n])
        at += n
    kv_cache = torch.empty(nb, HKV, bs, 2 * D, dtype=torch.uint8 if fp8 else dtype, device=dev)
    kv_cache.view(torch.uint8).fill_(FILL_BYTE)  # every slot not written below: large finite values
    k_all = [torch.randn(n, HKV, D, generator=g0).to(dtype) for n in seq_lens]
    v_all = [torch.randn(n, HKV, D, generator=g0).to(dtype) for n in seq_lens]

    def slots(i, lo, hi):
        return [rows[i][p // bs] * bs + p % bs for p in range(lo, hi)]

    ctx_slots = sum((slots(i, 0, c) for i, c in enumerate(CTX_LENS)), [])
    new_slots = sum((slots(i, c, n) for i, (c, n) in enumerate(zip(CTX_LENS, seq_lens))), [])
    if planted:
        plant(new_slots)
    ctx_k = torch.cat([k[:c] for k, c in zip(k_all, CTX_LENS)]).to(dev)
    ctx_v = torch.cat([v[:c] for v, c in zip(v_all, CTX_LENS)]).to(dev)
    key = torch.cat([k[c:] for k, c in zip(k_all, CTX_LENS)]).to(dev)
    value = torch.cat([v[c:] for v, c in zip(v_all, CTX_LENS)]).to(dev)
    query = torch.randn(key.shape[0], H, D, generator=g0).to(dtype=dtype, device=dev)
    # an earlier step's write (the context), then this step's: both through the backend's do_kv_cache_update
    impl.do_kv_cache_update(layer, ctx_k, ctx_v, kv_cache, torch.tensor(ctx_slots, dtype=torch.int64, device=dev))
    impl.do_kv_cache_update(layer, key, value, kv_cache, torch.tensor(new_slots, dtype=torch.int64, device=dev))
    qsl = torch.tensor([0] + torch.tensor(QUERY_LENS).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    meta = mod.FlashAttentionMetadata(
        num_actual_tokens=key.shape[0], max_query_len=max(QUERY_LENS), query_start_loc=qsl,
        max_seq_len=max(seq_lens), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_table=table.to(dev), slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=dev),
        scheduler_metadata=None, max_num_splits=0, causal=True)
    output = torch.zeros(key.shape[0], H, D, dtype=dtype, device=dev)
    with guard("record") as g, g.new_kv(key, value):
        impl.forward(layer, query, key, value, kv_cache, meta, output=output)
    if dev != "cpu":
        torch.cuda.synchronize()

    def stored(x, s):  # what the cache holds: e4m3 of x / scale, dequantized
        return (x.float() / s).to(torch.float8_e4m3fn).float() * s if fp8 else x
    ref = reference([query[a:b].cpu() for a, b in zip(qsl[:-1].tolist(), qsl[1:].tolist())],
                    [stored(k, k_scale) for k in k_all], [stored(v, v_scale) for v in v_all],
                    D ** -0.5, window, sinks)
    out = output.cpu().double()
    real = slice(1, None) if planted else slice(None)  # the planted row reads NaN
    err = (out[real] - ref[real]).abs().max().item()
    return impl.vllm_flash_attn_version, g, err, bool(out[real].isfinite().all())


def main(argv=None) -> int:
    from kvfuzz.contracts.checks.violations import Check

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--standin", action="store_true", help="CPU: vLLM's wrapper over tests/support's FA4 stand-in")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    args = ap.parse_args(argv)
    if not args.standin and not torch.cuda.is_available():
        print("no CUDA device: run on an H200 after `source benchmarks/gpu_env.sh`, or pass --standin", file=sys.stderr)
        return 2
    dev = "cpu" if args.standin else "cuda"
    failures = []
    with contextlib.ExitStack() as stack:
        try:
            mod, where, writer = setup(stack, args.standin)
        except Exception as e:
            print(f"setup failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(f"backend: {BACKEND} {where}\ncache writer: {writer}\ndevice: "
              f"{'cpu (stand-ins)' if args.standin else torch.cuda.get_device_name()}")
        print(f"{'case':<14} {'fa':>2} {'calls':>5} {'records':>7} {'max_err':>10}")
        for name in args.cases.split(","):
            fa, g, err, finite = run_case(mod, name, *CASES[name], dev)
            planted = CASES[name][-1]
            calls = g.calls["flash_attn_varlen_func"]
            print(f"{name:<14} {fa!s:>2} {calls:>5} {len(g.records):>7} {err:>10.3g}")
            checks = {"fa_version == 4": fa == 4, "one checked FA call": calls == 1 and not g.unchecked,
                      "finite output": finite}
            if planted:
                checks["the guard recorded the unwritten token"] = bool(g.records) and any(
                    v.check is Check.UNIFIED for r in g.records for v in r.violations)
                for r in g.records:
                    print("  " + r.message.replace("\n", "\n  "))
            else:
                checks["no records"] = g.records == []
                for r in g.records:
                    print("  unexpected: " + r.message.replace("\n", "\n  "))
            failures += [f"{name}: {what}" for what, ok in checks.items() if not ok]
    for f in failures:
        print(f"FAILED {f}")
    print("all expectations held" if not failures else f"{len(failures)} expectation(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
