"""Packed sequences in the RL step (rl.packing, megagspo/rl/micro_batches.py): the packed step equals the
padded step — every logged metric, every gradient of every optimizer step, the weights after it — under
GSPO-token with R3 and GRPO with R2 and the KL reference on one process (GSPO and GRPO with R2 in packed
micro-batches against one padded pass: tests/test_trainer_parallel.py's accumulation test), and with
token-budget micro-batches
(rl.max_tokens_per_micro_batch) at DP=2 x EP=2, where the ranks need different numbers of micro-batches and
agree on one. The TP=2 (sequence parallel), TP=2 x EP=2 and PP=2 layouts are compared packed-against-padded in
tests/test_trainer_parallel.py. Plus the pieces: row lengths, the packed stream and its TP alignment tail, the
longest-first partition, and the config's refusals.

Tolerances: tests/test_trainer_parallel.py's (float32; only reduction order differs). The router aux loss is
off in the token-budget run only: like Megatron, each micro-batch adds its own load-balancing estimate, so a
different grouping changes it by design.
"""

from __future__ import annotations

import pytest
import torch

from helpers import fresh_seed
from multiprocess import run_distributed
from test_trainer_parallel import BASE, TP_RUN, _run, _runs_match, _trainer

GRPO = ["rl.loss=grpo", "rl.clip_low=0.2", "rl.clip_high=0.28"]


