"""Partial rollouts on SGLang servers (generate(..., switch=WeightSwitch)): abort and resume, as SGLang-based RL
trainers do. While a round of /generate requests is in flight, a watcher thread asks switch.pending() every
`partial_poll_s` (from that thread: pending must be thread-safe and cheap); when newer weights are pending it
POSTs /abort_request {"abort_all": true} to every server, whose in-flight requests then return at their next
step with finish_reason abort and the tokens so far. Once the round has returned (nothing in flight),
switch.apply(engine) loads the new weights and the unfinished samples go out again as prompt + tokens so far
with max_new_tokens = what is left, until none is aborted. version_RL tags every token with the version of its
round; routes come from each sample's last request (its prefill re-read the whole prefix). A refused abort, or a
sample aborted `partial_max_stalls` times in a row without a new token, raises naming the samples."""

from __future__ import annotations

import threading
from typing import Dict, List, Optional

from ..base import RolloutEngine, RolloutOutput, SamplingParams, WeightSwitch
from .client import SGLangClient, server_message
from .config import SGLangEngineConfig
from .errors import SGLangServerError
from .generation import Generation, where
from .schema import ParsedSample, SGLangResponseError, abort_request_json


class PartialRollouts:
    """Rounds of `generation` under a WeightSwitch: the resume loop on the generating thread, the abort watcher
    beside each round."""

    def __init__(self, config: SGLangEngineConfig, generation: Generation, client: SGLangClient) -> None:
        self.config, self.generation, self.client = config, generation, client

    def generate(self, rows: List[List[int]], n: int, sampling: SamplingParams, switch: WeightSwitch,
                 engine: RolloutEngine) -> RolloutOutput:
        """Each round sends every unfinished sample (prompt + its tokens so far, max_new_tokens = what is left)
        while a watcher asks switch.pending(); when newer weights are pending it POSTs /abort_request {abort_all}
        to every server, so the in-flight requests return at their next step with what they have. Once all of the
        round's requests have returned (nothing is in flight), switch.apply(engine) loads the new weights and the
        aborted samples go out again. Tokens and log-probs are kept from every round, tagged with the version of
        that round; routes (R3) come from each sample's last request, whose prefill re-read its whole prefix
        under the weights that finished it."""
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
                version = int(switch.apply(engine))
            inputs = [rows[r] + tokens[r] for r in active]
            sps = [self.generation.sampling_json(sampling, max_new - len(tokens[r])) for r in active]
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
                        f"{where(r, n)}: aborted {stalls[r]} times in a row without a new token "
                        f"({len(tokens[r])} of {max_new} generated); the servers abort it before it runs "
                        f"(sglang.partial_max_stalls = {self.config.partial_max_stalls})")
        parsed = [ParsedSample(tokens[r], logps[r], last[r].finish_type, last[r].routes) for r in range(len(rows))]
        if self.generation.want_routes:
            for r, s in enumerate(parsed):
                if s.routes is None:  # only an aborted item may lack routes; it finished the response here
                    raise SGLangResponseError(f"{where(r, n)}: routing replay (R3) is on but the request "
                                              "that finished it was aborted without routed_experts")
        return self.generation.output(rows, parsed, max_new, n, versions)

    def _finished(self, s: ParsedSample, tokens: List[int], max_new: int) -> bool:
        """A response that stopped (eos) or reached max_new_tokens is done, also when the abort raced with its
        last step (SGLang checks the abort first, so such an item reports abort)."""
        eos_ids = self.generation.tokenizer.eos_ids
        return s.finish_type != "abort" or len(tokens) >= max_new or any(t in eos_ids for t in tokens)

    def _watched_round(self, samples: List[int], inputs: List[List[int]], sps: List[dict], max_new: int, n: int,
                       switch: WeightSwitch) -> List[ParsedSample]:
        """Generation.round with the abort watcher running; a refused abort (or a failing switch) raises once the
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
            parsed = self.generation.round(samples, inputs, sps, max_new, n, aborting)
        finally:
            done.set()
            watcher.join()
        if errors:
            raise errors[0]
        return parsed

    def _servers_of(self, samples: List[int], count: int) -> Dict[str, List[int]]:
        """url -> the samples of this round that Generation.round sends there (chunk k goes to server k % S)."""
        urls = self.client.urls
        out: Dict[str, List[int]] = {url: [] for url in urls}
        for k, start in enumerate(range(0, count, self.config.max_batch)):
            out[urls[k % len(urls)]] += samples[start:start + self.config.max_batch]
        return out

    def _abort_all(self, servers: Dict[str, List[int]], n: int) -> None:
        """POST /abort_request {abort_all} to every server; SGLangServerError naming the samples a server kept
        generating when it refuses (or cannot be reached)."""
        for url, samples in servers.items():
            try:
                status, payload = self.client.post(url, "/abort_request", abort_request_json())
                message = server_message(payload)
            except SGLangServerError as exc:
                status, message = None, str(exc)
            if status != 200:
                named = ", ".join(where(r, n) for r in samples[:3]) + (" ..." if len(samples) > 3 else "")
                raise SGLangServerError(
                    f"/abort_request (abort_all) failed on {url} (HTTP {status}): {message}; newer weights are "
                    f"pending but {len(samples)} sample(s) generating there were not stopped: {named or 'none'}")
