"""kvfuzz reproducer: kernel mismatch (agreement) on sglang.decode_attention_fwd.

kernel disagrees with the fp64 reference in 1 (token, head) rows; worst at sequence 0 position 0 (output row 0), head 1, dim 12: |out - ref| = 0.000876 > bound 0.000775

Re-run: pytest sglang.decode_attention_fwd-kernel-mismatch-agreement-d105153d03/test_case.py   (or: kvfuzz replay sglang.decode_attention_fwd-kernel-mismatch-agreement-d105153d03)
The test fails while the failure reproduces.
"""

import json

from kvfuzz.fuzz.campaign.reproducers import rerun

CASE = json.loads(r"""{"target": "sglang.decode_attention_fwd", "example": {"batch": {"query_lens": [1, 1], "ctx_lens": [0, 0], "num_heads": 2, "num_kv_heads": 2, "head_size": 32, "block_size": 1, "num_blocks": 2, "block_table": [[0], [1]], "dtype": "float16", "kv_cache_dtype": "fp8_e4m3", "seed": 0, "sm_scale": null, "k_scale": 1.0, "v_scale": 1.0, "sliding_window": null, "alibi": false, "sinks": true, "softcap": null, "value_range": "large", "csr_tail": []}, "poison": "nan"}, "caller_fault": null}""")


def test_case():
    rerun(CASE["target"], CASE["example"], CASE["caller_fault"])
