"""The SGLang servers of one engine: started and owned by it (`SGLangLaunchConfig`: `python -m
sglang.launch_server` children, each in a session of its own so that closing signals exactly what was started),
or attached to (`urls`, checked with GET /health and, for routing replay, /get_server_info). Also the servers'
GPU memory around training (colocate: release / resume). Launching needs the `sglang` package on a GPU host;
attaching needs only the HTTP client."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from typing import List

from .client import SGLangClient, http_request, server_message
from .config import SGLangEngineConfig, SGLangLaunchConfig
from .errors import SGLangConfigError, SGLangServerError, SGLangUnavailableError

SGLANG_MISSING = ("launching SGLang servers needs the `sglang` package, which is not importable here: "
                  "`pip install sglang` on a GPU host, or attach to running servers with "
                  "SGLangEngineConfig(urls=[...])")


class SGLangServers:
    """Launches (config.launch) or attaches to (config.urls) the servers, then serves them as `client`.
    want_routes: the servers must return routed experts (launched with --enable-return-routed-experts; attached
    ones that say they run without it are refused)."""

    def __init__(self, config: SGLangEngineConfig, want_routes: bool) -> None:
        self.config = config
        self._procs: List[subprocess.Popen] = []
        self._logs = []
        self._released = False
        if config.launch is not None:
            self.client = SGLangClient(self._launch(config.launch, want_routes), config.timeout_s)
            return
        self.client = SGLangClient(config.urls, config.timeout_s)
        if config.health_check:
            for url in self.urls:
                self._check_health(url)
        if want_routes:
            self._check_routes_enabled()

    @property
    def urls(self) -> List[str]:
        return self.client.urls

    # ------------------------------------------------------------------------------------------ launch
    def _launch(self, lc: SGLangLaunchConfig, want_routes: bool) -> List[str]:
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
                if want_routes:
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

    @staticmethod
    def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SGLangServerError(f"SGLang server for {url} exited with code {proc.returncode} while starting "
                                        "(see its log)")
            try:
                status, _ = http_request("GET", url + "/health", None, timeout=10)
                if status == 200:
                    return
            except SGLangServerError:
                pass
            time.sleep(2)
        raise SGLangServerError(f"SGLang server at {url} was not healthy after {timeout:.0f} s")

    # ------------------------------------------------------------------------------------------ attach
    def _check_health(self, url: str) -> None:
        status, payload = self.client.get(url, "/health")
        if status != 200:
            raise SGLangServerError(f"SGLang server at {url} is not healthy: /health answered {status} "
                                    f"{server_message(payload)}")

    def _check_routes_enabled(self) -> None:
        for url in self.urls:
            try:
                status, info = self.client.get(url, "/get_server_info")
            except SGLangServerError:
                continue
            if status == 200 and isinstance(info, dict) and info.get("enable_return_routed_experts") is False:
                raise SGLangConfigError(
                    f"routing replay (R3) needs routed experts, but the SGLang server at {url} was started without "
                    "--enable-return-routed-experts")

    # ------------------------------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Free the servers' GPU memory (weights and KV cache) for training; needs colocate=True."""
        if not self.config.colocate:
            raise SGLangConfigError("release_memory() needs sglang.colocate = true (servers with "
                                    "--enable-memory-saver)")
        if not self._released:
            self.client.post_all("/release_memory_occupation", {}, "release_memory_occupation")
            self._released = True

    def resume_memory(self) -> None:
        if self._released:
            self.client.post_all("/resume_memory_occupation", {}, "resume_memory_occupation")
            self._released = False

    # ------------------------------------------------------------------------------------------ close
    def close(self) -> None:
        """Stop the servers this engine started (SIGTERM to each child's session, SIGKILL after 60 s) and close
        their logs; attached servers are left running."""
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
