"""FSDP2 inside Trainer (gloo on CPU): MindSpeedTrainer, plain Trainer after `import mindspeed_hf` (FSDP from the
training arguments or from the environment `accelerate launch` exports), PEFT LoRA, checkpoints and resume, and the
example scripts, each against a single-process Trainer on the same global batch (fp32, 1e-5).

Launches: one single-process reference, torchrun `train`, `env` and `hsdp` (4 ranks) of trainer_worker.py, and per
example script one single-process and one torchrun run. The resolve_plan tests at the end run in this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from child_runs import FOREIGN, REPO, child_env, run_or_fail, run_worker, torchrun

HERE = Path(__file__).resolve().parent
WORKER = HERE / "trainer_worker.py"
TOL = 1e-5


def accelerate_fsdp2_env(tmp: Path) -> dict[str, str]:
    """What `accelerate launch --config_file examples/accelerate/npu_fsdp2_8.yaml` exports, for 2 processes in fp32:
    computed by accelerate's own launcher code from the example YAML."""
    import yaml
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    config = yaml.safe_load((REPO / "examples" / "accelerate" / "npu_fsdp2_8.yaml").read_text())
    config.update(num_processes=2, mixed_precision="no")
    config["parallelism_config"]["parallelism_config_dp_shard_size"] = 2
    path = tmp / "fsdp2.yaml"
    path.write_text(yaml.safe_dump(config))
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(FOREIGN[:3])}


def _worker(scenario: str, root: Path, **extra: str) -> dict:
    nproc = 0 if scenario == "reference" else 4 if scenario == "hsdp" else 2
    return run_worker(WORKER, root / f"{scenario}.json", scenario, "--root", str(root), nproc=nproc,
                      env=child_env(**extra))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer_fsdp")


@pytest.fixture(scope="module")
def reference(root) -> dict:
    return _worker("reference", root)


@pytest.fixture(scope="module")
def train(root, reference) -> dict:
    return _worker("train", root)


@pytest.fixture(scope="module")
def hsdp(root, reference) -> dict:
    return _worker("hsdp", root)


@pytest.fixture(scope="module")
def env_run(root, train) -> dict:
    # with the layer class named, as accelerate exports fsdp_transformer_layer_cls_to_wrap
    return _worker("env", root, **accelerate_fsdp2_env(root), FSDP_TRANSFORMER_CLS_TO_WRAP="Qwen3DecoderLayer")


def _close(a: list[float], b: list[float], tol: float = TOL) -> None:
    assert len(a) == len(b) > 0, (a, b)
    assert max(abs(x - y) for x, y in zip(a, b)) <= tol, (a, b)


def _param_diff(root: Path, a: str, b: str, only: str = "") -> float:
    pa, pb = torch.load(root / f"{a}.pt"), torch.load(root / f"{b}.pt")
    keys = [k for k in pb if only in k]
    assert keys and set(keys) <= set(pa), (sorted(pa)[:3], keys[:3])
    return max((pa[k] - pb[k]).abs().max().item() for k in keys)


def _sharded(r: dict) -> None:
    assert r["all_dtensor"] and r["placements"] == ["(Shard(dim=0),)"] and r["frozen_sharded"]
    assert r["optimizer_on_dtensors"] and r["wrapped_is_model"]  # no DDP / accelerate wrapper around it


def test_mindspeed_trainer_dp_shard_matches_single_process(root, reference, train):
    r = train["ms"]
    _close(r["losses"], reference["base"]["losses"])
    _close(r["grad_norms"], reference["base"]["grad_norms"])  # clip_grad_norm_ over DTensor grads
    _sharded(r)  # checked after evaluate(): the tail/root groups were resharded
    assert r["eval_loss"] == r["eval_loss"]  # evaluation ran (finite)
    assert not any(r["report_kernels"].values())  # kernels off here: this tests the sharding alone
    assert _param_diff(root, "ms", "ref_base") < TOL


def test_kernels_on_a_sharded_model(reference, train):
    r = train["ms_kernels"]
    # every kernel of the model (no experts, no linear attention), the fused loss included: it reads the sharded tail
    # group's lm_head
    assert all(n for op, n in r["report_kernels"].items() if op not in ("experts", "linear_attention"))
    _close(r["losses"], reference["base"]["losses"])
    _sharded(r)


