"""QLoRA under FSDP2 on 2 ranks (gloo) against plain HF QLoRA in one process (qlora_worker.py): the packed 4-bit base
weights sharded in their storage dtype (bnb_4bit_quant_storage uint8 and float32), the LoRA adapters sharded and
trained with per-step losses and gradients within 1e-5, the fused loss on, an adapter-only consolidated save; and
bf16 mixed precision over a float32 storage refused before anything is sharded."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install -e .[qlora])")

from child_runs import run_worker  # noqa: E402

WORKER = Path(__file__).resolve().parent / "qlora_worker.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qlora_fsdp")
    return run_worker(WORKER, root / "out.json", "--root", str(root), nproc=2)


@pytest.mark.parametrize("storage", ["uint8", "float32"])
def test_losses_and_lora_gradients_match_one_process(result, storage):
    r = result[storage]
    assert len(r["losses"]) == len(r["ref_losses"]) == 3
    assert all(abs(a - b) <= TOL for a, b in zip(r["losses"], r["ref_losses"])), (r["losses"], r["ref_losses"])
    assert r["grad_max_diff"] <= TOL
    assert r["param_max_diff"] <= 1e-4  # 3 AdamW steps at lr 1e-2
    assert r["fused_loss"] == 1


@pytest.mark.parametrize("storage", ["uint8", "float32"])
def test_packed_base_weights_sharded_in_their_storage(result, storage):
    p = result[storage]["placements"]
    assert p == {"count": 14, "sharded": True, "dtype": True, "local_fraction": 0.5}
    q = result[storage]["quantized_linear"]
    assert q["quant_storage"] == [storage] and q["quant_type"] == ["nf4"] and q["modules"] == 14


@pytest.mark.parametrize("storage", ["uint8", "float32"])
def test_adapter_only_save(result, storage):
    r = result[storage]
    assert "adapter_model.safetensors" in r["saved_files"] and "model.safetensors" not in r["saved_files"]
    assert r["saved_only_lora"] and r["saved_max_diff"] == 0.0


def test_bf16_over_float32_storage_refused(result):
    r = result["refusal"]
    assert r["untouched"]
    assert "param_dtype=torch.bfloat16" in r["message"] and "bnb_4bit_quant_storage=torch.uint8" in r["message"]
