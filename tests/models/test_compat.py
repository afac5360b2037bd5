"""mindspeed_hf.releases.compat on the installed transformers: each shim gives what that release's own code expects (the
model and op tests run the shims end to end; these pin the edges of each one)."""

import pytest
import torch
from tiny_models import tiny_model
from transformers import TrainingArguments, masking_utils
from transformers.models.llama import modeling_llama

from mindspeed_hf.patches import forwards
from mindspeed_hf.releases import compat


def test_rope_forward_takes_every_signature_of_the_release():
    """(q, k, cos, sin, unsqueeze_dim=1) and the legacy (q, k, cos, sin, position_ids=None, unsqueeze_dim=1)."""
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    emb = torch.randn(2, 5, 4).repeat(1, 1, 2)
    cos, sin = emb.cos(), emb.sin()
    bsnd = q.transpose(1, 2), k.transpose(1, 2)
    position_ids = torch.arange(5).unsqueeze(0)
    for args, kwargs, (qq, kk), dim in [
        ((), {}, (q, k), 1),
        ((None,), {}, (q, k), 1),  # legacy position_ids slot, positional
        ((position_ids,), {}, (q, k), 1),
        ((position_ids, 2), {}, bsnd, 2),
        ((2,), {}, bsnd, 2),
        ((), {"unsqueeze_dim": 2, "position_ids": position_ids}, bsnd, 2),
    ]:
        ours = forwards.ROPE_LAYOUTS["half"](qq, kk, cos, sin, *args, **kwargs)
        theirs = modeling_llama.apply_rotary_pos_emb(qq, kk, cos, sin, unsqueeze_dim=dim)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("keep", [0, 1, 3, torch.tensor([0, 2, 5])])
def test_slice_to_keep(keep):
    hidden = torch.randn(2, 6, 4)
    if isinstance(keep, torch.Tensor):
        expected = hidden[:, keep]  # these positions
    else:
        expected = hidden[:, -keep:] if keep else hidden  # the last `keep`, 0 = all
    assert torch.equal(compat.slice_to_keep(hidden, keep), expected)


def test_mask_query_arguments_round_trip():
    for q_length, kv_length in ((5, 5), (1, 5)):
        kwargs = compat.mask_query_kwargs(q_length, kv_length - q_length, torch.device("cpu"))
        q_len, q_offset, device = compat.mask_query_span(kwargs, kv_length)
        assert q_len == q_length and torch.device(device) == torch.device("cpu")
        # a query offset is known on the host only where the release gives it (5.x), or it must be 0 (4.57)
        assert q_offset == kv_length - q_length or (compat.MASK_TAKES_CACHE_POSITION and q_offset is None)


def test_create_mask_is_the_models_prefill_mask():
    config = tiny_model("llama").config
    config._attn_implementation = "sdpa"
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[1, :2] = 0
    mask = compat.create_mask(masking_utils.create_causal_mask, config, torch.zeros(2, 6, 1), padding)
    expected = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6) & padding.bool()[:, None, None, :]
    assert torch.equal(mask, expected)


def test_bidirectional_mask_function_sees_every_key():
    mask = masking_utils.sdpa_mask(batch_size=1, kv_length=4, mask_function=compat.bidirectional_mask_function,
                                   allow_is_causal_skip=False, **compat.mask_query_kwargs(4, 0, torch.device("cpu")))
    assert mask.shape == (1, 1, 4, 4) and bool(mask.all())


def test_activation_checkpointing_switches(tmp_path):
    model = tiny_model("qwen3")
    assert compat.enable_activation_checkpointing(model, {"use_reentrant": False})
    assert model.is_gradient_checkpointing
    assert not compat.enable_activation_checkpointing(torch.nn.Linear(2, 2), {})
    switch, switch_kwargs = compat.training_args_checkpointing_names()
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                             **{switch: True, switch_kwargs: {"use_reentrant": False}})
    assert getattr(args, switch) is True
