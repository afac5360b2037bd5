"""Device-independent proxies for `mindspeed-hf bench`: what one training step (forward + backward + optimizer
step, as Trainer runs it) dispatches and keeps, counted rather than timed, so that machine load cannot move them.

- `aten_ops`: operators that reach the dispatcher below autograd (a TorchDispatchMode sees each once), outside any
  torch_npu call and its backward: a torch_npu call is one kernel, not the ops a stand-in computes it with.
- `npu_calls`: calls of torch_npu's `npu_*` functions (the kernels the NPU path launches from Python), plus one
  backward kernel (`<name>.backward`) for each call whose autograd nodes run in the backward.
- `saved_bytes`: distinct non-parameter storages autograd saves for backward (memory/measure.py's SavedStorages),
  measured on the NEXT step: its saved-tensor hooks make autograd dispatch one `detach` per saved tensor when the
  backward unpacks it, which a step that is not being measured never runs, so they must not be in the op counts.
- `largest_alloc_bytes`: the largest storage an operator created (an output storage none of its inputs had).

The same code on the same inputs gives the same counts. `counted_run` (what `mindspeed-hf bench` runs in a child
process, bench_child.py) runs three steps of the `train` run: the first creates the optimizer state, the second is
counted, the third's saved tensors measured.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import TrainerCallback

from ..device import import_torch_npu
from ..memory.measure import SavedStorages
from ..releases import compat

COUNTED_STEP = 2  # step 1 creates the optimizer state (one-time ops); step 2 is what every later step does
SAVED_STEP = COUNTED_STEP + 1  # the step whose saved tensors are measured (hooks of their own: see above)
PROFILE_STEPS = 3  # steps traced after the counted one with --profile


def _storages(tree: Any) -> set[int]:
    return {compat.storage_key(t.untyped_storage()) for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


def _nodes_between(outputs: Any, inputs: Any) -> list[Any]:
    """The autograd nodes a call created: reachable from its outputs' grad_fn without passing an input's grad_fn
    or a leaf's AccumulateGrad."""
    stop = {t.grad_fn for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    todo = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    found: dict[Any, None] = {}
    while todo:
        node = todo.pop()
        if node is None or node in stop or node in found or type(node).__name__ == "AccumulateGrad":
            continue
        found[node] = None
        todo.extend(child for child, _ in node.next_functions)
    return list(found)


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while active (by op name) and records the largest storage any of them
    created. A torch_npu call (wrap_npu) counts as one kernel, and the backward of its autograd nodes as one more
    (`<name>.backward`), however many aten ops a stand-in computes them with."""

    def __init__(self) -> None:
        super().__init__()
        self.aten: Counter[str] = Counter()
        self.npu: Counter[str] = Counter()
        self.largest = 0
        self.inside_npu = 0
        self._backward_of: dict[Any, tuple[str, int]] = {}  # autograd node -> the npu call that created it
        self._backward_calls: set[tuple[str, int]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        call = self._backward_of.get(compat.current_autograd_node())
        if call is not None:
            if call not in self._backward_calls:
                self._backward_calls.add(call)
                self.npu[f"{call[0]}.backward"] += 1
        elif not self.inside_npu:
            self.aten[str(func.overloadpacket)] += 1
        inputs = _storages((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if compat.storage_key(storage) not in inputs:
                    self.largest = max(self.largest, storage.nbytes())
        return out

    def wrap_npu(self, name: str, fn: Any) -> Any:
        """`fn` (a torch_npu function) counted as one kernel call; the ops inside it are not aten counts."""

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.npu[name] += 1
            self.inside_npu += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self.inside_npu -= 1
            for node in _nodes_between(out, (args, kwargs)):
                self._backward_of[node] = (name, self.npu[name])
            return out

        return counted


@contextlib.contextmanager
def _npu_counted(counter: OpCounter) -> Iterator[None]:
    """Route torch_npu's `npu_*` functions through the counter while active (where torch_npu loads: the kernels
    look them up as module attributes at each call)."""
    module = import_torch_npu()
    names = [n for n in dir(module) if n.startswith("npu_") and callable(getattr(module, n))] if module else []
    originals = {n: getattr(module, n) for n in names}
    try:
        for name, fn in originals.items():
            setattr(module, name, counter.wrap_npu(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


@contextlib.contextmanager
def count_step(model: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """Count the kernels run inside the block (see the module docstring); the yielded dict is filled on exit with
    torch_npu (the module's file, or None), aten_ops, aten_by_op, npu_calls, npu_by_op, largest_alloc_bytes."""
    counts: dict[str, Any] = {}
    counter = OpCounter()
    with _npu_counted(counter), counter:
        yield counts
    module = import_torch_npu()
    counts.update(torch_npu=None if module is None else str(getattr(module, "__file__", "torch_npu")),
                  aten_ops=sum(counter.aten.values()), aten_by_op=dict(sorted(counter.aten.items())),
                  npu_calls=sum(counter.npu.values()), npu_by_op=dict(sorted(counter.npu.items())),
                  largest_alloc_bytes=counter.largest)


@contextlib.contextmanager
def measure_saved(model: torch.nn.Module, counts: dict[str, Any]) -> Iterator[None]:
    """Record in `counts` what autograd saves for backward inside the block: saved_bytes, saved_tensors (a step
    of its own: the hooks that see the saved tensors add ops to the backward)."""
    saved = SavedStorages(model)
    with saved.hooks():
        yield
    counts.update(saved_bytes=saved.nbytes, saved_tensors=saved.count)


def count_model_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], lr: float = 1e-3,
                     optimizer: torch.optim.Optimizer | None = None,
                     max_grad_norm: float | None = None) -> dict[str, Any]:
    """count_step of one training step of `model` on `batch` (forward with labels, backward, gradient clipping when
    `max_grad_norm` is set, the optimizer step: `optimizer`, else AdamW at `lr`), after one uncounted step that
    creates the optimizer state; then measure_saved of one more step."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        model(**batch).loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with count_step(model) as counts:
        step()
    with measure_saved(model, counts):
        step()
    return counts


class StepCounter(TrainerCallback):
    """Counts one Trainer step (on_step_begin .. on_step_end: forward, backward, clipping, optimizer step) and
    measures the saved tensors of the next one."""

    def __init__(self, step: int = COUNTED_STEP) -> None:
        self.step = step
        self.counts: dict[str, Any] | None = None
        self._stack: contextlib.ExitStack | None = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            self._stack = contextlib.ExitStack()
            self.counts = self._stack.enter_context(count_step(model))
        elif state.global_step == self.step and self.counts is not None:
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(measure_saved(model, self.counts))

    def on_step_end(self, args, state, control, **kwargs):
        if self._stack is not None:
            self._stack.close()
            self._stack = None


def counted_run(config: str | None, overrides: list[str], out: str, profile: str | None = None,
                profile_steps: int = PROFILE_STEPS) -> dict[str, Any]:
    """Three steps of the `train` run (accelerated or not, per MINDSPEED_HF_AUTO), the second counted and the
    third's saved tensors measured; writes
    the counts (plus model_type and applied kernels) to `out` as JSON and returns them. With `profile`, then
    `profile_steps` more steps under the profiler, traced into that directory (bench_profile)."""
    from ..recipes.run_config import load_run_config
    from ..recipes.text import run_training, training_args_for
    from .profile import ProfileCallback

    run = load_run_config(config)
    steps = SAVED_STEP + (profile_steps if profile else 0)
    args = training_args_for(run, [*overrides, "--max_steps", str(steps), "--logging_steps", "1",
                                   "--save_strategy", "no", "--disable_tqdm", "true"])
    counter = StepCounter()
    callbacks: list[Any] = [counter, *([ProfileCallback(profile, after_step=SAVED_STEP)] if profile else [])]
    result = run_training(run, args, quality_eval=False, callbacks=callbacks)
    if counter.counts is None or "saved_bytes" not in counter.counts:
        raise RuntimeError(f"bench: the counted run ended before step {SAVED_STEP} (too few training rows?)")
    counts = {**counter.counts, "model_type": result["model_type"], "applied": result["applied"]}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(counts, indent=1))
    return counts
