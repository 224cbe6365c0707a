"""Real upstream bugs re-injected into the pinned kernels (kvfuzz.fuzz.bench.bugs) and ``kvfuzz bench bugs``.

Each patch applies to the installed source; a patch whose context no longer matches is refused with a message
naming it and the file; the re-injected kernel differs from upstream's on the bug's hand-built smallest trigger;
and a short default campaign finds every bug it can reach on a CPU (docs/bugs.md says which it misses and why).
"""

import hashlib
import json
import tomllib
from pathlib import Path

import pytest
import torch
from support import ROOT, kvfuzz

from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench import bugs as bugs_mod
from kvfuzz.fuzz.bench.bugs import BUGS, get_bug, installed_file, smallest_trigger
from kvfuzz.fuzz.bench.bugs.patching import Patch, PatchDoesNotApply, parse_patches
from kvfuzz.fuzz.bench.paged_torch import batch_size
from kvfuzz.fuzz.harness import attention

#: The bugs a default CPU campaign is expected to find (the others: docs/bugs.md, Bug.why_missed).
FOUND_BY_DEFAULT = sorted(n for n, b in BUGS.items() if b.cpu and b.why_missed is None)
#: The bugs whose trigger runs in this process (vllm-47671's crashes it: tested in a child).
IN_PROCESS = sorted(n for n, b in BUGS.items() if b.cpu and not b.big_cache)
#: The bugs re-injected into one Python module (FlashInfer's, into a package copy: test_flashinfer_bugs.py).
MODULE_BUGS = sorted(n for n, b in BUGS.items() if b.package is None)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_registry_and_entry_point():
    assert set(BUGS) == {"bug.vllm-47305", "bug.vllm-56579", "bug.sglang-2479", "bug.vllm-47671", "bug.vllm-30887",
                         "bug.flashinfer-1416", "bug.flashinfer-350", "bug.flashinfer-4401"}
    for name, bug in BUGS.items():
        header = bug.patches()[0].header
        assert bug.upstream in header and "The fix" in header and "Undoing it:" in header, name
        assert get_bug(name).name == name and get_bug(name.removeprefix("bug.")).name == name
        assert (bug.why_missed is None) == (name in FOUND_BY_DEFAULT) or not bug.cpu
        assert bug.cpu == (name in MODULE_BUGS)  # FlashInfer's run on CUDA only
    with pytest.raises(KeyError, match="known: bug.flashinfer-1416, .*bug.sglang-2479"):
        get_bug("bug.nope")
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["kvfuzz.targets"]
    assert eps["bug.*"] == "kvfuzz.fuzz.bench.bugs:get_bug"


@pytest.mark.parametrize("name", MODULE_BUGS)
def test_patch_applies_to_the_installed_source(name):
    bug = BUGS[name]
    bug.check_applies()
    f = installed_file(bug.patched_module)
    patched = bug.patch().apply(f.read_text(), f)
    assert patched != f.read_text()


def test_planted_context_mismatch_is_refused(tmp_path, monkeypatch):
    bug = BUGS["bug.vllm-56579"]
    f = installed_file(bug.patched_module)
    changed = f.read_text().replace("    y = S / x\n", "    y = S / (x + 0.0)\n")
    assert changed != f.read_text()
    with pytest.raises(PatchDoesNotApply) as e:
        bug.patch().apply(changed, f)
    msg = str(e.value)
    assert "vllm-56579.patch no longer applies to" in msg and str(f) in msg
    assert "'    y = S / x'" in msg and "'    y = S / (x + 0.0)'" in msg  # what the patch wants, what the file has

    # a planted patch file: the target says it is unavailable, naming the patch and the file
    text = bug.patch_path.read_text().replace("-    y = S / x\n", "-    y = S / x  # planted\n")
    (tmp_path / "vllm-56579.patch").write_text(text)
    monkeypatch.setattr(bugs_mod, "PATCHES", tmp_path)
    with pytest.raises(PatchDoesNotApply, match=r"vllm-56579\.patch no longer applies to .*triton_attention_helpers"):
        bug.check_applies()
    a = get_bug(bug.name).availability()
    assert not a.ok and "no longer applies" in a.reason and "triton_attention_helpers.py" in a.reason


