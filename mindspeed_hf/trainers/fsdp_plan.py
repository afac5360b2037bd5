"""Whether, and how, a trainer's model is sharded with FSDP2: one reading of every source of the request.

The sources are TrainingArguments `fsdp` + `fsdp_config`, the environment `accelerate launch` exports for an
FSDP config (ACCELERATE_USE_FSDP, FSDP_*, PARALLELISM_CONFIG_*), and mindspeed_hf's own parallel sizes. They are
read once, before any work; contradictions fail with a message that names the settings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist

from .. import parallel
from ..config import MindSpeedConfig, ParallelConfig

logger = logging.getLogger("mindspeed_hf")

_TRUE, _FALSE = ("1", "true", "yes", "on", "full_shard"), ("0", "false", "no", "off", "shard_grad_op", "no_shard")
_OUR_AXES, _ACCELERATE_AXES = ("dp_replicate", "dp_shard", "cp", "ep"), ("dp_replicate", "dp_shard", "cp", "tp", "sp")
_CONFIG_LABEL = ("mindspeed_hf parallel config (parallel.* in MINDSPEED_HF_CONFIG, or mindspeed_dp_replicate / "
                 "mindspeed_dp_shard / mindspeed_cp / mindspeed_ep / mindspeed_reshard_after_forward / "
                 "mindspeed_cpu_offload)")


@dataclass(frozen=True)
class FsdpPlan:
    """What to build: mesh sizes (dp_shard -1 = fill the world) and FSDP2 knobs, plus who asked for it."""

    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    reshard_after_forward: bool
    cpu_offload: bool
    prefetch: int
    cpu_ram_efficient_loading: bool
    activation_checkpointing: bool
    sources: tuple[str, ...]
    layer_classes: tuple[str, ...] | None = None  # None: the model's _no_split_modules


# ---------------------------------------------------------------------------------------------- the request
def _flag(value: Any, where: str) -> bool:
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{where}={value!r} must be true or false")


def _hf_request(args: Any) -> dict[str, Any] | None:
    """FSDP asked for through TrainingArguments (`fsdp` + `fsdp_config`, normalised by HF into fsdp_plugin_args)."""
    plugin = getattr(args, "fsdp_plugin_args", None)
    if not getattr(args, "fsdp", None) or plugin is None:  # None also for fsdp_config xla (not ours)
        return None
    version = int(plugin.get("fsdp_version", 2))
    # HF fills reshard_after_forward in with a default; only what the user stated (fsdp_config, or a legacy
    # `fsdp="full_shard"` string, which HF writes into fsdp_config) may contradict our own setting.
    config = getattr(args, "fsdp_config", None) or {}
    stated = config.get("reshard_after_forward")
    return {"source": "TrainingArguments.fsdp/fsdp_config", "version": version,
            **_wrap_request(plugin.get("auto_wrap_policy"), plugin.get("transformer_cls_names_to_wrap"),
                            plugin.get("state_dict_type") if "state_dict_type" in config else None),
            "reshard_after_forward": _flag(stated, "fsdp_config['reshard_after_forward']")
            if version == 2 and stated is not None else None,
            **{k: bool(plugin.get(k, False)) for k in ("cpu_offload", "cpu_ram_efficient_loading",
                                                       "activation_checkpointing")}}


def _env_request(env: Mapping[str, str]) -> dict[str, Any] | None:
    """FSDP asked for by `accelerate launch` (FSDP_* variables; accelerate defaults FSDP_VERSION to 1)."""
    if not _flag(env.get("ACCELERATE_USE_FSDP", "false"), "ACCELERATE_USE_FSDP"):
        return None
    version, reshard = int(env.get("FSDP_VERSION", "1")), env.get("FSDP_RESHARD_AFTER_FORWARD")
    flags = {k: _flag(env.get(f"FSDP_{v}", "false"), f"FSDP_{v}") for k, v in (
        ("cpu_offload", "OFFLOAD_PARAMS"), ("cpu_ram_efficient_loading", "CPU_RAM_EFFICIENT_LOADING"),
        ("activation_checkpointing", "ACTIVATION_CHECKPOINTING"))}
    return {"source": "accelerate launch environment (ACCELERATE_USE_FSDP)", "version": version,
            **_wrap_request(env.get("FSDP_AUTO_WRAP_POLICY"), env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"),
                            env.get("FSDP_STATE_DICT_TYPE")),
            "reshard_after_forward": _flag(reshard, "FSDP_RESHARD_AFTER_FORWARD") if reshard and version == 2
            else None, **flags}


def _wrap_request(policy: str | None, classes: str | None, state_dict_type: str | None) -> dict[str, Any]:
    """accelerate's wrapping and state-dict settings, normalised (None: not stated)."""
    names = tuple(c.strip() for c in (classes or "").split(",") if c.strip()) or None
    return {"auto_wrap_policy": (policy or "").upper() or None, "layer_classes": names,
            "state_dict_type": (state_dict_type or "").upper() or None}


