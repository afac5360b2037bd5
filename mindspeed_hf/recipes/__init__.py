"""The runs `mindspeed-hf train` knows: a run described in YAML (`run_config.py`, `text.py`; the embedded default run
in `default_run/`) and the embedded recipes (`vl.py`, `omni.py`, `diffusion.py`, each with its generated data)."""
