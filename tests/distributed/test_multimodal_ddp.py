"""A plain Trainer script on a tiny Qwen2.5-VL under DDP (2 ranks, gloo, CPU, no parallel sizes) with gradient
checkpointing, rows with images of different grids and rows without: Trainer then builds DDP with
find_unused_parameters=False, and a rank whose rows have no image leaves the tower's gradients unreduced (without
mindspeed_hf's placeholder the run hangs in its second step: seen); with mindspeed_hf it
runs the tower on a placeholder (parallel/towers.py) and equals one plain-HF process on the same global batches
(losses, grad norms, every parameter after 3 SGD steps, 1e-5; the loss a token mean over the ranks on both sides).
The DeepSpeed ZeRO-2 and ZeRO-3 cases: test_deepspeed.py. And a model outside the tested placeholders: one line on
every rank."""

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


def _media_rank(rank: int, port: int, errors) -> None:
    """One of 2 gloo ranks: a tiny Qwen2.5-VL taken as a model outside PLACEHOLDER_MODELS, rank 0's row with its
    images, rank 1's without; the error each rank raised (or None) into `errors`."""
    import sys

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_vlms import pad_rows, tiny_vlm, vlm_rows

    from mindspeed_hf.parallel import towers

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        towers.PLACEHOLDER_MODELS = ("llava",)
        model = tiny_vlm("qwen2_5_vl")
        assert towers.keep_media_in_step(model, model, torch.device("cpu")) == "check"
        rows = [row for row in vlm_rows(model) if ("pixel_values" in row) == (rank == 0)][:1]
        try:
            model(**pad_rows(rows))
            errors[rank] = None
        except ValueError as error:
            errors[rank] = str(error)
    finally:
        dist.destroy_process_group()


def test_a_model_without_tested_placeholders_stops_in_one_line():
    """A multimodal model outside PLACEHOLDER_MODELS, its ranks' media different: every rank raises the same one-line
    error before the forward (naming each rank's media and the tested models), instead of a collective mismatch."""
    import torch.multiprocessing as mp

    from mindspeed_hf.parallel.dims import _free_port

    errors = mp.Manager().dict()
    mp.spawn(_media_rank, args=(_free_port(), errors), nprocs=2)
    assert errors[0] == errors[1] and "\n" not in errors[0], dict(errors)
    assert errors[0].startswith("this step's micro-batches carry different media on the ranks (rank 0: pixel_values; "
                                "rank 1: none), and qwen2_5_vl's towers have no tested placeholders"), errors[0]
