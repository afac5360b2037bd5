"""Activation memory and step time of one training step of a DiT denoiser: recompute none / selective / full and
activation offload per transformer block, side by side; or one process against cp ranks (fp32, CPU, the torch
backend: the torch_npu stand-in keeps attention probabilities for backward that the device kernel does not).

    python benchmarks/bench_diffusion_memory.py                    # Flux shape: 2 double + 4 single blocks, width
                                                                   # 256, 1024 image + 128 text tokens
    python benchmarks/bench_diffusion_memory.py --family wan       # Wan shape: 4 blocks, width 256, 8x32x32 video
                                                                   # latents (2048 tokens after 1x2x2 patches)
    python benchmarks/bench_diffusion_memory.py --family wan --cp 2   # activation memory per rank: one process vs
                                                                      # cp=2 ranks (torchrun, gloo; ring)

Each variant runs in its own process (same model, seed and batch), after a warm-up step that allocates the
gradients. Columns as benchmarks/bench_recompute.py: `kept` (the storages the forward leaves alive for backward,
mindspeed_hf.memory.measure), `saved_tensors_hooks` bytes, the step's peak RSS over the resident size, and forward +
backward time. Offload copies what the chosen blocks save to host memory; on a CPU host memory is the same memory,
so its row shows what leaves the device (the saved bytes) rather than a lower RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OFFLOAD = {"offload_activations": True}
VARIANTS = {"none": {}, "selective": {"recompute": "selective"}, "full": {"recompute": "full"}, "offload": OFFLOAD,
            "offload+full": {**OFFLOAD, "recompute": "full"}}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _model_and_inputs(family: str):
    import torch
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if family == "flux":
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
                                       attention_head_dim=64, num_attention_heads=4, joint_attention_dim=256,
                                       pooled_projection_dim=256, axes_dims_rope=(16, 24, 24))
        ids = torch.zeros(32, 32, 3)
        ids[..., 1], ids[..., 2] = torch.arange(32)[:, None], torch.arange(32)[None, :]
        inputs = dict(hidden_states=torch.randn(1, 1024, 64, generator=gen),
                      encoder_hidden_states=torch.randn(1, 128, 256, generator=gen),
                      pooled_projections=torch.randn(1, 256, generator=gen), timestep=torch.tensor([0.5]),
                      img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(128, 3))
    else:
        model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64,
                                      in_channels=16, out_channels=16, text_dim=256, freq_dim=64, ffn_dim=1024,
                                      num_layers=4, rope_max_seq_len=64)
        inputs = dict(hidden_states=torch.randn(1, 16, 8, 32, 32, generator=gen),
                      encoder_hidden_states=torch.randn(1, 128, 256, generator=gen), timestep=torch.tensor([500]))
    return model.train(), inputs


def child(args) -> None:
    import torch

    import mindspeed_hf
    from mindspeed_hf.config import config_from_dict
    from mindspeed_hf.memory.measure import measure_forward
    from mindspeed_hf.parallel.parallelize import parallelize

    torch.set_num_threads(args.threads)
    model, inputs = _model_and_inputs(args.family)
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    config = config_from_dict({"backend": args.backend, "memory": VARIANTS[args.variant],
                               "parallel": {"cp": cp, "dp_shard": 1}})
    mindspeed_hf.enable(config)
    mindspeed_hf.apply_to_model(model, config)
    parallelize(model, None, config)
    if cp > 1:  # the cp step alone (no FSDP2): what each rank keeps of the split sequence
        from mindspeed_hf.parallel import ParallelDims, init_distributed
        from mindspeed_hf.parallel.parallelize import ParallelizeOptions, apply_cp

        init_distributed("cpu")
        dims = ParallelDims(cp=cp, dp_shard=1, world_size=cp)
        dims.build_mesh("cpu")
        apply_cp(model, dims, config, ParallelizeOptions())

    def loss() -> torch.Tensor:
        return model(**inputs, return_dict=False)[0].float().pow(2).mean()

    loss().backward()  # warm-up: allocates the gradients
    before = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    value, kept = measure_forward(model, loss)
    value.backward()
    peak = _rss("VmHWM") - before
    del value
    start = time.perf_counter()
    loss().backward()
    if cp == 1 or torch.distributed.get_rank() == 0:
        print(json.dumps({"variant": args.variant, "kept": kept.alive_bytes, "saved": kept.saved_bytes,
                          "peak": peak, "seconds": time.perf_counter() - start}), flush=True)


def _run(args, variant: str, cp: int = 1) -> dict:
    env = {**os.environ, "MINDSPEED_HF_AUTO": "0", "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests" / "npu_standin")
                                                        if args.backend == "npu" else "",
                                                        os.environ.get("PYTHONPATH")]))}
    launcher = [sys.executable] if cp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 f"--nproc_per_node={cp}"]
    cmd = [*launcher, __file__, "--child", variant, "--family", args.family, "--threads", str(args.threads),
           "--backend", args.backend]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))


def table(args, rows: dict[str, dict]) -> str:
    base, mib = rows["none"], 2 ** 20
    shape = ("Flux: 2 double + 4 single blocks, width 256 (4 heads x 64), 1024 image + 128 text tokens"
             if args.family == "flux" else "Wan: 4 blocks, width 256 (4 heads x 64), 8x32x32 latents = 2048 video "
             "tokens, 128 text tokens")
    lines = [f"# diffusers DiT: recompute / activation offload per block (CPU, fp32, batch 1, {shape}, {args.backend} "
             f"backend, {args.threads} thread(s))", "",
             "| memory | kept for backward (MiB) | ratio | saved_tensors_hooks (MiB) | ratio | step peak over resident "
             "(MiB) | ratio | forward+backward (s) | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['kept'] / mib:.1f} | {r['kept'] / base['kept']:.2f}x | {r['saved'] / mib:.1f} | "
                     f"{r['saved'] / base['saved']:.2f}x | {r['peak'] / mib:.0f} | {r['peak'] / base['peak']:.2f}x | "
                     f"{r['seconds']:.2f} | {r['seconds'] / base['seconds']:.2f}x |")
    lines += ["", "selective = memory.recompute_modules default (attention_core, mlp) in every block; full = every "
              "block recomputed whole; offload = memory.offload_activations (every block but the last).", "",
              f"Produced by `python benchmarks/bench_diffusion_memory.py --family {args.family} --backend "
              f"{args.backend}`; each variant in its own process."]
    return "\n".join(lines) + "\n"


def cp_table(args, rows: dict[str, dict]) -> str:
    base, mib = rows["one process"], 2 ** 20
    lines = [f"# diffusers {args.family}: activation memory per rank under context parallelism (CPU, fp32, batch 1, "
             f"{args.backend} backend, ring attention over gloo)", "",
             "| run | kept for backward (MiB) | ratio | saved_tensors_hooks (MiB) | ratio | forward+backward (s) |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['kept'] / mib:.1f} | {r['kept'] / base['kept']:.2f}x | {r['saved'] / mib:.1f} | "
                     f"{r['saved'] / base['saved']:.2f}x | {r['seconds']:.2f} |")
    lines += ["", "Rank 0's figures; each rank keeps its share of the video tokens (the model's own _cp_plan split), "
              "the text and the timestep embedding whole.", "",
              f"Produced by `python benchmarks/bench_diffusion_memory.py --family {args.family} --cp {args.cp} "
              f"--backend {args.backend}`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--family", choices=("flux", "wan"), default="flux")
    # torch by default: the npu stand-in's attention keeps its probabilities ([S, S] per head) for backward, which
    # the device kernel does not, so its memory is no measure of the NPU's
    parser.add_argument("--backend", choices=("torch", "npu"), default="torch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1, help="compare one process with cp ranks (no recompute)")
    parser.add_argument("--out", default=None, help="markdown file to write (default: benchmarks/results/"
                        "diffusion_memory_<family>_cpu.md), or - for none")
    args = parser.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    if args.cp > 1:
        rows = {"one process": _run(args, "none"), f"cp={args.cp}, per rank": _run(args, "none", args.cp)}
        text = cp_table(args, rows)
        name = f"diffusion_cp_memory_{args.family}_cpu.md"
    else:
        rows = {variant: _run(args, variant) for variant in VARIANTS}
        text = table(args, rows)
        name = f"diffusion_memory_{args.family}_cpu.md"
    print(text)
    out = args.out or str(REPO / "benchmarks" / "results" / name)
    if out != "-":
        Path(out).write_text(text)


if __name__ == "__main__":
    main()
