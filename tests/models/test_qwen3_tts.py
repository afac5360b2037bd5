"""Qwen3-TTS (the qwen-tts package): with mindspeed_hf the talker and the code predictor give plain HF's loss and
gradients (fp32, 1e-5) on the torch and npu backends with every fused op counted; disable() restores them; the
example's objective (examples/qwen3_tts/tts_loss.py) equals next-frame cross-entropy for the talker and per-codebook
cross-entropy for the code predictor, computed here from HF's own forwards; a qwen_tts imported after enable() is
patched when its model is applied."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from tiny_models import assert_close_grads, one_thread, qwen_tts_missing, tiny_tts_model  # noqa: F401

if qwen_tts_missing():
    pytest.skip(qwen_tts_missing(), allow_module_level=True)

from child_runs import REPO  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf.config import config_from_dict  # noqa: E402
from mindspeed_hf.patches import third_party  # noqa: E402

sys.path.insert(0, str(REPO / "examples" / "qwen3_tts"))
from data import Collator, synthetic_rows  # noqa: E402
from qwen_tts_loader import import_qwen_tts  # noqa: E402
from tts_loss import Qwen3TTSFinetune, input_embeddings  # noqa: E402

MODELING = import_qwen_tts()
ORIGINAL_NORM = MODELING.Qwen3TTSRMSNorm.forward
pytestmark = pytest.mark.usefixtures("one_thread")
PATCHED = {("module", "apply_rotary_pos_emb"), ("module", "apply_multimodal_rotary_pos_emb"),
           ("Qwen3TTSRMSNorm", "forward"), ("Qwen3TTSTalkerTextMLP", "forward"),
           ("Qwen3TTSPreTrainedModel", "get_correct_attn_implementation"), ("Qwen3TTSPreTrainedModel", "post_init")}


def _snapshot() -> dict:
    return {(owner, name): getattr(MODELING if owner == "module" else getattr(MODELING, owner), name)
            for owner, name in PATCHED}


def _batch(model, rows: int = 3, seed: int = 1) -> dict[str, torch.Tensor]:
    return Collator(model.config)(synthetic_rows(model.config, rows, seed=seed))


def _loss_and_grads(module, batch):
    module.zero_grad(set_to_none=True)
    out = module(**batch)
    out["loss"].backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in out.items()}, grads


def test_multimodal_rope_matches_hf_for_any_position_rows(backend):
    """The fused rope on the folded tables equals qwen-tts' own function, rows equal (TTS) or not, both layouts,
    and never falls back to it."""
    original = MODELING.apply_multimodal_rotary_pos_emb
    fallbacks = []
    fast = third_party.mrope_function(lambda *args: fallbacks.append(1) or original(*args))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 7, 16, generator=gen), torch.randn(2, 2, 7, 16, generator=gen)
    angles = torch.randn(1, 2, 7, 8, generator=gen).repeat(1, 1, 1, 2)  # cat(freqs, freqs), as the rotary modules
    other = torch.randn(3, 2, 7, 8, generator=gen).repeat(1, 1, 1, 2)
    for rows in (angles.expand(3, -1, -1, -1), other):
        cos, sin = rows.cos(), rows.sin()
        for interleaved in (True, False):
            expected = original(q, k, cos, sin, [4, 2, 2], interleaved)
            for got, want in zip(fast(q, k, cos, sin, [4, 2, 2], interleaved), expected):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not fallbacks


def test_talker_and_code_predictor_match_hf(backend):
    model = tiny_tts_model()
    module = Qwen3TTSFinetune(model)
    batch = _batch(model)
    expected, expected_grads = _loss_and_grads(module, batch)
    originals = _snapshot()

    mindspeed_hf.enable(config_from_dict({"backend": backend}))
    report = mindspeed_hf.apply_to_model(module)
    # talker: 2 layers x (input, post-attention, q_norm, k_norm) + final norm; the code predictor the same
    assert report["kernels"] == {"rms_norm": 18, "rope": 4, "swiglu": 4, "attention": 4,
                                 "fused_linear_cross_entropy": 0, "experts": 0, "linear_attention": 0}
    assert report["backend"] == backend and report["model_type"] == "qwen3_tts"
    assert {model.talker.config._attn_implementation,
            model.talker.code_predictor.config._attn_implementation} == {"mindspeed"}
    got, grads = _loss_and_grads(module, batch)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-5, msg=key)
    assert_close_grads(expected_grads, grads)
    assert any(n.startswith("model.talker.code_predictor.") for n in grads)

    mindspeed_hf.disable()
    assert _snapshot() == originals
    assert model.talker.code_predictor.config._attn_implementation == "sdpa"
    assert not any(mindspeed_hf.report(module)["kernels"].values())
    again, _ = _loss_and_grads(module, batch)
    torch.testing.assert_close(again["loss"], expected["loss"], atol=0, rtol=0)


def test_objective_is_next_frame_and_per_codebook():
    """Computed independently from HF's forwards: the talker's own forward (its position ids), upstream's
    forward_sub_talker_finetune for the code predictor's logits, explicit per-position / per-codebook loops."""
    torch.manual_seed(0)
    model = tiny_tts_model()
    batch = _batch(model)
    ours = Qwen3TTSFinetune(model)(**batch)
    talker, groups = model.talker, model.config.talker_config.num_code_groups

    with torch.no_grad():
        embeds = input_embeddings(model, batch)
        out = talker(inputs_embeds=embeds, attention_mask=batch["attention_mask"], output_hidden_states=True)
        hidden = out.hidden_states[0][-1]
        labels, terms = batch["codec_0_labels"], []
        for b in range(labels.shape[0]):
            for t in range(labels.shape[1] - 1):
                if labels[b, t + 1] != -100:  # position t predicts the frame (or codec eos) at t + 1
                    terms.append(F.cross_entropy(out.logits[b, t], labels[b, t + 1]))
        torch.testing.assert_close(ours["talker_loss"], torch.stack(terms).mean(), atol=1e-5, rtol=1e-5)

        mask = batch["codec_mask"]
        frames = batch["codec_ids"][mask]
        states = torch.stack([hidden[b, p - 1] for b, p in mask.nonzero().tolist()])
        logits, upstream_loss = talker.forward_sub_talker_finetune(frames, states)
        assert logits.shape[1] == groups - 1
        per_codebook = [F.cross_entropy(logits[:, j - 1], frames[:, j]) for j in range(1, groups)]
        torch.testing.assert_close(ours["code_predictor_loss"], torch.stack(per_codebook).mean(), atol=1e-5,
                                   rtol=1e-5)
        # upstream's loss shifts these labels once more (head j scored on codebook j + 2, the last head on nothing)
        assert abs(float(upstream_loss) - float(ours["code_predictor_loss"])) > 1e-3
    torch.testing.assert_close(ours["loss"], ours["talker_loss"] + 0.3 * ours["code_predictor_loss"])

    ours["loss"].backward()
    for j, head in enumerate(talker.code_predictor.lm_head):  # every codebook 1 .. G-1 trains its head
        assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0, f"head {j} got no loss"
    assert talker.text_projection.linear_fc1.weight.grad.abs().sum() > 0  # text_projection is applied


