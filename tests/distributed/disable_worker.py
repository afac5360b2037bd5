"""Worker for tests/distributed/test_disable.py (torchrun, 2 ranks, gloo, CPU): in ONE process, mindspeed_hf enabled,
a plain Trainer with context parallelism (cp=2) trains 2 steps, then one with tensor parallelism (tp=2; transformers
>= 5), then disable(). Rank 0 writes what differs from the snapshot taken before enable() (tests/snapshots.py:
every attribute of transformers' model modules and their classes, Trainer, TrainingArguments, and the attention,
mask and experts registries) and which axes ran, to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models, snapshots
from snapshots import changed, transformers_symbols  # noqa: E402
from tiny_models import tiny_model  # noqa: E402
from trainer_worker import collate, dataset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    import transformers
    from transformers import Trainer

    import mindspeed_hf  # launched with MINDSPEED_HF_AUTO=0: nothing is patched yet
    from mindspeed_hf.trainers import MindSpeedTrainingArguments, run_of

    axes = [("cp", "llama")] + ([("tp", "qwen3")] if int(transformers.__version__.split(".")[0]) >= 5 else [])
    for _, family in axes:  # what building a model sets in transformers itself (lazy imports, class-level caches)
        tiny_model(family, use_cache=False)
    before = transformers_symbols()
    mindspeed_hf.enable()
    ran = {}
    for axis, family in axes:
        args = MindSpeedTrainingArguments(output_dir=f"{opts.out}.{axis}", max_steps=2, per_device_train_batch_size=4,
                                          report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True,
                                          **{f"mindspeed_{axis}": 2})
        trainer = Trainer(model=tiny_model(family, use_cache=False), args=args, train_dataset=dataset(),
                          data_collator=collate)
        trainer.train()
        dims = run_of(trainer).dims
        ran[axis] = {"size": getattr(dims, axis), "attention": trainer.model.config._attn_implementation}
    mindspeed_hf.disable()
    if trainer.args.process_index == 0:
        with open(opts.out, "w") as f:
            json.dump({"ran": ran, "changed": changed(before, transformers_symbols())}, f)


if __name__ == "__main__":
    main()
