"""HF's output switches on every head we replace: a labelled training forward with `return_dict=False` (a named
argument on 4.57, taken through **kwargs by transformers 5.x's `can_return_tuple`: Qwen3.5, the Omni thinkers,
Qwen2-VL ...) returns HF's tuple, element for element the plain model's (loss first, then the logits, made from the
fused pass's hidden states; the hidden states asked for with output_hidden_states), while the fused loss runs (on
4.57 the VLM heads that take return_dict by name build their tuple by hand: HF's forward runs there). Before the fix
the VLM / Omni heads raised `AttributeError: 'tuple' object has no attribute 'logits'`."""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import installed, one_thread, padded_batch, tiny_model  # noqa: F401
from tiny_omni import OMNI_TYPES, omni_batch, tiny_omni_thinker
from tiny_vlms import QWEN_VL, tiny_vlm, vlm_batch

import mindspeed_hf

pytestmark = pytest.mark.usefixtures("one_thread")
VLM_HEADS = (*QWEN_VL, *OMNI_TYPES)
HEADS = [*installed(QWEN_VL), *installed(OMNI_TYPES), *installed(("qwen3", "qwen3_next"))]


def _build(model_type: str):
    if model_type in OMNI_TYPES:
        model = tiny_omni_thinker(model_type)
        return model, omni_batch(model)
    if model_type in QWEN_VL:
        model = tiny_vlm(model_type)
        return model, vlm_batch(model)
    return tiny_model(model_type), padded_batch()


def _assert_same(expected, actual, where: str = "") -> None:
    assert type(actual) is tuple and len(actual) == len(expected), (where, len(expected), len(actual))
    for index, (want, got) in enumerate(zip(expected, actual)):
        if isinstance(want, tuple):
            _assert_same(want, got, f"{where}[{index}]")
        elif isinstance(want, torch.Tensor):
            torch.testing.assert_close(torch.as_tensor(got), want, atol=1e-5, rtol=1e-5, msg=f"{where}[{index}]")
        else:  # a cache (its own object per call)
            assert type(got) is type(want), f"{where}[{index}]"


@pytest.mark.parametrize("model_type", HEADS)
def test_return_dict_false_gives_hf_tuple(model_type):
    model, batch = _build(model_type)
    model.train()
    switches = {"return_dict": False, "output_hidden_states": True}  # the other output switches pass through
    torch.manual_seed(0)
    expected = model(**batch, **switches)
    mindspeed_hf.enable()
    mindspeed_hf.apply_to_model(model)
    torch.manual_seed(0)
    actual = model(**batch, **switches)
    _assert_same(expected, actual)
    # transformers 4.57's VLM heads take return_dict by name and build their tuple by hand: HF's forward runs there
    by_hand = "return_dict" in inspect.signature(type(model).forward).parameters and model_type in VLM_HEADS
    assert mindspeed_hf.report(model)["ran"]["fused_linear_cross_entropy"] == (0 if by_hand else 1)
