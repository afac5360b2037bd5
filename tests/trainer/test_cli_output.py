"""What `mindspeed-hf train` prints: the summary's kernel phrase from report(model); other packages' import-time
warnings held back (ours and errors kept; --debug shows them); Ctrl-C one line naming the checkpoint and the flag;
under torchrun one summary (rank 0), no DDP notice for the model we shard, and context parallelism with the
held-out loss measured and the exact match skipped."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import warnings

from child_runs import REPO, child_env, torchrun

from mindspeed_hf.cli.quiet import third_party_quiet
from mindspeed_hf.parallel.checkpoint import COMPLETE_MARKER
from mindspeed_hf.recipes import summary

DEEPSPEED_NOTICE = "Setting accelerator to CPU"  # deepspeed's import-time line on a CPU machine (DS_ACCELERATOR unset)
DDP_NOTICE = "parallel_mode != ParallelMode.DISTRIBUTED"


def test_summary_phrase_is_what_report_says():
    report = {"kernels": {"rms_norm": 17, "swiglu": 0, "attention": 0}, "kept": {"attention": "mindspeed_cp"},
              "vision_kernels": {}}
    assert summary.applied(report) == "rms_norm x17; kept: attention: mindspeed_cp"
    ran = dict(report, ran={"rms_norm": 2040, "swiglu": 480, "attention": 0})  # executions, when report() has them
    assert summary.applied(ran) == "kernel calls rms_norm x2,040, swiglu x480; kept: attention: mindspeed_cp"
    hf = dict(ran, hf_path={"swiglu": "HF's MLP ...", "fused_linear_cross_entropy": "HF's loss ..."})
    assert summary.applied(hf).endswith("; HF's code where ours gains nothing on this backend: swiglu, "
                                        "fused_linear_cross_entropy")


def test_third_party_quiet_keeps_ours_and_errors(caplog):
    shown: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            shown.append(record.getMessage())

    keep = Keep()
    logging.getLogger().addHandler(keep)
    try:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            with third_party_quiet() as hidden:
                logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
                logging.getLogger("bitsandbytes").error("a real failure")
                logging.getLogger("mindspeed_hf").warning("ours")
                warnings.warn_explicit("third-party", UserWarning, "x.py", 1, module="somepkg")
                warnings.warn_explicit("our own", UserWarning, "y.py", 1, module="mindspeed_hf.recipes.text")
        logging.getLogger("bitsandbytes").warning("after the block")
    finally:
        logging.getLogger().removeHandler(keep)
    assert "Failed to load CPU gemm_4bit_forward" not in shown and [r.getMessage() for r in hidden] == [
        "Failed to load CPU gemm_4bit_forward"]
    assert "a real failure" in shown and "ours" in shown and "after the block" in shown
    assert [str(w.message) for w in raised] == ["our own"]


def test_command_hides_import_noise_unless_debug(tmp_path):
    env = child_env(auto=True, quiet=False)
    env.pop("DS_ACCELERATOR", None)  # tests set it (tests/conftest.py); a user's shell does not

    def train(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "mindspeed_hf.cli.main", "train", "--skip-quality-eval", "--max_steps", "1",
               "--save_strategy", "no", *extra]
        return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=True)

    quiet = train("--output_dir", str(tmp_path / "a"))
    loud = train("--output_dir", str(tmp_path / "b"), "--debug")
    if DEEPSPEED_NOTICE not in loud.stdout + loud.stderr:  # deepspeed not installed, or it found an accelerator
        return
    assert DEEPSPEED_NOTICE not in quiet.stdout + quiet.stderr
    assert "mindspeed_hf: qwen3 on backend" in quiet.stderr  # our own lines are still there


BITSANDBYTES_NOTICE = "Failed to load CPU gemm_4bit_forward"  # bitsandbytes' import-time line where `kernels` is


def test_env_hides_import_noise():
    """`mindspeed-hf env` (and export, bench: the same quiet block) prints its table without other packages'
    import-time lines (deepspeed's on a CPU machine, bitsandbytes' where the `kernels` package is installed)."""
    env = child_env(auto=True, quiet=False)
    env.pop("DS_ACCELERATOR", None)
    done = subprocess.run([sys.executable, "-m", "mindspeed_hf.cli.main", "env"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=True)
    out = done.stdout + done.stderr
    assert "| setting | value |" in out
    assert DEEPSPEED_NOTICE not in out and BITSANDBYTES_NOTICE not in out, out[:2000]


def test_ctrl_c_says_how_to_resume(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mindspeed_hf.cli.main", "train", "--skip-quality-eval", "--save_strategy", "steps",
           "--save_steps", "2", "--max_steps", "400", "--output_dir", str(out)]
    # a terminal's Ctrl-C reaches a process whose SIGINT is not ignored: a test run started in the background of a
    # non-interactive shell ignores it, and a child inherits that (Python then installs no KeyboardInterrupt)
    proc = subprocess.Popen(cmd, env=child_env(auto=True), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while not (out / "checkpoint-4" / COMPLETE_MARKER).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("mindspeed-hf train: stopped (Ctrl-C)"))
    assert f"the newest complete checkpoint is {out}/checkpoint-" in line and line.endswith(
        f"--output_dir {out} --resume_from_checkpoint"), line


def test_torchrun_context_parallel_run_prints_once(tmp_path):
    """2 ranks, parallel.cp=2: trains, measures the held-out loss, skips generation (one line why), one summary."""
    run = tmp_path / "cp.yaml"
    run.write_text("model:\n  config: {model_type: qwen3, hidden_size: 64, intermediate_size: 128, "
                   "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, "
                   "max_position_embeddings: 64}\n"
                   "  tokenizer: builtin:tokenizer\ndata: {train: builtin:train.jsonl, eval: builtin:eval.jsonl, "
                   "max_length: 32}\nparallel: {cp: 2}\ntraining: {max_steps: 2, per_device_train_batch_size: 8, "
                   "per_device_eval_batch_size: 50, save_strategy: 'no', report_to: none}\nevaluation: "
                   "{num_prompts: 10}\nruntime: {cpu_threads: 1}\n")
    cmd = torchrun("-m", "mindspeed_hf.cli.main", "train", str(run), "--output_dir", str(tmp_path / "out"))
    proc = subprocess.run(cmd, env=child_env(auto=True, quiet=False), cwd=REPO, capture_output=True, text=True,
                          timeout=500)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-5000:]
    assert text.count("\nmindspeed-hf train: qwen3") == 1, text[-5000:]
    assert text.count("exact match skipped") == 1 and text.count("skipped\n") == 2, text[-5000:]
    assert DDP_NOTICE not in text, text[-5000:]
