"""Shape coverage (fuzz/harness/coverage.py SHAPE_DIMENSIONS) and its grids in `kvfuzz report`
(fuzz/campaign/store/report.py): each example's longest context by longest query and head size by window on log2
bins, and the report's tables and heat maps that show the bins a campaign never reached (those a target declares
marked), each size tier's share and how long each shrink took."""

import json

import pytest

from kvfuzz.fuzz.bench.paged_torch import small_batch
from kvfuzz.fuzz.campaign.store.report import plot_shapes, shape_grid, write_report
from kvfuzz.fuzz.harness.coverage import SHAPE_DIMENSIONS, labels, log2_bin
from kvfuzz.fuzz.targets import get_target


def test_log2_bins_and_labels():
    assert [log2_bin(n) for n in (0, 1, 2, 3, 4, 1023, 1024, 32768)] == [
        "0", "2^0", "2^1", "2^1", "2^2", "2^9", "2^10", "2^15"]
    batch = small_batch([1, 40], [0, 1100], heads=(2, 1), head_size=32, sliding_window=300)
    lab = labels(get_target("mutant.base"), batch)
    assert lab[SHAPE_DIMENSIONS[0]] == "2^10 x 2^5" and lab[SHAPE_DIMENSIONS[1]] == "32 x 2^8"
    plain = small_batch([3], [0], head_size=24)
    assert labels(get_target("mutant.base"), plain)[SHAPE_DIMENSIONS[1]] == "24 x none"


def test_the_report_shows_the_shapes_never_reached(tmp_path):
    rows, cols, cells = shape_grid({"2^1 x 2^0": 3, "2^4 x 2^2": 1, "0 x 2^0": 2})
    assert rows == ["0", "2^1", "2^2", "2^3", "2^4"] and cols == ["2^0", "2^1", "2^2"]  # the gaps filled in
    assert cells[("2^4", "2^2")] == 1
    coverage = {SHAPE_DIMENSIONS[0]: {"2^1 x 2^0": 3, "2^4 x 2^2": 1},
                SHAPE_DIMENSIONS[1]: {"64 x none": 2, "256 x 2^8": 2}}
    summary = {"seed": 0, "workers": 1, "targets": [{"target": "t.x", "examples": 4, "examples_per_s": 1.0,
                                                     "kernel_s": 1.0, "harness_s": 1.0, "failures": [],
                                                     "coverage": coverage}]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    report = write_report(tmp_path).read_text()
    assert "| ctx_len \\ query_len | 2^0 | 2^1 | 2^2 |" in report
    assert "| 2^3 | **0** | **0** | **0** |" in report  # contexts of 8..15 tokens: never drawn
    assert "| 2^4 | **0** | **0** | 1 |" in report
    assert "| head_size \\ window | 2^8 | none |" in report and "| 64 | **0** | 2 |" in report
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    png = tmp_path / "shapes-t.x.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and "![shapes of t.x](shapes-t.x.png)" in report


def test_the_report_marks_declared_bins_never_reached_and_tier_shares(tmp_path):
    bins = {SHAPE_DIMENSIONS[0]: {"0 x 2^0": 2, "2^1 x 2^0": 3, "2^2 x 2^0": 0, "2^2 x 2^1": 0},
            SHAPE_DIMENSIONS[1]: {"64 x none": 5, "64 x 2^4": 0}, "states": {"freed-window": 0}}
    rows, cols, cells = shape_grid({"0 x 2^0": 2, "2^1 x 2^0": 3}, bins[SHAPE_DIMENSIONS[0]])
    assert rows == ["0", "2^1", "2^2"] and cols == ["2^0", "2^1"]  # the declared bins widen the grid
    coverage = {SHAPE_DIMENSIONS[0]: {"0 x 2^0": 2, "2^1 x 2^0": 3}, SHAPE_DIMENSIONS[1]: {"64 x none": 5}}
    stages = {"small": {"examples": 4, "seconds": {"kernel": 1.0, "other": 1.0}},  # the stage table's per-tier rows
              "serving": {"examples": 1, "seconds": {"kernel": 1.0, "reference": 4.0, "shrink": 1.0}}}
    failure = {"kind": "kernel mismatch", "blame": "kernel", "check": "agreement", "count": 1, "message": "m",
               "batch": "1 seqs", "reproducer": None,
               "shrink": {"structural_first": 1.25, "hypothesis": 30.0, "structural": 2.0}}
    summary = {"seed": 0, "workers": 1, "targets": [{"target": "t.x", "examples": 5, "examples_per_s": 1.0,
                                                     "kernel_s": 2.0, "harness_s": 6.0, "failures": [failure],
                                                     "coverage": coverage, "bins": bins, "stages": stages,
                                                     "declared": {"dtype": {"float16": 5}},
                                                     "chunks": {"free": {"chunks": 1, "examples": 4, "seconds": 6.0},
                                                                "focused": {"chunks": 2, "examples": 1,
                                                                            "seconds": 2.0}}}]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    report = write_report(tmp_path).read_text()
    assert "| 2^1 | 3 | · |" in report  # (2^1, 2^1) is not declared: no tier of the target draws it
    assert "| 2^2 | **0** | **0** |" in report  # declared, never reached
    assert "Declared bins never reached: 2 of 4 (2^2 x 2^0, 2^2 x 2^1)." in report
    assert "| 64 | **0** | 5 |" in report and "Declared bins never reached: 1 of 2 (64 x 2^4)." in report
    assert "| small | 4 | 80.0% | 2.0 | 25.0% |" in report and "| serving | 1 | 20.0% | 6.0 | 75.0% |" in report
    assert "| 1.2 + 30.0 + 2.0 s |" in report  # how long each shrink took
    assert "| free | 1 | 4 | 6.0 | 75.0% |" in report and "| focused | 2 | 1 | 2.0 | 25.0% |" in report
    assert "| production states | **freed-window: 0** |" in report  # a declared state never drawn
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "shapes-t.x.png").read_bytes()[:4] == b"\x89PNG"


def test_the_heat_map_tells_zero_from_one(tmp_path):
    """Colours on a log scale, each cell's count written in it, a declared bin never reached in red with its 0:
    0 and 1 do not look alike (issue 48 item 9)."""
    pytest.importorskip("matplotlib")
    import numpy as np
    from PIL import Image

    def plot(coverage, bins, name):
        path = plot_shapes({"target": name, "coverage": {SHAPE_DIMENSIONS[0]: coverage},
                            "bins": {SHAPE_DIMENSIONS[0]: bins}}, tmp_path / f"{name}.png")
        return np.asarray(Image.open(path).convert("RGB")).astype(int)

    declared = {"0 x 2^0": 1, "2^1 x 2^0": 0}
    one = plot({"0 x 2^0": 1, "2^1 x 2^0": 1}, declared, "one")
    zero = plot({"0 x 2^0": 1}, declared, "zero")
    red = lambda img: ((img[..., 0] > 200) & (img[..., 1] < 200) & (img[..., 2] < 200)).sum()  # noqa: E731
    assert red(zero) > red(one) + 1000  # the empty declared cell is red
    assert np.abs(one - zero).sum() > 0
