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
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from megagspo.ablation import AblationRunner, load_ablation, plan_runs, shell_command, write_report
from megagspo.checkpoint import CheckpointError, Preempted
from megagspo.checkpoint.full_state import load_checkpoint
from megagspo.checkpoint.run_folder import RunAlreadyFinished, summary_lines
from megagspo.checkpoint.run_lock import RunFolderBusy, RunFolderLock
from megagspo.config import ConfigError, deferred_path_checks, load_config
from megagspo.dry_run import dry_run
from megagspo.errors import bounded_message, os_error_message
from megagspo.hf_export import export_hf
from megagspo.planner import PlanError
from moe.architecture import ArchitectureError
from moe.parallel import LayoutError


def _quiet_third_party() -> None:
    """What the libraries say that a user cannot act on is dropped; any other warning keeps Python's default
    (shown once per place it is raised from)."""
    import logging

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


def _train(args, rl: bool) -> int:
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        print(f"megagspo {args.command}: error: --resume continues the run in the folder and --overwrite moves it "
              "aside: pass one of them", file=sys.stderr)
        return 2
    overrides = list(args.overrides) + (["checkpoint.resume=latest"] if getattr(args, "resume", False) else []) \
        + (["checkpoint.resume=never"] if getattr(args, "overwrite", False) else [])
    try:
        cfg = load_config(args.config, overrides)
        # the one lazy import: it loads Megatron-Core (+2.5 s of start-up that plan / export / ablate / --help
        # do not need), and only after _quiet_third_party() has filtered what Megatron says on import
        from megagspo.trainer.trainer import Trainer

        trainer = Trainer(cfg)
    except RunAlreadyFinished as exc:  # `make train` twice: the answer, not a second run
        if os.environ.get("RANK", "0") == "0":
            print(f"megagspo {args.command}: {exc}; its summary.json:")
            print("\n".join(summary_lines(exc.summary)), flush=True)
        return 0
    except (ConfigError, ValueError, FileNotFoundError, CheckpointError, RunFolderBusy) as exc:
        print(f"megagspo {args.command}: error: {bounded_message(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the filesystem refused a read or a write: say which path and why, in one line
        print(f"megagspo {args.command}: error: {os_error_message(exc)}", file=sys.stderr)
        return 2
    _PATCH_LINES.say_once()
    try:
        trainer.train(rl=rl)
    except Preempted as exc:
        print(f"megagspo {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except CheckpointError as exc:
        print(f"megagspo {args.command}: error: {bounded_message(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"megagspo {args.command}: error: {os_error_message(exc)}; the checkpoints written so far are "
              "intact (--resume continues from the newest)", file=sys.stderr)
        return 1
    return 0


def _plan(args) -> int:
    """`megagspo plan` and `megagspo train --dry-run`: validate a recipe and print its per-GPU memory."""
    try:
        with deferred_path_checks() as missing:
            cfg = load_config(args.config, args.overrides)
        report = dry_run(cfg, missing_paths=missing, check_weights=getattr(args, "check_weights", False))
    except (ValueError, FileNotFoundError, PlanError, LayoutError, ArchitectureError, CheckpointError) as exc:
        print(f"megagspo {args.command}: error: {bounded_message(exc)}", file=sys.stderr)
        return 2
    print(report.text(cfg))
    print(f"megagspo {args.command}: {args.config} is valid for {report.world_size} ranks")
    return 0


def _export(args) -> int:
    src = args.checkpoint if os.path.isdir(args.checkpoint) else os.path.dirname(args.checkpoint)
    out = args.out or os.path.join(src, "hf")
    # The default output lies inside the run folder: it is written only while no trainer owns that folder.
    lock = RunFolderLock(src, "megagspo export") if not args.out and _is_run_folder(src) else None
    try:
        if lock is not None:
            lock.acquire()
        notes = export_hf(load_checkpoint(args.checkpoint), out)
    except (RunFolderBusy, CheckpointError, ValueError) as exc:
        print(f"megagspo export: error: {bounded_message(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"megagspo export: error: {os_error_message(exc)}", file=sys.stderr)
        return 2
    finally:
        if lock is not None:
            lock.release()
    for note in notes:
        print(f"  {note}")
    print(f"exported Hugging Face Qwen3MoeForCausalLM to {out}")
    return 0


def _is_run_folder(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(os.path.join(path, "metrics.jsonl"))


def _ablate(args) -> int:
    """`megagspo ablate`: run the arms x seeds of an ablation recipe (or print their commands), then report."""

    def _ints(text):
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--seeds must be comma-separated integers, got {text!r}") from None

    try:
        spec = load_ablation(args.config, out_dir=args.out or None,
                             seeds=_ints(args.seeds) if args.seeds else None,
                             arms=[a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None)
        if args.print_commands:
            spec.validate_runs(args.overrides)
            runs = plan_runs(spec, args.overrides)
            if any(r.kind == "cold_start" for r in runs):
                print("# stage 1: one cold-start SFT per seed")
            for i, run in enumerate(runs):
                if run.kind == "cell" and (i == 0 or runs[i - 1].kind == "cold_start"):
                    print("# stage 2: the cells; each needs only the cold start of its own seed")
                print(shell_command(spec, run, args.launcher))
            print(f"# then: megagspo ablate --config {args.config} --report-only"
                  + (f" --out {args.out}" if args.out else ""))
            return 0
        failed = []
        if not args.report_only:
            failed = AblationRunner(spec, args.overrides, jobs=args.jobs).run()
    except ConfigError as exc:
        print(f"megagspo ablate: error: {bounded_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("megagspo ablate: interrupted; running cells were asked to checkpoint; rerun the same command to "
              "resume", file=sys.stderr)
        return 130
    reproduce = "megagspo ablate --config " + args.config + (f" --out {args.out}" if args.out else "") + \
        "".join(f" {o}" for o in args.overrides)
    try:
        path = write_report(spec, command=reproduce)
    except (FileNotFoundError, ValueError) as exc:  # ValueError: a cell's summary / config file is not trusted
        print(f"megagspo ablate: error: {bounded_message(exc)}", file=sys.stderr)
        return 1
    print(f"megagspo ablate: report written to {path}")
    if failed:
        print(f"megagspo ablate: {len(failed)} run(s) failed: " + ", ".join(r.label for r in failed), file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per job, each with its own help."""
    parser = argparse.ArgumentParser(prog="megagspo", description="GSPO RL for Qwen3-MoE on Megatron-Core",
                                     epilog="megagspo COMMAND --help describes a command's options")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    described = {
        "train": "Cold-start SFT (sft.steps), then RL (rl.steps) with rl.loss = gspo | gspo_token | grpo, into the run "
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
    p.add_argument("--jobs", type=int, default=1, help="runs at a time on this machine (one per core on CPU)")
    p.add_argument("--report-only", action="store_true", help="only combine finished runs into the report")
    p.add_argument("--print-commands", action="store_true",
                   help="print one command per run (cold starts first) to submit as separate cluster jobs")
    p.add_argument("--launcher", default="", help="with --print-commands: wrap each run, e.g. "
                   "'sbatch --nodes=1 launch/slurm.sbatch' (gets RECIPE key=value ...)")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    # Overrides may stand on both sides of a flag (`train --resume rl.steps=9` and `train rl.steps=9 --resume`):
    # argparse stops its positional list at the flag, so the words it leaves over that look like overrides
    # are added to them; anything else is still an error.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or not all("=" in word and not word.startswith("-") for word in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    _quiet_third_party()
    if args.command == "ablate":
        return _ablate(args)
    if args.command == "export":
        return _export(args)
    if getattr(args, "check_weights", False) and not args.dry_run:
        parser.error("--check-weights goes with --dry-run (a run checks the weights as it reads them)")
    if args.command == "plan" or getattr(args, "dry_run", False):
        return _plan(args)
    if args.command == "sft":
        args.overrides = list(args.overrides) + ["rl.steps=0"]
        return _train(args, rl=False)
    return _train(args, rl=True)


if __name__ == "__main__":
    sys.exit(main())
