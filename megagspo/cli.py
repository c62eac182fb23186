"""megagspo command line.

    megagspo train  --config configs/tiny_cpu.yaml [section.key=value ...]   cold-start SFT, then RL
    megagspo train  ... --resume | --overwrite                                continue the run / move it aside
    megagspo sft    --config configs/tiny_cpu.yaml [overrides]               cold-start SFT only (checkpoint)
    megagspo export --checkpoint runs/tiny_cpu [--out DIR]                    Hugging Face folder (safetensors)
    megagspo plan   --config configs/qwen3_30b_a3b_gspo.yaml [overrides]       per-GPU memory plan
    megagspo train  --dry-run --config RECIPE                                 validate a recipe without GPUs
    megagspo ablate --config configs/ablations/tiny_cpu.yaml [--jobs 2]        A/B arms x seeds, then a report

Under torchrun every process runs the same command (gloo on CPU):
    torchrun --nproc-per-node 2 -m megagspo.cli train --config configs/tiny_cpu.yaml

This module imports only the standard library: a Ctrl-C in the seconds that torch, Megatron-Core and
transformers take to import is one line, exit 130 (megagspo.interrupts), and --help is instant. The commands
themselves are in megagspo.commands.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from megagspo import environment, interrupts


def _quiet_third_party() -> None:
    """What the libraries say that a user cannot act on is dropped; any other warning keeps Python's default
    (shown once per place it is raised from)."""
    import logging

    warnings.showwarning = _show_warning
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|cuda_graph_scope).*")
    # Megatron's distributed optimizer calls these torch.distributed names; torch 2.13 deprecates them
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")
    logging.getLogger("moe.cpu_shim").setLevel(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # transformers' own bars ("Writing model shards" for one file, "Loading weights"): our bars say the progress
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("moe.cpu_shim", "moe.megatron_compat"):
        logging.getLogger(name).addFilter(_PATCH_LINES)
    megatron = logging.getLogger("megatron")
    if not any(isinstance(f, _LibraryLog) for h in megatron.handlers for f in h.filters):
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
        handler.addFilter(_LibraryLog())
        megatron.addHandler(handler)
        megatron.propagate = False


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A recipe or override using keys from before the rl sections (megagspo.config_moves.MovedKeyWarning) is told
    in one line that a person acts on (which keys, their names now), not with Python's file:line and source."""
    if category.__name__ == "MovedKeyWarning":  # by name: this module imports only the standard library early
        print(f"megagspo: warning: {message}", file=file or sys.stderr)
        return
    _PYTHON_SHOW_WARNING(message, category, filename, lineno, file, line)


_PYTHON_SHOW_WARNING = warnings.showwarning


class _LibraryLog:
    """Megatron-Core's log records (WARNING and up), each message once, without those that describe this
    project's own choices rather than a problem."""

    EXPECTED = ("Unknown MLP type: ",)  # our grouped-GEMM experts module (moe/experts.py) gets default kwargs

    def __init__(self) -> None:
        self.seen: set = set()

    def filter(self, record) -> bool:
        message = record.getMessage()
        if message.startswith(self.EXPECTED) or message in self.seen:
            return False
        self.seen.add(message)
        return True


class _PatchLines:
    """The CPU shim and the Megatron compatibility steps log one line per patch (moe.cpu_shim,
    moe.megatron_compat); the CLI keeps them and says them in one line (MEGAGSPO_VERBOSE=1: every line)."""

    def __init__(self) -> None:
        self.lines: list = []

    def filter(self, record) -> bool:
        if os.environ.get("MEGAGSPO_VERBOSE", "") not in ("", "0"):
            return True
        self.lines.append(record.getMessage())
        return False

    def say_once(self) -> None:
        if self.lines and os.environ.get("RANK", "0") == "0":
            print(f"megagspo: {len(self.lines)} logged patches make megatron-core run here (CPU shim, compatibility "
                  "fixes; MEGAGSPO_VERBOSE=1 prints each, docs/platform.md explains them)", flush=True)
        self.lines = []


_PATCH_LINES = _PatchLines()


