"""The kvfuzz command end to end: the seeds' caller fault found, shrunk, written, replayed."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, SUPPORT, available, kvfuzz, start_kvfuzz

pytestmark = pytest.mark.kernel
TRITON = "vllm.chunked_prefill_paged_decode"
PLANTED = SUPPORT / "planted_endings.py"


@pytest.fixture(scope="module")
def caller_fault_run(tmp_path_factory):
    available(TRITON)
    out = tmp_path_factory.mktemp("fuzz")
    r = kvfuzz("fuzz", "--target", TRITON, "--caller-fault", "decode-ctx-only", "--max-examples", "8",
               "--seed", "3", "--out", str(out))
    return r, out


def test_caller_fault_exits_1_and_names_the_decode_invariant(caller_fault_run):
    r, out = caller_fault_run
    assert r.returncode == 1, r.stdout + r.stderr
    assert "caller contract violation" in r.stdout and "decode invariant" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    (t,) = summary["targets"]
    kinds = {(f["kind"], f["check"], f["blame"]) for f in t["failures"]}
    assert ("caller contract violation", "decode invariant", "caller") in kinds
    assert not any(f["blame"] == "kernel" for f in t["failures"]), t["failures"]


def test_reproducer_is_one_decode_sequence(caller_fault_run):
    _, out = caller_fault_run
    (d,) = [p for p in out.iterdir() if p.name.startswith(TRITON + "-caller-violation-decode-invariant")]
    case = json.loads((d / "case.json").read_text())
    batch = case["example"]["batch"]
    assert batch["query_lens"] == [1] and case["derived"]["decode_seqs"] == [0]
    assert case["kind"] == "caller contract violation" and case["blame"] == "caller"
    assert case["details"]["kernel"]["outcome"] in ("non-finite", "mismatch")
    assert case["details"]["violations"][0]["position"] == batch["ctx_lens"][0]
    assert {"torch", "triton", "vllm", "hypothesis", "kvfuzz"} <= set(case["versions"])
    from safetensors.torch import load_file
    tensors = load_file(str(d / "tensors.safetensors"))
    assert {"query", "key_cache", "value_cache", "block_table", "output", "reference"} <= set(tensors)


def test_replay_and_test_case_fail_the_same_way(caller_fault_run):
    _, out = caller_fault_run
    (d,) = [p for p in out.iterdir() if p.name.startswith(TRITON + "-caller-violation")]
    r = kvfuzz("replay", str(d))
    assert r.returncode == 1 and "reproduced" in r.stdout and "decode invariant" in r.stdout, r.stdout + r.stderr
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(d / "test_case.py")],
                       capture_output=True, text=True, timeout=600, cwd=d)
    assert p.returncode == 1 and "caller contract violation (decode invariant)" in p.stdout, p.stdout


def test_the_database_replays_the_failure_first(caller_fault_run):
    """A second campaign with no new examples to spend still finds the saved failure at once."""
    _, out = caller_fault_run
    r = kvfuzz("fuzz", "--target", TRITON, "--caller-fault", "decode-ctx-only", "--max-examples", "1",
               "--seed", "99", "--out", str(out))
    assert r.returncode == 1 and "decode invariant" in r.stdout


@pytest.mark.cli_text
def test_targets_lists_both_with_availability():
    r = kvfuzz("targets", "--json")
    assert r.returncode == 0
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows[TRITON]["contract"] == "split" and rows["vllm.cpu_attention"]["contract"] == "unified"
    assert all(isinstance(row["available"], bool) and row["reason"] for row in rows.values())
    assert "fp8_e5m2" in rows[TRITON]["kv_cache_dtypes"] and ["alibi", "sinks"] in rows[TRITON]["exclusive"]
    assert set(rows["vllm.unified_attention"]["features"]) == {"alibi", "sinks", "sliding_window", "softcap"}
    assert "freed window blocks" in rows["vllm.unified_attention"]["states"]
    assert "freed window blocks" in rows[TRITON]["states"]  # ROCm's backend calls it on freed blocks (vllm#53628)
    assert "freed window blocks" not in rows["vllm.decode_attention_fwd"]["states"]  # no sliding window
    assert "shared prefix" in rows["sglang.decode_attention_fwd"]["states"]
    piped = kvfuzz("targets").stdout.splitlines()
    assert piped[0].split("\t")[7] == "states"
    (unified,) = [line.split("\t") for line in piped if line.startswith("vllm.unified_attention\t")]
    assert "freed window blocks" in unified[7].split(",")


def test_targets_lists_the_sglang_targets_with_csr_metadata():
    rows = {row["name"]: row for row in json.loads(kvfuzz("targets", "--json").stdout)}
    assert rows["sglang.extend_attention_fwd"]["contract"] == "prefix [CSR]"
    assert rows["sglang.decode_attention_fwd"]["contract"] == "unified (decode-only) [CSR]"
    assert all(rows[n]["metadata"] == "csr" and rows[n]["shared_prefix_blocks"]
               for n in rows if n.startswith("sglang."))
    assert rows[TRITON]["metadata"] == "block_table" and rows[TRITON]["shared_prefix_blocks"]  # vLLM's prefix caching


def test_targets_lists_the_states_each_target_declares():
    """The CUDA-graph padding state, by convention, on the targets whose engine pads them, and nowhere else (vLLM's
    CPU backend runs no CUDA graphs); shared prefix pages on the vLLM and SGLang targets."""
    rows = {row["name"]: row for row in json.loads(kvfuzz("targets", "--json").stdout)}
    assert rows["vllm.unified_attention"]["states"] == ["shared prefix", "freed window blocks",
                                                        "cuda-graph padding (vllm)"]
    assert rows["sglang.decode_attention_fwd"]["states"] == ["shared prefix", "cuda-graph padding (sglang)"]
    assert rows["vllm.cpu_attention"]["states"] == ["shared prefix"]
    assert rows[TRITON]["states"] == ["shared prefix", "freed window blocks"]  # ROCm's path (vllm#53628)
    assert rows["vllm.triton_mla_decode"]["states"] == ["shared prefix", "cuda-graph padding (vllm)"]  # TRITON_MLA
    assert rows["vllm.flashmla_decode"]["states"] == ["shared prefix", "cuda-graph padding (vllm)"]  # FLASHMLA
    assert rows["vllm.flash_attn_varlen"]["states"] == ["shared prefix", "freed window blocks",
                                                        "cuda-graph padding (vllm)"]  # FLASH_ATTN (FA3)
    # what an fp8 cache narrows, each list in the JSON as the table's cell says it (null: not narrowed)
    assert rows["sglang.decode_attention_fwd"]["fp8_gqa_ratios"] == [1]  # MHA only with an fp8 cache
    assert rows["vllm.flash_attn_varlen"]["fp8_dtypes"] == ["bfloat16"] and rows["vllm.flash_attn_varlen"][
        "fp8_gqa_ratios"] is None
    piped = kvfuzz("targets").stdout.splitlines()
    header = piped[0].split("\t")
    line = next(row.split("\t") for row in piped if row.startswith("vllm.unified_attention\t"))
    assert line[header.index("states")] == "shared prefix,freed window blocks,cuda-graph padding (vllm)"


def test_the_seeds_fault_on_sglang_decode_is_the_callers(tmp_path):
    available("sglang.decode_attention_fwd")
    r = kvfuzz("fuzz", "--target", "sglang.decode_attention_fwd", "--caller-fault", "decode-ctx-only",
               "--max-examples", "3", "--seed", "5", "--out", str(tmp_path))
    assert r.returncode == 1 and "unified invariant" in r.stdout and "blame: caller" in r.stdout, r.stdout


@pytest.mark.parametrize("args, message", [
    (["fuzz", "--target", "nope"], "unknown target 'nope'"),
    (["fuzz", "--caller-fault", "nope"], "nope"),
    (["fuzz", "--duration", "soon"], "give seconds"),
    (["replay", "."], "case.json: does not exist"),
    (["fuzz", "--big-cache", "--target", "vllm.cpu_reshape_and_cache"], "--big-cache fuzzes attention kernels"),
])
@pytest.mark.cli_text
def test_bad_usage_exits_2_with_the_problem_named(tmp_path, args, message):
    r = kvfuzz(*args, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("args, message", [
    (["--duration", "0"], "--duration"),
    (["--out", ""], "--out"),
    (["--max-examples", "0"], "--max-examples"),
])
@pytest.mark.cli_text
def test_cli_edges_are_usage_errors(tmp_path, args, message):
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", *(["--out", str(tmp_path / "o")] if "--out" not in args
                                                            else []), *args)
    assert r.returncode == 2 and message in r.stderr, r.stdout + r.stderr


@pytest.mark.cli_text
def test_out_under_a_file_or_in_proc_is_a_usage_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    for out in (f / "sub", "/proc/kvfuzz-out"):
        r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--out", str(out))
        assert r.returncode == 2 and "--out" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_clean_run_exits_0(tmp_path):
    """The shipped baseline's known findings on the CPU op (Finding 11: softcap NaN at 'extreme' values, drawn by
    default) are counted and listed, yet the campaign exits 0; anything else found would exit 1."""
    available("vllm.cpu_attention")
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--max-examples", "20", "--poison", "stale",
               "--baseline", str(ROOT / "kvfuzz-baseline.toml"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    (t,) = json.loads((tmp_path / "summary.json").read_text())["targets"]
    assert t["examples"] == 20 and t["examples_per_s"] > 0
    assert all(f.get("known") == "finding-11" for f in t["failures"]), t["failures"]


def test_big_cache_campaign_on_the_cpu_op(tmp_path):
    """Blocks past 2**31 elements of 4+ GiB caches, allocated but poisoned only where referenced: the CPU op
    runs them on this machine without touching the rest (measured: 400 examples in 7.7 s, 0.5 GB RSS)."""
    available("vllm.cpu_attention")
    r = kvfuzz("fuzz", "--big-cache", "--target", "vllm.cpu_attention", "--max-examples", "10", "--poison", "stale",
               "--baseline", str(ROOT / "kvfuzz-baseline.toml"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    (t,) = json.loads((tmp_path / "summary.json").read_text())["targets"]
    assert t["examples"] == 10 and all(f.get("known") == "finding-11" for f in t["failures"]), t["failures"]


def test_a_user_adapter_loads_as_package_module_class(tmp_path):
    import os
    examples = ROOT / "examples"
    r = kvfuzz("fuzz", "--target", "sdpa_paged_target:SdpaPaged", "--max-examples", "5", "--out", str(tmp_path),
               env={**os.environ, "PYTHONPATH": str(examples)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["targets"][0]["target"] == "example.sdpa_paged"


def test_a_user_adapter_loads_from_a_file_outside_the_package(tmp_path):
    adapter = ROOT / "examples" / "sdpa_paged_target.py"
    r = kvfuzz("fuzz", "--target", f"{adapter}:SdpaPaged", "--max-examples", "15", "--poison", "nan",
               "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    (t,) = json.loads((tmp_path / "summary.json").read_text())["targets"]
    assert t["target"] == "example.sdpa_paged" and t["examples"] == 15


def test_observability_writes_tyche_json_lines(tmp_path):
    available("vllm.cpu_attention")
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--max-examples", "5", "--poison", "stale",
               "--observability", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    (f,) = list((tmp_path / "observed").glob("*_testcases.jsonl"))
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    assert len(lines) >= 5 and all(x["type"] == "test_case" for x in lines)
    assert lines[0]["property"] == "kvfuzz_vllm_cpu_attention"
    assert any(k.startswith("path: ") for k in lines[0]["features"])


def test_sigterm_stops_after_the_current_example_and_writes_the_summary(tmp_path):
    import signal
    import time
    available(TRITON)
    p = start_kvfuzz("fuzz", "--target", TRITON, "--max-examples", "1000", "--poison", "stale", "--out", str(tmp_path))
    deadline = time.monotonic() + 900  # until the status file counts an example, however long start-up takes
    while True:
        try:
            if json.loads((tmp_path / "status.json").read_text())["targets"][0]["examples"] > 0:
                break
        except (OSError, ValueError, KeyError, IndexError):
            pass
        assert p.poll() is None, "the campaign ended before it counted an example"
        assert time.monotonic() < deadline, "no example counted in 900 s"
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] is True and p.returncode == 3, out + err  # 3: did not run as asked
    assert 0 < summary["targets"][0]["examples"] < 1000
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["running"] is False and state["in_flight"] == {}
    # resuming continues the chunk sequence instead of repeating the seeds already explored
    chunks = state["chunks"][TRITON]
    r = kvfuzz("fuzz", "--target", TRITON, "--max-examples", "2", "--poison", "stale", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "state.json").read_text())["chunks"][TRITON] > chunks
    assert json.loads((tmp_path / "summary.json").read_text())["interrupted"] is False


def test_fuzz_writes_a_report_with_coverage_plots(tmp_path):
    available("vllm.cpu_attention")
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--max-examples", "20", "--poison", "nan",
               "--out", str(tmp_path))
    assert r.returncode == 1
    report = (tmp_path / "report.md").read_text()
    assert "| vllm.cpu_attention | 20 |" in report and "non-finite output" in report
    png = tmp_path / "coverage-vllm.cpu_attention.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    assert "![coverage of vllm.cpu_attention](coverage-vllm.cpu_attention.png)" in report
    r = kvfuzz("report", str(tmp_path / "nothing-here"))
    assert r.returncode == 2


def test_bench_curve_writes_a_cold_and_a_warm_run_into_a_new_dir(tmp_path):
    """`kvfuzz bench curve` on a CPU target: its --dir is created, each run's campaign ran and was sampled, and
    the JSON (written after every run) holds both modes."""
    doc_path = tmp_path / "results" / "curve.json"
    r = kvfuzz("bench", "curve", "--target", "mutant.base", "--duration", "3s", "--workers", "1", "--interval",
               "0.5", "--dir", str(tmp_path / "not" / "yet"), "--json", str(doc_path), "--", "--poison", "stale")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(doc_path.read_text())
    assert [(x["mode"], x["workers"]) for x in doc["runs"]] == [("cold", 1), ("warm", 1)]
    for run in doc["runs"]:
        assert run["exit_status"] == 0 and run["examples"] > 0 and run["samples"]
        assert run["failures"] == [] and run["declared_never_drawn"] is not None


def test_small_references_of_a_cuda_target_run_on_the_cpu(make_batch):
    from kvfuzz.fuzz.harness.attention import GPU_REFERENCE_MIN_KV, reference_device

    class OnCuda:
        device = "cuda"

    class OnCpu:
        device = "cpu"

    small = make_batch([(3, 4), (1, 9)], head_size=32)
    big = make_batch([(1, GPU_REFERENCE_MIN_KV // 32)], head_size=32, num_heads=1, num_kv_heads=1, block_size=16)
    assert big.kv_elements >= GPU_REFERENCE_MIN_KV > small.kv_elements
    assert reference_device(OnCuda(), small) == "cpu" and reference_device(OnCuda(), big) == "cuda"
    assert reference_device(OnCpu(), big) == "cpu"


@pytest.mark.cli_text
def test_output_that_is_not_a_terminal_is_never_wrapped(tmp_path, monkeypatch):
    """Piped or logged, whatever COLUMNS says: a message whole on one line, a table at its full width."""
    import io

    from rich.table import Table

    from kvfuzz.fuzz.cli.common import make_console

    monkeypatch.setenv("COLUMNS", "40")
    buf = io.StringIO()
    c = make_console(buf)
    message = "cannot start: " + "/deep" * 60 + "/db is a file, not a directory"
    c.print(message)
    table = Table(title="wide")
    table.add_column("target", overflow="fold")
    table.add_column("failures", overflow="fold")
    table.add_row("vllm.cpu_attention", "kernel mismatch " + "x" * 200)
    c.print(table)
    lines = buf.getvalue().splitlines()
    assert message in lines, lines
    assert any("kernel mismatch " + "x" * 200 in line for line in lines), lines


def test_on_a_terminal_rich_keeps_its_layout(monkeypatch):
    import io

    from kvfuzz.fuzz.cli.common import UNWRAPPED_WIDTH, make_console

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "40")
    buf = Tty()
    c = make_console(buf)
    assert c.width == 40 and c.width != UNWRAPPED_WIDTH
    c.print("word " * 20)
    assert max(len(line) for line in buf.getvalue().splitlines()) <= 40


@pytest.mark.cli_text
def test_a_cli_message_naming_a_long_path_is_one_line_in_a_log(tmp_path):
    """The fuzz command's own message, piped with COLUMNS=40 and a path of ~300 characters: one whole line."""
    deep = tmp_path.joinpath(*["d" * 40] * 7)
    deep.mkdir(parents=True)
    f = deep / "db-file"
    f.write_text("")
    planted = SUPPORT / "planted_endings.py"
    r = kvfuzz("fuzz", "--target", f"{planted}:Correct", "--db", str(f), "--out", str(tmp_path / "o"),
               env=dict(os.environ, COLUMNS="40"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert any(str(f) in line and "is a file, not a directory" in line for line in r.stdout.splitlines()), r.stdout


def test_targets_tells_availability_without_loading_a_kernel_library():
    """`kvfuzz targets` (without --check) imports no kernel library: it answers from what is installed and says
    so; --check loads each kernel, as `kvfuzz fuzz` does."""
    probe = ("import sys; from kvfuzz.fuzz.cli import main\n"
             "try:\n    main(['targets', '--json'])\nexcept SystemExit:\n    pass\n"
             "print([m for m in ('vllm', 'triton', 'sglang', 'torch._dynamo', 'torch._inductor') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    *rows_json, imported = r.stdout.rstrip().splitlines()
    assert imported == "[]", imported
    rows = {row["name"]: row for row in json.loads("\n".join(rows_json))}
    assert not any(row["loaded"] for row in rows.values())
    assert all("not loaded (--check loads it)" in row["reason"] for row in rows.values() if row["available"])
    checked = {row["name"]: row for row in json.loads(kvfuzz("targets", "--json", "--check").stdout)}
    assert rows and checked.keys() == rows.keys()  # every target forecast is loaded and compared below
    assert all(row["loaded"] for row in checked.values())
    for name, row in checked.items():  # the forecast agrees with loading, here
        assert row["available"] == rows[name]["available"], (name, row["reason"], rows[name]["reason"])
        assert "not loaded" not in row["reason"]


def test_installed_names_what_is_missing_without_loading(monkeypatch, tmp_path):
    from kvfuzz.fuzz.targets import sglang_triton, triton_runtime, vllm_cpu
    from kvfuzz.fuzz.targets.sglang_triton import SglangDecodeAttentionFwd
    from kvfuzz.fuzz.targets.torch_flex import TorchFlexPaged
    from kvfuzz.fuzz.targets.vllm_cpu import VllmCpuAttention
    from kvfuzz.fuzz.targets.vllm_triton import VllmUnifiedAttention, module_file

    assert module_file("vllm.v1.attention.ops.no_such_kernel") is None and module_file("no_such_pkg.x") is None
    monkeypatch.setattr(vllm_cpu, "_AVAILABILITY", None)
    monkeypatch.setenv(vllm_cpu.LIB_ENV, str(tmp_path / "missing.so"))
    a = VllmCpuAttention().installed()
    assert not a.ok and "missing.so is not a file" in a.reason
    monkeypatch.setattr(vllm_cpu.torch, "__version__", "2.4.0")
    assert "built against torch 2.13" in VllmCpuAttention().installed().reason
    monkeypatch.setenv(sglang_triton.TREE_ENV, str(tmp_path))
    # triton may already be imported in this worker by an earlier test: its interpreter on, so the tree is what's judged
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = SglangDecodeAttentionFwd().installed()
    assert not a.ok and f"{sglang_triton.TREE_ENV}={tmp_path} lacks" in a.reason
    t = VllmUnifiedAttention()
    monkeypatch.setattr(t, "kernel_module", lambda: "vllm.v1.attention.ops.no_such_kernel")
    if importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("triton") is not None:
        a = t.installed()
        assert not a.ok and "has no vllm.v1.attention.ops.no_such_kernel" in a.reason
    monkeypatch.setattr(triton_runtime, "on_cuda", lambda: False)
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or object())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_runtime.triton_imported_too_early()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    a = TorchFlexPaged().installed()
    assert not a.ok and "torch.nn.attention.flex_attention" in a.reason


def test_a_target_that_cannot_tell_without_loading_is_loaded(tmp_path, monkeypatch):
    """An adapter without installed() (the base class's None) is asked availability(), and says loaded."""
    from click.testing import CliRunner

    import kvfuzz.fuzz.targets as targets_pkg
    from kvfuzz.fuzz.cli import main
    from kvfuzz.fuzz.targets.registry import load_spec

    (tmp_path / "plain_target.py").write_text(
        "import sys\nsys.path.insert(0, %r)\nfrom sdpa_paged_target import SdpaPaged\n"
        "class Plain(SdpaPaged):\n    name = 'plain.sdpa'\n" % str(ROOT / "examples"))
    t = load_spec(f"{tmp_path / 'plain_target.py'}:Plain")
    assert t.installed() is None
    asked = []
    monkeypatch.setattr(type(t), "availability", lambda self: asked.append(1) or type(t).__mro__[1].availability(self))
    monkeypatch.setattr(targets_pkg, "registered", lambda: ["plain.sdpa"])
    monkeypatch.setattr(targets_pkg, "get_target", lambda name: t)
    r = CliRunner().invoke(main, ["targets", "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.output)
    assert row["loaded"] is True and row["available"] is True and asked


def test_bench_curve_warm_capped_stops_at_the_cold_runs_examples(tmp_path):
    """--mode warm-capped: the warm run draws exactly as many examples as the cold run (so it visits only what
    the cold run compiled); modes must start cold."""
    doc_path = tmp_path / "curve.json"
    # the cold run ends at its example budget (30), never at the (long) duration: no dependence on speed
    r = kvfuzz("bench", "curve", "--target", "mutant.base", "--duration", "10m", "--workers", "1", "--interval",
               "0.5", "--mode", "warm-capped", "--dir", str(tmp_path / "runs"), "--json", str(doc_path), "--",
               "--poison", "stale", "--max-examples", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    cold, capped = json.loads(doc_path.read_text())["runs"]
    assert (cold["mode"], capped["mode"]) == ("cold", "warm-capped")
    assert cold["examples"] == 30 and capped["examples"] == cold["examples"]
    from kvfuzz.fuzz.bench.curve import curve

    with pytest.raises(ValueError, match="start with 'cold'"):
        curve(["mutant.base"], 1.0, [1], modes=("warm",))


def test_bench_curve_cold_only_runs_one_campaign(tmp_path):
    """--cold-only: the cold run and nothing after it; with --mode it is a usage error (exit 2)."""
    doc_path = tmp_path / "curve.json"
    r = kvfuzz("bench", "curve", "--target", "mutant.base", "--duration", "10m", "--workers", "1", "--interval",
               "0.5", "--cold-only", "--dir", str(tmp_path / "runs"), "--json", str(doc_path), "--",
               "--poison", "stale", "--max-examples", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    (cold,) = json.loads(doc_path.read_text())["runs"]
    assert cold["mode"] == "cold" and cold["examples"] == 10
    r = kvfuzz("bench", "curve", "--target", "mutant.base", "--cold-only", "--mode", "warm")
    assert r.returncode == 2 and "--cold-only" in r.stderr


def test_bench_curve_hands_warm_capped_the_cold_runs_count(monkeypatch, tmp_path):
    """The cap itself: the warm-capped run gets ``--max-examples`` = the cold run's examples, the plain warm run
    no cap, and both after the user's own arguments (click takes the last)."""
    from kvfuzz.fuzz.bench import curve as curve_mod

    calls = []

    def fake_run(target, duration, workers, cache, out, seed, interval, extra):
        calls.append(tuple(extra))
        return {"examples": 1234 if not calls[1:] else 7}

    monkeypatch.setattr(curve_mod, "run_campaign", fake_run)
    doc = curve_mod.curve(["t"], 5.0, [1], root=tmp_path, extra=("--poison", "stale"),
                          modes=("cold", "warm", "warm-capped"))
    assert [r["mode"] for r in doc["runs"]] == ["cold", "warm", "warm-capped"]
    assert calls == [("--poison", "stale"), ("--poison", "stale"), ("--poison", "stale", "--max-examples", "1234")]


# ---- every option's bad values: exit 2, the option named, no traceback ----
# {file} is an existing file (a folder cannot be made under it), {case} a reproducer directory of regressions/.
BAD_VALUES = [  # (command, option, bad value): options whose values click's types do not check by themselves
    ("fuzz", "--db", "redis://:notaport/x"),
    ("fuzz", "--db", "redis://localhost:6379/abc"),
    ("fuzz", "--db", "redis:///0"),
    ("fuzz", "--db", ""),
    ("check", "--db", "redis://:notaport/x"),
    ("fuzz", "--duration", "soon"),
    ("fuzz", "--sanitize", "1.5"),
    ("fuzz", "--sanitize", "often"),
    ("fuzz", "--duration", "0"),
    ("bench detect", "--duration", "soon"),
    ("bench curve", "--duration", "0s"),
    ("fuzz", "--target", "nope"),
    ("check", "--target", "nope"),
    ("relations", "--target", "nope"),
    ("bench throughput", "--target", "nope"),
    ("bench curve", "--target", "nope"),
    ("replay {case}", "--target", "nope"),
    ("relations", "--relation", "nope"),
    ("bench detect", "--mutant", "nope"),
    ("bench curve", "--workers", "zero"),
    ("fuzz", "--out", "{file}/sub"),
    ("check", "--out", "{file}"),
    ("check", "--corpus", "{file}"),
    ("fuzz", "--triton-cache", "{file}/sub"),
    ("fuzz", "--jit-cache", "{file}/sub"),
    ("bench curve", "--dir", "{file}/sub"),
    ("fuzz", "--baseline", "{file}.missing"),
    ("check", "--junit-xml", "{file}/x.xml"),
    ("relations", "--json", "{file}/x.json"),
    ("bench detect", "--json", "{file}/x.json"),
    ("bench detect", "--markdown", "{file}/x.md"),
    ("bench throughput", "--json", "{file}/x.json"),
    ("bench curve", "--json", "{file}/x.json"),
    ("bench curve", "--plot", "{file}/x.png"),
    ("bench bugs", "--bug", "nope"),
    ("bench bugs", "--duration", "soon"),
    ("bench bugs", "--json", "{file}/x.json"),
    ("bench bugs", "--baseline", "{file}.missing"),
    ("bench upstream", "--tree", "{file}"),
    ("bench upstream", "--tree", "{file}.missing"),
    ("bench upstream --tree {case}", "--bug", "nope"),
    ("bench upstream --tree {case}", "--bug", "sglang-2479x"),
    ("bench upstream --tree {case}", "--json", "{file}/x.json"),
    ("baseline add {case} --id x --reason r --reference r", "--baseline", "{file}/b.toml"),
    ("report {case} --issue", "--baseline", "{file}.missing"),
    ("fuzz", "--db", "http://127.0.0.1:1/"),
    ("check", "--db", "reddis://localhost:6379/0"),
    ("baseline add {case} --reason r --reference r", "--id", " "),
    ("baseline add {case} --id x --reference r", "--reason", ""),
    ("baseline add {case} --id x --reason r", "--reference", ""),
]
#: What a command needs besides the option under test (its arguments, required options).
REQUIRED = {"replay": ["{case}"], "report": ["{case}"], "bench upstream": ["--tree", "{case}"],
            "baseline add": ["{case}", "--id", "x", "--reason", "r", "--reference", "r"]}


def _fill(words: list[str], tmp_path: Path) -> list[str]:
    f = tmp_path / "a-file"
    f.write_text("")
    case = next((ROOT / "regressions").glob("vllm.*"))
    return [w.replace("{file}", str(f)).replace("{case}", str(case)) for w in words]


def _assert_refused(code: int, out: str, option: str, traceback: bool) -> None:
    assert code == 2, f"exit {code}, not 2:\n{out}"
    assert option in out, f"the message does not name {option}:\n{out}"
    assert not traceback, f"a traceback:\n{out}"


@pytest.mark.parametrize("command, option, value", BAD_VALUES,
                         ids=[f"{c.split(' {')[0]} {o}={v!r}" for c, o, v in BAD_VALUES])
@pytest.mark.cli_text
def test_a_bad_value_exits_2_naming_the_option(tmp_path, command, option, value):
    args = _fill([*command.split(), option, value], tmp_path)
    r = kvfuzz(*args, cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    _assert_refused(r.returncode, out, option, "Traceback" in out)


def leaf_commands(group=None, path=("kvfuzz",)) -> dict:
    """Every runnable command of ``kvfuzz`` (or of ``group``), by its full name ("kvfuzz bench curve")."""
    import click

    from kvfuzz.fuzz.cli import main

    found = {}
    for name, cmd in (group or main).commands.items():
        if isinstance(cmd, click.Group):
            found |= leaf_commands(cmd, (*path, name))
        else:
            found[" ".join((*path, name))] = cmd
    return found


def _typed_bad_values():
    """(command, option, bad value) for every option whose click type checks its values: a Choice gets a name
    it does not list, a number range one below its minimum, a number a word."""
    import click

    for name, cmd in leaf_commands().items():
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.is_flag:
                continue
            t = p.type
            if isinstance(t, click.Choice):
                yield name, p.opts[0], "nope"
            elif isinstance(t, (click.IntRange, click.FloatRange)) and t.min is not None:
                yield name, p.opts[0], str(t.min - 1)
                if t.max is not None:  # a limit that cannot be met: refused at parse time, with its bound
                    yield name, p.opts[0], str(t.max + 1)
            elif t in (click.INT, click.FLOAT) or isinstance(t, (click.IntRange, click.FloatRange)):
                yield name, p.opts[0], "many"


TYPED = list(_typed_bad_values())


@pytest.mark.parametrize("command, option, value", TYPED, ids=[f"{c[7:]} {o}={v[:12]}" for c, o, v in TYPED])
@pytest.mark.cli_text
def test_a_value_of_the_wrong_type_exits_2_naming_the_option(tmp_path, command, option, value):
    from click.testing import CliRunner

    from kvfuzz.fuzz.cli import main

    words = command.split()[1:]
    extra = next((REQUIRED[k] for k in REQUIRED if " ".join(words) == k), [])
    r = CliRunner().invoke(main, _fill([*words, *extra, option, value], tmp_path))
    _assert_refused(r.exit_code, r.output, option, not isinstance(r.exception, (SystemExit, type(None))))


def test_every_option_is_walked_with_a_bad_value():
    import click

    walked = {(f"kvfuzz {c.split(' {')[0].split(' --')[0]}", o) for c, o, _ in BAD_VALUES} | {
        (c, o) for c, o, _ in TYPED}
    #: Options every value of which is a valid one.
    anything_goes = {("kvfuzz fuzz", "--seed"), ("kvfuzz check", "--seed"), ("kvfuzz relations", "--seed"),
                     ("kvfuzz bench curve", "--seed")}
    missing = [(name, p.opts[0]) for name, cmd in leaf_commands().items() for p in cmd.params
               if isinstance(p, click.Option) and not p.is_flag and (name, p.opts[0]) not in walked | anything_goes]
    assert not missing, f"options with no bad value in BAD_VALUES or TYPED: {missing}"


@pytest.mark.parametrize("var, value", [("KVFUZZ_FOCUS_SECONDS", "soon"), ("KVFUZZ_FOCUS_SECONDS", "-1"),
                                        ("KVFUZZ_FREE_SECONDS", "inf"), ("KVFUZZ_CHUNK_CLOCK", "cpu"),
                                        ("KVFUZZ_SANITIZE_STANDBY", "yes")])
@pytest.mark.cli_text
def test_a_bad_campaign_environment_variable_exits_2_naming_it(tmp_path, var, value):
    """The environment variables a campaign reads are checked before any worker starts: exit 2, the variable and its
    values named, no traceback, no campaign run."""
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--out", str(tmp_path / "o"), env={**os.environ, var: value})
    assert r.returncode == 2 and f"{var}={value!r}" in r.stderr and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "o" / "summary.json").exists()
