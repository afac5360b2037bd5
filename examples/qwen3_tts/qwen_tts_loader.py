"""Importing the `qwen-tts` package's model classes and loading a checkpoint for training.

`import qwen_tts` (even `qwen_tts.core.models`) imports the 25 Hz speech tokenizer, which needs torchaudio, sox and
onnxruntime. Training uses none of them (the 12 Hz codes are prepared offline, see data.py), so when one of them
cannot be imported a placeholder module takes its place; it fails with a clear message if anything calls into it.
The placeholders are installed after `import transformers` (transformers probes torchaudio's spec at import).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

MODELING = "qwen_tts.core.models.modeling_qwen3_tts"
TRANSFORMERS_5 = ("qwen-tts 0.1.1 pins transformers 4.57.x, and its transformers-5 forks (qwen-tts-hf, "
                  "qwen-tts-compat) crash on transformers >= 5.24, whose ModelOutput takes cache= instead of "
                  "past_key_values=")
_OPTIONAL = ("torchaudio", "sox", "onnxruntime")


class _Missing(types.ModuleType):
    """Stands for an optional dependency of the 25 Hz tokenizer that is not installed or does not load."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"{self.__name__}.{name}: {self.__name__} is not usable here (only qwen-tts' 25 Hz "
                          "tokenizer needs it; Qwen3-TTS fine-tuning does not)")


def _placeholder(name: str) -> types.ModuleType:
    module = _Missing(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__path__ = []  # a package, so `import torchaudio.compliance.kaldi` resolves to placeholders too
    sys.modules[name] = module
    return module


def _ensure_importable(name: str) -> None:
    try:
        importlib.import_module(name)
    except (ImportError, OSError):  # torchaudio built for another torch raises OSError loading its library
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        _placeholder(name)
        if name == "torchaudio":
            parent = sys.modules[name]
            parent.compliance = _placeholder("torchaudio.compliance")
            parent.compliance.kaldi = _placeholder("torchaudio.compliance.kaldi")


def import_qwen_tts() -> types.ModuleType:
    """qwen_tts' modeling module (Qwen3TTSForConditionalGeneration, Qwen3TTSConfig, mel_spectrogram, ...)."""
    if MODELING in sys.modules:
        return sys.modules[MODELING]
    import transformers  # first: see the module docstring

    if int(transformers.__version__.split(".")[0]) >= 5:
        raise RuntimeError(f"Qwen3-TTS fine-tuning needs transformers 4.57.x (found {transformers.__version__}): "
                           f"{TRANSFORMERS_5}")
    if importlib.util.find_spec("qwen_tts") is None:
        raise ModuleNotFoundError("Qwen3-TTS fine-tuning needs the qwen-tts package (transformers 4.57): "
                                  "pip install --no-deps qwen-tts==0.1.1 && pip install einops librosa soundfile")
    for name in _OPTIONAL:
        _ensure_importable(name)
    return importlib.import_module(MODELING)


def load_model(path: str, dtype: Any = None, attn_implementation: str | None = None):
    """A Qwen3-TTS checkpoint directory (config.json + weights) as Qwen3TTSForConditionalGeneration, without the
    speech tokenizer and generation config that its own from_pretrained also loads for inference."""
    from transformers import PreTrainedModel

    modeling = import_qwen_tts()
    kwargs = {"config": load_config(path)}
    if dtype is not None:
        kwargs["torch_dtype"] = dtype
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return PreTrainedModel.from_pretrained.__func__(modeling.Qwen3TTSForConditionalGeneration, path, **kwargs)


def load_config(path: str):
    """The checkpoint's Qwen3TTSConfig, loadable again: qwen-tts 0.1.1 writes `model_type` into speaker_encoder_config
    on save, which its speaker-encoder config does not accept back."""
    with open(Path(path) / "config.json") as f:
        data = json.load(f)
    data.get("speaker_encoder_config", {}).pop("model_type", None)
    config = import_qwen_tts().Qwen3TTSConfig(**data)
    speaker = config.speaker_encoder_config  # its __init__ skips PretrainedConfig's; set_attn_implementation reads
    if "_attn_implementation_internal" not in vars(speaker):
        speaker._attn_implementation_internal = None
    return config
