"""The rollout engine as the training step sees it, under any process layout: the policy's weights go in
(streamed in buckets, to the engine or as copies to a receiver elsewhere), samples come out (generated once per
model-parallel group and shared with its peers)."""

from __future__ import annotations

import time
from typing import Callable, Optional

from megagspo.config import Config
from megagspo.policy.megatron_policy import MegatronPolicy
from megagspo.rollout import RolloutEngine, RolloutOutput, SamplingParams
from megagspo.rollout.base import WeightSwitch, drain, single_turn
from moe.parallel import ParallelDims
from moe.sharding import iter_full_state_buckets


class EngineLink:
    """The trainer's rollout engine, kept current. A rollout source brings its engines up to date after each update
    (megagspo.rl.sources): most stream the weights here at once (`sync_weights`); one whose batches come from
    elsewhere (the producer process) only marks this engine `behind`, and whoever reads it next (the held-out
    evaluation, through `current_engine`) streams them then: the model is streamed once per step, not twice."""

    def __init__(self, dims: ParallelDims, policy: MegatronPolicy, engine: RolloutEngine, bucket_mib: int) -> None:
        self.dims = dims
        self.policy = policy
        self.engine = engine
        self.bucket_bytes = bucket_mib * 2**20
        self.behind = False           # the engine lacks the policy's latest weights (mark_behind)
        self.streamed_bytes = 0       # bytes of the buckets this rank received from them

    def sync_weights(self) -> float:
        """Stream the policy's weights to the rollout engine (collective: every rank calls it); returns seconds.

        The full (TP=EP=PP=1) model goes out in buckets of at most `rollout.sync_bucket_mib` MiB, gathered one
        bucket at a time over TP / EP / PP (moe.sharding.iter_full_state_buckets), so that no rank ever holds
        the whole model. Only the ranks whose engine needs the weights receive buckets (engine.weights_needed:
        for the embedded engine the ranks that generate, model-parallel rank 0 of each data-parallel rank; for
        SGLang rank 0, which sends); the others relay their shards and iterate empty buckets."""
        seconds = self.stream_weights(self.engine)
        self.behind = False
        return seconds

    def mark_behind(self) -> None:
        """The policy was updated and this engine was not given the weights (its source's batches come from
        elsewhere): the next `current_engine` streams them."""
        self.behind = True

    def current_engine(self) -> RolloutEngine:
        """The engine with the policy's latest weights (collective when it is behind: every rank calls it, as the
        evaluation does)."""
        if self.behind:
            self.sync_weights()
        return self.engine

    def stream_weights(self, consumer) -> float:
        """The policy's weights streamed into any consumer of the stream (`weights_needed`,
        `update_weights_from_buckets`): the run's engine, or CopiedWeights for a receiver elsewhere. Collective;
        returns seconds."""
        t0 = time.perf_counter()
        buckets = iter_full_state_buckets(self.policy.model, self.bucket_bytes, dims=self.dims,
                                          receive=consumer.weights_needed(self.dims.generates))
        consumer.update_weights_from_buckets(_Counted(buckets, self))
        return time.perf_counter() - t0

    def stream_copies(self, version: int, deliver: Optional[Callable[[int, list], None]]) -> float:
        """The policy's weights, as version `version`, to a receiver that loads them later, elsewhere: host copies
        of the buckets handed to `deliver(version, buckets)` on the ranks whose engine would receive them (a
        producer process, or the generating thread's WeightSwitch). `deliver` None: this rank only takes part in
        the stream. Collective; returns seconds."""
        return self.stream_weights(CopiedWeights(version, self.engine.weights_needed, deliver))

    def load_pending(self, switch: WeightSwitch) -> None:
        """Partial rollouts: weights handed to `switch` that no generation took yet, loaded into the engine now."""
        if switch.pending():
            switch.apply(self.engine)

    def seeded_generator(self, seed: int):
        """The engine's own sampling generator seeded with `seed` (None where the engine samples elsewhere): what
        generation beside the training thread draws from (megagspo.rl.rollouts_ahead)."""
        return self.engine.seeded_generator(seed)

    def generate(self, prompt_ids: list, n: int, sampling: SamplingParams, switch=None) -> RolloutOutput:
        """The engine's samples; under TP / PP only rank 0 of each model-parallel group (the TP x PP ranks of
        one data-parallel rank) generates and broadcasts to its peers, so that they all train on the same
        rollouts. `switch`: partial rollouts (RolloutEngine.generate)."""
        return self.dims.on_mp_rank0("rollout generation",
                                     lambda: self.engine.generate(prompt_ids, n, sampling, switch=switch))

    def rollouts(self, agent=None) -> Callable[..., RolloutOutput]:
        """The batch maker's rollout function (examples, n, sampling, switch=) -> RolloutOutput: single-turn
        generation, or `agent`'s multi-turn trajectories (megagspo.agent.AgentRollouts), run whole on model-parallel
        rank 0 (its tools run once) and shared with the TP x PP peers."""
        if agent is None:
            return single_turn(self.generate)

        def run(examples, n: int, sampling: SamplingParams, switch=None) -> RolloutOutput:
            return self.dims.on_mp_rank0("agent rollouts",
                                         lambda: agent.run(self.engine.generate, examples, n, sampling, switch))

        return run


