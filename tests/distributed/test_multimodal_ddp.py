"""A plain Trainer script on a tiny Qwen2.5-VL under DDP (2 ranks, gloo, CPU, no parallel sizes) with gradient
checkpointing, rows with images of different grids and rows without: Trainer then builds DDP with
find_unused_parameters=False, and a rank whose rows have no image leaves the tower's gradients unreduced (without
mindspeed_hf's placeholder the run hangs in its second step: seen); with mindspeed_hf it
runs the tower on a placeholder (parallel/towers.py) and equals one plain-HF process on the same global batches
(losses, grad norms, every parameter after 3 SGD steps, 1e-5; the loss a token mean over the ranks on both sides).
The DeepSpeed ZeRO-3 case: test_deepspeed.py."""

from __future__ import annotations

from pathlib import Path

from child_runs import assert_trained_alike, run_trainer_worker

WORKER = Path(__file__).resolve().parent / "vlm_context_worker.py"


def test_ddp_with_checkpointing_on_rows_of_mixed_media_equals_one_process(tmp_path):
    data = ("--token-mean", "--checkpointing")
    want = run_trainer_worker(WORKER, tmp_path, "reference", "reference", *data)
    # then a no_grad forward on rank 0 alone, as a sample-generating callback makes: no media sync, no hang
    run = run_trainer_worker(WORKER, tmp_path, "ddp", "sharded", "--dp", "2", *data, "--rank0-forward",
                             config="backend: torch\n")
    assert run["dp"] == 1, run  # no mesh of ours: Trainer's DDP
    assert run["placeholders"]["pixel_values"] > 0, run["placeholders"]
    assert run["ran"]["fused_linear_cross_entropy"] > 0
    assert_trained_alike(run, want, 1e-5)
