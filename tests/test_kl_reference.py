"""KL penalty to a frozen reference policy (rl.kl_coef > 0).

(a) the k3 term each loss adds, against a plain-Python float64 reference (value and gradient), fresh seed;
(b) kl_coef = 0 leaves loss and gradients bit-identical to a loss config without KL;
(c) at the first RL step (one mini-batch) the policy IS the reference: kl/ref == 0 exactly and every training
    metric (loss, grad norm, ratios) equals the kl_coef = 0 run's bit for bit, so the KL gradient is 0;
(d) a short `megagspo train rl.kl_coef=0.1` logs kl/ref > 0 once the policy has moved; the reference on disk
    equals the cold-start weights; a SIGKILLed run resumes to the uninterrupted metrics; a corrupt reference
    is refused on resume;
(e) the memory planner adds the reference's weights (sharded like the policy's) and `megagspo plan` names them.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_algo_common import F64, gen, random_packed  # noqa: F401 - gen is a fixture (prints its seed)

from test_checkpoint_resume import ARGS as RESUME_ARGS, VOLATILE, _env, _served

from helpers import CliRuns
from megagspo.algorithm import PackedBatch, get_loss

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOSSES = [("gspo", {"clip_low": 3e-4, "clip_high": 4e-4}),
          ("gspo_token", {"clip_low": 3e-4, "clip_high": 4e-4}),
          ("grpo", {"clip_low": 0.2, "clip_high": 0.27, "aggregation": "seq_mean_token_mean"}),
          ("grpo", {"clip_low": 0.2, "clip_high": 0.27, "aggregation": "token_mean"})]
IDS = ["gspo", "gspo_token", "grpo-seq_mean_token_mean", "grpo-token_mean"]


def _batch(p, logp, ref=None):
    n_tok = int(p["mask"].sum())
    return PackedBatch(logp_T=logp, loss_mask_T=p["mask"], cu_seqlens_S1=p["cu"], num_global_sequences=37,
                       old_logp_T=p["old"], advantages_S=p["adv"], num_global_tokens=n_tok + 5, ref_logp_T=ref)


def _loss_and_grad(name, fields, p, ref=None, kl=None):
    fn = get_loss(name)
    cfg = fn.Config(**fields, **({"kl": kl} if kl is not None else {}))
    logp = p["logp"].clone().requires_grad_(True)
    loss, metrics = fn(_batch(p, logp, ref), cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def _k3_reference(logp, ref, mask, cu, aggregation, num_seqs_global, num_tok_global):
    """Plain-Python loop, float64: Schulman's k3 = exp(ref - logp) - (ref - logp) - 1 per response token,
    then the loss's own normalisation: per-sequence mean over |y_i| summed over sequences / N (GSPO,
    GSPO-token, GRPO seq-mean-token-mean), or the token sum / N_tok (GRPO token-mean)."""
    total = logp.new_zeros(())
    tokens, k3_sum = 0, logp.new_zeros(())
    for i in range(len(cu) - 1):
        terms = []
        for t in range(int(cu[i]), int(cu[i + 1])):
            if mask[t]:
                d = ref[t] - logp[t]
                terms.append(torch.exp(d) - d - 1.0)
        if terms:
            seq = torch.stack(terms)
            total = total + (seq.sum() / len(terms) if aggregation != "token_mean" else seq.sum())
            k3_sum = k3_sum + seq.sum().detach()
            tokens += len(terms)
    norm = num_tok_global if aggregation == "token_mean" else num_seqs_global
    return total / norm, k3_sum / max(tokens, 1)


@pytest.mark.parametrize("name,fields", LOSSES, ids=IDS)
def test_k3_term_matches_pure_torch_reference(gen, name, fields):  # noqa: F811 - gen is the fixture
    p = random_packed(gen)
    ref = p["logp"] + 0.3 * torch.randn(p["logp"].shape, generator=gen, dtype=F64)
    coef = 0.05 + float(torch.rand((), generator=gen, dtype=F64))
    loss0, grad0, _ = _loss_and_grad(name, fields, p)
    loss1, grad1, metrics = _loss_and_grad(name, fields, p, ref=ref, kl={"coef": coef, "estimator": "k3"})

    logp = p["logp"].clone().requires_grad_(True)
    n_tok = int(p["mask"].sum()) + 5
    penalty, mean_k3 = _k3_reference(logp, ref, p["mask"], p["cu"], fields.get("aggregation"), 37, n_tok)
    (grad_ref,) = torch.autograd.grad(coef * penalty, logp)

    assert float(penalty.detach()) > 0
    torch.testing.assert_close(loss1 - loss0, coef * penalty.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad1 - grad0, grad_ref, rtol=1e-10, atol=1e-15)
    torch.testing.assert_close(metrics["kl/ref"], mean_k3, rtol=1e-12, atol=0)
    torch.testing.assert_close(metrics["loss/kl"], coef * penalty.detach(), rtol=1e-12, atol=1e-15)
    # Only masked response tokens carry the KL gradient.
    assert torch.all(grad1[~p["mask"]] == grad0[~p["mask"]])


@pytest.mark.parametrize("name,fields", LOSSES, ids=IDS)
def test_kl_coef_zero_is_bit_identical(gen, name, fields):  # noqa: F811
    p = random_packed(gen)
    ref = p["logp"] + 0.3 * torch.randn(p["logp"].shape, generator=gen, dtype=F64)
    loss0, grad0, m0 = _loss_and_grad(name, fields, p)
    for kl in ({"coef": 0.0}, {"coef": 0.0, "estimator": "k1"}):
        loss1, grad1, m1 = _loss_and_grad(name, fields, p, ref=ref, kl=kl)
        assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
        assert set(m1) == set(m0) and "kl/ref" not in m1


def test_policy_equal_to_reference_gives_zero_kl_and_zero_gradient(gen):  # noqa: F811
    p = random_packed(gen)
    for name, fields in LOSSES:
        loss0, grad0, _ = _loss_and_grad(name, fields, p)
        loss1, grad1, m = _loss_and_grad(name, fields, p, ref=p["logp"].clone(), kl={"coef": 0.1})
        assert float(m["kl/ref"]) == 0.0 and float(m["loss/kl"]) == 0.0
        assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)


# ------------------------------------------------------------------------------------------------ trainer
# the resume tests' tiny run, with one mini-batch per step (step 0's update is then at the reference weights)
ARGS = [*RESUME_ARGS, "rl.steps=4", "rl.mini_batches=1"]
TRAINING = ("loss", "grad_norm", "ratio/mean", "kl/approx_old", "entropy/mean", "clip/seq_frac", "clip/tok_frac",
            "reward/mean")


def _cmd(out_dir, name, *extra):
    return [sys.executable, "-m", "megagspo.cli", "train", *ARGS, f"log.out_dir={out_dir}", f"name={name}", *extra]


def _rl_rows(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows if r.get("phase") == "rl"]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's `megagspo` runs that are only read afterwards: a run costs its work, not a
    fresh start-up. The run the resume test kills has a process of its own."""
    cli_runs = CliRuns(_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield cli_runs
    cli_runs.close()


@pytest.fixture(scope="module")
def runs(cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("kl")
    _served(cli, _cmd(out, "kl", "rl.kl_coef=0.1"))
    _served(cli, _cmd(out, "nokl"))
    return out


@pytest.mark.slow
def test_first_step_has_zero_kl_and_zero_kl_gradient(runs):
    kl, nokl = _rl_rows(runs / "kl"), _rl_rows(runs / "nokl")
    assert kl[0]["kl/ref"] == 0.0 and kl[0]["loss/kl"] == 0.0
    # One mini-batch: step 0's only update is computed at the reference weights, where k3 and its gradient
    # are exactly 0, so loss, gradient norm and every other training metric equal the kl_coef = 0 run's.
    assert {k: kl[0][k] for k in TRAINING} == {k: nokl[0][k] for k in TRAINING}
    assert "kl/ref" not in nokl[0] and not os.path.exists(runs / "nokl" / "reference.safetensors")


@pytest.mark.slow
def test_kl_is_logged_and_positive_after_updates(runs):
    rows = _rl_rows(runs / "kl")
    assert len(rows) == 4
    for r in rows[1:]:
        assert math.isfinite(r["kl/ref"]) and r["kl/ref"] > 0 and r["loss/kl"] > 0
    assert any(rows[i]["grad_norm"] != _rl_rows(runs / "nokl")[i]["grad_norm"] for i in range(1, 4))


@pytest.mark.slow
def test_reference_on_disk_is_the_cold_start_policy(runs):
    from megagspo.checkpoint import CheckpointError, load_reference, safe_torch_load

    run_id = json.load(open(runs / "kl" / "reference.json"))["run_id"]
    ref = load_reference(str(runs / "kl"), run_id)
    cold = safe_torch_load(str(runs / "kl" / "cold_start.pt"))["state"]
    assert set(ref) == set(cold) and all(torch.equal(ref[k], cold[k]) for k in ref)
    with pytest.raises(CheckpointError, match="not to the resumed run"):
        load_reference(str(runs / "kl"), "another-run")


@pytest.mark.slow
def test_sigkill_then_resume_with_kl_equals_uninterrupted(cli, runs, tmp_path):
    run_dir = tmp_path / "k"
    proc = subprocess.Popen(_cmd(tmp_path, "k", "rl.kl_coef=0.1"), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while len(_rl_rows(run_dir)) < 3:
        assert proc.poll() is None, f"run ended early ({proc.returncode}): {proc.communicate()[1][-3000:]}"
        assert time.time() - t0 < 180, "run too slow"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert os.path.isdir(run_dir / "checkpoints" / "step_000002")
    assert not os.path.exists(run_dir / "checkpoints" / "step_000004")
    # a corrupt reference is refused (never silently replaced by the resumed policy's weights)
    good = (run_dir / "reference.safetensors").read_bytes()
    (run_dir / "reference.safetensors").write_bytes(good[:-8] + bytes(8))
    out = _served(cli, _cmd(tmp_path, "k", "rl.kl_coef=0.1", "--resume"), rc=2)
    assert "reference.safetensors: sha256 differs" in out.stdout + out.stderr
    (run_dir / "reference.safetensors").write_bytes(good)
    out = _served(cli, _cmd(tmp_path, "k", "rl.kl_coef=0.1", "--resume"))
    assert "resuming from" in out.stdout
    assert _rl_rows(run_dir) == _rl_rows(runs / "kl")
    # another run resumed from this run's checkpoint finds the reference next to that checkpoint, continues
    # exactly, and keeps a verified copy in its own folder for its own later resumes
    out = _served(cli, _cmd(tmp_path, "b", "rl.kl_coef=0.1",
                            f"checkpoint.resume={run_dir / 'checkpoints' / 'step_000002'}"))
    assert "resuming from" in out.stdout
    assert _rl_rows(tmp_path / "b") == _rl_rows(runs / "kl")
    assert (tmp_path / "b" / "reference.safetensors").read_bytes() == good


def test_a_failed_reference_write_is_an_oserror_and_leaves_nothing(tmp_path):
    """safetensors reports write failures as SafetensorError; the trainer's collective error path catches
    OSError, so the writer must turn one into the other (else rank 0 escapes and its peers wait forever)."""
    import torch as _torch

    from megagspo.checkpoint.reference import REFERENCE, save_reference

    blocker = tmp_path / f"{REFERENCE}.tmp-{os.getpid()}"
    blocker.mkdir()  # the temporary file cannot be created: a directory has its name
    with pytest.raises(OSError, match="tmp-"):
        save_reference(str(tmp_path), {"w": _torch.zeros(2)}, "run")
    assert not (tmp_path / REFERENCE).exists() and blocker.is_dir()


# ------------------------------------------------------------------------------------------------ planner
def test_planner_adds_the_reference_weights():
    from megagspo.planner import GIB, PlanInputs, plan_memory
    from moe.parallel import ParallelLayout
    from test_planner import TINY

    base = dict(world_size=2, layout=ParallelLayout(expert_parallel=2), micro_batch_tokens=10)
    off = plan_memory(TINY, PlanInputs(**base))
    on = plan_memory(TINY, PlanInputs(**base, reference_model=True))
    name = "reference model weights (bf16, frozen, KL)"
    assert name not in off.terms_gib
    # sharded like the policy's bf16 weights: dense 2104 on this rank, experts 2 layers * 576 / EP 2 = 576
    assert round(on.terms_gib[name] * GIB) == 2 * (2104 + 576) == round(on.terms_gib["weights (bf16)"] * GIB)
    assert round((on.total_gib - off.total_gib) * GIB) == 2 * (2104 + 576)


def test_plan_command_names_the_reference(cli):
    # The planner labels the weights with model.precision (the reference is kept in the policy's precision);
    # given explicitly so that this check does not depend on the precision the recipe file declares.
    out = _served(cli, [sys.executable, "-m", "megagspo.cli", "plan", "--config", "configs/qwen3_30b_a3b_gspo.yaml",
                        "rl.kl_coef=0.01", "model.precision=bf16"])
    assert "reference model weights (bf16, frozen, KL)" in out.stdout and "KL coef 0.01" in out.stdout
    out = _served(cli, [sys.executable, "-m", "megagspo.cli", "plan", "--config", "configs/qwen3_30b_a3b_gspo.yaml"])
    assert "reference model weights" not in out.stdout
