"""Weight sync to the servers: which path (`weight_sync`: disk_sync.py, tensor_sync.py, distributed_sync.py)
and the protocol every path runs under across trainer ranks. Each path sends HF-named tensors (per-expert
layout, what SGLang's Qwen3-MoE loader maps; each Megatron bucket converted on its own) and stops the update
with a server's message when it refuses a bucket.

Under torch.distributed with several ranks only rank 0 receives the stream's buckets and sends
(`weights_needed`); every rank iterates its stream to the end (its collectives), then rank 0 broadcasts the
outcome: nobody generates with old weights, and a failure on rank 0 raises on every rank (SGLangServerError
naming it) instead of leaving the others waiting."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional

import torch

from moe.collective import run_on_rank0

from ..base import drain
from .client import SGLangClient, server_message
from .config import SGLangEngineConfig
from .disk_sync import CheckpointWriter, DiskSync
from .distributed_sync import DistributedSync, check_distributed_available
from .errors import SGLangConfigError, SGLangServerError
from .schema import SGLangResponseError
from .server import SGLangServers
from .tensor_sync import TensorSync, tensor_sync_codec
from .versions import WeightVersion


def check_weight_sync_prerequisites(cfg: SGLangEngineConfig, ipc_codec):
    """Everything weight_sync needs that can be checked before any server is contacted; fails naming it.
    -> the IPC codec of a tensor sync (None for the other paths)."""
    if cfg.weight_sync == "tensor":
        return tensor_sync_codec(cfg, ipc_codec)
    if cfg.weight_sync == "distributed":
        check_distributed_available(cfg)
    return None


def server_tp_size(client: SGLangClient, url: str, weight_sync: str) -> int:
    """The server's TP size (ranks in the weight-update group; IPC payloads per bucket), from /get_server_info."""
    status, info = client.get(url, "/get_server_info")
    if status != 200 or not isinstance(info, dict):
        raise SGLangServerError(f"weight_sync = {weight_sync!r} needs the server's parallel layout, but "
                                f"GET {url}/get_server_info answered {status} {server_message(info)}")
    tp = info.get("tp_size")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise SGLangResponseError(f"{url}/get_server_info has no valid tp_size (got {tp!r})")
    dp, pp = info.get("dp_size", 1), info.get("pp_size", 1)
    dp_ok = dp == 1 or (weight_sync == "tensor" and info.get("enable_dp_attention") is True)
    if not dp_ok or pp != 1:
        raise SGLangConfigError(
            f"sglang.weight_sync = {weight_sync!r}: the server at {url} runs dp_size={dp}, "
            f"pp_size={pp}; SGLang takes in-memory weight updates with dp_size 1 (tensor: or dp attention) and "
            "this engine with pp_size 1; use weight_sync = 'disk'")
    return tp


class WeightSync:
    """The path of `config.weight_sync` over `servers` (an in-memory path asks each server's TP size first),
    run on rank 0 under the protocol above; also writes checkpoint folders on request (write_hf_checkpoint)."""

    def __init__(self, config: SGLangEngineConfig, arch, servers: SGLangServers, codec=None) -> None:
        self.config, self.servers = config, servers
        self.version = WeightVersion()
        self.checkpoints = CheckpointWriter(config.sync_dir, arch, self.version)
        client = servers.client
        if config.weight_sync == "disk":
            self.path = DiskSync(config, client, self.checkpoints)
            return
        tp_sizes = [server_tp_size(client, url, config.weight_sync) for url in client.urls]
        if config.weight_sync == "tensor":
            self.path = TensorSync(config, arch, client, codec, tp_sizes, self.version)
        else:
            self.path = DistributedSync(config, arch, client, tp_sizes, self.version)

    @staticmethod
    def weights_needed(generates: bool) -> bool:
        """Only rank 0 (or the only process) sends to the servers, whichever ranks generate."""
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def update(self, buckets: Iterable[Dict[str, torch.Tensor]]) -> None:
        """Every rank calls this with its stream of Megatron buckets. Rank 0 (or the only process) sends them as
        they come, then broadcasts the outcome over the default group (None, or its error), so no rank generates
        before the servers hold the new weights, and a failure on rank 0 raises on every rank (SGLangServerError
        on the others, naming rank 0's error) instead of leaving them waiting. The other ranks (which receive
        empty buckets: `weights_needed`) and rank 0 after a failure iterate the stream to its end first, so its
        collectives complete everywhere."""
        import torch.distributed as dist

        count = len(buckets) if hasattr(buckets, "__len__") else None
        it = iter(buckets)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() != 0:
            drain(it)

        def send():
            try:
                self._send(it, count)
            finally:
                drain(it)

        run_on_rank0("the weight update", send, peer_error=SGLangServerError)

    def _send(self, buckets: Iterator[Dict[str, torch.Tensor]], count: Optional[int]) -> None:
        self.servers.resume_memory()  # the weights must be on the GPU to be loaded
        self.path.send(buckets, count)

    def write_hf_checkpoint(self, buckets: List[Dict[str, torch.Tensor]], max_shard_bytes: int) -> Path:
        return self.checkpoints.write(buckets, max_shard_bytes)

    def close(self) -> None:
        self.path.close()
