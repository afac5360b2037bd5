"""The accelerate seam in one process (runtime/accelerator.py): a plain accelerate loop with the accelerator on trains
like plain Hugging Face (losses and gradients), its model prepared through the one path (kernels counted as they run,
memory features from the config); disable() gives Accelerator its own methods back; bad settings stop at
`Accelerator()` in one line; a patched kernel that never ran is said at end_training. (Several ranks:
tests/distributed/test_accelerate_loop.py.)"""

from __future__ import annotations

import logging

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from tiny_models import tiny_model

import mindspeed_hf
from mindspeed_hf.config import config_from_dict
from mindspeed_hf.runtime import run_of

TOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _batches(n: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(2, 120, (2, 16), generator=g) for _ in range(n)]
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def _loop(config: dict | None) -> tuple[list[float], dict[str, torch.Tensor], object, dict]:
    """Three SGD steps of a plain accelerate loop on a tiny Qwen3; mindspeed_hf on with `config` (None: off).
    Returns the losses, the last step's gradients, the accelerator and report() of the model before disable()."""
    if config is not None:
        mindspeed_hf.enable(config_from_dict(config))
    model = tiny_model("qwen3")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, grads = [], {}
    for batch in _batches():
        loss = model(**batch).loss
        accelerator.backward(loss)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.end_training()
    report = mindspeed_hf.report(model)
    mindspeed_hf.disable()
    return losses, grads, accelerator, report


def test_a_loop_trains_like_plain_hf_with_the_kernels_counted():
    want, want_grads, _, _ = _loop(None)
    got, got_grads, accelerator, report = _loop({})
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, (got, want)
    assert max((got_grads[n] - want_grads[n]).abs().max().item() for n in want_grads) <= TOL
    run = run_of(accelerator)
    assert run is not None and run.owner == "Accelerator" and run.plan is None
    assert len(run.models) == 1
    ran = report["ran"]
    assert ran["attention"] > 0 and ran["fused_linear_cross_entropy"] == 3, ran


def test_memory_settings_reach_a_loop():
    want, want_grads, _, _ = _loop(None)
    got, got_grads, accelerator, _ = _loop({"memory": {"recompute": "selective"}})
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOL
    assert max((got_grads[n] - want_grads[n]).abs().max().item() for n in want_grads) <= TOL
    (model,) = list(run_of(accelerator).models)
    recomputed = [name for name, m in model.named_modules() if "_mindspeed_recompute" in vars(m)]
    assert recomputed and all(".layers." in name for name in recomputed), recomputed


def test_disable_gives_accelerator_its_methods_back():
    before = dict(vars(Accelerator))
    mindspeed_hf.enable()
    assert getattr(vars(Accelerator)["prepare"], "_mindspeed_wiring", False)
    mindspeed_hf.disable()
    assert {k: v for k, v in vars(Accelerator).items()} == before


def test_bad_sizes_stop_at_the_accelerator_in_one_line(monkeypatch):
    monkeypatch.setenv("MINDSPEED_HF_PARALLEL_TP", "3")
    mindspeed_hf.enable()
    with pytest.raises(ValueError) as err:
        Accelerator(cpu=True)
    message = str(err.value)
    assert "\n" not in message and "MINDSPEED_HF_PARALLEL_TP" in message and "world_size=1" in message, message


def test_a_kernel_that_never_ran_is_said_at_end_training(caplog):
    mindspeed_hf.enable()
    model = tiny_model("qwen3")
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    with caplog.at_level(logging.WARNING, logger="mindspeed_hf"):
        model(input_ids=_batches(1)[0]["input_ids"])  # no labels: the fused loss has nothing to do
        accelerator.end_training()
    said = [r.getMessage() for r in caplog.records if "never ran since Accelerator.prepare" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("mindspeed_hf: fused_linear_cross_entropy patched into"), said
