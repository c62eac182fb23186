#!/usr/bin/env bash
# One command that verifies the whole GPU path on an offline GPU host, within a fixed time budget.
#
#   make gpu-check                                   # or: bash tools/gpu_check.sh [--budget S] [--only a,b] [--list]
#   GPU_CHECK_OUT=/some/dir bash tools/gpu_check.sh  # where summary.txt / summary.json / logs.tgz / _C*.so go
#   GPU_CHECK_STEP_PATHS=grouped+sdpa,grouped+sdpa+wgrad-add bash tools/gpu_check.sh   # A/B paths in the step stage
#
# Stages run in order of value, each under its own time limit (GNU timeout: the stage's whole process group dies
# with it) and only when at least its minimum time is left of the budget (default 470 s). A failure never aborts
# the run: a stage whose prerequisite is missing is SKIPped with the reason. The table (PASS / FAIL:rc / TIMEOUT /
# SKIP, seconds, one line of cause or the goal verdict) is printed LAST, whatever happened, and written to the
# output folder with the logs and the built extension (drop that `_C*.so` into .gpu-prebuilt/ to skip the ~60 s
# build next time).
#
# On a machine without CUDA the script runs in dry mode: the same table, every GPU stage SKIPped with its reason,
# exit 0 (CI runs it so the script cannot rot). On the GPU host it exits 1 when any stage FAILs or times out.
#
# Install on the GPU host (no venv, no network): the wheels that `make gpu-wheels` put into .gpu-wheels/ are
# installed with `pip install --no-index --no-deps --target $SITE`, and PYTHONPATH puts $SITE first, so the image's
# CUDA torch is kept and nothing is downloaded.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-$REPO/gpu-check-out}
BUDGET=${GPU_CHECK_BUDGET:-470}
ONLY=""
LIST=0
while (($#)); do
    case $1 in
        --budget) BUDGET=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --list) LIST=1; shift ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done
