"""torchrun worker for tests/distributed/test_expert_parallel.py (gloo, CPU, fp32). Rank 0 writes a JSON report.

Every case trains a tiny MoE model with expert parallelism and, on rank 0, the same model unsharded in plain
Hugging Face on the whole global batch (one process), and reports per-step losses, grad norms (before clipping,
clipped at MAX_NORM) and the final parameters of both (the loops: expert_harness.py). Scenarios: `two` (2 ranks),
`four` (4 ranks), `trainer` / `trainer_native` (plain Trainer under torchrun), `trainer_ref` (one process).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "npu_standin"))  # the torch_npu stand-in
from expert_harness import (  # noqa: E402
    EXPERT_LORA,
    GLOBAL_BATCH,
    batch,
    build,
    compare,
    ep_run,
    full_params,
    make_opt,
    micro_loss,
)
from tiny_models import tiny_model  # noqa: E402

from mindspeed_hf.config import MemoryConfig, MindSpeedConfig, ParallelConfig  # noqa: E402
from mindspeed_hf.parallel import ParallelDims, init_distributed, parallelize  # noqa: E402


def case(family, world, *, ep=2, dp_replicate=1, steps=3, accum=1, bias=None, recompute=False, lora=None,
         **overrides) -> dict:
    """EP training vs one process on the global batch."""
    dims = ParallelDims(dp_replicate=dp_replicate, ep=ep, world_size=world)
    dims.build_mesh("cpu")
    model = build(family, bias, lora, **overrides)
    ref = copy.deepcopy(model) if dist.get_rank() == 0 else None
    config = MindSpeedConfig(parallel=ParallelConfig(dp_replicate=dp_replicate, ep=ep),
                             memory=MemoryConfig(recompute=recompute))
    parallelize(model, dims, config)
    experts = [m for m in model.modules() if hasattr(m, "_mindspeed_ep")]
    losses, norms, grads = ep_run(model, dims, steps, accum)
    got = full_params(model)
    out = {"losses": losses, "norms": norms, "dims": [dims.dp_replicate, dims.dp_shard, dims.ep, dims.efsdp_size],
           "expert_placements": str(experts[0].gate_up_proj.placements),
           "local_experts": experts[0].gate_up_proj.to_local().shape[0]}
    out["local_rows"] = _rows_per_rank(model, dims)
    if ref is not None:
        out.update(compare(ref, grads, got, steps, accum))
    return out


def _error(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def native(world, root) -> dict:
    """A model loaded with transformers' own EP (DistributedConfig(fsdp_size=world, ep_size=world)) and
    parallel.ep unset: adopted as loaded (its experts sharding, dispatch and FSDP2; nothing sharded twice) and
    trained against one process. With parallel.ep too, or another data layout: one-line refusals first."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    path = f"{root}/tiny_moe"
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(
        fsdp_size=world, ep_size=world))
    layout = {n: str(p.placements) for n, p in model.named_parameters()}
    out = {"errors": {}}
    for label, dims, parallel in (("both", ParallelDims(ep=world, world_size=world), ParallelConfig(ep=world)),
                                  ("layout", ParallelDims(dp_replicate=world, world_size=world),
                                   ParallelConfig(dp_replicate=world))):
        dims.build_mesh("cpu")
        out["errors"][label] = _error(lambda d=dims, p=parallel: parallelize(model, d, MindSpeedConfig(parallel=p)))
    dims = ParallelDims(world_size=world)
    dims.build_mesh("cpu")
    parallelize(model, dims, MindSpeedConfig())
    out["unchanged"] = layout == {n: str(p.placements) for n, p in model.named_parameters()}
    out["ours"] = sum(hasattr(m, "_mindspeed_ep") for m in model.modules())
    out["losses"], out["norms"], grads = ep_run(model, dims, 2, 1)
    got = full_params(model)
    if dist.get_rank() == 0:
        out.update(compare(AutoModelForCausalLM.from_pretrained(path), grads, got, 2, 1))
    return out


#: the other MoE families of tests/tiny_models.py EP shards (gpt_oss: refused, see `errors`); qwen2_moe without its
#: aux loss in the sum (a per-rank aux loss is not the global batch's; router_outputs compares it per rank)
FAMILIES = {"qwen2_moe": {"output_router_logits": False}, "olmoe": {}, "deepseek_v3": {}, "glm4_moe": {},
            "ernie4_5_moe": {}, "qwen3_next": {}, "qwen3_5_moe_text": {}}
NPU_OPS = ("npu_grouped_matmul", "npu_moe_token_permute", "npu_moe_token_unpermute")


