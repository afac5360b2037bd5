"""Whether, and how, a run's model is sharded by us: one reading of every source of the request, for a Trainer and
an accelerate loop alike.

Whether FSDP is asked for comes from TrainingArguments `fsdp` + `fsdp_config` (a trainer), the `fsdp_plugin` a script
gave its Accelerator (a loop), the environment `accelerate launch` exports for an FSDP config (ACCELERATE_USE_FSDP,
FSDP_*), and the parallel sizes of the resolved config; the sizes and knobs themselves are settings of
mindspeed_hf.config, resolved there with one precedence. Read once per run, before any work; contradictions fail with
a message that names the settings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from .. import parallel
from ..config import ACCELERATE_SOURCE, ParallelConfig, ResolvedConfig
from ..config.sources import hf_fsdp_settings, plugin_fsdp_settings
from ..parallel.plan import AXES, AXIS, SIZE_PATHS, ParallelPlan
from ..value_kinds import parse_flag

logger = logging.getLogger("mindspeed_hf")

_SIZE_PATHS = SIZE_PATHS  # the sizes' setting paths, from the one table of axes (parallel/plan.py AXES)
#: axes whose accelerate size alone (accelerate launch environment) asks for ours: accelerate's own would bypass our
#: attention (cp) or shard the model its own way (tp)
_TAKEN_FROM_ACCELERATE = (AXIS["cp"].path, AXIS["tp"].path)
#: accelerate's ParallelismConfig axes that no row of AXES builds: refused before any work
_NOT_OURS = {"sp": "sequence parallel"}


# ---------------------------------------------------------------------------------------------- the request
def _settings_request(source: str, settings: dict[str, Any] | None) -> dict[str, Any] | None:
    """FSDP asked for through TrainingArguments (hf_fsdp_settings) or an Accelerator's plugin
    (plugin_fsdp_settings). Its knobs (reshard_after_forward, cpu_offload, activation_checkpointing) are settings:
    see mindspeed_hf.config.sources."""
    if settings is None:
        return None
    return {"source": source, "version": settings["version"],
            **_wrap_request(settings["auto_wrap_policy"], settings["classes"], settings["state_dict_type"]),
            "cpu_ram_efficient_loading": parse_flag(settings["cpu_ram_efficient_loading"],
                                               "fsdp_config['cpu_ram_efficient_loading']")}


def _env_request(env: Mapping[str, str]) -> dict[str, Any] | None:
    """FSDP asked for by `accelerate launch` (FSDP_* variables; accelerate defaults FSDP_VERSION to 1). Its knobs
    are settings: see mindspeed_hf.config.accelerate_env_layer."""
    if not parse_flag(env.get("ACCELERATE_USE_FSDP", "false"), "ACCELERATE_USE_FSDP"):
        return None
    return {"source": "accelerate launch environment (ACCELERATE_USE_FSDP)",
            "version": int(env.get("FSDP_VERSION", "1")),
            **_wrap_request(env.get("FSDP_AUTO_WRAP_POLICY"), env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"),
                            env.get("FSDP_STATE_DICT_TYPE")),
            "cpu_ram_efficient_loading": parse_flag(env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false"),
                                               "FSDP_CPU_RAM_EFFICIENT_LOADING")}


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


def _refuse_other_axes(pc: Any, pc_source: str, env: Mapping[str, str]) -> None:
    """accelerate's parallel sizes of axes we do not build (sequence parallel: not a row of AXES); refuse them
    before any work."""
    axes = [name for name in _NOT_OURS if name not in AXIS]
    stated = [("accelerate launch environment", {k: env.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE") for k in axes})]
    if pc is not None:
        stated.append((pc_source, {k: getattr(pc, f"{k}_size", None) for k in axes}))
    for label, sizes in stated:
        for name, why in ((name, _NOT_OURS[name]) for name in axes):
            if sizes.get(name) is not None and int(sizes[name]) > 1:
                raise ValueError(f"{label}: {name} size {sizes[name]} ({why}) is not supported by mindspeed_hf's "
                                 f"parallelism; valid choices: {name} size 1")


def world_size_from(env: Mapping[str, str]) -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(env.get("WORLD_SIZE", "1"))


def _sizes(resolved: ResolvedConfig, world: int) -> parallel.ParallelDims:
    """The mesh sizes, checked against the world size; the error names where each size came from."""
    p = resolved.config.parallel
    try:
        return parallel.ParallelDims(**{axis.name: getattr(p, axis.name) for axis in AXES}, world_size=world,
                                     cp_ulysses=p.cp_ulysses)
    except ValueError as err:
        given = ", ".join(resolved.describe(path) for path in _SIZE_PATHS if resolved.is_set(path))
        given = given or "the defaults"
        raise ValueError(f"mindspeed_hf parallel sizes from {given}: {err}") from err


def _asks_for_sharding(requests: list[dict[str, Any]], ours: dict[str, str], resolved: ResolvedConfig) -> bool:
    """An FSDP request, or a parallel size set to something other than its default (a run description that lists
    the default sizes asks for nothing)."""
    given, default = resolved.config.parallel, ParallelConfig()
    names = [path.rpartition(".")[2] for path in ours]
    return bool(requests) or any(getattr(given, n) != getattr(default, n) for n in names)


def resolve_plan(args: Any, resolved: ResolvedConfig, env: Mapping[str, str] | None = None,
                 world_size: int | None = None, announce: bool = True, *, fsdp_plugin: Any = None,
                 parallelism_config: Any = None) -> ParallelPlan | None:
    """Whether (and how) a run's model is sharded by us; None leaves Trainer / accelerate exactly as they are.

    `args`: a trainer's TrainingArguments (None for an accelerate loop); `fsdp_plugin` / `parallelism_config`: what
    a loop's script gave its Accelerator. FSDP is asked for by TrainingArguments `fsdp` (version 2), an Accelerator's
    `fsdp_plugin` (fsdp_version 2), by `accelerate launch` (ACCELERATE_USE_FSDP with
    FSDP_VERSION 2), or by a parallel size set in our own settings (arguments, MINDSPEED_HF_*, YAML, or
    TrainingArguments' parallelism_config); accelerate's PARALLELISM_CONFIG_* sizes then shape the mesh too, and
    its PARALLELISM_CONFIG_CP_SIZE > 1 asks for it alone (our context parallelism replaces accelerate's). Sizes
    and knobs are the resolved config's (mindspeed_hf.config gives the precedence). Raises ValueError (naming the
    settings) for FSDP version 1 together with our sizes, different versions or layer classes from two sources,
    sequence parallel sizes, tp with cp / ep, and sizes that do not tile the world. `announce=False`: the same
    checks without the log lines (a check made before the trainer, which says them).
    """
    env = os.environ if env is None else env
    world = world_size_from(env) if world_size is None else world_size
    own = (_settings_request("TrainingArguments.fsdp/fsdp_config", hf_fsdp_settings(args)) if args is not None
           else _settings_request("Accelerator(fsdp_plugin=...)", plugin_fsdp_settings(fsdp_plugin)))
    requests = [r for r in (own, _env_request(env)) if r is not None]
    if len(requests) == 2 and "FSDP_VERSION" not in env:
        # transformers 4.57 writes its own `fsdp` arguments into ACCELERATE_USE_FSDP / FSDP_*: not a second source
        requests = requests[:1]
    if len(requests) == 2 and requests[0]["version"] != requests[1]["version"]:
        raise ValueError(f"{requests[0]['source']} asks for FSDP version {requests[0]['version']} but "
                         f"{requests[1]['source']} (FSDP_VERSION) for version {requests[1]['version']}")
    hf = requests[0] if requests else None
    sizes_set = {path: resolved.sources[path] for path in _SIZE_PATHS if resolved.is_set(path)}
    # accelerate's own sizes configure our mesh once FSDP is asked for; alone they are accelerate's business, but
    # for cp > 1: accelerate's context parallel (torch's, SDPA only) would bypass our attention, so ours runs it
    ours = {path: source for path, source in sizes_set.items()
            if source != ACCELERATE_SOURCE or (path in _TAKEN_FROM_ACCELERATE and resolved.value(path) > 1)}
    if hf and hf["version"] != 2:
        if ours:
            raise ValueError(f"{hf['source']} asks for FSDP version {hf['version']}, which cannot be combined with "
                             f"the mindspeed_hf parallel sizes {sorted(ours)} (from {', '.join(ours.values())}): "
                             "mindspeed_hf shards with FSDP2; valid choices: fsdp version 2, or no parallel sizes")
        if announce:
            logger.info("mindspeed_hf: FSDP version %s is left to accelerate", hf["version"])
        return None
    if hf is None and not ours:
        return None
    if args is not None:
        parallelism_config = getattr(args, "parallelism_config", None)
    _refuse_other_axes(parallelism_config, "TrainingArguments.parallelism_config" if args is not None
                       else "Accelerator(parallelism_config=...)", env)
    dims = _sizes(resolved, world)
    if dims.dp_replicate * dims.fsdp_size * dims.tp == 1:
        if announce and _asks_for_sharding(requests, ours, resolved):
            logger.info("mindspeed_hf: FSDP asked for in a single process; nothing to shard")
        return None
    stated_classes = {r["layer_classes"] for r in requests if r["layer_classes"]}
    if len(stated_classes) > 1:
        raise ValueError(f"{requests[0]['source']} and {requests[1]['source']} name different layer classes to "
                         f"wrap: {sorted(stated_classes)}; set transformer_layer_cls_to_wrap in one place only")
    for request in requests if announce else []:
        _say_what_differs(request)
    p = resolved.config.parallel
    asked = [r["source"] for r in requests]  # an FSDP request, then the sources of sizes it does not already name
    sources = tuple(dict.fromkeys(asked + [s for s in sizes_set.values() if not any(a.startswith(s) for a in asked)]))
    return ParallelPlan.from_dims(dims, reshard_after_forward=p.reshard_after_forward, cpu_offload=p.cpu_offload,
                                  prefetch=p.prefetch,
                                  cpu_ram_efficient_loading=bool(hf and hf["cpu_ram_efficient_loading"]),
                                  sources=sources, layer_classes=next(iter(stated_classes), None),
                                  size_sources=sizes_set)
