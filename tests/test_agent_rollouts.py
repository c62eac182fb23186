"""Multi-turn trajectories (megagspo.agent) against scripted engines: token in, token out, loss mask 0 on what the
policy did not sample, routes appended per turn (never overwritten, no filler), weight versions per token, the
tool loop's error texts and counts, the budgets, the turn batcher's determinism, the prefix policy, and the SGLang
engine serving a three-turn trajectory by ids.

The scripted engines answer from the ids they are given (decoded): no tool response yet -> a call to `add` with
the prompt's operands; a tool response -> that response's text as the answer. Their routes say which generate call
recorded each position ([.., 0]) and the position itself ([.., 1]), so a test can read which turn's prefill a
trajectory's row came from.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from megagspo.agent.hermes import format_tool_call
from megagspo.agent.loop import AgentSample, register_agent
from megagspo.agent.runner import AgentFailed, AgentRollouts
from megagspo.agent.tools import register_tool
from megagspo.agent.trajectory import stack_trajectories
from megagspo.config import AgentConfig
from megagspo.data.datasets import Example
from megagspo.data.tokenizer import BuiltinTokenizer
from megagspo.rl.batch import SequenceBatch
from megagspo.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, response_texts, trajectory_rewards

TOK = BuiltinTokenizer(tools=True)
SAMPLING = SamplingParams(24, greedy=True)


def example(a: int, b: int) -> Example:
    prompt = f"{a:02d}+{b:02d}="
    return Example(prompt, str(a + b), tuple(TOK.prompt_ids(prompt)))


def call_turn(text: str) -> str:
    a, b = (int(x) for x in re.match(r"<bos>(\d+)\+(\d+)=", text).groups())
    return format_tool_call("add", {"a": a, "b": b}, compact=True)


def answer_script(text: str, turns: int) -> str:
    """Call add until `turns` calls were answered, then answer with the last tool response."""
    responses = re.findall(r"<tool_response>(.*?)</tool_response>", text)
    return call_turn(text) if len(responses) < turns else responses[-1]


class ScriptedEngine(RolloutEngine):
    """Each row: script(decoded ids) + eos, log-prob -(position + 1) / 100; routes [.., 0] = the call's number,
    [.., 1] = the position; with `versions` (a list per call), every token of call c has version versions[c]."""

    def __init__(self, script, versions=None) -> None:
        self.script, self.versions, self.calls, self.prompts = script, versions, 0, []

    def generate(self, prompts, n, sampling, switch=None) -> RolloutOutput:
        self.calls += 1
        rows = [list(p) for p in prompts for _ in range(n)]
        self.prompts.append(rows)
        turns = [TOK.encode(self.script(TOK.decode_with_specials(p))) + [TOK.eos_id] for p in rows]
        turns = [t[:sampling.max_new_tokens] for t in turns]
        length = max(map(len, turns))
        R = len(rows)
        ids = torch.full((R, length), TOK.pad_id)
        mask = torch.zeros((R, length), dtype=torch.bool)
        logp = torch.zeros((R, length))
        positions = max(len(p) for p in rows) + length - 1
        routes = torch.full((R, positions, 1, 2), -1, dtype=torch.int16)
        for r, (p, t) in enumerate(zip(rows, turns)):
            ids[r, :len(t)] = torch.tensor(t)
            mask[r, :len(t)] = True
            logp[r, :len(t)] = -(torch.arange(len(t)) + 1) / 100
            fed = len(p) + len(t) - 1
            routes[r, :fed, 0, 0] = self.calls
            routes[r, :fed, 0, 1] = torch.arange(fed, dtype=torch.int16)
        version = None
        if self.versions is not None:
            version = torch.where(mask, self.versions[self.calls - 1], 0)
        return RolloutOutput([list(p) for p in rows], ids, mask, logp, routes, version)


def rollouts(config: AgentConfig, engine, examples, n=1, sampling=SAMPLING):
    agent = AgentRollouts(config, TOK)
    try:
        return agent.run(engine.generate, examples, n, sampling)
    finally:
        agent.close()


TOOLS = AgentConfig(name="tool_loop", tools=["add"], max_turns=4, max_total_tokens=128)


def test_a_three_turn_trajectory_is_token_in_token_out_with_tool_tokens_masked():
    engine = ScriptedEngine(lambda text: answer_script(text, turns=2))
    out = rollouts(TOOLS, engine, [example(18, 25)])
    row = out.agent_rows[0]
    assert row["turns"] == 3 and row["tool_calls"] == 2 and row["status"] == "done" and row["final_text"] == "43"
    call = TOK.encode(format_tool_call("add", {"a": 18, "b": 25}, compact=True)) + [TOK.eos_id]
    tool = TOK.encode("<tool_response>43</tool_response>")
    answer = TOK.encode("43") + [TOK.eos_id]
    expected_ids = call + tool + call + tool + answer
    expected_mask = [True] * len(call) + [False] * len(tool) + [True] * len(call) + [False] * len(tool) + \
        [True] * len(answer)
    n = len(expected_ids)
    assert out.response_ids_RL[0, :n].tolist() == expected_ids and out.response_mask_RL[0].sum() == n
    assert out.loss_mask_RL[0, :n].tolist() == expected_mask
    # each turn's prompt extended the previous ids exactly: the engine was given prompt + everything so far
    prompt = list(example(18, 25).prompt_ids)
    assert [p[0] for p in engine.prompts] == [prompt, prompt + call + tool, prompt + call + tool + call + tool]
    # log-probs where sampled, 0 on tool tokens; the verifier reads the final answer
    lp = out.logp_RL[0, :n]
    assert torch.all(lp[~out.loss_mask_RL[0, :n]] == 0) and torch.all(lp[out.loss_mask_RL[0, :n]] < 0)
    assert response_texts(out, TOK) == ["43"]
    # the sequence batch: loss only on sampled targets, the rollout log-probs there
    seqs = SequenceBatch.from_rollouts(out, torch.ones(1), TOK.pad_id, 128)
    assert seqs.num_tokens == len(prompt) + n - 1
    assert seqs.loss_mask_T.tolist() == ([False] * (len(prompt) - 1) + expected_mask)
    assert torch.equal(seqs.rollout_logp_T[seqs.loss_mask_T], lp[out.loss_mask_RL[0, :n]])


def test_routes_are_appended_per_turn_and_no_sampled_token_gets_a_filler():
    """Turn k's rows are kept as recorded; the next turn's prefill only adds rows past them (the previous turn's last
    sampled token first among them); every row of a fed position is a real route."""
    engine = ScriptedEngine(lambda text: answer_script(text, turns=2))
    out = rollouts(TOOLS, engine, [example(18, 25)])
    prompt = len(example(18, 25).prompt_ids)
    call, tool = 22, len(TOK.encode("<tool_response>43</tool_response>"))
    fed = prompt + int(out.response_mask_RL[0].sum()) - 1
    routes = out.routes_RPLyK[0, :, 0]
    assert torch.all(routes[:fed] >= 0) and torch.all(routes[fed:] == -1)
    assert routes[:fed, 1].tolist() == list(range(fed))  # aligned with the positions
    first_end = prompt + call - 1               # turn 1 fed the prompt and its call but the last token
    second_end = first_end + tool + call        # turn 2 fed turn 1's last token, the tool text, its call but the last
    assert set(routes[:first_end, 0].tolist()) == {1}
    assert set(routes[first_end:second_end, 0].tolist()) == {2}  # turn 1's last token: from turn 2's prefill
    assert set(routes[second_end:fed, 0].tolist()) == {3}


def test_weight_versions_are_kept_per_token_across_turns():
    """Partial rollouts: every token keeps the version that sampled it, turn by turn; tool tokens have none."""
    engine = ScriptedEngine(lambda text: answer_script(text, turns=1), versions=[3, 5])

    class Switch:
        version = 3

        def pending(self):
            return False

        def apply(self, engine):
            return self.version

    agent = AgentRollouts(TOOLS, TOK)
    out = agent.run(engine.generate, [example(17, 28)], 1, SAMPLING, Switch())
    mask, versions = out.loss_mask_RL[0], out.version_RL[0]
    n = int(out.response_mask_RL[0].sum())
    assert set(versions[:22].tolist()) == {3} and set(versions[n - 3:n].tolist()) == {5}
    assert torch.all(versions[:n][~mask[:n]] == 0)
    seqs = SequenceBatch.from_rollouts(out, torch.ones(1), TOK.pad_id, 128)
    assert set(seqs.version_T[seqs.loss_mask_T].tolist()) == {3, 5}


@register_tool("test_agent_raises")
def _raises(a: int) -> int:
    """Always fails.

    Args:
        a: anything
    """
    raise ValueError(f"no luck with {a}")


@register_tool("test_agent_hangs")
def _hangs(a: int) -> int:
    """Never returns in time.

    Args:
        a: anything
    """
    time.sleep(60)
    return a


def test_tool_failures_become_text_the_model_reads_and_are_counted():
    """A malformed call, an unknown tool, a tool that raises and a hanging tool cut at its limit: each a tool
    response; the run goes on and each is counted by kind."""
    calls = ['<tool_call>{"name":"add",</tool_call>', format_tool_call("mul", {"a": 1}, compact=True),
             format_tool_call("test_agent_raises", {"a": 1}, compact=True),
             format_tool_call("test_agent_hangs", {"a": 1}, compact=True)]

    def script(text):
        done = len(re.findall("<tool_response>", text))
        return calls[done] if done < len(calls) else "1"

    config = AgentConfig(name="tool_loop", tools=["add", "test_agent_raises", "test_agent_hangs"], max_turns=6,
                         max_total_tokens=512, max_tool_response_tokens=200, tool_timeout_s=1.0)
    t0 = time.perf_counter()
    out = rollouts(config, ScriptedEngine(script), [example(1, 2)], sampling=SamplingParams(64, greedy=True))
    assert time.perf_counter() - t0 < 30
    row = out.agent_rows[0]
    assert row["status"] == "done" and row["turns"] == 5
    assert row["tool_errors"] == {"malformed": 1, "unknown_tool": 1, "raised": 1, "timeout": 1}
    text = TOK.decode_with_specials(out.response_ids_RL[0][out.response_mask_RL[0]].tolist())
    for needle in ("malformed", "unknown tool 'mul'", "ValueError: no luck with 1", "time limit"):
        assert needle in text


def test_budgets_turns_total_length_and_tool_response_length():
    always_call = ScriptedEngine(lambda text: call_turn(text))
    out = rollouts(AgentConfig(name="tool_loop", tools=["add"], max_turns=2, max_total_tokens=128), always_call,
                   [example(1, 2)])
    assert out.agent_rows[0]["status"] == "max_turns" and out.agent_rows[0]["turns"] == 2
    # the length budget: the second call does not fit; truncated trajectories score 0
    out = rollouts(AgentConfig(name="tool_loop", tools=["add"], max_turns=4, max_total_tokens=22),
                   ScriptedEngine(lambda text: answer_script(text, turns=1)), [example(1, 2), example(3, 4)])
    assert [r["status"] for r in out.agent_rows] == ["truncated", "truncated"]
    assert int(out.response_mask_RL.sum(1).max()) <= 22
    assert trajectory_rewards(out, [1.0, 1.0]) == [0.0, 0.0]
    # a tool response over its budget is cut on the configured side, counted
    for side, kept in (("right", "<tool_response>4</tool_response>"), ("left", "<tool_response>3</tool_response>")):
        cut = AgentConfig(name="tool_loop", tools=["add"], max_tool_response_tokens=1, tool_response_truncation=side)
        out = rollouts(cut, ScriptedEngine(lambda text: answer_script(text, turns=1)), [example(20, 23)])
        text = TOK.decode_with_specials(out.response_ids_RL[0][out.response_mask_RL[0]].tolist())
        assert kept in text and out.agent_rows[0]["tool_truncations"] == 1


def test_turns_are_batched_across_samples_and_the_result_does_not_depend_on_timing():
    """Samples needing 1, 2 and 3 calls: every engine call batches the turns of all samples still running (4 calls
    for the 4 turns of the longest); two runs give identical outputs."""
    def script(text):
        a = int(re.match(r"<bos>(\d+)", text).group(1))
        return answer_script(text, turns=a % 3 + 1)

    examples = [example(a, 10) for a in (3, 4, 5, 6)]
    first_engine = ScriptedEngine(script)
    first = rollouts(TOOLS, first_engine, examples, n=2)
    assert first_engine.calls == 4 and [len(rows) for rows in first_engine.prompts] == [8, 8, 4, 2]
    second = rollouts(TOOLS, ScriptedEngine(script), examples, n=2)
    for name in RolloutOutput.TENSORS:
        a, b = getattr(first, name), getattr(second, name)
        assert (a is None and b is None) or torch.equal(a, b)
    assert first.agent_rows == second.agent_rows
    assert [r["turns"] for r in first.agent_rows] == [1 + (a % 3 + 1) for a in (3, 4, 5, 6) for _ in range(2)]


def test_a_template_that_rewrites_history_fails_closed_or_is_counted_by_policy(monkeypatch):
    from megagspo.agent.chat import BuiltinChatFormat

    def rewriting(self, messages, add_generation_prompt):  # a template that rewrites the question once a tool answered
        if any(m["role"] == "tool" for m in messages):
            messages = [{**m, "content": m["content"].replace("01+02=", "1+2=")} for m in messages]
        return original(self, messages, add_generation_prompt)

    original = BuiltinChatFormat.render
    monkeypatch.setattr(BuiltinChatFormat, "render", rewriting)
    engine = ScriptedEngine(lambda text: answer_script(text, turns=1))
    with pytest.raises(ValueError, match="sample 0.*turn 2"):
        rollouts(TOOLS, engine, [example(1, 2)])
    keep = AgentConfig(name="tool_loop", tools=["add"], prefix_policy="keep")
    out = rollouts(keep, ScriptedEngine(lambda text: answer_script(text, turns=1)), [example(1, 2)])
    assert out.agent_rows[0]["prefix_rewrites"] == 1 and out.agent_rows[0]["final_text"] == "3"


def test_an_agent_that_raises_names_itself_and_the_sample():
    @register_agent("test_agent_broken")
    def broken(context):
        class Broken:
            def run(self, sample: AgentSample, engine, sampling):
                if sample.index == 1:
                    raise KeyError("oops")
                episode = context.episode(sample.messages)
                episode.assistant_turn(engine, sampling)
                return episode.finish("done", "x")

        return Broken()

    with pytest.raises(AgentFailed, match="'test_agent_broken' failed on sample 1 of 2.*KeyError"):
        rollouts(AgentConfig(name="test_agent_broken"), ScriptedEngine(lambda text: "1"), [example(1, 2)], n=2)


def test_an_environment_gives_its_own_reward_and_user_turns():
    from megagspo.agent.loop import EnvStep, register_environment

    @register_environment("test_agent_guess")
    class Guess:
        def reset(self, example):
            self.tries = 0
            return [{"role": "user", "content": "5+5="}]

        def step(self, text):
            self.tries += 1
            if self.tries == 2:
                return EnvStep(done=True, reward=0.25)
            return EnvStep([{"role": "tool", "content": "again"}])

    out = rollouts(AgentConfig(name="environment", environment="test_agent_guess"),
                   ScriptedEngine(lambda text: "7"), [example(1, 2)])
    assert out.prompt_ids[0] == TOK.prompt_ids("5+5=")
    assert out.agent_rows[0]["reward"] == 0.25 and trajectory_rewards(out, [1.0]) == [0.25]


def test_stacked_trajectories_survive_the_checkpoint_form_and_dynamic_sampling_selection():
    engine = ScriptedEngine(lambda text: answer_script(text, turns=1))
    out = rollouts(TOOLS, engine, [example(1, 2), example(30, 40)], n=2)
    state = out.state_dict()
    back = RolloutOutput.from_state(state["tensors"], state["meta"])
    assert back.agent_rows == out.agent_rows and torch.equal(back.loss_mask_RL, out.loss_mask_RL)
    both = RolloutOutput.concat([out.select_rows([2, 3]), out.select_rows([0, 1])], TOK.pad_id)
    assert both.agent_rows == out.agent_rows[2:] + out.agent_rows[:2]
    assert torch.equal(both.loss_mask_RL[:2, :out.loss_mask_RL.shape[1]], out.loss_mask_RL[2:])


def test_a_hook_built_trajectory_that_breaks_the_invariants_is_refused():
    from megagspo.agent.trajectory import Trajectory

    bad = Trajectory(prompt_ids=[1], ids=[3, 4], sampled=[True, False], logp=[0.0, 0.0])
    with pytest.raises(ValueError, match="must end with a sampled token"):
        bad.check("sample 0")
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory(prompt_ids=[1], ids=[3], sampled=[True, True], logp=[0.0]).check("x")
    assert stack_trajectories([Trajectory([1], [3], [True], [-0.5])], 0).loss_mask_RL.tolist() == [[True]]


def test_the_sglang_engine_serves_a_three_turn_trajectory_by_ids(tmp_path):
    """Token in, token out through SGLang's /generate: each turn's request carries the trajectory's ids so far
    (never text), the server's ids come back as they are, and the routes are appended per turn."""
    import base64

    import numpy as np

    from megagspo.rollout.sglang import SGLangEngine, SGLangEngineConfig
    from test_sglang_engine import ARCH, FakeSGLang

    def scripted(k, ids, item):
        tokens = TOK.encode(answer_script(TOK.decode_with_specials(ids), turns=2)) + [TOK.eos_id]
        meta = item["meta_info"]
        meta["output_token_logprobs"] = [[-0.5, t, None] for t in tokens]
        meta["completion_tokens"] = meta["output_token_logprobs_length"] = len(tokens)
        meta["finish_reason"] = {"type": "stop", "matched": TOK.eos_id}
        routes = np.zeros((len(ids) + len(tokens) - 1, ARCH.num_hidden_layers, ARCH.num_experts_per_tok), np.int32)
        routes[..., 0] = len(fake.posted("/generate"))  # which request recorded the position
        meta["routed_experts"] = base64.b64encode(routes.tobytes()).decode()
        return {"output_ids": tokens, "meta_info": meta}

    fake = FakeSGLang()
    fake.mutate = scripted
    try:
        engine = SGLangEngine(ARCH, TOK, config=SGLangEngineConfig(urls=[fake.url], sync_dir=str(tmp_path / "sync"),
                                                                   routing_replay="r3"))
        agent = AgentRollouts(TOOLS, TOK)
        out = agent.run(engine.generate, [example(18, 25)], 1, SAMPLING)
        agent.close()
    finally:
        fake.close()
    bodies = fake.posted("/generate")
    assert len(bodies) == 3 and all("text" not in b for b in bodies)
    prompt = list(example(18, 25).prompt_ids)
    n = int(out.response_mask_RL[0].sum())
    full = prompt + out.response_ids_RL[0, :n].tolist()
    for body in bodies:  # every turn's input is a prefix of the final trajectory, extended exactly
        ids = body["input_ids"][0]
        assert ids == full[:len(ids)]
    turn = 22 + len(TOK.encode("<tool_response>43</tool_response>"))  # a call with its eos, then the tool's text
    assert [len(b["input_ids"][0]) for b in bodies] == [len(prompt), len(prompt) + turn, len(prompt) + 2 * turn]
    assert out.agent_rows[0]["turns"] == 3 and out.agent_rows[0]["final_text"] == "43"
    routes = out.routes_RPLyK[0, :len(full) - 1, 0, 0].tolist()  # MoE layers only; [.., 0] = the request
    assert routes == [1] * (len(prompt) + 21) + [2] * turn + [3] * (n - turn - 22)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_losses_kl_and_mismatch_metrics_read_only_the_sampled_tokens(name):
    """A batch of trajectories through the registered loss with a KL term and the rollout log-probs (the mismatch
    metrics): whatever the policy, old, reference and rollout log-probs hold at tool / boundary tokens (NaN
    placeholders included), the loss, its gradient and every metric are the same; the gradient there is 0."""
    from megagspo.algorithm import KLConfig
    from megagspo.algorithm.packing import PackedBatch
    from megagspo.algorithm.registry import get_loss

    engine = ScriptedEngine(lambda text: answer_script(text, turns=int(text[6]) % 2 + 1))
    out = rollouts(TOOLS, engine, [example(11, 22), example(12, 30), example(45, 19)], n=2)
    seqs = SequenceBatch.from_rollouts(out, torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]), TOK.pad_id, 128)
    mask = seqs.loss_mask_T
    assert 0 < int(mask.sum()) < int((seqs.targets_T != TOK.pad_id).sum())  # tool tokens are there, unmasked
    gen = torch.Generator().manual_seed(48)
    draw = {k: -torch.rand(seqs.num_tokens, generator=gen, dtype=torch.float64) for k in ("logp", "old", "ref")}
    rollout = seqs.rollout_logp_T.double()

    def run(garbage: bool):
        def at_context(x, fill):
            return torch.where(mask, x, fill) if garbage else x
        logp = at_context(draw["logp"], torch.full_like(draw["logp"], 3.0)).clone().requires_grad_(True)
        batch = PackedBatch(logp_T=logp, loss_mask_T=mask, cu_seqlens_S1=seqs.cu_seqlens_S1,
                            num_global_sequences=seqs.num_sequences, num_global_tokens=float(mask.sum()),
                            old_logp_T=at_context(draw["old"], torch.full_like(logp, -7.0)),
                            ref_logp_T=at_context(draw["ref"], torch.full_like(logp, 5.0)),
                            rollout_logp_T=at_context(rollout, torch.full_like(logp, float("nan"))),
                            advantages_S=seqs.advantages_S.double())
        fn = get_loss(name)
        loss, metrics = fn(batch, fn.Config(kl=KLConfig(coef=0.1, estimator="k3")))
        loss.backward()
        return loss.detach(), logp.grad, {k: float(v) for k, v in metrics.items()}

    clean, dirty = run(False), run(True)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    assert torch.all(dirty[1][~mask] == 0)
    assert clean[2] == dirty[2] and any(k.startswith("mismatch/") for k in clean[2])


def test_the_examples_in_docs_agents_md_run():
    """docs/agents.md's tool, environment and agent examples, executed as written, then used."""
    import os

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "agents.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert len(blocks) == 3
    namespace = {"PRICES": {"pen": 1.5}}
    for block in blocks:
        exec(compile(block, "docs/agents.md", "exec"), namespace)
    from megagspo.agent.tools import ToolCaller, get_tool

    price = ToolCaller([get_tool("lookup_price")], 5.0).call("lookup_price", {"item": "pen", "quantity": 2})
    assert price.error is None and price.text == "3.0"
    guesses = ScriptedEngine(lambda text: "7" if text.count("higher") + text.count("lower") < 1 else "3")
    out = rollouts(AgentConfig(name="environment", environment="guess_number"), guesses, [example(1, 2)])
    assert out.agent_rows[0]["turns"] == 2 and out.agent_rows[0]["reward"] == 1.0
    out = rollouts(AgentConfig(name="two_tries"), ScriptedEngine(lambda text: "5"), [example(1, 2)])
    assert out.agent_rows[0]["turns"] == 2 and out.agent_rows[0]["final_text"] == "5"