def npu_case(world) -> dict:
    """ep=2 with MINDSPEED_HF_BACKEND=npu (the stand-in torch_npu): parity vs one process, and the calls of the
    grouped matmul and permute / unpermute ops on each rank."""
    import os

    import torch_npu

    from mindspeed_hf.ops import registry

    calls = dict.fromkeys(NPU_OPS, 0)
    originals = {name: getattr(torch_npu, name) for name in NPU_OPS}

    def counted(name):
        def op(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return op

    for name in NPU_OPS:
        setattr(torch_npu, name, counted(name))
    os.environ["MINDSPEED_HF_BACKEND"] = "npu"
    registry.set_backend(None)  # re-read the environment
    try:
        out = case("qwen3_moe", world, steps=2)
    finally:
        os.environ.pop("MINDSPEED_HF_BACKEND")
        registry.set_backend(None)
        for name, op in originals.items():
            setattr(torch_npu, name, op)
    gathered = [None] * world
    dist.all_gather_object(gathered, calls)
    out["npu_calls"] = gathered
    out["torch_npu"] = torch_npu.__file__
    return out


def _rows_per_rank(model, dims) -> list[int]:
    """Rows the first layer's local experts receive on each rank for one forward (gathered over ranks)."""
    from mindspeed_hf.parallel import expert as ep_mod

    seen, original = [], ep_mod._AllToAll

    class Spy:
        @staticmethod
        def apply(*args):
            out = original.apply(*args)
            seen.append(out.shape[0])
            return out

    ep_mod._AllToAll = Spy
    try:
        per = GLOBAL_BATCH // dims.dp_size
        rank = dist.get_rank()
        with torch.no_grad():
            model(input_ids=batch(99)[0][rank * per:(rank + 1) * per])
    finally:
        ep_mod._AllToAll = original
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen[0])  # the dispatch of the first layer
    return gathered


def resume(root: str, world: int) -> dict:
    """DCP: model + optimizer shards saved at step 2 of an ep=2 run resume exactly, into ep=2 and into ep=1 (plain
    FSDP2: another layout of the same world size)."""
    from mindspeed_hf.parallel import load_model_shards, load_optimizer_shards, save_model_shards, save_optimizer_shards

    def sharded(ep):
        dims = ParallelDims(ep=ep, world_size=world)
        dims.build_mesh("cpu")
        model = parallelize(build("qwen3_moe"), dims, MindSpeedConfig(parallel=ParallelConfig(ep=ep)))
        return model, dims, make_opt(model)

    def steps(model, dims, opt, first, count):
        rank, per = dist.get_rank(), GLOBAL_BATCH // dims.dp_size
        losses = []
        for step in range(first, first + count):
            loss = micro_loss(model, step, 0, slice(rank * per, (rank + 1) * per), 1)
            (loss * dims.dp_size).backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
        return losses

    model, dims, opt = sharded(2)
    steps(model, dims, opt, 0, 2)
    save_model_shards(model, f"{root}/model")
    save_optimizer_shards(model, opt, f"{root}/optim")
    out = {"uninterrupted": steps(model, dims, opt, 2, 2)}
    for ep in (2, 1):
        model, dims, opt = sharded(ep)
        load_model_shards(model, f"{root}/model")
        load_optimizer_shards(model, opt, f"{root}/optim")
        out[f"resumed_ep{ep}"] = steps(model, dims, opt, 2, 2)
    return out


def adapter_save(root: str, world: int) -> dict:
    """LoRA on the experts under EP: save_hf_consolidated writes the adapter only, with the trained values."""
    from safetensors.torch import load_file

    from mindspeed_hf.parallel import save_hf_consolidated

    dims = ParallelDims(ep=2, world_size=world)
    dims.build_mesh("cpu")
    model = parallelize(build("qwen3_moe", lora=EXPERT_LORA), dims, MindSpeedConfig(parallel=ParallelConfig(ep=2)))
    ep_run(model, dims, 1, 1)
    trained = {n.replace(".default", ""): p for n, p in full_params(model).items() if "lora_" in n}
    save_hf_consolidated(model, f"{root}/adapter")
    if dist.get_rank() != 0:
        return {}
    saved = load_file(f"{root}/adapter/adapter_model.safetensors")
    return {"same_keys": sorted(saved) == sorted(trained), "expert_keys": sum(".experts." in k for k in saved),
            "max_diff": max((saved[k] - trained[k]).abs().max().item() for k in saved)}


