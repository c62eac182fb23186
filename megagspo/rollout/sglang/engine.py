"""The SGLang rollout engine: batched `/generate` over SGLang's native HTTP API, weights synced from Megatron.

Attach to running servers (`SGLangEngineConfig(urls=[...])`) or let the engine start and own them
(`SGLangEngineConfig(launch=SGLangLaunchConfig(model_path=...))`, `python -m sglang.launch_server` children).
Only the HTTP client (stdlib urllib) is needed to attach; launching needs the `sglang` package on a GPU host.

`SGLangEngine` is the RolloutEngine face (base.py) over collaborators with one job each, built in this order:
  sync.check_weight_sync_prerequisites  what the weight sync needs here, before any server is contacted
  server.SGLangServers                  launch or attach, health, GPU memory (colocate), stop (client.py: HTTP)
  sync.WeightSync                       update_weights_from_buckets: disk / tensor / distributed (the *_sync.py)
  generation.Generation                 generate: /generate rounds -> RolloutOutput
  partial.PartialRollouts               generate(..., switch): abort and resume under newer weights

generate(prompts, n, sampling): the N*G requests go out prompt-major (row i*G+g = sample g of prompt i), in
chunks of `max_batch` spread over the servers (generation.py); with a WeightSwitch, partial rollouts
(partial.py); switch None: one round, no watcher, version_RL None.

update_weights_from_buckets(stream of Megatron buckets; update_weights(full state) is a stream of one) sends
HF-named tensors in one of three ways (`weight_sync`): "disk" (an HF checkpoint folder under `sync_dir`),
"tensor" (same host: CUDA IPC) or "distributed" (any host: a process group with the servers); see sync.py for
the protocol across trainer ranks.

Legend as in base.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence

import torch

from ..base import RolloutEngine, RolloutOutput, SamplingParams, WeightSwitch, register_engine
from .config import SGLangEngineConfig, with_engine_dtype
from .errors import SGLangConfigError
from .generation import Generation
from .partial import PartialRollouts
from .server import SGLangServers
from .sync import WeightSync, check_weight_sync_prerequisites


@register_engine("sglang")
class SGLangEngine(RolloutEngine):
    def __init__(self, arch, tokenizer, record_routes: Optional[bool] = None,
                 config: Optional[SGLangEngineConfig] = None, ipc_codec=None, engine_dtype: str = "auto") -> None:
        """ipc_codec: weight_sync = 'tensor' only; default SGLangIpcCodec() (CUDA + sglang). Another codec (e.g. one
        that pickles CPU tensors, as the tests use) replaces CUDA IPC explicitly. engine_dtype (rollout.engine_dtype):
        the launched servers' --dtype / --quantization (config.with_engine_dtype)."""
        if config is None:
            raise SGLangConfigError("rollout.engine = 'sglang' needs an SGLangEngineConfig (urls of running servers "
                                    "or launch settings): SGLangEngine(arch, tokenizer, "
                                    "config=SGLangEngineConfig(...))")
        if isinstance(config, dict):
            config = SGLangEngineConfig(**config)
        config = with_engine_dtype(config, engine_dtype)
        if ipc_codec is not None and config.weight_sync != "tensor":
            raise SGLangConfigError(f"an ipc_codec applies to sglang.weight_sync = 'tensor' only, not "
                                    f"{config.weight_sync!r}")
        if record_routes is False and config.routing_replay == "r3":
            raise SGLangConfigError("sglang.routing_replay = 'r3' needs routes, but record_routes=False was passed")
        self.arch = arch
        self.tokenizer = tokenizer
        self.config = config
        # record_routes=True (the trainer's rollout.record_routes) asks for routes exactly as R3 does.
        self.want_routes = config.routing_replay == "r3" or bool(record_routes)
        codec = check_weight_sync_prerequisites(config, ipc_codec)
        self.servers = SGLangServers(config, self.want_routes)
        self.urls = self.servers.urls
        self._sync = WeightSync(config, arch, self.servers, codec)
        self._generation = Generation(config, arch, tokenizer, self.servers.client, self.want_routes)
        self._partial = PartialRollouts(config, self._generation, self.servers.client)

    def close(self) -> None:
        """Leave the weight-update group (distributed sync), then stop the servers this engine started."""
        self._sync.close()
        self.servers.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Free the servers' GPU memory (weights and KV cache) for training; needs colocate=True."""
        self.servers.release_memory()

    def resume_memory(self) -> None:
        self.servers.resume_memory()

    # ------------------------------------------------------------------------------------------ weights
    @staticmethod
    def weights_needed(generates: bool) -> bool:
        """Only rank 0 (or the only process) sends to the servers, whichever ranks generate."""
        return WeightSync.weights_needed(generates)

    def update_weights_from_buckets(self, buckets: Iterable[Dict[str, torch.Tensor]]) -> None:
        """Every rank calls this with its stream (RolloutEngine's contract); rank 0 sends: WeightSync.update."""
        self._sync.update(buckets)

    def write_hf_checkpoint(self, megatron_state: Dict[str, torch.Tensor],
                            max_shard_bytes: int = 5 * 2**30) -> Path:
        """The full Megatron state as an HF checkpoint (safetensors shards + index + config.json) in a new
        folder `<sync_dir>/weights-v<k>`; returns its path."""
        return self._sync.write_hf_checkpoint([megatron_state], max_shard_bytes)

    # ------------------------------------------------------------------------------------------ rollout
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                 switch: Optional[WeightSwitch] = None) -> RolloutOutput:
        """switch None: one pass of /generate requests. A WeightSwitch: partial rollouts by abort and resume
        (PartialRollouts), every token tagged with the version that sampled it (version_RL)."""
        if n < 1 or not prompts:
            raise ValueError(f"generate needs prompts and n >= 1 (got {len(prompts)} prompts, n={n})")
        if not self.config.original_logprob and not sampling.greedy and sampling.temperature != 1.0:
            raise SGLangConfigError(
                f"temperature {sampling.temperature} with servers that return tempered log-probs: start them with "
                "SGLANG_RETURN_ORIGINAL_LOGPROB=1 and set sglang.original_logprob = true (logp_RL must be the "
                "temperature-1 log-softmax)")
        self.resume_memory()
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        if switch is not None:
            return self._partial.generate(rows, n, sampling, switch, self)
        sp = self._sampling_json(sampling, sampling.max_new_tokens)
        parsed = self._generation.round(list(range(len(rows))), rows, sp, sampling.max_new_tokens, n)
        return self._generation.output(rows, parsed, sampling.max_new_tokens, n)

    def _sampling_json(self, sampling: SamplingParams, max_new: int) -> dict:
        """The sampling_params a request of this generation carries (Generation.sampling_json)."""
        return self._generation.sampling_json(sampling, max_new)
