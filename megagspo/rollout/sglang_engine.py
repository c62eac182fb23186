"""The SGLang rollout engine: batched `/generate` over SGLang's native HTTP API, weights synced from Megatron.

Attach to running servers (`SGLangEngineConfig(urls=[...])`) or let the engine start and own them
(`SGLangEngineConfig(launch=SGLangLaunchConfig(model_path=...))`, `python -m sglang.launch_server` children).
Only the HTTP client (stdlib urllib) is needed to attach; launching needs the `sglang` package on a GPU host.

generate(prompts, n, sampling): the N*G requests go out prompt-major (row i*G+g = sample g of prompt i), in
chunks of `max_batch` spread over the servers; tokens and log-probs come from meta_info.output_token_logprobs
(the eos token kept: stop_token_ids=[eos], no_stop_trim); routes (R3) from meta_info.routed_experts, laid
out as RolloutOutput.routes_RPLyK (positions prompt + response[:-1], MoE layers only, -1 where not fed).
With R3 on, a response without routes, or with routes of the wrong size, raises SGLangResponseError naming the
sample: training never goes on without replay.

generate(..., switch=WeightSwitch) (partial rollouts) aborts and resumes, as SGLang-based RL trainers do: while a
round of /generate requests is in flight, a watcher thread asks switch.pending() every `partial_poll_s` (from
that thread: pending must be thread-safe and cheap); when newer weights are pending it POSTs /abort_request
{"abort_all": true} to every server, whose in-flight requests then return at their next step with finish_reason
abort and the tokens so far. Once the round has returned (nothing in flight), switch.apply(engine) loads the new
weights and the unfinished samples go out again as prompt + tokens so far with max_new_tokens = what is left,
until none is aborted. version_RL tags every token with the version of its round; routes come from each
sample's last request (its prefill re-read the whole prefix). A refused abort, or a sample aborted
`partial_max_stalls` times in a row without a new token, raises naming the samples. switch None: one round, no
watcher, version_RL None.

update_weights_from_buckets(stream of Megatron buckets; update_weights(full state) is a stream of one) sends
HF-named tensors (per-expert layout, what SGLang's Qwen3-MoE loader maps; each bucket converted on its own,
weight_sync.hf_named_tensors_of_bucket) in one of three ways (`weight_sync`):
  "disk"         an HF checkpoint in a fresh folder under `sync_dir`, written shard by shard as the buckets arrive
                 (shards of at most `bucket_bytes`), /update_weights_from_disk, /flush_cache, the previous folder
                 removed. Works wherever the servers can read `sync_dir`.
  "tensor"       same host (colocated): buckets of at most `bucket_bytes` moved to this process's GPU, serialized
                 with SGLang's MultiprocessingSerializer (CUDA IPC handles, base64; one copy per server TP rank)
                 and posted to /update_weights_from_tensor, as a FlattenedTensorBucket ("flattened_bucket") or a
                 [(name, tensor)] list ("named_tensors"). Needs CUDA and the sglang package in this process.
  "distributed"  any host: at the first update the engine (trainer rank 0) and every server TP rank form a
                 process group (/init_weights_update_group, rank 0 = trainer); each bucket is announced by
                 /update_weights_from_distributed (names, dtypes, shapes) while rank 0 broadcasts its tensors.
For tensor / distributed the incoming tensors are re-cut into buckets of at most `bucket_bytes` in arrival
order (`_sync_buckets`): a bucket is sent once it is full, and the last one is held until the stream ends. The
cache is flushed only with the last bucket (flush_cache), which also carries the new weight_version. A server
that answers a bucket with success false stops the update with its message. Under torch.distributed with
several ranks only rank 0 receives the stream's buckets and sends (`weights_needed`); every rank iterates its
stream to the end (its collectives), then rank 0 broadcasts the outcome: nobody generates with old weights,
and a failure on rank 0 raises on every rank (SGLangServerError naming it) instead of leaving the others
waiting.

Legend as in base.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from moe import cuda_calls
from moe.collective import run_on_rank0
from moe.hf_checkpoint import PER_EXPERT, HFFolderWriter, hf_tensor_shapes
from moe.parallel import free_port

from .base import RolloutEngine, RolloutOutput, SamplingParams, WeightSwitch, drain, register_engine
from .sglang_schema import (ParsedSample, SGLangResponseError, abort_request_json, destroy_weights_update_group_json,
                            generate_request_json, init_weights_update_group_json, parse_generate_item,
                            sampling_params_json,
                            update_weights_from_distributed_json, update_weights_from_tensor_json,
                            weight_update_result)
from .weight_sync import (broadcast_bucket, bucket_metadata, hf_named_tensors_of_bucket, init_weight_update_group,
                          plan_buckets)

SGLANG_MISSING = ("launching SGLang servers needs the `sglang` package, which is not importable here: "
                  "`pip install sglang` on a GPU host, or attach to running servers with "
                  "SGLangEngineConfig(urls=[...])")


class SGLangConfigError(ValueError):
    pass


class SGLangServerError(RuntimeError):
    """A server that cannot be reached, or that answered an endpoint with an error."""


class SGLangUnavailableError(RuntimeError):
    """Something this configuration needs is missing here: the sglang package, CUDA, NCCL."""


WEIGHT_SYNC_MODES = ("disk", "tensor", "distributed")
IPC_FORMATS = ("flattened_bucket", "named_tensors")   # load_format "flattened_bucket" | None (list of pairs)
SYNC_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DIST_BACKENDS = ("nccl", "gloo")


def _fail(field_name: str, message: str):
    raise SGLangConfigError(f"sglang.{field_name}: {message}")


@dataclass
class SGLangLaunchConfig:
    model_path: str
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    num_servers: int = 1             # servers on ports port, port+1, ...; each gets tp_size GPUs (base_gpu_id)
    mem_fraction_static: Optional[float] = None
    extra_args: Tuple[str, ...] = ()
    startup_timeout_s: float = 900.0
    log_dir: Optional[str] = None    # child stdout/stderr go to <log_dir>/sglang-<port>.log (else inherited)

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            _fail("launch.model_path", f"must be a non-empty path, got {self.model_path!r}")
        for name in ("tp_size", "num_servers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(f"launch.{name}", f"must be a positive integer, got {v!r}")
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535 - self.num_servers:
            _fail("launch.port", f"must be a TCP port, got {self.port!r}")
        if self.mem_fraction_static is not None and not 0.0 < float(self.mem_fraction_static) < 1.0:
            _fail("launch.mem_fraction_static", f"must lie in (0, 1), got {self.mem_fraction_static!r}")
        if isinstance(self.extra_args, str) or not all(isinstance(a, str) for a in self.extra_args):
            _fail("launch.extra_args", f"must be a list of strings, got {self.extra_args!r}")
        self.extra_args = tuple(self.extra_args)
        if not self.startup_timeout_s > 0:
            _fail("launch.startup_timeout_s", f"must be positive, got {self.startup_timeout_s!r}")


@dataclass
class SGLangEngineConfig:
    urls: List[str] = field(default_factory=list)   # base URLs of running servers, e.g. http://10.0.0.5:30000
    launch: Optional[SGLangLaunchConfig] = None     # or: servers the engine starts and owns
    timeout_s: float = 600.0                        # per HTTP request
    routing_replay: str = "off"                     # off | r3 (return_routed_experts, strictly checked)
    weight_sync: str = "disk"                       # disk | tensor (same host, CUDA IPC) | distributed (NCCL)
    sync_dir: Optional[str] = None                  # where "disk" writes HF checkpoints (must be visible to servers)
    load_format: Optional[str] = None               # passed to /update_weights_from_disk when set ("disk" only)
    bucket_bytes: int = 512 * 2**20                 # tensor / distributed: bytes per bucket (a bigger tensor: alone);
                                                    #   disk: bytes per safetensors shard of a sync
    sync_dtype: Optional[str] = None                # tensor / distributed: cast to bfloat16 | float16 | float32 first
    ipc_format: str = "flattened_bucket"            # tensor: flattened_bucket | named_tensors
    master_address: Optional[str] = None            # distributed: this host's address as the servers reach it
                                                    #   (default: the interface that routes to the first server)
    master_port: int = 0                            # distributed: rendezvous port on this host (0: a free one)
    group_name: str = "megagspo_weight_sync"        # distributed: name of the weight-update process group
    dist_backend: str = "nccl"                      # distributed: nccl (GPU) | gloo (CPU tensors; tested on CPU)
    colocate: bool = False                          # release / resume GPU memory around training
    max_batch: int = 256                            # sequences per /generate request
    original_logprob: bool = True                   # servers run with SGLANG_RETURN_ORIGINAL_LOGPROB=1
    health_check: bool = True                       # GET /health of every server when attaching
    partial_poll_s: float = 0.02                    # partial rollouts: how often the watcher asks switch.pending()
    partial_max_stalls: int = 8                     # partial rollouts: aborts in a row without a new token that
                                                    #   make a sample fail (instead of resuming forever)

    def __post_init__(self) -> None:
        if isinstance(self.launch, dict):
            self.launch = SGLangLaunchConfig(**self.launch)
        if isinstance(self.urls, str):
            self.urls = [self.urls]
        self.urls = [u.rstrip("/") for u in self.urls]
        if bool(self.urls) == (self.launch is not None):
            _fail("urls", "give exactly one of `urls` (attach to running servers) and `launch` (start them)")
        for u in self.urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                _fail("urls", f"{u!r} is not an http(s) base URL")
        if not self.timeout_s > 0:
            _fail("timeout_s", f"must be positive, got {self.timeout_s!r}")
        if self.routing_replay not in ("off", "r3"):
            _fail("routing_replay", f"must be 'off' or 'r3', got {self.routing_replay!r}")
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            _fail("weight_sync", f"must be one of {', '.join(WEIGHT_SYNC_MODES)}; got {self.weight_sync!r}")
        if self.weight_sync == "disk" and not self.sync_dir:
            _fail("sync_dir", "weight_sync = 'disk' needs a folder the servers can read")
        if self.load_format is not None and self.weight_sync != "disk":
            _fail("load_format", f"applies to weight_sync = 'disk' only (tensor sync picks it from ipc_format); "
                                 f"got {self.load_format!r} with weight_sync = {self.weight_sync!r}")
        if not isinstance(self.bucket_bytes, int) or isinstance(self.bucket_bytes, bool) or self.bucket_bytes < 1:
            _fail("bucket_bytes", f"must be a positive integer (bytes), got {self.bucket_bytes!r}")
        if self.sync_dtype is not None and self.sync_dtype not in SYNC_DTYPES:
            _fail("sync_dtype", f"must be one of {', '.join(SYNC_DTYPES)} or null; got {self.sync_dtype!r}")
        if self.ipc_format not in IPC_FORMATS:
            _fail("ipc_format", f"must be one of {', '.join(IPC_FORMATS)}; got {self.ipc_format!r}")
        if self.dist_backend not in DIST_BACKENDS:
            _fail("dist_backend", f"must be one of {', '.join(DIST_BACKENDS)}; got {self.dist_backend!r}")
        if not isinstance(self.master_port, int) or isinstance(self.master_port, bool) \
                or not 0 <= self.master_port <= 65535:
            _fail("master_port", f"must be a TCP port or 0 (pick a free one), got {self.master_port!r}")
        if self.master_address is not None and (not isinstance(self.master_address, str) or not self.master_address):
            _fail("master_address", f"must be a host name or address, got {self.master_address!r}")
        if not isinstance(self.group_name, str) or not self.group_name:
            _fail("group_name", f"must be a non-empty string, got {self.group_name!r}")
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) or self.max_batch < 1:
            _fail("max_batch", f"must be a positive integer, got {self.max_batch!r}")
        if isinstance(self.partial_poll_s, bool) or not isinstance(self.partial_poll_s, (int, float)) \
                or not 0 < self.partial_poll_s <= 1:
            _fail("partial_poll_s", f"must be in (0, 1] seconds, got {self.partial_poll_s!r}")
        if not isinstance(self.partial_max_stalls, int) or isinstance(self.partial_max_stalls, bool) \
                or self.partial_max_stalls < 1:
            _fail("partial_max_stalls", f"must be a positive integer, got {self.partial_max_stalls!r}")


# ------------------------------------------------------------------------------------------------ HTTP
def _http(method: str, url: str, body: Optional[dict], timeout: float):
    """(status, parsed JSON or text) for one request; SGLangServerError when the server cannot be reached."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SGLangServerError(f"cannot reach SGLang server at {url}: {reason}") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        return status, json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return status, text


