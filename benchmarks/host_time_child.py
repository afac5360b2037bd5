"""Child of bench_host_time.py: runs examples/sft_trainer.py as __main__ and writes, to $HOST_TIME_OUT, the import
time of mindspeed_hf and per training step its wall and CPU (process) time. The parent reads whole-process CPU.

What the example imports anyway (torch, transformers' Trainer, accelerate) is imported first, so the import time
is mindspeed_hf's own (with enable() under MINDSPEED_HF_AUTO=1), not the libraries' that both runs pay."""

import json
import os
import runpy
import sys
import time

import accelerate  # noqa: F401
import torch  # noqa: F401
from transformers import Trainer

_start = time.process_time()
import mindspeed_hf  # noqa: E402,F401

_import_s = time.process_time() - _start

_steps: list[tuple[float, float]] = []
_plain_step = Trainer.training_step


def _timed_step(self, *args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        return _plain_step(self, *args, **kwargs)
    finally:
        _steps.append((time.perf_counter() - wall, time.process_time() - cpu))


Trainer.training_step = _timed_step
sys.argv = [sys.argv[1], *sys.argv[2:]]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python script.py` does
runpy.run_path(sys.argv[0], run_name="__main__")
with open(os.environ["HOST_TIME_OUT"], "w") as f:
    json.dump({"import_s": _import_s, "steps": _steps}, f)