class _Dims:
    """The members SequenceBatch.model_input / token_budget_split read of moe.parallel.ParallelDims, for unit tests."""

    def __init__(self, seq_multiple=1):
        self.seq_multiple, self.dp_size, self.dp_rank = seq_multiple, 1, 0

    def seq_length(self, natural):
        return -(-natural // self.seq_multiple) * self.seq_multiple

    def dp_sum(self, values):
        return list(values)

    def dp_gather(self, values):
        return [list(values)]


def _rollouts():
    from megagspo.rollout import RolloutOutput

    prompts = [[5, 6, 7], [8], [9, 10]]
    response_RL = torch.tensor([[11, 12, 0], [13, 14, 15], [0, 0, 0]])
    mask_RL = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    logp_RL = -torch.arange(1, 10, dtype=torch.float32).reshape(3, 3) / 10
    return RolloutOutput(prompts, response_RL, mask_RL, logp_RL)


def _sequences(row_len=5):
    from megagspo.rl.batch import SequenceBatch

    return SequenceBatch.from_rollouts(_rollouts(), torch.tensor([0.5, -1.0, 0.0]), pad_id=0, row_len=row_len)


def test_sequences_hold_prompt_and_response_up_to_its_last_token():
    """prompt 3 + 2 response tokens - 1; prompt 1 + 3 - 1; an empty response keeps its prompt's positions; the
    targets are the next tokens, the loss mask and the engine's log-probs sit on the response targets."""
    seqs = _sequences()
    assert seqs.lengths == [4, 3, 1] and seqs.cu_seqlens_S1.tolist() == [0, 4, 7, 8]
    assert seqs.tokens_T.tolist() == [5, 6, 7, 11, 8, 13, 14, 9]
    assert seqs.targets_T.tolist() == [6, 7, 11, 12, 13, 14, 15, 10]
    assert seqs.loss_mask_T.tolist() == [False, False, True, True, True, True, True, False]
    assert torch.equal(seqs.rollout_logp_T, torch.tensor([0, 0, -0.1, -0.2, -0.4, -0.5, -0.6, 0]))
    part = seqs.select([2, 0])
    assert part.lengths == [1, 4] and part.tokens_T.tolist() == [9, 5, 6, 7, 11]
    assert part.advantages_S.tolist() == [0.0, 0.5]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_demonstrations_as_sequences_give_sfts_padded_rows(seed):
    """Cold-start SFT's batch is a SequenceBatch; its rows are exactly the prompt + answer rows SFT trained on
    (build_sequences): inputs, targets and loss mask, on random prompts and answers of uneven lengths."""
    from megagspo.policy.megatron_policy import build_sequences
    from megagspo.rl.batch import SequenceBatch

    gen = torch.Generator().manual_seed(seed)
    n = 5
    prompts = [torch.randint(3, 50, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(n)]
    answers = [torch.randint(3, 50, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist() + [2]
               for _ in range(n)]
    width = max(map(len, answers))
    resp, mask = torch.full((n, width), 0), torch.zeros((n, width), dtype=torch.bool)
    for i, a in enumerate(answers):
        resp[i, :len(a)], mask[i, :len(a)] = torch.tensor(a), True
    natural = max(map(len, prompts)) + width - 1
    row_len = _Dims(4).seq_length(natural)
    inp, tgt, lmask, _ = build_sequences(prompts, resp, mask, 0, length=row_len)
    seqs = SequenceBatch.from_demonstrations(prompts, answers, pad_id=0, row_len=row_len)
    # a sequence's last token is an input too where its row has room (the longest rows have none)
    assert seqs.lengths == [min(len(p) + len(a), row_len) for p, a in zip(prompts, answers)]
    assert torch.equal(seqs.rows_of(seqs.tokens_T, 0), inp) and torch.equal(seqs.rows_of(seqs.targets_T, 0), tgt)
    assert torch.equal(seqs.rows_of(seqs.loss_mask_T, False), lmask)
    part = seqs.select(range(1, 3))  # a micro-batch's rows are the rows' slice
    assert torch.equal(part.rows_of(part.tokens_T, 0), inp[1:3])


@pytest.mark.parametrize("multiple", [1, 4])
def test_packed_stream_holds_real_positions_and_an_aligned_tail(multiple):
    part = _sequences().select([2, 0])
    view = part.model_input(packed=True, dims=_Dims(multiple))
    total = 5 if multiple == 1 else 8
    assert view.model.input_ids_BS.shape == (1, total) and view.computed_tokens == total
    assert view.model.input_ids_BS[0, :5].tolist() == [9, 5, 6, 7, 11]
    assert view.model.targets_BS[0, :5].tolist() == [10, 6, 7, 11, 12]
    assert view.model.packed.cu_seqlens_N1.tolist() == ([0, 1, 5] if multiple == 1 else [0, 1, 5, 8])
    # the loss reads the sequences' tokens of any per-position result, never the tail
    logp = torch.arange(total, dtype=torch.float32)[None]
    assert view.tokens_of(logp, part.num_tokens).tolist() == [0, 1, 2, 3, 4]
    if multiple == 1:
        assert view.model.padding_mask_BS is None
    else:  # the tail: pad tokens, padding for the aux loss
        assert view.model.input_ids_BS[0, 5:].tolist() == [0, 0, 0]
        assert view.model.padding_mask_BS[0].tolist() == [False] * 5 + [True] * 3
    padded = part.model_input(packed=False, dims=_Dims(multiple))
    assert padded.computed_tokens == 10
    assert padded.model.input_ids_BS.tolist() == [[9, 0, 0, 0, 0], [5, 6, 7, 11, 0]]
    assert padded.model.padding_mask_BS.tolist() == [[False, True, True, True, True], [False] * 4 + [True]]
    rows_logp = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    assert padded.tokens_of(rows_logp, part.num_tokens).tolist() == [0, 5, 6, 7, 8]


def test_longest_first_balances_tokens_and_keeps_every_row_once():
    from megagspo.rl.micro_batches import longest_first

    gen = torch.Generator().manual_seed(fresh_seed())
    lengths = torch.randint(1, 200, (37,), generator=gen)
    rows = torch.randperm(37, generator=gen)
    groups = longest_first(rows, lengths, 5)
    assert sorted(torch.cat(groups).tolist()) == sorted(rows.tolist())
    loads = [int(sum(lengths[(rows == r).nonzero()[0, 0]] for r in g)) for g in groups]
    assert max(loads) - min(loads) <= int(lengths.max()), loads
    assert all(len(g) for g in groups)


def test_token_budget_split_sizes_micro_batches_by_tokens():
    from megagspo.rl.micro_batches import token_budget_split

    lengths = torch.tensor([50, 10, 10, 30, 40, 60, 5, 5])
    minis = [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])]
    split = token_budget_split(minis, lengths, budget=60, dims=_Dims())
    assert [len(m) for m in split] == [2, 2]   # 100 and 110 tokens -> 2 micro-batches of <= 60 each
    for mini, micro in zip(minis, split):
        assert sorted(torch.cat(micro).tolist()) == mini.tolist()
        assert all(int(lengths[g].sum()) <= 60 for g in micro)


@pytest.mark.parametrize("overrides, error", [
    (["rl.max_tokens_per_micro_batch=64", "rl.micro_batch_size=2"], "both size the micro-batches"),
    (["rl.max_tokens_per_micro_batch=64", "rl.packing=false"], "needs rl.batch.packing = true"),
    (["model.attention=local"], "needs model.attention = sdpa"),
    (["rl.packing=2"], "rl.batch.packing"),
])
def test_config_refuses_contradictory_packing_settings(overrides, error):
    import os

    from megagspo.config import ConfigError, load_config
    from helpers import REPO

    with pytest.raises(ConfigError, match=error):
        load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), overrides)


