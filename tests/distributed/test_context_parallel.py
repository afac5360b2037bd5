"""Context parallelism wired into HF models (parallelize's cp step + split_cp_batch) against plain HF, one process.

One torchrun launch of context_parallel_worker.py (gloo, 4 ranks, fp32) trains tiny llama / qwen3 / mistral
(sliding window) / qwen3_moe a few steps under cp=2 with dp_shard=2 (FSDP2 over dp_shard x cp, the data split over
dp) and cp=4: ring, ring with zigzag, Ulysses, Ulysses with fewer kv heads than its size, the hybrid 2 x 2, on padded
and packed batches (documents crossing the splits), LoRA, gradient accumulation 2 (num_items_in_batch given), full
and selective recompute, cp 2 x ep 2 on qwen3_moe, and the NPU path (stand-in torch_npu, fused-op calls counted on
every rank); every step's loss and every gradient equal HF's within 1e-5. With the router's aux loss on, cp trains
HF's loss with the aux term per cp slice, averaged over the cp ranks (HF's own load_balancing_loss_func on each
slice's router logits): equal within 1e-5 too.
A plain Trainer script with cp from MINDSPEED_HF_CONFIG (context_trainer_worker.py: dp_shard 2 x cp 2 with
DataCollatorWithFlattening, gradient accumulation 2, kernels on) equals the single-process plain-HF Trainer.
Single-process tests: the settings and their one-line errors, the split batch (global label shift, loss scaling,
left padding as its own segment), and the refusals (heads, softcapping, dropout, unsplit batches).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from child_runs import child_env, run_or_fail, run_trainer_worker, torchrun
from tiny_models import tiny_model

from mindspeed_hf.config import ParallelConfig
from mindspeed_hf.parallel import ParallelDims
from mindspeed_hf.parallel.context import ContextParallel, check_context_parallel, split_cp_batch
from mindspeed_hf.parallel.context.model import cp_attention_forward
from mindspeed_hf.releases.supported import EP_MIN_TRANSFORMERS, installed

HERE = Path(__file__).resolve().parent
WORKER = HERE / "context_parallel_worker.py"
TRAINER_WORKER = HERE / "context_trainer_worker.py"
TOL = 1e-5
CASES = [
    "llama_ring2_padded", "llama_ring2_zigzag_packed", "qwen3_ring2_zigzag_padded", "qwen3_ulysses2_packed",
    "mistral_window_ring2_zigzag_packed", "mistral_window_ulysses2_padded", "llama_hybrid2x2_zigzag_packed",
    "qwen3_ulysses4_gqa_padded", "qwen3_ring4_contig_packed", "llama_ring2_lora_accum2_full_recompute",
    "qwen3_hybrid2x2_accum2_selective_recompute", "llama_hsdp2_ring2_zigzag_packed", "qwen3_moe_ring2_zigzag_packed",
    "llama_npu_ring2_zigzag_packed",
]
# cp x ep (transformers >= EP_MIN_TRANSFORMERS: fused experts); the router's aux loss on, per cp slice (README)
EP_CASES = ["qwen3_moe_ring2_ep2_padded", "qwen3_moe_ulysses2_ep2_packed", "qwen3_moe_aux_per_slice_ring2_ep2_full"]
EP_READY = installed("transformers").major >= int(EP_MIN_TRANSFORMERS.split(".")[0])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp_model") / "report.json"
    run_or_fail(torchrun(str(WORKER), "--out", str(out), nproc=4), child_env(), "context_parallel_worker (nproc=4)")
    return json.loads(out.read_text())


def test_losses_and_gradients_equal_one_process(report):
    assert sorted(report) == sorted(CASES + (EP_CASES if EP_READY else []))
    bad = {name: diffs for name, diffs in report.items() if not (diffs["loss"] <= TOL and diffs["grad"] <= TOL)}
    assert not bad, bad


def test_npu_path_runs_the_fused_ops_on_every_rank(report):
    """MINDSPEED_HF_BACKEND=npu (stand-in): the ring's blocks ran npu_fusion_attention forward (softmax_max /
    softmax_sum taken as the lse) and npu_fusion_attention_grad backward on each of the 4 ranks."""
    calls = report["llama_npu_ring2_zigzag_packed"]["npu_calls"]
    assert len(calls) == 4
    for rank in calls:
        assert rank.get("npu_fusion_attention", 0) > 0 and rank.get("npu_fusion_attention_grad", 0) > 0, calls


# ---------------------------------------------------------------------------------------- settings and errors


def test_settings_validate_in_one_line():
    assert ParallelConfig(cp=4, cp_ulysses=2).cp_zigzag is True
    with pytest.raises(ValueError, match=r"cp_ulysses=3 must divide parallel.cp=4; valid choices: \[1, 2, 4\]"):
        ParallelConfig(cp=4, cp_ulysses=3)
    with pytest.raises(ValueError, match="parallel.cp_ulysses=0 must be >= 1"):
        ParallelConfig(cp=2, cp_ulysses=0)
    with pytest.raises(ValueError, match=r"cp_ulysses=3 must divide cp=2"):
        ParallelDims(cp=2, cp_ulysses=3, world_size=4)
    with pytest.raises(ValueError, match=r"dp_replicate \* cp = 1 \* 3 = 3 does not divide world_size=4"):
        ParallelDims(cp=3, world_size=4)


def test_model_checks_name_the_problem():
    llama = tiny_model("llama")  # 4 heads, 2 kv heads
    check_context_parallel(llama, 4)  # kv heads repeated up to the Ulysses size
    with pytest.raises(ValueError, match=r"parallel.cp_ulysses=3 must divide the number of attention heads 4"):
        check_context_parallel(llama, 3)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        check_context_parallel(tiny_model("gemma2"), 1)
    with pytest.raises(ValueError, match="attention_dropout=0.1 must be 0"):
        check_context_parallel(tiny_model("llama", attention_dropout=0.1), 1)
    from tiny_vlms import tiny_vlm  # split inside the model, after the merge (test_context_parallel_vlm.py)

    vlm = tiny_vlm("qwen2_vl")
    check_context_parallel(vlm, 2, vision=True)
    del vlm.model.language_model  # nowhere to split after the merge: refused before any work
    with pytest.raises(ValueError, match=r"parallel.cp: qwen2_vl has no `model.language_model` to split"):
        check_context_parallel(vlm, 1)


def _ctx(cp: int = 2, rank: int = 0, zigzag: bool = True) -> ContextParallel:
    return ContextParallel(cp, 1, zigzag, rank, None, None)


def test_split_batch_shifts_globally_and_scales_the_loss():
    ids = torch.arange(1, 10).unsqueeze(0)  # 9 tokens -> padded to 12 (2 * cp * 3 with zigzag)
    labels = ids.clone()
    labels[0, 4] = -100
    parts = [split_cp_batch({"input_ids": ids, "labels": labels}, _ctx(rank=r)) for r in range(2)]
    # zigzag: rank 0 holds chunks 0 and 3 (tokens 0-2, 9-11), rank 1 chunks 1 and 2 (tokens 3-8)
    assert parts[0]["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0]]
    assert parts[1]["position_ids"].tolist() == [[3, 4, 5, 6, 7, 8]]
    assert parts[1]["shift_labels"].tolist() == [[-100, 6, 7, 8, 9, -100]]  # token 3 predicts the masked label
    assert parts[0]["labels"] is parts[0]["shift_labels"] and parts[0]["use_cache"] is False
    assert parts[0]["num_items_in_batch"] == 7 / 2  # 8 shifted labels, one masked; each rank carries cp x share
    assert parts[0]["segment_ids"] is None  # one unpadded document: causality alone
    given = split_cp_batch({"input_ids": ids, "labels": labels}, _ctx(), num_items_in_batch=20)
    assert given["num_items_in_batch"] == 10


def test_split_batch_left_padding_becomes_a_hidden_segment():
    ids = torch.arange(1, 9).unsqueeze(0)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    local = split_cp_batch({"input_ids": ids, "attention_mask": mask}, _ctx(zigzag=False))
    assert local["segment_ids"].tolist() == [[-2, -2, 0, 0]] and "attention_mask" not in local
    right = split_cp_batch({"input_ids": ids, "attention_mask": mask.flip(1)}, _ctx(zigzag=False))
    assert right["segment_ids"] is None  # right padding: causal tokens never see it
    with pytest.raises(ValueError, match="inputs_embeds is not split"):
        split_cp_batch({"inputs_embeds": torch.zeros(1, 8, 4)}, _ctx())
    with pytest.raises(ValueError, match="shorter than 2 \\* cp=4"):
        split_cp_batch({"input_ids": ids[:, :3]}, _ctx())


def test_attention_refuses_an_unsplit_batch():
    module = torch.nn.Module()
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="prepared by parallelize"):
        cp_attention_forward(module, q, q, q, None)
    module._mindspeed_cp = _ctx()
    with pytest.raises(ValueError, match="parallel.cp=2: the model got a batch that was not split"):
        cp_attention_forward(module, q, q, q, None, position_ids=None)


# ------------------------------------------------------------------------------- accelerate's cp settings


def _cp_plan(args=None, env: dict | None = None, world: int = 4):
    from mindspeed_hf.config import resolve
    from mindspeed_hf.runtime import resolve_plan
    from mindspeed_hf.trainers.arguments import hf_fsdp_layer

    env = env or {}
    resolved = resolve([hf_fsdp_layer(args)] if args is not None else [], env=env)
    return resolved, resolve_plan(args, resolved, env=env, world_size=world)


def test_accelerate_cp_size_maps_to_parallel_cp(tmp_path):
    """PARALLELISM_CONFIG_CP_SIZE (accelerate launch, with or without its FSDP2 switches) and TrainingArguments'
    parallelism_config.cp_size become parallel.cp, and the Trainer plan builds the mesh dp_shard 2 x cp 2 on 4."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments

    sizes = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"}
    fsdp2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    for env in (sizes, {**sizes, **fsdp2}):
        resolved, plan = _cp_plan(env=env)
        assert resolved.config.parallel.cp == 2 and resolved.describe("parallel.cp").startswith(
            "PARALLELISM_CONFIG_CP_SIZE=2 (accelerate")
        assert (plan.cp, plan.dp_shard) == (2, 2)  # dp_shard fills the world
    assert _cp_plan(env={**sizes, "PARALLELISM_CONFIG_CP_SIZE": "1"})[1] is None  # cp 1 alone: accelerate's
    assert _cp_plan(env={"PARALLELISM_CONFIG_CP_SIZE": "2"})[1] is None  # accelerate would not read it either
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=2))
    resolved, plan = _cp_plan(args)
    assert resolved.describe("parallel.cp") == ("parallelism_config.cp_size=2 "
                                                "(TrainingArguments (fsdp_config / parallelism_config))")
    assert (plan.cp, plan.dp_shard) == (2, 2)
    with pytest.raises(ValueError, match=r"parallelism_config.cp_size=2 .*must equal world_size=3"):
        _cp_plan(args, world=3)


