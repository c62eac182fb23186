"""Partial rollouts in the embedded engine (`rollout.partial`; RolloutEngine.generate's `switch`): weights that arrive
while a batch is generated stop the unfinished responses, load, and the responses continue from their prefix.

Checked against independent computations on a tiny random Qwen3-MoE, weights streamed as Megatron buckets through
the producer's own `ArrivingWeights` (the WeightSwitch the producer process gives the engine):
- every token's log-prob is the teacher-forced log-softmax of the version that sampled it (a full forward of a
  fresh model holding that version's weights over the prompt and the response so far), and version_RL says which;
- the tokens before the first switch are those of a run that never switched (same generator, same draws);
- a switch that never fires changes nothing, bit for bit, but the version tags;
- a response that ended before a switch is not continued; the switch is taken between two prompt-length classes too;
- R3 routes of a continued response are those of the forward that computed its last token;
- the staleness metrics of the `Produced` source read the per-token versions.
"""

from __future__ import annotations

import queue

import pytest
import torch

from megagspo.rl.producer import ArrivingWeights
from megagspo.rl.rollouts_ahead import HandedWeights
from megagspo.rollout import HFRolloutEngine, SamplingParams


from test_rollout_engine_memory import _arch as _arch_of_vocab
from test_rollout_engine_memory import _Tok, on_cpu  # noqa: F401 (a fixture)


def _arch():
    return _arch_of_vocab(40)


class OneRank:
    """The data-parallel and pipeline reductions of a single rank."""

    def dp_sum(self, values):
        return list(values)

    pp_sum = dp_sum

    def dp_gather(self, values):
        return [list(values)]


def _megatron_state(arch, seed: int) -> dict:
    from moe.hf_checkpoint import FUSED, hf_tensor_shapes, megatron_state_dict_from_hf

    g = torch.Generator().manual_seed(seed)
    hf = {k: torch.randn(shape, generator=g) * 0.3 for k, shape in hf_tensor_shapes(arch, FUSED).items()}
    return megatron_state_dict_from_hf(hf, arch)


class _ArrivingAt(ArrivingWeights):
    """The producer's weight holder, with the trainer's sends scripted: version v's buckets arrive at the
    `at[v]`-th time the engine asks whether newer weights are pending (one ask per decoding step)."""

    def __init__(self, engine, states: dict, at: dict) -> None:
        super().__init__(queue.Queue(), engine)
        self.states, self.at, self.asks = states, at, 0
        self.commands.put((0, [states[0]]))
        assert self.wait_for(0)

    def pending(self) -> bool:
        self.asks += 1
        for version, ask in self.at.items():
            if ask == self.asks:
                self.commands.put((version, [self.states[version]]))
        return super().pending()


class _HandedAt(HandedWeights):
    """The one-step-ahead thread's switch, with the training thread's hand-overs scripted the same way."""

    def __init__(self, engine, states: dict, at: dict) -> None:
        super().__init__(version=0)
        engine.update_weights(states[0])
        self.states, self.at, self.asks = states, at, 0

    def pending(self) -> bool:
        self.asks += 1
        for version, ask in self.at.items():
            if ask == self.asks:
                self.hand(version, [self.states[version]])
        return super().pending()


SWITCHES = {"producer process": _ArrivingAt, "one-step-ahead thread": _HandedAt}

PROMPTS = [[5, 6, 7], [8, 9, 10], [11, 12], [13, 14, 15, 16]]
SAMPLING = dict(max_new_tokens=12, temperature=0.8, top_p=0.95)


def _generate(engine, switch, seed=3):
    sampling = SamplingParams(**SAMPLING, generator=engine.seeded_generator(seed))
    return engine.generate(PROMPTS, 3, sampling, switch=switch)


@torch.no_grad()
def _teacher_forced(arch, state: dict, prompt: list, response: list) -> torch.Tensor:
    """log pi_state(response[t] | prompt + response[:t]) for every t: one full forward of a fresh engine."""
    engine = HFRolloutEngine(arch, _Tok(), record_routes=False)
    engine.update_weights(state)
    ids = torch.tensor([prompt + response])
    logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.fixture(scope="module")
def states():
    arch = _arch()
    return arch, {v: _megatron_state(arch, seed=10 + v) for v in range(3)}


