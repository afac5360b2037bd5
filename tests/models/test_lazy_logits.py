"""Logits made on first read (patches/lazy_logits.py): in a forward with labels outside Trainer's own loss
computation - a custom training loop, evaluation - the loss is the fused one and `outputs.logits` is built only when
something reads it, then it is HF's tensor (values, dtype, gradients into the model). Against the unpatched model in
the same process (the package disabled), fp32, 1e-5."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

import mindspeed_hf
from mindspeed_hf.patches import causal_lm
from mindspeed_hf.patches.lazy_logits import DeferredLogits


@pytest.fixture
def made(monkeypatch) -> list[tuple[int, ...]]:
    """The shape of every logits tensor made from deferred logits."""
    shapes: list[tuple[int, ...]] = []
    original = DeferredLogits.materialize

    def counting(self):
        first = self._value is None
        value = original(self)
        if first:
            shapes.append(tuple(self.shape))
        return value

    monkeypatch.setattr(DeferredLogits, "materialize", counting)
    return shapes


def _batch(vocab: int = 128, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _run(family: str, accelerated: bool, read, **overrides):
    """One training step of a fresh model: (loss, what `read(outputs)` returned, the gradients)."""
    (mindspeed_hf.enable if accelerated else mindspeed_hf.disable)()
    model = tiny_model(family, **overrides)
    model.train()
    outputs = model(**_batch())
    loss = outputs.loss + (read(outputs) if read is not None else 0)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), outputs, grads


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma2"])
def test_a_loop_that_reads_only_the_loss_never_builds_logits(family, made):
    hf_loss, _, hf_grads = _run(family, False, None)
    loss, outputs, grads = _run(family, True, None)
    assert isinstance(outputs.logits, DeferredLogits) and made == []
    assert abs(loss.item() - hf_loss.item()) <= 1e-5
    _close(grads, hf_grads)
    # metadata reads build nothing either
    assert outputs.logits.shape == (2, 12, 128) and outputs.logits.dtype == torch.float32
    assert outputs.logits.device.type == "cpu" and outputs.logits.requires_grad and outputs.logits.dim() == 3
    assert made == []


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])  # gemma2: the softcap applied as HF does
def test_a_loop_that_builds_its_loss_on_the_logits_gets_hf_gradients(family, made):
    def read(outputs):
        return 1e-2 * outputs.logits.float().logsumexp(-1).pow(2).mean()

    hf_loss, hf_out, hf_grads = _run(family, False, read)
    loss, outputs, grads = _run(family, True, read)
    assert made == [(2, 12, 128)]  # once
    assert abs(loss.item() - hf_loss.item()) <= 1e-5
    _close(grads, hf_grads)
    torch.testing.assert_close(outputs.logits.detach(), hf_out.logits.detach(), atol=1e-5, rtol=0)


def test_every_way_of_reading_gives_the_same_tensor(made):
    _, hf_out, _ = _run("qwen3", False, None)
    _, outputs, _ = _run("qwen3", True, None)
    assert "logits" in outputs and list(outputs.keys()) == list(hf_out.keys())
    first = outputs["logits"]
    assert first is outputs.logits and outputs.to_tuple()[1] is first and dict(outputs)["logits"] is first
    assert outputs.logits.float() is first  # a cast to its own dtype is itself, as for a tensor
    half = outputs.logits.to(torch.bfloat16)  # accelerate's output conversion casts every output: deferred too
    assert isinstance(half, DeferredLogits) and half.dtype == torch.bfloat16 and made == []
    torch.testing.assert_close(outputs.logits[:, -1], hf_out.logits[:, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(half.float(), hf_out.logits.to(torch.bfloat16).float(), atol=1e-2, rtol=0)
    # made: the logits, their bf16 cast, and that cast in fp32 (each once)
    assert made == [(2, 12, 128)] * 3 and "tensor(" in repr(outputs.logits) and len(made) == 3


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])  # gemma2: its softcap applied before the argmax
def test_a_top1_reader_gets_hf_argmax_without_logits(family, made):
    """A token-accuracy reader (`outputs.logits.argmax(-1)`, ms-swift's) gets HF's top-1 per position from the
    chunked pass, the logits never built; also through a widening cast (accelerate's output conversion)."""
    _, hf_out, _ = _run(family, False, None)
    hf_logits = hf_out.logits.detach()
    _, outputs, _ = _run(family, True, None)
    for read in (lambda x: x.argmax(-1), lambda x: x.argmax(dim=-1), lambda x: torch.argmax(x, dim=2),
                 lambda x: x.double().argmax(-1)):
        top1 = read(outputs.logits)
        assert type(top1) is torch.Tensor and top1.dtype == torch.long and top1.shape == hf_logits.shape[:-1]
        # HF's top-1, up to near-ties (the two models' hidden states differ in the last bits)
        assert (hf_logits.gather(-1, top1[..., None]).squeeze(-1) >= hf_logits.amax(-1) - 1e-5).all()
        assert (top1 == hf_logits.argmax(-1)).float().mean() > 0.9
    assert made == []
    assert torch.equal(outputs.logits.argmax(-1, keepdim=True), hf_out.logits.argmax(-1, keepdim=True))
    assert made == [(2, 12, 128)]  # any other reading builds the logits


def test_under_autocast_the_logits_have_hf_dtype():
    read = {}
    for accelerated in (False, True):
        (mindspeed_hf.enable if accelerated else mindspeed_hf.disable)()
        model = tiny_model("qwen3")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = model(**_batch())
        read[accelerated] = outputs.logits  # read outside the autocast region: made as inside it
    assert read[True].dtype == read[False].dtype == torch.bfloat16
    torch.testing.assert_close(read[True].float(), read[False].float(), atol=0, rtol=0)


def test_explicit_skip_logits_false_takes_hf_path(made, monkeypatch):
    calls = []
    monkeypatch.setattr(causal_lm, "fused_linear_cross_entropy", lambda *a, **k: calls.append(1))
    mindspeed_hf.enable()
    model = tiny_model("qwen3")
    outputs = model(**_batch(), skip_logits=False)
    assert type(outputs.logits) is torch.Tensor and not calls


def test_a_wrapped_head_defers_too(made):
    """A PEFT LoRA on lm_head (not an nn.Linear: its output metadata is probed on one position, its random state
    kept): the logits and the gradients a loss on them sends into the adapter equal PEFT on plain HF."""
    from peft import LoraConfig, get_peft_model

    def run(accelerated):
        (mindspeed_hf.enable if accelerated else mindspeed_hf.disable)()
        model = get_peft_model(tiny_model("qwen3"), LoraConfig(r=4, target_modules=["lm_head", "q_proj"],
                                                                lora_dropout=0.0, init_lora_weights=False))
        model.train()
        torch.manual_seed(5)
        outputs = model(**_batch())
        (outputs.loss + 1e-2 * outputs.logits.float().logsumexp(-1).pow(2).mean()).backward()
        state = torch.get_rng_state()
        return outputs, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, state

    hf_out, hf_grads, hf_rng = run(False)
    out, grads, rng = run(True)
    assert made == [(2, 12, 128)] and torch.equal(rng, hf_rng)
    torch.testing.assert_close(out.logits.detach(), hf_out.logits.detach(), atol=1e-5, rtol=0)
    _close(grads, hf_grads)


@pytest.mark.skipif(not __import__("transformers").__version__.startswith("5"), reason="the VL families: >= 5")
def test_a_vision_language_forward_defers_its_logits(made):
    from tiny_vlms import tiny_vlm, vlm_batch

    results = {}
    for accelerated in (False, True):
        (mindspeed_hf.enable if accelerated else mindspeed_hf.disable)()
        model = tiny_vlm("qwen2_5_vl").train()
        outputs = model(**vlm_batch(model))
        results[accelerated] = outputs
    assert isinstance(results[True].logits, DeferredLogits) and made == []
    assert abs(results[True].loss.item() - results[False].loss.item()) <= 1e-5
    torch.testing.assert_close(results[True].logits.detach(), results[False].logits.detach(), atol=1e-5, rtol=0)
    assert len(made) == 1


def test_a_first_read_after_the_optimizer_step_is_refused_not_wrong(made):
    """After the backward (weights unchanged) the logits are HF's; once an optimizer step changed the lm_head they
    cannot be that forward's any more: a first read then raises the error naming the way out, not other numbers."""
    mindspeed_hf.disable()
    hf = tiny_model("qwen3").train()(**_batch())
    mindspeed_hf.enable()
    model = tiny_model("qwen3").train()
    outputs = model(**_batch())
    outputs.loss.backward()
    torch.testing.assert_close(outputs.logits.detach(), hf.logits.detach(), atol=1e-5, rtol=0)
    later = model(**_batch(seed=1))
    later.loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match="kernels.skip_logits: never"):
        later.logits.argmax(-1)
    assert made == [(2, 12, 128)]
