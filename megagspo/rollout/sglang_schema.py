"""SGLang's native HTTP schema, as this engine speaks it: request bodies and response parsing, no I/O.

Checked against SGLang's source (sgl-project/sglang, 2025-2026 snapshots):
  python/sglang/srt/managers/io_struct.py          GenerateReqInput fields (input_ids as a list of lists for a
      batch, sampling_params dict broadcast to every item, return_logprob, logprob_start_len=-1 = output tokens
      only, return_routed_experts: bool), UpdateWeightFromDiskReqInput {model_path, load_format, weight_version,
      ...}, Release/ResumeMemoryOccupationReqInput {tags}
  python/sglang/srt/managers/tokenizer_manager.py   a batch /generate returns a list, one dict per item, in
      order: {"output_ids", "meta_info"} (+ "text" unless --skip-tokenizer-init); meta_info has "finish_reason"
      (None | {"type": "stop", "matched": id|str} | {"type": "length", "length": n} | {"type": "abort",
      "message": ...}), "prompt_tokens", "completion_tokens", "output_token_logprobs" = [[logprob, token_id,
      text|None], ...], and "routed_experts" = base64 of the int32 bytes of a [seqlen - 1, num_hidden_layers,
      top_k] array (seqlen = prompt + completion tokens: every position the model was fed)
  python/sglang/srt/layers/moe/routed_experts_capturer.py   the int32 [tokens, num_hidden_layers, top_k] host
      buffer, read back as req_to_token[: seqlen - 1]
  python/sglang/srt/managers/detokenizer_manager.py a matched stop token is trimmed from the *text* unless
      no_stop_trim; output_ids / output_token_logprobs keep it
  python/sglang/srt/entrypoints/http_server.py      /generate, /health, /get_model_info, /get_server_info,
      /flush_cache (GET|POST, 200 or 400), /update_weights_from_disk (200 {"success", "message",
      "num_paused_requests"}, 400 with success false), /release_memory_occupation and
      /resume_memory_occupation (GET|POST; errors as 400 {"error": {"message"}})
  sampler: output log-probs are log_softmax(logits / temperature) unless the server runs with
      SGLANG_RETURN_ORIGINAL_LOGPROB=1 (then the temperature-1 log-softmax RolloutOutput wants); greedy
      (temperature 0) returns log_softmax(logits) either way.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np


class SGLangResponseError(RuntimeError):
    """A server response that does not fit the schema, or that breaks the engine's contract (R3 routes)."""


def sampling_params_json(max_new_tokens: int, temperature: float, top_p: float, greedy: bool,
                         stop_token_ids: Sequence[int]) -> dict:
    """SGLang `sampling_params` for one rollout batch (broadcast by SGLang to every item of the batch)."""
    return {
        "max_new_tokens": int(max_new_tokens),
        "temperature": 0.0 if greedy else float(temperature),
        "top_p": 1.0 if greedy else float(top_p),
        "top_k": -1,
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


def generate_request_json(input_ids: Sequence[Sequence[int]], sampling_params: dict, return_routes: bool) -> dict:
    body = {
        "input_ids": [[int(t) for t in ids] for ids in input_ids],
        "sampling_params": sampling_params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    if return_routes:
        body["return_routed_experts"] = True
    return body


@dataclass
class ParsedSample:
    tokens: List[int]
    logps: List[float]
    finish_type: str
    routes: Optional[np.ndarray] = None  # int32 [positions, layers, top_k] as the server sent them


def decode_routed_experts(value, positions: int, top_k: int, where: str) -> np.ndarray:
    """meta_info.routed_experts (base64 of little-endian int32 [positions, layers, top_k]) -> array.

    Also accepts a nested JSON list (older servers / custom builds) of the same shape."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
            raise SGLangResponseError(f"{where}: routed_experts is not valid base64 ({exc})") from None
        if len(raw) % 4:
            raise SGLangResponseError(f"{where}: routed_experts holds {len(raw)} bytes, not whole int32 values")
        flat = np.frombuffer(raw, dtype="<i4")
    elif isinstance(value, list):
        try:
            flat = np.asarray(value, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise SGLangResponseError(f"{where}: routed_experts list is not rectangular ({exc})") from None
    else:
        raise SGLangResponseError(f"{where}: routed_experts has type {type(value).__name__}, expected a base64 "
                                  "string")
    per_position = flat.size // positions if positions else 0
    if positions <= 0 or flat.size != positions * per_position or per_position % top_k or per_position == 0:
        raise SGLangResponseError(
            f"{where}: routed_experts has {flat.size} ids, which is not {positions} fed positions (prompt + "
            f"response - 1) x layers x top_k={top_k}")
    return flat.reshape(positions, per_position // top_k, top_k)


def parse_generate_item(item, prompt_len: int, max_new_tokens: int, want_routes: bool, top_k: int,
                        where: str) -> ParsedSample:
    """One element of a /generate response -> tokens, log-probs, finish type and (if asked) routes."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise SGLangResponseError(f"{where}: response item has no meta_info object: {str(item)[:200]}")
    meta = item["meta_info"]
    finish = meta.get("finish_reason")
    if finish is None:
        raise SGLangResponseError(f"{where}: finish_reason is null (the request did not finish)")
    finish_type = finish.get("type") if isinstance(finish, dict) else str(finish)
    if finish_type == "abort":
        raise SGLangResponseError(f"{where}: the server aborted the request: {finish.get('message', finish)}")
    if finish_type not in ("stop", "length"):
        raise SGLangResponseError(f"{where}: unknown finish_reason {finish!r}")
    lp = meta.get("output_token_logprobs")
    if not isinstance(lp, list):
        raise SGLangResponseError(f"{where}: meta_info.output_token_logprobs missing (was return_logprob sent?)")
    tokens, logps = [], []
    for j, entry in enumerate(lp):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise SGLangResponseError(f"{where}: output_token_logprobs[{j}] = {entry!r}, expected "
                                      "[logprob, token_id, text]")
        logp, tok = entry[0], entry[1]
        if logp is None or not isinstance(tok, int):
            raise SGLangResponseError(f"{where}: output_token_logprobs[{j}] = {entry!r} has no log-prob/token id")
        tokens.append(tok)
        logps.append(float(logp))
    output_ids = item.get("output_ids")
    if output_ids is not None and list(output_ids) != tokens:
        raise SGLangResponseError(f"{where}: output_ids ({len(output_ids)} tokens) disagree with the tokens of "
                                  f"output_token_logprobs ({len(tokens)})")
    completion = meta.get("completion_tokens")
    if completion is not None and completion != len(tokens):
        raise SGLangResponseError(f"{where}: completion_tokens = {completion} but {len(tokens)} log-probs")
    if len(tokens) > max_new_tokens:
        raise SGLangResponseError(f"{where}: {len(tokens)} tokens generated, max_new_tokens = {max_new_tokens}")
    prompt_tokens = meta.get("prompt_tokens")
    if prompt_tokens is not None and prompt_tokens != prompt_len:
        raise SGLangResponseError(f"{where}: prompt_tokens = {prompt_tokens}, the prompt sent has {prompt_len}")
    routes = None
    if want_routes:
        value = meta.get("routed_experts")
        if value is None:
            raise SGLangResponseError(
                f"{where}: routing replay (R3) is on but the server returned no routed_experts; start SGLang with "
                "--enable-return-routed-experts (refusing to train without replay)")
        routes = decode_routed_experts(value, prompt_len + len(tokens) - 1, top_k, where)
    return ParsedSample(tokens, logps, finish_type, routes)