def _packed_vs_padded_body(rank, world_size, out_dir, seed, extra):
    runs = {}
    for packing in ("false", "true"):
        trainer = _trainer([*BASE, *TP_RUN, *extra, f"seed={seed}", f"rl.packing={packing}",
                            f"log.out_dir={out_dir}", f"name=packing_{packing}"])
        runs[packing] = _run(trainer, rl_steps=2)
        last = runs[packing][0][-1]
        runs[packing + "_batch"] = {k: v for k, v in last.items() if k.startswith("batch/")}
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("extra", [
    ["rl.loss=gspo_token", "rl.routing_replay=r3", "rollout.record_routes=true", "rl.micro_batch_size=2"],
    [*GRPO, "rl.routing_replay=r2", "rl.kl_coef=0.1"],
], ids=["gspo_token_r3_micro_batches", "grpo_r2_kl"])
def test_packed_step_equals_padded_step(tmp_path, extra):
    seed = fresh_seed()
    runs = run_distributed(_packed_vs_padded_body, world_size=1, args=(str(tmp_path), seed, extra),
                           timeout_s=300)[0]
    _runs_match([runs["true"]], runs["false"], f"seed {seed} packed vs padded")
    # Padded rows carry padding unless every sequence of the step fills the row width (a seed where all the
    # responses run to max_response_tokens on equal-length prompts), so the padded fraction may be 0 as well.
    assert runs["true_batch"]["batch/pad_fraction"] == 0.0 <= runs["false_batch"]["batch/pad_fraction"] < 1.0
    assert runs["true_batch"]["batch/tokens_per_micro_batch_max"] <= runs["false_batch"]["batch/tokens_per_micro_batch_max"]


BUDGET = ["model.router_aux_loss_coef=0.0", "parallel.expert_parallel=2", "rl.loss=gspo", "rl.prompts_per_step=8",
          "sft.steps=2", "sft.lr=0.05", "rl.lr=0.05"]


def _budget_body(rank, world_size, out_dir, seed, layout):
    trainer = _trainer([*BASE, *BUDGET, *layout, f"seed={seed}", f"log.out_dir={out_dir}", "name=budget"])
    assert trainer.dims.dp_size == 2
    return _run(trainer, rl_steps=2), None


@pytest.mark.multiprocess
def test_token_budget_micro_batches_equal_the_padded_step_at_dp2_ep2(tmp_path):
    """DP=2 x EP=2: micro-batches of at most 24 tokens (each rank's 8 sequences of ~8-12 tokens per mini-batch
    need 3-5 of them; both ranks run the larger count), each mini-batch's sequences re-partitioned over the
    ranks by tokens (megagspo.rl.dp_balance), against padded whole mini-batches as generated."""
    seed = fresh_seed()
    padded = run_distributed(_budget_body, world_size=2, args=(str(tmp_path / "padded"), seed, ["rl.packing=false"]),
                             timeout_s=300)
    budget = run_distributed(_budget_body, world_size=2, timeout_s=300,
                             args=(str(tmp_path / "budget"), seed, ["rl.max_tokens_per_micro_batch=24"]))
    for rank in range(2):
        _runs_match([budget[rank][0]], padded[rank][0], f"seed {seed} rank {rank} token budget")
    for row in budget[0][0][0]:  # every sequence is shorter than the budget: every micro-batch fits it
        assert 0 < row["batch/tokens_per_micro_batch_min"] <= row["batch/tokens_per_micro_batch_max"] <= 24
        assert row["batch/pad_fraction"] == 0.0
    assert all(row["batch/dp_tokens_max_over_mean"] >= 1.0 for row in budget[0][0][0])


