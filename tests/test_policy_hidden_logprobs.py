"""Log-probs straight from hidden states in the trainer (model.logprob_path=hidden, the default) against the
logits path (model.logprob_path=logits), and the fused GSPO loss (rl.loss_impl=kernels) in the training path.

- Trainer runs (2 SFT steps, 2 RL steps, GSPO, float32) on the hidden path give the logits path's metrics,
  gradients at every optimizer step and final weights at TP=1, TP=2 (sequence parallel, vocab-parallel
  kernel) and PP=2 (LM head on the last stage; with the KL reference at PP=2); at TP=1 also with the fused
  GSPO loss. Both runs of a layout share one process, one seed and the same initial weights (asserted).
- The peak of allocated bytes of one RL micro-batch update (forward, GSPO loss, backward) of a tiny model at
  a large vocabulary drops by at least the float32 logits' size on the hidden path (allocator events from
  torch's profiler: exact byte counts of every allocation and free, deterministic at one thread).

Tolerance (float32): the two paths order the same float32 reductions differently (the LM-head product per
chunk against one product; the log-sum-exp per chunk), so values agree to a few ulps of the largest value:
gradients and weights rtol 1e-5, atol 2e-6 * max|reference| + 1e-7; metrics rel 1e-5, abs 1e-6 (as in
tests/test_trainer_parallel.py, where a layout change reorders the same reductions).
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import REPO, assert_close_scaled, fresh_seed, tiny_arch
from multiprocess import run_distributed
from test_trainer_parallel import BASE, TP_RUN, _run, _runs_match, _trainer


# chunks of 8 tokens: every micro-batch (4-8 rows x ~13 positions) spans several chunks, and one ends short
CHUNK = ["model.logprob_chunk_tokens=8"]


def _paths_body(rank, world_size, out_dir, seed, layout, extra, variants):
    """One trainer per variant (overrides), same seed, same layout; -> [(rows, weights, grads)] per variant."""
    reports, initial = [], None
    for v, overrides in enumerate(variants):
        trainer = _trainer([*BASE, *TP_RUN, *extra, *layout, *overrides, f"seed={seed}",
                            f"log.out_dir={out_dir}", f"name=v{v}"])
        assert trainer.policy.logprob_path == trainer.cfg.model.logprob_path  # the path under test is taken
        start = trainer.policy.full_state_dict()
        if initial is None:
            initial = start
        for name, tensor in initial.items():  # the comparison starts from the same weights
            assert torch.equal(start[name], tensor), f"variant {v}: initial {name} differs"
        reports.append(_run(trainer, rl_steps=2))
    return reports


LOGITS = ["model.logprob_path=logits"]
HIDDEN = ["model.logprob_path=hidden", *CHUNK]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, layout, extra, variants", [
    (1, [], ["rl.loss=gspo"], [LOGITS, HIDDEN, [*HIDDEN, "rl.loss_impl=kernels"]]),
    (2, ["parallel.tensor_parallel=2"], ["rl.loss=gspo"], [LOGITS, HIDDEN]),
    (2, ["parallel.pipeline_parallel=2"], ["rl.loss=gspo_token", "rl.kl_coef=0.1"], [LOGITS, HIDDEN]),
], ids=["tp1_and_fused_gspo", "tp2", "pp2_gspo_token_kl"])
def test_hidden_path_run_equals_logits_path(tmp_path, world, layout, extra, variants):
    seed = fresh_seed()
    results = run_distributed(_paths_body, world_size=world,
                              args=(str(tmp_path), seed, layout, extra, variants), timeout_s=300)
    for rank, reports in enumerate(results):
        reference = reports[0]
        for v, report in enumerate(reports[1:], start=1):
            _runs_match([report], reference, f"seed {seed} rank {rank} variant {variants[v]} vs logits path")


# ------------------------------------------------------------------------------------------ peak memory
VOCAB, ROWS, SEQ, MEM_CHUNK = 16384, 4, 32, 16


def _peak_bytes(fn) -> int:
    """Peak of (allocated - freed) CPU bytes while fn() runs, above the level at its start, from the allocator
    events torch's profiler records (exact sizes, in order)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    assert events, "the profiler recorded no allocation"
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def _update_peaks(seed, peak_bytes, tied=False):
    """The logits-path and hidden-path policies (same weights), one RL micro-batch update each under
    `peak_bytes(fn)`. -> {path: (peak bytes, {parameter: main_grad})}. tied: the LM head is the embedding
    (its gradient sums the head's, added by the kernel into DDP's buffer, and the embedding lookup's)."""
    from megagspo.algorithm import PackedBatch, get_loss
    from megagspo.config import ParallelConfig
    from megagspo.policy.megatron_policy import MegatronPolicy, setup_parallel

    torch.set_num_threads(1)
    dims, _, _ = setup_parallel(ParallelConfig(), seed)
    arch = tiny_arch("moe", vocab_size=VOCAB, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=16, moe_intermediate_size=32, num_experts=2, tie_word_embeddings=tied)
    policies = {path: MegatronPolicy(arch, dims, ParallelConfig(), "auto", logprob_path=path,
                                     logprob_chunk_tokens=MEM_CHUNK) for path in ("logits", "hidden")}
    policies["hidden"].load_full_state_dict(policies["logits"].full_state_dict())
    dev = policies["logits"].device
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen)
    inp, tgt = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
    mask = (torch.rand(ROWS, SEQ, generator=gen) < 0.7).to(dev)
    adv = torch.randn(ROWS, generator=gen).to(dev)
    loss_fn = get_loss("gspo")
    cfg = loss_fn.Config(clip_low=0.2, clip_high=0.2)

    def gspo(i, logp, ent):
        batch = PackedBatch.from_padded(logp_BL=logp, loss_mask_BL=mask, num_global_sequences=ROWS,
                                        old_logp_BL=logp.detach() - 0.01, advantages_B=adv, entropy_BL=ent)
        return loss_fn(batch, cfg)

    out = {}
    for path, policy in policies.items():
        policy.zero_grad()
        peak = peak_bytes(lambda: policy.run_micro_batches([(inp, tgt)], loss_fn=gspo))
        grads = {n: p.main_grad.detach().cpu().clone() for n, p in policy.model.named_parameters()}
        out[path] = (peak, grads)
    return out