def _server_message(payload) -> str:
    if isinstance(payload, dict):
        if isinstance(payload.get("error"), dict) and "message" in payload["error"]:
            return str(payload["error"]["message"])
        if "message" in payload:
            return str(payload["message"])
    return str(payload)[:500]


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


def _address_towards(url: str) -> str:
    """This host's address on the interface that routes to `url` (no packet is sent)."""
    parts = urllib.parse.urlsplit(url)
    family, _, _, _, addr = socket.getaddrinfo(parts.hostname, parts.port or 80, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


class SGLangIpcCodec:
    """What /update_weights_from_tensor carries, made with SGLang's own classes (the server unpickles with an
    allow-list, and FlattenedTensorBucket's byte layout changed between versions, so only the server's version
    fits): buckets on this process's current GPU, FlattenedTensorBucket, MultiprocessingSerializer with torch's
    CUDA reductions patched to name devices by UUID. Needs CUDA and the sglang package (same host as the servers).

    A codec is any object with `device`, flatten(pairs) -> dict, serialize(obj) -> base64 str, release()."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise SGLangUnavailableError("sglang.weight_sync = 'tensor' shares CUDA tensors with the servers (CUDA IPC), "
                                         "but CUDA is not available here; use weight_sync = 'disk' or 'distributed'")
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


@register_engine("sglang")
class SGLangEngine(RolloutEngine):
    def __init__(self, arch, tokenizer, record_routes: Optional[bool] = None,
                 config: Optional[SGLangEngineConfig] = None, ipc_codec=None) -> None:
        """ipc_codec: weight_sync = 'tensor' only; default SGLangIpcCodec() (CUDA + sglang). Another codec (e.g. one
        that pickles CPU tensors, as the tests use) replaces CUDA IPC explicitly."""
        if config is None:
            raise SGLangConfigError("rollout.engine = 'sglang' needs an SGLangEngineConfig (urls of running servers "
                                    "or launch settings): SGLangEngine(arch, tokenizer, config=SGLangEngineConfig(...))")
        if isinstance(config, dict):
            config = SGLangEngineConfig(**config)
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
        self.moe_layers = [i for i, is_moe in enumerate(arch.moe_layer_pattern) if is_moe]
        self.top_k = arch.num_experts_per_tok
        self._procs: List[subprocess.Popen] = []
        self._logs = []
        self._released = False
        self._version = 0
        self._current_dir: Optional[Path] = None
        self._sync_dtype = SYNC_DTYPES[config.sync_dtype] if config.sync_dtype else None
        self._codec = None
        self._group = None            # distributed: the weight-update process group, formed at the first update
        self._group_failed: Optional[str] = None
        self._tp_sizes: List[int] = []
        self._check_weight_sync_prerequisites(ipc_codec)
        if config.launch is not None:
            self.urls = self._launch(config.launch)
        else:
            self.urls = list(config.urls)
            if config.health_check:
                for url in self.urls:
                    self._check_health(url)
            if self.want_routes:
                self._check_routes_enabled()
        if config.weight_sync in ("tensor", "distributed"):
            self._tp_sizes = [self._server_tp_size(url) for url in self.urls]

    def _check_weight_sync_prerequisites(self, ipc_codec) -> None:
        """Everything weight_sync needs that can be checked before any server is contacted; fails naming it."""
        cfg = self.config
        if cfg.weight_sync == "tensor":
            hosts = [cfg.launch.host] if cfg.launch is not None else [urllib.parse.urlsplit(u).hostname for u in cfg.urls]
            remote = [h for h in hosts if not _is_local_host(h)]
            if remote:
                raise SGLangConfigError(
                    f"sglang.weight_sync = 'tensor' passes CUDA IPC handles, which only work between processes on one "
                    f"host, but {', '.join(remote)} is not this host; use weight_sync = 'distributed' (NCCL) or 'disk'")
            self._codec = ipc_codec if ipc_codec is not None else SGLangIpcCodec()
        elif cfg.weight_sync == "distributed":
            import torch.distributed as dist

            if not dist.is_available():
                raise SGLangUnavailableError("sglang.weight_sync = 'distributed' needs torch.distributed, which this "
                                             "torch build lacks")
            if cfg.dist_backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
                raise SGLangUnavailableError(
                    "sglang.weight_sync = 'distributed' with dist_backend = 'nccl' broadcasts from this process's GPU, "
                    "but CUDA/NCCL is not available here; use weight_sync = 'disk' (or dist_backend = 'gloo')")

    def _server_tp_size(self, url: str) -> int:
        """The server's TP size (ranks in the weight-update group; IPC payloads per bucket), from /get_server_info."""
        status, info = _http("GET", url + "/get_server_info", None, self.config.timeout_s)
        if status != 200 or not isinstance(info, dict):
            raise SGLangServerError(f"weight_sync = {self.config.weight_sync!r} needs the server's parallel layout, but "
                                    f"GET {url}/get_server_info answered {status} {_server_message(info)}")
        tp = info.get("tp_size")
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise SGLangResponseError(f"{url}/get_server_info has no valid tp_size (got {tp!r})")
        dp, pp = info.get("dp_size", 1), info.get("pp_size", 1)
        dp_ok = dp == 1 or (self.config.weight_sync == "tensor" and info.get("enable_dp_attention") is True)
        if not dp_ok or pp != 1:
            raise SGLangConfigError(
                f"sglang.weight_sync = {self.config.weight_sync!r}: the server at {url} runs dp_size={dp}, "
                f"pp_size={pp}; SGLang takes in-memory weight updates with dp_size 1 (tensor: or dp attention) and "
                "this engine with pp_size 1; use weight_sync = 'disk'")
        return tp

    # ------------------------------------------------------------------------------------------ servers
    def _launch(self, lc: SGLangLaunchConfig) -> List[str]:
        if importlib.util.find_spec("sglang") is None:
            raise SGLangUnavailableError(SGLANG_MISSING)
        env = dict(os.environ)
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # temperature-1 log-probs, as RolloutOutput.logp_RL wants
        urls = []
        try:
            for s in range(lc.num_servers):
                port = lc.port + s
                cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", lc.model_path,
                       "--tp-size", str(lc.tp_size), "--host", lc.host, "--port", str(port),
                       "--base-gpu-id", str(s * lc.tp_size), "--skip-tokenizer-init"]
                if self.want_routes:
                    cmd.append("--enable-return-routed-experts")
                if self.config.colocate:
                    cmd.append("--enable-memory-saver")
                if lc.mem_fraction_static is not None:
                    cmd += ["--mem-fraction-static", str(lc.mem_fraction_static)]
                cmd += list(lc.extra_args)
                out = None
                if lc.log_dir:
                    os.makedirs(lc.log_dir, exist_ok=True)
                    out = open(os.path.join(lc.log_dir, f"sglang-{port}.log"), "ab")
                    self._logs.append(out)
                # own session: close() signals exactly this child's process group, nothing else
                proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                        start_new_session=True)
                self._procs.append(proc)
                urls.append(f"http://{lc.host}:{port}")
            for url, proc in zip(urls, self._procs):
                self._wait_ready(url, proc, lc.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        return urls

    def _wait_ready(self, url: str, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SGLangServerError(f"SGLang server for {url} exited with code {proc.returncode} while starting "
                                        "(see its log)")
            try:
                status, _ = _http("GET", url + "/health", None, timeout=10)
                if status == 200:
                    return
            except SGLangServerError:
                pass
            time.sleep(2)
        raise SGLangServerError(f"SGLang server at {url} was not healthy after {timeout:.0f} s")

    def _check_health(self, url: str) -> None:
        status, payload = _http("GET", url + "/health", None, self.config.timeout_s)
        if status != 200:
            raise SGLangServerError(f"SGLang server at {url} is not healthy: /health answered {status} "
                                    f"{_server_message(payload)}")

    def _check_routes_enabled(self) -> None:
        for url in self.urls:
            try:
                status, info = _http("GET", url + "/get_server_info", None, self.config.timeout_s)
            except SGLangServerError:
                continue
            if status == 200 and isinstance(info, dict) and info.get("enable_return_routed_experts") is False:
                raise SGLangConfigError(
                    f"routing replay (R3) needs routed experts, but the SGLang server at {url} was started without "
                    "--enable-return-routed-experts")

    def close(self) -> None:
        if self._group is not None:
            group, self._group = self._group, None
            for url in self.urls:  # best effort: the servers may already be gone
                try:
                    self._post(url, "/destroy_weights_update_group",
                               destroy_weights_update_group_json(self.config.group_name))
                except SGLangServerError:
                    pass
            try:
                import torch.distributed as dist

                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):
                pass
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 15)  # the child's own session (start_new_session): only what we started
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        self._procs = []
        for f in self._logs:
            f.close()
        self._logs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ helpers
    def _post(self, url: str, path: str, body: Optional[dict]):
        return _http("POST", url + path, body, self.config.timeout_s)

    def _post_all(self, path: str, body: Optional[dict], what: str) -> List:
        out = []
        for url in self.urls:
            status, payload = self._post(url, path, body)
            ok = status == 200 and not (isinstance(payload, dict) and payload.get("success") is False)
            if not ok:
                raise SGLangServerError(f"{what} failed on {url} (HTTP {status}): {_server_message(payload)}")
            out.append(payload)
        return out

    # ------------------------------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Free the servers' GPU memory (weights and KV cache) for training; needs colocate=True."""
        if not self.config.colocate:
            raise SGLangConfigError("release_memory() needs sglang.colocate = true (servers with --enable-memory-saver)")
        if not self._released:
            self._post_all("/release_memory_occupation", {}, "release_memory_occupation")
            self._released = True

    def resume_memory(self) -> None:
        if self._released:
            self._post_all("/resume_memory_occupation", {}, "resume_memory_occupation")
            self._released = False

    # ------------------------------------------------------------------------------------------ weights
    @staticmethod
    def weights_needed(generates: bool) -> bool:
        """Only rank 0 (or the only process) sends to the servers, whichever ranks generate."""
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def update_weights_from_buckets(self, buckets: Iterable[Dict[str, torch.Tensor]]) -> None:
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
                self._send_weights(it, count)
            finally:
                drain(it)

        run_on_rank0("the weight update", send, peer_error=SGLangServerError)

    def _send_weights(self, buckets: Iterator[Dict[str, torch.Tensor]], count: Optional[int]) -> None:
        self.resume_memory()
        if self.config.weight_sync == "disk":
            self._update_from_disk(buckets)
        elif self.config.weight_sync == "tensor":
            self._update_from_tensor(buckets, count)
        else:
            self._update_from_distributed(buckets, count)

    def _sync_buckets(self, buckets: Iterator[Dict[str, torch.Tensor]], count: Optional[int]):
        """The stream re-cut for tensor / distributed sync: yields (k, n, pairs, last) per server bucket, `pairs`
        the HF (name, tensor) pairs of bucket k (0-based) in arrival order (HF state-dict order within each
        incoming bucket; a whole state dict thus goes out in HF order), under `bucket_bytes` and one dtype per
        bucket (plan_buckets), `n` the number of server buckets once known (None before), `last` on the final
        one. Converted tensors wait in `pending` until a full bucket forms; the last bucket is held until the
        stream ends (or its `count` incoming buckets have come), and sent only when the stream held every HF
        tensor exactly once (else KeyError, before the flush). Holds at most: the incoming bucket, its HF
        tensors, and less than one server bucket carried over."""
        cap = self.config.bucket_bytes
        expected = hf_tensor_shapes(self.arch, PER_EXPERT)
        seen: set = set()
        pending: list = []
        k = 0

        def sizes(pairs):
            return [(n, t.dtype, t.numel() * t.element_size()) for n, t in pairs]

        def check_complete():
            missing = [name for name in expected if name not in seen]
            if missing:
                raise KeyError(f"weight sync: the stream lacked {len(missing)} HF tensor(s), e.g. {missing[:5]} "
                               f"(the servers hold {k} updated bucket(s) of this sync; nothing was flushed)")

        for i, bucket in enumerate(buckets):
            named = hf_named_tensors_of_bucket(bucket, self.arch, self._sync_dtype)
            del bucket
            repeated = [name for name, _ in named if name in seen]
            if repeated:
                raise ValueError(f"weight sync: the stream holds {repeated[:5]} more than once")
            seen.update(name for name, _ in named)
            pending.extend(named)
            del named
            final = count is not None and i == count - 1
            plan = plan_buckets(sizes(pending), cap) if pending else []
            if final:
                check_complete()
            ready = plan if final else plan[:-1]  # the last one may still grow, or be the update's last
            n = k + len(plan) if final else None
            for j, idx in enumerate(ready):
                yield k, n, [pending[x] for x in idx], final and j == len(plan) - 1
                k += 1
            pending = [] if final else [pending[x] for x in plan[-1]] if plan else []
            if final:
                return
        check_complete()
        plan = plan_buckets(sizes(pending), cap) if pending else []
        for j, idx in enumerate(plan):
            yield k, k - j + len(plan), [pending[x] for x in idx], j == len(plan) - 1
            k += 1

    @staticmethod
    def _bucket_label(b: int, n: Optional[int], pairs) -> str:
        of = f"/{n}" if n is not None else ""
        return f"bucket {b + 1}{of} ({pairs[0][0]} .. {pairs[-1][0]}, {len(pairs)} tensors)"

    def _update_from_tensor(self, buckets, count: Optional[int]) -> None:
        codec, flattened = self._codec, self.config.ipc_format == "flattened_bucket"
        version = str(self._version + 1)
        for b, n, pairs, last in self._sync_buckets(buckets, count):
            pairs = [(name, t.to(codec.device).contiguous()) for name, t in pairs]
            payload = codec.flatten(pairs) if flattened else pairs
            for url, tp in zip(self.urls, self._tp_sizes):
                # one serialization per TP rank: each rank opens (and releases) its own IPC handles
                body = update_weights_from_tensor_json([codec.serialize(payload) for _ in range(tp)],
                                                       "flattened_bucket" if flattened else None,
                                                       flush_cache=last, weight_version=version if last else None)
                status, answer = self._post(url, "/update_weights_from_tensor", body)
                ok, message = weight_update_result(status, answer)
                if not ok:
                    raise SGLangServerError(
                        f"update_weights_from_tensor failed on {url} for {self._bucket_label(b, n, pairs)} "
                        f"(HTTP {status}): {message}; the server's weights are partly updated")
            del payload, pairs
            codec.release()
        self._version += 1

    def _update_from_distributed(self, buckets, count: Optional[int]) -> None:
        if self._group_failed:
            raise SGLangServerError(f"the weight-update process group broke in an earlier update ({self._group_failed}); "
                                    "restart the run (the servers' weights are partly updated)")
        self._ensure_group()
        device = torch.device("cuda", cuda_calls.current_cuda_device()) if self.config.dist_backend == "nccl" \
            else torch.device("cpu")
        version = str(self._version + 1)
        group = self._group
        for b, n, pairs, last in self._sync_buckets(buckets, count):
            pairs = [(name, t.to(device).contiguous()) for name, t in pairs]
            names, dtypes, shapes = bucket_metadata(pairs)
            body = update_weights_from_distributed_json(names, dtypes, shapes, self.config.group_name,
                                                        flush_cache=last, weight_version=version if last else None)

            def send(tensors=[t for _, t in pairs]):
                if device.type == "cuda":
                    cuda_calls.set_cuda_device(device)
                for work in broadcast_bucket(tensors, group):
                    work.wait()

            try:
                self._with_posts("/update_weights_from_distributed", [body] * len(self.urls), send,
                                 f"update_weights_from_distributed of {self._bucket_label(b, n, pairs)}")
            except BaseException as exc:
                self._group_failed = str(exc)
                raise
        self._version += 1

    def _ensure_group(self) -> None:
        """Form the weight-update group: POST /init_weights_update_group to every server (each blocks until the group
        exists) while this process joins as rank 0; server i's TP ranks get 1 + sum(tp of servers before it) + r."""
        if self._group is not None:
            return
        cfg = self.config
        address = cfg.master_address or _address_towards(self.urls[0])
        port = cfg.master_port or free_port(address)
        world = 1 + sum(self._tp_sizes)
        offsets = [1 + sum(self._tp_sizes[:i]) for i in range(len(self.urls))]
        bodies = [init_weights_update_group_json(address, port, off, world, cfg.group_name, cfg.dist_backend)
                  for off in offsets]
        try:
            self._group = self._with_posts(
                "/init_weights_update_group", bodies,
                lambda: init_weight_update_group(address, port, 0, world, cfg.group_name, cfg.dist_backend,
                                                 cfg.timeout_s),
                f"init_weights_update_group (rendezvous at {address}:{port}, {world} ranks)")
        except BaseException as exc:
            self._group_failed = str(exc)
            raise

    def _with_posts(self, path: str, bodies: List[dict], local, what: str):
        """POST bodies[i] to server i and run local() here, all at once (SGLang's group and broadcast endpoints
        answer only when the trainer's side has run too); the first failure on either side raises at once."""
        answers: List = [None] * len(self.urls)
        mine: dict = {}

        def post(i: int) -> None:
            try:
                answers[i] = self._post(self.urls[i], path, bodies[i])
            except BaseException as exc:  # noqa: BLE001 (re-raised by the waiting thread)
                answers[i] = exc

        def run_local() -> None:
            try:
                mine["value"] = local()
            except BaseException as exc:  # noqa: BLE001
                mine["error"] = exc

        threads = [threading.Thread(target=post, args=(i,), daemon=True) for i in range(len(self.urls))]
        threads.append(threading.Thread(target=run_local, daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            for url, answer in zip(self.urls, answers):
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
                waiting = [u for u, a in zip(self.urls, answers) if a is None]
                raise SGLangServerError(f"{what} timed out after {self.config.timeout_s:.0f} s (no answer from "
                                        f"{', '.join(waiting) or 'none'}; trainer side done: {not threads[-1].is_alive()})")
            time.sleep(0.01)

    def _update_from_disk(self, buckets) -> None:
        path = self._write_checkpoint(buckets, self.config.bucket_bytes)
        body = {"model_path": str(path), "weight_version": str(self._version)}
        if self.config.load_format:
            body["load_format"] = self.config.load_format
        try:
            for url in self.urls:
                status, payload = self._post(url, "/update_weights_from_disk", body)
                if status != 200 or not isinstance(payload, dict) or payload.get("success") is not True:
                    raise SGLangServerError(f"update_weights_from_disk of {path} failed on {url} (HTTP {status}): "
                                            f"{_server_message(payload)}")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # servers keep (and may still read) the previous folder
            raise
        self._post_all("/flush_cache", None, "flush_cache")
        previous, self._current_dir = self._current_dir, path
        if previous is not None and previous != path:
            shutil.rmtree(previous, ignore_errors=True)

    def write_hf_checkpoint(self, megatron_state: Dict[str, torch.Tensor],
                            max_shard_bytes: int = 5 * 2**30) -> Path:
        """The full Megatron state as an HF checkpoint (safetensors shards + index + config.json) in a new
        folder `<sync_dir>/weights-v<k>`; returns its path."""
        return self._write_checkpoint([megatron_state], max_shard_bytes)

    def _write_checkpoint(self, buckets, max_shard_bytes: int) -> Path:
        """`write_hf_checkpoint` from a stream of Megatron buckets through moe.hf_checkpoint's HF folder writer
        (per-expert layout, each tensor in its own dtype; a shard is written once full, so this holds one shard
        and one bucket), under a temporary name renamed once the stream held every tensor."""
        self._version += 1
        path = Path(self.config.sync_dir) / f"weights-v{self._version:06d}"
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

    # ------------------------------------------------------------------------------------------ rollout
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                 switch: Optional[WeightSwitch] = None) -> RolloutOutput:
        """switch None: one pass of /generate requests. A WeightSwitch: partial rollouts by abort and resume
        (`_generate_partial`), every token tagged with the version that sampled it (version_RL)."""
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
            return self._generate_partial(rows, n, sampling, switch)
        sp = self._sampling_json(sampling, sampling.max_new_tokens)
        parsed = self._generate_round(list(range(len(rows))), rows, sp, sampling.max_new_tokens, n)
        return self._rollout_output(rows, parsed, sampling.max_new_tokens, n)

    def _sampling_json(self, sampling: SamplingParams, max_new: int) -> dict:
        return sampling_params_json(max_new, sampling.temperature, sampling.top_p, sampling.greedy,
                                    list(self.tokenizer.eos_ids))

    def _generate_round(self, samples: List[int], inputs: List[List[int]], sp, max_new: int, n: int,
                        aborting: Optional[threading.Event] = None) -> List[ParsedSample]:
        """One /generate pass: inputs[i] (the input of sample samples[i]) in chunks of max_batch spread over the
        servers; sp one sampling_params dict, or one per input. aborting (partial rollouts): once set, chunks not
        yet sent are not sent (they come back as aborted, empty), and aborted items are partial responses."""
        chunks = [(s, inputs[s:s + self.config.max_batch]) for s in range(0, len(inputs), self.config.max_batch)]
        partial = aborting is not None

        def run(job):
            k, (start, ids) = job
            if partial and aborting.is_set():  # the weights change before these would start: send them after
                return [ParsedSample([], [], "abort") for _ in ids]
            url = self.urls[k % len(self.urls)]
            chunk_sp = sp[start:start + len(ids)] if isinstance(sp, list) else sp
            first, last = samples[start], samples[start + len(ids) - 1]
            status, payload = self._post(url, "/generate", generate_request_json(ids, chunk_sp, self.want_routes))
            if status != 200:
                raise SGLangServerError(f"/generate failed on {url} for samples {first}..{last} "
                                        f"(HTTP {status}): {_server_message(payload)}")
            if not isinstance(payload, list) or len(payload) != len(ids):
                got = len(payload) if isinstance(payload, list) else type(payload).__name__
                raise SGLangResponseError(f"/generate on {url} answered {got} items for {len(ids)} inputs "
                                          f"(samples {first}..{last})")
            return [parse_generate_item(item, len(ids[j]), chunk_sp[j]["max_new_tokens"] if partial else max_new,
                                        self.want_routes, self.top_k, self._where(samples[start + j], n),
                                        allow_abort=partial)
                    for j, item in enumerate(payload)]

        workers = min(len(chunks), 4 * len(self.urls))
        if workers == 1:
            return run((0, chunks[0]))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return [s for part in pool.map(run, enumerate(chunks)) for s in part]

    def _rollout_output(self, rows: List[List[int]], parsed: List[ParsedSample], max_new: int, n: int,
                        versions: Optional[List[List[int]]] = None) -> RolloutOutput:
        """The samples laid out as RolloutOutput (each cut at its first eos); versions[r] (partial rollouts): the
        version of each of sample r's tokens, as version_RL."""
        tok = self.tokenizer
        num = len(rows)
        response_RL = torch.full((num, max_new), tok.pad_id, dtype=torch.long)
        mask_RL = torch.zeros((num, max_new), dtype=torch.bool)
        logp_RL = torch.zeros((num, max_new), dtype=torch.float32)
        version_RL = None if versions is None else torch.zeros((num, max_new), dtype=torch.long)
        routes = None
        if self.want_routes:
            max_prompt = max(len(r) for r in rows)
            routes = torch.full((num, max_prompt + max_new - 1, len(self.moe_layers), self.top_k), -1,
                                dtype=torch.int16)
        for r, s in enumerate(parsed):
            length = self._response_length(s.tokens)
            tokens = s.tokens[:length]
            response_RL[r, :length] = torch.tensor(tokens, dtype=torch.long)
            mask_RL[r, :length] = True
            logp_RL[r, :length] = torch.tensor(s.logps[:length], dtype=torch.float32)
            if version_RL is not None:
                version_RL[r, :length] = torch.tensor(versions[r][:length], dtype=torch.long)
            if routes is not None:
                routes[r, :len(rows[r]) + length - 1] = self._moe_routes(s.routes, r, n)[:len(rows[r]) + length - 1]
        prompt_ids = [list(r) for r in rows]
        return RolloutOutput(prompt_ids, response_RL, mask_RL, logp_RL, routes, version_RL)

    def _response_length(self, tokens: List[int]) -> int:
        """A response ends at (and includes) its first eos (any of the stop tokens)."""
        ends = [tokens.index(e) for e in self.tokenizer.eos_ids if e in tokens]
        return min(ends) + 1 if ends else len(tokens)

    # ------------------------------------------------------------------------------------------ partial rollouts
    def _generate_partial(self, rows: List[List[int]], n: int, sampling: SamplingParams,
                          switch: WeightSwitch) -> RolloutOutput:
        """Abort and resume, as SGLang does partial rollouts. Each round sends every unfinished sample (prompt +
        its tokens so far, max_new_tokens = what is left) while a watcher asks switch.pending(); when newer
        weights are pending it POSTs /abort_request {abort_all} to every server, so the in-flight requests return
        at their next step with what they have. Once all of the round's requests have returned (nothing is in
        flight), switch.apply(self) loads the new weights and the aborted samples go out again. Tokens and
        log-probs are kept from every round, tagged with the version of that round; routes (R3) come from each
        sample's last request, whose prefill re-read its whole prefix under the weights that finished it."""
        max_new = sampling.max_new_tokens
        tokens: List[List[int]] = [[] for _ in rows]
        logps: List[List[float]] = [[] for _ in rows]
        versions: List[List[int]] = [[] for _ in rows]
        last: List[Optional[ParsedSample]] = [None] * len(rows)
        stalls = [0] * len(rows)
        active = list(range(len(rows)))
        version = int(switch.version)
        while active:
            # nothing in flight: load newer weights before sending (after an abort the watcher made, they are
            # pending; an abort from elsewhere resumes under the same weights)
            if switch.pending():
                version = int(switch.apply(self))
            inputs = [rows[r] + tokens[r] for r in active]
            sps = [self._sampling_json(sampling, max_new - len(tokens[r])) for r in active]
            parsed = self._watched_round(active, inputs, sps, max_new, n, switch)
            for r, s in zip(active, parsed):
                tokens[r] += s.tokens
                logps[r] += s.logps
                versions[r] += [version] * len(s.tokens)
                last[r] = s
                stalls[r] = stalls[r] + 1 if s.finish_type == "abort" and not s.tokens else 0
            active = [r for r in active if not self._finished(last[r], tokens[r], max_new)]
            for r in active:
                if stalls[r] >= self.config.partial_max_stalls:
                    raise SGLangResponseError(
                        f"{self._where(r, n)}: aborted {stalls[r]} times in a row without a new token "
                        f"({len(tokens[r])} of {max_new} generated); the servers abort it before it runs "
                        f"(sglang.partial_max_stalls = {self.config.partial_max_stalls})")
        parsed = [ParsedSample(tokens[r], logps[r], last[r].finish_type, last[r].routes) for r in range(len(rows))]
        if self.want_routes:
            for r, s in enumerate(parsed):
                if s.routes is None:  # only an aborted item may lack routes; it finished the response here
                    raise SGLangResponseError(f"{self._where(r, n)}: routing replay (R3) is on but the request "
                                              "that finished it was aborted without routed_experts")
        return self._rollout_output(rows, parsed, max_new, n, versions)

    def _finished(self, s: ParsedSample, tokens: List[int], max_new: int) -> bool:
        """A response that stopped (eos) or reached max_new_tokens is done, also when the abort raced with its
        last step (SGLang checks the abort first, so such an item reports abort)."""
        return s.finish_type != "abort" or len(tokens) >= max_new or any(t in self.tokenizer.eos_ids for t in tokens)

    def _watched_round(self, samples: List[int], inputs: List[List[int]], sps: List[dict], max_new: int, n: int,
                       switch: WeightSwitch) -> List[ParsedSample]:
        """_generate_round with the abort watcher running; a refused abort (or a failing switch) raises once the
        round's requests have returned (they ran on to their end under the old weights)."""
        aborting, done = threading.Event(), threading.Event()
        errors: List[BaseException] = []
        servers = self._servers_of(samples, len(inputs))

        def watch():
            try:
                while not done.wait(self.config.partial_poll_s):
                    if switch.pending():
                        aborting.set()
                        self._abort_all(servers, n)
                        return
            except BaseException as exc:  # noqa: BLE001 (raised by the generating thread)
                errors.append(exc)

        watcher = threading.Thread(target=watch, name="sglang-abort-watcher", daemon=True)
        watcher.start()
        try:
            parsed = self._generate_round(samples, inputs, sps, max_new, n, aborting)
        finally:
            done.set()
            watcher.join()
        if errors:
            raise errors[0]
        return parsed

    def _servers_of(self, samples: List[int], count: int) -> Dict[str, List[int]]:
        """url -> the samples of this round that _generate_round sends there (chunk k goes to server k % S)."""
        out: Dict[str, List[int]] = {url: [] for url in self.urls}
        for k, start in enumerate(range(0, count, self.config.max_batch)):
            out[self.urls[k % len(self.urls)]] += samples[start:start + self.config.max_batch]
        return out

    def _abort_all(self, servers: Dict[str, List[int]], n: int) -> None:
        """POST /abort_request {abort_all} to every server; SGLangServerError naming the samples a server kept
        generating when it refuses (or cannot be reached)."""
        for url, samples in servers.items():
            try:
                status, payload = self._post(url, "/abort_request", abort_request_json())
                message = _server_message(payload)
            except SGLangServerError as exc:
                status, message = None, str(exc)
            if status != 200:
                named = ", ".join(self._where(r, n) for r in samples[:3]) + (" ..." if len(samples) > 3 else "")
                raise SGLangServerError(
                    f"/abort_request (abort_all) failed on {url} (HTTP {status}): {message}; newer weights are "
                    f"pending but {len(samples)} sample(s) generating there were not stopped: {named or 'none'}")

    @staticmethod
    def _where(r: int, n: int) -> str:
        return f"sample {r} (prompt {r // n}, sample {r % n} of {n})"

    def _moe_routes(self, arr, r: int, n: int) -> torch.Tensor:
        """Server routes [P, layers, K] -> [P, MoE layers, K] int16. SGLang reports all num_hidden_layers (dense
        layers included, their rows meaningless); a server reporting only the MoE layers is accepted too."""
        n_layers = arr.shape[1]
        if n_layers == self.arch.num_hidden_layers:
            arr = arr[:, self.moe_layers]
        elif n_layers != len(self.moe_layers):
            raise SGLangResponseError(
                f"{self._where(r, n)}: routed_experts has {n_layers} layers; the model has "
                f"{self.arch.num_hidden_layers} layers ({len(self.moe_layers)} MoE)")
        if arr.size and (arr.min() < 0 or arr.max() >= self.arch.num_experts):
            raise SGLangResponseError(f"{self._where(r, n)}: routed_experts holds expert ids outside "
                                      f"[0, {self.arch.num_experts})")
        return torch.from_numpy(arr.astype("int16"))
