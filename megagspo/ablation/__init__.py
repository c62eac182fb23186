"""A/B ablations: arms of one base recipe, several seeds, a shared cold start, a combined report
(`megagspo ablate`; configs/ablations/)."""

from megagspo.ablation.report import write_report
from megagspo.ablation.results import load_results
from megagspo.ablation.runner import AblationRunner, plan_runs, shell_command
from megagspo.ablation.spec import AblationSpec, load_ablation

__all__ = ["AblationRunner", "AblationSpec", "load_ablation", "load_results", "plan_runs", "shell_command",
           "write_report"]