def test_hunks_apply_at_an_offset():
    patch = Patch.parse("hdr\n--- a/m.py\n+++ b/m.py\n@@ -2,3 +2,3 @@\n a\n-b\n+B\n c\n", "p.patch")
    assert patch.header == "hdr" and patch.path == "m.py"
    assert patch.apply("x\na\nb\nc\n") == "x\na\nB\nc\n"
    assert patch.apply("x\ny\nz\na\nb\nc\nd\n") == "x\ny\nz\na\nB\nc\nd\n"  # moved down: still found
    with pytest.raises(PatchDoesNotApply, match="hunk 1 of 1"):
        patch.apply("x\na\nb2\nc\n")
    with pytest.raises(ValueError, match="not a unified diff"):
        Patch.parse("no diff here", "q.patch")
    # several files (git diff output): one patch each; Patch.parse refuses them, a file twice is refused
    two = ("hdr\ndiff --git a/m.py b/m.py\nindex 1..2\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+A\n"
           "diff --git a/n.cuh b/n.cuh\n--- a/n.cuh\n+++ b/n.cuh\n@@ -1,2 +1 @@\n--- x\n y\n")
    m, n = parse_patches(two, "two.patch")
    assert (m.header, m.path, n.header, n.path) == ("hdr", "m.py", "", "n.cuh")
    assert n.apply("-- x\ny\n") == "y\n"  # a removed line that looks like a file header stays in its hunk
    with pytest.raises(ValueError, match="more than one file"):
        Patch.parse(two, "two.patch")
    with pytest.raises(ValueError, match="m.py appears twice"):
        parse_patches(two.replace("n.cuh", "m.py"), "dup.patch")


def _outputs(name: str):
    """Upstream's and the re-injected kernel's outputs on the bug's smallest trigger (NaN poison)."""
    bug = BUGS[name]
    example = Example(smallest_trigger(name), Poison.NAN)
    outs = []
    for target in (bug.base(), get_bug(name)):
        run = attention.prepare(target, example)
        if bug.scale_query != 1.0:
            run = attention.prepare(target, example, data=bug.trigger_data(run.data))
        outs.append(target.run(run.call).clone())
    return outs


@pytest.mark.kernel
@pytest.mark.parametrize("name", IN_PROCESS)
def test_reinjected_kernel_differs_on_the_smallest_trigger(name):
    installed = installed_file(BUGS[name].patched_module)
    before = _sha(installed)
    upstream, reinjected = _outputs(name)
    assert torch.isfinite(upstream).all(), f"{name}: upstream's kernel is not finite on the trigger"
    assert not torch.isfinite(reinjected).all(), f"{name}: the re-injected kernel is finite on the trigger"
    assert _sha(installed) == before  # the installed file is untouched


def test_installed_module_keeps_upstreams_code():
    """Loading a re-injected kernel leaves the installed modules as they are (the softcap bug rewires a private
    copy of triton_unified_attention, not the real one)."""
    from kvfuzz.fuzz.targets.triton_runtime import prepare_triton_runtime

    prepare_triton_runtime()
    kernel = BUGS["bug.vllm-56579"].kernel()
    import vllm.v1.attention.ops.triton_attention_helpers as helpers
    import vllm.v1.attention.ops.triton_unified_attention as tua

    assert kernel is not tua.unified_attention
    assert tua.apply_softcap is helpers.apply_softcap
    assert kernel.__globals__["apply_softcap"] is not helpers.apply_softcap
    assert "tl.exp(2.0 * y)" in Path(helpers.__file__).read_text()