def sharded_loading(root: str, world: int) -> dict:
    """from_pretrained_sharded with ep: each rank reads only its experts, from a checkpoint of the fused layout or
    of the per-expert keys transformers' save_pretrained writes (Qwen-MoE and Mixtral namings); the gathered model
    equals from_pretrained's."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from mindspeed_hf.parallel import from_pretrained_sharded, fsdp_mesh

    sources = {"fused": "qwen3_moe", "per_expert": "qwen3_moe", "per_expert_mixtral": "mixtral"}
    if dist.get_rank() == 0:
        for layout, family in sources.items():
            source, where = tiny_model(family, seed=3), f"{root}/load_{layout}"
            if layout == "fused":
                source.config.save_pretrained(where)
                save_file({k: v.contiguous() for k, v in source.state_dict().items()}, f"{where}/model.safetensors",
                          metadata={"format": "pt"})
            else:
                source.save_pretrained(where)
    dist.barrier()
    dims = ParallelDims(ep=2, world_size=world)
    mesh = dims.build_mesh("cpu")
    result = {}
    for layout in sources:
        model = from_pretrained_sharded(f"{root}/load_{layout}", fsdp_mesh(mesh, dims), dims=dims)
        experts = next(m for m in model.modules() if hasattr(m, "_mindspeed_ep"))
        got = full_params(model)
        want = dict(AutoModelForCausalLM.from_pretrained(f"{root}/load_{layout}").named_parameters())
        result[layout] = {"max_diff": max((got[n] - p).abs().max().item() for n, p in want.items()),
                          "local_rows": experts.gate_up_proj.to_local().shape[0],
                          "same_names": sorted(got) == sorted(want)}
    return result


def router_outputs(family, world) -> dict:
    """output_router_logits=True with the auxiliary loss: each rank's loss, aux_loss and router_logits equal plain
    HF's on that rank's batch in one process."""
    dims = ParallelDims(ep=2, world_size=world)
    dims.build_mesh("cpu")
    model = build(family, output_router_logits=True, router_aux_loss_coef=0.02)
    ref = copy.deepcopy(model)
    parallelize(model, dims, MindSpeedConfig(parallel=ParallelConfig(ep=2)))
    rank, per = dist.get_rank(), GLOBAL_BATCH // world
    ids, labels = batch(0)
    kwargs = dict(input_ids=ids[rank * per:(rank + 1) * per], labels=labels[rank * per:(rank + 1) * per])
    mine, theirs = model(**kwargs), ref(**kwargs)
    diffs = {
        "loss": (mine.loss - theirs.loss).abs().item(),
        "aux_loss": (mine.aux_loss - theirs.aux_loss).abs().item(),
        "router_logits": max((a - b).abs().max().item() for a, b in zip(mine.router_logits, theirs.router_logits)),
        "n_router_logits": [len(mine.router_logits), len(theirs.router_logits)],
        "aux_nonzero": theirs.aux_loss.item() != 0.0,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, diffs)
    return {"per_rank": gathered}


def errors(world, root) -> dict:
    """One-line errors before any work."""
    if dist.get_rank() == 0:  # also read by `native`
        tiny_model("qwen3_moe").save_pretrained(f"{root}/tiny_moe")
    dist.barrier()
    dims = ParallelDims(ep=world, world_size=world)
    dims.build_mesh("cpu")
    config = MindSpeedConfig(parallel=ParallelConfig(ep=world))
    return {label: _error(lambda f=family, kw=kw: parallelize(build(f, **kw), dims, config))
            for label, family, kw in (("dense", "qwen3", {}), ("indivisible", "qwen3_moe", {"num_experts": 3}),
                                      ("gpt_oss", "gpt_oss", {}))}


def scenario_two(world, root) -> dict:
    return {
        "qwen3_moe": case("qwen3_moe", world),
        "mixtral": case("mixtral", world, steps=2),
        "accum": case("qwen3_moe", world, steps=2, accum=2, recompute="selective"),  # reruns the exchange
        "imbalanced": case("qwen3_moe", world, steps=2, bias=[3.0, 0.0, 0.0, -3.0]),
        "zero_rank": case("mixtral", world, steps=2, bias=[20.0, 20.0, 0.0, 0.0]),
        "lora": case("qwen3_moe", world, steps=2, lora={"target_modules": ["q_proj", "v_proj"]}),
        "lora_experts": case("qwen3_moe", world, steps=2, lora=EXPERT_LORA),
        **{family: case(family, world, steps=2, **kw) for family, kw in FAMILIES.items()},
        "npu": npu_case(world),
        "router": router_outputs("qwen3_moe", world),
        "errors": errors(world, root),
        "native": native(world, root),
        "resume": resume(root, world),
        "loading": sharded_loading(root, world),
        "adapter": adapter_save(root, world),
    }


def scenario_four(world, root) -> dict:
    return {
        "efsdp2": case("qwen3_moe", world, steps=2),
        "lora_experts": case("qwen3_moe", world, steps=1, lora=EXPERT_LORA),
        "loading": sharded_loading(root, world),
        "hsdp": case("mixtral", world, dp_replicate=2, steps=2, accum=2),
    }


# ---------------------------------------------------------------------------------------------- inside Trainer
TRAINER = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.5, gradient_accumulation_steps=2)


def native_model(root: str):
    """tiny qwen3_moe loaded with transformers' own EP over the torchrun world (DistributedConfig(fsdp_size=W,
    ep_size=W)); the same weights as tiny_model("qwen3_moe")."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    init_distributed("cpu")
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        tiny_model("qwen3_moe").save_pretrained(root + "/src")
    dist.barrier()
    return AutoModelForCausalLM.from_pretrained(root + "/src", distributed_config=DistributedConfig(
        fsdp_size=world, ep_size=world))


