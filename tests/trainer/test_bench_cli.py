"""`mindspeed-hf bench` end to end on the npu path (the stand-in torch_npu on the children's path): two interleaved
pairs of runs, the counted step of each side, with fewer kernels dispatched than plain HF; `--profile` writes a
chrome trace that loads, with events, and prints the top operators; `--plot` writes a PNG; bad options fail in one
line before any run."""

from __future__ import annotations

import json
import os

import pytest
from child_runs import REPO
from conftest import cli

from mindspeed_hf.bench import plot as bench_plot
from mindspeed_hf.bench import run as bench_run

STANDIN = REPO / "tests" / "npu_standin"


def _row(out: str, name: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.fixture(scope="module")
def npu_bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    args = ["bench", "--steps", "2", "--repeats", "2", "--backend", "npu", "--profile", str(tmp / "prof"),
            "--workdir", str(tmp / "work")]
    if bench_plot.matplotlib_available():
        args += ["--plot", str(tmp / "chart.png")]
    proc = cli(args, PYTHONPATH=os.pathsep.join([str(REPO), str(STANDIN)]))
    return proc.stdout, tmp


def test_bench_counts_a_step_of_each_side(npu_bench):
    out, tmp = npu_bench
    base = json.loads((tmp / "work" / "baseline_counted.json").read_text())
    fast = json.loads((tmp / "work" / "accelerated_counted.json").read_text())
    assert base["npu_calls"] == 0 and fast["npu_calls"] > 0 and "npu_standin" in fast["torch_npu"]
    calls = fast["npu_by_op"]  # 17 norm sites (4 layers x 4 + 1); those after a residual add fused with it
    assert calls["npu_rms_norm"] + calls.get("npu_add_rms_norm", 0) == 17
    assert calls["npu_rms_norm.backward"] + calls.get("npu_rms_norm_backward", 0) == 17
    kernels = _row(out, "kernels dispatched (aten + torch_npu)")
    assert kernels[1:] == [f"{base['aten_ops']:,}", f"{fast['aten_ops'] + fast['npu_calls']:,}",
                           f"{(fast['aten_ops'] + fast['npu_calls']) / base['aten_ops']:.2f}x"]
    assert float(kernels[3].rstrip("x")) < 0.85
    assert _row(out, "torch_npu kernel calls (fwd + bwd)")[1:3] == ["0", str(fast["npu_calls"])]
    assert "torch_npu here is the CPU stand-in" in out
    for name in ("aten operators", "saved for backward (MiB)", "largest tensor allocated (MiB)"):
        assert _row(out, name)[3].endswith("x"), name


def test_bench_runs_interleaved_pairs(npu_bench):
    """Two repeats: baseline and accelerated alternate (ABBA), each side a separate process; per-step losses equal."""
    out, _ = npu_bench
    assert "| | baseline (plain HF) (median) | mindspeed_hf (median) | ratio (median) |" in out
    order = [line.split(":")[0] for line in out.splitlines() if line.startswith("[bench] ")]
    assert order == ["[bench] baseline_0", "[bench] accelerated_0", "[bench] accelerated_1", "[bench] baseline_1"]
    losses = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(losses) == 2
    for line in losses:
        assert float(line.split("|")[4]) <= 1e-5, line
    worst = next(line for line in out.splitlines() if line.startswith("| max per-step loss diff"))
    assert float(worst.split("|")[3]) <= 1e-5, worst
    host = _row(out, "host CPU time per step (ms), median step")
    assert float(host[1]) > 0 and float(host[2]) > 0 and host[3].endswith("x"), host
    assert bench_run.CPU_NOTE not in out  # the npu path (stand-in) is not the torch reference


def test_cpu_note_only_for_the_torch_path():
    """On CPU with the torch backend the table says the torch path is the correctness reference; not otherwise."""
    def side(backend, host_ms):
        return {"device": "cpu", "model_type": "qwen3", "losses": {"1": 1.0}, "step_host_ms": host_ms,
                "report": {"backend": backend}}

    torch_side = bench_run.compare([side("torch", 10.0)], [side("torch", 12.0)])
    assert bench_run.CPU_NOTE in torch_side
    assert _row(torch_side, "host CPU time per step (ms), median step")[1:4] == ["10.0", "12.0", "1.20x"]
    assert bench_run.CPU_NOTE not in bench_run.compare([side("npu", 10.0)], [side("npu", 10.0)])


def test_bench_profile_writes_a_loadable_trace_and_top_ops(npu_bench):
    out, tmp = npu_bench
    trace = json.loads((tmp / "prof" / "trace.json").read_text())
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::mm" for e in ops), len(ops)
    assert f"## top 15 operators by self time ({tmp / 'prof' / 'trace.json'})" in out
    assert "| aten::mm | cpu_op |" in out


@pytest.mark.skipif(not bench_plot.matplotlib_available(), reason="matplotlib not installed ([plot] extra)")
def test_bench_plot_writes_a_png(npu_bench):
    out, tmp = npu_bench
    chart = tmp / "chart.png"
    assert f"chart: {chart}" in out and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000


def test_bench_bad_options_fail_in_one_line(tmp_path, capsys):
    from mindspeed_hf.cli.main import main

    assert main(["bench", "--backend", "tpu", "--workdir", str(tmp_path)]) == 2
    assert not (tmp_path / "baseline_0.json").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mindspeed-hf bench: error: --backend='tpu' is not valid; choose one of auto, torch, npu, cuda")
    assert main(["bench", "--repeats", "0", "--workdir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "mindspeed-hf bench: error: --repeats=0 must be >= 1"


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"--plot needs matplotlib: pip install 'mindspeed_hf\[plot\]'"):
        bench_plot.require_matplotlib()


def test_self_time_is_duration_less_nested_events_per_thread():
    from mindspeed_hf.bench.profile import self_times

    span = {"ph": "X", "cat": "cpu_op", "pid": 1}
    events = [dict(span, name="outer", ts=0, dur=10, tid=1), dict(span, name="inner", ts=2, dur=3, tid=1),
              dict(span, name="inner", ts=6, dur=2, tid=1), dict(span, name="inner", ts=1, dur=4, tid=2)]
    assert self_times(events) == {("cpu_op", "outer"): (1, 5.0), ("cpu_op", "inner"): (3, 9.0)}