def _memory_body(rank, world_size, seed):
    return [_update_peaks(seed, _peak_bytes, tied) for tied in (False, True)]


def _cuda_peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def _check_peaks(out):
    (peak_logits, g_logits), (peak_hidden, g_hidden) = out["logits"], out["hidden"]
    for name, ref in g_logits.items():
        assert_close_scaled(g_hidden[name], ref, name, rtol=1e-5, atol_scale=2e-6)
    assert any(float(g.abs().max()) > 0 for g in g_logits.values())
    logits_bytes = ROWS * SEQ * VOCAB * 4
    print(f"peak bytes: logits path {peak_logits}, hidden path {peak_hidden}, logits {logits_bytes}")
    assert peak_logits - peak_hidden >= logits_bytes, (peak_logits, peak_hidden, logits_bytes)


@pytest.mark.multiprocess
def test_hidden_path_update_peak_memory_drops_by_the_logits():
    """One RL micro-batch update (no optimizer step) on the logits path and on the hidden path, same weights and
    batch: the same gradients, and a peak lower by at least the float32 [T, V] logits (8 MiB here; the logits
    path also holds their gradient). Untied, and with the LM head tied to the embedding."""
    seed = fresh_seed()
    for out in run_distributed(_memory_body, world_size=1, args=(seed,), timeout_s=240)[0]:  # untied, tied
        _check_peaks(out)


def _cuda_main(seed: int) -> None:
    """The update-peak comparison on CUDA, float32 (run in a subprocess by the gpu test below)."""
    _check_peaks(_update_peaks(seed, _cuda_peak_bytes))


@pytest.mark.gpu
def test_hidden_path_update_on_cuda():
    """The CPU test above on one GPU (torch.cuda.max_memory_allocated; a fresh process, MEGAGSPO_DEVICE=cuda).
    Never run in the session that wrote it (no GPU)."""
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; this host has none (torch.cuda.is_available() is False)")
    seed = fresh_seed()
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MEGAGSPO_DEVICE="cuda",
               PYTHONPATH=os.pathsep.join([REPO, tests, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", f"import test_policy_hidden_logprobs as t; t._cuda_main({seed})"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
