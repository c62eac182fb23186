"""Weight sync over a process group (`weight_sync = "distributed"`, servers on any host): at the first update
this process (the trainer's rank 0) and every server TP rank form a group (/init_weights_update_group, rank 0 =
the trainer); then each server bucket is announced by /update_weights_from_distributed (names, dtypes, shapes)
while rank 0 broadcasts its tensors. SGLang's group and broadcast endpoints answer only once the trainer's side
has run too, so every POST runs beside the local side (`posts_beside`). A group that broke stays broken: later
updates refuse at once instead of hanging in a half-formed group."""

from __future__ import annotations

import socket
import threading
import time
import urllib.parse
from typing import List, Optional

import torch

from moe import cuda_calls
from moe.parallel import free_port

from ..weight_sync import broadcast_bucket, init_weight_update_group
from .buckets import bucket_label, server_buckets
from .client import SGLangClient
from .config import SYNC_DTYPES, SGLangEngineConfig
from .errors import SGLangServerError, SGLangUnavailableError
from .schema import (bucket_metadata, destroy_weights_update_group_json, init_weights_update_group_json,
                     update_weights_from_distributed_json, weight_update_result)
from .versions import WeightVersion


def check_distributed_available(cfg: SGLangEngineConfig) -> None:
    """What a distributed sync needs here, checked before any server is contacted: torch.distributed, and for
    nccl CUDA with NCCL."""
    import torch.distributed as dist

    if not dist.is_available():
        raise SGLangUnavailableError("sglang.weight_sync = 'distributed' needs torch.distributed, which this "
                                     "torch build lacks")
    if cfg.dist_backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise SGLangUnavailableError(
            "sglang.weight_sync = 'distributed' with dist_backend = 'nccl' broadcasts from this process's GPU, "
            "but CUDA/NCCL is not available here; use weight_sync = 'disk' (or dist_backend = 'gloo')")


def _address_towards(url: str) -> str:
    """This host's address on the interface that routes to `url` (no packet is sent)."""
    parts = urllib.parse.urlsplit(url)
    family, _, _, _, addr = socket.getaddrinfo(parts.hostname, parts.port or 80, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def posts_beside(client: SGLangClient, path: str, bodies: List[dict], local, what: str):
    """POST bodies[i] to server i and run local() here, all at once (SGLang's group and broadcast endpoints
    answer only when the trainer's side has run too); the first failure on either side raises at once, and
    nothing answering within the client's timeout raises naming the servers still silent. -> local()'s value."""
    urls = client.urls
    answers: List = [None] * len(urls)
    mine: dict = {}

    def post(i: int) -> None:
        try:
            answers[i] = client.post(urls[i], path, bodies[i])
        except BaseException as exc:  # noqa: BLE001 (re-raised by the waiting thread)
            answers[i] = exc

    def run_local() -> None:
        try:
            mine["value"] = local()
        except BaseException as exc:  # noqa: BLE001
            mine["error"] = exc

    threads = [threading.Thread(target=post, args=(i,), daemon=True) for i in range(len(urls))]
    threads.append(threading.Thread(target=run_local, daemon=True))
    for t in threads:
        t.start()
    deadline = time.monotonic() + client.timeout_s
    while True:
        for url, answer in zip(urls, answers):
            if isinstance(answer, BaseException):
                raise answer
            if answer is not None:
                ok, message = weight_update_result(*answer)
                if not ok:
                    raise SGLangServerError(f"{what} failed on {url} (HTTP {answer[0]}): {message}")
        if "error" in mine:
            raise mine["error"]
        if all(a is not None for a in answers) and not threads[-1].is_alive():
            return mine.get("value")
        if time.monotonic() > deadline:
            waiting = [u for u, a in zip(urls, answers) if a is None]
            done = not threads[-1].is_alive()
            raise SGLangServerError(f"{what} timed out after {client.timeout_s:.0f} s (no answer from "
                                    f"{', '.join(waiting) or 'none'}; trainer side done: {done})")
        time.sleep(0.01)


class DistributedSync:
    """The trainer's side of SGLang's weight-update group: formed at the first update, server i's TP ranks at
    1 + sum(tp of the servers before it) + r; destroyed (best effort) by close()."""

    def __init__(self, config: SGLangEngineConfig, arch, client: SGLangClient, tp_sizes: List[int],
                 version: WeightVersion) -> None:
        self.config, self.arch, self.client = config, arch, client
        self.tp_sizes, self.version = tp_sizes, version
        self._sync_dtype = SYNC_DTYPES[config.sync_dtype] if config.sync_dtype else None
        self._group = None            # the weight-update process group, formed at the first update
        self._group_failed: Optional[str] = None

    def send(self, buckets, count: Optional[int]) -> None:
        if self._group_failed:
            raise SGLangServerError(f"the weight-update process group broke in an earlier update "
                                    f"({self._group_failed}); restart the run (the servers' weights are partly "
                                    "updated)")
        self._ensure_group()
        device = torch.device("cuda", cuda_calls.current_cuda_device()) if self.config.dist_backend == "nccl" \
            else torch.device("cpu")
        version = str(self.version.value + 1)
        group = self._group
        for b, n, pairs, last in server_buckets(buckets, count, self.arch, self.config.bucket_bytes,
                                                self._sync_dtype):
            pairs = [(name, t.to(device).contiguous()) for name, t in pairs]
            names, dtypes, shapes = bucket_metadata(pairs)
            body = update_weights_from_distributed_json(names, dtypes, shapes, self.config.group_name,
                                                        flush_cache=last, weight_version=version if last else None)

            def broadcast(tensors=[t for _, t in pairs]):
                if device.type == "cuda":
                    cuda_calls.set_cuda_device(device)
                for work in broadcast_bucket(tensors, group):
                    work.wait()

            try:
                posts_beside(self.client, "/update_weights_from_distributed", [body] * len(self.client.urls),
                             broadcast, f"update_weights_from_distributed of {bucket_label(b, n, pairs)}")
            except BaseException as exc:
                self._group_failed = str(exc)
                raise
        self.version.value += 1

    def _ensure_group(self) -> None:
        """Form the weight-update group: POST /init_weights_update_group to every server (each blocks until the group
        exists) while this process joins as rank 0; server i's TP ranks get 1 + sum(tp of servers before it) + r."""
        if self._group is not None:
            return
        cfg, urls = self.config, self.client.urls
        address = cfg.master_address or _address_towards(urls[0])
        port = cfg.master_port or free_port(address)
        world = 1 + sum(self.tp_sizes)
        offsets = [1 + sum(self.tp_sizes[:i]) for i in range(len(urls))]
        bodies = [init_weights_update_group_json(address, port, off, world, cfg.group_name, cfg.dist_backend)
                  for off in offsets]
        try:
            self._group = posts_beside(
                self.client, "/init_weights_update_group", bodies,
                lambda: init_weight_update_group(address, port, 0, world, cfg.group_name, cfg.dist_backend,
                                                 cfg.timeout_s),
                f"init_weights_update_group (rendezvous at {address}:{port}, {world} ranks)")
        except BaseException as exc:
            self._group_failed = str(exc)
            raise

    def close(self) -> None:
        """Leave the group (best effort: the servers may already be gone)."""
        if self._group is None:
            return
        group, self._group = self._group, None
        for url in self.client.urls:
            try:
                self.client.post(url, "/destroy_weights_update_group",
                                 destroy_weights_update_group_json(self.config.group_name))
            except SGLangServerError:
                pass
        try:
            import torch.distributed as dist

            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            pass
