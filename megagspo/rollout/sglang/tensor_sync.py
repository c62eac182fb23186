"""Weight sync by CUDA IPC (`weight_sync = "tensor"`, colocated: the servers on this host): each server bucket
moved to this process's GPU, serialized with SGLang's MultiprocessingSerializer (CUDA IPC handles, base64; one
copy per server TP rank) and posted to /update_weights_from_tensor, as a FlattenedTensorBucket
("flattened_bucket") or a [(name, tensor)] list ("named_tensors"). Only the last bucket flushes the cache and
carries the new weight_version. Needs CUDA and the sglang package in this process (SGLangIpcCodec); tests pass a
codec of their own."""

from __future__ import annotations

import socket
import urllib.parse
from typing import List, Optional, Tuple

import torch

from moe import cuda_calls

from .buckets import bucket_label, server_buckets
from .client import SGLangClient
from .config import SYNC_DTYPES, SGLangEngineConfig
from .errors import SGLangConfigError, SGLangServerError, SGLangUnavailableError
from .schema import update_weights_from_tensor_json, weight_update_result
from .versions import WeightVersion


class SGLangIpcCodec:
    """What /update_weights_from_tensor carries, made with SGLang's own classes (the server unpickles with an
    allow-list, and FlattenedTensorBucket's byte layout changed between versions, so only the server's version
    fits): buckets on this process's current GPU, FlattenedTensorBucket, MultiprocessingSerializer with torch's
    CUDA reductions patched to name devices by UUID. Needs CUDA and the sglang package (same host as the servers).

    A codec is any object with `device`, flatten(pairs) -> dict, serialize(obj) -> base64 str, release()."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise SGLangUnavailableError("sglang.weight_sync = 'tensor' shares CUDA tensors with the servers "
                                         "(CUDA IPC), but CUDA is not available here; use weight_sync = 'disk' or "
                                         "'distributed'")
        try:
            from sglang.srt.utils import MultiprocessingSerializer
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
            try:
                from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
            except ImportError:  # sglang <= 0.5.x
                from sglang.srt.patch_torch import monkey_patch_torch_reductions
        except ImportError as exc:
            raise SGLangUnavailableError(
                f"sglang.weight_sync = 'tensor' serializes with SGLang's own MultiprocessingSerializer and "
                f"FlattenedTensorBucket, which are not importable here ({exc}): `pip install sglang` (the servers' "
                "version) in the trainer's environment, or use weight_sync = 'disk' or 'distributed'") from None
        monkey_patch_torch_reductions()
        self._serializer, self._bucket = MultiprocessingSerializer, FlattenedTensorBucket
        self.device = torch.device("cuda", cuda_calls.current_cuda_device())

    def flatten(self, pairs: List[Tuple[str, torch.Tensor]]) -> dict:
        bucket = self._bucket(named_tensors=pairs)
        return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}

    def serialize(self, obj) -> str:
        return self._serializer.serialize(obj, output_str=True)

    def release(self) -> None:
        cuda_calls.cuda_ipc_collect()  # free the blocks whose IPC handles the servers have closed


def _is_local_host(host: str) -> bool:
    """True when `host` names this machine (loopback, or an address a socket here can bind)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        if addr[0].startswith("127.") or addr[0] == "::1":
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def tensor_sync_codec(cfg: SGLangEngineConfig, ipc_codec):
    """The codec of a tensor sync, checked before any server is contacted: every server on this host (CUDA IPC
    handles do not cross hosts), then `ipc_codec` or SGLangIpcCodec() (which checks CUDA and sglang)."""
    hosts = [cfg.launch.host] if cfg.launch is not None else [urllib.parse.urlsplit(u).hostname for u in cfg.urls]
    remote = [h for h in hosts if not _is_local_host(h)]
    if remote:
        raise SGLangConfigError(
            f"sglang.weight_sync = 'tensor' passes CUDA IPC handles, which only work between processes on one "
            f"host, but {', '.join(remote)} is not this host; use weight_sync = 'distributed' (NCCL) or 'disk'")
    return ipc_codec if ipc_codec is not None else SGLangIpcCodec()


class TensorSync:
    """Posts each server bucket (buckets.server_buckets) to every server, one serialization per TP rank
    (`tp_sizes[i]` ranks on server i): each rank opens, and releases, its own IPC handles."""

    def __init__(self, config: SGLangEngineConfig, arch, client: SGLangClient, codec, tp_sizes: List[int],
                 version: WeightVersion) -> None:
        self.config, self.arch, self.client, self.codec = config, arch, client, codec
        self.tp_sizes, self.version = tp_sizes, version
        self._sync_dtype = SYNC_DTYPES[config.sync_dtype] if config.sync_dtype else None

    def send(self, buckets, count: Optional[int]) -> None:
        codec, flattened = self.codec, self.config.ipc_format == "flattened_bucket"
        version = str(self.version.value + 1)
        for b, n, pairs, last in server_buckets(buckets, count, self.arch, self.config.bucket_bytes,
                                                self._sync_dtype):
            pairs = [(name, t.to(codec.device).contiguous()) for name, t in pairs]
            payload = codec.flatten(pairs) if flattened else pairs
            for url, tp in zip(self.client.urls, self.tp_sizes):
                # one serialization per TP rank: each rank opens (and releases) its own IPC handles
                body = update_weights_from_tensor_json([codec.serialize(payload) for _ in range(tp)],
                                                       "flattened_bucket" if flattened else None,
                                                       flush_cache=last, weight_version=version if last else None)
                status, answer = self.client.post(url, "/update_weights_from_tensor", body)
                ok, message = weight_update_result(status, answer)
                if not ok:
                    raise SGLangServerError(
                        f"update_weights_from_tensor failed on {url} for {bucket_label(b, n, pairs)} "
                        f"(HTTP {status}): {message}; the server's weights are partly updated")
            del payload, pairs
            codec.release()
        self.version.value += 1

    def close(self) -> None:
        pass
