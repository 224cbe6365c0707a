"""Caller faults: deliberate breaks of a cache contract in kvfuzz's own harness, modeled on real caller bugs.

A fault changes what the harness writes before the kernel runs. kvfuzz must then report a caller contract
violation, never a kernel bug, and still show what the kernel computed from the broken cache.
"""

from __future__ import annotations

import attrs

from kvfuzz.contracts.batch import Batch


@attrs.frozen
class CallerFault:
    name: str
    description: str

    def cached_lens(self, batch: Batch, required: tuple[int, ...]) -> tuple[int, ...]:
        """The per-sequence cached lengths the faulty caller writes instead of ``required``."""
        if self.name == "decode-ctx-only":
            return tuple(batch.ctx_lens[i] if batch.is_decode(i) else n for i, n in enumerate(required))
        raise AssertionError(f"unhandled fault {self.name}")

    def applies(self, batch: Batch) -> bool:
        """Whether this fault changes anything for ``batch`` (the caller broke the contract)."""
        return bool(batch.decode_seqs)


FAULTS: dict[str, CallerFault] = {
    f.name: f
    for f in [
        CallerFault(
            "decode-ctx-only",
            "fill decode sequences only up to ctx_len, leaving the current token out of the cache, as "
            "vLLM's tests/kernels/attention/test_prefix_prefill.py did (../shared/seeds/)",
        ),
    ]
}


def get_fault(name: str) -> CallerFault:
    """Raises KeyError naming the known faults."""
    try:
        return FAULTS[name]
    except KeyError:
        raise KeyError(f"unknown caller fault {name!r}; known: {', '.join(FAULTS)}") from None
