"""Which fine-tuning framework drives a Trainer, and which of its own kernel options fight ours.

The frameworks users run (LLaMA-Factory, ms-swift, axolotl, TRL) subclass transformers' Trainer, so the drop-in
wiring reaches them unchanged. What it cannot see from the arguments is a framework's own kernel switch that
replaced parts of the model before the trainer was built: Liger (LLaMA-Factory `enable_liger_kernel`, ms-swift
`--use_liger_kernel` on releases whose TrainingArguments lack it, axolotl's liger plugin), unsloth (LLaMA-Factory
`use_unsloth`, ms-swift `--tuner_backend unsloth`) and axolotl's LoRA kernels (`lora_mlp_kernel`,
`lora_qkv_kernel`, `lora_o_kernel`). Each of those patches the modeling module or the model's modules the same
way we do, and the last writer wins without a word. This module looks at what the model really runs (the
functions and classes its modules use, by the package they come from), not at the flags, so a switch spelled in
any framework or release is found; the framework's name and its flag are only used to say which setting to turn
off. Nothing here changes the trainer or the model.

    found = detect(trainer)            # Detected(name, version, conflicts, notes)
    line = describe(trainer)           # one line, or None when there is nothing to say

Everything is read defensively (getattr with defaults): a framework release that renames an attribute makes
this report less, never fail.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from ..releases import compat

# package root of a Trainer subclass -> (framework name, distribution name for its version)
FRAMEWORKS: dict[str, tuple[str, str]] = {
    "llamafactory": ("LLaMA-Factory", "llamafactory"),
    "swift": ("ms-swift", "ms-swift"),
    "axolotl": ("axolotl", "axolotl"),
    "trl": ("TRL", "trl"),
}

# package root of a function or class found on the model -> the kernel family it belongs to
KERNEL_PACKAGES: dict[str, str] = {
    "liger_kernel": "Liger",
    "unsloth": "unsloth",
    "unsloth_zoo": "unsloth",
    "axolotl": "axolotl kernels",
}

# transformers' own hub kernels (from_pretrained(use_kernels=...), KernelConfig; on by default in transformers >= 5.25
# wherever the `kernels` package is installed): `kernelize` gives a module an instance forward from a hub repository
HUB_KERNELS = "transformers hub kernels"
HUB_SWITCH = ("use_kernels=False in from_pretrained (or USE_HUB_KERNELS=NO) for ours, or kernels.<op>: false to leave "
              "those layers to the hub kernels")

# (framework, kernel family) -> the setting that turns it off, as the framework spells it
SWITCHES: dict[tuple[str, str], str] = {
    ("LLaMA-Factory", "Liger"): "enable_liger_kernel: false",
    ("LLaMA-Factory", "unsloth"): "use_unsloth: false",
    ("ms-swift", "Liger"): "--use_liger_kernel false",
    ("ms-swift", "unsloth"): "--tuner_backend peft",
    ("axolotl", "Liger"): "remove axolotl.integrations.liger.LigerPlugin from plugins (liger_* keys)",
    ("axolotl", "axolotl kernels"): "lora_mlp_kernel / lora_qkv_kernel / lora_o_kernel: false",
    ("axolotl", "unsloth"): "unsloth_* keys: false",
}


@dataclass
class Detected:
    name: str | None  # "LLaMA-Factory", "ms-swift", "axolotl", "TRL", or None (plain transformers.Trainer)
    version: str | None = None
    conflicts: list[str] = field(default_factory=list)  # kernels of theirs that replaced ours on this model
    # what of its options changes what of ours runs (packing names); whether a kernel ran is said after train(),
    # from the counters (report()["ran"]), never guessed here from which methods the trainer overrides
    notes: list[str] = field(default_factory=list)


def _root(module_name: str | None) -> str:
    return (module_name or "").split(".", 1)[0]


def _version(distribution: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(distribution)
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout): no version
        return None


def framework_of(trainer: Any) -> tuple[str | None, str | None]:
    """(name, version) of the framework whose Trainer subclass this is; (None, None) for a plain Trainer.
    The most derived class decides: an ms-swift trainer built on TRL's is ms-swift."""
    for cls in type(trainer).__mro__:
        entry = FRAMEWORKS.get(_root(cls.__module__))
        if entry is not None:
            return entry[0], _version(entry[1])
    return None, None


