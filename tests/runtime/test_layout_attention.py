"""Single-process runtime tests: token layout and attention backends against the reference."""

import pytest

torch = pytest.importorskip("torch")

from megatron_flexsp.runtime.attention import BACKENDS, varlen_causal_attention  # noqa: E402
from megatron_flexsp.runtime.layout import build_group_layout, padded_length, shard_positions  # noqa: E402


@pytest.mark.parametrize("length, d", [(1, 1), (7, 2), (16, 4), (33, 4), (100, 8)])
def test_shards_cover_the_padded_sequence_once_and_balance_causal_work(length, d):
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


@pytest.mark.parametrize("backend", ["sdpa", "sdpa-mask"])
@pytest.mark.parametrize("n_kv", [4, 2])
def test_cpu_backends_match_reference(backend, n_kv):
    cu = torch.tensor([0, 5, 17, 18, 40])
    q, k, v = _qkv(40, 4, n_kv, 8)
    ref = varlen_causal_attention(q, k, v, cu, backend="reference")
    out = varlen_causal_attention(q, k, v, cu, backend=backend)
    # fp32 kernels vs a float64-accumulated reference: rounding only
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path without a GPU stack")
def test_gpu_backends_fail_clearly_without_packages():
    cu = torch.tensor([0, 4])
    q, k, v = _qkv(4, 4, 4, 4)
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="flash-attn"):
            varlen_causal_attention(q, k, v, cu, backend="flash")
