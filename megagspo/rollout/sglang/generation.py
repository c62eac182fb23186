"""Rollouts from SGLang's /generate: a round of requests and the RolloutOutput made of its answers.

A round sends its inputs in chunks of `max_batch`, chunk k to server k % S, several chunks at once; the servers
stop at eos (stop_token_ids=[eos], no_stop_trim) and return tokens and log-probs in
meta_info.output_token_logprobs (the eos token kept), routes (R3) in meta_info.routed_experts. The output lays
the samples out prompt-major (row i*G+g = sample g of prompt i), each cut at its first eos, routes as
RolloutOutput.routes_RPLyK (positions prompt + response[:-1], MoE layers only, -1 where not fed). With R3 on, a
response without routes, or with routes of the wrong size, raises SGLangResponseError naming the sample:
training never goes on without replay. Partial rollouts (partial.py) run rounds of their own with an abort
event and per-sample budgets."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import torch

from ..base import RolloutOutput, SamplingParams
from .client import SGLangClient, server_message
from .config import SGLangEngineConfig
from .errors import SGLangServerError
from .schema import ParsedSample, SGLangResponseError, generate_request_json, parse_generate_item, sampling_params_json


def where(r: int, n: int) -> str:
    """How an error names sample r of a batch of n samples per prompt."""
    return f"sample {r} (prompt {r // n}, sample {r % n} of {n})"


class Generation:
    """Rounds of /generate on `client`'s servers, and their RolloutOutput. want_routes: ask for routed experts
    and check them (R3, or record_routes)."""

    def __init__(self, config: SGLangEngineConfig, arch, tokenizer, client: SGLangClient, want_routes: bool) -> None:
        self.config, self.arch, self.tokenizer, self.client = config, arch, tokenizer, client
        self.want_routes = want_routes
        self.moe_layers = [i for i, is_moe in enumerate(arch.moe_layer_pattern) if is_moe]
        self.top_k = arch.num_experts_per_tok

    def sampling_json(self, sampling: SamplingParams, max_new: int) -> dict:
        return sampling_params_json(max_new, sampling.temperature, sampling.top_p, sampling.greedy,
                                    list(self.tokenizer.eos_ids))

    def round(self, samples: List[int], inputs: List[List[int]], sp, max_new: int, n: int,
              aborting: Optional[threading.Event] = None) -> List[ParsedSample]:
        """One /generate pass: inputs[i] (the input of sample samples[i]) in chunks of max_batch spread over the
        servers; sp one sampling_params dict, or one per input. aborting (partial rollouts): once set, chunks not
        yet sent are not sent (they come back as aborted, empty), and aborted items are partial responses."""
        urls = self.client.urls
        chunks = [(s, inputs[s:s + self.config.max_batch]) for s in range(0, len(inputs), self.config.max_batch)]
        partial = aborting is not None

        def run(job):
            k, (start, ids) = job
            if partial and aborting.is_set():  # the weights change before these would start: send them after
                return [ParsedSample([], [], "abort") for _ in ids]
            url = urls[k % len(urls)]
            chunk_sp = sp[start:start + len(ids)] if isinstance(sp, list) else sp
            first, last = samples[start], samples[start + len(ids) - 1]
            status, payload = self.client.post(url, "/generate", generate_request_json(ids, chunk_sp, self.want_routes))
            if status != 200:
                raise SGLangServerError(f"/generate failed on {url} for samples {first}..{last} "
                                        f"(HTTP {status}): {server_message(payload)}")
            if not isinstance(payload, list) or len(payload) != len(ids):
                got = len(payload) if isinstance(payload, list) else type(payload).__name__
                raise SGLangResponseError(f"/generate on {url} answered {got} items for {len(ids)} inputs "
                                          f"(samples {first}..{last})")
            return [parse_generate_item(item, len(ids[j]), chunk_sp[j]["max_new_tokens"] if partial else max_new,
                                        self.want_routes, self.top_k, where(samples[start + j], n),
                                        allow_abort=partial)
                    for j, item in enumerate(payload)]

        workers = min(len(chunks), 4 * len(urls))
        if workers == 1:
            return run((0, chunks[0]))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return [s for part in pool.map(run, enumerate(chunks)) for s in part]

    def output(self, rows: List[List[int]], parsed: List[ParsedSample], max_new: int, n: int,
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
            length = self.response_length(s.tokens)
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

    def response_length(self, tokens: List[int]) -> int:
        """A response ends at (and includes) its first eos (any of the stop tokens)."""
        ends = [tokens.index(e) for e in self.tokenizer.eos_ids if e in tokens]
        return min(ends) + 1 if ends else len(tokens)

    def _moe_routes(self, arr, r: int, n: int) -> torch.Tensor:
        """Server routes [P, layers, K] -> [P, MoE layers, K] int16. SGLang reports all num_hidden_layers (dense
        layers included, their rows meaningless); a server reporting only the MoE layers is accepted too."""
        n_layers = arr.shape[1]
        if n_layers == self.arch.num_hidden_layers:
            arr = arr[:, self.moe_layers]
        elif n_layers != len(self.moe_layers):
            raise SGLangResponseError(
                f"{where(r, n)}: routed_experts has {n_layers} layers; the model has "
                f"{self.arch.num_hidden_layers} layers ({len(self.moe_layers)} MoE)")
        if arr.size and (arr.min() < 0 or arr.max() >= self.arch.num_experts):
            raise SGLangResponseError(f"{where(r, n)}: routed_experts holds expert ids outside "
                                      f"[0, {self.arch.num_experts})")
        return torch.from_numpy(arr.astype("int16"))
