"""Partial rollouts on the SGLang engine (generate(..., switch=WeightSwitch)): abort and resume, against a slow
fake SGLang server.

SlowSGLang decodes like a server's decode batch: one token per step for every unfinished item of a /generate
request, a few ms apart, and /abort_request {abort_all} makes its in-flight requests return at their next step
with what they have (finish_reason abort), as SGLang's scheduler does. Its model: the next token depends only on
the last one (3, 4, ..., 17, then eos), so a resumed sample continues exactly where an uninterrupted one would;
its log-probs and routes encode the weight version it holds (the number of weight updates it received), so each
token's log-prob proves which version sampled it. `hold_after` steps make the cut deterministic: the fake then
waits for an abort, and the test's switch turns pending exactly then.
"""

from __future__ import annotations

import base64
import os
import threading
import time

import numpy as np
import pytest
import torch

from megagspo.rollout.base import SamplingParams
from megagspo.rollout.sglang import SGLangConfigError, SGLangEngine, SGLangEngineConfig, SGLangServerError
from megagspo.rollout.sglang.schema import SGLangResponseError, abort_request_json
from test_sglang_engine import ARCH, EOS, TOK, FakeSGLang, random_megatron_state, schema_errors

STEP_S = 0.003
OLD, NEW = 5, 6  # the switch's versions before and after the update


def next_token(seq):
    return EOS if seq[-1] == 17 else seq[-1] + 1 if 3 <= seq[-1] < 17 else 3


def fake_logp(version, context_len):
    """The fake's log-prob of the token after `context_len` tokens, under the weights of its `version`."""
    return -0.1 * (1 + version) - 0.001 * context_len


def fake_routes(n_fed, version):
    p = np.arange(n_fed)[:, None, None]
    layer = np.arange(ARCH.num_hidden_layers)[None, :, None]
    k = np.arange(ARCH.num_experts_per_tok)[None, None, :]
    return ((p + version + 2 * layer + k) % ARCH.num_experts).astype(np.int32)


def uninterrupted(prompt, max_new):
    seq, out = list(prompt), []
    while len(out) < max_new and (not out or out[-1] != EOS):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


