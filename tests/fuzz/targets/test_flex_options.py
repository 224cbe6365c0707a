"""kvfuzz.fuzz.targets.flex_options: vLLM's FlexAttention kernel options and block mask sizes, from vLLM's own
functions (imported, or compiled from the installed vllm/v1/attention/backends/flex_attention.py), and kvfuzz's
copies of them pinned to vLLM's."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from kvfuzz.fuzz.targets import flex_options
from kvfuzz.fuzz.targets.flex_options import (
    COPIES,
    DEFAULT_ATTENTION_CONFIG,
    GET_BLOCK_SIZES,
    GET_KERNEL_OPTIONS,
    VLLM_FLEX_MODULE,
    compile_from_source,
    upstream_function,
    vllm_flex_source,
    vllm_kernel_options,
    vllm_runs_block_size,
)
from kvfuzz.fuzz.targets.torch_flex import TorchFlexPaged

SOURCE = vllm_flex_source()
needs_vllm_source = pytest.mark.skipif(SOURCE is None, reason="vLLM's flex_attention.py is not installed")


@pytest.fixture(autouse=True)
def _fresh_upstream():
    """Each test finds vLLM's functions anew, and leaves no planted one behind."""
    upstream_function.cache_clear()
    yield
    upstream_function.cache_clear()


def vllm_function(qualname: str):
    return compile_from_source(SOURCE, qualname)


# ---- the functions are vLLM's own ------------------------------------------------------------------------------
@needs_vllm_source
@pytest.mark.parametrize("qualname, line", [(GET_KERNEL_OPTIONS, "def get_kernel_options("),
                                            (GET_BLOCK_SIZES, "def _get_block_sizes(")])
def test_the_source_route_compiles_vllms_own_function(qualname, line):
    """The compiled function is the code at vLLM's ``def`` line of its file (its tracebacks point there), and the
    route kvfuzz takes here (no pydantic: the module does not import) is vLLM's source."""
    fn = vllm_function(qualname)
    lines = SOURCE.read_text().splitlines()
    assert fn.__code__.co_filename == str(SOURCE)
    assert lines[fn.__code__.co_firstlineno - 1].strip().startswith(line)
    got, where = upstream_function(qualname)
    assert where.startswith("vllm"), where


# ---- kvfuzz's copies equal vLLM's functions ----------------------------------------------------------------------
def kernel_option_cases():
    return [(torch.empty(0, dtype=dtype), block_m, block_n, direct)
            for dtype in (torch.float32, torch.float16, torch.bfloat16) for block_m in (1, 16, 48, 128)
            for block_n in (0, 8, 16, 24, 64, 96, 128, 256) for direct in (True, False)]


def block_size_cases():
    cfgs = [DEFAULT_ATTENTION_CONFIG] + [types.SimpleNamespace(**{**vars(DEFAULT_ATTENTION_CONFIG), **kw}) for kw in (
        {"flex_attn_q_block_size": 32}, {"flex_attn_kv_block_size": 64}, {"flex_attn_q_block_size": 24},
        {"flex_attn_block_m": 32}, {"flex_attn_block_n": 32, "flex_attn_kv_block_size": 16})]
    return [(cfg, small, block, paged) for cfg in cfgs for small in (True, False) for block in (8, 16, 48, 64, 128)
            for paged in (True, False)]