class _Counted:
    """A weight stream whose received bytes are added to the link's count (what a test of one stream per step
    reads); `receive` as the stream's."""

    def __init__(self, buckets, link: EngineLink) -> None:
        self.buckets, self.link = buckets, link
        self.receive = getattr(buckets, "receive", True)

    def __iter__(self):
        for bucket in self.buckets:
            self.link.streamed_bytes += sum(t.numel() * t.element_size() for t in bucket.values())
            yield bucket


class CopiedWeights:
    """The weight stream's consumer for a receiver that loads the weights later, elsewhere: the producer process or
    the generating thread (partial rollouts). The ranks that `needed(generates)` names keep each bucket as a host
    copy (the trainer's next update overwrites the parameters; a GPU beside a running generation may not hold the
    model twice) and `deliver(version, buckets)` the lot; the others, and a rank with nothing to deliver to, only
    iterate the stream."""

    def __init__(self, version: int, needed: Callable[[bool], bool],
                 deliver: Optional[Callable[[int, list], None]]) -> None:
        self.version, self.needed, self.deliver = version, needed, deliver

    def weights_needed(self, generates: bool) -> bool:
        return self.deliver is not None and self.needed(generates)

    def update_weights_from_buckets(self, buckets) -> None:
        it = iter(buckets)
        if not getattr(buckets, "receive", True) or self.deliver is None:
            drain(it)
            return
        kept = [{name: t.detach().to("cpu", copy=True) for name, t in bucket.items()} for bucket in it]
        self.deliver(self.version, kept)


def build_engine(engine_cls: type, arch, tokenizer, cfg: Config) -> RolloutEngine:
    """The run's rollout engine (rollout.engine's class): SGLang gets rollout.sglang; the embedded engine takes
    the policy's precision on a GPU (bf16 -> bf16), fp32 on the CPU (hf_engine)."""
    return engine_cls(arch, tokenizer, **engine_kwargs(cfg))


def engine_kwargs(cfg: Config) -> dict:
    """The engine's arguments besides the architecture and the tokenizer (also what a producer process builds its
    engine with)."""
    kwargs = ({"config": cfg.rollout.sglang, "engine_dtype": cfg.rollout.engine_dtype} if cfg.rollout.engine == "sglang"
              else {"dtype": cfg.model.precision, "precision": cfg.rollout.engine_dtype} if cfg.rollout.engine == "hf"
              else {})
    return {"record_routes": cfg.rollout.record_routes, **kwargs}