@pytest.mark.parametrize("where", list(SWITCHES))
def test_each_token_has_the_log_prob_and_version_of_the_weights_that_sampled_it(on_cpu, states, where):
    arch, by_version = states
    engine = HFRolloutEngine(arch, _Tok(), record_routes=False)
    switch = SWITCHES[where](engine, by_version, at={1: 4, 2: 9})  # mid-way through the first prompt-length class
    out = _generate(engine, switch)
    mask_RL, version_RL = out.response_mask_RL, out.version_RL
    assert switch.version == 2 and version_RL.dtype == torch.long
    assert torch.equal(version_RL[~mask_RL], torch.zeros_like(version_RL[~mask_RL]))
    seen = set()
    for r in range(len(out.prompt_ids)):
        n = int(mask_RL[r].sum())
        response, versions = out.response_ids_RL[r, :n].tolist(), version_RL[r, :n]
        assert torch.all(versions[1:] >= versions[:-1]), versions  # versions only move forward along a response
        for v in versions.unique().tolist():
            at = versions == v
            expect = _teacher_forced(arch, by_version[v], out.prompt_ids[r], response)[at]
            torch.testing.assert_close(out.logp_RL[r, :n][at], expect, rtol=0, atol=2e-5)
            seen.add(v)
    assert seen == {0, 1, 2}  # some response holds tokens of every version
    continued = [(version_RL[r][mask_RL[r]].unique().numel() > 1) for r in range(len(out.prompt_ids))]
    assert any(continued)


def test_tokens_before_the_first_switch_are_those_of_a_run_without_one(on_cpu, states):
    arch, by_version = states
    engine = HFRolloutEngine(arch, _Tok(), record_routes=False)
    plain = _generate(engine, _ArrivingAt(engine, by_version, at={}), seed=4)
    engine = HFRolloutEngine(arch, _Tok(), record_routes=False)
    k = 8
    switched = _generate(engine, _ArrivingAt(engine, by_version, at={1: k + 1}), seed=4)
    # the first prompt-length class (prompts 0 and 1, 3 samples each); ask 1 comes before it, ask k + 1 after its
    # k-th token: the weights of version 1 arrive after the 8th token
    first = slice(0, 6)
    assert torch.equal(switched.response_ids_RL[first, :k], plain.response_ids_RL[first, :k])
    assert torch.equal(switched.logp_RL[first, :k], plain.logp_RL[first, :k])
    assert not torch.equal(switched.response_ids_RL[first, k:], plain.response_ids_RL[first, k:])
    mask_first = switched.response_mask_RL[first]
    assert bool((switched.version_RL[first, :k][mask_first[:, :k]] == 0).all())
    assert bool((switched.version_RL[first, k:][mask_first[:, k:]] == 1).all())
    # a response that ended before the switch is not continued: nothing after its stop token, version 0 only
    ended = [r for r in range(6) if not bool(plain.response_mask_RL[r, k:].any())]
    assert ended
    for r in ended:
        assert torch.equal(switched.response_ids_RL[r], plain.response_ids_RL[r])
    # the later prompt-length classes start under version 1: the switch pending at a class boundary is taken first
    later = switched.version_RL[6:][switched.response_mask_RL[6:]]
    assert later.numel() and bool((later == 1).all())


def test_a_switch_that_never_fires_changes_nothing_but_the_tags(on_cpu, states):
    arch, by_version = states
    engine = HFRolloutEngine(arch, _Tok())
    engine.update_weights(by_version[0])
    plain = _generate(engine, None)
    engine = HFRolloutEngine(arch, _Tok())
    tagged = _generate(engine, _ArrivingAt(engine, by_version, at={}))
    assert plain.version_RL is None
    for name in ("response_ids_RL", "response_mask_RL", "logp_RL", "routes_RPLyK"):
        assert torch.equal(getattr(plain, name), getattr(tagged, name)), name
    assert torch.equal(tagged.version_RL, torch.zeros_like(tagged.version_RL))
    assert torch.equal(tagged.versions_RL(0), plain.versions_RL(0))


