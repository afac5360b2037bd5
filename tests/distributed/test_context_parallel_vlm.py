"""Context parallelism through vision-language models: a plain Trainer script on a tiny Qwen2.5-VL and Qwen3-VL
(rows with images of different grids, rows without; right-padded or packed), and on the Omni thinkers (audio clips
of different lengths too), with the sizes only from
MINDSPEED_HF_CONFIG, equals a single plain-HF process on the same global batches: logged losses and grad norms
over 3 clipped SGD steps and every parameter after them (vision tower included) within 1e-5. The reference is the
rows right-padded (plain HF packs Qwen-VL rows wrongly: one sequence of 3-D positions across documents), so the
packed runs also show that a packed batch trains as its rows padded. The split happens
inside the model (parallel/context/multimodal.py): the vision tower keeps its own attention, the text layers run
the cp attention on their slice (vlm_context_worker.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from child_runs import assert_trained_alike, run_trainer_worker

from mindspeed_hf.parallel.context import padded_length

WORKER = Path(__file__).resolve().parent / "vlm_context_worker.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cp_vlm")


_references: dict[tuple[str, tuple[str, ...]], dict] = {}


def _reference(root: Path, model: str, data: tuple[str, ...]) -> dict:
    if (model, data) not in _references:
        name = "_".join(["ref", model, *(d.strip("-") for d in data)])
        _references[model, data] = run_trainer_worker(WORKER, root, name, "reference", "--model", model, *data)
    return _references[model, data]


STANDIN = Path(__file__).resolve().parents[1] / "npu_standin"
_OMNI_CP = pytest.mark.skipif(not hasattr(__import__("transformers").models.qwen2_5_omni.modeling_qwen2_5_omni,
                                          "Qwen2_5OmniThinkerModel"),
                              reason="the Omni thinkers have a `model.language_model` from transformers 5.23 on")


@pytest.mark.parametrize(("name", "model", "packed", "config", "nproc", "dp"), [
    # the npu path (stand-in torch_npu): fused attention in the text layers' ring and in the vision tower
    ("qwen2_5_vl_ring_padded_npu", "qwen2_5_vl", False, "backend: npu\nparallel: {cp: 2}\n", 2, 1),
    ("qwen2_5_vl_ulysses_packed", "qwen2_5_vl", True, "parallel: {cp: 2, cp_ulysses: 2}\n", 2, 1),
    # deepstack features split with the text, and gathered from the ranks' shares of the images (cp_vision)
    ("qwen3_vl_ring_padded_cp_vision", "qwen3_vl", False, "parallel: {cp: 2, cp_vision: true}\n", 2, 1),
    ("qwen3_vl_ulysses_packed", "qwen3_vl", True, "parallel: {cp: 2, cp_ulysses: 2}\n", 2, 1),
    # dp_shard 2 x cp 2 on 4 ranks (FSDP2 over both), the tower shared over cp
    ("qwen2_5_vl_dp2_cp2_cp_vision", "qwen2_5_vl", False, "parallel: {cp: 2, cp_vision: true}\n", 4, 2),
    # the hybrid: a ring of 2 Ulysses pairs
    ("qwen3_vl_hybrid_packed", "qwen3_vl", True, "parallel: {cp: 4, cp_ulysses: 2}\n", 4, 1),
    # the Omni thinkers: audio clips merged in too (transformers >= 5.23: their `model.language_model`)
    pytest.param("qwen2_5_omni_ring_padded_npu", "qwen2_5_omni_thinker", False, "backend: npu\nparallel: {cp: 2}\n",
                 2, 1, marks=_OMNI_CP),
    pytest.param("qwen3_omni_ulysses_packed_cp_vision", "qwen3_omni_moe_thinker", True,
                 "parallel: {cp: 2, cp_ulysses: 2, cp_vision: true}\n", 2, 1, marks=_OMNI_CP),
])
def test_plain_trainer_on_a_vlm_with_cp_equals_one_process(root, name, model, packed, config, nproc, dp, monkeypatch):
    # dp > 1: the loss a token mean over the dp ranks (Qwen-VL's accepts_loss_kwargs=False would make Trainer
    # average the ranks' own means: HF's multi-process result, not one process's), on both sides. cp_vision: videos
    # too (a video's frames are shared over the ranks like images; at dp > 1 a rank whose rows lack images or
    # videos another rank has runs the tower on a placeholder: parallel/towers.py).
    videos = "cp_vision" in config and "omni" not in model
    data = (*(["--token-mean"] if dp > 1 else []), *(["--videos"] if videos else []))
    want = _reference(root, model, data)
    if "npu" in config:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")])))
    args = ("sharded", "--model", model, "--dp", str(dp), *(["--packed"] if packed else []), *data)
    run = run_trainer_worker(WORKER, root, name, *args, config=config, nproc=nproc)
    assert (run["text_attention"], run["cp"], run["dp"]) == ("mindspeed_cp", nproc // dp, dp)
    assert run["vision_attention"] == "mindspeed"  # the tower keeps its own (varlen) attention kernel
    assert run["ran"]["fused_linear_cross_entropy"] > 0 and run["ran"]["attention"] > 0
    cp = nproc // dp  # the text layers see this rank's share of the (padded) sequence, nothing more
    assert run["lengths"]["text"] == [padded_length(n, cp, zigzag=True) // cp for n in run["lengths"]["full"]]
    assert (run["vision_shared"] > 0) == ("cp_vision" in config)  # the tower really ran on shares of the images
    if "npu" in config:
        assert run["implementations"]["attention"] == "npu:npu_fusion_attention"
        assert run["vision_implementation"].startswith("npu:npu_fusion_attention")
        assert run["ran"]["rms_norm"] > 0 and run["ran"]["rope"] > 0
    if dp > 1:  # the rows of mixed media left some rank without images or videos in some step
        assert sum(run["placeholders"].values()) > 0, run["placeholders"]
    assert_trained_alike(run, want, TOL)