def test_token_budget_adds_micro_batches_until_each_fits():
    """Whole sequences decide the count, not the total: 145 tokens fit 3 groups of <= 60; three 40-token
    sequences (120 tokens, 2 groups by count) need 3 groups at a budget of 60."""
    from megagspo.rl.micro_batches import token_budget_split

    lengths = torch.tensor([30, 30, 30, 30, 25])
    split = token_budget_split([torch.arange(5)], lengths, budget=60, dims=_Dims())[0]
    loads = [int(lengths[g].sum()) for g in split]
    assert len(loads) == 3 and sum(loads) == 145 and max(loads) <= 60
    lengths = torch.tensor([40, 40, 40])  # 120 tokens, budget 60: two groups cannot hold three 40s
    split = token_budget_split([torch.arange(3)], lengths, budget=60, dims=_Dims())[0]
    assert len(split) == 3


def test_equal_count_partition_balances_tokens():
    from megagspo.rl.dp_balance import equal_count_longest_first

    gen = torch.Generator().manual_seed(fresh_seed())
    lengths = torch.randint(1, 500, (48,), generator=gen).tolist()
    groups = equal_count_longest_first(lengths, 4)
    assert sorted(i for g in groups for i in g) == list(range(48)) and {len(g) for g in groups} == {12}
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(lengths), loads
    # by hand: 100 -> A, 60 -> B, 50 -> B (110), 3 -> A, 2 -> A (full: 105), 1 -> B (111)
    groups = equal_count_longest_first([100, 1, 2, 3, 50, 60], 2)
    assert groups == [[0, 2, 3], [1, 4, 5]]
    with pytest.raises(ValueError, match="equal groups"):
        equal_count_longest_first([1, 2, 3], 2)


def test_planner_sizes_token_budget_micro_batches():
    """The dry run plans token-budget micro-batches for the worst case of real tokens (every sequence at its
    maximum length): as many whole sequences as fit the budget (one, when a sequence is longer), instead of
    rl.micro_batch_size rows."""
    import os

    from helpers import REPO
    from megagspo.config import load_config
    from megagspo.dry_run import dry_run

    base = ["rl.prompts_per_step=8", "rl.group_size=4", "rl.mini_batches=2", "data.max_prompt_tokens=8",
            "data.max_response_tokens=5"]
    rows = dry_run(load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), base), require_fitting=False)
    assert (rows.micro_batch_tokens, rows.num_micro_batches) == (16 * 13, 2)
    budget = dry_run(load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"),
                                 [*base, "rl.max_tokens_per_micro_batch=40"]), require_fitting=False)
    # 3 sequences of 13 fit 40 tokens: 39-token micro-batches, ceil(16 / 3) = 6 per mini-batch
    assert (budget.micro_batch_tokens, budget.num_micro_batches) == (39, 2 * 6)
    short = dry_run(load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"),
                                [*base, "rl.max_tokens_per_micro_batch=4"]), require_fitting=False)
    assert (short.micro_batch_tokens, short.num_micro_batches) == (13, 2 * 16)  # one sequence per micro-batch


def _balance_body(rank, world_size, seed, versions=False):
    """Rank 0 generated long sequences, rank 1 short ones; after balance_over_dp each rank holds half of every
    mini-batch with nearly equal tokens, and every sequence's data arrived intact (`versions`: with the per-token
    policy versions of partial rollouts)."""
    from megagspo.rl.batch import SequenceBatch
    from megagspo.rl.dp_balance import balance_over_dp
    from moe.cpu_shim import apply_cpu_shim
    from moe.parallel import ParallelLayout, initialize_model_parallel

    apply_cpu_shim()
    dims = initialize_model_parallel(ParallelLayout())
    gen = torch.Generator().manual_seed(seed + rank)
    rows, width = 8, 40 if rank == 0 else 12
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=gen).tolist()
    # every token says where it came from: rank * 1000 + row * 100 + position
    tokens_T = torch.cat([rank * 1000 + r * 100 + torch.arange(n) for r, n in enumerate(lengths)])
    routes = (tokens_T[:, None, None] % 4).expand(len(tokens_T), 2, 2).to(torch.int16)
    seqs = SequenceBatch(tokens_T, tokens_T + 1, torch.ones(len(tokens_T), dtype=torch.bool), tokens_T.float() / 7,
                         rank * 10.0 + torch.arange(rows, dtype=torch.float32), lengths, -1, width, routes,
                         version_T=tokens_T % 3 + 5 if versions else None)
    minis = [torch.tensor([3, 0, 5, 6]), torch.tensor([1, 2, 4, 7])]
    out, mini_rows = balance_over_dp(dims, seqs, minis)
    return {"lengths": lengths, "out": out, "mini_rows": mini_rows}