def test_plain_trainer_fsdp_arguments_with_gradient_accumulation(root, reference, train):
    r = train["plain"]
    _close(r["losses"], reference["ga2"]["losses"])
    _close(r["grad_norms"], reference["ga2"]["grad_norms"])
    _sharded(r)
    assert not r["accelerate_fsdp"] and r["num_processes"] == 2
    assert _param_diff(root, "plain", "ref_ga2") < TOL  # SGD: the clipped gradients are the update


def test_accelerate_launch_environment(root, reference, env_run):
    assert env_run["meta_on_rank"] == [False, True]  # rank 1 got its shards from rank 0
    r = env_run["env"]
    _close(r["losses"], reference["base"]["losses"])
    _sharded(r)
    assert not r["accelerate_fsdp"]
    assert _param_diff(root, "env", "ref_base") < TOL


def test_load_best_model_at_end(root, reference, env_run):
    r = env_run["best"]
    assert r["best"] == reference["best"]["best"] != "checkpoint-4"  # an early checkpoint is the "best"
    _close(r["losses"], reference["best"]["losses"])
    assert _param_diff(root, "best", "ref_best") < TOL  # the best checkpoint's weights, as plain HF loads them
    assert _param_diff(root, "best", "env") > 1e-3  # ... which are not the final weights


def test_save_model_loads_with_from_pretrained(root, train):
    assert "model.safetensors" in train["ms"]["export_files"]
    assert _param_diff(root, "ms_export", "ms") == 0.0


def test_sharded_checkpoint_and_resume(root, train, env_run):
    files = train["ms"]["ckpt_files"]  # Trainer's own checkpoint, with the model and optimizer as DCP shards
    for name in ("COMPLETE", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
                 "training_args.bin", "pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"):
        assert name in files, (name, files)
    assert any(f.startswith("pytorch_model_fsdp_0/") and f.endswith(".distcp") for f in files)
    assert "model.safetensors" not in files and "optimizer.pt" not in files
    # accelerate is told the world size on CPU through use_cpu; the user's arguments (and the saved copy) keep theirs
    assert train["ms"]["use_cpu"] == {"given": False, "after_training": False, "saved": False}
    assert "checkpoint-3" in env_run["incomplete_error"] and "COMPLETE" in env_run["incomplete_error"]
    r = env_run["resume"]  # checkpoint-4 was "interrupted" (no marker), checkpoint-3 unmarked: resumes from 2
    assert r["steps"] == 4 and len(r["losses"]) == 2
    _close(r["losses"], train["ms"]["losses"][2:4])
    assert _param_diff(root, "resume", "ms") < TOL
    assert "checkpoint-4" in r["complete"] and "checkpoint-3" not in r["complete"]  # re-saved, marked


def test_lora(root, reference, train):
    r = train["lora"]
    _close(r["losses"], reference["lora"]["losses"])
    _sharded(r)  # frozen base weights sharded too
    assert _param_diff(root, "lora", "ref_lora") < TOL
    assert "adapter_model.safetensors" in r["export_files"] and "model.safetensors" not in r["export_files"]
    assert _param_diff(root, "lora", "lora_export", only="lora_") == 0.0


def test_hsdp_with_gradient_accumulation(root, reference, hsdp):
    r = hsdp["hsdp"]
    assert r["dims"] == [2, 2] and r["placements"] == ["(Replicate(), Shard(dim=0))"]
    _close(r["losses"], reference["hsdp"]["losses"])
    _close(r["grad_norms"], reference["hsdp"]["grad_norms"])
    assert _param_diff(root, "hsdp", "ref_hsdp") < TOL


def test_bf16_mixed_precision(reference, train):
    r = train["bf16"]
    _close(r["losses"], reference["base"]["losses"][:2], tol=2e-2)  # bf16 compute vs the fp32 reference
    _sharded(r)
    assert r["param_dtypes"] == ["torch.float32"] and r["compute_dtypes"] == ["torch.bfloat16"]


