"""kvfuzz reproducer: non-finite output (oracle: finite output) on vllm.flash_attn_varlen_fa2.

non-finite output: 32 elements in 1 (token, head) rows; first at sequence 0 position 16 (output row 0), head 0, dim 0:
nan

Re-run: pytest vllm.flash_attn_varlen_fa2-non-finite-finite-output-14c2197ba1/test_case.py
    (or: kvfuzz replay vllm.flash_attn_varlen_fa2-non-finite-finite-output-14c2197ba1)
The test fails while the failure reproduces and passes once it is fixed. It replays this directory in a child
process (a crash or a hang fails the test instead of killing pytest).
"""

from pathlib import Path

import pytest

from kvfuzz.fuzz.campaign import TargetUnavailable, replay


def test_case():
    # running this file is your consent to import the target it names (trust_target)
    try:
        r = replay(Path(__file__).parent, trust_target=True)
    except TargetUnavailable as e:  # e.g. a CUDA-only kernel on a CPU machine: nothing to replay here
        pytest.skip(str(e))
    assert r.got is None, f"{r.got[0]} ({r.got[1]}): {r.message}"
