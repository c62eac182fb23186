"""The built-in verifiable task: multi-digit addition, with disjoint train / held-out problem sets.

Prompts zero-pad both operands to `num_digits` ("07+42="), so every prompt has the same length and the
answer's length is the only thing that varies; the answer is the plain sum ("49").
"""

from __future__ import annotations

import random


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
