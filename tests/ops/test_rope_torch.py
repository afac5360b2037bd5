"""The torch backend's rotary embedding (rotate_half as a roll times a +-1 sign vector, ops/rotary.py) gives HF's
apply_rotary_pos_emb bits exactly, forward and backward, not merely within the parity tolerance, and keeps no
more for the backward than HF does; the sign vector is made once, never as an inference tensor."""

import gc
import itertools

import pytest
import torch
from torch.utils.checkpoint import checkpoint
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
    _assert_bitwise(hf, apply_rotary_pos_emb, q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def _assert_bitwise(hf, ours, q, k, cos, sin, **kwargs) -> None:
    """`ours(q, k, cos, sin)` gives `hf`'s outputs and gradients (for one upstream gradient) bit for bit."""
    outs = []
    for rope in (hf, ours):
        q_out, k_out = rope(q, k, cos, sin, **kwargs)
        upstream = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(t.dtype)
                    for i, t in enumerate((q_out, k_out))]
        outs.append((q_out, k_out, *torch.autograd.grad((q_out, k_out), (q, k), upstream)))
    for theirs, ours_ in zip(*outs, strict=True):
        assert ours_.dtype == theirs.dtype
        assert torch.equal(ours_, theirs)


def _saved_bytes(fn, *args) -> int:
    """Bytes of the distinct tensors autograd saves for the backward of fn(*args)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(saved.values())


def test_keeps_no_more_for_backward_than_hf():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 64, 32, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 64, 32, generator=gen, requires_grad=True)
    cos, sin = _tables(2, 64, 32, torch.float32, gen)
    ours = _saved_bytes(apply_rotary_pos_emb, q, k, cos, sin)
    theirs = _saved_bytes(modeling_llama.apply_rotary_pos_emb, q, k, cos, sin)
    assert ours <= theirs + 32 * 4  # at most the [head_dim] sign vector on top


def test_sign_vector_made_once_and_usable_with_grad_after_inference(monkeypatch):
    monkeypatch.setattr(rotary, "_signs", {})
    gen = torch.Generator().manual_seed(2)
    cos, sin = _tables(1, 3, 6, torch.float32, gen)
    with torch.inference_mode():  # first made under inference mode (generation), then used in training
        apply_rotary_pos_emb(torch.randn(1, 2, 3, 6), torch.randn(1, 2, 3, 6), cos, sin)
    q = torch.randn(1, 2, 3, 6, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 3, 6, generator=gen, requires_grad=True)
    for _ in range(3):
        out = apply_rotary_pos_emb(q, k, cos, sin)
        torch.autograd.grad(out, (q, k), [torch.ones_like(t) for t in out])
    assert len(rotary._signs) == 1
    assert not next(iter(rotary._signs.values())).is_inference()


def test_layers_of_a_forward_share_one_signed_table():
    """The layers of a forward get the same sin: one negated table serves them all, so a whole forward keeps no
    more for the backward than HF (which keeps sin itself), and nothing is held once the tables are gone."""
    gen = torch.Generator().manual_seed(3)
    tables = _tables(2, 16, 8, torch.float32, gen)
    layers = [tuple(torch.randn(2, heads, 16, 8, generator=gen, requires_grad=True) for heads in (4, 2))
              for _ in range(3)]

    def forward(rope, cos, sin):
        return [rope(q, k, cos, sin) for q, k in layers]

    assert _saved_bytes(forward, apply_rotary_pos_emb, *tables) <= _saved_bytes(
        forward, modeling_llama.apply_rotary_pos_emb, *tables)
    with torch.no_grad():
        apply_rotary_pos_emb(*layers[0], *tables)
        assert rotary._signed._last is not None
        assert all(ref() is None for ref in rotary._signed._last[3])  # nothing keeps it: the cache does not either
    del tables
    assert rotary._signed._last is None  # dropped with the table it came from


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of the plain tensors alive now (other tests' fake tensors have none)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter)}
    return sum(storages.values())


def test_checkpointed_layers_keep_no_table_beyond_hf():
    """Under activation checkpointing a layer's forward saves nothing: a negated table kept for the next layers would
    be a table HF's code does not hold, all through the backward (TRL's trainers checkpoint by default: its tensor
    peak was one table above plain TRL's). After the checkpointed forward, as much is alive as after HF's."""
    gen = torch.Generator().manual_seed(4)
    tables = _tables(2, 16, 8, torch.float32, gen)
    inputs = [tuple(torch.randn(2, heads, 16, 8, generator=gen, requires_grad=True) for heads in (4, 2))
              for _ in range(3)]
    alive, grads = {}, {}
    for name, rope in (("hf", modeling_llama.apply_rotary_pos_emb), ("ours", apply_rotary_pos_emb)):
        gc.collect()
        before = _live_tensor_bytes()
        outs = [checkpoint(rope, q, k, *tables, use_reentrant=False) for q, k in inputs]
        gc.collect()
        alive[name] = _live_tensor_bytes() - before
        grads[name] = torch.autograd.grad([t.pow(2).sum() for out in outs for t in out],
                                          [t for pair in inputs for t in pair])
        del outs
    assert alive["ours"] <= alive["hf"]
    # the recompute made its own table: the gradients are still HF's bits
    assert all(torch.equal(a, b) for a, b in zip(grads["hf"], grads["ours"], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["half_width", "interleaved"])
def test_other_layouts_are_bitwise_hf(layout, dtype):
    """GPT-OSS's half-width rope and DeepSeek-V3's interleaved one, through the "half" kernel: HF's bits forward and
    backward, on HF's own tables (each made by the family's rotary embedding's rule: half width / angles repeated)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.gpt_oss import modeling_gpt_oss

    ours = {"half_width": rotary.apply_rotary_pos_emb_half_width,
            "interleaved": rotary.apply_rotary_pos_emb_interleaved}[layout]
    hf = {"half_width": modeling_gpt_oss.apply_rotary_pos_emb,
          "interleaved": modeling_deepseek_v3.apply_rotary_pos_emb_interleave}[layout]
    gen = torch.Generator().manual_seed(4)
    q = (torch.randn(2, 4, 9, 16, generator=gen) * 3).to(dtype).requires_grad_()
    k = (torch.randn(2, 1, 9, 16, generator=gen) * 3).to(dtype).requires_grad_()
    cos, sin = _tables(2, 9, 16, dtype, gen)
    if layout == "half_width":
        cos, sin = cos[..., :8].contiguous(), sin[..., :8].contiguous()
    _assert_bitwise(hf, ours, q, k, cos, sin)


