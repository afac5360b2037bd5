"""`mindspeed-hf bench --profile DIR`: a profiler trace of a few training steps of the accelerated run, written as
a chrome trace (DIR/trace.json: chrome://tracing, https://ui.perfetto.dev), and the top operators by self time,
read back from that trace file (so the table is exactly what the viewer shows).

On an NPU the trace comes from torch_npu.profiler (CPU + NPU activities), elsewhere from torch.profiler (CPU, plus
CUDA on a GPU). The self time of an event is its duration less that of the events nested in it on its thread.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..device import detect_device_type, import_torch_npu

TRACE_NAME = "trace.json"
TOP_NAME = "top_ops.md"
# Spans that only mark a region (a step, a python frame): their time is their children's, not an operator's.
_MARKERS = ("user_annotation", "gpu_user_annotation", "python_function", "Trace", "overhead")


def _profiler() -> Any:
    """A started-later profiler for this device: torch_npu's on an NPU, torch's elsewhere."""
    if detect_device_type() == "npu":
        prof = import_torch_npu().profiler
        return prof.profile(activities=[prof.ProfilerActivity.CPU, prof.ProfilerActivity.NPU])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


class ProfileCallback(TrainerCallback):
    """Profiles the Trainer steps after `after_step` to the end of training; writes DIR/trace.json."""

    def __init__(self, directory: str | Path, after_step: int) -> None:
        self.directory = Path(directory)
        self.after_step = after_step
        self._prof: Any = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self._prof is None and state.global_step == self.after_step:
            self._prof = _profiler()
            self._prof.start()

    def on_train_end(self, args, state, control, **kwargs):
        if self._prof is not None:
            self._prof.stop()
            self.directory.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.directory / TRACE_NAME))
            self._prof = None


def _events(trace: dict[str, Any] | list[Any]) -> list[dict[str, Any]]:
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("cat") not in _MARKERS]


def self_times(events: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[int, float]]:
    """(category, name) -> (calls, self time in microseconds), nesting taken per (pid, tid)."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        spans: list[tuple[float, tuple[str, str], list[float]]] = []  # every span: (end, key, [self time])
        stack: list[tuple[float, tuple[str, str], list[float]]] = []  # the spans still open
        for e in thread:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                stack.pop()
            if stack:
                stack[-1][2][0] -= dur
            span = (start + dur, (str(e.get("cat", "")), str(e["name"])), [dur])
            stack.append(span)
            spans.append(span)
        for _, key, own in spans:
            calls, spent = out.get(key, (0, 0.0))
            out[key] = (calls + 1, spent + own[0])
    return out


def top_ops(trace_file: str | Path, rows: int = 15) -> str:
    """The `rows` operators with the most self time in a chrome trace, as a markdown table."""
    events = _events(json.loads(Path(trace_file).read_text()))
    if not events:
        raise ValueError(f"{trace_file}: the trace has no timed events")
    times = self_times(events)
    whole = sum(spent for _, spent in times.values()) or 1.0
    ranked = sorted(times.items(), key=lambda kv: -kv[1][1])[:rows]
    lines = [f"## top {len(ranked)} operators by self time ({trace_file})", "",
             "| operator | category | calls | self time (ms) | share |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {cat} | {calls} | {spent / 1000:.2f} | {spent / whole:.1%} |"
              for (cat, name), (calls, spent) in ranked]
    return "\n".join(lines)
