# The one-line hook for a framework's unmodified command line (llamafactory-cli, swift sft, axolotl train,
# torchrun children included): put this directory on PYTHONPATH, e.g.
#     PYTHONPATH=/path/to/examples/frameworks/hook llamafactory-cli train run.yaml
# Python imports `sitecustomize` at start-up in every process, so the models each process builds get the fused
# kernels and Trainer (the frameworks' trainers are its subclasses) gets the fused loss and the wiring.
import mindspeed_hf  # noqa: F401