def test_selective_checkpointing_sees_the_same_ops_in_forward_and_recompute():
    """torch's selective activation checkpointing matches each op of a region by its position between the forward
    and the recompute: inside it the tables are made per call (no cache), so a region whose forward found its table
    made (the second layer) recomputes the same ops after another model's forward (other tables) ran in between;
    gradients are HF's."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mul.Tensor else CheckpointPolicy.PREFER_RECOMPUTE

    gen = torch.Generator().manual_seed(5)
    tables = [_tables(2, 8, 8, torch.float32, gen) for _ in range(2)]  # two models' forwards
    layers = [tuple(torch.randn(2, heads, 8, 8, generator=gen, requires_grad=True) for heads in (4, 2))
              for _ in range(3)]
    grads = []
    for rope in (modeling_llama.apply_rotary_pos_emb, apply_rotary_pos_emb):
        outs = [checkpoint(lambda q, k, cos, sin, rope=rope: rope(q, k, cos, sin), q, k, *tables[i // 2],
                           use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy))
                for i, (q, k) in enumerate(layers)]
        total = sum((q_out * 1.5 + k_out.sum(1, keepdim=True)).sum() for q_out, k_out in outs)
        grads.append(torch.autograd.grad(total, [t for pair in layers for t in pair]))
    for theirs, ours in zip(*grads, strict=True):
        assert torch.equal(ours, theirs)
