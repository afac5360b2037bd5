"""The torch backend's rotary embedding (x * cos + x.roll(half) * signed_sin, ops/rotary.py) gives HF's
apply_rotary_pos_emb bits exactly, forward and backward, not merely within the parity tolerance; the signed sin
table is made once per table and never reused for another table or a table changed in place."""

import itertools

import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3

from mindspeed_hf.ops import apply_rotary_pos_emb, rotary
from mindspeed_hf.ops.registry import set_backend


@pytest.fixture(autouse=True)
def _torch_backend():
    set_backend("torch")
    yield
    set_backend(None)


def _tables(batch, seq, rot, dtype, gen):
    angles = torch.randn(batch, seq, rot // 2, generator=gen) * 5
    emb = torch.cat([angles, angles], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype,table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rotary_frac,unsqueeze_dim", list(itertools.product([1.0, 0.5], [1, 2])))
def test_rope_is_bitwise_hf(dtype, table_dtype, rotary_frac, unsqueeze_dim):
    batch, heads, kv_heads, seq, dim = 3, 6, 2, 11, 20
    gen = torch.Generator().manual_seed(0)
    q_shape = (batch, heads, seq, dim) if unsqueeze_dim == 1 else (batch, seq, heads, dim)
    k_shape = (batch, kv_heads, seq, dim) if unsqueeze_dim == 1 else (batch, seq, kv_heads, dim)
    q = (torch.randn(q_shape, generator=gen) * 3).to(dtype).requires_grad_()
    k = (torch.randn(k_shape, generator=gen) * 3).to(dtype).requires_grad_()
    cos, sin = _tables(batch, seq, int(dim * rotary_frac), table_dtype, gen)
    hf = modeling_llama.apply_rotary_pos_emb if rotary_frac == 1.0 else modeling_phi3.apply_rotary_pos_emb
    outs = []
    for rope in (hf, apply_rotary_pos_emb):
        q_out, k_out = rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        upstream = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(t.dtype)
                    for i, t in enumerate((q_out, k_out))]
        outs.append((q_out, k_out, *torch.autograd.grad((q_out, k_out), (q, k), upstream)))
    for theirs, ours in zip(*outs, strict=True):
        assert ours.dtype == theirs.dtype
        assert torch.equal(ours, theirs)


def test_signed_table_made_once_per_table(monkeypatch):
    made = []
    real = rotary._negated_first_half
    monkeypatch.setattr(rotary, "_negated_first_half", lambda sin: made.append(1) or real(sin))
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    cos, sin = _tables(2, 5, 8, torch.float32, gen)
    first = [apply_rotary_pos_emb(q, k, cos, sin) for _ in range(3)]  # three layers, one table
    assert len(made) == 1
    with torch.no_grad():
        sin.mul_(-1)  # changed in place: a new signed table, HF's result for the new values
    changed = apply_rotary_pos_emb(q, k, cos, sin)
    assert len(made) == 2
    assert all(torch.equal(a, b) for a, b in zip(changed, modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)))
    other_cos, other_sin = _tables(2, 5, 8, torch.float32, gen)  # another table: its own signed table
    other = apply_rotary_pos_emb(q, k, other_cos, other_sin)
    assert len(made) == 3
    assert all(torch.equal(a, b) for a, b in zip(other, modeling_llama.apply_rotary_pos_emb(q, k, other_cos,
                                                                                            other_sin)))
    assert all(torch.equal(a, b) for a, b in zip(first[0], first[2]))


def test_signed_table_goes_with_its_table():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 3, 4, generator=gen), torch.randn(1, 2, 3, 4, generator=gen)
    cos, sin = _tables(1, 3, 4, torch.float32, gen)
    apply_rotary_pos_emb(q, k, cos, sin)
    key = id(sin)
    assert key in rotary._signed_sins
    del sin
    assert key not in rotary._signed_sins