def _say_what_differs(request: dict[str, Any]) -> None:
    """accelerate settings mindspeed_hf's FSDP2 does not follow: say so (once per trainer) instead of dropping them."""
    policy = request["auto_wrap_policy"]
    if policy not in (None, "TRANSFORMER_BASED_WRAP"):
        logger.warning("mindspeed_hf FSDP2: %s sets auto_wrap_policy=%s, which is not applied: each decoder layer "
                       "(or transformer_layer_cls_to_wrap) is one FSDP group, as with TRANSFORMER_BASED_WRAP",
                       request["source"], policy)
    if request["state_dict_type"] == "FULL_STATE_DICT":
        logger.warning("mindspeed_hf FSDP2: %s sets state_dict_type=FULL_STATE_DICT; checkpoints are written as "
                       "sharded DCP directories instead (resumable, no full gather); save_model still writes "
                       "consolidated HF safetensors", request["source"])


def _explicit(section: ParallelConfig) -> dict[str, Any]:
    """The parallel settings that differ from the defaults (what a user set on purpose)."""
    default = ParallelConfig()
    return {f.name: getattr(section, f.name) for f in fields(section)
            if getattr(section, f.name) != getattr(default, f.name)}


def _size_sources(args: Any, config: MindSpeedConfig, env: Mapping[str, str]) -> list[tuple[str, dict[str, int]]]:
    """Every place that states mesh sizes, as (label, {dp_replicate, dp_shard, cp, ep, tp, sp})."""
    out = []
    if (_flag(env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false"), "ACCELERATE_USE_PARALLELISM_CONFIG")
            or any(k.startswith("PARALLELISM_CONFIG_") and k.endswith("_SIZE") for k in env)):
        out.append(("accelerate launch environment (PARALLELISM_CONFIG_*_SIZE)",
                    {k: int(env.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE", "1")) for k in _ACCELERATE_AXES}))
    pc = getattr(args, "parallelism_config", None)
    if pc is not None:
        out.append(("TrainingArguments.parallelism_config",
                    {k: int(getattr(pc, f"{k}_size", None) or 1) for k in _ACCELERATE_AXES}))
    if _explicit_sizes(config):
        out.append((_CONFIG_LABEL, {k: getattr(config.parallel, k) for k in _OUR_AXES}))
    return out


def _explicit_sizes(config: MindSpeedConfig) -> dict[str, int]:
    return {k: v for k, v in _explicit(config.parallel).items() if k in _OUR_AXES}


def world_size_from(env: Mapping[str, str]) -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(env.get("WORLD_SIZE", "1"))


def _resolve_sizes(sources: list[tuple[str, dict[str, int]]], world: int) -> tuple[int, int, int, int]:
    """One (dp_replicate, dp_shard, cp, ep) all sources agree on; errors name the source and the setting."""
    resolved: list[tuple[str, tuple[int, int, int, int]]] = []
    for label, s in sources:
        for name, why in (("tp", "tensor parallel"), ("sp", "sequence parallel"), ("cp", "context parallel"),
                          ("ep", "expert parallel")):
            if s.get(name, 1) > 1:
                raise ValueError(f"{label}: {name} size {s[name]} ({why}) is not supported by mindspeed_hf's "
                                 f"Trainer FSDP2 integration yet; valid choices: {name} size 1")
        try:
            dims = parallel.ParallelDims(s["dp_replicate"], s["dp_shard"], s["cp"], s.get("ep", 1), world_size=world)
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from err
        resolved.append((label, (dims.dp_replicate, dims.dp_shard, dims.cp, dims.ep)))
    for label, sizes in resolved[1:]:
        if sizes != resolved[0][1]:
            raise ValueError(f"contradictory mesh sizes (dp_replicate, dp_shard, cp, ep): {resolved[0][0]} gives "
                             f"{resolved[0][1]} but {label} gives {sizes}; set them in one place only")
    return resolved[0][1] if resolved else (1, parallel.ParallelDims(world_size=world).dp_shard, 1, 1)


def _knob(name: str, hf: dict[str, Any] | None, config: MindSpeedConfig) -> Any:
    """An FSDP knob from HF/accelerate if it states one, else ours; both stated and different is an error."""
    ours, explicit = getattr(config.parallel, name), name in _explicit(config.parallel)
    theirs = hf.get(name) if hf else None
    if theirs is not None and explicit and theirs != ours:
        raise ValueError(f"{hf['source']} sets {name}={theirs} but {_CONFIG_LABEL} sets parallel.{name}={ours}; "
                         "set it in one place only")
    return theirs if theirs is not None else ours


def resolve_plan(args: Any, config: MindSpeedConfig, env: Mapping[str, str] | None = None,
                 world_size: int | None = None) -> FsdpPlan | None:
    """Whether (and how) this trainer's model is sharded with FSDP2; None leaves Trainer exactly as it is.

    Raises ValueError (naming the settings) on contradictions: FSDP version 1 together with mindspeed_hf
    parallel sizes, different versions or sizes from two sources, sizes whose product is not the world size.
    """
    env = os.environ if env is None else env
    world = world_size_from(env) if world_size is None else world_size
    requests = [r for r in (_hf_request(args), _env_request(env)) if r is not None]
    if len(requests) == 2 and requests[0]["version"] != requests[1]["version"]:
        raise ValueError(f"{requests[0]['source']} asks for FSDP version {requests[0]['version']} but "
                         f"{requests[1]['source']} (FSDP_VERSION) for version {requests[1]['version']}")
    hf = requests[0] if requests else None
    if hf and len(requests) == 2:  # both stated: a knob they disagree on is a contradiction too
        for knob in ("reshard_after_forward", "cpu_offload"):
            a, b = requests[0][knob], requests[1][knob]
            if a is not None and b is not None and a != b:
                raise ValueError(f"{requests[0]['source']} sets {knob}={a} but {requests[1]['source']} sets {b}")
    ours_sizes = _explicit_sizes(config)
    if hf and hf["version"] != 2:
        if ours_sizes:
            raise ValueError(f"{hf['source']} asks for FSDP version {hf['version']}, which cannot be combined with "
                             f"{_CONFIG_LABEL} sizes {ours_sizes}: mindspeed_hf shards with FSDP2; valid choices: "
                             "fsdp version 2, or drop the mindspeed_hf parallel sizes")
        logger.info("mindspeed_hf: FSDP version %s is left to accelerate", hf["version"])
        return None
    if hf is None and not ours_sizes:
        return None
    dp_replicate, dp_shard, cp, ep = _resolve_sizes(_size_sources(args, config, env), world)
    if dp_replicate * dp_shard * cp == 1:
        logger.info("mindspeed_hf: FSDP asked for in a single process; nothing to shard")
        return None
    stated_classes = {r["layer_classes"] for r in requests if r["layer_classes"]}
    if len(stated_classes) > 1:
        raise ValueError(f"{requests[0]['source']} and {requests[1]['source']} name different layer classes to "
                         f"wrap: {sorted(stated_classes)}; set transformer_layer_cls_to_wrap in one place only")
    for request in requests:
        _say_what_differs(request)
    sources = tuple(r["source"] for r in requests) + ((_CONFIG_LABEL,) if ours_sizes else ())
    return FsdpPlan(dp_replicate, dp_shard, cp, ep, bool(_knob("reshard_after_forward", hf, config)),
                    bool(_knob("cpu_offload", hf, config)), config.parallel.prefetch,
                    bool(hf and hf["cpu_ram_efficient_loading"]), bool(hf and hf["activation_checkpointing"]),
                    sources, next(iter(stated_classes), None))