def _parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per job, each with its own help."""
    parser = argparse.ArgumentParser(prog="megagspo", description="GSPO RL for Qwen3-MoE on Megatron-Core",
                                     epilog="megagspo COMMAND --help describes a command's options")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    described = {
        "train": "Cold-start SFT (sft.steps), then RL (rl.steps) with rl.loss.name = gspo | gspo_token | grpo, into the run "
                 "folder log.out_dir/name. Where that folder holds a run: --resume continues it, --overwrite moves it "
                 "aside first; a finished run of the same config is not started over (its summary is printed).",
        "sft": "Cold-start SFT only (= train with rl.steps=0): held-out accuracy before and after, then the full "
               "weights in <run>/checkpoint.pt. Start RL runs from it with model.init_from=<run>/checkpoint.pt "
               "sft.steps=0 (what megagspo ablate does per seed).",
    }
    for name, help_text in (("train", "cold-start SFT, then RL: GSPO / GSPO-token / GRPO"),
                            ("sft", "cold-start SFT only: a checkpoint for model.init_from")):
        p = sub.add_parser(name, help=help_text, description=described[name])
        p.add_argument("--config", default="configs/tiny_cpu.yaml", help="YAML recipe")
        p.add_argument("overrides", nargs="*", help="section.key=value, e.g. rl.steps=20 seed=1")
        p.add_argument("--resume", action="store_true",
                       help="continue from the run's latest intact checkpoint; an error when there is none "
                            "(= checkpoint.resume=latest; checkpoint.resume=auto starts fresh instead)")
        p.add_argument("--overwrite", action="store_true",
                       help="start fresh where the run folder holds a run: the earlier run moves whole to "
                            "<run>.replaced-<time>/ first (= checkpoint.resume=never); without it a fresh start "
                            "there is refused")
        if name == "train":
            p.add_argument("--dry-run", action="store_true",
                           help="validate the recipe (config, layout, checkpoint shapes, memory plan) and exit")
            p.add_argument("--check-weights", action="store_true",
                           help="with --dry-run: also read every weight of an HF model.init_from folder and refuse "
                                "NaN / inf (the dry run reads headers only; a run checks the values at start-up)")
    p = sub.add_parser("plan", help="per-GPU memory plan; refuses a recipe that cannot fit")
    p.add_argument("--config", required=True, help="YAML recipe")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.world_size=16")
    p = sub.add_parser("export", help="write a run's weights as a Hugging Face folder")
    p.add_argument("--checkpoint", required=True, help="run folder or checkpoint.pt")
    p.add_argument("--out", default="", help="output folder (default <run>/hf)")
    p = sub.add_parser("ablate", help="A/B ablation: arms x seeds, shared cold start, report")
    p.add_argument("--config", required=True, help="ablation recipe, e.g. configs/ablations/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value applied to every run, e.g. rl.steps=20")
    p.add_argument("--out", default="", help="output folder (default: the recipe's out_dir, else runs/ablations/NAME)")
    p.add_argument("--seeds", default="", help="comma-separated subset of the recipe's seeds")
    p.add_argument("--arms", default="", help="comma-separated subset of the recipe's arms")
    p.add_argument("--settings", default="", help="comma-separated subset of the recipe's settings (its second "
                   "dimension: every arm runs under every setting)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time on this machine (one per core on CPU)")
    p.add_argument("--report-only", action="store_true", help="only combine finished runs into the report")
    p.add_argument("--print-commands", action="store_true",
                   help="print one command per run (cold starts first) to submit as separate cluster jobs")
    p.add_argument("--launcher", default="", help="with --print-commands: wrap each run, e.g. "
                   "'sbatch --nodes=1 launch/slurm.sbatch' (gets RECIPE key=value ...)")
    return parser


def main(argv=None) -> int:
    interrupts.arm()  # first: a stop from here until the run writes is one line and writes nothing
    environment.make_output_safe()  # a terminal encoding without the characters we print: escapes, not errors
    try:
        return _main(argv)
    except interrupts.StoppedDuringStartup as exc:
        _say_stopped(argv, exc)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - re-raised below unless a library's import failed
        line = environment.import_failure(exc)
        if line is None:
            raise
        _say_error(argv, line)  # a missing or broken dependency, an unusable locale: the environment's, one line
        return 2
    finally:
        interrupts.disarm()  # in-process callers (tests) get their own signal handlers back


def _say_error(argv, line: str) -> None:
    """`megagspo <command>: error: <line>`, exit 2: what the environment (not the recipe) got wrong."""
    words = sys.argv[1:] if argv is None else list(argv)
    command = next((w for w in words if not w.startswith("-")), "")
    command = command if command in ("train", "sft", "plan", "export", "ablate") else ""
    sys.stderr.write(f"megagspo{' ' + command if command else ''}: error: {line}\n")
    sys.stderr.flush()


def _say_stopped(argv, exc: interrupts.StoppedDuringStartup) -> None:
    """The one line of a stop during start-up (every rank under torchrun prints it: each was stopped)."""
    words = sys.argv[1:] if argv is None else list(argv)
    command = next((w for w in words if not w.startswith("-")), "")
    sys.stderr.write(f"megagspo{' ' + command if command else ''}: stopped by {exc.name} during start-up; "
                     "nothing was written\n")
    sys.stderr.flush()


def _main(argv) -> int:
    parser = _parser()
    # Overrides may stand on both sides of a flag (`train --resume rl.steps=9` and `train rl.steps=9 --resume`):
    # argparse stops its positional list at the flag, so the words it leaves over that look like overrides
    # are added to them; anything else is still an error.
    args, extra = parser.parse_known_args(argv)
    undecodable = environment.undecodable_argument(sys.argv[1:] if argv is None else list(argv))
    if undecodable:  # bytes that are not UTF-8 fail only where they are first written (config.yaml, JSON, a log)
        _say_error(argv, undecodable)
        return 2
    if extra:
        if not hasattr(args, "overrides") or not all("=" in word and not word.startswith("-") for word in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    if getattr(args, "check_weights", False) and not args.dry_run:
        parser.error("--check-weights goes with --dry-run (a run checks the weights as it reads them)")
    _quiet_third_party()
    # the one lazy import: torch and the project (seconds), after the signal guard and the library filters
    from megagspo import commands

    if args.command == "ablate":
        return commands.ablate(args)
    if args.command == "export":
        return commands.export(args)
    if args.command == "plan" or getattr(args, "dry_run", False):
        return commands.plan(args)
    if args.command == "sft":
        args.overrides = list(args.overrides) + ["rl.steps=0"]
        return commands.train(args, rl=False, started=_PATCH_LINES.say_once)
    return commands.train(args, rl=True, started=_PATCH_LINES.say_once)


if __name__ == "__main__":
    sys.exit(main())