def test_big_cache_trigger_is_past_int32():
    """vllm-47671's smallest trigger sits past 2**31 elements (where the int32 offset wraps); its patch removes
    both int64 casts."""
    b = smallest_trigger("bug.vllm-47671")
    per_block = b.block_size * b.num_kv_heads * b.head_size
    assert b.block_table[0][0] * per_block >= 2**31 > (b.block_table[0][0] - 1) * per_block
    f = installed_file(BUGS["bug.vllm-47671"].patched_module)
    patched = BUGS["bug.vllm-47671"].patch().apply(f.read_text(), f)
    assert f.read_text().count(").to(tl.int64)  # page_number") == 2 and ").to(tl.int64)  # page_number" not in patched


_CHILD = """
import sys, torch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.bugs import BUGS, get_bug, smallest_trigger
from kvfuzz.fuzz.harness import attention
name = "bug.vllm-47671"
target = BUGS[name].base() if sys.argv[1] == "upstream" else get_bug(name)
run = attention.prepare(target, Example(smallest_trigger(name), Poison.NAN))
out = target.run(run.call)
print("finite" if bool(torch.isfinite(out).all()) else "non-finite")
"""


@pytest.mark.kernel
def test_int32_offsets_crash_past_2_31_elements():
    """vllm-47671 on its smallest trigger (a page 2**31 elements into a 4 GiB fp16 cache whose untouched pages
    cost no RAM), each kernel in a child: upstream's is finite, the re-injected one's wrapped offset reads
    unmapped memory and the process dies by SIGSEGV."""
    import subprocess
    import sys

    up = subprocess.run([sys.executable, "-c", _CHILD, "upstream"], capture_output=True, text=True, timeout=600)
    assert up.returncode == 0 and up.stdout.strip().endswith("finite") and "non-finite" not in up.stdout, up.stderr
    bug = subprocess.run([sys.executable, "-c", _CHILD, "bug"], capture_output=True, text=True, timeout=600)
    assert bug.returncode == -11, (bug.returncode, bug.stdout, bug.stderr[-2000:])


@pytest.mark.kernel
@pytest.mark.parametrize("name", [n for n in FOUND_BY_DEFAULT if n not in ("bug.vllm-47305", "bug.vllm-30887")])
def test_short_default_campaign_finds_the_bug(name):
    """The CI budget: a default campaign (seed 0) finds the bug, shrinks it to the smallest trigger's sizes,
    and its reproducer replays. Bounded by examples only, so the result does not depend on the machine's speed
    (vllm-56579 is found at the 59th example of seed 0 since vllm.unified_attention also draws the freed-window
    state; 39 examples was all a loaded 2-core machine ran in the former 120 s)."""
    from kvfuzz.fuzz.bench.bugs.benchmark import run_bug

    r = run_bug(name, 0, duration=None, max_examples=300)
    assert r["found"], f"{name}: not found in {r['examples_total']} examples"
    # NaN/inf poison in the scratch or the cache tail gives a non-finite row; stale or zero poison a wrong one
    assert r["kind"] in ("non-finite output", "kernel mismatch") and r["blame"] == "kernel"
    assert r["replays"] is True and r["rerun_kinds"] == [r["kind"]] * 3
    smallest = batch_size(smallest_trigger(name))
    assert (r["size"]["seqs"], r["size"]["kv_tokens"]) <= (smallest["seqs"], smallest["kv_tokens"])


