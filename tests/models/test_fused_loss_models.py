"""causal_lm_forward (the fused-loss causal-LM forward) against each family's own HF forward: loss, every
gradient, eval logits, logits_to_keep, MoE aux loss, PEFT LoRA on lm_head, TRL's fused head and HF Trainer with
gradient accumulation. The forward is put on the class by hand here (the patch engine is tested elsewhere)."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from tiny_models import FAMILY_CONFIGS, VOCAB, assert_close_grads, padded_batch, tiny_model

from mindspeed_hf.config import config_from_dict
from mindspeed_hf.patches import scope
from mindspeed_hf.patches.causal_lm import SkippedLogits, causal_lm_forward
from mindspeed_hf.releases.compat import CACHE_NAME, cache_of

TOL = dict(atol=1e-5, rtol=1e-5)
# Gemma3's text config has no softcap by default: turn it on so one family of each kind exercises it
OVERRIDES = {"gemma3_text": dict(final_logit_softcapping=30.0), "qwen3_moe": dict(output_router_logits=True)}
CHUNK = 7  # several chunks even for the tiny batches


@contextlib.contextmanager
def patched(model, chunk_size: int = CHUNK, enabled: bool = True):
    """Put causal_lm_forward on the model's class (as the patch engine does) and restore it after. These loops
    are not Trainer's, so the logits are skipped by `skip_logits: always` (enabled) or kept (`never`)."""
    cls = type(model)
    saved = cls.__dict__["forward"]
    cls.forward = causal_lm_forward
    scope.set_process_config(config_from_dict(
        {"kernels": {"loss_chunk_size": chunk_size, "skip_logits": "always" if enabled else "never"}}))
    try:
        yield
    finally:
        cls.forward = saved
        scope.set_process_config(None)


def _run(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_family_loss_and_grads_match_hf(model_type):
    model = tiny_model(model_type, **OVERRIDES.get(model_type, {})).train()
    batch = padded_batch()
    items = {"num_items_in_batch": torch.tensor(41)}
    expected = [_run(model, batch), _run(model, batch, **items)]
    with patched(model):
        actual = [_run(model, batch), _run(model, batch, **items)]
    for (ref, ref_grads), (out, grads) in zip(expected, actual):
        assert isinstance(out.logits, SkippedLogits)  # training with labels: no [tokens, vocab] logits
        torch.testing.assert_close(out.loss, ref.loss, **TOL)
        assert_close_grads(ref_grads, grads)
        if getattr(ref, "aux_loss", None) is not None:
            torch.testing.assert_close(out.aux_loss, ref.aux_loss, **TOL)
            assert out.router_logits is not None
    if model_type in ("qwen2_moe", "qwen3_moe"):
        assert expected[0][0].aux_loss is not None  # output_router_logits really on for these two


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "mixtral"])
def test_eval_and_explicit_skip_logits_false_return_hf_logits(model_type):
    model = tiny_model(model_type)
    batch = padded_batch()
    model.eval()
    with torch.no_grad():
        ref = model(**batch)
        with patched(model):
            out = model(**batch)
            skipped = model(**batch, skip_logits=True)  # Trainer's liger eval flag: loss only
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    assert isinstance(skipped.logits, SkippedLogits)
    torch.testing.assert_close(skipped.loss, ref.loss, **TOL)

    model.train()
    ref, ref_grads = _run(model, batch)
    with patched(model):
        out, grads = _run(model, batch, skip_logits=False)
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    assert_close_grads(ref_grads, grads)


def test_logits_to_keep_generation_and_tuple_output():
    model = tiny_model("qwen3").eval()
    ids = padded_batch()["input_ids"][:, :9]
    with torch.no_grad():
        ref = model(input_ids=ids, logits_to_keep=1).logits
        ref_gen = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
        with patched(model):
            out = model(input_ids=ids, logits_to_keep=1).logits
            gen = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
            as_tuple = model(input_ids=ids, return_dict=False)
    assert out.shape == (ids.shape[0], 1, VOCAB)
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(gen, ref_gen)
    assert isinstance(as_tuple, tuple) and as_tuple[0].shape == (*ids.shape, VOCAB)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2_moe", "gemma3_text"])
