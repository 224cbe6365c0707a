"""Kernel targets: adapters from a kvfuzz batch to a real kernel call (:mod:`.base`), and the registry that
resolves a target's name (:mod:`.registry`)."""

from .base import Availability, KernelCall, Target
from .registry import BUILTIN, ENTRY_POINT_GROUP, get_target, is_registered, load_spec, registered, spec_of

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "Availability", "KernelCall", "Target", "get_target", "is_registered",
           "load_spec", "registered", "spec_of"]
