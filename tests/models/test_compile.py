"""torch.compile with the accelerator on: `torch.compile(model, fullgraph=True)` of every text family traces (the
per-model config read from a plain stack while Dynamo traces, no ContextVar; the MoE experts kernel with no host read
of the routing), and a compiled training step equals the eager patched one (fp32, 1e-5); a compiled forward
generates the same tokens; a new routing of an MoE model is not a new graph. Dynamo and AOT autograd run in full
(backend "aot_eager"); inductor's code generation is left out (minutes of C++ builds on this machine), which is the
compiler's own business, not what the accelerator changes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tiny_models import FAMILY_CONFIGS, tiny_model
from transformers import __version__ as transformers_version

import mindspeed_hf
from mindspeed_hf.releases import compat

FIVE = int(transformers_version.split(".")[0]) >= 5
pytestmark = pytest.mark.skipif(not FIVE, reason="transformers 4.57's models do not trace with fullgraph=True")


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 120, (2, 12), generator=torch.Generator().manual_seed(seed))


def _skip_where_hf_runs_the_experts(model) -> None:
    """transformers 5.0 .. 5.9 accept only their own experts implementations: there HF's runs, and its backward
    (transformers::grouped_mm_fallback) does not trace on CPU - nothing of ours to test."""
    from mindspeed_hf.parallel import find_fused_experts

    if find_fused_experts(model) and compat.experts_registry() is None:
        pytest.skip("HF's own experts implementation runs on this release (ours needs transformers >= 5.10)")


def _step(family: str, compiled: bool):
    model = tiny_model(family)
    _skip_where_hf_runs_the_experts(model)
    model.train()
    ids = _ids()
    with torch.no_grad():  # transformers installs its output-capturing hooks on the first call, under a lock that
        model(input_ids=ids)  # Dynamo cannot enter (HF's own MoE models with output_router_logits fail the same way)
    forward = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    loss = forward(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


QUICK = ("qwen3", "qwen3_moe")  # the README's quick suite; every other family is in the slow run


@pytest.mark.parametrize("family", [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(FAMILY_CONFIGS)])
def test_a_compiled_training_step_equals_the_eager_one(family):
    mindspeed_hf.enable()
    torch._dynamo.reset()
    eager_loss, eager_grads = _step(family, compiled=False)
    loss, grads = _step(family, compiled=True)
    assert abs(loss.item() - eager_loss.item()) <= 1e-5
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("family", ["qwen3", pytest.param("qwen3_moe", marks=pytest.mark.slow),
                                    pytest.param("gemma2", marks=pytest.mark.slow)])
def test_a_compiled_forward_generates_the_same_tokens(family):
    mindspeed_hf.enable()
    torch._dynamo.reset()
    model = tiny_model(family).eval()
    _skip_where_hf_runs_the_experts(model)
    prompt = _ids()[:1]
    want = model.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="static")
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    got = model.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)


@pytest.mark.skipif(compat.experts_registry() is None, reason="the fused experts kernel needs transformers >= 5.10")
def test_a_new_routing_is_not_a_new_graph():
    mindspeed_hf.enable()
    torch._dynamo.reset()
    graphs, backend = _graph_counter()
    model = tiny_model("qwen3_moe").eval()
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    with torch.no_grad():
        for seed in range(3):  # three batches, three routings, one shape
            torch.testing.assert_close(compiled(input_ids=_ids(seed)).logits, model(input_ids=_ids(seed)).logits,
                                       atol=1e-5, rtol=0)
    assert len(graphs) == 1


def _graph_counter() -> tuple[list, Callable]:
    """A torch.compile backend that counts the graphs Dynamo builds (and runs them as traced)."""
    graphs = []

    def backend(gm, example_inputs):  # noqa: ARG001 - the backend signature
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def test_eager_forwards_between_compiled_calls_do_not_recompile():
    """transformers' generate compiles `model.__call__` and runs the prefill eagerly: an eager forward counts what
    ran and fills the package's memos, and the compiled graph must be guarded on neither (transformers'
    test_generate_compile_model_forward_fullgraph and test_static_cache_no_recompile_with_smaller_length failed on
    the counters)."""
    mindspeed_hf.enable()
    torch._dynamo.reset()
    graphs, backend = _graph_counter()
    model = tiny_model("qwen3").eval()
    compiled = torch.compile(model.__call__, fullgraph=True, backend=backend, dynamic=False)
    with torch.no_grad():
        model(input_ids=_ids(2))  # an eager forward first: the counters hold values when the graph is traced
        compat._NAMED.clear()  # and the memos are empty then, as in a process whose first forward is compiled
        for seed in range(2):
            got = compiled(input_ids=_ids(seed)).logits
            eager = model(input_ids=_ids(seed)).logits  # an eager forward in between: counters move, memos fill
            torch.testing.assert_close(got, eager, atol=1e-5, rtol=0)
    assert len(graphs) == 1
    assert mindspeed_hf.report(model)["ran"]["rms_norm"] > 0  # the eager forwards are still counted


@pytest.mark.skipif(compat.experts_registry() is None, reason="the fused experts kernel needs transformers >= 5.10")
def test_an_moe_forward_compiled_without_fullgraph_is_one_graph():
    """transformers' default CompileConfig (generate with a static cache) does not ask for fullgraph: there a
    data-dependent output shape (the experts' group sizes) would split the forward into pieces run eagerly. One graph,
    HF's values."""
    mindspeed_hf.enable()
    torch._dynamo.reset()
    graphs, backend = _graph_counter()
    model = tiny_model("qwen3_moe").eval()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=_ids()).logits, model(input_ids=_ids()).logits, atol=1e-5, rtol=0)
    assert len(graphs) == 1


def test_trainer_with_torch_compile_trains_as_eager(tmp_path, caplog):
    """Trainer's own torch_compile=True (accelerate compiles the model): the same losses as the eager accelerated
    run, and no "never ran" warning for kernels that ran inside the compiled graph."""
    from transformers import Trainer, TrainingArguments

    rows = [{"input_ids": r, "labels": r} for r in torch.randint(2, 120, (8, 12), generator=torch.Generator()
                                                                 .manual_seed(0)).tolist()]
    losses = {}
    for compiled in (False, True):
        mindspeed_hf.enable()
        torch._dynamo.reset()
        args = TrainingArguments(output_dir=str(tmp_path / str(compiled)), max_steps=2, per_device_train_batch_size=4,
                                 logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
                                 use_cpu=True, torch_compile=compiled, torch_compile_backend="aot_eager")
        trainer = Trainer(model=tiny_model("qwen3"), args=args, train_dataset=rows)
        with caplog.at_level("WARNING", logger="mindspeed_hf"):
            trainer.train()
        losses[compiled] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        mindspeed_hf.disable()
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)
    assert not [r for r in caplog.records if "never ran" in r.getMessage()]
