"""The memory report (`mindspeed-hf bench --memory`): for the configured run, the peak memory of one training step
split into parameters, gradients, optimizer state and activations, with recompute off, selective, full, and with
activation offload, so a user can choose.

Each setting gets a fresh model (the run's seed), the run's accelerator settings with only the memory mode changed
(recompute_modules, recompute_layers, offload_layers and offload_min_bytes stay as configured), one batch of
`per_device_train_batch_size` rows of the run's training data and torch's AdamW. A warm-up step allocates the
gradients, the optimizer state and the offload host buffers; then one step is measured:

- on NPU / CUDA, activations are the allocator's peak over forward + backward minus what was allocated before it;
- on the CPU (no allocator statistics), they are the bytes the forward keeps for backward on the device
  (memory/measure.py: every storage the forward created that is alive when it returns), less what offload freed.

Parameters, gradients and optimizer state are the bytes of their tensors. The step peak is their sum with the
activations. The loss of the measured step is printed too: it is the same in every row.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..config import MindSpeedConfig
from ..device import detect_device_type, device_module, reset_peak_memory
from ..recipes.run_config import RunConfig, build_training_args, load_run_config
from ..releases import compat

#: The memory settings compared, as changes to the run's memory section.
MODES: dict[str, dict[str, Any]] = {
    "off": {"recompute": False, "offload_activations": False},
    "selective": {"recompute": "selective", "offload_activations": False},
    "full": {"recompute": True, "offload_activations": False},
    "offload": {"recompute": False, "offload_activations": True},
}


@dataclass(frozen=True)
class StepMemory:
    """One memory setting's figures (bytes), and the measured step's loss."""

    mode: str
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    offloaded: int
    loss: float

    @property
    def peak(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations


def _tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages of `tensors` (DTensors by their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            seen[compat.storage_key(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def mode_config(base: MindSpeedConfig, mode: str) -> MindSpeedConfig:
    """The run's config with the memory mode `mode` (one of MODES)."""
    return dataclasses.replace(base, memory=dataclasses.replace(base.memory, **MODES[mode]))


def _batch(run: RunConfig, rows: int, seed: int, tokenizer: Any, device: torch.device) -> dict[str, torch.Tensor]:
    from ..recipes.data import PaddingCollator, split_rows, tokenize_rows

    examples = tokenize_rows(split_rows(run.data, seed)[0], tokenizer, run.data)[:rows]
    return {k: v.to(device) for k, v in PaddingCollator(tokenizer.pad_token_id)(examples).items()}


def measure_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], learning_rate: float,
                 device_type: str) -> tuple[int, int, int, int, int, float]:
    """(parameters, gradients, optimizer state, activations, offloaded, loss) of one training step of `model`
    (prepared: parallelize applied), after a warm-up step; see the module docstring."""
    from ..memory import offloader_of
    from ..memory.measure import measure_forward

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
    model(**batch).loss.backward()  # warm-up: gradients, optimizer state, host buffers
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    offloader = offloader_of(model)
    module = device_module(device_type)
    if module is not None:
        module.synchronize()
        reset_peak_memory(device_type)
        before = module.memory_allocated()
        loss = model(**batch).loss
        offloaded = offloader.offloaded_bytes if offloader is not None else 0
        loss.backward()
        module.synchronize()
        activations = module.max_memory_allocated() - before
    else:
        loss, kept = measure_forward(model, lambda: model(**batch).loss)
        offloaded = offloader.offloaded_bytes if offloader is not None else 0
        # measure counts every storage an op wrote into as the forward's: the offload host buffers (allocated in
        # the warm-up, every one written again in this forward) are host memory, and the freed storages hold none
        host = sum(pool.held_bytes for pool in offloader.pools.values()) if offloader is not None else 0
        activations = kept.alive_bytes - offloaded - host
        loss.backward()
    state = [t for s in optimizer.state.values() for t in s.values()]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return (_tensor_bytes(model.parameters()), _tensor_bytes(grads), _tensor_bytes(state), activations, offloaded,
            float(loss.detach()))


def measure_modes(run: RunConfig, args: Any, modes: list[str] | None = None) -> list[StepMemory]:
    """StepMemory of each memory setting in `modes` (default: all of MODES) for the run."""
    from transformers import set_seed

    import mindspeed_hf

    from ..parallel.parallelize import parallelize
    from ..recipes.text import build_model, load_tokenizer

    device_type = detect_device_type()
    device = torch.device(device_type)
    mindspeed_hf.enable(run.mindspeed)
    tokenizer = load_tokenizer(run.model)
    batch = _batch(run, args.per_device_train_batch_size, args.seed, tokenizer, device)
    rows = []
    for mode in modes or list(MODES):
        config = mode_config(run.mindspeed, mode)
        set_seed(args.seed)
        model = build_model(run.model, tokenizer).to(device).train()
        mindspeed_hf.apply_to_model(model, config)
        model = parallelize(model, None, config)
        rows.append(StepMemory(mode, *measure_step(model, batch, args.learning_rate, device_type)))
        del model
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def format_report(rows: list[StepMemory], heading: str, device_type: str) -> str:
    """The markdown table `memory_report` prints."""
    base = next((r for r in rows if r.mode == "off"), rows[0])
    lines = [heading, "",
             "| memory setting | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | activations (MiB) | "
             "activations vs off | step peak (MiB) | step peak vs off | offloaded (MiB) | loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.mode} | {_mib(r.parameters)} | {_mib(r.gradients)} | {_mib(r.optimizer_state)} | "
                     f"{_mib(r.activations)} | {r.activations / max(base.activations, 1):.2f}x | {_mib(r.peak)} | "
                     f"{r.peak / max(base.peak, 1):.2f}x | {_mib(r.offloaded)} | {r.loss:.6f} |")
    how = ("the allocator's peak over forward + backward" if device_type != "cpu" else
           "the bytes the forward keeps on the device for backward (on the CPU the offloaded copies live in the "
           "same RAM: offload lowers the device figure, not the process's)")
    lines += ["", f"activations: {how}. Choose selective when activations almost fit, full when they do not, offload "
              "when host memory and copy bandwidth are free (it can combine with either; memory.offload_min_bytes "
              "skips small tensors)."]
    return "\n".join(lines)


def memory_report(config: str | None, overrides: list[str]) -> int:
    """Print the memory report for the run YAML `config` (None: the embedded default run) with `--key value`
    TrainingArguments overrides; returns the exit status (2 for a configuration error, named in one line)."""
    try:
        run = load_run_config(config)
        args = build_training_args(run, overrides, accelerated=True)
    except (ValueError, FileNotFoundError) as err:
        print(f"mindspeed-hf bench --memory: {err}", file=sys.stderr)
        return 2
    device_type = detect_device_type()
    rows = measure_modes(run, args)
    first = rows[0]
    heading = (f"mindspeed-hf bench --memory: {run.source}, one training step of {args.per_device_train_batch_size} "
               f"rows on {device_type} ({run.model.dtype}); parameters {_mib(first.parameters)} MiB")
    report = format_report(rows, heading, device_type)
    if any(r.mode == "offload" and r.offloaded == 0 for r in rows):
        report += (f" Here no saved tensor reached memory.offload_min_bytes={run.mindspeed.memory.offload_min_bytes}, "
                   "so offload moved nothing.")
    print(report, flush=True)
    return 0