# ---------------------------------------------------------------------------------------------- examples
def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if '"loss"' in line]


@pytest.mark.parametrize("script,how", [("sft_trainer.py", "args"), ("sft_lora.py", "args"), ("sft_trl.py", "env")])
def test_example_under_torchrun_matches_single_process(script, how, tmp_path):
    """FSDP through `--fsdp full_shard` or the accelerate launch environment; kernels on (import mindspeed_hf)."""
    common = [str(REPO / "examples" / script), "--max_steps", "4"]
    single, sharded = tmp_path / "single.jsonl", tmp_path / "sharded.jsonl"
    run_or_fail([sys.executable, *common, "--output_dir", str(tmp_path / "a"), "--losses_file", str(single)],
         child_env(auto=True), f"{script} single process")
    extra = accelerate_fsdp2_env(tmp_path) if how == "env" else {}
    flags = ["--fsdp", "full_shard", "--fsdp_config", '{"fsdp_version": 2}'] if how == "args" else []
    run_or_fail(torchrun(*common, "--output_dir", str(tmp_path / "b"), "--losses_file", str(sharded),
                   "--per_device_train_batch_size", "4", *flags), child_env(auto=True, **extra), f"{script} torchrun")
    _close(_losses(sharded), _losses(single))


# ---------------------------------------------------------------------------------------------- the request
def _plan(args=None, world: int = 2, env: dict | None = None, **parallel):
    """The plan for `args`, with `parallel` as the YAML file's section and `env` as the whole environment."""
    from mindspeed_hf.config import resolve
    from mindspeed_hf.runtime import resolve_plan
    from mindspeed_hf.trainers.arguments import hf_fsdp_layer

    env = env or {}
    explicit = [hf_fsdp_layer(args)] if args is not None else []
    if hasattr(args, "mindspeed_layer"):
        explicit.append(args.mindspeed_layer())
    resolved = resolve(explicit, yaml_source={"parallel": parallel}, env=env)
    return resolve_plan(args, resolved, env=env, world_size=world)


def _hf_args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)


def test_plan_sources(tmp_path):
    assert _plan(world=1) is None and _plan(world=2) is None  # no request: Trainer unchanged (DDP stays DDP)
    plan = _plan(_hf_args(tmp_path, fsdp="shard_grad_op offload", fsdp_config={"fsdp_version": 2}))
    assert (plan.dp_shard, plan.reshard_after_forward, plan.cpu_offload) == (2, False, True)
    env = accelerate_fsdp2_env(tmp_path)
    plan = _plan(env=env, prefetch=2)
    assert (plan.dp_shard, plan.reshard_after_forward, plan.prefetch, plan.cpu_ram_efficient_loading) == (2, True, 2,
                                                                                                         True)
    assert _plan(env={**env, "FSDP_VERSION": "1", "ACCELERATE_USE_PARALLELISM_CONFIG": "false"}) is None  # accelerate's
    assert _plan(world=4, dp_replicate=2).dp_shard == 2  # HSDP from our sizes alone
    plan = _plan(_hf_args(tmp_path, fsdp=True, fsdp_config={"fsdp_version": 2}),
                 reshard_after_forward=False)  # HF's default is not a statement
    assert plan.reshard_after_forward is False


def test_plan_follows_the_precedence(tmp_path):
    """explicit arguments > MINDSPEED_HF_* > YAML > accelerate launch environment > defaults, for sizes and knobs."""
    from mindspeed_hf.trainers import MindSpeedTrainingArguments

    env = accelerate_fsdp2_env(tmp_path)  # dp_shard 2, reshard_after_forward true
    assert _plan(env=env).reshard_after_forward is True
    assert _plan(env=env, reshard_after_forward=False).reshard_after_forward is False  # YAML over accelerate
    ours = {**env, "MINDSPEED_HF_PARALLEL_RESHARD_AFTER_FORWARD": "true"}
    assert _plan(env=ours, reshard_after_forward=False).reshard_after_forward is True  # MINDSPEED_HF_* over YAML
    args = MindSpeedTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                      mindspeed_reshard_after_forward=False)
    assert _plan(args, env=ours).reshard_after_forward is False  # arguments over everything
    plan = _plan(env=env, world=4, dp_replicate=2)  # YAML adds a replicate axis; accelerate's dp_shard stays
    assert (plan.dp_replicate, plan.dp_shard) == (2, 2)