def test_balance_over_dp_spreads_each_mini_batch_by_tokens_and_moves_data_intact():
    seed = fresh_seed()
    res = run_distributed(_balance_body, world_size=2, args=(seed,), timeout_s=120)
    lengths = {r: res[r]["lengths"] for r in range(2)}
    longest = max(max(n) for n in lengths.values())
    seen = []
    for k in range(2):
        loads = []
        for r in range(2):
            out, rows = res[r]["out"], res[r]["mini_rows"][k]
            assert len(rows) == 4  # equal counts
            assert out.row_len == 40  # padded rows hold any rank's longest
            loads.append(sum(out.lengths[i] for i in rows.tolist()))
            for i in rows.tolist():
                one = out.select([i])
                first = int(one.tokens_T[0])
                src_rank, src_row = first // 1000, (first % 1000) // 100
                n = lengths[src_rank][src_row]
                assert one.lengths == [n]
                expected = src_rank * 1000 + src_row * 100 + torch.arange(n)
                assert torch.equal(one.tokens_T, expected) and torch.equal(one.targets_T, expected + 1)
                assert torch.equal(one.rollout_logp_T, expected.float() / 7) and one.loss_mask_T.all()
                assert float(one.advantages_S[0]) == src_rank * 10.0 + src_row
                assert torch.equal(one.routes_TLy[:, 0, 0], (expected % 4).to(torch.int16))
                seen.append((k, src_rank, src_row))
        assert abs(loads[0] - loads[1]) <= longest, loads
    # each mini-batch holds exactly the rows both ranks put in it
    minis = [[3, 0, 5, 6], [1, 2, 4, 7]]
    assert sorted(seen) == sorted((k, r, i) for k in range(2) for r in range(2) for i in minis[k])


def _balance_versions_body(rank, world_size, seed):
    return _balance_body(rank, world_size, seed, versions=True)


def test_balance_over_dp_moves_the_token_versions_of_partial_rollouts():
    """Partial rollouts + a token budget at DP = 2: each token's policy version (SequenceBatch.version_T) travels
    with it, as every declared per-token field does (ec55d2c kept the sender's versions and indexed them with the
    received positions: an index error, or versions of other tokens)."""
    seed = fresh_seed()
    res = run_distributed(_balance_versions_body, world_size=2, args=(seed,), timeout_s=120)
    for r in range(2):
        out = res[r]["out"]
        assert out.version_T is not None and out.version_T.shape == out.tokens_T.shape
        assert torch.equal(out.version_T, out.tokens_T % 3 + 5)
        for rows in res[r]["mini_rows"]:
            part = out.select(rows.tolist())
            assert torch.equal(part.version_T, part.tokens_T % 3 + 5)


def test_every_per_token_field_is_declared_once_and_travels():
    """select, to and the DP exchange iterate SequenceBatch's declaration: every [T]-long tensor field is declared
    per token (a new one cannot be forgotten by a hand-kept list)."""
    import dataclasses

    from megagspo.rl.batch import SequenceBatch

    n = 5
    seqs = SequenceBatch(torch.arange(n), torch.arange(n) + 1, torch.ones(n, dtype=torch.bool), torch.zeros(n),
                         torch.zeros(2), [2, 3], 0, 4, torch.zeros(n, 1, 2, dtype=torch.int16), None,
                         torch.arange(n) % 2)
    token_long = {f.name for f in dataclasses.fields(seqs)
                  if isinstance(getattr(seqs, f.name), torch.Tensor) and getattr(seqs, f.name).shape[:1] == (n,)}
    assert token_long == set(SequenceBatch.per_token_fields())
    one = seqs.select([1])
    assert all(getattr(one, name).shape[0] == 3 for name in SequenceBatch.per_token_fields())
    assert torch.equal(one.version_T, torch.tensor([0, 1, 0])) and one.advantages_S.shape == (1,)
