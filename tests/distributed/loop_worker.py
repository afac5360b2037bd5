"""Runs an example accelerate loop's main() as it is (examples/custom_loop.py, or --script another, such as the
diffusion LoRA scripts), watched from outside: the loop is the user's, unchanged; this worker only records, per rank,
the sequence length its attention layers see and how the parameters are placed (DTensor placements) once
Accelerator.prepare returned, then writes them with the loop's losses as JSON.

    loop_worker.py --out OUT.json [--script examples/diffusion/train_text_to_video_lora.py] -- <the loop's arguments>
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
_script = Path(sys.argv[sys.argv.index("--script") + 1]) if "--script" in sys.argv else REPO / "examples/custom_loop.py"
sys.path.insert(0, str(_script.resolve().parent))
_spec = importlib.util.spec_from_file_location(_script.stem, _script)
loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop)  # imports mindspeed_hf first, as the script does

from accelerate import Accelerator  # noqa: E402
from torch import nn  # noqa: E402

SEEN: dict[str, object] = {"attention_lengths": set(), "placements": {}, "dtensor_params": [0, 0]}


def _watch(module: nn.Module) -> None:
    for name, param in module.named_parameters():
        placements = getattr(param, "placements", None)
        SEEN["dtensor_params"][0] += placements is not None
        SEEN["dtensor_params"][1] += 1
        if name.endswith(("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight")) or (
                "experts" in name and name.endswith("gate_up_proj")):
            SEEN["placements"][name] = [repr(p) for p in placements] if placements else None
    for sub in module.modules():
        if type(sub).__name__.endswith("Attention"):
            sub.register_forward_pre_hook(
                lambda m, args, kwargs: SEEN["attention_lengths"].add(
                    (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1]),
                with_kwargs=True)


def _kills() -> None:
    """Fault injection for the crash tests: LOOP_KILL_AFTER_STEP=N kills rank 0 (SIGKILL) once step N is logged;
    LOOP_KILL_IN_SAVE=NAME kills rank 0 inside the save of directory NAME, after every shard is written and before
    the COMPLETE marker."""
    import signal

    from mindspeed_hf.runtime import state

    after, in_save = os.environ.get("LOOP_KILL_AFTER_STEP"), os.environ.get("LOOP_KILL_IN_SAVE")
    if os.environ.get("RANK", "0") != "0":
        return
    if after:
        write = loop.JsonLines.write

        def write_then_die(self, **record):
            write(self, **record)
            if record.get("step") == int(after):
                os.kill(os.getpid(), signal.SIGKILL)

        loop.JsonLines.write = write_then_die
    if in_save:
        finish = state.finish

        def die_before_marking(directory: str) -> None:
            if os.path.basename(directory) == in_save:
                os.kill(os.getpid(), signal.SIGKILL)
            finish(directory)

        state.finish = die_before_marking


def main() -> None:
    split = sys.argv.index("--")
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    loop_args = sys.argv[split + 1:]
    losses = out.with_suffix(".losses.jsonl")
    prepare = Accelerator.prepare

    def watched(self, *args, **kwargs):
        result = prepare(self, *args, **kwargs)
        for obj in result if isinstance(result, tuple) else (result,):
            if isinstance(obj, nn.Module):
                _watch(obj)
        return result

    Accelerator.prepare = watched
    _kills()
    sys.argv = [_script.name, *loop_args, "--losses_file", str(losses)]
    loop.main()
    rank = int(os.environ.get("RANK", "0"))
    record = {"attention_lengths": sorted(SEEN["attention_lengths"]), "placements": SEEN["placements"],
              "dtensor_params": SEEN["dtensor_params"]}
    Path(f"{out}.rank{rank}").write_text(json.dumps(record))
    if rank == 0:
        steps = [r for r in map(json.loads, losses.read_text().splitlines()) if "loss" in r]
        out.write_text(json.dumps({"losses": [s["loss"] for s in steps], "steps": [s["step"] for s in steps]}))


if __name__ == "__main__":
    main()
