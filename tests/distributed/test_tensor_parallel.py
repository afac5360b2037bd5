"""Tensor parallelism under torchrun (gloo, CPU, fp32) against plain Hugging Face in one process.

tensor_worker.py: `two` (2 ranks, tp=2): tiny llama, qwen3 and qwen3_moe with mindspeed_hf enabled and sequence
parallelism on, llama without it, llama on an odd sequence (uneven shards) with a padding mask, qwen3 on the npu
path (the torch_npu stand-in), the vocab-parallel cross-entropy (alone, and chunked on the sharded lm_head), and
the one-line refusals; `four` (4 ranks): dp_shard=2 x tp=2 with FSDP2 over the dp sub-mesh.
Each model case trains 3 AdamW steps and compares its losses and first-step gradients (gathered from the shards)
with the unpatched model's in one process (HF's own loss), to 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from child_runs import run_worker

HERE = Path(__file__).resolve().parent
WORKER = HERE / "tensor_worker.py"
TOL = 1e-5
CASES = ["llama", "qwen3", "qwen3_moe", "llama_no_sp", "padded_odd", "npu"]
KERNELS = ("rms_norm", "rope", "swiglu", "attention", "fused_linear_cross_entropy")


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


@pytest.mark.parametrize("case", CASES)
def test_tp2_matches_one_process(two, case):
    r = two[case]
    _assert_parity(r)
    for name, (placement, share) in r["placements"].items():
        assert [placement, share] == list(_expected_placement(name)), name
    assert sum(share < 1 for _, share in r["placements"].values()) >= 14  # 7 projections x 2 layers at least


@pytest.mark.parametrize("case", CASES)
def test_kernels_ran_on_local_shards(two, case):
    r = two[case]
    assert r["attention"] == "mindspeed" and r["backend"] == ("npu" if case == "npu" else "torch")
    for ran in r["ran_per_rank"]:  # 3 steps x (2 layers, or 1 loss): every kernel ran on every rank
        assert all(ran[k] >= 3 for k in KERNELS), ran
        assert ran["experts"] == (6 if case == "qwen3_moe" else 0), ran
    seen = r["seen"]
    assert seen["dtensor_args"] == 0  # our kernels got plain tensors
    assert seen["attention_heads"] == [2]  # 4 heads / tp 2: the local heads
    # rank 0's norms on its sequence shard under sequence parallelism (12 / 2; 13 -> 7 + 6), the whole sequence
    # without it; Qwen3's per-head q_norm / k_norm run on [B, S, heads, D] (4-D: not listed)
    assert seen["norm_rows"] == {"llama_no_sp": [12], "padded_odd": [7]}.get(case, [6])


def test_vocab_parallel_cross_entropy(two):
    r = two["vocab_parallel"]
    assert r["loss_rel_diff"] <= 1e-6 and r["grad_diff"] <= TOL, r
    linear = r["linear"]  # chunked on the sharded lm_head, logits never gathered
    assert linear["loss_rel_diff"] <= 1e-6 and linear["hidden_grad_diff"] <= TOL, linear
    assert linear["weight_grad_diff"] <= TOL, linear


def test_errors_name_the_setting(two):
    e = two["errors"]
    assert e["heads"].startswith("parallel.tp=2 must divide the attention heads")
    assert e["heads"].endswith("valid choices: [1, 3]")
    assert e["tied"].startswith("parallel.tp=2: LlamaForCausalLM ties lm_head to the embeddings")
    assert e["heads_untouched"] and e["tied_untouched"]  # refused before any work
    assert all("\n" not in message for message in e.values() if isinstance(message, str))


def test_dp_shard2_x_tp2_with_fsdp2(four):
    r = four["dp_tp"]
    _assert_parity(r)
    layer = r["placements"]["model.layers.0.self_attn.q_proj.weight"]
    # FSDP2's dim-0 shard over dp, taken from inside tp's Shard(0): each rank holds a quarter
    assert layer == ["(_StridedShard(dim=0, sf=2), Shard(dim=0))", 0.25], layer
    assert r["ran"]["attention"] >= 6 and r["ran"]["fused_linear_cross_entropy"] == 3
