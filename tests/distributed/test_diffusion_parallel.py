"""diffusers DiTs under `parallelize(model, dims, config)` on CPU ranks (gloo, fp32) against one plain diffusers
process on the same global batch: Flux and Wan with context parallelism over their image / video tokens (cp=2 as a
ring on the npu path, as Ulysses on the torch path; Wan on 4 ranks as a ring of Ulysses pairs) and with FSDP2 per
transformer block (dp_shard=2): the flow-matching loss equal to 1e-5, every gradient to 1e-4 of its tensor's
largest entry, each cp rank's attention over its share of the tokens. And the one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from child_runs import run_worker

pytest.importorskip("diffusers")
WORKER = Path(__file__).resolve().parent / "diffusion_worker.py"
# tokens each rank's queries hold under cp (Flux: (6 text + 12 image) / cp; Wan: 8 video / cp), and whole; the
# hybrid: 2 per rank in the cross-attention, the Ulysses pair's 4 in the ring
LOCAL = {"flux": {"cp_ring": [9], "fsdp": [18]}, "wan": {"cp_ring": [4], "fsdp": [8], "cp_hybrid": [2, 4]}}


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_context_parallel_and_fsdp_equal_one_process(family, tmp_path):
    report = run_worker(WORKER, tmp_path / f"{family}.json", "--family", family, "--cases", "cp_ring,cp_ulysses,fsdp")
    for case, result in report.items():
        assert result["loss_diff"] <= 1e-5 and result["grad_error"] <= 1e-4, (case, result)
        assert result["ran_attention"] > 0, (case, result)
        if case in LOCAL[family]:  # npu cases: the lengths the fused kernel saw
            assert result["attention_lengths"] == LOCAL[family][case], (case, result)


def test_hybrid_ring_of_ulysses_pairs(tmp_path):
    """cp=4 on 4 ranks: Ulysses inside each pair (the all-to-all gathers the pair's 4 tokens), a ring of 2 pairs;
    Wan's cross-attention runs on each rank's 2 video tokens against the whole text."""
    report = run_worker(WORKER, tmp_path / "hybrid.json", "--family", "wan", "--cases", "cp_hybrid", nproc=4)
    result = report["cp_hybrid"]
    assert result["loss_diff"] <= 1e-5 and result["grad_error"] <= 1e-4, result
    assert result["attention_lengths"] == LOCAL["wan"]["cp_hybrid"], result


def test_refusals():
    """Before any work: a family without a supported plan, heads the Ulysses size does not divide, and (at the
    first forward) a sequence cp does not divide."""
    import torch
    from tiny_denoisers import FAMILIES

    from mindspeed_hf.parallel.context.denoiser import apply_denoiser_context_parallel
    from mindspeed_hf.parallel.context.model import ContextParallel

    ctx = ContextParallel(cp=3, ulysses=3, zigzag=False, rank=0, ring_group=None, ulysses_group=None)
    with pytest.raises(ValueError, match="not supported; valid choices: parallel.cp=1, or a model of flux, wan"):
        apply_denoiser_context_parallel(FAMILIES["qwenimage"]().model, ctx, "qwenimage")
    with pytest.raises(ValueError, match="parallel.cp_ulysses=3 must divide the number of attention heads 2"):
        apply_denoiser_context_parallel(FAMILIES["wan"]().model, ctx, "wan")
    tiny = FAMILIES["wan"]()
    apply_denoiser_context_parallel(tiny.model, ContextParallel(3, 1, False, 0, None, None), "wan")
    from tiny_denoisers import noisy_batch

    kwargs, _, _ = noisy_batch(tiny)
    with pytest.raises(ValueError, match="parallel.cp=3: .* has 8 tokens along dim 1, not a multiple of cp"):
        with torch.no_grad():
            tiny.model(**kwargs)
