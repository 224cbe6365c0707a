"""Shape coverage (fuzz/harness/coverage.py SHAPE_DIMENSIONS) and its grids in `kvfuzz report`
(fuzz/campaign/store/report.py): each example's longest context by longest query and head size by window on log2
bins, and the report's tables that show the bins a campaign never reached."""

import json

from kvfuzz.fuzz.bench.paged_torch import small_batch
from kvfuzz.fuzz.campaign.store.report import shape_grid, write_report
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
