"""The mutant zoo (kvfuzz.fuzz.bench.mutants) and ``kvfuzz bench detect`` (kvfuzz.fuzz.bench.detection)."""

import json

import pytest
from click.testing import CliRunner
from support import kvfuzz

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.mutants import MUTANTS, PagedTorch, get_mutant, smallest_trigger
from kvfuzz.fuzz.harness.attention import check_example

pytestmark = pytest.mark.kernel


def test_registry():
    assert len(MUTANTS) >= 12
    for name, cls in MUTANTS.items():
        assert name == cls.name and name.startswith("mutant.")
        assert cls.trigger and cls.bug and cls.__doc__
        assert issubclass(cls, PagedTorch)
    with pytest.raises(KeyError, match="known"):
        get_mutant("nope")


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_smallest_trigger_fails_the_property_and_base_passes(name):
    batch = smallest_trigger(name)
    example = Example(batch, Poison.NAN)
    check_example(PagedTorch(), example)  # the unmutated kernel agrees with the reference
    with pytest.raises(Finding):
        check_example(get_mutant(name), example)


@pytest.mark.parametrize("poison", [Poison.STALE, Poison.ZEROS])
def test_base_passes_grid_like_batches(poison):
    from kvfuzz.fuzz.bench.paged_torch import small_batch as _batch

    b = _batch([1, 5, 9], [30, 0, 17], heads=(6, 2), head_size=32, block_size=8,
               table=[[6, 2, 9, 0], [1, 0, 0, 0], [3, 8, 5, 7]], num_blocks=10)
    check_example(PagedTorch(), Example(b, poison))


def test_bench_detect_json(tmp_path):
    from kvfuzz.fuzz.cli.bench import bench

    out = tmp_path / "d.json"
    res = CliRunner().invoke(bench, ["detect", "--mutant", "mutant.gqa_modulo", "--mutant", "mutant.gqa_pow2_group",
                                     "--seeds", "1", "--max-examples", "60", "--duration", "10s",
                                     "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert {"settings", "mutants", "grid_missed", "kvfuzz_missed", "wall_seconds"} <= set(doc)
    by = {m["mutant"]: m for m in doc["mutants"]}
    assert set(by) == {"mutant.gqa_modulo", "mutant.gqa_pow2_group"}
    for m in by.values():
        assert {"bug", "trigger", "smallest_trigger", "kvfuzz", "grid", "runs"} <= set(m)
        assert m["kvfuzz"]["found"] == 1 and m["kvfuzz"]["runs"] == 1
        run = next(r for r in m["runs"] if r["tool"] == "kvfuzz")
        assert {"found", "seconds_to_first", "examples_to_first", "size", "case", "seconds_total"} <= set(run)
        assert {"seqs", "tokens", "heads", "head_size", "blocks", "columns"} <= set(run["size"])
        assert run["rerun_kinds"] == [run["kind"]] * 3 and m["kvfuzz"]["kind_stable"] == 1
        assert m["kvfuzz"]["shrunk_to_smallest_trigger"] == 1
    # vLLM's grids use GQA ratios 1, 4 and 8 (MQA) only: a power-of-two assumption goes unnoticed
    assert by["mutant.gqa_pow2_group"]["grid"]["found"] == 0
    assert by["mutant.gqa_modulo"]["grid"]["found"] == 1
    assert doc["grid_missed"] == ["mutant.gqa_pow2_group"]


def test_bench_throughput_splits_time_by_stage(tmp_path):
    out = tmp_path / "t.json"
    r = kvfuzz("bench", "throughput", "--target", "vllm.cpu_attention", "--examples", "5", "--no-scaling", "--json",
               str(out))
    if "not available" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    (p,) = json.loads(out.read_text())["profiles"]
    assert p["examples"] == 5 and set(p["stages_s"]) == {"generate", "materialize", "check_caller", "kernel",
                                                          "reference", "check_output", "compile", "queued"}
    assert 0 < p["harness_overhead"] < 1 and p["materialize_gb_per_s"] > 0
