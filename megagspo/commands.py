"""What each `megagspo` command does once its arguments are parsed (megagspo.cli parses them, arms the start-up
signal guard and quiets the libraries first, then imports this module: it loads torch).

    train(args, rl)   cold-start SFT then RL (rl=True), or SFT only: the Trainer, and every refusal as one line
    plan(args)        `megagspo plan` and `megagspo train --dry-run`
    export(args)      a run's weights as a Hugging Face folder
    ablate(args)      arms x seeds, then the report
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Callable

from megagspo import interrupts
from megagspo.ablation import AblationRunner, load_ablation, plan_runs, shell_command, write_report
from megagspo.ablation.runner import AblationStopped
from megagspo.checkpoint import CheckpointError, Preempted
from megagspo.checkpoint.full_state import load_checkpoint
from megagspo.checkpoint.run_folder import RunAlreadyFinished, summary_lines
from megagspo.checkpoint.run_lock import RunFolderBusy, RunFolderLock
from megagspo.config import ConfigError, deferred_path_checks, load_config
from megagspo.dry_run import dry_run
from megagspo.errors import bounded_message, os_error_message
from megagspo.hf_export import export_hf
from megagspo.planner import PlanError
from megagspo.rl.producer_process import ProducerFailed
from moe.architecture import ArchitectureError
from moe.parallel import LayoutError


def train(args, rl: bool, started: Callable[[], None] = lambda: None) -> int:
    """started(): called once the Trainer is built (the CLI says its one line about the platform patches)."""
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        print(f"megagspo {args.command}: error: --resume continues the run in the folder and --overwrite moves it "
              "aside: pass one of them", file=sys.stderr)
        return 2
    overrides = list(args.overrides) + (["checkpoint.resume=latest"] if getattr(args, "resume", False) else []) \
        + (["checkpoint.resume=never"] if getattr(args, "overwrite", False) else [])
    try:
        cfg = load_config(args.config, overrides)
        # the one lazy import: it loads Megatron-Core and transformers (+2 s of start-up that plan / export /
        # ablate do not need)
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
    started()
    try:
        trainer.train(rl=rl)  # from its first write on, StopRequest answers a signal (finish, checkpoint)
    except Preempted as exc:
        print(f"megagspo {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except CheckpointError as exc:
        print(f"megagspo {args.command}: error: {bounded_message(exc)}", file=sys.stderr)
        return 1
    except ProducerFailed as exc:  # restarted MAX_RESTARTS times already: the cause is the producer's, not a kill
        print(f"megagspo {args.command}: error: {bounded_message(exc)}; the checkpoints written so far are intact "
              "(--resume continues from the newest)", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"megagspo {args.command}: error: {os_error_message(exc)}; the checkpoints written so far are "
              "intact (--resume continues from the newest)", file=sys.stderr)
        return 1
    finally:
        interrupts.disarm()  # the run has written: the start-up guard's "nothing was written" is no longer true
    return 0


def plan(args) -> int:
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


def export(args) -> int:
    src = args.checkpoint if os.path.isdir(args.checkpoint) else os.path.dirname(args.checkpoint)
    out = args.out or os.path.join(src, "hf")
    # The default output lies inside the run folder: it is written only while no trainer owns that folder.
    lock = RunFolderLock(src, "megagspo export") if not args.out and _is_run_folder(src) else None
    interrupts.disarm()  # from here the export writes: a stop is Python's own again, not "nothing was written"
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


def _ablate_command(args) -> str:
    """The command as given (the subsets and --jobs included): what a rerun runs to resume an interrupted ablation."""
    words = ["megagspo", "ablate", "--config", args.config]
    for flag, value in (("--out", args.out), ("--seeds", args.seeds), ("--arms", args.arms),
                        ("--settings", args.settings)):
        if value:
            words += [flag, value]
    if args.jobs != 1:
        words += ["--jobs", str(args.jobs)]
    return " ".join(shlex.quote(w) for w in words + list(args.overrides))


def ablate(args) -> int:
    """`megagspo ablate`: run the arms x seeds of an ablation recipe (or print their commands), then report.
    The start-up guard (megagspo.interrupts) stays armed while the recipe is read and the runs are planned:
    nothing is written yet, so a stop there is its one line. While the runs run, the runner takes SIGINT /
    SIGTERM itself: it passes the stop on to the running runs, waits for their checkpoints and raises
    AblationStopped (one line, exit 128 + signal, naming what to rerun). The guard is disarmed before the report
    is written."""

    def _ints(text):
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--seeds must be comma-separated integers, got {text!r}") from None

    try:
        spec = load_ablation(args.config, out_dir=args.out or None,
                             seeds=_ints(args.seeds) if args.seeds else None,
                             arms=[a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None,
                             settings=([x.strip() for x in args.settings.split(",") if x.strip()]
                                       if args.settings else None))
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
    except AblationStopped as exc:
        print(f"megagspo ablate: {exc.line(_ablate_command(args))}", file=sys.stderr)
        return exc.exit_code
    interrupts.disarm()  # the report is written from here: a stop is Python's own again
    reproduce = "megagspo ablate --config " + args.config + (f" --out {args.out}" if args.out else "") + \
        "".join(f" {o}" for o in args.overrides)
    try:
        path = write_report(spec, command=reproduce, failed=[r.run_dir for r in failed])
    except (FileNotFoundError, ValueError) as exc:  # ValueError: a cell's summary / config file is not trusted
        print(f"megagspo ablate: error: {bounded_message(exc)}", file=sys.stderr)
        return 1
    print(f"megagspo ablate: report written to {path}")
    if failed:
        print(f"megagspo ablate: {len(failed)} run(s) failed: " + ", ".join(r.label for r in failed), file=sys.stderr)
        return 1
    return 0
