"""Tensor parallelism under torchrun (gloo, CPU, fp32) against plain Hugging Face in one process.

tensor_worker.py: `two` (2 ranks, tp=2): tiny llama, qwen3 and qwen3_moe with mindspeed_hf enabled and sequence
parallelism on, llama without it, llama on an odd sequence (uneven shards) with a padding mask, qwen3 on the npu
path (the torch_npu stand-in), the vocab-parallel cross-entropy (alone, and chunked on the sharded lm_head), and
the one-line refusals; `four` (4 ranks): dp_shard=2 x tp=2 with FSDP2 over the dp sub-mesh.
Each model case trains 3 AdamW steps and compares its losses and first-step gradients (gathered from the shards)
with the unpatched model's in one process (HF's own loss), to 1e-5.

tensor_trainer_worker.py: a plain transformers.Trainer script, unchanged, with `parallel: {tp: 2}` only from
MINDSPEED_HF_CONFIG (2 ranks: tp 2; 4 ranks: dp_shard 2 x tp 2, FSDP2 over dp only), against the same script as
plain HF in one process on the same global batches: logged losses, grad norms, final parameters, and the directory
save_model writes (from_pretrained reloads it); a LoRA adapter under tp=2 against one-process LoRA;
a tp=2 checkpoint resumed as dp_shard=2.
Single-process: the plan, and the refusals as one line.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers
from child_runs import run_trainer_worker, run_worker

HERE = Path(__file__).resolve().parent
WORKER = HERE / "tensor_worker.py"
TRAINER_WORKER = HERE / "tensor_trainer_worker.py"
TOL = 1e-5
TP_RELEASE = int(transformers.__version__.split(".")[0]) >= 5  # 4.57: refused (tested last)
CASES = ["llama", "qwen3", "qwen3_moe", "llama_no_sp", "padded_odd", "npu", "qwen3_moe_npu"]
KERNELS = ("rms_norm", "rope", "swiglu", "attention", "fused_linear_cross_entropy")
needs_tp = pytest.mark.skipif(not TP_RELEASE, reason="tensor parallelism needs transformers >= 5 (refused on 4.57)")


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    return run_worker(WORKER, tmp_path_factory.mktemp("tp") / "two.json", "two", nproc=2)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict:
    return run_worker(WORKER, tmp_path_factory.mktemp("tp") / "four.json", "four", nproc=4)


def _assert_parity(r: dict) -> None:
    assert len(r["losses"]) == len(r["ref_losses"]) == 3, r
    assert r["loss_max_diff"] <= TOL, r
    assert r["same_names"] and r["grad_max_diff"] <= TOL, r


def _expected_placement(name: str) -> tuple[str, float]:
    """(placements, local share) tp=2 gives each parameter."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return "(Shard(dim=0),)", 0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "(Shard(dim=1),)", 0.5
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # vocab-parallel
        return "(Shard(dim=0),)", 0.5
    if name.endswith("experts.gate_up_proj"):  # the gate and up halves of every expert's intermediate dim
        return "(_StridedShard(dim=1, sf=2),)", 0.5
    if name.endswith("experts.down_proj"):
        return "(Shard(dim=2),)", 0.5
    return "(Replicate(),)", 1.0  # norms, router


@needs_tp
@pytest.mark.parametrize("case", CASES)
def test_tp2_matches_one_process(two, case):
    r = two[case]
    _assert_parity(r)
    for name, (placement, share) in r["placements"].items():
        assert [placement, share] == list(_expected_placement(name)), name
    assert sum(share < 1 for _, share in r["placements"].values()) >= 14  # 7 projections x 2 layers at least


@needs_tp
@pytest.mark.parametrize("case", CASES)
def test_kernels_ran_on_local_shards(two, case):
    r = two[case]
    assert r["attention"] == "mindspeed" and r["backend"] == ("npu" if case.endswith("npu") else "torch")
    for ran in r["ran_per_rank"]:  # 3 steps x (2 layers, or 1 loss): every kernel ran on every rank
        # qwen3_moe's MLPs are all experts: its swiglu runs inside the experts kernel (npu) or HF's grouped_mm (torch)
        assert all(ran[k] >= 3 for k in KERNELS if not (k == "swiglu" and case == "qwen3_moe")), ran
        # the experts kernel on the npu path; the torch backend runs transformers' own grouped_mm (same algorithm)
        assert ran["experts"] == (6 if case == "qwen3_moe_npu" else 0), ran
        # every loss scored on the rank's vocab slice (ops/vocab_parallel.py), the [chunk, vocab] logits never gathered
        assert ran.get("vocab_parallel_cross_entropy") == ran["fused_linear_cross_entropy"], ran
    seen = r["seen"]
    assert seen["dtensor_args"] == 0  # our kernels got plain tensors
    assert seen["attention_heads"] == [2]  # 4 heads / tp 2: the local heads
    # rank 0's norms on its sequence shard under sequence parallelism (12 / 2; 13 -> 7 + 6), the whole sequence
    # without it; Qwen3's per-head q_norm / k_norm run on [B, S, heads, D] (4-D: not listed)
    assert seen["norm_rows"] == {"llama_no_sp": [12], "padded_odd": [7]}.get(case, [6])


