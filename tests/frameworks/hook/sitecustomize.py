"""The test's hook for a framework's own command line: the user's one line, `import mindspeed_hf`, plus (when
MSHF_TEST_DUMP=path.json is set) a TrainerCallback that writes, at the end of training, what ran on the
trained model: mindspeed_hf.report(model) ("ran": op -> executions of our kernels), whether HF's gradient
checkpointing was on, and the framework check (mindspeed_hf.trainers.frameworks.describe)."""

import os

import mindspeed_hf  # the user's one line

_DUMP = os.environ.get("MSHF_TEST_DUMP")

if _DUMP:
    import json

    from transformers import Trainer, TrainerCallback

    class _DumpReport(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_train_end(self, args, state, control, model=None, **kwargs):
            from mindspeed_hf.trainers import frameworks

            model = model if model is not None else self.trainer.model
            inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
            report = mindspeed_hf.report(model)
            found = frameworks.detect(self.trainer)
            with open(_DUMP, "w") as f:
                json.dump({"report": report,
                           "hf_gradient_checkpointing": bool(getattr(inner, "is_gradient_checkpointing", False)),
                           "framework": found.name, "conflicts": found.conflicts,
                           "message": frameworks.describe(self.trainer),
                           "trainer": type(self.trainer).__name__}, f, default=str, indent=1)

    _init = Trainer.__init__

    def __init__(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.add_callback(_DumpReport(self))

    Trainer.__init__ = __init__