@torch.no_grad()
def test_routes_of_a_continued_response_come_from_the_forward_of_its_last_token(on_cpu, states):
    arch, by_version = states
    engine = HFRolloutEngine(arch, _Tok())
    out = _generate(engine, _ArrivingAt(engine, by_version, at={1: 3}))
    reference = HFRolloutEngine(arch, _Tok())
    reference.update_weights(by_version[1])
    checked = 0
    for r in range(len(out.prompt_ids)):
        mask = out.response_mask_RL[r]
        versions = out.version_RL[r][mask]
        if not (versions == 1).any() or not (versions == 0).any():
            continue
        n = int(mask.sum())
        ids = out.prompt_ids[r] + out.response_ids_RL[r, :n].tolist()
        fed = len(ids) - 1  # prompt + response[:-1]: the positions the engine fed
        reference._routes.clear()
        reference._recording = True
        try:
            reference.model(input_ids=torch.tensor([ids[:fed]]))
        finally:
            reference._recording = False
        expect = torch.stack([reference._routes[layer][0].reshape(fed, -1) for layer in range(len(reference._gates))],
                             dim=1)
        got = out.routes_RPLyK[r, :fed].long()
        assert torch.equal(got.sort(-1).values, expect.sort(-1).values)
        assert bool((out.routes_RPLyK[r, fed:] == -1).all())
        checked += 1
    assert checked


def test_staleness_metrics_read_per_token_versions():
    from megagspo.rl.sources import token_staleness
    from megagspo.rollout import RolloutOutput

    mask_RL = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    version_RL = torch.tensor([[3, 3, 4, 5], [5, 5, 0, 0], [4, 4, 4, 0]])
    out = RolloutOutput([[1]] * 3, torch.ones(3, 4, dtype=torch.long), mask_RL, torch.zeros(3, 4), None, version_RL)
    m = token_staleness(OneRank(), out, version=3, step=6, partial=True)
    stale = [3, 3, 2, 1, 1, 1, 2, 2, 2]  # 6 - version of each of the 9 tokens
    assert m["rollout/staleness_mean"] == pytest.approx(sum(stale) / 9)
    assert m["rollout/staleness_max"] == 3.0
    assert m["rollout/stale_token_frac"] == 1.0
    assert m["rollout/older_version_token_frac"] == pytest.approx(3 / 9)  # row 0: 3, 3, 4 are older than its 5
    assert m["rollout/continued_response_frac"] == pytest.approx(1 / 3)
    out.version_RL = None  # one version for the whole batch: the batch's
    assert token_staleness(OneRank(), out, version=5, step=6, partial=False) == {
        "rollout/staleness_mean": 1.0, "rollout/staleness_max": 1.0, "rollout/stale_token_frac": 1.0}


class _Prompts:
    """A prompt stream: the next `n` of a fixed cycle of prompts."""

    def __init__(self) -> None:
        self.position = 0

    def sample(self, n: int) -> list:
        from megagspo.data.datasets import Example

        picked = [PROMPTS[(self.position + i) % len(PROMPTS)] for i in range(n)]
        self.position += n
        return [Example(prompt=str(p), answer="", prompt_ids=tuple(p)) for p in picked]


class _DecodingTok(_Tok):
    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def test_the_producers_batches_keep_the_versions_through_dynamic_sampling_rounds(on_cpu, states):
    """BatchMaker (what the producer process runs per batch) with partial rollouts and dynamic sampling: the rounds'
    rows keep their tokens' versions, whichever rounds they come from, and the weights arriving in the second round
    tag its later tokens."""
    from megagspo.config_training import FilterConfig, RLBatchConfig
    from megagspo.rewards import score_batch
    from megagspo.rl.batch_maker import BatchMaker
    from megagspo.rl.producer import RewardRecipe
    from megagspo.rollout.base import single_turn
    from moe.parallel import DPShare

    arch, by_version = states
    tok = _DecodingTok()
    engine = HFRolloutEngine(arch, tok, record_routes=False)
    # 1 for a response that stopped before the budget: a group whose samples all ran to it is uninformative
    reward = RewardRecipe("stopped_early", 1.0, fn=_stopped_early)
    reward_fn = reward.build()
    # as the producer process builds it (megagspo.rl.producer.producer_main): its own share, engine and verifier
    maker = BatchMaker(RLBatchConfig(prompts_per_step=2, group_size=3, mini_batches=1),
                       FilterConfig(enabled=True, max_rounds=4), DPShare(0, 1), _Prompts(), tok, single_turn(engine.generate),
                       SamplingParams(**SAMPLING, generator=engine.seeded_generator(4)),
                       lambda texts, answers, stats: score_batch(reward_fn, texts, answers, stats))
    switch = _ArrivingAt(engine, by_version, at={1: 16})  # the first round asks 1 + 12 times at most: in the second
    made = maker.make(switch)
    out, info = made.rollouts.out, made.filter
    assert info["rounds"] >= 2 and out.version_RL is not None
    mask_RL = out.response_mask_RL
    assert out.version_RL.shape == out.response_ids_RL.shape
    assert set(out.version_RL[mask_RL].unique().tolist()) == {0, 1}
    for r in range(len(out.prompt_ids)):
        n = int(mask_RL[r].sum())
        response, versions = out.response_ids_RL[r, :n].tolist(), out.version_RL[r, :n]
        for v in versions.unique().tolist():
            at = versions == v
            expect = _teacher_forced(arch, by_version[v], out.prompt_ids[r], response)[at]
            torch.testing.assert_close(out.logp_RL[r, :n][at], expect, rtol=0, atol=2e-5)
    assert bool((out.version_RL[~mask_RL] == 0).all())