def test_compute_metrics_under_cp_is_refused_at_init(tmp_path):
    """A Trainer that will evaluate with compute_metrics under cp is refused in one line when it is built (its
    predictions would be each rank's sequence slices); the evaluation loss alone, cp 1, or no evaluation pass."""
    from types import SimpleNamespace

    from transformers import TrainingArguments

    from mindspeed_hf.runtime import Run, attach
    from mindspeed_hf.trainers.context import check_metrics_at_init

    sizes = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"}

    def trainer(cp_env: dict, metrics: bool = True, **args):
        resolved, plan = _cp_plan(env=cp_env)
        targs = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **args)
        t = SimpleNamespace(args=targs, compute_metrics=(lambda p: {}) if metrics else None)
        attach(t, Run(args=targs, resolved=resolved, plan=plan))
        return t

    with pytest.raises(ValueError, match=r"^parallel.cp=2: Trainer predictions .* valid choices: ") as error:
        check_metrics_at_init(trainer(sizes, eval_strategy="steps", eval_steps=1))
    assert "\n" not in str(error.value)
    check_metrics_at_init(trainer(sizes, metrics=False, eval_strategy="steps", eval_steps=1))
    check_metrics_at_init(trainer(sizes, eval_strategy="steps", eval_steps=1, prediction_loss_only=True))
    check_metrics_at_init(trainer(sizes))  # never evaluates
    check_metrics_at_init(trainer({}, eval_strategy="steps", eval_steps=1))  # no cp