@needs_tp
def test_vocab_parallel_cross_entropy(two):
    r = two["vocab_parallel"]
    assert r["loss_rel_diff"] <= 1e-6 and r["grad_diff"] <= TOL, r
    linear = r["linear"]  # chunked on the sharded lm_head, logits never gathered
    assert linear["loss_rel_diff"] <= 1e-6 and linear["hidden_grad_diff"] <= TOL, linear
    assert linear["weight_grad_diff"] <= TOL, linear


@needs_tp
def test_errors_name_the_setting(two):
    e = two["errors"]
    assert e["heads"].startswith("parallel.tp=2 must divide the attention heads")
    assert e["heads"].endswith("valid choices: [1, 3]")
    assert e["tied"].startswith("parallel.tp=2: LlamaForCausalLM ties lm_head to the embeddings")
    assert e["heads_untouched"] and e["tied_untouched"]  # refused before any work
    assert all("\n" not in message for message in e.values() if isinstance(message, str))


@needs_tp
def test_dp_shard2_x_tp2_with_fsdp2(four):
    r = four["dp_tp"]
    _assert_parity(r)
    layer = r["placements"]["model.layers.0.self_attn.q_proj.weight"]
    # FSDP2's dim-0 shard over dp, taken from inside tp's Shard(0): each rank holds a quarter
    assert layer == ["(_StridedShard(dim=0, sf=2), Shard(dim=0))", 0.25], layer
    assert r["ran"]["attention"] >= 6 and r["ran"]["fused_linear_cross_entropy"] == 3
    assert r["ran"].get("vocab_parallel_cross_entropy") == 3, r["ran"]  # FSDP2's unsharded head: the tp slice


# ---------------------------------------------------------------------------------------------- plain Trainer
def _trainer_run(root: Path, name: str, *args: str, config: str | None = None, nproc: int = 2) -> dict:
    return run_trainer_worker(TRAINER_WORKER, root, name, *args, config=config, nproc=nproc)


@pytest.fixture(scope="module")
def trainer_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp_trainer")


def _same_as(run: dict, ref: dict) -> None:
    from transformers import AutoModelForCausalLM

    for key in ("losses", "grad_norms"):
        assert len(run[key]) == len(ref[key]) == 3
        assert max(abs(a - b) for a, b in zip(run[key], ref[key])) <= TOL, (key, run[key], ref[key])
    want = ref["params"]
    assert run["params"].keys() == want.keys()
    assert max((run["params"][n] - want[n]).abs().max().item() for n in want) <= TOL
    reloaded = AutoModelForCausalLM.from_pretrained(run["saved"]).state_dict()  # the consolidated save
    assert reloaded.keys() == want.keys()
    assert max((reloaded[n] - want[n]).abs().max().item() for n in want) <= TOL


@needs_tp
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_plain_trainer_with_tp_from_the_config_equals_one_process(trainer_root, family):
    """tp=2 from MINDSPEED_HF_CONFIG alone, kernels on: 3 clipped SGD steps equal the plain-HF Trainer in one process
    (losses, grad norms, parameters, the saved directory); each rank holds half of every sharded weight."""
    ref = _trainer_run(trainer_root, f"reference_{family}", "reference", "--family", family)
    run = _trainer_run(trainer_root, f"tp2_{family}", "tp", "--family", family, config="parallel: {tp: 2}\n")
    assert (run["attention"], run["tp"], run["dp"]) == ("mindspeed", 2, 1)
    for name, (placement, share) in run["shares"].items():
        assert [placement, share] == list(_expected_placement(name)), name
    assert len(run["shares"]) == len(run["params"])  # every parameter is a DTensor on the tp mesh
    _same_as(run, ref)


@needs_tp
def test_plain_trainer_dp_shard2_x_tp2(trainer_root):
    """4 ranks, `parallel: {tp: 2}`: dp_shard fills 2, FSDP2 over the dp ranks only (2-D DTensors), each dp rank's
    batch half shared by its tp pair."""
    ref = _trainer_run(trainer_root, "reference_llama4", "reference", "--family", "llama")
    run = _trainer_run(trainer_root, "dp2_tp2_llama", "tp", "--family", "llama", "--dp", "2",
                       config="parallel: {tp: 2}\n", nproc=4)
    assert (run["tp"], run["dp"]) == (2, 2)
    assert run["shares"]["model.layers.0.self_attn.q_proj.weight"] == ["(_StridedShard(dim=0, sf=2), Shard(dim=0))",
                                                                      0.25]
    _same_as(run, ref)


