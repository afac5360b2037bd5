"""examples/omni/finetune_talker.py: the Qwen2.5-Omni talker fine-tuning script runs unmodified under mindspeed_hf
(fused loss on codec_head, decoder kernels reported and run), logs the per-step losses of the same script on plain
HF, the loss falls, and the saved talker loads with from_pretrained and runs."""

from __future__ import annotations

import pytest
import torch
from conftest import run_example

from mindspeed_hf.patches.families import FAMILIES

pytestmark = pytest.mark.slow
STEPS = 20


def _losses(lines: list[dict]) -> list[float]:
    return [line["loss"] for line in lines if "loss" in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("talker")
    found = {"tmp": tmp}
    for auto in (True, False):
        (tmp / str(auto)).mkdir()
        found[auto] = run_example("omni/finetune_talker.py", tmp / str(auto), auto, "--max_steps", str(STEPS))
    return found


def test_losses_fall_and_equal_plain_hf(runs):
    accelerated, plain = _losses(runs[True]), _losses(runs[False])
    assert len(accelerated) == len(plain) == STEPS
    # (4.57's Trainer logs 4 decimals)
    torch.testing.assert_close(torch.tensor(accelerated), torch.tensor(plain), atol=1.5e-4, rtol=0)
    assert sum(accelerated[-5:]) / 5 < accelerated[0] - 1.0  # the voice is being learned
    report = runs[True][-1]
    assert report["enabled"] and report["report"]["model_type"] == "qwen2_5_omni_talker"
    ran, kernels = report["report"]["ran"], report["report"]["kernels"]
    assert kernels["fused_linear_cross_entropy"] == 1 and ran["fused_linear_cross_entropy"] == STEPS
    assert min(ran[op] for op in ("rms_norm", "rope", "swiglu", "attention")) >= STEPS * 2
    assert not runs[False][-1]["enabled"]


def test_saved_talker_loads(runs):
    from transformers import Qwen2_5OmniTalkerForConditionalGeneration

    assert FAMILIES["qwen2_5_omni_talker"].talker_heads
    out = runs["tmp"] / "True" / "out"
    talker = Qwen2_5OmniTalkerForConditionalGeneration.from_pretrained(out)
    assert talker.config.model_type == "qwen2_5_omni_talker"
    with torch.no_grad():
        logits = talker(inputs_embeds=torch.randn(1, 6, talker.config.embedding_size),
                        position_ids=torch.arange(6).expand(3, 1, -1)).logits
    assert logits.shape == (1, 6, talker.config.vocab_size) and torch.isfinite(logits).all()
    plain = Qwen2_5OmniTalkerForConditionalGeneration.from_pretrained(runs["tmp"] / "False" / "out")
    for (name, trained), other in zip(talker.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(trained, other, atol=2e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