# ------------------------------------------------------------------------------------------ plain Trainer


def _trainer_run(root: Path, name: str, *args: str, config: str | None = None, nproc: int = 4) -> dict:
    return run_trainer_worker(TRAINER_WORKER, root, name, *args, config=config, nproc=nproc)


@pytest.fixture(scope="module")
def trainer_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cp_trainer")


@pytest.fixture(scope="module")
def trainer_reference(trainer_root) -> dict:
    return _trainer_run(trainer_root, "reference", "reference", "--packed", "--ga", "2")


@pytest.mark.parametrize(("name", "config", "args", "cp", "dp"), [
    # dp_shard 2 x cp 2 (ring, zigzag), DataCollatorWithFlattening (packed rows, documents crossing the cp split),
    # gradient accumulation 2: the loader splits over dp only
    ("dp2_cp2_packed_ga2", "parallel: {cp: 2}\n", ("cp", "--dp", "2", "--ga", "2", "--packed"), 2, 2),
])
def test_plain_trainer_with_cp_from_the_config_equals_one_process(trainer_root, trainer_reference, name, config,
                                                                  args, cp, dp):
    """A plain Trainer script, kernels on, MINDSPEED_HF_CONFIG sets cp: logged losses, grad norms and the final
    parameters after 3 clipped SGD steps, and then `trainer.evaluate`'s loss on held-out rows (split over cp too),
    equal the single-process plain-HF Trainer on the same global batches (padding-free packed rows: each micro-batch
    is one row of several documents)."""
    run = _trainer_run(trainer_root, name, *args, config=config)
    assert (run["attention"], run["cp"], run["dp"]) == ("mindspeed_cp", cp, dp)
    for key in ("losses", "grad_norms"):
        assert len(run[key]) == len(trainer_reference[key]) == 3
        assert max(abs(a - b) for a, b in zip(run[key], trainer_reference[key])) <= TOL, key
    want = trainer_reference["params"]
    assert run["params"].keys() == want.keys()
    assert max((run["params"][n] - want[n]).abs().max().item() for n in want) <= TOL
    assert abs(run["eval_loss"] - trainer_reference["eval_loss"]) <= TOL, (run["eval_loss"], trainer_reference)
    assert trainer_reference["predict_error"] is None
    error = run["predict_error"]  # predictions would be each rank's slices: refused before the loop runs
    assert error.startswith(f"parallel.cp={cp}: Trainer predictions") and "valid choices" in error and "\n" not in error