@pytest.mark.kernel
def test_a_campaign_in_the_bugs_configuration_finds_the_window_v_mask_bug():
    """vllm-30887 (unified_attention's V mask outside the window undone) needs the freed-window state
    (``Batch.freed_window_blocks``, declared by vllm.unified_attention), a sliding window, block size 16 (a 32-key
    tile holding a freed block next to a visible one: larger blocks fill a tile, and tiles wholly before the
    window are skipped) and the 2-D kernel (a prefill of more than 8 query tokens). A default campaign finds it on
    1 seed of 3 in 5 minutes here (docs/bugs.md); inside that configuration (the declaration narrowed to block size
    16, a window, the auto cache, as a pinned GPU campaign keeps one configuration per chunk) one bounded by
    examples finds it, blamed on the kernel, the reproducer replays, and it shrinks to at most two sequences: a
    decode reading a freed block and a 9-token prefill that routes the call to the 2-D kernel (docs/bugs.md)."""
    import attrs

    from kvfuzz.fuzz.bench.bugs import get_bug
    from kvfuzz.fuzz.bench.bugs.benchmark import run_bug

    target = get_bug("bug.vllm-30887")
    target.capabilities = attrs.evolve(target.capabilities.restrict(block_sizes=(16,), kv_cache_dtypes=("auto",)),
                                       features=frozenset({"sliding_window"}))
    r = run_bug("bug.vllm-30887", 0, duration=None, max_examples=150, target=target)
    assert r["found"], f"not found in {r['examples_total']} examples"
    assert (r["kind"], r["blame"]) == ("non-finite output", "kernel") and r["poison"] in ("nan", "inf")
    assert r["replays"] is True and r["rerun_kinds"] == [r["kind"]] * 3
    assert "freed_window_blocks" in r["case"]
    smallest = batch_size(smallest_trigger("bug.vllm-30887"))
    assert r["size"]["seqs"] <= 2 and r["size"]["kv_tokens"] <= smallest["kv_tokens"] + 1


@pytest.mark.kernel
def test_big_cache_campaign_finds_the_int32_offset_bug():
    """vllm-47671 is out of a default campaign's reach (docs/bugs.md); ``--big-cache`` finds it: a kernel crash
    blamed on the kernel, shrunk to one decode token, whose reproducer replays (in a child)."""
    from kvfuzz.fuzz.bench.bugs.benchmark import run_bug_supervised

    r = run_bug_supervised("bug.vllm-47671", 0, duration=120, max_examples=50)
    assert r["found"], f"not found in {r['examples_total']} examples"
    assert (r["kind"], r["blame"], r["check"]) == ("kernel crash", "kernel", "SIGSEGV")
    assert r["size"]["seqs"] == 1 and r["size"]["kv_tokens"] == 1
    assert r["replays"] is True


@pytest.mark.parametrize("name", sorted(n for n in MODULE_BUGS if BUGS[n].base.name == "vllm.unified_attention"))
def test_a_reinjected_kernels_file_keeps_upstreams_name_and_the_known_lines(name):
    """A memcheck report on the re-injected kernel names its source file and line; the base target's known
    memory-safety entries match on the upstream basename and line (vllm#56862: triton_unified_attention.py:432).
    On an H200 the private copy was named kvfuzz_bug_<slug>_..._triton_unified_attention.py, so vllm#56862 under
    bug.vllm-56579 stayed new with --baseline (a 9-token prefill, 80.3 s). The copy keeps the basename, and each
    known location's line reads as upstream's."""
    import inspect

    from kvfuzz.fuzz.campaign.store.baseline import load_baseline

    fn = BUGS[name].kernel()
    path = Path(inspect.getsourcefile(getattr(fn, "fn", fn)))
    upstream = installed_file(BUGS[name].kernel_module or BUGS[name].patched_module)
    assert path.name == upstream.name and path != upstream
    mine, theirs = path.read_text().splitlines(), upstream.read_text().splitlines()
    entries = [e for e in load_baseline(ROOT / "kvfuzz-baseline.toml").for_target(BUGS[name].base.name) if e.locations]
    assert entries
    for loc in (loc for e in entries for loc in e.locations):
        file, line = loc.rsplit(":", 1)
        assert file == path.name and mine[int(line) - 1] == theirs[int(line) - 1], loc


