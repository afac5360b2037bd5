"""torchrun worker for tests/distributed (gloo on CPU). Rank 0 writes a JSON report to --out.

Scenarios (one torchrun launch each, several checks per launch to keep start-up costs down):
  main   (2 ranks): FSDP parity + sharded save at step 2 + HF export + meta-device sharded loading,
                    tied-embedding parity, PEFT LoRA parity + adapter-only save.
  resume (2 ranks): resume from the step-2 checkpoint of `main`, steps 3-4.
  hsdp   (4 ranks): HSDP 2x2 parity.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mindspeed_hf.parallel.checkpoint import (
    capture_rng_state,
    latest_complete_checkpoint,
    load_sharded,
    restore_rng_state,
    save_hf_consolidated,
    save_sharded,
)
from mindspeed_hf.parallel.dims import ParallelDims, expert_mesh, fsdp_mesh, init_distributed
from mindspeed_hf.parallel.fsdp import apply_fsdp, local_state_bytes, reshard_model
from mindspeed_hf.parallel.loading import (
    from_pretrained_sharded,
    load_sharded_safetensors,
    local_shard_slices,
)

GLOBAL_BATCH, SEQ, VOCAB, LR = 4, 16, 128, 1e-2
MODEL_VOCAB = 131  # odd: embed/lm_head rows shard unevenly (66 + 65), like torch.chunk


def tiny_config(tied: bool = False):
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=MODEL_VOCAB,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def build_model(tied: bool = False, lora: bool = False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(tied))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        )
        with torch.no_grad():  # non-zero B so the adapter matters from step 0
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.05)
    return model


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 10:] = -100  # uneven valid-token counts across ranks
    labels[GLOBAL_BATCH - 1, :7] = -100
    return ids, labels


def make_opt(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def ref_step(model, opt, step):
    ids, labels = batch(step)
    n = (labels[:, 1:] != -100).sum()
    loss = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def dist_step(model, opt, step, dp_rank, dp_size):
    """This rank's share of the global batch; returns the global token-weighted mean loss."""
    ids, labels = batch(step)
    per = GLOBAL_BATCH // dp_size
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    n = (labels[:, 1:] != -100).sum()  # global count (a Trainer gathers it across ranks)
    loss = model(input_ids=ids[sl], labels=labels[sl], num_items_in_batch=n).loss
    (loss * dp_size).backward()  # FSDP averages gradients over the dp ranks
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item()


