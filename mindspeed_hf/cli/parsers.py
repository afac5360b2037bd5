"""The `mindspeed-hf` command's parsers: one per subcommand, each printing its own `--help`, and the table that the
command (cli/main.py) and the generated command reference (docs/reference/commands.md) both read.

Parsing takes no torch and no model: `--help` and a mistyped option are instant. A mistake is one line
(`mindspeed-hf bench: error: ...`, exit status 2), not argparse's usage block.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..config import TRAIN_RECIPES

HELP_WIDTH = 100  # fixed, so the generated reference does not depend on the terminal that built it


def say_error(command: str, err: BaseException, every_rank: bool = False) -> None:
    """One line on stderr, from rank 0 only under torchrun (every rank finds the same configuration error; they all
    exit 2); `every_rank` for a failure that may be one rank's own."""
    rank = os.environ.get("RANK", "0")
    if rank == "0" or every_rank:
        text = " ".join(str(err).split()) or type(err).__name__
        where = f" (rank {rank})" if rank != "0" else ""
        print(f"mindspeed-hf {command}{where}: error: {text}", file=sys.stderr)


class CommandParser(argparse.ArgumentParser):
    """argparse whose mistakes are the command's one line, and whose `-h/--help` prints this subcommand's help and
    returns instead of exiting (see `parse`)."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        say_error(self.prog.removeprefix("mindspeed-hf "), ValueError(f"{message} (--help lists the options)"))
        raise SystemExit(2)


def _parser(name: str, description: str, usage: str | None = None, epilog: str | None = None) -> CommandParser:
    parser = CommandParser(
        prog=f"mindspeed-hf {name}", usage=usage, description=description, epilog=epilog, allow_abbrev=False,
        add_help=False, formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=HELP_WIDTH))
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return parser


def parse(parser: CommandParser, argv: list[str], known: bool = False
          ) -> tuple[argparse.Namespace, list[str]] | None:
    """`argv` parsed (with the unknown options when `known`); None after printing the help that `-h` asked for
    (before any check of the arguments: `mindspeed-hf export --help` needs no CHECKPOINT)."""
    if "-h" in argv or "--help" in argv:
        print(parser.format_help())
        return None
    if known:
        own, rest = parser.parse_known_args(argv)
    else:
        own, rest = parser.parse_args(argv), []
    return own, rest


def train_parser() -> CommandParser:
    """`mindspeed-hf train [CONFIG.yaml] [options] [--<TrainingArguments key> VALUE ...]`."""
    parser = _parser(
        "train", usage="mindspeed-hf train [CONFIG.yaml] [options] [--<TrainingArguments key> VALUE ...]",
        description=(
            "A supervised fine-tuning run from a YAML run description (model, data, TrainingArguments, the\n"
            "accelerator's settings). Without CONFIG.yaml: the embedded tiny default run (a Qwen3-architecture\n"
            "model, its tokenizer and an instruction dataset shipped in the package), with held-out loss and\n"
            "exact-match accuracy before and after, and a Hugging Face checkpoint in ./mindspeed_hf_output.\n"
            "Any option not listed below is a TrainingArguments override (--max_steps 5 --output_dir DIR);\n"
            "--resume_from_checkpoint [PATH] continues from PATH, or without PATH from the newest complete\n"
            "checkpoint in output_dir.\n"
            "Errors are one line (exit status 2); --debug shows the traceback."),
        epilog=("recipes: text (CONFIG.yaml or the default run); vl: a tiny Qwen2.5-VL on synthetic images\n"
                "(transformers >= 5); omni: a tiny Qwen2.5-Omni thinker on synthetic tones and images; diffusion:\n"
                "a tiny Flux transformer's text-to-image LoRA run in diffusers' loop (the [diffusion] extra).\n"
                "The vl, omni and diffusion recipes build their own model and data and take no CONFIG.yaml."))
    parser.add_argument("--recipe", default=None, metavar="NAME",
                        help="which run: " + ", ".join(TRAIN_RECIPES) + " (default text)")
    parser.add_argument("--metrics-file", default=None, metavar="F", help="write the run's metrics as JSON to F")
    parser.add_argument("--skip-quality-eval", action="store_true",
                        help="skip the before/after held-out loss and accuracy")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    return parser


def env_parser() -> CommandParser:
    """`mindspeed-hf env`."""
    parser = _parser("env", description=(
        "The device, the installed versions (torch, transformers, accelerate, PEFT, TRL, the kernel libraries),\n"
        "the accelerator's settings and where each came from, and the kernel each op uses here, as a markdown\n"
        "table (paste it into an issue)."))
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def bench_parser() -> CommandParser:
    """`mindspeed-hf bench [CONFIG.yaml] [options] [--<TrainingArguments key> VALUE ...]`."""
    parser = _parser(
        "bench", usage="mindspeed-hf bench [CONFIG.yaml] [options] [--<TrainingArguments key> VALUE ...]",
        description=(
            "The same short run (CONFIG.yaml, or the embedded default run) without and with the accelerator,\n"
            "in separate processes, R interleaved pairs: median ratios and their spread (step time, host time,\n"
            "tokens/s, peak memory), then one counted step of each (aten ops, torch_npu calls, saved bytes,\n"
            "largest tensor). On a CPU the torch backend runs HF's own code where ours gains nothing\n"
            "(report()['hf_path']): expect no speed-up but the large-vocabulary loss."))
    parser.add_argument("--steps", type=int, default=20, help="training steps per side (default 20)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved baseline/accelerated pairs; ratios are their median and spread (default 3)")
    parser.add_argument("--workdir", default=None, help="keep both runs' outputs here (default: a temp dir)")
    parser.add_argument("--backend", default=None,
                        help="the accelerated side's kernel backend: auto, torch, npu (where torch_npu loads), cuda")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="write a chrome trace of a few accelerated steps to DIR/trace.json, print the top ops")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw both runs' losses and the ratios with their spread (needs matplotlib: [plot])")
    parser.add_argument("--memory", action="store_true", help="print the run's memory report instead")
    return parser


def moe_parser() -> CommandParser:
    """`mindspeed-hf moe OUTPUT_DIR`."""
    parser = _parser("moe", description=(
        "The expert load of a Trainer run on a MoE model (OUTPUT_DIR/moe_load.jsonl): per layer, the busiest\n"
        "expert over the mean at the first and last logged interval and over the run."))
    parser.add_argument("run_dir", metavar="OUTPUT_DIR", help="the run's output_dir (or its moe_load.jsonl)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw each layer's token share per expert and its imbalance per step (needs [plot])")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def export_parser() -> CommandParser:
    """`mindspeed-hf export CHECKPOINT OUT`."""
    parser = _parser("export", description=(
        "A checkpoint of any layout the accelerator writes (sharded DCP or not; a PEFT run: its adapter, or\n"
        "with --merge-lora the merged model) as a Hugging Face directory that from_pretrained loads, in one\n"
        "CPU process, streamed one output file at a time."))
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint-N directory (or accelerate's state)")
    parser.add_argument("out", metavar="OUT", help="the directory to write: new or empty (see --overwrite)")
    parser.add_argument("--merge-lora", action="store_true", help="a LoRA run: write the merged full model")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: as saved")
    parser.add_argument("--shard-size", default="5GB", help="the largest safetensors file (default 5GB)")
    parser.add_argument("--push-to-hub", metavar="ID", default=None, help="upload the directory to this Hub repository")
    parser.add_argument("--overwrite", action="store_true",
                        help="OUT may hold files: the model files there are replaced (default: OUT new or empty)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, the line `mindspeed-hf --help` shows, and its parser."""

    name: str
    summary: str
    parser: Callable[[], CommandParser]


COMMANDS = {c.name: c for c in (
    Command("train", "fine-tune: a YAML run, the embedded default run, or a recipe (vl, omni, diffusion)",
            train_parser),
    Command("env", "device, versions, settings and the kernel each op uses here", env_parser),
    Command("bench", "the same run without and with the accelerator: ratios with their spread", bench_parser),
    Command("moe", "the expert load of a MoE run, per layer", moe_parser),
    Command("export", "any checkpoint as a Hugging Face model directory", export_parser),
)}


def usage() -> str:
    """`mindspeed-hf --help`: the commands, a line each."""
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS.values()]
    return ("usage: mindspeed-hf <command> [options]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n`mindspeed-hf <command> --help` describes a command and its options.")