def _function_module(fn: Any) -> str | None:
    fn = getattr(fn, "__func__", fn)
    while hasattr(fn, "__wrapped__"):  # functools.wraps chains: the innermost is who wrote the body
        inner = fn.__wrapped__
        if _root(getattr(fn, "__module__", None)) in KERNEL_PACKAGES:
            break
        fn = inner
    return getattr(fn, "__module__", None)


def _unwrap(model: Any) -> Any:
    """The transformers model under PEFT / DDP / FSDP wrappers (as far as they can be seen without accelerate)."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "module") and not hasattr(model, "config"):
            model = model.module
        elif callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()
        else:
            break
    return model


def foreign_kernels(model: Any) -> dict[str, set[str]]:
    """Kernel family -> the parts of `model` that run its code: module classes defined by the kernel package
    (LigerRMSNorm), forwards replaced on a class or an instance (Liger's lce_forward on the CausalLM, axolotl's
    LoRA MLP on each layer's mlp), and the modeling module's rotary function."""
    found: dict[str, set[str]] = {}
    if model is None:
        return found
    hf_model = _unwrap(model)

    def note(origin: str | None, what: str) -> None:
        family = KERNEL_PACKAGES.get(_root(origin))
        if family is not None:
            found.setdefault(family, set()).add(what)

    modules = hf_model.modules() if hasattr(hf_model, "modules") else []
    for module in modules:
        cls = type(module)
        kind = cls.__name__
        repo = vars(module).get("_kernel_repo") if "forward" in vars(module) else None
        if repo is not None:  # transformers' hub kernels (use_kernels, KernelConfig): kernelize's instance forward
            found.setdefault(HUB_KERNELS, set()).add(f"{kind}.forward ({getattr(repo, 'repo_id', repo)})")
            continue
        note(cls.__module__, kind)
        note(_function_module(vars(module).get("forward", cls.forward)), f"{kind}.forward")
        for hook in ("apply_qkv", "apply_o"):  # axolotl's LoRA attention kernels (instance methods)
            if hook in vars(module):
                note(_function_module(vars(module)[hook]), f"{kind}.{hook}")
    modeling = sys.modules.get(type(hf_model).__module__)
    rope = getattr(modeling, "apply_rotary_pos_emb", None) if modeling is not None else None
    if rope is not None:
        note(_function_module(rope), "apply_rotary_pos_emb")
    return found


def _code_package(fn: Any) -> str | None:
    """The top-level package whose file defines `fn`'s code (a functools.wraps wrapper copies the wrapped function's
    __module__, so its own code is what tells who wrote it)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return None
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == code.co_filename:
            return _root(module.__name__)
    return None


def head_notes(model: Any) -> list[str]:
    """A loss head another package installed on the model instance: TRL's chunked LM head (trl 1.15+
    `add_fused_lm_head`, used by its SFT, DPO, KTO, GRPO and RLOO trainers) scores the tokens with its own tiles, so
    our fused loss stays out of it (its tiles are TRL's math, not a kernel of ours) while the backbone kernels run
    under it."""
    hf_model = _unwrap(model)
    forward = vars(hf_model).get("forward") if hasattr(hf_model, "__dict__") else None
    if forward is not None and _code_package(forward) == "trl":
        return ["TRL computes the loss with its own chunked LM head (trl add_fused_lm_head): mindspeed_hf's fused "
                "loss stays out of it, the backbone kernels run under it"]
    return []


def _packing_notes(trainer: Any, name: str | None, model: Any) -> list[str]:
    """Packing / padding-free modes that key on the attention implementation's name."""
    notes = []
    config = getattr(_unwrap(model), "config", None)
    attention = compat.attn_implementation(config)
    if name == "TRL" and getattr(trainer, "padding_free", False) and attention == "mindspeed":
        notes.append("TRL padding_free with attention 'mindspeed': TRL's warning about non-flash attention does "
                     "not apply (our attention is varlen: the packed rows stay apart by position_ids)")
    if name == "ms-swift" and getattr(getattr(trainer, "template", None), "padding_free", False):
        if attention in ("flash_attention_2", "flash_attention_3"):
            notes.append(f"ms-swift padding_free/packing runs HF's {attention} (asked for by --attn_impl), not "
                         "mindspeed_hf's attention")
    return notes