def test_bench_bugs_holds_a_bug_target_to_its_base_kernels_known_findings(tmp_path, monkeypatch):
    """A re-injected bug's target (``bug.vllm-30887``) runs its base target's kernel (``vllm.unified_attention``),
    live upstream bugs included, so ``--baseline`` holds it to the base target's entries. On an H200 it did not:
    vllm#56862's entry names vllm.unified_attention, the campaign's target was bug.vllm-30887, and the live bug's
    memcheck hit counted as 30887 found (seed 1, 109.6 s, known_hits []). In process (:func:`run_bug`) the campaign
    gets the base target's entries under the bug target's name, ids kept; under the supervisor
    (:func:`run_bug_supervised`) the child's ``--baseline`` file holds them so."""
    from kvfuzz.fuzz.bench.bugs import benchmark
    from kvfuzz.fuzz.campaign.store.baseline import load_baseline

    shipped = load_baseline(ROOT / "kvfuzz-baseline.toml")
    seen = {}

    class Stop(Exception):
        pass

    def fake_fuzz(target, config):
        seen["in process"] = (target.name, config.baseline)
        raise Stop

    monkeypatch.setattr(benchmark, "fuzz_target", fake_fuzz)
    with pytest.raises(Stop):
        benchmark.run_bug("bug.vllm-30887", 0, duration=1, baseline=str(ROOT / "kvfuzz-baseline.toml"))

    def fake_child(cmd, **kwargs):
        assert cmd[cmd.index("--target") + 1] == BUGS["bug.vllm-47671"].spec
        seen["child"] = ("bug.vllm-47671", load_baseline(cmd[cmd.index("--baseline") + 1]))
        return benchmark.subprocess.CompletedProcess(cmd, 1, "", "")

    monkeypatch.setattr(benchmark.subprocess, "run", fake_child)
    with pytest.raises(RuntimeError, match="without a summary"):  # the planted child wrote none
        benchmark.run_bug_supervised("bug.vllm-47671", 0, duration=1, baseline=str(ROOT / "kvfuzz-baseline.toml"))
    for (target, baseline), bug in zip((seen["in process"], seen["child"]), ("bug.vllm-30887", "bug.vllm-47671")):
        base = BUGS[bug].base.name
        want = [e.id for e in shipped.for_target(base)]
        assert want and [e.id for e in baseline.for_target(target)] == want, (bug, target)
        assert baseline.for_target(base) == ()
        others = [e for e in shipped.entries if e.target != base]
        assert [e for e in baseline.entries if e.target not in (base, target)] == others
    assert seen["in process"][0] == "bug.vllm-30887" and "vllm-56862" in [e.id for e in seen["in process"][1].entries]


@pytest.mark.kernel
@pytest.mark.cli_text
def test_cli_bench_bugs(tmp_path):
    """``kvfuzz bench bugs`` end to end on vllm-47305 (the other bug the default campaign finds): the table and
    the JSON; an unknown bug exits 2 naming the option and the known bugs."""
    out = tmp_path / "bugs.json"
    shipped = ROOT / "kvfuzz-baseline.toml"  # its known findings would not count as the bug found
    p = kvfuzz("bench", "bugs", "--bug", "vllm-47305", "--seeds", "1", "--duration", "120s", "--max-examples", "300",
               "--json", out, "--baseline", shipped)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["settings"]["baseline"] == str(shipped) and doc["bugs"][0]["runs"][0]["known_hits"] == []
    (entry,) = doc["bugs"]
    assert entry["bug"] == "bug.vllm-47305" and entry["summary"]["found"] == 1 and entry["summary"]["replayed"] == 1
    run = entry["runs"][0]
    assert run["kind"] == "non-finite output" and run["size"]["seqs"] == 1 and run["size"]["kv_tokens"] == 1
    assert doc["settings"]["machine"]
    bad = kvfuzz("bench", "bugs", "--bug", "nope")
    assert bad.returncode == 2 and "--bug" in bad.stderr and "bug.vllm-47305" in bad.stderr
    assert "Traceback" not in bad.stderr
    (tmp_path / "bad.toml").write_text('[[known]]\nid = "x"\n')
    bad = kvfuzz("bench", "bugs", "--bug", "vllm-47305", "--baseline", tmp_path / "bad.toml")
    assert bad.returncode == 2 and "bad.toml" in bad.stderr and "--baseline" in bad.stderr, bad.stderr
    live = kvfuzz("bench", "bugs", "--live", "--baseline", shipped)
    assert live.returncode == 2 and "--baseline" in live.stderr and "Traceback" not in live.stderr + bad.stderr
