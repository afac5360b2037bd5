"""FSDP2 / HSDP / checkpoints / sharded loading under torchrun (gloo on CPU).

Three torchrun launches (see worker.py): `main` (2 ranks), `resume` (2 ranks, a fresh process
group resuming from main's step-2 checkpoint) and `hsdp` (4 ranks).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from child_runs import run_worker

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
TOL = 1e-5


def _torchrun(nproc: int, scenario: str, root: Path) -> dict:
    return run_worker(WORKER, root / f"{scenario}.json", scenario, "--root", str(root), nproc=nproc)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def main(root) -> dict:
    return _torchrun(2, "main", root)


@pytest.fixture(scope="module")
def resume(root, main) -> dict:
    return _torchrun(2, "resume", root)


@pytest.fixture(scope="module")
def hsdp(root) -> dict:
    return _torchrun(4, "hsdp", root)


def _close(a, b, tol=TOL):
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert abs(x - y) <= tol, (a, b)


def test_fsdp_loss_parity_and_placements(main):
    r = main["fsdp"]
    assert main["dims"] == [1, 2, 1, 1]
    _close(r["losses"], r["ref_losses"])
    assert r["all_dtensor"] and r["placements"] == ["(Shard(dim=0),)"]
    assert r["param_max_diff"] < 1e-4  # 4 AdamW steps at lr 1e-2
    assert main["slices_match_distribute_tensor"]


def test_apply_fsdp_validation(main):
    e = main["errors"]
    assert "mesh must be 1-D (FSDP) or 2-D (HSDP)" in e["mesh_3d"]  # the world mesh: dp_replicate, dp_shard, cp, tp
    assert "prefetch" in e["prefetch"] and "valid choices" in e["dtype"]
    assert e["untouched"] and e["offload_warning"] and "already sharded" in e["twice"]


def test_hf_export_roundtrip(main):
    r = main["fsdp"]
    assert r["export_vs_gathered"] == 0.0 and r["export_vs_state"] == 0.0
    assert r["export_vs_ref"] < 1e-4


def test_tied_embeddings(main):
    r = main["tied"]
    _close(r["losses"], r["ref_losses"])
    assert r["still_tied"] and r["loaded_tied"] and r["export_vs_gathered"] == 0.0
    assert r["sharded_load_tied"] and r["sharded_load_vs_gathered"] == 0.0
    assert r["all_dtensor"]


def test_lora(main):
    r = main["lora"]
    _close(r["losses"], r["ref_losses"])
    assert r["frozen_sharded"] and r["all_dtensor"] and r["n_trainable"] == 12
    assert "adapter_model.safetensors" in r["files"] and "model.safetensors" not in r["files"]
    assert r["saved_keys_all_lora"] and r["n_saved"] == 12
    assert r["reloaded_vs_gathered"] == 0.0 and r["reloaded_vs_ref"] < 1e-4
    assert r["sharded_extra"] == {"step": 3} and r["sharded_roundtrip_diff"] == 0.0
    assert r["optim_states_equal"]


def test_bf16_mixed_precision(main):
    r = main["bf16"]
    _close(r["losses"], r["ref_losses"], tol=1e-2)  # bf16 compute vs fp32 reference
    assert r["param_dtypes"] == ["torch.float32"]  # sharded master weights stay fp32


def test_meta_sharded_loading(main):
    r = main["loading"]
    assert r["vs_from_pretrained"] == 0.0 and r["logits_diff"] == 0.0
    assert r["small_window_reload_diff"] == 0.0
    assert r["buffers_equal"] and "model.rotary_emb.inv_freq" in r["buffer_names"]
    assert r["all_dtensor"]
    assert max(r["rank_param_bytes"]) < 0.6 * r["full_param_bytes"]
    assert sum(r["rank_param_bytes"]) == r["full_param_bytes"]


def test_resume_from_sharded_checkpoint(main, resume):
    assert resume["incomplete_rejected"]
    assert resume["latest"] == "step_2" and resume["resumed_step"] == 2
    assert resume["losses"] == main["fsdp"]["losses"][2:4]  # exact: same math, same order


def test_hsdp_2x2(hsdp):
    r = hsdp["hsdp"]
    _close(r["losses"], r["ref_losses"])
    assert r["placements"] == [hsdp["expected_placements"]] and r["all_dtensor"]
    assert r["param_max_diff"] < 1e-4
    assert hsdp["loading_vs_from_pretrained"] == 0.0


def test_cp_ep_mesh_views(hsdp):
    # ParallelDims(cp=2, ep=2) on 4 ranks: mesh (dp_replicate=1, dp_shard=2, cp=2)
    views = hsdp["views"]
    assert views[0]["hsdp_mesh"] == [2, 2]
    assert views[0]["by_name"] == [[2, 2], ["dp_replicate", "dp_shard_cp"]]
    for rank, v in enumerate(views):
        assert v["dp_shard_cp"] == v["dp_cp"] == [0, 1, 2, 3]
        assert v["cp"] == [rank - rank % 2, rank - rank % 2 + 1]  # cp innermost
        assert v["dp_shard"] == v["dp"] == [rank % 2, rank % 2 + 2]
        assert v["ep"] == v["cp"] and v["efsdp"] == v["dp_shard"]  # ep borrows dp_shard_cp ranks


def test_latest_complete_checkpoint_ignores_incomplete(tmp_path):
    os.environ.setdefault("MINDSPEED_HF_AUTO", "0")
    from mindspeed_hf.parallel.checkpoint import COMPLETE_MARKER, latest_complete_checkpoint

    assert latest_complete_checkpoint(str(tmp_path / "missing")) is None
    for name, done in [("step_2", True), ("step_10", True), ("step_11", False), ("step_12.tmp", True)]:
        (tmp_path / name).mkdir()
        if done:
            (tmp_path / name / COMPLETE_MARKER).write_text("{}")
    assert latest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "step_10")
