"""The test's hook for a framework's own command line: the user's one line, `import mindspeed_hf`, plus (when
MSHF_TEST_DUMP=path.json is set) a TrainerCallback that writes, at the end of training, what ran on the
trained model: mindspeed_hf.report(model) ("ran": op -> executions of our kernels), whether HF's gradient
checkpointing was on, and the framework check (mindspeed_hf.trainers.frameworks.describe)."""

import os

import mindspeed_hf  # the user's one line

_DUMP = os.environ.get("MSHF_TEST_DUMP")

if _DUMP:
    import functools
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

    def _swift_fused_loss(trainer):
        """The proposed adapter for ms-swift (docs/frameworks.md), tried from outside: its compute_loss inside our
        logits-unread window, and the logits its template hands back None instead of SkippedLogits, so ms-swift
        skips its token accuracy as it does for Liger. Whenever ms-swift computes the loss itself it pops the labels
        first, so the model never skips logits there."""
        from mindspeed_hf.patches import causal_lm, scope

        compute_loss = trainer.compute_loss

        def windowed(model, inputs, return_outputs=False, num_items_in_batch=None):
            with scope.logits_unread_window():
                return compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

        compute_sft_loss = trainer.template.compute_sft_loss

        def sft_loss(*args, **kwargs):
            outputs = compute_sft_loss(*args, **kwargs)
            if isinstance(getattr(outputs, "logits", None), causal_lm.SkippedLogits):
                outputs.logits = None
            return outputs

        trainer.compute_loss = windowed
        trainer.template.compute_sft_loss = sft_loss

    _init = Trainer.__init__

    # functools.wraps keeps Trainer.__init__'s signature visible: ms-swift picks `processing_class` or `tokenizer`
    # from inspect.signature(Trainer.__init__) (swift/trainers/mixin.py:122-124)
    @functools.wraps(_init)
    def __init__(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.add_callback(_DumpReport(self))
        if os.environ.get("MSHF_TEST_SWIFT_FUSED") and type(self).__module__.startswith("swift."):
            _swift_fused_loss(self)

    Trainer.__init__ = __init__
