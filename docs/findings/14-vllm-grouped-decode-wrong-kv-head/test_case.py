"""kvfuzz reproducer: kernel mismatch (oracle: agreement with the fp64 reference) on vllm.decode_attention_fwd.

kernel disagrees with the fp64 reference in 8 (token, head) rows; worst at sequence 0 position 3 (output row 0), head
26, dim 17: |out - ref| = 0.572 > bound 3.1e-07

Re-run: pytest vllm.decode_attention_fwd-kernel-mismatch-agreement-with-the-fp64-reference-9f746221bb/test_case.py
    (or: kvfuzz replay vllm.decode_attention_fwd-kernel-mismatch-agreement-with-the-fp64-reference-9f746221bb)
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
