"""The SGLang rollout engine against a fake SGLang server (stdlib http.server on 127.0.0.1) speaking SGLang's
native schema (python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py, tokenizer_manager.py):
batched /generate with meta_info.output_token_logprobs [[logprob, token_id, null], ...], finish_reason dicts,
completion_tokens, and routed_experts as base64 of int32 [prompt + completion - 1, num_hidden_layers, top_k];
/update_weights_from_disk {success, message}; /flush_cache; memory release/resume; /health.

Covers: the request bodies sent, exact parsing into RolloutOutput (ids, masks, log-probs, routes, dense
layers dropped from routes), n > 1 prompt-major order, eos / finish handling, R3 failures named by sample,
server errors surfacing the server's message, the HF checkpoint written for weight sync (loaded back bit
for bit and by transformers), colocate memory calls, launch without sglang. A GPU test launches a real server.

In-memory weight sync: the fake validates /update_weights_from_tensor, /init_weights_update_group,
/update_weights_from_distributed and /destroy_weights_update_group bodies against SGLang's io_struct fields
(IO_STRUCT below, copied from sgl-project/sglang python/sglang/srt/managers/io_struct.py at 001067ff; unknown
fields are refused, stricter than SGLang, so a misspelt field cannot pass unnoticed). "tensor" sync runs with a
codec that pickles CPU tensors instead of CUDA IPC handles; the fake rebuilds each bucket as SGLang's model
runner does (flattened_bucket dict or [(name, tensor)]). "distributed" sync runs for real over gloo: each fake
server TP rank is a spawned process that joins the group the way SGLang's model_runner does (rendezvous at
tcp://master, store prefixed with group_name) and receives every tensor by broadcast(src=0).
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import pickle
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from megagspo.data.tokenizer import BuiltinTokenizer
from megagspo.rollout.base import SamplingParams
from megagspo.rollout.sglang import (SGLangConfigError, SGLangEngine, SGLangEngineConfig, SGLangLaunchConfig,
                                     SGLangServerError, SGLangUnavailableError)
from megagspo.rollout.sglang.schema import SGLangResponseError
from moe.architecture import Qwen3MoeArchitecture
from moe.parallel import free_port

TOK = BuiltinTokenizer()  # pad 0, bos 1, eos 2, vocab 20
EOS = TOK.eos_id
# layer 0 dense, layers 1 and 2 MoE: SGLang reports routes for all 3 layers, the engine keeps the 2 MoE ones
ARCH = Qwen3MoeArchitecture(vocab_size=TOK.vocab_size, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=4,
                            num_experts_per_tok=2, intermediate_size=12, mlp_only_layers=(0,),
                            max_position_embeddings=64, rope_theta=10000.0)


# ------------------------------------------------------------------------------------------ fake server
def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_str(v):
    return v is None or isinstance(v, str)


# endpoint -> {field: (check, required)}: SGLang io_struct.py (001067ff) request structs, HTTP (JSON) view
IO_STRUCT = {
    "/update_weights_from_tensor": {  # UpdateWeightsFromTensorReqInput
        "serialized_named_tensors": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), True),
        "load_format": (_opt_str, False), "flush_cache": (lambda v: isinstance(v, bool), False),
        "abort_all_requests": (lambda v: isinstance(v, bool), False), "weight_version": (_opt_str, False),
        "disable_draft_model": (lambda v: v is None or isinstance(v, bool), False),
        "torch_empty_cache": (lambda v: isinstance(v, bool), False)},
    "/init_weights_update_group": {  # InitWeightsUpdateGroupReqInput
        "master_address": (lambda v: isinstance(v, str), True), "master_port": (_is_int, True),
        "rank_offset": (_is_int, True), "world_size": (_is_int, True),
        "group_name": (lambda v: isinstance(v, str), False), "backend": (lambda v: isinstance(v, str), False)},
    "/update_weights_from_distributed": {  # UpdateWeightsFromDistributedReqInput
        "names": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), True),
        "dtypes": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), True),
        "shapes": (lambda v: isinstance(v, list) and all(isinstance(x, list) and all(map(_is_int, x)) for x in v),
                   True),
        "group_name": (lambda v: isinstance(v, str), False), "flush_cache": (lambda v: isinstance(v, bool), False),
        "abort_all_requests": (lambda v: isinstance(v, bool), False), "weight_version": (_opt_str, False),
        "load_format": (_opt_str, False), "torch_empty_cache": (lambda v: isinstance(v, bool), False)},
    "/destroy_weights_update_group": {"group_name": (lambda v: isinstance(v, str), False)},
    "/abort_request": {  # AbortReq (BaseReq.rid; http_worker_ipc is internal)
        "rid": (_opt_str, False), "abort_all": (lambda v: isinstance(v, bool), False),
        "finished_reason": (lambda v: v is None or isinstance(v, dict), False), "abort_message": (_opt_str, False)},
}


def schema_errors(path, body):
    spec = IO_STRUCT[path]
    if not isinstance(body, dict):
        return [f"body is {type(body).__name__}, not an object"]
    errors = [f"unknown field {k!r}" for k in body if k not in spec]
    errors += [f"missing field {k!r}" for k, (_, req) in spec.items() if req and k not in body]
    errors += [f"bad value for {k!r}: {body[k]!r}"[:200] for k, (ok, _) in spec.items() if k in body and not ok(body[k])]
    return errors


@dataclass
class FlatMeta:  # the fields of SGLang's FlattenedTensorMetadata
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class CpuCodec:
    """Tensor-sync codec for CPU: pickled CPU tensors (base64) instead of CUDA IPC handles."""
    device = torch.device("cpu")

    def __init__(self):
        self.released = 0

    def flatten(self, pairs):
        assert len({t.dtype for _, t in pairs}) == 1, "one dtype per flattened bucket"
        meta, start = [], 0
        for name, t in pairs:
            meta.append(FlatMeta(name, t.shape, t.dtype, start, start + t.numel(), t.numel()))
            start += t.numel()
        return {"flattened_tensor": torch.cat([t.flatten() for _, t in pairs]), "metadata": meta}

    def serialize(self, obj):
        return base64.b64encode(pickle.dumps(obj)).decode()

    def release(self):
        self.released += 1


def rebuild_named_tensors(entry, load_format):
    """What SGLang's model runner makes of one serialized_named_tensors entry (update_weights_from_tensor)."""
    obj = pickle.loads(base64.b64decode(entry, validate=True))
    if load_format == "flattened_bucket":
        flat = obj["flattened_tensor"]
        return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]
    assert load_format is None, load_format
    return [(name, t) for name, t in obj]


