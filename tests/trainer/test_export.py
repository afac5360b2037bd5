"""`mindspeed_hf.export` / `mindspeed-hf export` on checkpoints written in one process the way a sharded run writes
them (DCP shards of the model, the configs beside them, the COMPLETE marker), against the model itself: every tensor
that `from_pretrained` reads back equals the model's; a LoRA run gives PEFT's adapter, or with merge_lora PEFT's own
merge_and_unload. Incomplete and truncated checkpoints are refused in one line naming the file. (Checkpoints of real
sharded Trainer runs: tests/distributed/test_export_runs.py.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiny_models import tiny_model
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM

import mindspeed_hf
from mindspeed_hf.checkpoints.layout import MODEL_DIR
from mindspeed_hf.cli.main import main as command
from mindspeed_hf.parallel.checkpoint import mark_complete
from mindspeed_hf.runtime.state import save_configs as _save_configs


def _checkpoint(root, model, step: int = 4, complete: bool = True) -> str:
    path = os.path.join(root, f"checkpoint-{step}")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(path, MODEL_DIR), no_dist=True)
    _save_configs(model, path)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step}, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)
    if complete:
        mark_complete(path, global_step=step)
    return path


def _saved_keys(directory) -> set[str]:
    from safetensors import safe_open

    keys = set()
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                keys.update(f.keys())
    return keys


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_export_of_a_sharded_checkpoint_loads_equal(tmp_path, family):
    model = tiny_model(family)
    with torch.no_grad():  # not the initial weights: the export must read them from the shards
        for p in model.parameters():
            p.add_(0.01)
    out = mindspeed_hf.export(_checkpoint(tmp_path, model), tmp_path / "hf", max_shard_size="50KB")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert _max_diff(loaded.state_dict(), model.state_dict()) == 0
    # streamed file by file, in save_pretrained's names (transformers 5: MoE experts one tensor per expert again)
    model.save_pretrained(tmp_path / "ref", max_shard_size="50KB")
    assert _saved_keys(out) == _saved_keys(tmp_path / "ref")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == _saved_keys(out) and len(set(index["weight_map"].values())) > 2
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text()) == {"model_max_length": 64}
    assert "(step 4)" in (tmp_path / "hf" / "README.md").read_text()
    assert not (tmp_path / "hf" / "trainer_state.json").exists()


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava"])
def test_export_of_a_vision_language_checkpoint(tmp_path, model_type):
    """The class the config names (a VL model, not a causal LM): its own save_pretrained writes HF's key names."""
    from tiny_vlms import tiny_vlm
    from transformers import AutoModelForImageTextToText

    model = tiny_vlm(model_type)
    out = mindspeed_hf.export(_checkpoint(tmp_path, model), tmp_path / "hf")
    assert _max_diff(AutoModelForImageTextToText.from_pretrained(out).state_dict(), model.state_dict()) == 0


def test_export_in_bf16_with_small_shards(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)  # a tied weight is stored once
    out = mindspeed_hf.export(_checkpoint(tmp_path, model), tmp_path / "hf", dtype="bf16", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert _max_diff(loaded.state_dict(), model.to(torch.bfloat16).state_dict()) == 0


def test_lora_run_gives_the_adapter_or_the_merged_model(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    base = tiny_model("qwen3")
    peft_model = get_peft_model(tiny_model("qwen3"), LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                                  init_lora_weights=False))
    checkpoint = _checkpoint(tmp_path, peft_model)
    adapter = mindspeed_hf.export(checkpoint, tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_model("qwen3"), adapter)
    lora = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert _max_diff({k: v for k, v in reloaded.state_dict().items() if "lora_" in k}, lora) == 0
    merged = mindspeed_hf.export(checkpoint, tmp_path / "merged", merge_lora=True, max_shard_size="30KB")
    want = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    assert _max_diff(AutoModelForCausalLM.from_pretrained(merged).state_dict(), want) == 0
    assert (tmp_path / "merged" / "model.safetensors.index.json").exists()  # merged file by file


def test_an_unsharded_directory_is_copied_or_converted(tmp_path):
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path / "saved")
    copied = mindspeed_hf.export(tmp_path / "saved", tmp_path / "copy")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "copy" / name).read_bytes() == (tmp_path / "saved" / name).read_bytes()
    assert _max_diff(AutoModelForCausalLM.from_pretrained(copied).state_dict(), model.state_dict()) == 0
    half = mindspeed_hf.export(tmp_path / "saved", tmp_path / "half", dtype="fp16")
    loaded = AutoModelForCausalLM.from_pretrained(half, dtype=torch.float16)
    assert _max_diff(loaded.state_dict(), model.to(torch.float16).state_dict()) == 0


