"""Single-process runtime tests: token layout and attention backends against an independent
reference (:mod:`tests.reference`: plain softmax per document in float64, GQA grouping spelled out)."""

import pytest

torch = pytest.importorskip("torch")

from megatron_flexsp.runtime.attention import BACKENDS, varlen_causal_attention  # noqa: E402
from megatron_flexsp.runtime.layout import build_group_layout, padded_length, shard_positions  # noqa: E402
from tests.reference import packed_attention, shard_rows  # noqa: E402


@pytest.mark.parametrize("length, d", [(1, 1), (7, 2), (16, 4), (33, 4), (100, 8)])
def test_shards_cover_the_padded_sequence_once_and_balance_causal_work(length, d):
    for r in range(d):  # the layout's definition: chunks r and 2d-1-r of the padded sequence
        assert shard_positions(length, d, r).tolist() == shard_rows(length, d, r)
    p = padded_length(length, d)
    assert p % (2 * d) == 0 and length <= p < length + 2 * d
    allpos = torch.cat([shard_positions(length, d, r) for r in range(d)])
    assert sorted(allpos.tolist()) == list(range(p))
    work = [int((shard_positions(length, d, r) + 1).sum()) for r in range(d)]  # causal keys per query
    assert len(set(work)) == 1


def test_group_layout_permutations_are_inverse():
    lay = build_group_layout([5, 12, 3], 2)
    x = torch.arange(int(lay.cu_seqlens[-1]))
    assert torch.equal(lay.to_natural(lay.to_gathered(x)), x)
    assert lay.token_counts == [sum(padded_length(L, 2) for L in (5, 12, 3)) // 2] * 2
    assert int(lay.valid.sum()) == 20
    with pytest.raises(ValueError, match="at least one sequence"):
        build_group_layout([], 2)
    with pytest.raises(ValueError, match="rank 2 outside a group of 2"):
        shard_positions(5, 2, 2)


def _qkv(T, n, n_kv, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, n, H, generator=g), torch.randn(T, n_kv, H, generator=g),
            torch.randn(T, n_kv, H, generator=g))


@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa-mask"])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_cpu_backends_match_an_independent_reference(backend, n_kv):
    lengths = [5, 12, 1, 22]
    q, k, v = _qkv(40, 4, n_kv, 8)
    ref = packed_attention(q, k, v, lengths)
    out = varlen_causal_attention(q, k, v, [0, 5, 17, 18, 40], backend=backend)
    # fp32 kernels vs a float64 reference: rounding only
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_documents_do_not_attend_to_each_other():
    cu = torch.tensor([0, 6, 10])
    q, k, v = _qkv(10, 2, 2, 4)
    out = varlen_causal_attention(q, k, v, cu, backend="reference")
    k2, v2 = k.clone(), v.clone()
    k2[6:] += 5.0
    v2[6:] -= 3.0
    out2 = varlen_causal_attention(q, k2, v2, cu, backend="reference")
    torch.testing.assert_close(out[:6], out2[:6], rtol=0, atol=0)
    # and a token never sees later tokens of its own document
    v3 = v.clone()
    v3[3:6] += 1.0
    out3 = varlen_causal_attention(q, k, v3, cu, backend="reference")
    torch.testing.assert_close(out[:3], out3[:3], rtol=0, atol=0)


def test_padding_does_not_change_real_tokens():
    lay = build_group_layout([5], 4)  # padded to 8
    q, k, v = _qkv(8, 4, 4, 4)
    cu = lay.cu_seqlens
    out = varlen_causal_attention(q, k, v, cu, backend="sdpa")
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[5:] = 1e3
    out2 = varlen_causal_attention(q2, k2, v2, cu, backend="sdpa")
    torch.testing.assert_close(out[:5], out2[:5], rtol=0, atol=0)


def test_bad_backend_inputs():
    cu = torch.tensor([0, 4])
    q, k, v = _qkv(4, 4, 4, 4)
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        varlen_causal_attention(q, k, v, cu, backend="cuda")
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to T=4"):
        varlen_causal_attention(q, k, v, torch.tensor([0, 3]))
    q3, k3, v3 = _qkv(4, 4, 3, 4)
    with pytest.raises(ValueError, match="not a multiple of 3"):
        varlen_causal_attention(q3, k3, v3, cu, backend="sdpa")
    assert set(BACKENDS) == {"reference", "sdpa", "sdpa-mask", "flash", "te"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error paths without a GPU")
@pytest.mark.parametrize("backend, package", [("flash", "flash-attn"), ("te", "transformer-engine")])
def test_gpu_backends_fail_clearly_on_the_host(backend, package):
    """Without the package: an error naming it; with it but without a GPU: an error all the same."""
    cu = [0, 4]
    q, k, v = _qkv(4, 4, 4, 4)
    with pytest.raises(Exception) as err:
        varlen_causal_attention(q, k, v, cu, backend=backend)
    importable = {"flash": "flash_attn", "te": "transformer_engine"}[backend]
    import importlib.util

    if importlib.util.find_spec(importable) is None:
        assert err.type is RuntimeError and package in str(err.value)