def test_module_imported_after_enable_is_patched_when_its_model_is_applied(monkeypatch):
    model = tiny_tts_model()
    with monkeypatch.context() as hidden:  # as if qwen_tts were imported only after enable()
        hidden.delitem(sys.modules, MODELING.__name__)
        mindspeed_hf.enable()
    assert MODELING.Qwen3TTSRMSNorm.forward is ORIGINAL_NORM
    report = mindspeed_hf.apply_to_model(model)
    assert MODELING.Qwen3TTSRMSNorm.forward is not ORIGINAL_NORM
    assert report["kernels"]["rms_norm"] == 18 and report["kernels"]["rope"] == 4
    mindspeed_hf.disable()
    assert MODELING.Qwen3TTSRMSNorm.forward is ORIGINAL_NORM


def test_qwen_tts_imported_after_mindspeed_hf_is_patched_on_import(tmp_path):
    """`import mindspeed_hf` first, `import qwen_tts` afterwards (a fresh process): the model built then runs our
    kernels with no Trainer or apply_to_model involved."""
    import os
    import subprocess

    script = tmp_path / "after.py"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(REPO / 'tests')!r}, {str(REPO / 'examples' / 'qwen3_tts')!r}]\n"
        "import mindspeed_hf\n"
        "assert mindspeed_hf.is_enabled() and 'qwen_tts' not in sys.modules\n"
        "from qwen_tts_loader import import_qwen_tts\n"
        "import_qwen_tts()\n"
        "from tiny_models import tiny_tts_model\n"
        "report = mindspeed_hf.report(tiny_tts_model())\n"
        "print(report['kernels']['rms_norm'], report['kernels']['rope'])\n")
    env = {**os.environ, "MINDSPEED_HF_AUTO": "1", "MINDSPEED_HF_KERNELS_TORCH_PATH": "fused"}  # counts ours
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].split() == ["18", "4"], done.stdout  # qwen-tts prints a banner first