def test_refusals_are_one_line_naming_the_file(tmp_path, capsys):
    model = tiny_model("llama")
    incomplete = _checkpoint(tmp_path / "a", model, complete=False)
    assert command(["export", incomplete, str(tmp_path / "out")]) == 2
    assert "no COMPLETE marker" in capsys.readouterr().err and not (tmp_path / "out").exists()
    checkpoint = _checkpoint(tmp_path / "b", model)
    shard = next(p for p in (tmp_path / "b" / "checkpoint-4" / MODEL_DIR).iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    assert command(["export", checkpoint, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and shard.name in err, err
    with pytest.raises(ValueError, match="holds no LoRA adapter"):
        mindspeed_hf.export(_checkpoint(tmp_path / "c", model), tmp_path / "out", merge_lora=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no model"):
        mindspeed_hf.export(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(SystemExit, match="2"):  # argparse names the choices
        command(["export", checkpoint, str(tmp_path / "x"), "--dtype", "int8"])


def test_the_command_exports(tmp_path, capsys):
    model = tiny_model("llama")
    assert command(["export", _checkpoint(tmp_path, model), str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert _max_diff(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict(), model.state_dict()) == 0


def test_push_to_hub_uploads_the_written_directory(tmp_path, monkeypatch):
    """The Hub is not reachable here: huggingface_hub's two calls are recorded, with what the directory held then."""
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: calls.append(
        ("upload", kw["repo_id"], sorted(os.listdir(kw["folder_path"])))))
    checkpoint = _checkpoint(tmp_path, tiny_model("llama"))
    with pytest.raises(ValueError, match="not a Hub repository id"):  # before anything is written
        mindspeed_hf.export(checkpoint, tmp_path / "bad", push_to_hub="me/bad id!")
    assert not (tmp_path / "bad").exists() and not calls
    out = mindspeed_hf.export(checkpoint, tmp_path / "hf", push_to_hub="me/tiny")
    assert calls[0] == ("create", "me/tiny", {"exist_ok": True})
    assert calls[1] == ("upload", "me/tiny", sorted(os.listdir(out)))
    assert {"model.safetensors", "config.json", "README.md", "tokenizer_config.json"} <= set(calls[1][2])


def _train(tmp_path, **kw):
    from transformers import Trainer, TrainingArguments

    rows = torch.randint(1, 100, (16, 12), generator=torch.Generator().manual_seed(0)).tolist()
    model = tiny_model("qwen3")
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=4,
                             save_steps=2, report_to="none", disable_tqdm=True, use_cpu=True, **kw)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    trainer.train()
    return model


def test_every_checkpoint_is_exported_in_the_background(tmp_path, monkeypatch, restore_wiring):
    monkeypatch.setenv("MINDSPEED_HF_CHECKPOINTS_EXPORT_HF", "1")
    mindspeed_hf.enable()
    model = _train(tmp_path, save_total_limit=1)  # rotation removes checkpoint-2, not its export
    for step in (2, 4):
        checkpoint, exported = tmp_path / "run" / f"checkpoint-{step}", tmp_path / "run" / "hf" / f"checkpoint-{step}"
        assert json.loads((exported / "export.json").read_text())["step"] == step
        assert not (tmp_path / "run" / "hf" / f"checkpoint-{step}.log").exists()  # removed when it succeeded
    assert not checkpoint.with_name("checkpoint-2").exists()
    assert _max_diff(AutoModelForCausalLM.from_pretrained(exported).state_dict(), model.state_dict()) == 0


def test_a_failed_background_export_is_one_warning(tmp_path, monkeypatch, restore_wiring, caplog):
    from mindspeed_hf.checkpoints import background as export_background

    monkeypatch.setenv("MINDSPEED_HF_CHECKPOINTS_EXPORT_HF", "1")
    monkeypatch.setattr(export_background.sys, "executable", "false")  # every export process fails
    mindspeed_hf.enable()
    with caplog.at_level("WARNING", logger="mindspeed_hf"):
        _train(tmp_path)
    failed = [r.getMessage() for r in caplog.records if "export_hf: exporting" in r.getMessage()]
    assert len(failed) == 2 and "checkpoint-4.log" in failed[-1], failed
    assert (tmp_path / "run" / "checkpoint-4" / "trainer_state.json").exists()  # the run went on


def test_a_qlora_run_exports_its_adapter(tmp_path):
    """The 4-bit base is stored packed with its quantization state: the adapter equals PEFT's own save of it; a
    merge onto the quantized base is refused naming the way that works."""
    pytest.importorskip("bitsandbytes")
    from qlora_models import qlora_model, save_base
    from safetensors.torch import load_file

    model = qlora_model(save_base(tmp_path / "base"))
    checkpoint = _checkpoint(tmp_path, model)
    adapter = mindspeed_hf.export(checkpoint, tmp_path / "adapter")
    model.save_pretrained(tmp_path / "peft")
    name = "adapter_model.safetensors"
    assert _max_diff(load_file(os.path.join(adapter, name)), load_file(tmp_path / "peft" / name)) == 0
    with pytest.raises(ValueError, match="is quantized .bitsandbytes.; valid choices: its LoRA adapter"):
        mindspeed_hf.export(checkpoint, tmp_path / "merged", merge_lora=True)


# ---------------------------------------------------------------------------------------------- the output directory
def _snapshot(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _old_export(directory) -> None:
    """What an earlier export of another model left: four shards and their index, its tokenizer, its README."""
    model = tiny_model("llama")
    model.save_pretrained(directory, max_shard_size="20KB")
    assert len(list(directory.glob("model-0000*-of-*.safetensors"))) >= 4
    (directory / "tokenizer.json").write_text('{"old": true}')
    (directory / "README.md").write_text("the old model\n")
    (directory / "notes.txt").write_text("mine, not a model file\n")


def test_a_non_empty_output_is_refused_and_left_byte_identical(tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path, tiny_model("qwen3"))
    out = tmp_path / "existing"
    _old_export(out)
    before = _snapshot(out)
    capsys.readouterr()
    assert command(["export", checkpoint, str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"export: the output directory {out} is not empty" in err and "--overwrite" in err
    assert _snapshot(out) == before
    with pytest.raises(ValueError, match="not empty"):  # the API too
        mindspeed_hf.export(checkpoint, out)
    assert _snapshot(out) == before


def test_overwrite_replaces_the_model_and_leaves_no_stale_file(tmp_path, capsys):
    model = tiny_model("qwen3")
    checkpoint = _checkpoint(tmp_path, model)
    out = tmp_path / "existing"
    _old_export(out)
    assert command(["export", checkpoint, str(out), "--overwrite"]) == 0, capsys.readouterr().err
    fresh = mindspeed_hf.export(checkpoint, tmp_path / "fresh")
    names = sorted(p.name for p in out.iterdir())  # no old shard, index or tokenizer; the user's own file kept
    assert names == sorted([*os.listdir(fresh), "notes.txt"]), names
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "fresh" / "model.safetensors").read_bytes()
    assert _max_diff(AutoModelForCausalLM.from_pretrained(out).state_dict(), model.state_dict()) == 0
    assert "the old model" not in (out / "README.md").read_text()  # written anew, not appended to
    assert not list(tmp_path.glob(".existing.exporting*"))


def test_a_failed_export_leaves_the_output_as_it_was(tmp_path, monkeypatch):
    """The disk fills while the weights are written: nothing of the half export reaches OUT (it is written beside
    OUT and moved in once whole), with or without --overwrite."""
    import errno

    import safetensors.torch

    checkpoint = _checkpoint(tmp_path, tiny_model("qwen3"))
    out = tmp_path / "existing"
    _old_export(out)
    before = _snapshot(out)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match="No space left"):
        mindspeed_hf.export(checkpoint, out, overwrite=True)
    assert _snapshot(out) == before and not list(tmp_path.glob(".existing.exporting*"))
    with pytest.raises(OSError, match="No space left"):
        mindspeed_hf.export(checkpoint, tmp_path / "new")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv,fragments", [
    (["{root}/no-such-checkpoint", "{root}/out"], ["export: the checkpoint", "no-such-checkpoint does not exist"]),
    (["{root}/a-file", "{root}/out"], ["a-file is a file, not a checkpoint directory"]),
    (["{checkpoint}", "{root}/out", "--shard-size", "banana"], ["--shard-size", "'banana' is not a size",
                                                                 "KB, MB, GB or TB"]),
    (["{checkpoint}", "{root}/out", "--shard-size", "0GB"], ["'0GB' is not a size"]),
    (["{incomplete}", "{root}/out"], ["export:", "no COMPLETE marker", "export an earlier checkpoint"]),
    (["{checkpoint}", "{root}/a-file"], ["the output", "a-file is a file"]),
], ids=["missing", "file", "shard-size-word", "shard-size-zero", "incomplete", "output-is-a-file"])
def test_export_mistakes_are_one_line_about_export(tmp_path, capsys, argv, fragments):
    model = tiny_model("llama")
    names = {"root": str(tmp_path), "checkpoint": _checkpoint(tmp_path, model),
             "incomplete": _checkpoint(tmp_path / "b", model, complete=False)}
    (tmp_path / "a-file").write_text("x")
    capsys.readouterr()
    assert command(["export", *(a.format(**names) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mindspeed-hf export: error: export"), err
    assert "resume" not in err and "Errno" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not (tmp_path / "out").exists()


def test_shard_sizes_are_read_as_the_writers_read_them():
    from mindspeed_hf.checkpoints.export import shard_size

    assert shard_size("5GB") == "5GB" and shard_size(" 500mb ") == "500MB" and shard_size("1.5GB") == "1.5GB"
    assert shard_size(1000) == 1000 and shard_size("2048") == 2048
    for bad in ("banana", "5", "GB", "-1GB", "5GiB", "0"):
        with pytest.raises(ValueError, match="is not a size"):
            shard_size(bad if bad != "5" else "5 G")
