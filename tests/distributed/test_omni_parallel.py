"""The Omni thinkers under a plain Trainer script with the sizes only from MINDSPEED_HF_CONFIG (torchrun, gloo, CPU,
fp32): HSDP over the whole model (audio tower, vision tower, text layers; 4 ranks: 2 replicas of FSDP2 over 2),
FSDP2 on 2 ranks with expert parallelism (ep=2) on Qwen3-Omni's MoE thinker, and selective recompute / activation
offload, on rows of mixed media (audio + images, audio only, images only, text only: a rank lacking a medium another
rank has runs that tower on a placeholder), each equal to a single plain-HF process on the same global batches:
logged losses and grad norms over 3 clipped SGD steps and every parameter after them within 1e-5. The worker is
the VLM one (vlm_context_worker.py: rows from tests/tiny_omni.omni_rows). Context parallelism through the thinkers:
test_context_parallel_vlm.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from child_runs import assert_trained_alike, run_trainer_worker

WORKER = Path(__file__).resolve().parent / "vlm_context_worker.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("omni_parallel")


_references: dict[str, dict] = {}


@pytest.mark.parametrize(("name", "model", "config", "nproc", "dp"), [
    ("qwen2_5_omni_hsdp", "qwen2_5_omni_thinker", "parallel: {dp_replicate: 2, dp_shard: 2}\n", 4, 4),
    ("qwen3_omni_fsdp2_ep2", "qwen3_omni_moe_thinker", "parallel: {dp_shard: 2, ep: 2}\n", 2, 2),
    ("qwen2_5_omni_recompute_offload", "qwen2_5_omni_thinker",
     "memory: {recompute: selective, offload_activations: true, offload_min_bytes: 0}\n", 1, 1),
])
def test_plain_trainer_on_an_omni_thinker_equals_one_process(root, name, model, config, nproc, dp):
    # Rows of mixed media (audio + images, audio only, images only, text only: under FSDP2 a rank lacking a medium
    # another rank has runs that tower on a placeholder), and the loss a token mean over the dp ranks (the thinkers'
    # accepts_loss_kwargs=False would make Trainer average the ranks' own means), on both sides; one reference per
    # model
    data = ("--token-mean",)
    if model not in _references:
        _references[model] = run_trainer_worker(WORKER, root, f"ref_{model}", "reference", "--model", model, *data)
    want = _references[model]
    run = run_trainer_worker(WORKER, root, name, "sharded", "--model", model, "--dp", str(dp), *data,
                             config=config, nproc=nproc)
    assert (run["dp"], run["ep"], run["cp"]) == (dp, 2 if "ep: 2" in config else 1, 1)
    assert run["replicate"] == (2 if "dp_replicate" in config else 1)
    assert run["audio_kernels"]["attention"] > 0 and run["ran"]["fused_linear_cross_entropy"] > 0
    if "ep: " in config:
        assert run["ran"]["experts"] > 0
    if "memory" in config:  # the thinker's text layers recompute their attention core and MLP and offload
        assert run["memory"]["recompute"] >= 2 * 2 and run["memory"]["offload"] >= 2, run["memory"]
    if dp > 1:  # some rank lacked audio and some rank images in some step
        assert run["placeholders"]["input_features"] > 0 and run["placeholders"]["pixel_values"] > 0, run
    assert_trained_alike(run, want, TOL)
