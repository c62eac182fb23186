"""The built-in verifiable task: multi-digit addition, with disjoint train / held-out problem sets.

Prompts zero-pad both operands to `num_digits` ("07+42="), so every prompt has the same length and the
answer's length is the only thing that varies; the answer is the plain sum ("49").

`sloppy_demonstrations` gives the cold-start SFT a demonstrator that sometimes drops the carry out of the ones
digit ("18+25=" -> "33" instead of "43"): a systematic mistake that the reward, which checks the true sum, can
teach the policy to stop making.
"""

from __future__ import annotations

import random

from megagspo.agent.hermes import format_tool_call


def addition_examples(num_digits: int, train_size: int, eval_size: int, seed: int):
    """-> (train, held_out): lists of (prompt, answer) pairs; no problem appears in both."""
    space = 10 ** num_digits
    total = train_size + eval_size
    if total > space * space:
        raise ValueError(f"{total} problems requested but only {space * space} distinct ones exist")
    rng = random.Random(seed)
    codes = rng.sample(range(space * space), total)
    pairs = []
    for code in codes:
        a, b = divmod(code, space)
        pairs.append((f"{a:0{num_digits}d}+{b:0{num_digits}d}=", str(a + b)))
    return pairs[:train_size], pairs[train_size:]


def carry_dropped(prompt: str) -> str:
    """The sum of an addition prompt ("18+25=") written as a demonstrator who forgets the carry out of the ones
    digit would write it ("33"); the plain sum where the ones digits do not carry."""
    a, b = prompt.rstrip("=").split("+")
    a, b = int(a), int(b)
    if a % 10 + b % 10 < 10:
        return str(a + b)
    return str(a + b - 10)


def sloppy_demonstrations(train: list, fraction: float, seed: int) -> list:
    """One demonstration per training (prompt, answer) pair: the answer, or, for `fraction` of the problems whose
    ones digits carry (drawn with `seed`, fixed per problem), the answer with that carry dropped."""
    rng = random.Random(f"sloppy-demonstrations-{seed}")
    out = []
    for prompt, answer in train:
        draw = rng.random()  # one draw per problem, so the choice of a problem does not depend on the others'
        carries = carry_dropped(prompt) != answer
        out.append(carry_dropped(prompt) if carries and draw < fraction else answer)
    return out


def tool_demonstrations(train: list, demos: list, fraction: float, seed: int) -> list:
    """Each training problem's demonstration: for `fraction` of them (drawn with `seed`, fixed per problem) two
    assistant turns, a compact Hermes call to the `add` tool with the prompt's operands and then the sum it returns;
    the others keep their one-turn demonstration from `demos` (the answer, or the carry dropped)."""
    rng = random.Random(f"tool-demonstrations-{seed}")
    out = []
    for (prompt, answer), demo in zip(train, demos):
        draw = rng.random()  # one draw per problem, so the choice of a problem does not depend on the others'
        if draw < fraction:
            a, b = (int(x) for x in prompt.rstrip("=").split("+"))
            out.append((format_tool_call("add", {"a": a, "b": b}, compact=True), answer))
        else:
            out.append(demo)
    return out
