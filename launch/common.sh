# Sourced by the launchers (not run on its own): checks the recipe argument and sets `config`, `python`
# (PYTHON or the project's .venv) and NPROC_PER_NODE (default: this node's GPU count, else 1).
# The caller `shift`s the recipe off its arguments afterwards.
config=${1:-}
[ -f "$config" ] || { echo "$0: no such recipe: ${config:-<none given>}" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  NPROC_PER_NODE=$(( gpus > 0 ? gpus : 1 ))
fi