def _router_ids(model) -> list[torch.Tensor]:
    """Every training forward's top-k expert ids, as each layer's router returns them (in call order)."""
    seen: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(
            lambda m, a, out: seen.append(out[2].detach().clone()) if m.training else None)
    return seen


def _expected_load(seen: list[torch.Tensor], config, accum: int) -> list[dict[str, float]]:
    """moe/* per optimizer step from the router outputs: per layer, the step's micro-batches summed (over every
    rank)."""
    layers, experts = config.num_hidden_layers, config.num_experts
    per_step = layers * accum
    out = []
    for start in range(0, len(seen), per_step):
        counts = torch.zeros(layers, experts)
        for i, ids in enumerate(seen[start:start + per_step]):
            counts[i % layers] += torch.bincount(ids.reshape(-1), minlength=experts).float()
        if dist.is_initialized():  # every rank's tokens
            dist.all_reduce(counts)
        ratio = (counts.max(1).values / counts.mean(1)).tolist()
        out.append({**{f"moe/layer_{i}/imbalance": round(r, 4) for i, r in enumerate(ratio)},
                    **{f"moe/layer_{i}/zero_token_experts": int(z) for i, z in enumerate((counts == 0).sum(1))},
                    "moe/routed_per_layer": round(counts.sum().item() / layers, 1)})
    return out


def scenario_trainer(root: str, per_device: int, native: bool = False) -> dict:
    """Plain transformers.Trainer: one process without mindspeed_hf (the reference, per_device = the global batch),
    or under torchrun with EP from MINDSPEED_HF_CONFIG (`import mindspeed_hf`, nothing else changed; the family from
    MOE_FAMILY, default qwen3_moe), or (`native`)
    on a model loaded with transformers' own EP, our FSDP2 asked for by MINDSPEED_HF_CONFIG too: adopted."""
    from trainer_worker import run, targs
    from transformers import Trainer, TrainingArguments

    args = targs(TrainingArguments, root, per_device_train_batch_size=per_device, use_cpu=True, max_steps=3, **TRAINER)
    logged, handler, logger = [], logging.Handler(), logging.getLogger("mindspeed_hf")
    handler.emit = lambda record: logged.append(record.getMessage())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    model = native_model(root) if native else tiny_model(os.environ.get("MOE_FAMILY", "qwen3_moe"))
    routed = _router_ids(model)  # an independent count: every router's own output, on every rank
    trainer, out = run(Trainer, model, args)
    out["fsdp_log"] = [line for line in logged if "FSDP2 on" in line]
    out["moe"] = [{k: v for k, v in h.items() if k.startswith("moe/")}
                  for h in trainer.state.log_history if "loss" in h]
    out["moe_expected"] = _expected_load(routed, model.config, TRAINER["gradient_accumulation_steps"])
    params = full_params(trainer.model)
    out["params"] = {n: t.tolist() for n, t in params.items() if "experts" in n or "gate" in n}
    out["ep_modules"] = len([m for m in trainer.model.modules() if hasattr(m, "_mindspeed_ep")])
    trainer.save_model(root + "/hf")  # consolidated HF safetensors, HF's fused experts layout
    if not dist.is_initialized() or dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        loaded = dict(AutoModelForCausalLM.from_pretrained(root + "/hf").named_parameters())
        out["export_shapes_ok"] = all(loaded[n].shape == t.shape for n, t in params.items())
        out["export_max_diff"] = max((loaded[n] - t).abs().max().item() for n, t in params.items())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["two", "four", "trainer", "trainer_native", "trainer_ref"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.scenario == "trainer_ref":  # one process, no torchrun
        out = scenario_trainer(a.out + ".d", per_device=4)
    elif a.scenario.startswith("trainer"):
        import mindspeed_hf  # noqa: F401  - the one line an unmodified script adds

        out = scenario_trainer(a.out + ".d", per_device=2, native=a.scenario == "trainer_native")
    else:
        init_distributed("cpu")
        out = {"two": scenario_two, "four": scenario_four}[a.scenario](dist.get_world_size(), a.out + ".d")
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