def full_params(model) -> dict[str, torch.Tensor]:
    """Gathered parameters (collective), keyed by name."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:5], sorted(b)[:5])
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def all_ranks(flag: bool) -> bool:
    t = torch.tensor([0 if flag else 1])
    dist.all_reduce(t)
    return t.item() == 0


def placements(model) -> list[str]:
    return sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)})


def all_dtensor(model) -> bool:
    return all(isinstance(p, DTensor) for p in model.parameters())


def parity(rank, world, dims, mesh, *, tied=False, lora=False, steps=3, save_at=None, root=None,
           **fsdp_kwargs):
    model = build_model(tied=tied, lora=lora)
    ref = copy.deepcopy(model) if rank == 0 else None
    apply_fsdp(model, fsdp_mesh(mesh, dims), **fsdp_kwargs)
    opt = make_opt(model)
    ref_opt = make_opt(ref) if ref is not None else None
    res = {"losses": [], "ref_losses": [], "placements": placements(model),
           "all_dtensor": all_dtensor(model)}
    dp_rank = dist.get_rank() // (world // dims.dp_size)
    for step in range(steps):
        if ref is not None:
            res["ref_losses"].append(ref_step(ref, ref_opt, step))
        res["losses"].append(dist_step(model, opt, step, dp_rank, dims.dp_size))
        if save_at is not None and step + 1 == save_at:
            save_sharded(model, opt, {"step": step + 1, "rng": capture_rng_state()},
                         os.path.join(root, f"step_{step + 1}"))
    gathered = full_params(model)
    if ref is not None:
        res["param_max_diff"] = max_diff(gathered, {n: p.detach() for n, p in ref.named_parameters()})
    return model, opt, ref, gathered, res


def scenario_main(rank, world, root):
    from transformers import AutoModelForCausalLM

    dims = ParallelDims(world_size=world)
    mesh = dims.build_mesh("cpu")
    out = {"dims": [dims.dp_replicate, dims.dp_shard, dims.cp, dims.ep]}

    # -- local_shard_slices agrees with distribute_tensor (uneven and empty shards) ------------
    fmesh = fsdp_mesh(mesh, dims)
    ok = []
    for shape in [(5, 3), (1, 4), (7,), (131, 2)]:
        t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        local = distribute_tensor(t, fmesh, [Shard(0)]).to_local()
        ok.append(torch.equal(local, t[local_shard_slices(shape, fmesh, [Shard(0)])]))
    out["slices_match_distribute_tensor"] = all_ranks(all(ok))

    # -- apply_fsdp argument validation (raises before sharding anything) ---------------------
    errors = {}
    probe = build_model()
    for label, kwargs in [
        ("mesh_3d", {"mesh": mesh}),
        ("prefetch", {"mesh": fmesh, "prefetch": -1}),
        ("dtype", {"mesh": fmesh, "param_dtype": torch.int8}),
    ]:
        try:
            apply_fsdp(probe, **kwargs)
            errors[label] = "no error"
        except ValueError as e:
            errors[label] = str(e)
    errors["untouched"] = not any(isinstance(p, DTensor) for p in probe.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_fsdp(probe, fmesh, cpu_offload=True)
    errors["offload_warning"] = any("cpu_offload" in str(w.message) for w in caught)
    try:
        apply_fsdp(probe, fmesh)
        errors["twice"] = "no error"
    except ValueError as e:
        errors["twice"] = str(e)
    out["errors"] = errors
    del probe

    # -- plain FSDP: parity, sharded save at step 2, HF export ---------------------------------
    model, _opt, ref, gathered, res = parity(rank, world, dims, mesh, steps=4, save_at=2, root=root)
    out["fsdp"] = res
    if rank == 0:  # an interrupted, newer save: must be ignored by the resume run
        os.makedirs(os.path.join(root, "step_3"), exist_ok=True)
        with open(os.path.join(root, "step_3", "partial.bin"), "wb") as f:
            f.write(b"x")
    hf_dir = os.path.join(root, "hf")
    state = save_hf_consolidated(model, hf_dir)
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(hf_dir)
        loaded_p = {n: p.detach() for n, p in loaded.named_parameters()}
        res["export_vs_gathered"] = max_diff(loaded_p, gathered)
        res["export_vs_state"] = max_diff(loaded_p, {k: state[k] for k in loaded_p})
        res["export_vs_ref"] = max_diff(loaded_p, {n: p.detach() for n, p in ref.named_parameters()})
    dist.barrier()

    # -- meta-device sharded loading from the exported checkpoint ------------------------------
    sharded = from_pretrained_sharded(hf_dir, fsdp_mesh(mesh, dims))
    g2 = full_params(sharded)
    with torch.no_grad():  # again, re-opening the file every 4 KiB read
        for p in sharded.parameters():
            p.to_local().zero_()
    load_sharded_safetensors(sharded, hf_dir, window_bytes=4096)
    reload_diff = max_diff(full_params(sharded), g2)
    mem = local_state_bytes(sharded)["params"]
    mems = [None] * world
    dist.all_gather_object(mems, mem)
    ids, _ = batch(0)
    with torch.no_grad():
        logits = sharded(input_ids=ids).logits
    reshard_model(sharded)  # no backward: give the tail/root groups back their shards
    if rank == 0:
        normal = AutoModelForCausalLM.from_pretrained(hf_dir)
        full = local_state_bytes(normal)["params"]
        with torch.no_grad():
            ref_logits = normal(input_ids=ids).logits
        out["loading"] = {
            "vs_from_pretrained": max_diff(g2, {n: p.detach() for n, p in normal.named_parameters()}),
            "buffers_equal": all(
                torch.equal(b, dict(normal.named_buffers())[n]) for n, b in sharded.named_buffers()
            ),
            "buffer_names": [n for n, _ in sharded.named_buffers()],
            "logits_diff": (logits - ref_logits).abs().max().item(),
            "rank_param_bytes": mems,
            "full_param_bytes": full,
            "all_dtensor": all_dtensor(sharded),
            "small_window_reload_diff": reload_diff,
        }
    del model, sharded

    # -- tied embeddings -----------------------------------------------------------------------
    model, _, _, _, res = parity(rank, world, dims, mesh, tied=True)
    hf = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    res["still_tied"] = hf
    tied_dir = os.path.join(root, "hf_tied")
    save_hf_consolidated(model, tied_dir)
    gathered = full_params(model)
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(tied_dir)
        res["loaded_tied"] = loaded.lm_head.weight is loaded.model.embed_tokens.weight
        res["export_vs_gathered"] = max_diff(
            {n: p.detach() for n, p in loaded.named_parameters()}, gathered
        )
    sharded = from_pretrained_sharded(tied_dir, fsdp_mesh(mesh, dims))
    res["sharded_load_tied"] = sharded.lm_head.weight is sharded.model.embed_tokens.weight
    res["sharded_load_vs_gathered"] = max_diff(full_params(sharded), gathered)
    out["tied"] = res

    # -- PEFT LoRA -----------------------------------------------------------------------------
    model, _opt, ref, gathered, res = parity(rank, world, dims, mesh, lora=True)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    res["frozen_sharded"] = bool(frozen) and all(
        isinstance(p, DTensor) and p.placements == (Shard(0),) for p in frozen
    )
    res["n_trainable"] = sum(p.requires_grad for p in model.parameters())
    lora_dir = os.path.join(root, "lora")
    save_hf_consolidated(model, lora_dir)
    # sharded checkpoint of a LoRA model (frozen base + adapter + optimizer) round-trips
    save_sharded(model, _opt, {"step": 3}, os.path.join(root, "lora_ckpt", "step_3"))
    fresh = build_model(lora=True)
    apply_fsdp(fresh, fsdp_mesh(mesh, dims))
    fresh_opt = make_opt(fresh)
    res["sharded_extra"] = load_sharded(fresh, fresh_opt, os.path.join(root, "lora_ckpt", "step_3"))
    res["sharded_roundtrip_diff"] = max_diff(full_params(fresh), gathered)
    res["optim_states_equal"] = all_ranks(all(
        torch.equal(a.to_local(), b.to_local())
        for sa, sb in zip(_opt.state.values(), fresh_opt.state.values(), strict=True)
        for a, b in ((sa["exp_avg"], sb["exp_avg"]), (sa["exp_avg_sq"], sb["exp_avg_sq"]))
    ))
    if rank == 0:
        from peft import PeftModel
        from safetensors.torch import load_file

        res["files"] = sorted(os.listdir(lora_dir))
        saved = load_file(os.path.join(lora_dir, "adapter_model.safetensors"))
        res["saved_keys_all_lora"] = all("lora_" in k for k in saved)
        res["n_saved"] = len(saved)
        base = build_model(lora=False)
        reloaded = PeftModel.from_pretrained(base, lora_dir)
        ref_lora = {n: p.detach() for n, p in ref.named_parameters() if "lora_" in n}
        got = {n: p.detach() for n, p in reloaded.named_parameters() if "lora_" in n}
        res["reloaded_vs_ref"] = max_diff(got, ref_lora)
        res["reloaded_vs_gathered"] = max_diff(got, {k: gathered[k] for k in got})
    out["lora"] = res

    # -- bf16 mixed precision, ZeRO-2-like resharding, deeper prefetch (loose parity) ---------
    model, _, _, _, res = parity(rank, world, dims, mesh, steps=2, param_dtype=torch.bfloat16,
                                 reshard_after_forward=False, prefetch=2)
    res["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    out["bf16"] = res
    return out


def scenario_resume(rank, world, root):
    dims = ParallelDims(world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_model()
    apply_fsdp(model, fsdp_mesh(mesh, dims))
    opt = make_opt(model)
    out = {"incomplete_rejected": False}
    try:
        load_sharded(model, opt, os.path.join(root, "step_3"))
    except FileNotFoundError:
        out["incomplete_rejected"] = True
    latest = latest_complete_checkpoint(root)
    out["latest"] = os.path.basename(latest) if latest else None
    extra = load_sharded(model, opt, latest)
    restore_rng_state(extra["rng"])
    out["resumed_step"] = extra["step"]
    out["losses"] = [dist_step(model, opt, s, rank, dims.dp_size)
                     for s in range(extra["step"], 4)]
    return out


def scenario_hsdp(rank, world, root):
    dims = ParallelDims(dp_replicate=2, dp_shard=2, world_size=world)
    mesh = dims.build_mesh("cpu")
    _, _, _, _, res = parity(rank, world, dims, mesh, steps=2)
    out = {"hsdp": res, "expected_placements": str((Replicate(), Shard(0)))}

    # sharded loading onto the 2-D mesh
    from transformers import AutoModelForCausalLM

    hf_dir = os.path.join(root, "hsdp_src")
    if rank == 0:
        build_model().save_pretrained(hf_dir)
    dist.barrier()
    sharded = from_pretrained_sharded(hf_dir, fsdp_mesh(mesh, dims))
    got = full_params(sharded)
    if rank == 0:
        normal = AutoModelForCausalLM.from_pretrained(hf_dir)
        out["loading_vs_from_pretrained"] = max_diff(got, {n: p.detach() for n, p in normal.named_parameters()})

    # cp and ep axes: validated and present in the mesh even though nothing uses them yet
    d2 = ParallelDims(cp=2, ep=2, world_size=world)
    d2.build_mesh("cpu")
    views = {
        name: d2.get_mesh(name).mesh.flatten().tolist()
        for name in ("dp_shard", "cp", "dp", "dp_shard_cp", "dp_cp")
    }
    em = expert_mesh(d2)
    views["ep"] = em["ep"].mesh.flatten().tolist()
    views["efsdp"] = em["efsdp"].mesh.flatten().tolist()
    views["hsdp_mesh"] = list(fsdp_mesh(mesh, dims).mesh.shape)
    with warnings.catch_warnings():  # a mesh not built by these dims: sliced by axis name
        warnings.simplefilter("ignore")
        by_name = fsdp_mesh(mesh, ParallelDims(dp_replicate=2, world_size=world))
    views["by_name"] = [list(by_name.mesh.shape), list(by_name.mesh_dim_names)]
    gathered = [None] * world
    dist.all_gather_object(gathered, views)
    out["views"] = gathered
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["main", "resume", "hsdp"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    fn = {"main": scenario_main, "resume": scenario_resume, "hsdp": scenario_hsdp}[args.scenario]
    result = fn(rank, world, args.root)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
