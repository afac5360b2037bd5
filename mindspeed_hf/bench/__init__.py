"""The harness of `mindspeed-hf bench`: the same run without and with the accelerator in separate processes
(`run.py` drives them, `child.py` is one of them), the counted step (`counts.py`), a profile (`profile.py`), the
chart (`plot.py`) and the memory report (`memory_report.py`)."""