class SlowSGLang(FakeSGLang):
    def __init__(self, hold_after=None, rehold=False, hold_timeout=5.0, abort_wins_last_step=False):
        self._update_result = None
        self.updates_in_flight = 0      # weight updates that arrived while a /generate was running
        self.in_flight = 0
        super().__init__()
        self.lock = threading.Lock()
        self.abort_epoch = 0
        self.steps = 0                  # decode steps run, all requests
        self.hold_after = hold_after    # after this many steps, wait (up to hold_timeout) for an abort
        self.rehold = rehold            # hold again in every later request (a server that never gets going)
        self.hold_timeout = hold_timeout
        # SGLang checks a pending abort before eos / length: an item that finished in the step the abort caught
        # reports abort (with all its tokens)
        self.abort_wins_last_step = abort_wins_last_step
        self.holding = threading.Event()
        self.abort_answer = (200, None)
        self.threads_seen = set()       # names of the client process's threads while generating

    @property
    def update_result(self):  # read by the handler at each /update_weights_from_disk
        self.updates_in_flight += self.in_flight > 0
        return self._update_result

    @update_result.setter
    def update_result(self, value):
        self._update_result = value

    @property
    def version(self):
        return len(self.posted("/update_weights_from_disk"))

    def abort_request(self, body):
        assert body == abort_request_json()
        if self.abort_answer[0] == 200:
            with self.lock:
                self.abort_epoch += 1
        return self.abort_answer

    def _hold(self, epoch):
        self.holding.set()
        deadline = time.monotonic() + self.hold_timeout
        while self.abort_epoch == epoch and time.monotonic() < deadline:
            time.sleep(0.001)
        self.holding.clear()
        if not self.rehold:
            self.hold_after = None

    def generate(self, body):
        self.in_flight += 1
        try:
            return self._generate(body)
        finally:
            self.in_flight -= 1

    def _generate(self, body):
        self.threads_seen.update(t.name for t in threading.enumerate())
        ids_list = body["input_ids"]
        sps = body["sampling_params"]
        sps = sps if isinstance(sps, list) else [sps] * len(ids_list)
        epoch, version = self.abort_epoch, self.version
        seqs = [list(ids) for ids in ids_list]
        outs, lps = [[] for _ in ids_list], [[] for _ in ids_list]
        finish = [None] * len(ids_list)
        finished_at = [None] * len(ids_list)
        while any(f is None for f in finish):
            if self.hold_after is not None and self.steps >= self.hold_after:
                self._hold(epoch)
            if self.abort_epoch != epoch:
                if self.abort_wins_last_step:
                    finish = [None if at == self.steps else f for f, at in zip(finish, finished_at)]
                break
            time.sleep(STEP_S)
            self.steps += 1
            for i, seq in enumerate(seqs):
                if finish[i] is not None:
                    continue
                tok = next_token(seq)
                lps[i].append(fake_logp(version, len(seq)))
                outs[i].append(tok)
                seq.append(tok)
                finished_at[i] = self.steps
                if tok in sps[i]["stop_token_ids"]:
                    finish[i] = {"type": "stop", "matched": tok}
                elif len(outs[i]) >= sps[i]["max_new_tokens"]:
                    finish[i] = {"type": "length", "length": len(outs[i])}
        return [self._item(ids, outs[i], lps[i], finish[i], version, body.get("return_routed_experts"))
                for i, ids in enumerate(ids_list)]

    @staticmethod
    def _item(ids, tokens, logps, finish, version, routes):
        if finish is None and not tokens:  # aborted in the waiting queue: no prompt_tokens, no log-probs
            return {"output_ids": [], "meta_info": {"id": "rid", "completion_tokens": 0,
                                                    "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}}
        finish = finish or {"type": "abort", "message": "Abort before finishing", "status_code": None}
        meta = {"id": "rid", "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(tokens),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logps, tokens)]}
        if routes:
            meta["routed_experts"] = base64.b64encode(fake_routes(len(ids) + len(tokens) - 1, version).tobytes()).decode()
        return {"output_ids": tokens, "meta_info": meta}


class ScriptedSwitch:
    """A WeightSwitch whose new weights arrive when `fire()` says so; apply loads a tiny random state."""

    def __init__(self, fire, version=OLD):
        self.version = version
        self.fire = fire
        self.arrived = False  # newer weights stay pending until applied
        self.applied = 0
        self.state = random_megatron_state(7)

    def pending(self):
        self.arrived = self.arrived or bool(self.fire(self))
        return self.arrived

    def apply(self, engine):
        assert self.arrived, "apply without newer weights pending"
        self.arrived = False
        engine.update_weights_from_buckets([self.state])
        self.version += 1
        self.applied += 1
        return self.version


def when_holding(*fakes):
    return lambda sw: sw.applied == 0 and all(f.holding.is_set() for f in fakes)


def engine_for(fakes, tmp_path, **kw):
    cfg = SGLangEngineConfig(urls=[f.url for f in fakes], sync_dir=str(tmp_path / "sync"), partial_poll_s=0.005, **kw)
    return SGLangEngine(ARCH, TOK, config=cfg)


@pytest.fixture
def fakes(request):
    servers = [SlowSGLang(**getattr(request, "param", {})) for _ in range(2)]
    yield servers
    for s in servers:
        s.close()


# prompt i's last token sets its response: [1, 16] stops after 2 tokens (17, eos), [1, 12] after 6, [1, 3] and
# [1, 5] run to max_new
PROMPTS = [[1, 16], [1, 12], [1, 3], [1, 5]]
MAX_NEW = 8


@pytest.mark.parametrize("fakes", [{"hold_after": 3}], indirect=True)
def test_switch_mid_generation_aborts_resumes_and_tags_versions(fakes, tmp_path):
    eng = engine_for(fakes, tmp_path, max_batch=2)  # chunk 0 (prompts 0, 1) -> server 0, chunk 1 -> server 1
    switch = ScriptedSwitch(when_holding(*fakes))
    out = eng.generate(PROMPTS, 1, SamplingParams(max_new_tokens=MAX_NEW), switch=switch)

    assert switch.applied == 1 and switch.version == NEW
    for f in fakes:  # one abort per server; the weights changed only once nothing was in flight
        assert f.posted("/abort_request") == [{"abort_all": True}] and not schema_errors("/abort_request", {"abort_all": True})
        assert f.version == 1 and f.updates_in_flight == 0
    first = [b for f in fakes for b in f.posted("/generate")[:1]]
    assert [ids for b in first for ids in b["input_ids"]] == PROMPTS
    # the 3-step cut: [1, 16] had stopped (17, eos) and is not sent again; the others resume from their prefix
    prefix = {1: [13, 14, 15], 2: [4, 5, 6], 3: [6, 7, 8]}
    (resume0,), (resume1,) = (f.posted("/generate")[1:] for f in fakes)  # 3 samples left: chunks of 2 and 1
    assert resume0["input_ids"] == [PROMPTS[1] + prefix[1], PROMPTS[2] + prefix[2]]
    assert resume1["input_ids"] == [PROMPTS[3] + prefix[3]]
    for body in (resume0, resume1):  # each with what is left of its budget, otherwise the same sampling
        assert [sp["max_new_tokens"] for sp in body["sampling_params"]] == [MAX_NEW - 3] * len(body["input_ids"])
        assert body["sampling_params"][0] == {**eng._sampling_json(SamplingParams(max_new_tokens=MAX_NEW), MAX_NEW),
                                              "max_new_tokens": MAX_NEW - 3}

    for r, p in enumerate(PROMPTS):
        tokens = uninterrupted(p, MAX_NEW)  # prefix + continuation = what one pass would have generated
        L = len(tokens)
        assert out.response_ids_RL[r, :L].tolist() == tokens and (out.response_ids_RL[r, L:] == TOK.pad_id).all()
        assert out.response_mask_RL[r].tolist() == [True] * L + [False] * (MAX_NEW - L)
        cut = len(prefix.get(r, tokens))
        assert out.version_RL[r].tolist() == [OLD] * cut + [NEW] * (L - cut) + [0] * (MAX_NEW - L)
        want = [fake_logp(0 if j < cut else 1, len(p) + j) for j in range(L)]  # server versions 0, then 1
        assert torch.allclose(out.logp_RL[r, :L], torch.tensor(want)) and (out.logp_RL[r, L:] == 0).all()
    assert out.response_ids_RL[0, :2].tolist() == [17, EOS] and out.response_ids_RL[1, 5].item() == EOS


def test_switch_never_pending_equals_one_pass_with_versions(fakes, tmp_path):
    eng = engine_for(fakes, tmp_path, max_batch=2, routing_replay="r3")
    sampling = SamplingParams(max_new_tokens=MAX_NEW)
    plain = eng.generate(PROMPTS, 2, sampling)
    assert not any("abort-watcher" in name for f in fakes for name in f.threads_seen)  # no watcher without a switch
    switch = ScriptedSwitch(lambda sw: False)
    out = eng.generate(PROMPTS, 2, sampling, switch=switch)
    assert any("abort-watcher" in name for f in fakes for name in f.threads_seen)
    assert plain.version_RL is None and switch.applied == 0
    assert out.prompt_ids == plain.prompt_ids
    for name in ("response_ids_RL", "response_mask_RL", "logp_RL", "routes_RPLyK"):
        assert torch.equal(getattr(out, name), getattr(plain, name)), name
    assert torch.equal(out.version_RL, torch.where(plain.response_mask_RL, OLD, 0))
    assert out.version_RL.dtype == torch.long
    assert all(f.posted("/abort_request") == [] for f in fakes)


@pytest.mark.parametrize("fakes", [{"hold_after": 3}], indirect=True)
def test_r3_routes_come_from_each_samples_last_request(fakes, tmp_path):
    eng = engine_for(fakes, tmp_path, max_batch=2, routing_replay="r3")
    out = eng.generate(PROMPTS, 1, SamplingParams(max_new_tokens=MAX_NEW), switch=ScriptedSwitch(when_holding(*fakes)))
    routes = out.routes_RPLyK
    assert routes.shape == (4, 2 + MAX_NEW - 1, ARCH.num_moe_layers, ARCH.num_experts_per_tok)
    for r, p in enumerate(PROMPTS):
        fed = len(p) + int(out.response_mask_RL[r].sum()) - 1
        version = 0 if r == 0 else 1  # sample 0 finished before the switch; the others' resume re-read everything
        want = torch.from_numpy(fake_routes(fed, version)[:, [1, 2]].astype(np.int16))
        assert torch.equal(routes[r, :fed], want), r
        assert (routes[r, fed:] == -1).all()
    assert not torch.equal(torch.from_numpy(fake_routes(5, 0)), torch.from_numpy(fake_routes(5, 1)))


@pytest.mark.parametrize("fakes", [{"hold_after": 3}], indirect=True)
def test_abort_from_elsewhere_resumes_under_the_same_weights(fakes, tmp_path):
    eng = engine_for(fakes[:1], tmp_path)
    switch = ScriptedSwitch(lambda sw: False)

    def other_client():  # e.g. another trainer's abort_all on a shared server
        assert fakes[0].holding.wait(5)
        fakes[0].abort_request({"abort_all": True})

    t = threading.Thread(target=other_client)
    t.start()
    out = eng.generate(PROMPTS[1:3], 1, SamplingParams(max_new_tokens=MAX_NEW), switch=switch)
    t.join()
    assert switch.applied == 0 and fakes[0].version == 0 and len(fakes[0].posted("/generate")) == 2
    for r, p in enumerate(PROMPTS[1:3]):
        tokens = uninterrupted(p, MAX_NEW)
        assert out.response_ids_RL[r, :len(tokens)].tolist() == tokens
        assert out.version_RL[r].tolist() == [OLD] * len(tokens) + [0] * (MAX_NEW - len(tokens))


@pytest.mark.parametrize("fakes", [{"hold_after": 2, "abort_wins_last_step": True}], indirect=True)
def test_abort_on_the_last_step_finishes_the_sample(fakes, tmp_path):
    eng = engine_for(fakes[:1], tmp_path, routing_replay="r3")
    prompts = [[1, 16], [1, 3]]  # [1, 16]'s eos comes in step 2, the step the abort catches
    out = eng.generate(prompts, 1, SamplingParams(max_new_tokens=MAX_NEW), switch=ScriptedSwitch(when_holding(fakes[0])))
    first, resume = fakes[0].posted("/generate")
    assert resume["input_ids"] == [[1, 3, 4, 5]]  # the finished one is not sent again
    assert out.response_ids_RL[0].tolist() == [17, EOS] + [TOK.pad_id] * (MAX_NEW - 2)
    assert out.version_RL[0].tolist() == [OLD, OLD] + [0] * (MAX_NEW - 2)
    assert out.response_ids_RL[1].tolist() == uninterrupted([1, 3], MAX_NEW)
    assert out.version_RL[1].tolist() == [OLD] * 2 + [NEW] * (MAX_NEW - 2)
    # its routes are the aborted request's (the one that finished it)
    assert torch.equal(out.routes_RPLyK[0, :3], torch.from_numpy(fake_routes(3, 0)[:, [1, 2]].astype(np.int16)))


@pytest.mark.parametrize("fakes", [{"hold_after": 2, "hold_timeout": 0.2}], indirect=True)
def test_refused_abort_raises_naming_the_samples(fakes, tmp_path):
    fakes[1].abort_answer = (400, {"error": {"message": "abort refused by the scheduler"}})
    eng = engine_for(fakes, tmp_path, max_batch=2)
    switch = ScriptedSwitch(when_holding(*fakes))
    with pytest.raises(SGLangServerError, match=r"/abort_request \(abort_all\) failed on .*HTTP 400.*abort refused "
                                                r"by the scheduler.*sample 2 \(prompt 2, sample 0 of 1\)"):
        eng.generate(PROMPTS, 1, SamplingParams(max_new_tokens=MAX_NEW), switch=switch)
    assert switch.applied == 0  # never loads weights under requests that kept going


@pytest.mark.parametrize("fakes", [{"hold_after": 0, "rehold": True}], indirect=True)
def test_aborts_without_progress_raise_naming_the_sample(fakes, tmp_path):
    eng = engine_for(fakes[:1], tmp_path, partial_max_stalls=3)
    switch = ScriptedSwitch(lambda sw: fakes[0].holding.is_set())  # pending whenever the server sits there
    with pytest.raises(SGLangResponseError, match=r"sample 0 \(prompt 0, sample 0 of 2\): aborted 3 times in a row "
                                                  r"without a new token \(0 of 8 generated\)"):
        eng.generate(PROMPTS[:1], 2, SamplingParams(max_new_tokens=MAX_NEW), switch=switch)
    assert switch.applied == 2 and len(fakes[0].posted("/generate")) == 3


def test_partial_config_is_validated(tmp_path):
    for field, bad in (("partial_poll_s", 0), ("partial_poll_s", 5.0), ("partial_poll_s", True),
                       ("partial_max_stalls", 0), ("partial_max_stalls", 1.5)):
        with pytest.raises(SGLangConfigError, match=f"sglang.{field}"):
            SGLangEngineConfig(urls=["http://127.0.0.1:1"], sync_dir=str(tmp_path), **{field: bad})


# ------------------------------------------------------------------------------------------ in a training run
class HoldTheBatchAhead(SlowSGLang):
    """Holds the batch generated ahead of RL step 1 (the second RL /generate) after its first decode step, until
    an abort: the update's weights then reach the generating thread mid-batch, as they do when generation is
    slower than the update."""

    def __init__(self):
        super().__init__(hold_timeout=120.0)
        self.fresh_rl = 0

    def _generate(self, body):
        ids = body["input_ids"]
        if len(ids) == 4 and self.abort_epoch == 0:
            self.fresh_rl += 1
            if self.fresh_rl == 2:
                self.hold_after = self.steps + 1
        return super()._generate(body)


def _partial_trainer_body(rank, world_size, url, out_dir):
    from megagspo.config import load_config
    from megagspo.trainer.trainer import Trainer

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(repo, "configs/tiny_cpu.yaml"), [
        "sft.steps=0", "rl.steps=3", "rl.batch.prompts_per_step=2", "rl.batch.group_size=2",
        "rl.batch.mini_batches=1", "rl.eval.every=100", "rl.eval.samples=0", "data.train_size=20",
        "data.eval_size=3", "threads=1", "log.progress=false", "log.plots=false", "log.tensorboard=false",
        "log.save_checkpoint=false", "checkpoint.every_steps=0", "rollout.engine=sglang", "rollout.staleness=1",
        "rollout.partial=true", f"log.out_dir={out_dir}", "name=partial",
        "rollout.sglang={urls: [" + url + "], sync_dir: " + out_dir + "/sync}"])
    Trainer(cfg, quiet=True).train()
    return True


def test_a_training_run_aborts_and_resumes_the_batch_ahead_under_the_new_weights(tmp_path):
    """rollout.engine = sglang, rollout.staleness = 1, rollout.partial: the step hands the weights after update 0 to
    the thread generating batch 1, whose engine aborts the held request, loads them into the server and resumes
    the samples from their prefix; the step itself sends no weights (no update while a /generate runs), and step 1
    logs its tokens' versions: the first token of every response one update old, the rest fresh."""
    import json

    from multiprocess import run_distributed

    fake = HoldTheBatchAhead()
    try:
        run_distributed(_partial_trainer_body, world_size=1, args=(fake.url, str(tmp_path)), timeout_s=300)
        events, prompt_len = [], None
        for method, path, body in fake.requests:
            if method == "POST" and path == "/generate" and len(body["input_ids"]) == 4:
                prompt_len = prompt_len or len(body["input_ids"][0])  # a + b = prompts are all alike
                events.append("rl" if len(body["input_ids"][0]) == prompt_len else "resume")
            elif method == "POST" and path in ("/abort_request", "/update_weights_from_disk"):
                events.append(path.strip("/").split("_")[0])
        assert fake.updates_in_flight == 0
    finally:
        fake.close()
    # the sync at start; batch 0; batch 1 held, aborted, the weights after update 0, resumed; batch 2 (done before
    # update 1 ends), then update 1's weights, loaded after it; update 2's weights at the end
    assert events == ["update", "rl", "rl", "abort", "update", "resume", "rl", "update", "update"], events
    with open(tmp_path / "partial" / "metrics.jsonl") as f:
        rows = [r for r in map(json.loads, f) if r.get("phase") == "rl"]
    step1 = rows[1]
    assert step1["rollout/continued_response_frac"] == 1.0
    lengths = step1["response/length_mean"]
    assert step1["rollout/older_version_token_frac"] == pytest.approx(1.0 / lengths)
    assert step1["rollout/staleness_max"] == 1.0 and step1["rollout/staleness_mean"] == pytest.approx(1.0 / lengths)
    assert rows[2]["rollout/continued_response_frac"] == 0.0 and rows[2]["rollout/staleness_mean"] == 1.0