def test_cache_goes_in_and_out_under_the_release_name(model_type):
    """The KV cache is taken and returned under the installed release's name (`cache` in 5.x, which also takes
    `past_key_values` as its deprecated alias; `past_key_values` in 4.57): a prefill and a decoding step that passes
    the cache back give HF's logits and the same kind of cache."""
    model = tiny_model(model_type).eval()
    ids = padded_batch()["input_ids"][:, :8]
    assert CACHE_NAME in inspect.signature(type(model).forward).parameters
    assert CACHE_NAME in inspect.signature(causal_lm_forward).parameters

    def prefill_and_step():
        with torch.no_grad():
            first = model(input_ids=ids[:, :7], use_cache=True)
            second = model(input_ids=ids[:, 7:], use_cache=True, past_key_values=cache_of(first))
        return first, second

    expected = prefill_and_step()
    with patched(model):
        actual = prefill_and_step()
    for ref, out in zip(expected, actual, strict=True):
        torch.testing.assert_close(out.logits, ref.logits, **TOL)
        assert cache_of(out) is not None and type(cache_of(out)) is type(cache_of(ref))


def test_disabled_or_custom_loss_keeps_hf_path():
    model = tiny_model("llama").train()
    batch = padded_batch()
    ref, ref_grads = _run(model, batch)
    with patched(model, enabled=False):
        out, grads = _run(model, batch)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    assert_close_grads(ref_grads, grads)

    seen = []

    def custom(logits, labels, vocab_size, **kwargs):
        seen.append(logits.shape)
        return logits.float().mean()

    model.loss_function = custom
    with patched(model):
        out = model(**batch)
    assert seen == [(*batch["input_ids"].shape, VOCAB)] and out.logits is not None


def test_tied_embeddings_model():
    model = tiny_model("qwen3", tie_word_embeddings=True).train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref, ref_grads = _run(model, padded_batch())
    with patched(model):
        out, grads = _run(model, padded_batch())
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    assert_close_grads(ref_grads, grads)


def test_peft_lora_on_lm_head():
    peft = pytest.importorskip("peft")
    base = tiny_model("qwen3")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    model = peft.get_peft_model(base, config).train()
    batch = padded_batch()
    ref, ref_grads = _run(model, batch)
    assert any("lm_head.lora_A" in n for n in ref_grads)
    with patched(base):
        out, grads = _run(model, batch)
    assert isinstance(out.logits, SkippedLogits)
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    assert_close_grads(ref_grads, grads)


def test_trl_fused_lm_head_unchanged():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) was added in trl 1.15.0")
    batch = padded_batch()
    results = []
    for patch in (False, True):
        model = tiny_model("qwen3").train()
        ctx = patched(model) if patch else contextlib.nullcontext()
        with ctx:
            trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
            fused, fused_grads = _run(model, batch, fused_lm_head=True)
            plain, _ = _run(model, batch)  # TRL's other path: the class forward underneath
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"]).logits
        results.append((fused, fused_grads, plain, logits))
    (ref, ref_grads, ref_plain, ref_logits), (out, grads, plain, logits) = results
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    torch.testing.assert_close(out.log_probs, ref.log_probs, **TOL)
    assert_close_grads(ref_grads, grads)
    torch.testing.assert_close(plain.loss, ref_plain.loss, **TOL)
    torch.testing.assert_close(logits, ref_logits, **TOL)


def test_hf_trainer_grad_accumulation_two_steps(tmp_path):
    from transformers import Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(3)
    data = []
    for i in range(8):
        ids = torch.randint(1, VOCAB, (12,), generator=gen)
        labels = ids.clone()
        labels[: 1 + 2 * (i % 4)] = -100  # uneven valid-token counts across micro-batches
        data.append({"input_ids": ids, "labels": labels})

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.seen.append(loss.detach().clone())
            return loss

    def train(patch: bool):
        model = tiny_model("qwen3")
        args = TrainingArguments(
            output_dir=str(tmp_path / str(patch)), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=2, learning_rate=0.1, optim="sgd", logging_steps=1, report_to="none", save_strategy="no",
            use_cpu=True, seed=0, disable_tqdm=True,
        )
        with patched(model) if patch else contextlib.nullcontext():
            trainer = Recording(model=model, args=args, train_dataset=data)
            trainer.seen = []
            assert trainer.model_accepts_loss_kwargs
            trainer.train()
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return torch.stack(trainer.seen), logged, {n: p.detach().clone() for n, p in model.named_parameters()}

    ref_losses, ref_logged, ref_params = train(False)
    losses, logged, params = train(True)
    assert len(losses) == 4 and len(logged) == 2
    torch.testing.assert_close(losses, ref_losses, **TOL)
    assert logged == pytest.approx(ref_logged, abs=1e-5)
    # SGD keeps parameter differences proportional to gradient differences (AdamW's g / sqrt(v) blows the last
    # bits of near-zero gradients up to lr-sized steps, which says nothing about the loss)
    assert_close_grads(ref_params, params)