def detect(trainer: Any, model: Any = None) -> Detected:
    """The framework driving `trainer`, the kernels of other packages found on its model that replaced ours
    (each named with the setting that turns it off), and the framework options that choose another attention."""
    name, version = framework_of(trainer)
    model = model if model is not None else getattr(trainer, "model", None)
    found = Detected(name, version)
    for family, parts in sorted(foreign_kernels(model).items()):
        switch = HUB_SWITCH if family == HUB_KERNELS else SWITCHES.get((name, family)) if name else None
        if family == "Liger" and switch is None and getattr(getattr(trainer, "args", None), "use_liger_kernel", False):
            switch = "use_liger_kernel=False"
        shown = ", ".join(sorted(parts)[:4]) + (f" (+{len(parts) - 4})" if len(parts) > 4 else "")
        found.conflicts.append(f"{family} replaced mindspeed_hf's kernels on {shown}"
                               + (f" (turn off: {switch})" if switch else ""))
    found.notes.extend(head_notes(model))
    found.notes.extend(_packing_notes(trainer, name, model))
    return found


def describe(trainer: Any, model: Any = None) -> str | None:
    """One line for the log: the framework and what of its options conflicts with ours; None when a plain
    Trainer has nothing to report."""
    found = detect(trainer, model)
    if found.name is None and not found.conflicts and not found.notes:
        return None
    who = f"{found.name} {found.version}" if found.version else (found.name or "Trainer")
    parts = found.conflicts + found.notes
    if not parts:
        return f"mindspeed_hf: running under {who}; no conflicting kernel options"
    return f"mindspeed_hf: running under {who}; " + "; ".join(parts)


def check_sequence_parallel(trainer: Any, model: Any = None) -> None:
    """Refuse, in one line before any work, accelerate's DeepSpeed Ulysses sequence parallelism
    (`parallelism_config.sp_size > 1`) on a model whose attention is ours: DeepSpeed wraps the attention named by
    `sp_attn_implementation` (sdpa or a flash name) and refuses a model configured with another one (a ValueError
    at accelerator.prepare, deep in the first train() call)."""
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if pc is None or not getattr(pc, "sp_enabled", False):
        return
    from ..ops.attention import ATTENTION_NAME, OUR_ATTENTIONS

    model = model if model is not None else getattr(trainer, "model", None)
    attention = compat.attn_implementation(getattr(_unwrap(model), "config", None))
    if attention == ATTENTION_NAME or attention in OUR_ATTENTIONS:
        raise ValueError(
            f"parallelism_config.sp_size={pc.sp_size} (accelerate's {pc.sp_backend} Ulysses sequence parallelism) "
            f"wraps the attention its sp_attn_implementation names (sdpa or flash), but this model runs "
            f"mindspeed_hf's attention ({attention!r}): build it with attn_implementation='sdpa' (mindspeed_hf's "
            "other kernels still apply) or set kernels.attention: false (MINDSPEED_HF_KERNELS_ATTENTION=false); "
            "mindspeed_hf's own sequence parallelism is parallel.cp (Ulysses / ring, MINDSPEED_HF_PARALLEL_CP)")


def log_once(trainer: Any, logger: Any, model: Any = None) -> str | None:
    """The one call for the Trainer wiring (after Trainer.__init__): an overlap that cannot run refused
    (check_sequence_parallel), then `describe` logged once per trainer, as a warning when another package's kernels
    replaced ours, else at info. Returns the line (None: nothing said)."""
    if getattr(trainer, "_mindspeed_framework_logged", False):
        return None
    check_sequence_parallel(trainer, model)
    found = detect(trainer, model)
    line = describe(trainer, model)
    try:
        trainer._mindspeed_framework_logged = True
    except AttributeError:  # a trainer that refuses attributes: say it every time rather than fail
        pass
    if line is not None:
        (logger.warning if found.conflicts else logger.info)(line)
    return line
