"""Expert parallelism under torchrun (gloo, CPU, fp32) against plain Hugging Face in one process.

Launches (expert_worker.py): `two` (2 ranks: every MoE family of tiny_models.py EP applies to at ep=2 (qwen3_moe,
mixtral, qwen2_moe, olmoe, deepseek_v3, glm4_moe, ernie4_5_moe, the hybrid qwen3_next and qwen3_5_moe_text; gpt_oss's
refusal), the NPU path (stand-in, ops
counted), a model loaded with transformers' own EP adopted (and the refusals), gradient accumulation 2 with selective
recompute of the MoE block (backward reruns the token exchange), DCP resume into ep=2 and ep=1, a forced
imbalanced router, a rank that receives no token, LoRA on the attention and on the expert weights themselves (PEFT
target_parameters, against PEFT's own single-process path) with an adapter-only save, router logits / aux loss,
the one-line errors), `four` (4 ranks: dp_shard=4 x ep=2, so efsdp=2, HSDP 2 x 2 with ep=2 and gradient
accumulation, LoRA on the experts), and a plain Trainer with EP from MINDSPEED_HF_CONFIG (kernels on), and one on a
model loaded with transformers' own EP (adopted), beside their single-process plain-HF reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from child_runs import child_env, run_worker

from mindspeed_hf.config import ParallelConfig
from mindspeed_hf.releases.supported import EP_MIN_TRANSFORMERS, installed

HERE = Path(__file__).resolve().parent
WORKER = HERE / "expert_worker.py"
TOL = 1e-5
OLD_TRANSFORMERS = installed("transformers").major < int(EP_MIN_TRANSFORMERS.split(".")[0])
needs_fused = pytest.mark.skipif(OLD_TRANSFORMERS, reason=f"expert parallelism needs transformers >= "
                                                          f"{EP_MIN_TRANSFORMERS} (fused experts modules)")


def _launch(scenario: str, root: Path, nproc: int = 2, **env: str) -> dict:
    nproc = 0 if scenario == "trainer_ref" else nproc
    return run_worker(WORKER, root / f"{scenario}.json", scenario, nproc=nproc, env=child_env(**env))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module")
def two(root) -> dict:
    return _launch("two", root)


@pytest.fixture(scope="module")
def four(root) -> dict:
    return _launch("four", root, nproc=4)


def _assert_parity(r: dict) -> None:
    assert len(r["losses"]) == len(r["ref_losses"]) > 0
    for got, want in zip(r["losses"] + r["norms"], r["ref_losses"] + r["ref_norms"]):
        assert abs(got - want) <= TOL, r
    assert r["same_grads"] and r["grad_max_diff"] <= TOL, r  # the expert-gradient scale: AdamW alone is blind to it
    assert r["same_names"] and r["param_max_diff"] <= TOL, r


@needs_fused
@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe",
                                  "ernie4_5_moe", "qwen3_next", "qwen3_5_moe_text", "npu", "accum", "imbalanced",
                                  "zero_rank", "lora", "lora_experts"])
def test_ep2_matches_one_process(two, case):
    r = two[case]
    _assert_parity(r)
    assert r["dims"] == [1, 2, 2, 1]  # dp_replicate, dp_shard, ep, efsdp
    assert r["expert_placements"].endswith("Shard(dim=0))")
    assert sum(r["local_rows"]) == 4 * 12 * 2  # every (token, top-k slot) reached one rank: global batch x k
    if case == "zero_rank":
        assert r["local_rows"][1] == 0  # rank 1's experts received nothing, and backward still ran
    if case == "imbalanced":
        assert min(r["local_rows"]) * 2 < max(r["local_rows"])
    if case == "npu":  # the device's grouped matmul and token permute / unpermute ran on every rank
        assert "npu_standin" in r["torch_npu"]
        for calls in r["npu_calls"]:
            assert min(calls.values()) > 0, r["npu_calls"]


@needs_fused
@pytest.mark.parametrize("case", ["efsdp2", "hsdp", "lora_experts"])
def test_ep_on_four_ranks(four, case):
    r = four[case]
    _assert_parity(r)
    assert r["dims"] == ([2, 2, 2, 1] if case == "hsdp" else [1, 4, 2, 2])
    assert r["local_experts"] == (2 if case == "hsdp" else 1)  # 4 experts / ep 2, then / efsdp


@needs_fused
def test_router_logits_and_aux_loss_are_hf(two):
    for rank in two["router"]["per_rank"]:
        assert rank["aux_nonzero"] and rank["n_router_logits"] == [2, 2]
        assert rank["loss"] <= TOL and rank["aux_loss"] <= TOL and rank["router_logits"] == 0.0


@needs_fused
def test_errors_name_the_setting(two):
    e = two["errors"]
    assert e["dense"].startswith("parallel.ep=2: Qwen3ForCausalLM has no fused experts module")
    assert "must divide the number of experts (3" in e["indivisible"] and "valid choices: [1, 3]" in e["indivisible"]
    assert e["gpt_oss"].startswith("parallel.ep=2: experts model.layers.0.mlp.experts (GptOssExperts) have an "
                                   "unsupported layout (has_bias=True)")
    assert all("\n" not in message for message in e.values())


@needs_fused
def test_transformers_native_ep_is_adopted(two):
    r = two["native"]  # DistributedConfig(fsdp_size=2, ep_size=2) at load, parallel.ep unset: kept as loaded
    _assert_parity(r)
    assert r["unchanged"] and r["ours"] == 0  # transformers' placements untouched, no second dispatch
    e = r["errors"]
    assert e["both"].startswith("parallel.ep=2 and transformers' DistributedConfig(ep_size=2, fsdp_size=2, ")
    assert "valid choices: parallel.ep=1 to keep transformers' expert parallelism" in e["both"]
    assert "got dp_replicate=2, dp_shard=1, cp=1; valid choices: parallel.dp_replicate=1, parallel.dp_shard=2" in \
        e["layout"]
    assert all("\n" not in message for message in e.values())


@pytest.fixture(scope="module")
def trainer_ref(root) -> dict:
    return _launch("trainer_ref", root)


def _trainer_run(root: Path, scenario: str, yaml: str, **env: str) -> dict:
    config = root / f"{scenario}.yaml"  # the kernels stay on: the whole drop-in (fused loss on the sharded lm_head)
    config.write_text(yaml)
    got = _launch(scenario, root, MINDSPEED_HF_AUTO="1", MINDSPEED_HF_CONFIG=str(config), **env)
    assert len(got["losses"]) == 3 and len(got["fsdp_log"]) == 1, got
    assert got["export_shapes_ok"] and got["export_max_diff"] == 0.0  # save_model: global [E, ...] tensors
    return got


def _assert_trainer_parity(got: dict, ref: dict) -> None:
    assert len(got["losses"]) == len(ref["losses"]) and len(got["grad_norms"]) == len(ref["grad_norms"])
    assert ref["params"] and got["params"].keys() == ref["params"].keys(), sorted(got["params"])
    for a, b in zip(got["losses"] + got["grad_norms"], ref["losses"] + ref["grad_norms"]):
        assert abs(a - b) <= TOL, (got, ref)
    for name, want in ref["params"].items():  # SGD + clipping: the parameters see the gradient scale
        torch.testing.assert_close(torch.tensor(got["params"][name]), torch.tensor(want), atol=TOL, rtol=0)


@needs_fused
def test_plain_trainer_with_ep_from_yaml(root, trainer_ref):
    got = _trainer_run(root, "trainer", "parallel: {ep: 2}\n")
    assert got["ep_modules"] == 2
    assert "dp_replicate=1 dp_shard=2 ep=2 (efsdp=1)," in got["fsdp_log"][0], got  # the log names ep when on
    _assert_trainer_parity(got, trainer_ref)
    # the MoE load logged by the run == a count from the routers' own outputs, summed over both ranks (each rank pads
    # its own micro-batches, so the padded positions differ from the one-process reference's)
    assert len(got["moe"]) == len(got["moe_expected"]) == 3
    for logged, want in zip(got["moe"], got["moe_expected"]):
        assert {k: logged[k] for k in want} == pytest.approx(want, abs=1e-4), (logged, want)


@needs_fused
def test_plain_trainer_with_ep_on_a_hybrid_linear_attention_model(tmp_path):
    """Qwen3.5-MoE's text model (Gated DeltaNet + gated attention layers, shared expert): dp_shard 2 x ep 2 from
    MINDSPEED_HF_CONFIG under a plain Trainer equals one process of plain HF on the global batch."""
    ref = _launch("trainer_ref", tmp_path, MOE_FAMILY="qwen3_5_moe_text")
    got = _trainer_run(tmp_path, "trainer", "parallel: {ep: 2}\n", MOE_FAMILY="qwen3_5_moe_text")
    assert got["ep_modules"] == 4 and "dp_replicate=1 dp_shard=2 ep=2 (efsdp=1)," in got["fsdp_log"][0], got
    _assert_trainer_parity(got, ref)


@needs_fused
def test_plain_trainer_adopts_transformers_native_ep(root, trainer_ref):
    got = _trainer_run(root, "trainer_native", "parallel: {dp_shard: 2}\n")  # our FSDP2 asked for, ep unset
    assert got["ep_modules"] == 0  # transformers' own dispatch, not ours on top
    assert "dp_replicate=1 dp_shard=2," in got["fsdp_log"][0], got
    _assert_trainer_parity(got, trainer_ref)


def test_ep_setting_accepted_or_refused_by_release(monkeypatch):
    monkeypatch.setenv("MINDSPEED_HF_PARALLEL_EP", "2")
    from mindspeed_hf.config import resolve

    if OLD_TRANSFORMERS:
        with pytest.raises(ValueError, match=f"parallel.ep=2: expert parallelism needs transformers >= "
                                             f"{EP_MIN_TRANSFORMERS}"):
            resolve()
    else:
        assert resolve().config.parallel.ep == 2 and ParallelConfig(ep=4).ep == 4


def test_expert_major_index():
    from mindspeed_hf.parallel.expert import expert_major_index

    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source rank][local expert]
    # received rows: s0e0 s0e0 s0e2 | s1e0 s1e1 s1e1 s1e1 -> e0: 0 1 3, e1: 4 5 6, e2: 2
    assert expert_major_index(counts).tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert expert_major_index(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


@needs_fused
def test_dcp_resume_exact_also_onto_another_layout(two):
    r = two["resume"]
    assert len(r["uninterrupted"]) == 2
    assert r["resumed_ep2"] == r["uninterrupted"]  # same layout: bitwise
    for a, b in zip(r["resumed_ep1"], r["uninterrupted"]):  # ep=2 checkpoint into plain FSDP2 (ep=1)
        assert abs(a - b) <= TOL


@needs_fused
@pytest.mark.parametrize("launch", ["two", "four"])
def test_from_pretrained_sharded_reads_local_experts(launch, request):
    """Fused-layout checkpoints and the per-expert keys of save_pretrained / the Hub (qwen3_moe's gate_proj / up_proj /
    down_proj, Mixtral's w1 / w3 / w2 under block_sparse_moe) load equal to from_pretrained."""
    loaded = request.getfixturevalue(launch)["loading"]
    assert sorted(loaded) == ["fused", "per_expert", "per_expert_mixtral"]
    for layout, r in loaded.items():
        assert r["same_names"] and r["max_diff"] == 0.0, (layout, r)
        assert r["local_rows"] == (2 if launch == "two" else 1), (layout, r)  # 4 experts / ep 2 (/ efsdp 2 on four)


@needs_fused
def test_lora_on_experts_saves_the_adapter_only(two):
    r = two["adapter"]  # parity of LoRA on the expert weights: test_ep2_matches_one_process[lora_experts]
    assert r["same_keys"] and r["expert_keys"] == 8 and r["max_diff"] == 0.0  # 2 layers x 2 weights x (A, B)