@needs_tp
@pytest.mark.parametrize(("memory", "wrapped"), [
    ("recompute: full", {"recompute": 2, "selective": 0, "offload": 0}),
    ("offload_activations: true", {"recompute": 0, "selective": 0, "offload": 2}),
    ("recompute: selective", {"recompute": 0, "selective": 4, "offload": 0}),  # attention_core and mlp
    ("recompute: selective, recompute_modules: [self_attn, mlp, norms], offload_activations: true",
     {"recompute": 0, "selective": 8, "offload": 2}),
], ids=["full", "offload", "selective", "selective_all_parts_offload"])
def test_plain_trainer_tp2_with_recompute_or_offload(trainer_root, memory, wrapped, request):
    """tp=2 (sequence parallel) with the memory settings on: whole decoder layers recomputed in backward on their
    local shards; selective recompute of the layers' parts (the norms run on sequence shards, the attention and MLP
    on gathered inputs: each recomputed on exactly the inputs its forward got); what the layers save offloaded. The
    same 3 steps as one plain-HF process."""
    ref = _trainer_run(trainer_root, "reference_llama", "reference", "--family", "llama")
    run = _trainer_run(trainer_root, f"tp2_{request.node.callspec.id}", "tp", "--family", "llama",
                       config=f"parallel: {{tp: 2}}\nmemory: {{{memory}}}\n")
    assert run["tp"] == 2 and run["memory"] == wrapped, run["memory"]
    _same_as(run, ref)


