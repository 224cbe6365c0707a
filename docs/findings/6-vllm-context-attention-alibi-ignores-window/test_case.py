"""kvfuzz reproducer: silently accepted but unsupported (oracle: agreement with the fp64 reference) on
vllm.context_attention_fwd.

vllm.context_attention_fwd accepted an undeclared configuration (alibi with sliding_window together) without an error
and computed it wrongly: kernel disagrees with the fp64 reference in 20 (token, head) rows; worst at sequence 1 position
7 (output row 2), head 1, dim 7: |out - ref| = 0.961 > bound 3.67e-07. Either the kernel should reject it or its
declaration is too narrow and it has a bug there.

Re-run: pytest vllm.context_attention_fwd-silent-unsupported-agreement-with-the-fp64-reference-b16fc38fb4/test_case.py
    (or: kvfuzz replay vllm.context_attention_fwd-silent-unsupported-agreement-with-the-fp64-reference-b16fc38fb4)
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
