"""The test's hook for a framework's own command line: the user's one line, `import mindspeed_hf`, plus (when
MSHF_TEST_DUMP=path.json is set) a TrainerCallback that writes, at the end of training, what ran on the
trained model: mindspeed_hf.report(model) ("ran": op -> executions of our kernels), whether HF's gradient
checkpointing was on, the framework check (mindspeed_hf.trainers.frameworks.describe), how often deferred logits
were built, and (MSHF_TEST_COUNT_NPU=1) the stand-in's npu_fusion_attention calls by layout."""

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
                           "trainer": type(self.trainer).__name__, **_counts}, f, default=str, indent=1)

    _counts = {"logits_built": 0, "npu_fusion_attention": {}}

    def _count_logits_built() -> None:
        """How often deferred logits were built (a reader that needed the [tokens, vocab] logits)."""
        from mindspeed_hf.patches.lazy_logits import DeferredLogits

        materialize = DeferredLogits.materialize

        def counted(self):
            if self._value is None:
                _counts["logits_built"] += 1
            return materialize(self)

        DeferredLogits.materialize = counted

    def _count_npu_attention() -> None:
        """The stand-in torch_npu's npu_fusion_attention calls by layout (MSHF_TEST_COUNT_NPU=1, with
        MINDSPEED_HF_BACKEND=npu and tests/npu_standin on PYTHONPATH): what ran, to set beside report()."""
        import torch_npu

        real = torch_npu.npu_fusion_attention

        def counted(*args, **kwargs):
            layout = args[4] if len(args) > 4 else kwargs.get("input_layout")
            _counts["npu_fusion_attention"][layout] = _counts["npu_fusion_attention"].get(layout, 0) + 1
            return real(*args, **kwargs)

        torch_npu.npu_fusion_attention = counted

    _count_logits_built()
    if os.environ.get("MSHF_TEST_COUNT_NPU"):
        _count_npu_attention()

    _init = Trainer.__init__

    # functools.wraps keeps Trainer.__init__'s signature visible: ms-swift picks `processing_class` or `tokenizer`
    # from inspect.signature(Trainer.__init__) (swift/trainers/mixin.py:122-124)
    @functools.wraps(_init)
    def __init__(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.add_callback(_DumpReport(self))

    Trainer.__init__ = __init__