@needs_tp
def test_plain_trainer_lora_under_tp2(trainer_root):
    """A PEFT LoRA adapter on every projection under tp=2: A replicated / B column-sharded on q, k, v, gate, up; A
    row-sharded / B replicated on o, down. Losses, grad norms and every parameter equal one process; save_model
    writes the adapter, equal to the one-process adapter."""
    from safetensors.torch import load_file

    ref = _trainer_run(trainer_root, "reference_lora", "reference", "--family", "qwen3", "--lora")
    run = _trainer_run(trainer_root, "tp2_lora", "tp", "--family", "qwen3", "--lora", config="parallel: {tp: 2}\n")
    assert (run["attention"], run["tp"]) == ("mindspeed", 2)
    shares = run["shares"]
    layer = "base_model.model.model.layers.0"
    assert shares[f"{layer}.self_attn.q_proj.lora_B.default.weight"] == ["(Shard(dim=0),)", 0.5]
    assert shares[f"{layer}.self_attn.q_proj.lora_A.default.weight"] == ["(Replicate(),)", 1.0]
    assert shares[f"{layer}.mlp.down_proj.lora_A.default.weight"] == ["(Shard(dim=1),)", 0.5]
    assert shares[f"{layer}.mlp.down_proj.lora_B.default.weight"] == ["(Replicate(),)", 1.0]
    assert shares[f"{layer}.mlp.down_proj.base_layer.weight"] == ["(Shard(dim=1),)", 0.5]
    for key in ("losses", "grad_norms"):
        assert max(abs(a - b) for a, b in zip(run[key], ref[key], strict=True)) <= TOL, (key, run[key], ref[key])
    assert run["params"].keys() == ref["params"].keys()
    assert max((run["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"]) <= TOL
    saved, want = (load_file(str(Path(r["saved"]) / "adapter_model.safetensors")) for r in (run, ref))
    assert saved.keys() == want.keys() and len(want) == 2 * 7 * 2  # A and B of 7 projections, 2 layers
    assert max((saved[n] - want[n]).abs().max().item() for n in want) <= TOL


@needs_tp
def test_checkpoint_of_tp2_resumes_onto_dp_shard2(trainer_root):
    """A Trainer checkpoint written under tp=2 (DCP shards of the model and the SGD momentum) resumed on the same 2
    ranks laid out as dp_shard=2 (FSDP2): the resumed step's loss and the final parameters equal 3 uninterrupted
    steps in one process."""
    ref = _trainer_run(trainer_root, "reference_momentum", "reference", "--family", "llama", "--momentum")
    _trainer_run(trainer_root, "tp2_saves", "tp", "--family", "llama", "--momentum", "--save_steps", "2",
                 config="parallel: {tp: 2}\n")
    checkpoint = trainer_root / "tp2_saves.json.dir" / "checkpoint-2"
    run = _trainer_run(trainer_root, "dp2_resumes", "tp", "--family", "llama", "--momentum", "--dp", "2",
                       "--resume", str(checkpoint), config="parallel: {dp_shard: 2}\n")
    assert (run["tp"], run["dp"]) == (1, 2)
    assert len(run["losses"]) == 1 and abs(run["losses"][0] - ref["losses"][2]) <= TOL, (run["losses"], ref["losses"])
    assert max((run["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"]) <= TOL


# ---------------------------------------------------------------------------------------------- plan and refusals
def _plan(world: int, env: dict | None = None, **parallel):
    from mindspeed_hf.config import resolve
    from mindspeed_hf.runtime import resolve_plan

    env = env or {}
    return resolve_plan(None, resolve(yaml_source={"parallel": parallel}, env=env), env=env, world_size=world)


@needs_tp
def test_plan_carries_tp():
    plan = _plan(2, tp=2)
    assert (plan.tp, plan.dp_shard, plan.same_batch) == (2, 1, 2)
    assert plan.size_sources == {"parallel.tp": "config dict"} and plan.dims.tp == 2
    plan = _plan(8, tp=2, dp_replicate=2)
    assert (plan.dp_replicate, plan.dp_shard, plan.tp) == (2, 2, 2)
    # accelerate's own tp size (with its parallelism switch) is ours to build, as its cp
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2"}
    assert _plan(2, env=env).tp == 2
    assert _plan(1) is None


def _one_line(make) -> str:
    with pytest.raises(ValueError) as caught:
        make()
    assert "\n" not in str(caught.value), str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("sizes,fragment", [
    ({"tp": 2, "cp": 2}, "tp=2 with cp=2: tensor parallelism together with context parallelism is not supported yet"),
    ({"tp": 2, "ep": 2}, "tp=2 with ep=2: tensor parallelism together with expert parallelism is not supported yet"),
    ({"tp": 3}, "dp_replicate * cp * tp = 1 * 1 * 3 = 3 does not divide world_size=4"),
])
@needs_tp
def test_unsupported_combinations_are_refused_in_one_line(sizes, fragment):
    if "ep" in sizes:
        from mindspeed_hf.releases.supported import check_ep_release

        try:
            check_ep_release(2)
        except ValueError:
            pytest.skip("transformers without fused experts refuses ep > 1 first")
    line = _one_line(lambda: _plan(4, **sizes))
    assert fragment in line and line.startswith("mindspeed_hf parallel sizes from parallel.")


@needs_tp
def test_tp_with_deepspeed_is_refused():
    from mindspeed_hf.config import Layer, resolve
    from mindspeed_hf.trainers import deepspeed as ds

    resolved = resolve([Layer("test", {"parallel.tp": 2})])
    line = _one_line(lambda: ds.check_exclusive(SimpleNamespace(deepspeed="ds.json", fsdp=None), resolved, env={}))
    assert "DeepSpeed" in line and "tensor parallelism (parallel.tp=2 (test))" in line


@needs_tp
def test_the_tp_step_refuses_a_model_it_cannot_or_must_not_shard():
    """Tied embeddings (check_tensor_parallel) and a model already tensor-parallel (transformers' tp_plan="auto"
    sets _tp_size): refused in one line before any mesh is touched."""
    from tiny_models import tiny_model

    from mindspeed_hf.config import MindSpeedConfig
    from mindspeed_hf.parallel.parallelize import ParallelizeOptions, apply_tp

    dims = SimpleNamespace(tp=2, tp_enabled=True, get_mesh=lambda name: pytest.fail("no mesh before the checks"))
    tied = tiny_model("llama", tie_word_embeddings=True)
    line = _one_line(lambda: apply_tp(tied, dims, MindSpeedConfig(), ParallelizeOptions()))
    assert line.startswith("parallel.tp=2: LlamaForCausalLM ties lm_head to the embeddings")
    loaded = tiny_model("qwen3")
    loaded._tp_size = 2  # what from_pretrained(tp_plan="auto") leaves
    line = _one_line(lambda: apply_tp(loaded, dims, MindSpeedConfig(), ParallelizeOptions()))
    assert "tensor-parallel already (transformers already sharded it" in line and "sharding it twice" in line



@pytest.mark.skipif(TP_RELEASE, reason="refused on transformers < 5 only")
def test_tp_on_transformers_4_is_refused_in_one_line():
    from tiny_models import tiny_model

    from mindspeed_hf.parallel.tensor import check_tensor_parallel

    with pytest.raises(ValueError, match=r"^parallel.tp=2: tensor parallelism needs transformers >= 5.0 \(its tp "
                                         r"plans\), transformers 4\.57\.\d+ is installed; valid choices: "
                                         r"parallel.tp=1$"):
        check_tensor_parallel(tiny_model("qwen3", tie_word_embeddings=False), 2)
