"""The release rules in one place: which releases of the Hugging Face stack are supported and what needs which
release (`supported.py`, read from installed metadata, no imports), how the code reads what differs between
releases (`compat.py`), and every private name of transformers, accelerate, PEFT, TRL and diffusers that we rely
on, with the releases it was checked on (`seams.py`, tested on each release by tests/trainer/test_seams.py).
Nothing is imported here: `supported` is read before torch is."""
