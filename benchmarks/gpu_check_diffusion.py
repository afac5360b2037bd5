"""GPU check of the diffusion families (run where a CUDA device is present): each tiny denoiser of
tests/tiny_denoisers.py on the GPU, plain diffusers vs mindspeed_hf (backend auto -> cuda), fp32 and bf16: loss
difference and the worst gradient error relative to each tensor's largest entry, and what ran.

    python benchmarks/gpu_check_diffusion.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("MINDSPEED_HF_AUTO", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402


def main() -> None:
    import tiny_denoisers as T

    import mindspeed_hf

    device = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        for name in T.FAMILIES:
            tiny = T.FAMILIES[name]()
            tiny.model.to(device, dtype)
            kwargs, target, weighting = T.noisy_batch(tiny)
            move = {k: v.to(device, dtype) if torch.is_floating_point(v) else v.to(device)
                    for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            kwargs = {**kwargs, **move}
            for k, v in kwargs.items():
                if isinstance(v, dict):
                    kwargs[k] = {a: b.to(device, dtype) for a, b in v.items()}
            batch = (kwargs, target.to(device), weighting.to(device))
            want = T.loss_and_grads(tiny, batch)
            mindspeed_hf.enable()
            report = mindspeed_hf.apply_to_model(tiny.model)
            got = T.loss_and_grads(tiny, batch)
            ran = mindspeed_hf.report(tiny.model)["ran"]
            mindspeed_hf.disable()
            err = max(float((got[1][n].float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6))
                      for n, w in want[1].items())
            diff = abs(float(got[0] - want[0]))
            print(f"{str(dtype):15} {name:14} backend={report['backend']:5} loss diff {diff:.2e} grad rel err "
                  f"{err:.2e} ran {ran}", flush=True)


if __name__ == "__main__":
    main()