def _sglang_tp_rank(body, tp_rank, conn):
    """One fake server TP rank, as SGLang's model_runner joins and uses the weight-update group."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    torch.set_num_threads(1)
    try:
        rank, world = body["rank_offset"] + tp_rank, body["world_size"]
        timeout = timedelta(seconds=60)
        store, _, _ = next(c10d.rendezvous(f"tcp://{body['master_address']}:{body['master_port']}", rank, world,
                                           timeout=timeout))
        store = c10d.PrefixStore(body["group_name"], store)
        group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(body["backend"]), store,
                                                  group_name=body["group_name"], timeout=timeout)
        c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    except Exception as exc:  # noqa: BLE001
        conn.send(("error", repr(exc)))
        return
    conn.send(("ready", rank))
    while True:
        msg = conn.recv()
        if msg[0] == "destroy":
            dist.destroy_process_group(group)
            conn.send(("ok", None))
            return
        _, names, dtypes, shapes = msg
        weights = [torch.empty(shape, dtype=getattr(torch, dt)) for dt, shape in zip(dtypes, shapes)]
        for work in [dist.broadcast(w, src=0, group=group, async_op=True) for w in weights]:
            work.wait()
        conn.send(("ok", dict(zip(names, weights))))


def scripted_response(ids, occurrence, max_new):
    """The fake model: a deterministic response for (prompt, how many times this prompt came before in the batch)."""
    length = 1 + (sum(ids) + 2 * occurrence) % max_new
    tokens = [3 + (sum(ids) + occurrence + j) % 15 for j in range(length)]
    if (sum(ids) + occurrence) % 2 == 0:  # every other sample ends with eos (kept in output, no_stop_trim)
        tokens[-1] = EOS
    logps = [-0.01 * (1 + j) - 0.1 * occurrence - 0.001 * sum(ids) for j in range(length)]
    return tokens, logps


def scripted_routes(ids, n_tokens):
    positions = len(ids) + n_tokens - 1
    p = np.arange(positions)[:, None, None]
    layer = np.arange(ARCH.num_hidden_layers)[None, :, None]
    k = np.arange(ARCH.num_experts_per_tok)[None, None, :]
    return ((p + sum(ids) + 2 * layer + k) % ARCH.num_experts).astype(np.int32)


class FakeSGLang:
    def __init__(self):
        self.requests = []  # (method, path, body)
        self.mutate = None  # mutate(k, ids, item) -> item, for broken responses
        self.update_result = (200, {"success": True, "message": "Succeeded to update model weights.",
                                    "num_paused_requests": 0})
        self.routes_enabled = True
        self.tp_size = 1
        self.server_info_extra = {}
        self.tensor_fail_at = None      # refuse the k-th /update_weights_from_tensor (0-based)
        self.init_group_result = None   # answer /init_weights_update_group with this instead of joining
        self.received = {}              # tensor / distributed sync: name -> tensor as TP rank 0 rebuilt it
        self.ranks = []                 # distributed: (process, pipe) per TP rank
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, payload):
                raw = b"" if payload is None else (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                fake.requests.append(("GET", self.path, None))
                if self.path == "/health":
                    return self._send(200, b"")
                if self.path == "/get_server_info":
                    return self._send(200, {"enable_return_routed_experts": fake.routes_enabled,
                                            "tp_size": fake.tp_size, "dp_size": 1, "pp_size": 1,
                                            **fake.server_info_extra})
                if self.path == "/get_model_info":
                    return self._send(200, {"model_path": "/x", "is_generation": True})
                if self.path == "/flush_cache":
                    return self._send(200, b"Cache flushed.\n")
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.requests.append(("POST", self.path, body))
                if self.path == "/generate":
                    return self._send(200, fake.generate(body))
                if self.path == "/update_weights_from_disk":
                    return self._send(*fake.update_result)
                if self.path == "/flush_cache":
                    return self._send(200, b"Cache flushed.\n")
                if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                    return self._send(200, None)
                if self.path in IO_STRUCT:
                    errors = schema_errors(self.path, body)
                    if errors:  # FastAPI's answer to a body that does not validate
                        return self._send(422, {"detail": errors})
                    if self.path == "/abort_request":
                        return self._send(*fake.abort_request(body))
                    return self._send(*fake.weight_update(self.path, body))
                self._send(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def generate(self, body):
        sp = body["sampling_params"]
        seen = {}
        out = []
        for k, ids in enumerate(body["input_ids"]):
            occ = seen.get(tuple(ids), 0)
            seen[tuple(ids)] = occ + 1
            tokens, logps = scripted_response(ids, occ, sp["max_new_tokens"])
            finish = ({"type": "stop", "matched": EOS} if tokens[-1] in sp["stop_token_ids"]
                      else {"type": "length", "length": len(tokens)})
            meta = {"id": f"rid-{k}", "finish_reason": finish, "prompt_tokens": len(ids),
                    "completion_tokens": len(tokens), "cached_tokens": 0, "weight_version": "default",
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(logps, tokens)],
                    "input_token_logprobs": [], "output_token_logprobs_length": len(tokens)}
            if body.get("return_routed_experts"):
                meta["routed_experts"] = base64.b64encode(scripted_routes(ids, len(tokens)).tobytes()).decode()
            item = {"output_ids": tokens, "meta_info": meta}
            if self.mutate is not None:
                item = self.mutate(k, ids, item)
            out.append(item)
        return out

    def weight_update(self, path, body):
        ok = {"success": True, "message": "Succeeded to update parameter online."}
        if path == "/update_weights_from_tensor":
            k = len(self.posted(path)) - 1
            if k == self.tensor_fail_at:
                return 400, {"success": False, "message": "Failed to update weights: size mismatch for "
                                                          "model.layers.1.mlp.experts.0.up_proj.weight"}
            entries = body["serialized_named_tensors"]
            if len(entries) != self.tp_size:  # SGLang's TP rank r reads entry r
                return 400, {"success": False, "message": f"{len(entries)} payloads for tp_size {self.tp_size}"}
            per_rank = [rebuild_named_tensors(e, body.get("load_format")) for e in entries]
            for pairs in per_rank[1:]:
                assert [n for n, _ in pairs] == [n for n, _ in per_rank[0]]
                assert all(torch.equal(a, b) for (_, a), (_, b) in zip(pairs, per_rank[0]))
            self.received.update(per_rank[0])
            return 200, ok
        if path == "/init_weights_update_group":
            if self.init_group_result is not None:
                return self.init_group_result
            ctx = mp.get_context("spawn")
            for r in range(self.tp_size):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_sglang_tp_rank, args=(body, r, theirs), daemon=True)
                proc.start()
                self.ranks.append((proc, mine))
            for proc, conn in self.ranks:
                if not conn.poll(120):
                    return 400, {"success": False, "message": "TP rank did not join in time"}
                status, detail = conn.recv()
                if status != "ready":
                    return 400, {"success": False, "message": f"Failed to initialize custom process group: {detail}"}
            return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
        if path == "/update_weights_from_distributed":
            if not self.ranks:
                return 400, {"success": False, "message": "Group weight_update_group not in []. Please call "
                                                          "`init_weights_update_group` first."}
            for _, conn in self.ranks:
                conn.send(("update", body["names"], body["dtypes"], body["shapes"]))
            got = [conn.recv()[1] for _, conn in self.ranks]
            for other in got[1:]:
                assert all(torch.equal(other[k], got[0][k]) for k in got[0])
            self.received.update(got[0])
            return 200, ok
        if path == "/destroy_weights_update_group":
            for proc, conn in self.ranks:
                conn.send(("destroy",))
                conn.recv()
                proc.join(30)
            self.ranks = []
            return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def abort_request(self, body):
        return 200, None  # SGLang: Response(status_code=200), no body; nothing is in flight here

    def posted(self, path):
        return [b for m, p, b in self.requests if m == "POST" and p == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        for proc, _ in self.ranks:  # only the processes this fake started
            if proc.is_alive():
                proc.terminate()
                proc.join(10)


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


def make_engine(fake, tmp_path, **kw):
    cfg = SGLangEngineConfig(urls=[fake.url], sync_dir=str(tmp_path / "sync"), **kw)
    return SGLangEngine(ARCH, TOK, config=cfg)


PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 4, 4, 4, 8]]


def expected(prompts, n, max_new):
    rows = []
    for p in prompts:
        for g in range(n):
            tokens, logps = scripted_response(p, g, max_new)
            rows.append((p, tokens, logps))
    return rows


# ------------------------------------------------------------------------------------------ generate
def test_generate_request_body_matches_sglang_schema(fake, tmp_path):
    eng = make_engine(fake, tmp_path, routing_replay="r3")
    eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9))
    (body,) = fake.posted("/generate")
    assert body["input_ids"] == [p for p in PROMPTS for _ in range(2)]  # prompt-major
    assert body["sampling_params"] == {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                                       "stop_token_ids": [EOS], "skip_special_tokens": False, "no_stop_trim": True}
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["stream"] is False
    assert body["return_routed_experts"] is True
    # attach-time checks: /health, and that the server was started with --enable-return-routed-experts
    assert ("GET", "/health", None) in fake.requests and ("GET", "/get_server_info", None) in fake.requests

    eng2 = make_engine(fake, tmp_path, routing_replay="off")
    eng2.generate([[1, 3]], 1, SamplingParams(max_new_tokens=3, greedy=True))
    body = fake.posted("/generate")[-1]
    assert "return_routed_experts" not in body
    assert body["sampling_params"]["temperature"] == 0.0 and body["sampling_params"]["top_p"] == 1.0


def test_generate_parses_tokens_masks_logps_exactly(fake, tmp_path):
    eng = make_engine(fake, tmp_path)
    max_new, n = 5, 3
    out = eng.generate(PROMPTS, n, SamplingParams(max_new_tokens=max_new))
    rows = expected(PROMPTS, n, max_new)
    assert out.routes_RPLyK is None
    assert out.response_ids_RL.shape == (9, max_new) and out.response_ids_RL.dtype == torch.long
    assert out.prompt_ids == [p for p, _, _ in rows]
    saw_eos = saw_length = False
    for r, (p, tokens, logps) in enumerate(rows):
        length = len(tokens)
        assert out.response_ids_RL[r, :length].tolist() == tokens
        assert (out.response_ids_RL[r, length:] == TOK.pad_id).all()
        assert out.response_mask_RL[r].tolist() == [True] * length + [False] * (max_new - length)
        assert torch.allclose(out.logp_RL[r, :length], torch.tensor(logps, dtype=torch.float32))
        assert (out.logp_RL[r, length:] == 0).all()
        saw_eos |= tokens[-1] == EOS
        saw_length |= tokens[-1] != EOS
    assert saw_eos and saw_length  # both finish kinds are covered


def test_n_samples_are_prompt_major(fake, tmp_path):
    eng = make_engine(fake, tmp_path)
    out = eng.generate([[1, 3], [1, 4]], 4, SamplingParams(max_new_tokens=8))
    assert out.prompt_ids == [[1, 3]] * 4 + [[1, 4]] * 4
    for r in range(8):
        p, g = [[1, 3], [1, 4]][r // 4], r % 4
        tokens, _ = scripted_response(p, g, 8)
        assert out.response_ids_RL[r, :len(tokens)].tolist() == tokens


def test_response_past_eos_is_cut_at_first_eos(fake, tmp_path):
    eng = make_engine(fake, tmp_path)

    def mutate(k, ids, item):  # a server that kept going after eos (e.g. ignore_eos): tokens after it are dropped
        lp = [[-0.5, 5, None], [-0.25, EOS, None], [-0.75, 6, None], [-1.0, 7, None]]
        item["output_ids"] = [5, EOS, 6, 7]
        item["meta_info"].update(output_token_logprobs=lp, completion_tokens=4,
                                 finish_reason={"type": "length", "length": 4})
        return item

    fake.mutate = mutate
    out = eng.generate([[1, 3]], 1, SamplingParams(max_new_tokens=6))
    assert out.response_ids_RL[0].tolist() == [5, EOS, 0, 0, 0, 0]
    assert out.response_mask_RL[0].tolist() == [True, True, False, False, False, False]
    assert out.logp_RL[0].tolist() == [-0.5, -0.25, 0, 0, 0, 0]


def test_batches_are_chunked_and_spread_over_servers(tmp_path):
    a, b = FakeSGLang(), FakeSGLang()
    try:
        cfg = SGLangEngineConfig(urls=[a.url, b.url], sync_dir=str(tmp_path), max_batch=2, routing_replay="r3")
        eng = SGLangEngine(ARCH, TOK, config=cfg)
        prompts = [[1, 5], [1, 6], [1, 7]]
        out = eng.generate(prompts, 2, SamplingParams(max_new_tokens=4))
        sent = [ids for s in (a, b) for body in s.posted("/generate") for ids in body["input_ids"]]
        assert len(a.posted("/generate")) == 2 and len(b.posted("/generate")) == 1
        assert sorted(map(tuple, sent)) == sorted(tuple(p) for p in prompts for _ in range(2))
        # each chunk holds both samples of one prompt, so occurrences (and results) match a single batch
        for r, (p, tokens, _) in enumerate(expected(prompts, 2, 4)):
            assert out.response_ids_RL[r, :len(tokens)].tolist() == tokens
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------------------------------ routes (R3)
def test_routes_are_laid_out_as_rollout_output_expects(fake, tmp_path):
    eng = make_engine(fake, tmp_path, routing_replay="r3")
    max_new, n = 5, 2
    out = eng.generate(PROMPTS, n, SamplingParams(max_new_tokens=max_new))
    routes = out.routes_RPLyK
    max_prompt = max(map(len, PROMPTS))
    assert routes.shape == (6, max_prompt + max_new - 1, ARCH.num_moe_layers, ARCH.num_experts_per_tok)
    assert routes.dtype == torch.int16
    for r, (p, tokens, _) in enumerate(expected(PROMPTS, n, max_new)):
        fed = len(p) + len(tokens) - 1  # prompt + response[:-1]
        want = torch.from_numpy(scripted_routes(p, len(tokens))[:, [1, 2]].astype(np.int16))  # MoE layers 1, 2
        assert torch.equal(routes[r, :fed], want)
        assert (routes[r, fed:] == -1).all()


def test_record_routes_true_asks_for_routes_like_r3(fake, tmp_path):
    cfg = SGLangEngineConfig(urls=[fake.url], sync_dir=str(tmp_path))
    eng = SGLangEngine(ARCH, TOK, record_routes=True, config=cfg)  # the trainer's constructor call
    out = eng.generate([[1, 3]], 1, SamplingParams(max_new_tokens=3))
    assert out.routes_RPLyK is not None and fake.posted("/generate")[0]["return_routed_experts"] is True
    with pytest.raises(SGLangConfigError, match="record_routes=False"):
        SGLangEngine(ARCH, TOK, record_routes=False, config=SGLangEngineConfig(
            urls=[fake.url], sync_dir=str(tmp_path), routing_replay="r3"))


def test_r3_missing_routes_fails_naming_the_sample(fake, tmp_path):
    eng = make_engine(fake, tmp_path, routing_replay="r3")

    def mutate(k, ids, item):
        if k == 4:
            del item["meta_info"]["routed_experts"]
        return item

    fake.mutate = mutate
    with pytest.raises(SGLangResponseError, match=r"sample 4 \(prompt 2, sample 0 of 2\).*no routed_experts"):
        eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize("breakage", ["one_position_short", "wrong_layers", "not_base64", "bad_expert_id"])
def test_r3_malformed_routes_fail_naming_the_sample(fake, tmp_path, breakage):
    eng = make_engine(fake, tmp_path, routing_replay="r3")

    def mutate(k, ids, item):
        if k != 3:
            return item
        n_tok = len(item["output_ids"])
        arr = scripted_routes(ids, n_tok)
        if breakage == "one_position_short":  # route length not matching the sequence (ms-swift #9799)
            arr = arr[:-1]
        elif breakage == "wrong_layers":
            arr = np.concatenate([arr, arr[:, :1]], axis=1)
        elif breakage == "bad_expert_id":
            arr = arr.copy()
            arr[0, 1, 0] = ARCH.num_experts
        value = base64.b64encode(arr.tobytes()).decode()
        item["meta_info"]["routed_experts"] = "@@not-base64@@" if breakage == "not_base64" else value
        return item

    fake.mutate = mutate
    with pytest.raises(SGLangResponseError, match=r"sample 3 \(prompt 1, sample 1 of 2\)"):
        eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4))


def test_r3_refuses_a_server_started_without_routed_experts(fake, tmp_path):
    fake.routes_enabled = False
    with pytest.raises(SGLangConfigError, match="--enable-return-routed-experts"):
        make_engine(fake, tmp_path, routing_replay="r3")


def test_malformed_generate_responses_fail_clearly(fake, tmp_path):
    eng = make_engine(fake, tmp_path)
    cases = {
        "aborted": (lambda item: item["meta_info"].update(finish_reason={"type": "abort", "message": "OOM"}),
                    "aborted the request: OOM"),
        "unfinished": (lambda item: item["meta_info"].update(finish_reason=None), "did not finish"),
        "no_logprobs": (lambda item: item["meta_info"].pop("output_token_logprobs"), "output_token_logprobs missing"),
        "count": (lambda item: item["meta_info"].update(completion_tokens=99), "completion_tokens = 99"),
        "ids": (lambda item: item.update(output_ids=[7]), "output_ids"),
    }
    for name, (change, message) in cases.items():
        def mutate(k, ids, item, change=change):
            if k == 1:
                change(item)
            return item

        fake.mutate = mutate
        with pytest.raises(SGLangResponseError, match=r"sample 1 .*" + message):
            eng.generate([[1, 3], [1, 4]], 1, SamplingParams(max_new_tokens=5))


def test_tempered_logprobs_are_refused(fake, tmp_path):
    eng = make_engine(fake, tmp_path, original_logprob=False)
    with pytest.raises(SGLangConfigError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        eng.generate([[1, 3]], 1, SamplingParams(max_new_tokens=3, temperature=0.7))
    eng.generate([[1, 3]], 1, SamplingParams(max_new_tokens=3, temperature=1.0))  # identical at temperature 1


# ------------------------------------------------------------------------------------------ weights
def random_megatron_state(seed=0):
    from moe.hf_checkpoint import FUSED, hf_tensor_shapes, megatron_state_dict_from_hf

    g = torch.Generator().manual_seed(seed)
    hf = {k: torch.randn(shape, generator=g) * 0.1 for k, shape in hf_tensor_shapes(ARCH, FUSED).items()}
    return megatron_state_dict_from_hf(hf, ARCH)


def test_update_weights_writes_loadable_hf_checkpoint_and_calls_server(fake, tmp_path):
    from safetensors.torch import load_file

    from moe.hf_checkpoint import megatron_state_dict_from_hf

    eng = make_engine(fake, tmp_path)
    full = random_megatron_state()
    eng.update_weights(full)
    (body,) = fake.posted("/update_weights_from_disk")
    path = Path(body["model_path"])
    assert path.parent == tmp_path / "sync" and body["weight_version"] == "1" and "load_format" not in body
    assert len(fake.posted("/flush_cache")) == 1
    # the checkpoint round-trips bit for bit (per-expert layout, as hub checkpoints and SGLang's loader have it)
    loaded = {}
    for f in sorted(path.glob("*.safetensors")):
        loaded.update(load_file(str(f)))
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in loaded
    back = megatron_state_dict_from_hf(loaded, ARCH)
    assert sorted(back) == sorted(full) and all(torch.equal(back[k], full[k]) for k in full)
    # and transformers loads it as a Qwen3-MoE model with the same tensors
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(str(path))
    assert torch.equal(model.model.embed_tokens.weight, full["embedding.word_embeddings.weight"])
    assert torch.equal(model.model.layers[1].mlp.gate.weight, full["decoder.layers.1.mlp.router.weight"])
    # a second sync goes to a fresh folder and removes the previous one
    eng.update_weights(random_megatron_state(1))
    second = Path(fake.posted("/update_weights_from_disk")[-1]["model_path"])
    assert second != path and second.exists() and not path.exists()


def test_sharded_checkpoint_has_an_index(fake, tmp_path):
    eng = make_engine(fake, tmp_path)
    path = eng.write_hf_checkpoint(random_megatron_state(), max_shard_bytes=4096)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files


def test_update_weights_failure_raises_with_server_message(fake, tmp_path):
    eng = make_engine(fake, tmp_path, load_format="auto")
    fake.update_result = (400, {"success": False, "message": "Failed to get weights iterator: size mismatch for "
                                "model.layers.1.mlp.gate.weight", "num_paused_requests": 0})
    with pytest.raises(SGLangServerError, match="size mismatch for model.layers.1.mlp.gate.weight"):
        eng.update_weights(random_megatron_state())
    assert fake.posted("/update_weights_from_disk")[0]["load_format"] == "auto"
    assert fake.posted("/flush_cache") == []
    assert list((tmp_path / "sync").iterdir()) == []  # the rejected checkpoint is not left behind
    fake.update_result = (200, {"success": False, "message": "quietly failed"})  # 200 but success false
    with pytest.raises(SGLangServerError, match="quietly failed"):
        eng.update_weights(random_megatron_state())


def test_colocate_releases_and_resumes_memory(fake, tmp_path):
    eng = make_engine(fake, tmp_path, colocate=True)
    eng.release_memory()
    eng.release_memory()  # idempotent
    eng.update_weights(random_megatron_state())  # resumes first: weights must be on the GPU to be loaded
    paths = [p for m, p, _ in fake.requests if m == "POST"]
    assert paths == ["/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk",
                     "/flush_cache"]
    no_colocate = make_engine(fake, tmp_path)
    with pytest.raises(SGLangConfigError, match="colocate"):
        no_colocate.release_memory()


# ------------------------------------------------------------------------------------------ config, launch
def test_config_errors_name_the_field(tmp_path):
    cases = [
        (dict(), "sglang.urls"),
        (dict(urls=["http://h:1"], launch=SGLangLaunchConfig(model_path="/m"), sync_dir="/s"), "sglang.urls"),
        (dict(urls=["h:1"], sync_dir="/s"), "sglang.urls"),
        (dict(urls=["http://h:1"], sync_dir="/s", routing_replay="r2"), "sglang.routing_replay"),
        (dict(urls=["http://h:1"], sync_dir="/s", weight_sync="nccl"), "sglang.weight_sync"),
        (dict(urls=["http://h:1"]), "sglang.sync_dir"),
        (dict(urls=["http://h:1"], sync_dir="/s", timeout_s=0), "sglang.timeout_s"),
        (dict(urls=["http://h:1"], sync_dir="/s", max_batch=0), "sglang.max_batch"),
        (dict(urls=["http://h:1"], weight_sync="tensor", bucket_bytes=0), "sglang.bucket_bytes"),
        (dict(urls=["http://h:1"], weight_sync="tensor", sync_dtype="fp8"), "sglang.sync_dtype"),
        (dict(urls=["http://h:1"], weight_sync="tensor", ipc_format="dict"), "sglang.ipc_format"),
        (dict(urls=["http://h:1"], weight_sync="distributed", dist_backend="mpi"), "sglang.dist_backend"),
        (dict(urls=["http://h:1"], weight_sync="distributed", master_port=70000), "sglang.master_port"),
        (dict(urls=["http://h:1"], weight_sync="distributed", group_name=""), "sglang.group_name"),
        (dict(urls=["http://h:1"], weight_sync="tensor", load_format="auto"), "sglang.load_format"),
    ]
    for kwargs, name in cases:
        with pytest.raises(SGLangConfigError, match=name.replace(".", r"\.")):
            SGLangEngineConfig(**kwargs)
    with pytest.raises(SGLangConfigError, match="disk, tensor, distributed; got 'nccl'"):
        SGLangEngineConfig(urls=["http://h:1"], weight_sync="nccl")
    with pytest.raises(SGLangConfigError, match=r"sglang\.launch\.tp_size"):
        SGLangLaunchConfig(model_path="/m", tp_size=0)
    with pytest.raises(SGLangConfigError, match="needs an SGLangEngineConfig"):
        SGLangEngine(ARCH, TOK, record_routes=True)


def test_unreachable_server_is_a_clear_error(tmp_path):
    port = free_port()  # free now, and nothing listens on it
    with pytest.raises(SGLangServerError, match=f"cannot reach SGLang server at http://127.0.0.1:{port}/health"):
        SGLangEngine(ARCH, TOK, config=SGLangEngineConfig(urls=[f"http://127.0.0.1:{port}"], sync_dir=str(tmp_path),
                                                          timeout_s=5))


def test_launch_without_sglang_says_pip_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    cfg = SGLangEngineConfig(launch=SGLangLaunchConfig(model_path=str(tmp_path)), sync_dir=str(tmp_path))
    with pytest.raises(SGLangUnavailableError, match="pip install sglang"):
        SGLangEngine(ARCH, TOK, config=cfg)


def test_registry_returns_the_engine():
    from megagspo.rollout.base import get_engine_class

    assert get_engine_class("sglang") is SGLangEngine


# ------------------------------------------------------------------------------------------ in-memory weight sync
def expected_hf(state, dtype=None):
    from moe.hf_checkpoint import PER_EXPERT, hf_state_dict_from_megatron

    hf = hf_state_dict_from_megatron(state, ARCH, PER_EXPERT)
    return {k: (t if dtype is None else t.to(dtype)) for k, t in hf.items()}


def test_plan_buckets_caps_bytes_splits_dtypes_keeps_order():
    from megagspo.rollout.weight_sync import plan_buckets

    f32, bf16 = torch.float32, torch.bfloat16
    sizes = [("a", f32, 40), ("b", f32, 50), ("c", f32, 20), ("d", bf16, 10), ("e", bf16, 300), ("f", bf16, 30),
             ("g", f32, 100), ("h", f32, 1)]
    buckets = plan_buckets(sizes, 100)
    assert buckets == [[0, 1], [2], [3], [4], [5], [6], [7]]
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    assert plan_buckets(sizes[:3], 10**6) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="cap_bytes"):
        plan_buckets(sizes, 0)


@pytest.mark.parametrize("ipc_format", ["flattened_bucket", "named_tensors"])
def test_tensor_sync_posts_capped_buckets_per_tp_rank(fake, tmp_path, ipc_format):
    fake.tp_size = 2
    codec = CpuCodec()
    cap = 3000
    cfg = SGLangEngineConfig(urls=[fake.url], weight_sync="tensor", bucket_bytes=cap, sync_dtype="bfloat16",
                             ipc_format=ipc_format)
    eng = SGLangEngine(ARCH, TOK, config=cfg, ipc_codec=codec)
    state = random_megatron_state(3)
    eng.update_weights(state)
    bodies = fake.posted("/update_weights_from_tensor")
    want = expected_hf(state, torch.bfloat16)
    assert len(bodies) > 3 and codec.released == len(bodies)
    assert sorted(fake.received) == sorted(want)  # every HF tensor (per-expert names) arrived once ...
    assert all(fake.received[k].dtype == torch.bfloat16 and torch.equal(fake.received[k], want[k]) for k in want)
    sent_order = []
    for i, body in enumerate(bodies):
        last = i == len(bodies) - 1
        assert body["load_format"] == (None if ipc_format == "named_tensors" else "flattened_bucket")
        assert body["flush_cache"] is last  # one cache flush, after the last bucket
        assert body.get("weight_version") == ("1" if last else None)
        pairs = rebuild_named_tensors(body["serialized_named_tensors"][0], body["load_format"])
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        assert nbytes <= cap or len(pairs) == 1  # ... in buckets under the cap (a bigger tensor alone)
        sent_order += [n for n, _ in pairs]
    assert sent_order == list(want)  # in HF state-dict order
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in sent_order
    assert fake.posted("/update_weights_from_disk") == [] and fake.posted("/flush_cache") == []
    eng.update_weights(random_megatron_state(4))
    assert fake.posted("/update_weights_from_tensor")[-1]["weight_version"] == "2"


def test_tensor_sync_refused_bucket_raises_with_server_message(fake, tmp_path):
    fake.tensor_fail_at = 1
    cfg = SGLangEngineConfig(urls=[fake.url], weight_sync="tensor", bucket_bytes=2000)
    eng = SGLangEngine(ARCH, TOK, config=cfg, ipc_codec=CpuCodec())
    with pytest.raises(SGLangServerError, match=r"bucket 2/\d+ \(.*size mismatch for "
                                                r"model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight"):
        eng.update_weights(random_megatron_state())
    assert len(fake.posted("/update_weights_from_tensor")) == 2  # nothing sent after the refusal


def test_tensor_sync_needs_this_host_cuda_and_sglang(fake, tmp_path, monkeypatch):
    import importlib.util

    with pytest.raises(SGLangConfigError, match=r"192\.0\.2\.7 is not this host.*'distributed'"):
        SGLangEngine(ARCH, TOK, ipc_codec=CpuCodec(), config=SGLangEngineConfig(
            urls=["http://192.0.2.7:30000"], weight_sync="tensor", health_check=False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SGLangUnavailableError, match="CUDA is not available"):
        SGLangEngine(ARCH, TOK, config=SGLangEngineConfig(urls=[fake.url], weight_sync="tensor"))
    if importlib.util.find_spec("sglang") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(SGLangUnavailableError, match="pip install sglang"):
            SGLangEngine(ARCH, TOK, config=SGLangEngineConfig(urls=[fake.url], weight_sync="tensor"))
    with pytest.raises(SGLangUnavailableError, match="CUDA/NCCL is not available"):
        SGLangEngine(ARCH, TOK, config=SGLangEngineConfig(urls=[fake.url], weight_sync="distributed"))
    with pytest.raises(SGLangConfigError, match="ipc_codec applies to sglang.weight_sync = 'tensor' only"):
        SGLangEngine(ARCH, TOK, ipc_codec=CpuCodec(), config=SGLangEngineConfig(urls=[fake.url], sync_dir=str(tmp_path)))


def test_in_memory_sync_refuses_data_parallel_servers(fake):
    fake.server_info_extra = {"dp_size": 2}
    with pytest.raises(SGLangConfigError, match="dp_size=2"):
        SGLangEngine(ARCH, TOK, ipc_codec=CpuCodec(), config=SGLangEngineConfig(urls=[fake.url], weight_sync="tensor"))
    fake.server_info_extra = {"dp_size": 2, "enable_dp_attention": True}  # SGLang takes tensor updates then
    SGLangEngine(ARCH, TOK, ipc_codec=CpuCodec(), config=SGLangEngineConfig(urls=[fake.url], weight_sync="tensor"))


@pytest.mark.multiprocess
def test_distributed_sync_broadcasts_to_every_server_rank_over_gloo(tmp_path):
    """Two servers (TP 1 and TP 2): one group of 4 ranks (trainer = 0, offsets 1 and 2), every tensor broadcast
    to all three server ranks in the announced order, dtypes and shapes."""
    a, b = FakeSGLang(), FakeSGLang()
    b.tp_size = 2
    cfg = SGLangEngineConfig(urls=[a.url, b.url], weight_sync="distributed", dist_backend="gloo",
                             group_name="test_dist_sync", bucket_bytes=4000, sync_dtype="bfloat16", timeout_s=180)
    eng = SGLangEngine(ARCH, TOK, config=cfg)
    try:
        state = random_megatron_state(5)
        eng.update_weights(state)
        (init_a,), (init_b,) = a.posted("/init_weights_update_group"), b.posted("/init_weights_update_group")
        assert init_a["master_address"] == "127.0.0.1" and init_a["master_port"] == init_b["master_port"] > 0
        assert (init_a["rank_offset"], init_b["rank_offset"]) == (1, 2)
        assert init_a["world_size"] == init_b["world_size"] == 4
        assert init_a["group_name"] == "test_dist_sync" and init_a["backend"] == "gloo"
        want = expected_hf(state, torch.bfloat16)
        for fake in (a, b):
            bodies = fake.posted("/update_weights_from_distributed")
            assert len(bodies) > 3
            assert [n for body in bodies for n in body["names"]] == list(want)
            for i, body in enumerate(bodies):
                last = i == len(bodies) - 1
                assert body["flush_cache"] is last and body.get("weight_version") == ("1" if last else None)
                assert body["group_name"] == "test_dist_sync" and "load_format" not in body
                assert body["dtypes"] == ["bfloat16"] * len(body["names"])
                assert body["shapes"] == [list(want[n].shape) for n in body["names"]]
                nbytes = sum(want[n].numel() * 2 for n in body["names"])
                assert nbytes <= 4000 or len(body["names"]) == 1
            assert sorted(fake.received) == sorted(want)
            assert all(torch.equal(fake.received[k], want[k]) for k in want)
        # the second update reuses the group
        state2 = random_megatron_state(6)
        eng.update_weights(state2)
        assert len(a.posted("/init_weights_update_group")) == 1
        want2 = expected_hf(state2, torch.bfloat16)
        assert all(torch.equal(b.received[k], want2[k]) for k in want2)
        assert b.posted("/update_weights_from_distributed")[-1]["weight_version"] == "2"
        eng.close()
        assert a.posted("/destroy_weights_update_group") == [{"group_name": "test_dist_sync"}]
        assert b.ranks == []
    finally:
        eng.close()
        a.close()
        b.close()


def test_distributed_sync_init_refused_fails_fast(fake):
    fake.init_group_result = (400, {"success": False, "message": "Failed to initialize custom process group: "
                                                                 "NCCL error: unhandled system error"})
    cfg = SGLangEngineConfig(urls=[fake.url], weight_sync="distributed", dist_backend="gloo",
                             group_name="test_dist_refused", timeout_s=20)
    eng = SGLangEngine(ARCH, TOK, config=cfg)
    with pytest.raises(SGLangServerError, match="init_weights_update_group .* failed on .*NCCL error"):
        eng.update_weights(random_megatron_state())
    assert fake.posted("/update_weights_from_distributed") == []
    with pytest.raises(SGLangServerError, match="broke in an earlier update"):
        eng.update_weights(random_megatron_state())


def test_only_rank_zero_sends_then_all_ranks_wait(fake, tmp_path, monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    def broadcast(box, src=0, **kwargs):
        calls.append(("broadcast", src, list(box)))
        if dist.get_rank() != 0:
            box[0] = (True, None)  # what rank 0 sends after a successful update

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    eng = SGLangEngine(ARCH, TOK, ipc_codec=CpuCodec(), config=SGLangEngineConfig(urls=[fake.url], weight_sync="tensor"))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    eng.update_weights(random_megatron_state())
    assert fake.posted("/update_weights_from_tensor") == [] and calls == [("broadcast", 0, [None])]
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    eng.update_weights(random_megatron_state())
    # rank 0 reports success (and no result) to the others after sending
    assert len(fake.posted("/update_weights_from_tensor")) == 1 and calls[1] == ("broadcast", 0, [(True, None)])


def _update_weights_on_ranks_body(rank, world_size, url, sync_dir):
    eng = SGLangEngine(ARCH, TOK, config=SGLangEngineConfig(urls=[url], sync_dir=sync_dir))
    results = []
    for seed in (0, 1):  # the fake accepts the first update and refuses the second
        try:
            eng.update_weights(random_megatron_state(seed))
            results.append(None)
        except Exception as exc:  # noqa: BLE001 - the error each rank raised is the result
            results.append((type(exc).__name__, str(exc)))
    return results


class _RefuseSecondUpdate(FakeSGLang):
    """Accepts the first /update_weights_from_disk and refuses the later ones."""
    accepted = None

    @property
    def update_result(self):
        if len(self.posted("/update_weights_from_disk")) <= 1:
            return self.accepted
        return 400, {"success": False, "message": "Failed to get weights iterator: size mismatch for "
                                                  "model.layers.1.mlp.gate.weight"}

    @update_result.setter
    def update_result(self, value):
        self.accepted = value


@pytest.mark.multiprocess
def test_rank_zero_update_failure_raises_on_every_rank(tmp_path):
    """2 gloo ranks: only rank 0 talks to the server. When the server refuses the update, rank 0 raises the
    server's error and rank 1 raises SGLangServerError naming rank 0's failure, instead of waiting forever
    for rank 0 at the end of the update."""
    from multiprocess import run_distributed

    fake = _RefuseSecondUpdate()
    try:
        reports = run_distributed(_update_weights_on_ranks_body, world_size=2, args=(fake.url, str(tmp_path / "sync")),
                                  timeout_s=120)
    finally:
        fake.close()
    assert len(fake.posted("/update_weights_from_disk")) == 2  # rank 0's two updates only
    (ok0, err0), (ok1, err1) = reports
    assert ok0 is None and ok1 is None
    assert err0[0] == err1[0] == "SGLangServerError", (err0, err1)
    assert "size mismatch for model.layers.1.mlp.gate.weight" in err0[1] and "rank 0" not in err0[1]
    assert "rank 0" in err1[1] and "size mismatch for model.layers.1.mlp.gate.weight" in err1[1], err1


def test_weight_update_bodies_validate_against_io_struct():
    from megagspo.rollout.sglang.schema import (destroy_weights_update_group_json, init_weights_update_group_json,
                                                update_weights_from_distributed_json, update_weights_from_tensor_json)

    bodies = {
        "/update_weights_from_tensor": update_weights_from_tensor_json(["YQ==", "Yg=="], "flattened_bucket", False, "3"),
        "/init_weights_update_group": init_weights_update_group_json("10.0.0.1", 29500, 1, 3, "g", "nccl"),
        "/update_weights_from_distributed": update_weights_from_distributed_json(
            ["model.norm.weight"], ["bfloat16"], [torch.Size([16])], "g", True, None),
        "/destroy_weights_update_group": destroy_weights_update_group_json("g"),
    }
    for path, body in bodies.items():
        assert schema_errors(path, body) == [], path
        json.dumps(body)
    assert schema_errors("/update_weights_from_tensor", {"serialized_named_tensor": []}) == [
        "unknown field 'serialized_named_tensor'", "missing field 'serialized_named_tensors'"]
    with pytest.raises(ValueError, match="rank_offset"):
        init_weights_update_group_json("h", 1, 0, 3, "g", "nccl")
    with pytest.raises(ValueError, match="one length"):
        update_weights_from_distributed_json(["a", "b"], ["float32"], [[1]], "g", True, None)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_real_server_tiny_model(tmp_path):
    """Launch `python -m sglang.launch_server` on a tiny random Qwen3-MoE checkpoint: generate with R3, check
    tokens / log-probs / routes against transformers teacher-forced on the same tokens, then sync weights."""
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import Qwen3MoeForCausalLM

    from moe.hf_checkpoint import FUSED, hf_tensor_shapes, megatron_state_dict_from_hf
    from moe.hf_config import hf_config_from_architecture

    arch = Qwen3MoeArchitecture(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0)
    g = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(s, generator=g) * (1.0 if "norm" in k else 0.3) for k, s in hf_tensor_shapes(arch, FUSED).items()}
    state = megatron_state_dict_from_hf(hf, arch)
    # the initial model folder: the engine's own writer, used before the server exists
    seed_cfg = SGLangEngineConfig(urls=["http://127.0.0.1:1"], sync_dir=str(tmp_path / "init"), health_check=False)
    model_dir = SGLangEngine(arch, TOK, config=seed_cfg).write_hf_checkpoint(state)
    assert json.loads((model_dir / "config.json").read_text()) == hf_config_from_architecture(arch, dtype="float32")
    cfg = SGLangEngineConfig(launch=SGLangLaunchConfig(model_path=str(model_dir), port=31234, mem_fraction_static=0.3,
                                                       extra_args=("--disable-cuda-graph",)),
                             sync_dir=str(tmp_path / "sync"), routing_replay="r3", timeout_s=300)
    with SGLangEngine(arch, TOK, config=cfg) as eng:
        prompts = [[1, 5, 6, 7, 8], [1, 9, 10]]
        out = eng.generate(prompts, 2, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert out.routes_RPLyK.shape == (4, 5 + 8 - 1, 2, 2)
        assert (out.logp_RL[out.response_mask_RL] <= 0).all()
        for r in range(4):  # routes: valid expert ids on every fed position, -1 after
            fed = len(out.prompt_ids[r]) + int(out.response_mask_RL[r].sum()) - 1
            assert ((out.routes_RPLyK[r, :fed] >= 0) & (out.routes_RPLyK[r, :fed] < 8)).all()
            assert (out.routes_RPLyK[r, fed:] == -1).all()
        # log-probs: temperature-1 log-softmax of the same model (the server computes in bf16)
        model = Qwen3MoeForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        for r in range(4):
            resp = out.response_ids_RL[r][out.response_mask_RL[r]].tolist()
            ids = torch.tensor([out.prompt_ids[r] + resp])
            with torch.no_grad():
                logits = model(ids).logits[0].float()
            lp = torch.log_softmax(logits, -1)[len(out.prompt_ids[r]) - 1:-1].gather(-1, torch.tensor(resp)[:, None])
            assert torch.allclose(lp[:, 0], out.logp_RL[r, :len(resp)], atol=0.1)
        eng.update_weights(state)
        eng.generate(prompts, 1, SamplingParams(max_new_tokens=4))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_real_server_in_memory_weight_sync(tmp_path, mode):
    """Launch a real server on weights A, sync weights B in memory (tensor: CUDA IPC from this process's GPU;
    distributed: NCCL group with the server), then the server's greedy log-probs must be B's (transformers,
    teacher-forced) and not A's."""
    pytest.importorskip("sglang", reason="needs the sglang package (GPU hosts)")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import Qwen3MoeForCausalLM

    from moe.hf_checkpoint import FUSED, hf_tensor_shapes, megatron_state_dict_from_hf

    arch = Qwen3MoeArchitecture(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0)

    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return megatron_state_dict_from_hf({k: torch.randn(s, generator=g) * (1.0 if "norm" in k else 0.3)
                                            for k, s in hf_tensor_shapes(arch, FUSED).items()}, arch)

    state_a, state_b = state(0), state(1)
    writer = SGLangEngine(arch, TOK, config=SGLangEngineConfig(urls=["http://127.0.0.1:1"], health_check=False,
                                                               sync_dir=str(tmp_path / "w")))
    dir_a, dir_b = writer.write_hf_checkpoint(state_a), writer.write_hf_checkpoint(state_b)
    cfg = SGLangEngineConfig(launch=SGLangLaunchConfig(model_path=str(dir_a), port=31240, mem_fraction_static=0.3,
                                                       extra_args=("--disable-cuda-graph",)),
                             weight_sync=mode, bucket_bytes=64 * 1024, timeout_s=300)
    prompts = [[1, 5, 6, 7, 8], [1, 9, 10]]
    with SGLangEngine(arch, TOK, config=cfg) as eng:
        eng.update_weights({k: v.cuda() for k, v in state_b.items()})
        out = eng.generate(prompts, 1, SamplingParams(max_new_tokens=6, greedy=True))
    for path, should_match in ((dir_b, True), (dir_a, False)):
        model = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        close = []
        for r in range(len(prompts)):
            resp = out.response_ids_RL[r][out.response_mask_RL[r]].tolist()
            with torch.no_grad():
                logits = model(torch.tensor([out.prompt_ids[r] + resp])).logits[0]
            lp = torch.log_softmax(logits, -1)[len(out.prompt_ids[r]) - 1:-1].gather(-1, torch.tensor(resp)[:, None])
            close.append(torch.allclose(lp[:, 0], out.logp_RL[r, :len(resp)], atol=0.1))
        assert all(close) == should_match, (path, close)
