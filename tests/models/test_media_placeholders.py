"""parallel/towers.py's placeholders, in one process: a batch lacking a medium, given a placeholder of it (what a FSDP2
rank does when another rank's micro-batch has that medium), keeps the loss and every gradient of the same
accelerated model without it bit for bit (and of the unpatched model within 1e-5, padded rows), while the
placeholder's tower really runs and gets zero gradients; padded and packed rows, the Qwen-VL families (Qwen3.5
included) and both Omni thinkers, LLaVA and InternVL (fixed-size towers), with the accelerator on (torch and npu
backends)."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from tiny_models import assert_close_grads, installed, loss_and_grads
from tiny_omni import OMNI_TYPES, omni_rows, tiny_omni_thinker
from tiny_vlms import QWEN_VL, pad_rows, tiny_vlm, vlm_batch, vlm_rows

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.data import FlatteningCollator
from mindspeed_hf.parallel.towers import MEDIA, add_placeholders, tower_modules

TYPES = installed((*QWEN_VL, *OMNI_TYPES))
# HF's Qwen3-Omni forward before 5.20 fails on any batch with images and videos (its deepstack merge indexes a 3-D
# mask): a placeholder video beside real images is such a batch (README, "Ranks with different media")
_HF_JOINT_BUG = Version(transformers.__version__) < Version("5.20")


def _batches(model_type: str):
    """(model, {media present: two rows with exactly those media}) for every mix of media the test rows have."""
    omni = model_type in OMNI_TYPES
    model = tiny_omni_thinker(model_type) if omni else tiny_vlm(model_type)
    rows = omni_rows(model) if omni else vlm_rows(model, videos=True)
    kinds: dict[tuple[str, ...], list[dict]] = {}
    for row in rows:
        kinds.setdefault(tuple(key for key in MEDIA if key in row), []).append(row)
    return model, {kind: found[:2] for kind, found in kinds.items()}


def _tower_runs(model) -> list[str]:
    runs: list[str] = []
    for tower in tower_modules(model):
        tower.register_forward_hook(lambda module, args, out: runs.append(type(module).__name__))
    return runs


def _accelerated(model, backend: str):
    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    mindspeed_hf.apply_to_model(model)
    model.train()
    return _tower_runs(model)


def _same_but_the_placeholder_tower(got: tuple, want: tuple) -> None:
    """Loss and every gradient bit-identical; gradients only the placeholder reached are zeros."""
    (loss, grads), (placeholder_loss, placeholder_grads) = want, got
    assert torch.equal(placeholder_loss, loss)
    assert grads.keys() <= placeholder_grads.keys()
    for name, grad in placeholder_grads.items():
        if name in grads:
            assert torch.equal(grad, grads[name]), name
        else:  # a tower only the placeholder reached
            assert not grad.any(), name


def _equals_plain_hf(got: tuple, plain: tuple) -> None:
    """The placeholder run against the unpatched model on the batch without placeholders: loss 1e-5, every gradient
    HF computed 1e-5 (the placeholder-only tower's are zeros, checked above)."""
    torch.testing.assert_close(got[0], plain[0], atol=1e-5, rtol=1e-5)
    assert_close_grads(plain[1], {name: got[1][name] for name in plain[1]})


@pytest.mark.parametrize("model_type", TYPES)
def test_placeholders_change_nothing_but_run_the_towers(model_type, backend):
    model, batches = _batches(model_type)
    media = set(MEDIA) if model_type in OMNI_TYPES else {"pixel_values", "pixel_values_videos"}
    skip = model_type == "qwen3_omni_moe_thinker" and _HF_JOINT_BUG  # (images beside a placeholder video)
    batches = {kind: rows for kind, rows in batches.items()
               if media - set(kind) and not (skip and "pixel_values" in kind)}
    model.train()
    plain = {kind: loss_and_grads(model, pad_rows(rows)) for kind, rows in batches.items()}  # unpatched HF
    runs = _accelerated(model, backend)
    checked = 0
    for kind, rows in batches.items():
        lacking = media - set(kind)
        for batch in (pad_rows(rows), FlatteningCollator()(rows)):
            want = loss_and_grads(model, batch)
            runs.clear()
            with_placeholders = dict(batch)
            add_placeholders(model, with_placeholders, lacking, torch.device("cpu"))
            got = loss_and_grads(model, with_placeholders)
            # one more tower pass for each placeholder medium (images and videos: the vision tower again)
            assert len(runs) == len(kind) + len(lacking), (kind, runs)
            _same_but_the_placeholder_tower(got, want)
            if "position_ids" not in batch:  # padded rows: plain HF is the reference (packed: its sdpa mixes rows)
                _equals_plain_hf(got, plain[kind])
            checked += 1
    assert checked >= 4
    state = model._mindspeed_media_state
    assert sum(state.ran.values()) >= checked


@pytest.mark.parametrize("model_type", ["llava", "internvl"])
def test_a_fixed_size_tower_runs_one_placeholder_image(model_type, backend):
    """LLaVA / InternVL (their `vision_tower` takes whole images of its size): text-only rows plus a placeholder
    image equal the text-only rows."""
    model = tiny_vlm(model_type)
    ids = torch.randint(3, 200, vlm_batch(model)["input_ids"].shape, generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    model.train()
    plain = loss_and_grads(model, batch)  # unpatched HF
    runs = _accelerated(model, backend)
    want = loss_and_grads(model, batch)
    with_placeholder = dict(batch)
    add_placeholders(model, with_placeholder, {"pixel_values"}, torch.device("cpu"))
    got = loss_and_grads(model, with_placeholder)
    assert len(runs) == 1 and with_placeholder["pixel_values"].dim() == 4
    _same_but_the_placeholder_tower(got, want)
    _equals_plain_hf(got, plain)


def test_the_tested_models_are_the_placeholder_models():
    """parallel/towers.PLACEHOLDER_MODELS (the models that get placeholders) is exactly what this file tests."""
    from mindspeed_hf.parallel.towers import PLACEHOLDER_MODELS

    assert sorted(PLACEHOLDER_MODELS) == sorted((*QWEN_VL, *OMNI_TYPES, "llava", "internvl"))
