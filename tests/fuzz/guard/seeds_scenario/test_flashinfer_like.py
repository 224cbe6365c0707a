"""The seeds' bug in FlashInfer's form, written the way FlashInfer's tests/attention/test_batch_decode_kernels.py
builds its caches and metadata (flashinfer-python 0.7.2.post1; CUDA only).

``test_decode_as_in_the_seeds`` fills a ``[pages, 2, page_size, Hkv, D]`` NHD cache with each sequence's past
tokens and plans the decode over ``kv_len`` tokens (``kv_last_page_len = (kv_len - 1) % page_size + 1``),
treating ``q`` as the new token being generated; its reference attends to the past tokens plus the new
token's ``k_new``/``v_new``, which the test never appends to the pages, so the kernel reads whatever the
current token's slot (``last_page_len - 1`` of the last page) holds. Under ``--kvfuzz-guard`` the test hands
the new tokens to the guard (``kvfuzz_guard.new_kv``) and fails with the unified invariant at each sequence's
last position (plain pytest passes it: with values normal(0.1, 0.2) and kv_len 127 the missing token moves
the output less than atol 1e-2). ``test_decode_with_the_seeds_fix`` appends them first with
``flashinfer.append_paged_kv_cache`` (batch_indices/positions from ``get_batch_indices_positions``) and passes clean.

The guard's FlashInfer hooks (kvfuzz.fuzz.guard.flashinfer) are installed by this module's autouse fixture
while the kvfuzz plugin is on (the plugin installs them too when flashinfer is installed; nested installs are
counted). Skipped without CUDA or flashinfer.
Collected only with KVFUZZ_SEEDS_SCENARIO=1 (see conftest.py).
"""


import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("FlashInfer's kernels run on CUDA only", allow_module_level=True)
flashinfer = pytest.importorskip("flashinfer")

device = "cuda"
dtype = torch.float16


@pytest.fixture(autouse=True)
def flashinfer_hooks(request):
    try:
        g = request.getfixturevalue("kvfuzz_guard")
    except pytest.FixtureLookupError:
        g = None
    if g is None:
        yield
        return
    from kvfuzz.fuzz.guard.flashinfer import flashinfer_guard

    with flashinfer_guard(flashinfer):
        yield


def _decode_once(hand_over, fixed):
    torch.manual_seed(0)
    batch_size, kv_len, page_size = 4, 127, 16  # kv_len: past tokens plus the one being generated
    num_qo_heads, num_kv_heads, head_dim = 32, 4, 128
    num_pages_per_seq = (kv_len + page_size - 1) // page_size
    total_num_pages = num_pages_per_seq * batch_size

    def randn(*shape):  # as SGLang's kernel tests fill their tensors
        return torch.empty(shape, dtype=dtype, device=device).normal_(mean=0.1, std=0.2)

    q = randn(batch_size, num_qo_heads, head_dim)
    kv_data = randn(total_num_pages, 2, page_size, num_kv_heads, head_dim)
    k_new, v_new = randn(batch_size, num_kv_heads, head_dim), randn(batch_size, num_kv_heads, head_dim)
    kv_indptr = torch.arange(0, batch_size + 1, device=device, dtype=torch.int32) * num_pages_per_seq
    kv_indices = torch.arange(0, total_num_pages, device=device, dtype=torch.int32)
    kv_last_page_len = torch.full((batch_size,), (kv_len - 1) % page_size + 1, dtype=torch.int32, device=device)

    if fixed:  # the seeds' fix: append the current token to the pages first, as the serving backends do
        append_indptr = torch.arange(0, batch_size + 1, device=device, dtype=torch.int32)
        batch_indices, positions = flashinfer.get_batch_indices_positions(
            append_indptr, flashinfer.get_seq_lens(kv_indptr, kv_last_page_len, page_size), batch_size)
        flashinfer.append_paged_kv_cache(k_new, v_new, batch_indices, positions, kv_data, kv_indices, kv_indptr,
                                         kv_last_page_len, "NHD")

    workspace_buffer = torch.empty(32 * 1024 * 1024, dtype=torch.int8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace_buffer, "NHD")
    wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 q_data_type=dtype, kv_data_type=dtype)
    with hand_over(k_new, v_new):
        o = wrapper.run(q, kv_data)

    # reference: the past kv_len - 1 tokens from the pages, then the new token
    for i in range(batch_size):
        pages = kv_data[kv_indptr[i] : kv_indptr[i + 1]]
        k = torch.cat([pages[:, 0].reshape(-1, num_kv_heads, head_dim)[: kv_len - 1], k_new[i : i + 1]]).float()
        v = torch.cat([pages[:, 1].reshape(-1, num_kv_heads, head_dim)[: kv_len - 1], v_new[i : i + 1]]).float()
        k = k.repeat_interleave(num_qo_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_qo_heads // num_kv_heads, dim=1)
        p = (torch.einsum("hd,khd->hk", q[i].float(), k) / head_dim**0.5).softmax(-1)
        ref = torch.einsum("hk,khd->hd", p, v)
        # the missing token moves the output by ~|v_new - v_stale| / kv_len: under this tolerance, plain pytest passes
        torch.testing.assert_close(o[i].float(), ref, rtol=1e-2, atol=1e-2)


@torch.inference_mode()
def test_decode_as_in_the_seeds(hand_over):
    _decode_once(hand_over, fixed=False)


@torch.inference_mode()
def test_decode_with_the_seeds_fix(hand_over):
    _decode_once(hand_over, fixed=True)