def _stopped_early(text: str, answer: str) -> float:
    return float(len(text.split()) < SAMPLING["max_new_tokens"])


def test_partial_rollouts_need_a_source_that_generates_ahead():
    from megagspo.config import ConfigError
    from megagspo.rl.sources import OneStepAhead, Produced, source_class

    assert source_class(2, True, 1, "process", "hf", partial=True) is Produced
    with pytest.raises(ConfigError, match=r"rollout.partial = true .* needs rollout.staleness >= 1"):
        source_class(0, False, 1, "auto", "hf", partial=True)
    assert source_class(1, False, 1, "thread", "hf", partial=True) is OneStepAhead
    assert source_class(1, False, 1, "auto", "sglang", partial=True) is OneStepAhead
    with pytest.raises(ConfigError, match=r"rollout.partial = true with rollout.engine = sglang runs in one trainer "
                                          r"process .* under 2 processes"):
        source_class(1, False, 1, "auto", "sglang", partial=True, world=2)
    with pytest.raises(ConfigError, match=r"rollout.partial must be true or false, got 'yes'"):
        from megagspo.config import RolloutConfig

        RolloutConfig(partial="yes")


def test_the_batch_keeps_each_target_tokens_version_and_the_mismatch_splits_by_it():
    """SequenceBatch.from_rollouts puts each response token's version at its target position (0 at the prompt's),
    `select` keeps it; mismatch_by_version averages |log pi_old - log pi_rollout| apart for the tokens of the
    version the update starts from and for older ones."""
    from megagspo.rl.batch import SequenceBatch
    from megagspo.rl.step_metrics import mismatch_by_version
    from megagspo.rollout import RolloutOutput

    mask_RL = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    version_RL = torch.tensor([[4, 4, 5], [5, 5, 0]])
    logp_RL = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, 0.0]])
    out = RolloutOutput([[7, 8], [9]], torch.tensor([[11, 12, 13], [14, 15, 0]]), mask_RL, logp_RL, None, version_RL)
    seqs = SequenceBatch.from_rollouts(out, torch.zeros(2), pad_id=0, row_len=8)
    # sequence 0: inputs 7 8 11 12 (targets 8 11 12 13), sequence 1: inputs 9 14 (targets 14 15)
    assert seqs.version_T.tolist() == [0, 4, 4, 5, 5, 5]
    assert seqs.loss_mask_T.tolist() == [False, True, True, True, True, True]
    assert seqs.select([1]).version_T.tolist() == [5, 5]

    class Micro:  # a micro-batch whose model output is already in sequence order
        def __init__(self, seqs, old_logp):
            self.seqs, self.old_logp = seqs, old_logp

        def tokens_of(self, x):
            return x

    old_T = seqs.rollout_logp_T + torch.tensor([0.0, 0.01, 0.03, 0.2, -0.4, 0.6])
    m = mismatch_by_version(OneRank(), [Micro(seqs, old_T)], [old_T], step=5, recomputed=True)
    assert mismatch_by_version(OneRank(), [Micro(seqs, old_T)], [old_T], step=5, recomputed=False) == {}  # pi_old = rollout
    assert m["mismatch/abs_log_ratio_older_version"] == pytest.approx((0.01 + 0.03) / 2)
    assert m["mismatch/abs_log_ratio_current_version"] == pytest.approx((0.2 + 0.4 + 0.6) / 3)
    seqs.version_T = None  # one version for the whole batch: nothing to split
    assert mismatch_by_version(OneRank(), [Micro(seqs, old_T)], [old_T], step=5, recomputed=True) == {}