@pytest.mark.parametrize("case,match", [
    ("v1_with_sizes", r"version 1.*parallel\.dp_shard"),
    ("product", r"parallel\.dp_shard=4 \(config dict\).*world_size=2"),
    ("accelerate_product", r"PARALLELISM_CONFIG_DP_SHARD_SIZE=2 \(accelerate launch environment\).*world_size=4"),
    ("explicit_disagree", r"reshard_after_forward=False but training arguments \(mindspeed_\*\) sets True"),
    ("sp", r"sp size 2 \(sequence parallel\) is not supported"),  # tp: ours now (test_tensor_parallel.py)
    ("cp", r"parallel\.cp=3.*dp_replicate \* cp = 1 \* 3 = 3 does not divide world_size=4"),
])
def test_contradictions_fail_naming_the_settings(case, match, tmp_path):
    from mindspeed_hf.trainers import MindSpeedTrainingArguments

    env = accelerate_fsdp2_env(tmp_path)
    with pytest.raises(ValueError, match=match):
        if case == "v1_with_sizes":
            _plan(_hf_args(tmp_path, fsdp=True, fsdp_config={"fsdp_version": 1}), dp_shard=2)
        elif case == "product":
            _plan(dp_shard=4)
        elif case == "accelerate_product":
            _plan(env=env, world=4)
        elif case == "explicit_disagree":  # two explicit statements: no precedence between them
            _plan(MindSpeedTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", fsdp=True,
                                             fsdp_config={"fsdp_version": 2, "reshard_after_forward": False},
                                             mindspeed_reshard_after_forward=True))
        elif case == "sp":
            _plan(env={**env, "PARALLELISM_CONFIG_SP_SIZE": "2"})
        else:
            _plan(world=4, cp=3)


def test_mindspeed_trainer_fails_before_any_work(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import mindspeed_hf
    from mindspeed_hf.trainers import MindSpeedTrainer, MindSpeedTrainingArguments

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    args = MindSpeedTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", mindspeed_dp_shard=2)
    with pytest.raises(ValueError, match=r"mindspeed_dp_shard.*world_size=1"):
        MindSpeedTrainer(model=model, args=args)
    assert not mindspeed_hf.is_enabled()  # nothing was patched


def test_wrap_and_state_dict_settings_are_followed_or_reported(tmp_path, caplog):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mindspeed_hf.parallel.fsdp import get_fsdp_parts

    config = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": "Qwen3MLP"}
    assert _plan(_hf_args(tmp_path, fsdp=True, fsdp_config=config)).layer_classes == ("Qwen3MLP",)
    env = accelerate_fsdp2_env(tmp_path)
    assert _plan(env=env).layer_classes is None  # not stated: the model's _no_split_modules
    assert _plan(env={**env, "FSDP_TRANSFORMER_CLS_TO_WRAP": "A, B"}).layer_classes == ("A", "B")
    with pytest.raises(ValueError, match="different layer classes"):
        _plan(_hf_args(tmp_path, fsdp=True, fsdp_config=config), env={**env, "FSDP_TRANSFORMER_CLS_TO_WRAP": "B"})

    caplog.clear()
    _plan(env={**env, "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"})
    said = caplog.text
    assert "auto_wrap_policy=SIZE_BASED_WRAP, which is not applied" in said and "FULL_STATE_DICT" in said
    caplog.clear()
    _plan(env=env)  # TRANSFORMER_BASED_WRAP + SHARDED_STATE_DICT: what mindspeed_hf does, nothing to report
    assert "not applied" not in caplog.text and "FULL_STATE_DICT" not in caplog.text

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert [type(m).__name__ for m in get_fsdp_parts(model, ["Qwen3MLP"])["layers"]] == ["Qwen3MLP"] * 2
    with pytest.raises(ValueError, match=r"\['Nope'\] are not in Qwen3ForCausalLM.*Qwen3DecoderLayer"):
        get_fsdp_parts(model, ["Nope"])
