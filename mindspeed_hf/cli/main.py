"""The `mindspeed-hf` command: `train [CONFIG.yaml] [--key value ...]`, `env`, `bench [CONFIG.yaml]`.

Any option `train` does not know itself is a TrainingArguments override (`--output_dir DIR --max_steps 5`).
The config path is taken by hand rather than as an argparse positional: argparse would otherwise take the value
of an unknown option (the `5` of `--max_steps 5`) for the positional.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

USAGE = """mindspeed-hf <command> [options]

commands:
  train [CONFIG.yaml] [--metrics-file F] [--skip-quality-eval] [--resume_from_checkpoint [PATH]]
        [--<TrainingArguments key> VALUE ...]
        SFT run from a YAML run description (no CONFIG: the embedded tiny default run); with
        --resume_from_checkpoint it continues from PATH, or without PATH from the newest checkpoint in output_dir
  env   device, versions and the kernel each op uses here, as a markdown table
  bench [CONFIG.yaml] [--steps N] [--repeats R] [--<TrainingArguments key> VALUE ...]
        the same short run without and with the accelerator, R interleaved pairs, median ratios and spread
"""


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return None, argv


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


def _error(command: str, err: Exception) -> None:
    """One line on stderr, from rank 0 only under torchrun (every rank finds the same error; they all exit 2)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"mindspeed-hf {command}: error: {err}", file=sys.stderr)


def cmd_train(argv: list[str]) -> int:
    """`mindspeed-hf train`."""
    config, rest = _split_config(_resume_flag(argv))
    parser = argparse.ArgumentParser(prog="mindspeed-hf train", allow_abbrev=False, add_help=False)
    parser.add_argument("--metrics-file", default=None, help="write the run's metrics as JSON here")
    parser.add_argument("--skip-quality-eval", action="store_true", help="skip the before/after quality check")
    parser.add_argument("-h", "--help", action="store_true")
    own, overrides = parser.parse_known_args(rest)
    if own.help:
        print(USAGE)
        return 0
    _setup_logging()
    from .run_config import load_run_config
    from .train import check_parallel_sizes, check_resume, run_training, training_args_for

    try:  # configuration errors: one clear line, before any model is built
        run = load_run_config(config)
        args = training_args_for(run, overrides)
        check_resume(args)
        check_parallel_sizes(run, args)
    except (ValueError, FileNotFoundError) as err:
        _error("train", err)
        return 2
    run_training(run, args, metrics_file=own.metrics_file, quality_eval=False if own.skip_quality_eval else None)
    return 0


def cmd_bench(argv: list[str]) -> int:
    """`mindspeed-hf bench`."""
    config, rest = _split_config(argv)
    parser = argparse.ArgumentParser(prog="mindspeed-hf bench", allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=20, help="training steps per side (default 20)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved baseline/accelerated pairs; ratios are their median and spread (default 3)")
    parser.add_argument("--workdir", default=None, help="keep both runs' outputs here (default: a temp dir)")
    own, overrides = parser.parse_known_args(rest)
    from .bench import bench
    from .run_config import load_run_config

    try:  # fail here, once, on a bad config rather than in both subprocesses
        load_run_config(config)
    except (ValueError, FileNotFoundError) as err:
        _error("bench", err)
        return 2
    if own.repeats < 1:
        _error("bench", ValueError(f"--repeats={own.repeats} must be >= 1"))
        return 2
    table, _, _ = bench(config, steps=own.steps, overrides=overrides, workdir=own.workdir, repeats=own.repeats)
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mindspeed-hf` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "env":
        from .env import main as env_main

        return env_main()
    handlers = {"train": cmd_train, "bench": cmd_bench}
    if command not in handlers:
        print(f"mindspeed-hf: unknown command {command!r}; choose one of train, env, bench\n\n{USAGE}",
              file=sys.stderr)
        return 2
    return handlers[command](rest)


if __name__ == "__main__":
    sys.exit(main())