[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "gpu_check: --budget must be whole seconds, got $BUDGET" >&2; exit 2; }
STAGES="env install build tiny-bf16 contract producer t-model t-kernels step kernels varlen lp-logits lp-hidden packing gpu-tests peers"
if ((LIST)); then echo "$STAGES"; exit 0; fi
for s in ${ONLY//,/ }; do
    [[ " $STAGES " == *" $s "* ]] || { echo "gpu_check: --only: unknown stage $s; stages: $STAGES" >&2; exit 2; }
done

OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
LOGS=$OUT/logs
rm -rf "$LOGS" "$OUT/summary.tsv" "$OUT"/*.json
mkdir -p "$LOGS"
SITE=${GPU_CHECK_SITE:-/tmp/megagspo-gpu-site}
TSV=$OUT/summary.tsv
START=$(date +%s)
DRY=0
BUILD_PID=""
declare -A STATUS=()

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }

record() {  # name status seconds cause
    STATUS[$1]=$2
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4//$'\t'/ }" >> "$TSV"
}

# The first line that says why a stage failed: a pytest summary, an exception, else the log's last line.
cause_of() {
    local log=$1 line
    line=$(grep -E '^(FAILED|ERROR) |^E +[A-Za-z_.]*(Error|Exception)|[A-Za-z_.]*(Error|Exception): |Segmentation|core dumped|Killed' "$log" 2>/dev/null | head -1)
    [[ -z $line ]] && line=$(grep -E ' (passed|failed|skipped|error)' "$log" 2>/dev/null | tail -1)
    [[ -z $line ]] && line=$(grep -v '^\s*$' "$log" 2>/dev/null | tail -1)
    echo "${line:0:160}"
}

selected() { [[ -z $ONLY || ",$ONLY," == *",$1,"* ]]; }

# needs: a space-separated list of what must have passed (cuda, deps, ext, peers) -> "" or the reason it is missing
missing() {
    local need
    for need in $1; do
        case $need in
            cuda) ((DRY)) && { echo "dry mode: no CUDA device here"; return; } ;;
            deps) [[ ${STATUS[install]:-} == PASS ]] || { echo "install did not pass (${STATUS[install]:-not run})"; return; } ;;
            ext) [[ ${STATUS[build]:-} == PASS ]] || { echo "CUDA extension not built (${STATUS[build]:-not run})"; return; } ;;
            peers) [[ -n ${HAVE_PEERS:-} ]] || { echo "no liger-kernel / cut-cross-entropy wheels in .gpu-wheels/ (make gpu-wheels PEERS=1)"; return; } ;;
        esac
    done
}

# run_stage NAME LIMIT_S MIN_S "NEEDS" "COMMAND" [GOAL_KIND]: the command runs in bash from the repo root.
run_stage() {
    local name=$1 limit=$2 min=$3 needs=$4 cmd=$5 goal=${6:-} reason lim t0 rc dt cause status
    selected "$name" || return 0
    [[ " $needs " == *" ext "* ]] && wait_build  # here, not inside $(missing ...): a subshell cannot wait for it
    reason=$(missing "$needs")
    if [[ -n $reason ]]; then record "$name" SKIP 0 "$reason"; return 0; fi
    if (( $(left) < min )); then record "$name" SKIP 0 "budget: $(left) s left < this stage's minimum $min s"; return 0; fi
    lim=$(( limit < $(left) ? limit : $(left) ))
    echo "== $name (limit $lim s; $(elapsed) s elapsed) ==" >&2
    t0=$(date +%s)
    timeout -k 5 "$lim" bash -c "$cmd" > "$LOGS/$name.log" 2>&1
    rc=$?
    dt=$(( $(date +%s) - t0 ))
    case $rc in
        0) status=PASS; cause=$(grep -E ' passed| skipped' "$LOGS/$name.log" | tail -1)
           [[ -z $cause ]] && cause=$(grep -v '^\s*$' "$LOGS/$name.log" | tail -1 | cut -c1-160) ;;
        124|137) status=TIMEOUT; cause="over its $lim s limit; last: $(grep -v '^\s*$' "$LOGS/$name.log" | tail -1 | cut -c1-120)" ;;
        *) status="FAIL:$rc"; cause=$(cause_of "$LOGS/$name.log") ;;
    esac
    if [[ -n $goal ]]; then
        local verdict
        verdict=$("$PY" "$REPO/tools/gpu_goals.py" "$goal" "$OUT" 2>>"$LOGS/$name.log")
        [[ -n $verdict ]] && cause="$verdict"
    fi
    record "$name" "$status" "$dt" "$cause"
}

wait_build() {
    [[ -z $BUILD_PID ]] && return 0
    local rc dt
    wait "$BUILD_PID"; rc=$?
    BUILD_PID=""
    dt=$(cat "$OUT/.build_seconds" 2>/dev/null || echo "?")
    case $rc in
        0) record build PASS "$dt" "$(tail -1 "$LOGS/build.log")" ;;
        124|137) record build TIMEOUT "$dt" "extension build over its limit" ;;
        *) record build "FAIL:$rc" "$dt" "$(cause_of "$LOGS/build.log")" ;;
    esac
}

finish() {
    local rc=$?
    [[ -n $BUILD_PID ]] && { kill "$BUILD_PID" 2>/dev/null; pkill -f "setup.py -q build_ext" 2>/dev/null; }
    ((DRY)) || cp megagspo/_C*.so "$OUT"/ 2>/dev/null
    tar -czf "$OUT/logs.tgz" -C "$OUT" logs "$(basename "$TSV")" $(cd "$OUT" && ls ./*.json 2>/dev/null) 2>/dev/null
    "$PY" "$REPO/tools/gpu_goals.py" summary "$OUT" --budget "$BUDGET" --seconds "$(elapsed)" --dry "$DRY" \
        > "$OUT/summary.txt" 2>>"$LOGS/summary.err" || {
        # the summary must print even when Python cannot: a plain table from the TSV
        { echo "gpu-check ($(elapsed) s of $BUDGET)"; column -t -s $'\t' "$TSV" 2>/dev/null || cat "$TSV"; } > "$OUT/summary.txt"
    }
    echo
    cat "$OUT/summary.txt"
    if ((DRY)); then exit 0; fi
    grep -qE $'\t(FAIL|TIMEOUT)' "$TSV" && exit 1
    exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT TERM

# ---- 0 env: which GPU, which versions -------------------------------------------------------------------
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" > "$LOGS/env.log" 2>&1; then
    if nvidia-smi -L > /dev/null 2>&1; then
        # a GPU is here but this Python's torch cannot use it: a failure, not a dry run
        record env FAIL:1 0 "nvidia-smi sees a GPU but $PY's torch does not: $(cause_of "$LOGS/env.log")"
        for s in $STAGES; do [[ $s == env ]] || record "$s" SKIP 0 "env failed"; done
        exit 1
    fi
    DRY=1
    record env SKIP 0 "dry mode: $("$PY" -c 'import torch; print("torch", torch.__version__, "sees no CUDA device")' 2>&1 | tail -1)"
else
    # the host's torch signatures of the CUDA-only APIs, recorded first (the contract stage holds them to the record)
    run_stage env 30 5 "" "$PY tools/torch_signatures.py --installed --out '$OUT/torch_signatures.json' \\
    --compare tests/assets/gpu_host_torch_signatures.json || echo 'torch_signatures: differs from the record (above)'
$PY - <<'PY'
import platform, subprocess, torch
p = torch.cuda.get_device_properties(0)
line = (f'GPU {p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__} '
        f'(CUDA {torch.version.cuda}); python {platform.python_version()}')
for tool in (['nvcc', '--version'], ['g++', '--version'], ['nvidia-smi', '--query-gpu=driver_version,clocks.max.sm', '--format=csv,noheader']):
    try:
        print(' '.join(tool[:1]), subprocess.run(tool, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    except Exception as exc:  # a missing tool is reported, not fatal here
        print(tool[0], 'not available:', exc)
assert (p.major, p.minor) >= (9, 0), f'sm_{p.major}{p.minor}: the CUDA kernels are built for sm_90 (Hopper)'
print(line)
PY"
fi

# ---- 1 install: the wheels brought along, into a --target folder; the image's CUDA torch is kept ------
HAVE_PEERS=""
if ls .gpu-wheels/liger_kernel-*.whl .gpu-wheels/cut_cross_entropy-*.whl > /dev/null 2>&1; then HAVE_PEERS=1; fi
run_stage install 90 10 "cuda" "
set -e
if ls .gpu-wheels/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '$SITE' .gpu-wheels/*.whl
    echo installed: \$(ls .gpu-wheels | tr '\n' ' ')
else
    echo 'no .gpu-wheels/ (make gpu-wheels): using what this Python already has'
fi
PYTHONPATH='$SITE':$REPO $PY -c \"
import torch, megatron.core as m, transformers as t, math_verify
assert torch.cuda.is_available()
print('megatron-core', m.__version__, '| transformers', t.__version__, '| torch', torch.__version__)
\""
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export MEGAGSPO_REQUIRE_CUDA_KERNELS=1 PYTHONFAULTHANDLER=1

# ---- 2 build (background): a prebuilt _C*.so if it has the CUDA kernels, else MEGAGSPO_CUDA=1 build ------
EXT_OK="import sys, torch, megagspo._C as C, megagspo.kernels as K; sys.path.insert(0, 'tools'); import extension_runtime as R
assert C.built_with_cuda() and K.fused_available('cuda'), 'megagspo._C has no CUDA kernels'
problem = R.private_runtime_problem(C.__file__); assert problem is None, problem
print('megagspo._C with CUDA kernels:', C.__file__)"
if selected build || selected t-kernels || selected lp-logits || selected lp-hidden || selected peers; then
    if ((DRY)); then
        record build SKIP 0 "dry mode: no CUDA device here"
    else
        (
            t0=$(date +%s)
            set -o pipefail
            {
                if ls .gpu-prebuilt/_C*.so > /dev/null 2>&1 && cp .gpu-prebuilt/_C*.so megagspo/ && "$PY" -c "$EXT_OK"; then
                    echo "prebuilt extension from .gpu-prebuilt/ imports with CUDA kernels"
                    rc=0
                else
                    rm -f megagspo/_C*.so
                    # the system compiler: the CUDA image's $CXX (/opt/gcc/bin/g++) links libstdc++ statically,
                    # which makes every failed input check of the extension a segfault (tools/extension_runtime.py)
                    if [[ -x /usr/bin/g++ ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++; fi
                    echo "compiler: ${CXX:-c++} ($("${CXX:-c++}" --version | head -1))"
                    MEGAGSPO_CUDA=1 MEGAGSPO_CUDA_ARCH=${CUDA_ARCH:-90} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
                        timeout -k 5 240 "$PY" setup.py -q build_ext --inplace && "$PY" -c "$EXT_OK"
                    rc=$?
                fi
            } > "$LOGS/build.log" 2>&1
            echo $(( $(date +%s) - t0 )) > "$OUT/.build_seconds"
            exit $rc
        ) &
        BUILD_PID=$!
    fi
fi

PYTEST="$PY -m pytest -q -p no:cacheprovider -o addopts= -ra"
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 6"

# ---- 3.. the stages, most valuable first ------------------------------------------------------------------
# the trainer end to end first (bf16, packed): one stage says whether a CUDA run trains at all
run_stage tiny-bf16 180 60 "cuda deps ext" "MEGAGSPO_GPU_REPORT='$OUT' $PYTEST 'tests/test_gpu_trainer.py::test_tiny_recipe_trains_on_cuda[bf16]'" tiny
# this host's torch against the record the CPU's contract test binds to (tests/assets/gpu_host_torch_signatures.json;
# a difference under the same torch version fails here), then the contract, branch and fake-CUDA tests on this torch
run_stage contract 90 20 "cuda deps" "set -e
$PY tools/torch_signatures.py --installed --out '$OUT/torch_signatures.json' --compare tests/assets/gpu_host_torch_signatures.json
$PYTEST tests/test_cuda_contract.py tests/test_cuda_branches.py tests/test_fake_cuda_trace.py"
# the rollout producer process beside the trainer on one GPU (staleness 2, partial rollouts, R3): both peaks recorded
run_stage producer 150 60 "cuda deps ext" "MEGAGSPO_GPU_REPORT='$OUT' $PYTEST tests/test_gpu_trainer.py::test_producer_with_partial_rollouts_and_r3_on_cuda" producer
run_stage t-model 230 40 "cuda deps" "$PYTEST -m gpu tests/test_moe_grouped_experts.py tests/test_moe_token_dispatch.py tests/test_moe_sdpa_attention.py tests/test_moe_packed_attention.py tests/test_moe_optimizer_fused.py tests/test_moe_host_sync.py tests/test_moe_triton_kernels.py"
run_stage t-kernels 120 30 "cuda ext" "$PYTEST $XDIST tests/test_extension_build.py tests/test_kernel_extension.py tests/test_kernel_logprob.py tests/test_kernel_gspo.py tests/test_kernel_linear.py tests/test_kernel_policy_losses.py"
# GPU_CHECK_STEP_PATHS: more bench_train_step paths to time beside the default one (A/B of an implementation choice)
STEP_PATHS=${GPU_CHECK_STEP_PATHS:-grouped+sdpa,grouped+sdpa+triton}  # the default, and both Triton kernels on
STEP_LIMIT=$(( 110 + 45 * $(tr ',' '\n' <<< "$STEP_PATHS" | wc -l) ))
run_stage step "$STEP_LIMIT" 60 "cuda deps" "$PY benchmarks/bench_train_step.py --micro-batches 4 --paths '$STEP_PATHS' --json '$OUT/step.json' --profile '$OUT/profile'" step
# the two Triton expert kernels alone against the ops they replace (wgrad tile choices; SwiGLU x probs)
run_stage kernels 90 30 "cuda deps" "$PY benchmarks/bench_expert_kernels.py --json '$OUT/kernels.json'"
run_stage varlen 45 15 "cuda deps" "$PY benchmarks/bench_varlen_gqa.py --json '$OUT/varlen.json'"
run_stage lp-logits 100 40 "cuda ext" "$PY benchmarks/bench_logprob.py --tokens 32768 --vocab 151936 --dtype bfloat16 --device cuda --repeats 5 --paths fused,fused-inplace --json '$OUT/logits.json'" logits
run_stage lp-hidden 100 40 "cuda ext" "$PY benchmarks/bench_logprob.py --hidden 2048 --tokens 16384 --vocab 151936 --dtype bfloat16 --device cuda --repeats 5 --paths hidden --json '$OUT/hidden.json'" hidden
# everything else marked gpu in one pytest over several workers (the GPU has room for them): the policy and
# precision tests, the other end-to-end cases (fp32, fused GSPO loss, GRPO-R2, resume) and the CUDA variants
run_stage packing 150 60 "cuda deps ext" "$PY benchmarks/bench_packing.py --rows 128 --resp-max 1024 --hidden 512 --extra model.precision=bf16 --json '$OUT/packing.json'"
run_stage gpu-tests 300 60 "cuda deps ext" "$PYTEST $XDIST -m gpu tests --durations=12 --deselect 'tests/test_gpu_trainer.py::test_tiny_recipe_trains_on_cuda[bf16]' --deselect tests/test_gpu_trainer.py::test_producer_with_partial_rollouts_and_r3_on_cuda --ignore=tests/test_moe_grouped_experts.py --ignore=tests/test_moe_token_dispatch.py --ignore=tests/test_moe_sdpa_attention.py --ignore=tests/test_moe_packed_attention.py --ignore=tests/test_moe_optimizer_fused.py --ignore=tests/test_moe_host_sync.py --ignore=tests/test_moe_triton_kernels.py --ignore=tests/test_kernel_logprob.py --ignore=tests/test_kernel_gspo.py --ignore=tests/test_kernel_linear.py --ignore=tests/test_kernel_policy_losses.py --ignore=tests/test_extension_build.py --ignore=tests/test_kernel_extension.py"
run_stage peers 90 45 "cuda ext peers" "$PY benchmarks/bench_logprob.py --hidden 2048 --tokens 16384 --vocab 151936 --dtype bfloat16 --device cuda --repeats 3 --paths liger,cce --json '$OUT/peers.json'" peers
wait_build
