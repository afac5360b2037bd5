"""DeepSpeed ZeRO-2 and ZeRO-3 inside HF Trainer after `import mindspeed_hf` (2 ranks, gloo, CPU), against the same
DeepSpeed training run as plain Hugging Face (fp32, 1e-5 per step and rank); checkpoint resume exact; ZeRO-2 with
the optimizer offloaded to the CPU. One torchrun launch of deepspeed_worker.py runs both stages (about 45 s on 2
cores). The refusal of our own parallelism together with DeepSpeed: test_deepspeed_refusal.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from child_runs import child_env, run_worker

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install mindspeed_hf[deepspeed])")
from deepspeed_worker import lora_under_zero3_trains  # noqa: E402

HERE = Path(__file__).resolve().parent
TOL = 1e-5
STAGES = ("zero2", "zero3")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepspeed")
    return run_worker(HERE / "deepspeed_worker.py", root / "out.json", *STAGES, "--root", str(root),
                      env=child_env(auto=True))


@pytest.fixture(params=STAGES)
def runs(request, results) -> tuple[str, dict]:
    return request.param, results[request.param]


def _assert_close(got: list[list[float]], want: list[list[float]], tol: float) -> None:
    assert len(got) == len(want) == 2, (got, want)
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w), (rank, g, w)
        diff = max(abs(a - b) for a, b in zip(g, w, strict=True))
        assert diff <= tol, f"rank {rank}: losses {g} vs {w} (max diff {diff:.2e})"


def test_runs_under_deepspeed_on_every_rank(runs):
    stage, result = runs
    for name in ("accelerated", "plain"):
        run = result[name]
        assert run["engine"] == "DeepSpeedEngine" and run["zero_stage"] == int(stage[-1]), run
        assert run["world_size"] == 2, f"{name}: accelerate counted {run['world_size']} process(es)"
    assert all(result["accelerated"]["kernels"][op] for op in ("rms_norm", "rope", "swiglu", "attention",
                                                               "fused_linear_cross_entropy"))
    assert not result["plain"]["kernels"]


def test_losses_match_plain_deepspeed(runs):
    _, result = runs
    _assert_close(result["accelerated"]["losses"], result["plain"]["losses"], TOL)


def test_fused_loss_runs_and_gathers_a_partitioned_head(runs):
    """HF's forward calls lm_head once per step on [B, S, H]; the fused loss never calls a local (ZeRO-2) head and
    calls a ZeRO-3 (partitioned) one per chunk of at most 8 rows, so ZeRO's hooks gather it."""
    stage, result = runs
    acc, plain = result["accelerated"], result["plain"]
    assert plain["head_inputs"] and all(len(shape) == 3 for shape in plain["head_inputs"])
    if stage == "zero2":
        assert acc["lm_head_numel"] > 0 and acc["head_inputs"] == []
    else:
        assert acc["lm_head_numel"] == 0, "the lm_head weight is not partitioned: zero.Init did not run"
        assert len(acc["head_inputs"]) > 4 and all(len(s) == 2 and s[0] <= 8 for s in acc["head_inputs"])


def test_resume_from_checkpoint_is_exact(runs):
    _, result = runs
    uninterrupted = [losses[2:] for losses in result["accelerated"]["losses"]]
    assert result["resumed"]["losses"] == uninterrupted


def test_optimizer_offload_matches(results):
    zero2 = results["zero2"]
    assert zero2["offload"]["cpu_offload"] and not zero2["accelerated"]["cpu_offload"]
    _assert_close(zero2["offload"]["losses"], zero2["accelerated"]["losses"], TOL)


@pytest.mark.skipif(not lora_under_zero3_trains(), reason="transformers 4.57 cannot train LoRA under ZeRO-3 without "
                    "mindspeed_hf either (its lr scheduler keeps the parameter groups DeepSpeed dropped)")
def test_lora_with_gradient_checkpointing_under_zero3_matches(results):
    """PEFT LoRA on a ZeRO-3-partitioned model, Trainer's gradient checkpointing on: the same losses as plain HF."""
    zero3 = results["zero3"]
    assert zero3["lora"]["zero_stage"] == 3 and zero3["lora"]["kernels"]["fused_linear_cross_entropy"]
    _assert_close(zero3["lora"]["losses"], zero3["plain_lora"]["losses"], TOL)
    assert zero3["lora"]["losses"] != zero3["accelerated"]["losses"]  # the adapters trained, not the base


# ZeRO-2 reduces the gradients of every parameter a backward reached: a rank with text rows only leaves the tower's
# unreduced (rows with images or none); ZeRO-3 gathers the tower's weights in every tower call: a rank with images but
# no videos calls it once less (rows with images, videos, both or neither)
MIXED_MEDIA = {"zero2": ("--token-mean",), "zero3": ("--token-mean", "--videos")}


@pytest.mark.parametrize("stage", STAGES)
def test_multimodal_rows_of_mixed_media_equal_one_process(tmp_path, stage):
    """A tiny Qwen2.5-VL under ZeRO-2 / ZeRO-3 on 2 ranks, a rank's rows lacking a medium the other rank's have: it
    would skip collectives of the tower (above; gloo: "Connection reset by peer"); with mindspeed_hf it runs the
    tower on a placeholder (parallel/towers.py), and the plain Trainer script equals one plain-HF process on the same
    global batches (losses, grad norms, every parameter after 3 SGD steps, 1e-5; the loss a token mean over the ranks
    on both sides)."""
    from child_runs import assert_trained_alike, run_trainer_worker

    worker = HERE / "vlm_context_worker.py"
    want = run_trainer_worker(worker, tmp_path, "reference", "reference", *MIXED_MEDIA[stage])
    run = run_trainer_worker(worker, tmp_path, stage, "sharded", "--dp", "2", "--deepspeed", stage,
                             *MIXED_MEDIA[stage], config="backend: torch\n")
    assert sum(run["placeholders"].values()) > 0, run["placeholders"]
    assert run["ran"]["fused_linear_cross_entropy"] > 0 and run["ran"]["vision_attention"] > 0
    assert_trained_alike(run, want, TOL)
