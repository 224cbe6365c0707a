"""Merges with a planted defect, as plain functions with vLLM's ``merge_attn_states`` signature (torch only, no
kvfuzz: a reproducer's standalone.py imports this module by name, ``kernel = ("planted_merges", NAME)``). Each
computes in fp32 and writes where vLLM's merge writes (``output``, ``output_lse``; tokens from
``prefill_tokens_with_context`` on copied from the suffix).

- :func:`exp_direct`: multiplies each part by ``exp(lse)`` and divides by their sum, the form vLLM's kernel warns
  against ("Do not multiply the output with tl.exp(p_lse) or tl.exp(s_lse) directly"): 0 / 0 = NaN once both
  log-sum-exps are far below zero ("shifted" values);
- :func:`plus_inf_kept`: reads FlashAttention 2's ``+inf`` (an empty part) as a real log-sum-exp: NaN from
  ``inf - inf``;
- :func:`bf16_weights`: the weights rounded to bf16 before they scale the parts, a precision defect (~3 digits).
"""

import torch


def _write(output, output_lse, suffix_output, suffix_lse, prefill_tokens_with_context, out, lse):
    n = output.shape[0] if prefill_tokens_with_context is None else prefill_tokens_with_context
    out[n:], lse[:, n:] = suffix_output[n:].float(), suffix_lse[:, n:].float()
    output.copy_(out.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(lse)


def _empty(x):
    return torch.where(torch.isinf(x), torch.full_like(x, float("-inf")), x)


def exp_direct(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
               prefill_tokens_with_context=None, output_scale=None):
    ep, es = torch.exp(_empty(prefix_lse.float())), torch.exp(_empty(suffix_lse.float()))
    out = (prefix_output.float() * ep.T[..., None] + suffix_output.float() * es.T[..., None]) / (ep + es).T[..., None]
    _write(output, output_lse, suffix_output, suffix_lse, prefill_tokens_with_context, out, torch.log(ep + es))


def plus_inf_kept(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                  prefill_tokens_with_context=None, output_scale=None):
    p, s = prefix_lse.float(), suffix_lse.float()
    m = torch.maximum(p, s)
    ep, es = torch.exp(p - m), torch.exp(s - m)
    out = prefix_output.float() * (ep / (ep + es)).T[..., None] + suffix_output.float() * (es / (ep + es)).T[..., None]
    _write(output, output_lse, suffix_output, suffix_lse, prefill_tokens_with_context, out, m + torch.log(ep + es))


def bf16_weights(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                 prefill_tokens_with_context=None, output_scale=None):
    p, s = _empty(prefix_lse.float()), _empty(suffix_lse.float())
    m = torch.maximum(p, s)
    ep, es = torch.exp(p - m), torch.exp(s - m)
    wp, ws = (ep / (ep + es)).bfloat16().float(), (es / (ep + es)).bfloat16().float()
    out = prefix_output.float() * wp.T[..., None] + suffix_output.float() * ws.T[..., None]
    _write(output, output_lse, suffix_output, suffix_lse, prefill_tokens_with_context, out, m + torch.log(ep + es))
