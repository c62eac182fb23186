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
  http_server.py /abort_request takes AbortReq {rid, abort_all = False, finished_reason, abort_message} and
      answers 200 (empty body) or an error response; tokenizer_manager.abort_request(abort_all=True) aborts every
      request in flight: a running one returns at its next step with finish_reason {"type": "abort", "message",
      ...} and the output_ids / output_token_logprobs / completion_tokens (and, when captured, routed_experts) so
      far; one still in the waiting queue returns with no tokens (and no prompt_tokens)
  sampler: output log-probs are log_softmax(logits / temperature) unless the server runs with
      SGLANG_RETURN_ORIGINAL_LOGPROB=1 (then the temperature-1 log-softmax RolloutOutput wants); greedy
      (temperature 0) returns log_softmax(logits) either way.

In-memory weight updates (read in sgl-project/sglang at commit 001067ff / 9c0549b7, 2026, i.e. after the
msgspec rewrite of io_struct.py; the same fields exist in the 0.4.x-0.5.x dataclass versions):
  io_struct.py  UpdateWeightsFromTensorReqInput {serialized_named_tensors: List[bytes] (HTTP: base64 strings, one
      per TP rank of the server; rank r deserializes entry r with MultiprocessingSerializer), load_format
      (None | "direct" | "flattened_bucket" | a custom loader), flush_cache = True, abort_all_requests = False,
      weight_version = None, disable_draft_model, torch_empty_cache}
      InitWeightsUpdateGroupReqInput {master_address, master_port, rank_offset, world_size,
      group_name = "weight_update_group", backend = "nccl"}
      UpdateWeightsFromDistributedReqInput {names, dtypes (torch dtype names, getattr(torch, d)), shapes,
      group_name, flush_cache = True, abort_all_requests, weight_version, load_format, torch_empty_cache}
      DestroyWeightsUpdateGroupReqInput {group_name}
      every *ReqOutput of these: {success: bool, message: str}
  http_server.py  /update_weights_from_tensor, /init_weights_update_group, /update_weights_from_distributed,
      /destroy_weights_update_group answer 200 {"success": true, "message"} or 400 {"success": false, "message"}
  model_executor/model_runner.py  init_weights_update_group: rank = rank_offset + tp_rank in a group made from
      tcp://master_address:master_port, the store prefixed with group_name (init_custom_process_group);
      update_weights_from_distributed: per name torch.empty(shape, dtype) on the GPU, broadcast(src=0) in order,
      then model.load_weights; update_weights_from_tensor: load_format "flattened_bucket" takes a dict
      {"flattened_tensor", "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]},
      None takes [(name, tensor)]; tensors are rebuilt from CUDA IPC handles (torch reductions patched to name
      the device by UUID: sglang.srt.utils.patch_torch.monkey_patch_torch_reductions)
  weight_sync/tensor_bucket.py  FlattenedTensorBucket (its byte layout changed between versions: the trainer must
      build buckets with the server's own class, so tensor sync imports sglang on the trainer side)
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

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


def generate_request_json(input_ids: Sequence[Sequence[int]], sampling_params, return_routes: bool) -> dict:
    """sampling_params: one dict for every item, or a list of one dict per item (GenerateReqInput takes both;
    resumed partial rollouts each have their own remaining budget)."""
    if isinstance(sampling_params, list) and len(sampling_params) != len(input_ids):
        raise ValueError(f"{len(sampling_params)} sampling_params for {len(input_ids)} inputs")
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


def abort_request_json() -> dict:
    """/abort_request for every request the server holds (AbortReq.abort_all; rid is then not needed)."""
    return {"abort_all": True}


def parse_generate_item(item, prompt_len: int, max_new_tokens: int, want_routes: bool, top_k: int,
                        where: str, allow_abort: bool = False) -> ParsedSample:
    """One element of a /generate response -> tokens, log-probs, finish type and (if asked) routes.

    allow_abort (partial rollouts): an aborted item is a partial response, finish_type "abort", with the tokens
    and log-probs generated so far (none, and no log-prob list, when it was aborted in the waiting queue) and
    its routes only when the server sent them (it is resumed, and the resume's routes replace them)."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise SGLangResponseError(f"{where}: response item has no meta_info object: {str(item)[:200]}")
    meta = item["meta_info"]
    finish = meta.get("finish_reason")
    if finish is None:
        raise SGLangResponseError(f"{where}: finish_reason is null (the request did not finish)")
    finish_type = finish.get("type") if isinstance(finish, dict) else str(finish)
    aborted = finish_type == "abort"
    if aborted and not allow_abort:
        raise SGLangResponseError(f"{where}: the server aborted the request: {finish.get('message', finish)}")
    if finish_type not in ("stop", "length", "abort"):
        raise SGLangResponseError(f"{where}: unknown finish_reason {finish!r}")
    lp = meta.get("output_token_logprobs")
    if lp is None and aborted and not item.get("output_ids"):
        lp = []  # aborted before its first step: nothing generated, nothing to log
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
    if want_routes and not (aborted and meta.get("routed_experts") is None):
        value = meta.get("routed_experts")
        if value is None:
            raise SGLangResponseError(
                f"{where}: routing replay (R3) is on but the server returned no routed_experts; start SGLang with "
                "--enable-return-routed-experts (refusing to train without replay)")
        routes = decode_routed_experts(value, prompt_len + len(tokens) - 1, top_k, where)
    return ParsedSample(tokens, logps, finish_type, routes)


# ---------------------------------------------------------------------------------------- weight updates
# Field names of SGLang's request structs (io_struct.py, see the docstring): what this engine may send.
UPDATE_FROM_TENSOR_FIELDS = ("serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                             "weight_version", "disable_draft_model", "torch_empty_cache")
INIT_GROUP_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
UPDATE_FROM_DISTRIBUTED_FIELDS = ("names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                                  "weight_version", "load_format", "torch_empty_cache")
DESTROY_GROUP_FIELDS = ("group_name",)


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the spelling SGLang turns back with getattr(torch, name)."""
    return str(dtype).removeprefix("torch.")


def bucket_metadata(named: Sequence[tuple]) -> Tuple[List[str], List[str], List[List[int]]]:
    """names, dtype names ("bfloat16") and shapes of a bucket of (name, tensor) pairs, as
    /update_weights_from_distributed wants them."""
    return ([n for n, _ in named], [dtype_name(t.dtype) for _, t in named], [list(t.shape) for _, t in named])


def update_weights_from_tensor_json(serialized_named_tensors: Sequence[str], load_format: Optional[str],
                                    flush_cache: bool, weight_version: Optional[str]) -> dict:
    """One bucket for /update_weights_from_tensor: `serialized_named_tensors` holds one base64 string per TP rank
    of the server (MultiprocessingSerializer.serialize(payload, output_str=True), serialized once per rank)."""
    if not serialized_named_tensors or not all(isinstance(s, str) for s in serialized_named_tensors):
        raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
    body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
            "flush_cache": bool(flush_cache)}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def init_weights_update_group_json(master_address: str, master_port: int, rank_offset: int, world_size: int,
                                   group_name: str, backend: str) -> dict:
    if not 1 <= rank_offset < world_size:
        raise ValueError(f"rank_offset {rank_offset} outside [1, world_size={world_size}) (rank 0 is the trainer)")
    return {"master_address": str(master_address), "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": str(group_name), "backend": str(backend)}


def update_weights_from_distributed_json(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                                         group_name: str, flush_cache: bool, weight_version: Optional[str]) -> dict:
    """One bucket for /update_weights_from_distributed; the tensors follow as one broadcast(src=0) each, in
    this order (load_format left unset: per-tensor broadcasts need no shared bucket layout)."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names/dtypes/shapes must be non-empty and of one length, got {len(names)}/{len(dtypes)}/"
                         f"{len(shapes)}")
    body = {"names": list(names), "dtypes": list(dtypes), "shapes": [[int(x) for x in s] for s in shapes],
            "group_name": str(group_name), "flush_cache": bool(flush_cache)}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def destroy_weights_update_group_json(group_name: str) -> dict:
    return {"group_name": str(group_name)}


def weight_update_result(status: int, payload) -> tuple:
    """(ok, message) for the answer to any of the weight-update endpoints: ok needs HTTP 200 AND success true
    (SGLang answers 400 with success false; a 200 without `success` is not taken as success)."""
    message = ""
    if isinstance(payload, dict):
        message = str(payload.get("message", payload.get("detail", payload.get("error", ""))))
    else:
        message = str(payload)[:500]
    ok = status == 200 and isinstance(payload, dict) and payload.get("success") is True
    return ok, message
