"""kvfuzz.contracts: the logical model of one paged-attention call (Batch), its ground-truth tensors, the
fp64 reference, cache layouts and the materializer, the invariants a caller must meet and the oracles a
kernel must pass. Depends on torch and attrs only."""

from .batch import DTYPES, KV_CACHE_DTYPES, Batch, positions
from .capabilities import Capabilities
from .contract import Contract
from .data import BatchData, make_batch_data
from .failures import FailureKind
from .invariants import (DECODE, PREFILL, UNIFIED, Violation, check_contract, check_decode_invariant,
                         check_prefill_invariant, check_unified_invariant)
from .layouts import CacheLayout, LayoutError, NHDLayout, VllmPagedLayout
from .materialize import CacheState, Poison, materialize
from .oracles import OracleFailure, check_agreement, check_finite
from .reference import reference_attention, same_precision_attention

__all__ = [
    "DTYPES", "KV_CACHE_DTYPES", "Batch", "positions", "Capabilities", "Contract", "BatchData",
    "make_batch_data", "FailureKind", "DECODE", "PREFILL", "UNIFIED", "Violation", "check_contract",
    "check_decode_invariant", "check_prefill_invariant", "check_unified_invariant", "CacheLayout",
    "LayoutError", "NHDLayout", "VllmPagedLayout", "CacheState", "Poison", "materialize", "OracleFailure",
    "check_agreement", "check_finite", "reference_attention", "same_precision_attention",
]
