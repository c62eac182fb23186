"""The rollout engine as the training step sees it, under any process layout: the policy's weights go in
(streamed in buckets), samples come out (generated once per model-parallel group and shared with its peers)."""

from __future__ import annotations

import time

from megagspo.config import Config
from megagspo.policy.megatron_policy import MegatronPolicy
from megagspo.rollout import RolloutEngine, RolloutOutput, SamplingParams
from moe.parallel import ParallelDims
from moe.sharding import iter_full_state_buckets


class EngineLink:
    def __init__(self, dims: ParallelDims, policy: MegatronPolicy, engine: RolloutEngine, bucket_mib: int) -> None:
        self.dims = dims
        self.policy = policy
        self.engine = engine
        self.bucket_bytes = bucket_mib * 2**20

    def sync_weights(self) -> float:
        """Stream the policy's weights to the rollout engine (collective: every rank calls it); returns seconds.

        The full (TP=EP=PP=1) model goes out in buckets of at most `rollout.sync_bucket_mib` MiB, gathered one
        bucket at a time over TP / EP / PP (moe.sharding.iter_full_state_buckets), so that no rank ever holds
        the whole model. Only the ranks whose engine needs the weights receive buckets (engine.weights_needed:
        for the embedded engine the ranks that generate, model-parallel rank 0 of each data-parallel rank; for
        SGLang rank 0, which sends); the others relay their shards and iterate empty buckets."""
        return self.stream_weights(self.engine)

    def stream_weights(self, consumer) -> float:
        """sync_weights into any consumer of the stream (`weights_needed`, `update_weights_from_buckets`): the
        run's engine, or a rollout producer process (megagspo.rl.producer). Collective; returns seconds."""
        t0 = time.perf_counter()
        buckets = iter_full_state_buckets(self.policy.model, self.bucket_bytes, dims=self.dims,
                                          receive=consumer.weights_needed(self.dims.generates))
        consumer.update_weights_from_buckets(buckets)
        return time.perf_counter() - t0

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


def build_engine(engine_cls: type, arch, tokenizer, cfg: Config) -> RolloutEngine:
    """The run's rollout engine (rollout.engine's class): SGLang gets rollout.sglang; the embedded engine takes
    the policy's precision on a GPU (bf16 -> bf16), fp32 on the CPU (hf_engine)."""
    return engine_cls(arch, tokenizer, **engine_kwargs(cfg))


def engine_kwargs(cfg: Config) -> dict:
    """The engine's arguments besides the architecture and the tokenizer (also what a producer process builds its
    engine with)."""
    kwargs = ({"config": cfg.rollout.sglang} if cfg.rollout.engine == "sglang"
              else {"dtype": cfg.model.precision} if cfg.rollout.engine == "hf" else {})
    return {"record_routes": cfg.rollout.record_routes, **kwargs}
