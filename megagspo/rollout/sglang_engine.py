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

update_weights(megatron_state): "disk" writes an HF checkpoint (per-expert layout, as SGLang's loader reads
hub checkpoints) into a fresh folder under `sync_dir`, posts /update_weights_from_disk, checks `success`,
flushes the cache and removes the previous folder. "tensor" is not implemented (raises at construction).

Legend as in base.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .base import RolloutEngine, RolloutOutput, SamplingParams, register_engine
from .sglang_schema import (SGLangResponseError, generate_request_json, parse_generate_item,
                            sampling_params_json)

SGLANG_MISSING = ("launching SGLang servers needs the `sglang` package, which is not importable here: "
                  "`pip install sglang` on a GPU host, or attach to running servers with "
                  "SGLangEngineConfig(urls=[...])")


class SGLangConfigError(ValueError):
    pass


class SGLangServerError(RuntimeError):
    """A server that cannot be reached, or that answered an endpoint with an error."""


class SGLangUnavailableError(RuntimeError):
    """The sglang package is needed (to launch servers) and is not installed."""


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
    weight_sync: str = "disk"                       # disk | tensor (not implemented)
    sync_dir: Optional[str] = None                  # where "disk" writes HF checkpoints (must be visible to servers)
    load_format: Optional[str] = None               # passed to /update_weights_from_disk when set
    colocate: bool = False                          # release / resume GPU memory around training
    max_batch: int = 256                            # sequences per /generate request
    original_logprob: bool = True                   # servers run with SGLANG_RETURN_ORIGINAL_LOGPROB=1
    health_check: bool = True                       # GET /health of every server when attaching

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
        if self.weight_sync not in ("disk", "tensor"):
            _fail("weight_sync", f"must be 'disk' or 'tensor', got {self.weight_sync!r}")
        if self.weight_sync == "disk" and not self.sync_dir:
            _fail("sync_dir", "weight_sync = 'disk' needs a folder the servers can read")
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) or self.max_batch < 1:
            _fail("max_batch", f"must be a positive integer, got {self.max_batch!r}")


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


@register_engine("sglang")
class SGLangEngine(RolloutEngine):
    def __init__(self, arch, tokenizer, record_routes: Optional[bool] = None,
                 config: Optional[SGLangEngineConfig] = None) -> None:
        if config is None:
            raise SGLangConfigError("rollout.engine = 'sglang' needs an SGLangEngineConfig (urls of running servers "
                                    "or launch settings): SGLangEngine(arch, tokenizer, config=SGLangEngineConfig(...))")
        if isinstance(config, dict):
            config = SGLangEngineConfig(**config)
        if config.weight_sync == "tensor":
            raise NotImplementedError(
                "sglang.weight_sync = 'tensor' (/update_weights_from_tensor, same-host CUDA IPC handles) is not "
                "implemented; use weight_sync = 'disk'")
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
        if config.launch is not None:
            self.urls = self._launch(config.launch)
        else:
            self.urls = list(config.urls)
            if config.health_check:
                for url in self.urls:
                    self._check_health(url)
            if self.want_routes:
                self._check_routes_enabled()

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
    def update_weights(self, megatron_state: Dict[str, torch.Tensor]) -> None:
        self.resume_memory()
        path = self.write_hf_checkpoint(megatron_state)
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
        from safetensors.torch import save_file

        from moe.hf_checkpoint import PER_EXPERT, hf_state_dict_from_megatron
        from moe.hf_config import hf_config_from_architecture

        self._version += 1
        path = Path(self.config.sync_dir) / f"weights-v{self._version:06d}"
        if path.exists():
            shutil.rmtree(path)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        hf = hf_state_dict_from_megatron(megatron_state, self.arch, PER_EXPERT)
        shards: List[Dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, t in hf.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = t.detach().cpu().contiguous()
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
            total = sum(t.numel() * t.element_size() for t in hf.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        dtype = str(hf["model.embed_tokens.weight"].dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(hf_config_from_architecture(self.arch, dtype=dtype), indent=2))
        os.replace(tmp, path)
        return path

    # ------------------------------------------------------------------------------------------ rollout
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> RolloutOutput:
        if n < 1 or not prompts:
            raise ValueError(f"generate needs prompts and n >= 1 (got {len(prompts)} prompts, n={n})")
        if not self.config.original_logprob and not sampling.greedy and sampling.temperature != 1.0:
            raise SGLangConfigError(
                f"temperature {sampling.temperature} with servers that return tempered log-probs: start them with "
                "SGLANG_RETURN_ORIGINAL_LOGPROB=1 and set sglang.original_logprob = true (logp_RL must be the "
                "temperature-1 log-softmax)")
        self.resume_memory()
        tok = self.tokenizer
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        num, max_new = len(rows), sampling.max_new_tokens
        sp = sampling_params_json(max_new, sampling.temperature, sampling.top_p, sampling.greedy, [tok.eos_id])
        chunks = [(s, rows[s:s + self.config.max_batch]) for s in range(0, num, self.config.max_batch)]

        def run(job):
            k, (start, ids) = job
            url = self.urls[k % len(self.urls)]
            status, payload = self._post(url, "/generate", generate_request_json(ids, sp, self.want_routes))
            if status != 200:
                raise SGLangServerError(f"/generate failed on {url} for samples {start}..{start + len(ids) - 1} "
                                        f"(HTTP {status}): {_server_message(payload)}")
            if not isinstance(payload, list) or len(payload) != len(ids):
                got = len(payload) if isinstance(payload, list) else type(payload).__name__
                raise SGLangResponseError(f"/generate on {url} answered {got} items for {len(ids)} inputs "
                                          f"(samples {start}..{start + len(ids) - 1})")
            return [parse_generate_item(item, len(ids[j]), max_new, self.want_routes, self.top_k,
                                        self._where(start + j, n))
                    for j, item in enumerate(payload)]

        workers = min(len(chunks), 4 * len(self.urls))
        if workers == 1:
            parsed = run((0, chunks[0]))
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                parsed = [s for part in pool.map(run, enumerate(chunks)) for s in part]

        response_RL = torch.full((num, max_new), tok.pad_id, dtype=torch.long)
        mask_RL = torch.zeros((num, max_new), dtype=torch.bool)
        logp_RL = torch.zeros((num, max_new), dtype=torch.float32)
        routes = None
        if self.want_routes:
            max_prompt = max(len(r) for r in rows)
            routes = torch.full((num, max_prompt + max_new - 1, len(self.moe_layers), self.top_k), -1,
                                dtype=torch.int16)
        for r, s in enumerate(parsed):
            tokens = s.tokens
            if tok.eos_id in tokens:  # a response ends at (and includes) its first eos
                tokens = tokens[:tokens.index(tok.eos_id) + 1]
            length = len(tokens)
            response_RL[r, :length] = torch.tensor(tokens, dtype=torch.long)
            mask_RL[r, :length] = True
            logp_RL[r, :length] = torch.tensor(s.logps[:length], dtype=torch.float32)
            if routes is not None:
                routes[r, :len(rows[r]) + length - 1] = self._moe_routes(s.routes, r, n)[:len(rows[r]) + length - 1]
        prompt_ids = [list(r) for r in rows]
        return RolloutOutput(prompt_ids, response_RL, mask_RL, logp_RL, routes)

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
