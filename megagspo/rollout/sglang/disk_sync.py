"""Weight sync through the file system (`weight_sync = "disk"`): the stream of Megatron buckets written as an HF
checkpoint (per-expert layout, safetensors shards of at most `bucket_bytes`) in a fresh folder under `sync_dir`,
then /update_weights_from_disk on every server and /flush_cache, and the previous folder removed. Works wherever
the servers can read `sync_dir`; needs neither CUDA nor the sglang package here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from moe.hf_checkpoint import HFFolderWriter

from .client import SGLangClient, server_message
from .config import SGLangEngineConfig
from .errors import SGLangServerError
from .versions import WeightVersion


class CheckpointWriter:
    """HF checkpoints in numbered folders `<sync_dir>/weights-v<k>`, k taken from the shared WeightVersion."""

    def __init__(self, sync_dir: Optional[str], arch, version: WeightVersion) -> None:
        self.sync_dir, self.arch, self.version = sync_dir, arch, version

    def write(self, buckets, max_shard_bytes: int) -> Path:
        """An HF checkpoint from a stream of Megatron buckets through moe.hf_checkpoint's HF folder writer
        (per-expert layout, each tensor in its own dtype; a shard is written once full, so this holds one shard
        and one bucket), under a temporary name renamed once the stream held every tensor."""
        self.version.value += 1
        path = Path(self.sync_dir) / f"weights-v{self.version.value:06d}"
        if path.exists():
            shutil.rmtree(path)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            writer = HFFolderWriter(tmp, self.arch, max_shard_bytes=max_shard_bytes)
            for bucket in buckets:
                writer.add(bucket)
                del bucket
            writer.finish()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        os.replace(tmp, path)
        return path


class DiskSync:
    """Sends each update as a checkpoint folder; keeps the folder the servers hold until the next one loaded."""

    def __init__(self, config: SGLangEngineConfig, client: SGLangClient, checkpoints: CheckpointWriter) -> None:
        self.config, self.client, self.checkpoints = config, client, checkpoints
        self._current_dir: Optional[Path] = None

    def send(self, buckets, count: Optional[int]) -> None:
        """count (the stream's length, when known) is not needed: the folder is complete when the stream ends."""
        path = self.checkpoints.write(buckets, self.config.bucket_bytes)
        body = {"model_path": str(path), "weight_version": str(self.checkpoints.version.value)}
        if self.config.load_format:
            body["load_format"] = self.config.load_format
        try:
            for url in self.client.urls:
                status, payload = self.client.post(url, "/update_weights_from_disk", body)
                if status != 200 or not isinstance(payload, dict) or payload.get("success") is not True:
                    raise SGLangServerError(f"update_weights_from_disk of {path} failed on {url} (HTTP {status}): "
                                            f"{server_message(payload)}")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # servers keep (and may still read) the previous folder
            raise
        self.client.post_all("/flush_cache", None, "flush_cache")
        previous, self._current_dir = self._current_dir, path
        if previous is not None and previous != path:
            shutil.rmtree(previous, ignore_errors=True)

    def close(self) -> None:
        pass
