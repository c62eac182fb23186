"""The settings of the SGLang engine (`rollout.sglang`), checked field by field when built: the preflight builds
an SGLangEngineConfig before any compute, so a bad key fails the run at once, naming `sglang.<field>`.
Plain data and its validation only: nothing here touches a server."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .errors import SGLangConfigError

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


# rollout.engine_dtype -> the launch arguments of an SGLang server that computes so (fp8_sim is the real thing on
# SGLang: its FP8 W8A8 quantization of the linear layers, bf16 elsewhere)
SERVER_DTYPE_ARGS = {"fp32": ("--dtype", "float32"), "bf16": ("--dtype", "bfloat16"),
                     "fp16": ("--dtype", "float16"), "fp8_sim": ("--dtype", "bfloat16", "--quantization", "fp8")}


def with_engine_dtype(config: "SGLangEngineConfig", engine_dtype: str) -> "SGLangEngineConfig":
    """The config whose launched servers compute in rollout.engine_dtype (auto: as launched, SGLang's default).
    Servers attached by url run the dtype they were started with, and a launch whose extra_args already choose
    one is not overridden: both are refused, naming the keys."""
    if engine_dtype == "auto":
        return config
    if engine_dtype not in SERVER_DTYPE_ARGS:
        raise SGLangConfigError(f"rollout.engine_dtype = {engine_dtype!r} is not valid; valid values: auto, "
                                f"{', '.join(SERVER_DTYPE_ARGS)}")
    if config.launch is None:
        raise SGLangConfigError(f"rollout.engine_dtype = {engine_dtype} sets the precision of servers the engine "
                                "launches (sglang.launch); servers attached by sglang.urls run the dtype they were "
                                f"started with: start them with {' '.join(SERVER_DTYPE_ARGS[engine_dtype])} and leave "
                                "rollout.engine_dtype = auto")
    chosen = [a for a in config.launch.extra_args if a.split("=")[0] in ("--dtype", "--quantization")]
    if chosen:
        raise SGLangConfigError(f"rollout.engine_dtype = {engine_dtype} and sglang.launch.extra_args {chosen} both "
                                "set the servers' precision: keep one")
    launch = dataclasses.replace(config.launch, extra_args=(*config.launch.extra_args,
                                                            *SERVER_DTYPE_ARGS[engine_dtype]))
    return dataclasses.replace(config, launch=launch)
