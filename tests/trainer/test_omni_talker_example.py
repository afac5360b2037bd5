"""examples/omni/finetune_talker.py: the Qwen2.5-Omni talker fine-tuning script runs unmodified under mindspeed_hf
(fused loss on codec_head, decoder kernels reported and run), logs the per-step losses of the same script on plain
HF, the loss falls, and the saved talker loads with from_pretrained and runs; under torchrun with FSDP2 it equals the
single process. `--talker qwen3_omni_moe` (MoE talker + code predictor): equal to plain HF, and under torchrun with
`parallel: {dp_shard: 2, ep: 2}` and `memory: {recompute: selective, offload_activations: true}` equal to the
single process, checkpoint included."""

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


def test_fsdp2_on_two_ranks_equals_one_process(runs):
    """The same script under torchrun with `parallel: {dp_shard: 2}` from MINDSPEED_HF_CONFIG (the talker sharded
    by FSDP2, half the rows per rank): per-step losses equal the single process's, our kernels ran, and the gathered
    checkpoint loads with from_pretrained and equals it."""
    from transformers import Qwen2_5OmniTalkerForConditionalGeneration

    lines, _ = _torchrun_example(runs["tmp"] / "fsdp2", "parallel: {dp_shard: 2}\n")
    torch.testing.assert_close(torch.tensor(_losses(lines)), torch.tensor(_losses(runs[True])), atol=1e-5, rtol=0)
    assert lines[-1]["report"]["ran"]["fused_linear_cross_entropy"] == STEPS
    _same_weights(Qwen2_5OmniTalkerForConditionalGeneration, runs["tmp"] / "fsdp2" / "out",
                  runs["tmp"] / "True" / "out", atol=1e-5, rtol=1e-4)


def _torchrun_example(tmp, config: str, *flags: str) -> tuple[list[dict], str]:
    """The script under torchrun (2 ranks, 4 rows each) with `config` as MINDSPEED_HF_CONFIG: its JSON lines and
    what it printed."""
    import json

    from child_runs import torchrun
    from conftest import EXAMPLES, run

    tmp.mkdir()
    (tmp / "parallel.yaml").write_text(config)
    out = tmp / "losses.jsonl"
    proc = run(torchrun(str(EXAMPLES / "omni" / "finetune_talker.py"), "--max_steps", str(STEPS), "--output_dir",
                        str(tmp / "out"), "--losses_file", str(out), "--per_device_train_batch_size", "4", *flags),
               auto=True, MINDSPEED_HF_CONFIG=str(tmp / "parallel.yaml"))
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stdout + proc.stderr


def _same_weights(model_class, got, want, atol: float, rtol: float) -> None:
    got, want = model_class.from_pretrained(got), model_class.from_pretrained(want)
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def test_qwen3_talker_and_code_predictor_under_ep(tmp_path_factory):
    """Qwen3-Omni: the talker's codec loss plus the code predictor's per-codebook loss. Accelerated equals plain HF
    per step (HF's own labels paths are unusable here: the script scores plain HF from its logits), the loss falls;
    under torchrun with dp_shard 2 x ep 2 (2 experts per rank, the code predictor's layers sharded, its tables in
    the root group), selective recompute and activation offload on, the losses and the gathered checkpoint equal
    the single process's."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerForConditionalGeneration as Talker,
    )

    tmp = tmp_path_factory.mktemp("qwen3_talker")
    flags = ("--talker", "qwen3_omni_moe", "--max_steps", str(STEPS))
    single = {}
    for auto in (True, False):
        (tmp / str(auto)).mkdir()
        single[auto] = run_example("omni/finetune_talker.py", tmp / str(auto), auto, *flags)
    accelerated = _losses(single[True])
    torch.testing.assert_close(torch.tensor(accelerated), torch.tensor(_losses(single[False])), atol=1.5e-4, rtol=0)
    assert sum(accelerated[-5:]) / 5 < accelerated[0] - 1.5
    report = single[True][-1]["report"]
    assert report["model_type"] == "qwen3_omni_moe_talker"
    # the talker's head and the code predictor's 3 heads each step; the MoE layers on transformers' own grouped_mm
    # (the torch backend: the experts kernel's algorithm, kept and said so)
    assert report["ran"]["fused_linear_cross_entropy"] == 4 * STEPS and report["ran"]["experts"] == 0
    assert report["kept"]["experts"].startswith("HF's grouped_mm"), report["kept"]
    _same_weights(Talker, tmp / "True" / "out", tmp / "False" / "out", atol=2e-4, rtol=1e-3)

    # with selective recompute and activation offload on as well: they change no number
    memory = "memory: {recompute: selective, offload_activations: true, offload_min_bytes: 0}\n"
    lines, printed = _torchrun_example(tmp / "ep", "parallel: {dp_shard: 2, ep: 2}\n" + memory,
                                       "--talker", "qwen3_omni_moe")
    torch.testing.assert_close(torch.tensor(_losses(lines)), torch.tensor(accelerated), atol=1e-5, rtol=0)
    # the talker's 2 MoE layers and the code predictor's 2 layers
    assert "recompute is on (selective: attention_core, mlp in 4 of 4 decoder layers)" in printed, printed[-3000:]
    assert "activation offload is on" in printed
    # EP's dispatch runs the local experts, once more in the backward (selective recompute reruns the MLP)
    assert lines[-1]["report"]["ran"]["experts"] == 2 * 2 * STEPS
    # (AdamW over 20 steps: a gradient summed in another order moves a near-zero one's update; seen 2e-5)
    _same_weights(Talker, tmp / "ep" / "out", tmp / "True" / "out", atol=5e-5, rtol=1e-3)
