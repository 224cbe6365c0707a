"""kvfuzz reproducer: silently accepted but unsupported (oracle: agreement with the fp64 reference) on
vllm.unified_attention.

vllm.unified_attention accepted an undeclared configuration (alibi with sinks together) without an error and computed it
wrongly: kernel disagrees with the fp64 reference in 2 (token, head) rows; worst at sequence 0 position 1 (output row
1), head 0, dim 1: |out - ref| = 0.0151 > bound 7.29e-07. Either the kernel should reject it or its declaration is too
narrow and it has a bug there.

Re-run: pytest vllm.unified_attention-silent-unsupported-agreement-with-the-fp64-reference-1e973d95a9/test_case.py
    (or: kvfuzz replay vllm.unified_attention-silent-unsupported-agreement-with-the-fp64-reference-1e973d95a9)
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