def mismatches(fn, reference, cases) -> list[str]:
    """Each case where ``fn`` and ``reference`` answer differently (a result, or an exception's type and words)."""

    def answer(f, args):
        try:
            return f(*args)
        except Exception as e:  # vLLM's ValueError for a block size that is not a power of two is an answer too
            return type(e).__name__, str(e)

    def show(args):  # a query by its dtype (what get_kernel_options reads of it), the rest as they are
        return "(" + ", ".join(str(a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in args) + ")"

    return [f"{show(args)}: {answer(fn, args)} != vLLM's {answer(reference, args)}" for args in cases
            if answer(fn, args) != answer(reference, args)]


@needs_vllm_source
def test_kvfuzzs_copies_equal_vllms_functions():
    """Where vLLM's files are missing, kvfuzz's copies stand in: they answer as vLLM 0.33.0's functions on both of
    get_kernel_options's branches and on _get_block_sizes's settings and errors."""
    assert mismatches(COPIES[GET_KERNEL_OPTIONS], vllm_function(GET_KERNEL_OPTIONS), kernel_option_cases()) == []
    assert mismatches(COPIES[GET_BLOCK_SIZES], vllm_function(GET_BLOCK_SIZES), block_size_cases()) == []


@needs_vllm_source
def test_a_wrong_copy_is_caught():
    """Planted: a copy that prefers 64-wide tiles for fp32 queries too, and one that drops the power-of-two check."""

    def wide_fp32(query, block_m, block_n, use_direct_build):
        return COPIES[GET_KERNEL_OPTIONS](torch.empty(0, dtype=torch.float16), block_m, block_n, use_direct_build)

    def any_kv_block(attn_cfg, small, block, paged):
        return (16, block) if small and paged else (128, 128)

    wrong = mismatches(wide_fp32, vllm_function(GET_KERNEL_OPTIONS), kernel_option_cases())
    assert wrong and all(m.startswith("(torch.float32, ") and ", False): " in m for m in wrong), wrong
    assert any("(..., True, 48, True)" in m.replace(f"{DEFAULT_ATTENTION_CONFIG!r}", "...") for m in mismatches(
        any_kv_block, vllm_function(GET_BLOCK_SIZES), block_size_cases()))


# ---- where the functions come from ---------------------------------------------------------------------------
def test_an_importable_vllm_is_used_as_imported(monkeypatch):
    mine = types.ModuleType(VLLM_FLEX_MODULE)
    mine.get_kernel_options = lambda query, block_m, block_n, direct: {"BLOCK_M": block_m, "BLOCK_N": block_n}
    monkeypatch.setitem(sys.modules, VLLM_FLEX_MODULE, mine)
    assert upstream_function(GET_KERNEL_OPTIONS) == (mine.get_kernel_options, "vllm (imported)")
    assert vllm_kernel_options(torch.float16, 64) == {"BLOCK_M": 16, "BLOCK_N": 64}


@needs_vllm_source
def test_an_imported_function_that_answers_wrongly_is_passed_over(monkeypatch):
    mine = types.ModuleType(VLLM_FLEX_MODULE)
    mine.get_kernel_options = lambda query, block_m, block_n, direct: {"FORCE_USE_FLEX_ATTENTION": True}
    monkeypatch.setitem(sys.modules, VLLM_FLEX_MODULE, mine)
    fn, where = upstream_function(GET_KERNEL_OPTIONS)
    assert where == f"vllm source {SOURCE}" and fn is not mine.get_kernel_options


@pytest.mark.parametrize("source, why", [
    (None, "importing it"),
    ("def get_kernel_options(query, block_m, block_n, use_direct_build):\n    return helper(block_m)\n",
     "NameError: name 'helper' is not defined"),
    ("def other():\n    pass\n", "LookupError"),
    ("def get_kernel_options(query, block_m, block_n\n", "SyntaxError"),
])
def test_without_vllms_function_kvfuzzs_copy_is_used_and_says_why(monkeypatch, tmp_path, source, why):
    """vLLM not importable (sys.modules entry None), and its file absent, or changed so its function needs a global
    kvfuzz does not give it, or without the function, or unparsable: the copy, and the reason in ``where``."""
    monkeypatch.setitem(sys.modules, VLLM_FLEX_MODULE, None)
    path = tmp_path / "flex_attention.py"
    if source is not None:
        path.write_text(source)
    monkeypatch.setattr(flex_options, "vllm_flex_source", lambda: path if source is not None else None)
    fn, where = upstream_function(GET_KERNEL_OPTIONS)
    assert fn is COPIES[GET_KERNEL_OPTIONS]
    assert where.startswith("kvfuzz's copy of vllm 0.33.0 (") and why in where, where


# ---- the chain vLLM runs per call --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_with_torch_2_9_vllm_passes_16_query_rows_and_one_page(dtype):
    assert flex_options.supports_small_blocks()  # torch 2.13 here, 2.11 on the GPU
    for page in (16, 32, 64, 128):
        assert vllm_kernel_options(dtype, page) == {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": page}
    with pytest.raises(ValueError, match="power of 2"):
        vllm_kernel_options(dtype, 48)


def test_the_torch_version_rule_is_vllms():
    from vllm.utils.torch_version import _is_torch_equal_or_newer, is_torch_equal_or_newer

    assert flex_options.supports_small_blocks() == is_torch_equal_or_newer("2.9.0.dev0")
    for version in ("2.6.0", "2.8.0+cu126", "2.9.0.dev20250801", "2.9.0a0+git1234", "2.9.0", "2.11.0+cu128",
                    "2.13.0+cpu"):
        assert flex_options.supports_small_blocks(version) == _is_torch_equal_or_newer(version, "2.9.0.dev0"), version


def test_batch_invariance_as_vllm_reads_it(monkeypatch):
    """VLLM_BATCH_INVARIANT=1: 16 x 16 tiles and IS_DIVISIBLE False (FlexAttentionImpl), read as vllm.envs reads it."""
    import vllm.envs

    for value in ("0", "1"):
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", value)
        assert flex_options.batch_invariant() == vllm.envs.VLLM_BATCH_INVARIANT == (value == "1")
    assert vllm_kernel_options(torch.float16, 64) == {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": 16,
                                                      "IS_DIVISIBLE": False}


@needs_vllm_source
def test_the_target_declares_only_page_sizes_vllm_runs():
    """vLLM's backend runs multiples of 16 (get_supported_kernel_block_sizes) that are powers of two
    (_get_block_sizes raises for the rest, as vLLM's own function shows here)."""
    get_block_sizes = vllm_function(GET_BLOCK_SIZES)
    for page in TorchFlexPaged.capabilities.block_sizes:
        assert vllm_runs_block_size(page) and get_block_sizes(DEFAULT_ATTENTION_CONFIG, True, page, True)
    for page in (0, 8, 24, 48, 96):
        assert not vllm_runs_block_size(page), page
    for page in (24, 48, 96):
        with pytest.raises(ValueError, match="power of 2"):
            get_block_sizes(DEFAULT_ATTENTION_CONFIG, True, page, True)
    assert "MultipleOf(16)" in SOURCE.read_text()  # the 16 of KERNEL_BLOCK_MULTIPLE, where vLLM states it


# ---- importing vLLM's module leaves vLLM's Triton targets runnable on the CPU -----------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter matters on a machine without CUDA only")
@pytest.mark.parametrize("first", ["upstream_function", "a bare import of vLLM's module"])
def test_finding_vllms_function_enables_tritons_interpreter_first(first):
    """The import attempt imports triton (through vllm); in a fresh interpreter, upstream_function enables Triton's
    interpreter before it, so vLLM's Triton kernels still run there. Planted: the bare import leaves triton
    imported too early."""
    import subprocess

    code = ("import importlib, torch\n"
            "from kvfuzz.fuzz.targets import flex_options as f\n"
            + ("f.upstream_function(f.GET_KERNEL_OPTIONS)\n" if first == "upstream_function" else
               "try:\n    importlib.import_module(f.VLLM_FLEX_MODULE)\nexcept ImportError:\n    pass\n")
            + "from kvfuzz.fuzz.targets.triton_runtime import triton_imported_too_early\n"
            "import sys\nprint('triton' in sys.modules, triton_imported_too_early())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == (["True", "False"] if first == "upstream_function" else ["True", "True"])
