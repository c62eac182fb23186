"""Which rollout source a recipe gets and what combines with what: the one rule, as names. It imports nothing but
the config, so that the preflight (and with it the dry run, `plan` and `export`) checks it without loading the
policy, Megatron-Core or an engine; megagspo.rl.sources maps each name onto its class.

    synchronous      rollout.staleness 0: collect, then score
    group_filtered   rollout.staleness 0 with rl.filter.enabled (DAPO's dynamic sampling in rounds)
    one_step_ahead   rollout.staleness 1 on a thread of the trainer (rollout.producer = thread)
    produced         rollout.staleness N on a producer process (rollout.producer = process, rollout.engine = hf)
"""

from __future__ import annotations

from megagspo.config import ConfigError

SYNCHRONOUS, GROUP_FILTERED, ONE_STEP_AHEAD, PRODUCED = "synchronous", "group_filtered", "one_step_ahead", "produced"
PRODUCERS = ("auto", "process", "thread")


def producer_kind(producer: str, engine: str) -> str:
    """rollout.producer = auto: a process for the embedded engine (its generation competes with the update for this
    process's cores), the thread for SGLang (a server generates elsewhere; the thread only waits on HTTP)."""
    if producer == "auto":
        return "process" if engine == "hf" else "thread"
    return producer


def source_kind(staleness: int, filter_groups: bool, model_parallel: int, producer: str = "auto",
                engine: str = "hf", partial: bool = False, world: int = 1) -> str:
    """The source a recipe asks for, or a ConfigError naming the keys that cannot combine (the one place)."""
    if not staleness:
        if partial:
            raise ConfigError("rollout.partial = true continues unfinished responses under weights that arrive "
                              "while a batch is generated ahead: it needs rollout.staleness >= 1")
        return GROUP_FILTERED if filter_groups else SYNCHRONOUS
    kind = producer_kind(producer, engine)
    if kind == "thread" and partial and engine == "sglang" and world > 1:
        raise ConfigError(f"rollout.partial = true with rollout.engine = sglang runs in one trainer process (the "
                          f"generating thread loads the weights into the servers, and under {world} processes that "
                          "load is a collective of every rank); run one process or set rollout.partial = false")
    if kind == "thread":
        if staleness > 1 or filter_groups:
            raise ConfigError(f"rollout.producer = thread runs one batch ahead without dynamic sampling: rollout."
                              f"staleness = {staleness} with rl.filter.enabled = {str(filter_groups).lower()} is "
                              "not supported by it; set rollout.producer = process (rollout.engine = hf)")
        if model_parallel > 1:
            raise ConfigError("rollout.producer = thread needs parallel.tensor_parallel = pipeline_parallel = 1: "
                              "under TP x PP the generating rank broadcasts the rollouts to its peers, a collective "
                              "that cannot run beside the training thread's; set rollout.producer = process")
        return ONE_STEP_AHEAD
    if engine != "hf":
        raise ConfigError(f"rollout.producer = process runs the embedded engine (rollout.engine = hf), not "
                          f"rollout.engine = {engine}; with SGLang use rollout.staleness = 1 and rollout.producer = "
                          "thread (the server generates beside the trainer)")
    return PRODUCED
