"""The `mindspeed-hf` command: `train [CONFIG.yaml] [--key value ...]`, `env`, `bench [CONFIG.yaml]`, `moe`, `export`.

Any option `train` does not know itself is a TrainingArguments override (`--output_dir DIR --max_steps 5`).
The config path is taken by hand rather than as an argparse positional: argparse would otherwise take the value
of an unknown option (the `5` of `--max_steps 5`) for the positional.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from ..recipes.run_config import split_config
from .parsers import (
    COMMANDS,
    bench_parser,
    env_parser,
    export_parser,
    moe_parser,
    parse,
    say_error,
    train_parser,
    usage,
)


def _setup_logging() -> None:
    # The library only adds a NullHandler; the command shows its INFO lines (what was applied, recompute, ...).
    logger = logging.getLogger("mindspeed_hf")
    if not any(isinstance(h, logging.StreamHandler) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _resume_flag(argv: list[str]) -> list[str]:
    """`--resume_from_checkpoint` with no PATH after it means "the newest checkpoint" (Trainer's True)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--resume_from_checkpoint" and (i + 1 == len(out) or out[i + 1].startswith("--")):
            out.insert(i + 1, "true")
            break
    return out


def _enable() -> None:
    """What `import mindspeed_hf` does elsewhere (the command defers it past `--help`, so a bad MINDSPEED_HF_*
    setting is its one-line error): enable the accelerator unless MINDSPEED_HF_AUTO=0."""
    import mindspeed_hf

    if not mindspeed_hf.is_enabled():
        mindspeed_hf.auto_enable()


# What a user's input can get wrong: a setting, a file, a model id. Anything else is a defect, reported the same
# way but with its type, so it can be told apart.
_INPUT_ERRORS = (ValueError, FileNotFoundError, OSError)


def _one_line_errors(command: str, debug: bool, work: Callable[[], int]) -> int:
    """Run `work`; an exception becomes one line on stderr and exit status 2 (the traceback only with --debug)."""
    try:
        return work()
    except _INPUT_ERRORS as err:
        if debug:
            raise
        say_error(command, err)
        return 2
    except Exception as err:  # noqa: BLE001 - the command's contract: one line, the traceback with --debug
        if debug:
            raise
        say_error(command, RuntimeError(f"{type(err).__name__}: {err} (run again with --debug for the traceback)"),
               every_rank=True)
        return 2


def _check_recipe(recipe: str | None, config: str | None) -> str:
    """The `--recipe` value checked (one line naming the valid choices); the VL and Omni recipes take no CONFIG."""
    from ..config import TRAIN_RECIPES

    name = next(iter(TRAIN_RECIPES)) if recipe is None else recipe
    if name not in TRAIN_RECIPES:
        raise ValueError(f"--recipe {recipe!r} is not valid; choose one of {', '.join(TRAIN_RECIPES)}")
    if name != "text" and config is not None:
        raise ValueError(f"--recipe {name} builds its own model and data and takes no CONFIG.yaml (got {config!r}); "
                         "give TrainingArguments overrides instead (--max_steps N, --output_dir DIR)")
    return name


def _train_media(recipe: str, overrides: list[str], metrics_file: str | None, quality_eval: bool,
                 run_state: dict[str, str]) -> int:
    """`mindspeed-hf train --recipe vl|omni`: its TrainingArguments first (bad values fail before any model)."""
    _enable()
    from ..recipes.text import check_resume

    if recipe == "vl":
        from ..recipes.vl import run_vl_training as run
        from ..recipes.vl import vl_training_args as training_args
    elif recipe == "diffusion":
        from ..recipes.diffusion import diffusion_training_args as training_args
        from ..recipes.diffusion import run_diffusion_training as run
    else:
        from ..recipes.omni import omni_training_args as training_args
        from ..recipes.omni import run_omni_training as run
    args = training_args(overrides)
    check_resume(args)
    run_state["output_dir"] = str(args.output_dir)
    run(args, metrics_file=metrics_file, quality_eval=quality_eval)
    return 0


def _imports(config: str | None, recipe: str | None, quiet: bool) -> str:
    """The recipe checked, the accelerator enabled and the run's stack imported; other packages' import-time
    warnings held back unless `quiet` is False (cli/quiet.py)."""
    from .quiet import preload, third_party_quiet

    with third_party_quiet(quiet):
        name = _check_recipe(recipe, config)
        _enable()
        from ..recipes import text  # noqa: F401 - imported here, inside the quiet block

        preload()
    return name


def _train_text(config: str | None, overrides: list[str], own: argparse.Namespace, run_state: dict[str, str]) -> int:
    """The text recipe: configuration errors are one clear line, before any model is built."""
    from ..recipes.run_config import load_run_config
    from ..recipes.text import check_parallel_sizes, check_resume, run_training, training_args_for
    from ..trainers.notices import ddp_notice_held

    run = load_run_config(config)
    with ddp_notice_held() as notice:  # transformers' DDP notice: not about a model we shard
        args = training_args_for(run, overrides)
    check_resume(args)
    notice.release(sharded=check_parallel_sizes(run, args) is not None)
    run_state["output_dir"] = str(args.output_dir)
    run_training(run, args, metrics_file=own.metrics_file, quality_eval=False if own.skip_quality_eval else None)
    return 0


def _without_resume(argv: list[str]) -> list[str]:
    """The command line without its --resume_from_checkpoint [PATH]."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--resume_from_checkpoint":
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        elif not arg.startswith("--resume_from_checkpoint="):
            out.append(arg)
    return out


def _stopped(argv: list[str], output_dir: str | None) -> int:
    """Ctrl-C: one line (rank 0) saying how to continue, and from which checkpoint; exit status 130."""
    import shlex

    from ..checkpoints import checkpoint_step
    from ..parallel.checkpoint import latest_complete_checkpoint

    if os.environ.get("RANK", "0") != "0":
        return 130
    found = latest_complete_checkpoint(output_dir) if output_dir else None
    if found is None:
        where = f" in {output_dir}" if output_dir else ""
        print(f"mindspeed-hf train: stopped (Ctrl-C) before any checkpoint was saved{where}; nothing to resume: run "
              "the same command to start over (--save_strategy steps --save_steps N saves checkpoints)",
              file=sys.stderr)
        return 130
    again = shlex.join(["mindspeed-hf", "train", *_without_resume(argv), "--resume_from_checkpoint"])
    print(f"mindspeed-hf train: stopped (Ctrl-C); the newest complete checkpoint is {found} (step "
          f"{checkpoint_step(found)}); continue from it with: {again}", file=sys.stderr)
    return 130


def cmd_train(argv: list[str]) -> int:
    """`mindspeed-hf train`."""
    config, rest = split_config(_resume_flag(argv))
    parsed = parse(train_parser(), rest, known=True)
    if parsed is None:
        return 0
    own, overrides = parsed
    _setup_logging()
    from .quiet import wants_third_party_output

    run_state: dict[str, str] = {}

    def work() -> int:
        recipe = _imports(config, own.recipe, not wants_third_party_output(own.debug, overrides))
        if recipe != "text":
            return _train_media(recipe, overrides, own.metrics_file, not own.skip_quality_eval, run_state)
        return _train_text(config, overrides, own, run_state)

    try:
        return _one_line_errors("train", own.debug, work)
    except KeyboardInterrupt:
        if own.debug:
            raise
        return _stopped(argv, run_state.get("output_dir"))


def cmd_bench(argv: list[str]) -> int:
    """`mindspeed-hf bench`."""
    config, rest = split_config(argv)
    parsed = parse(bench_parser(), rest, known=True)
    if parsed is None:
        return 0
    own, overrides = parsed
    if own.memory:
        from ..bench.memory_report import memory_report

        return memory_report(config, overrides)
    from .quiet import third_party_quiet

    with third_party_quiet():  # other packages' import-time lines held back, as for train
        from ..bench.run import bench, check_options
        from ..recipes.run_config import build_training_args, load_run_config

    try:  # fail here, once, on a bad config, option or MINDSPEED_HF_* value rather than in every subprocess
        from ..config.sources import check_variables

        check_variables(os.environ)
        check_options(own.repeats, own.backend, own.steps)
        # the overrides as the children will read them (unknown or bad TrainingArguments values: one line here)
        with third_party_quiet():
            build_training_args(load_run_config(config), overrides, accelerated=False)
        if own.plot:
            from ..bench.plot import require_matplotlib

            require_matplotlib()
    except (ValueError, FileNotFoundError, ImportError) as err:
        say_error("bench", err)
        return 2
    result = bench(config, steps=own.steps, overrides=overrides, workdir=own.workdir, repeats=own.repeats,
                   backend=own.backend, profile=own.profile)
    print(result.report)
    if own.plot:
        from ..bench.plot import plot

        print(f"\nchart: {plot(result.bases, result.fasts, own.plot, result.counts)}")
    return 0


def cmd_moe(argv: list[str]) -> int:
    """`mindspeed-hf moe OUTPUT_DIR`: cli/moe_report.py; errors are one line (exit status 2)."""
    parsed = parse(moe_parser(), argv)
    if parsed is None:
        return 0
    own = parsed[0]

    def run() -> int:
        from .moe_report import plot, summary

        print(summary(own.run_dir))
        if own.plot:
            print(f"\nchart: {plot(own.run_dir, own.plot)}")
        return 0

    return _one_line_errors("moe", own.debug, run)


def cmd_export(argv: list[str]) -> int:
    """`mindspeed-hf export CHECKPOINT OUT`: checkpoints/export.py; errors are one line (exit status 2)."""
    parsed = parse(export_parser(), argv)
    if parsed is None:
        return 0
    own = parsed[0]

    def run() -> int:
        from .quiet import third_party_quiet

        with third_party_quiet(not own.debug):  # other packages' import-time lines held back, as for train
            from ..checkpoints.export import export

        out = export(own.checkpoint, own.out, merge_lora=own.merge_lora, dtype=own.dtype,
                     max_shard_size=own.shard_size, push_to_hub=own.push_to_hub, overwrite=own.overwrite)
        print(f"mindspeed-hf export: wrote {out}" + (f", uploaded to {own.push_to_hub}" if own.push_to_hub else ""))
        return 0

    return _one_line_errors("export", own.debug, run)


def cmd_env(argv: list[str]) -> int:
    """`mindspeed-hf env`: cli/env.py."""
    parsed = parse(env_parser(), argv)
    if parsed is None:
        return 0
    own = parsed[0]

    def run() -> int:
        from .env import main as env_main
        from .quiet import third_party_quiet

        with third_party_quiet(not own.debug):  # other packages' import-time lines held back, as for train
            _enable()
        return env_main()

    return _one_line_errors("env", own.debug, run)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mindspeed-hf` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    handlers = {"train": cmd_train, "env": cmd_env, "bench": cmd_bench, "moe": cmd_moe, "export": cmd_export}
    if command not in handlers:
        print(f"mindspeed-hf: error: unknown command {command!r}; choose one of {', '.join(COMMANDS)} "
              "(mindspeed-hf --help shows them)", file=sys.stderr)
        return 2
    return handlers[command](rest)


if __name__ == "__main__":
    sys.exit(main())
