"""What a training checkpoint holds and how the trainer saves / restores it (collectives over all ranks).

Files in `step_X/` (see store.py for the atomic protocol; the manifest lists every one of them):
    model/                 Megatron `dist_checkpointing` folder (torch_dist backend) of model.sharded_state_dict():
        __<rank>_0.distcp  the weights each rank holds as main replica (at EP=2: rank 1 writes its experts)
        .metadata          torch.distributed.checkpoint global metadata (which chunk of which key is where)
        common.pt          the non-sharded part (empty for the model)
        metadata.json      backend and version
    optimizer/             the same for Megatron's distributed optimizer (absent at step_000000, before the
                           first RL update): fp32 master weights and Adam moments as ShardedTensors mirroring
                           their parameters (`optimizer.state.<kind>.<param key>`); common.pt: param groups
                           (hyper-parameters and the Adam step)
    rng.safetensors        per rank: `rank<r>/torch` (global CPU generator: HF `generate` samples with it on
                           CPU), `rank<r>/sample_gen` (the mini-batch permutation generator), `rank<r>/cuda`
                           (this rank's GPU generator, where the run uses CUDA)
    trainer_state.json     step, run id, layout, model architecture, tokenizer, config, data-loader position
                           (sampler RNG + epoch order), Python / NumPy RNG per rank, last eval, summary so far,
                           metrics (row count + tail), whether optimizer/ exists, and `model_index` (full
                           parameter name -> checkpoint key and expert index) for single-process readers
    rollouts_ahead.safetensors  per rank (rollout.producer = thread, where a batch is held): the batch generated ahead
    producer.safetensors   per rank (rollout.producer = process): the batches produced and not consumed (until
                           ec55d2c filed under rollouts_ahead; read there by the `legacy` of its part)
    manifest.json          sizes and sha256 of all of the above, written last

The data position, RNGs, batch generated ahead and summary are the run's table of state-dict parts
(megagspo.checkpoint.parts: registered by the trainer, restored in one pass by `restore_parts`); the files and keys
above are the ones checkpoints had before the table, so older checkpoints resume.

Every rank writes its own shards (moe.dist_checkpoint); rank 0 writes the rest and commits. Loading goes
against the current model's sharded_state_dict, so a checkpoint written at EP=2 loads at EP=1 (and back),
moments included. The learning-rate schedule is a function of the step (megagspo.rl.schedule.lr_at), so
the step is the scheduler's state. RNG states are restored per rank when the world size is unchanged; otherwise each rank
reseeds from (seed, step, rank) and says so (a run resumed on another layout is continued, not reproduced
bit-for-bit). `load_run_checkpoint` rebuilds the full TP=EP=1 weights from the shards in one process, with
no process group, for `megagspo export` and `model.init_from`.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
from safetensors import SafetensorError

from megagspo.config import Config, flatten_keys
from megagspo.config_moves import move_old_keys
from megagspo.errors import write_failure_message
from moe import cuda_calls
from moe import dist_checkpoint
from moe.collective import run_on_rank0
from moe.device import use_cuda
from moe.dist_checkpoint import DistCheckpointError
from moe.json_files import JsonFileError, loads_bounded, read_json

from . import store
from .guards import load_safetensors
from .parts import CheckpointParts, Shared
from .run_folder import (RunAlreadyFinished, check_fresh_start, check_not_finished, earlier_run, listing,
                         move_earlier_run_aside, nothing_to_resume)
from .store import CheckpointError

MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
RNG = "rng.safetensors"
AHEAD = "rollouts_ahead.safetensors"  # rollout.producer = thread: the batch generated ahead, per rank
PRODUCED = "producer.safetensors"    # rollout.producer = process: the batches produced ahead, per rank
STATE = "trainer_state.json"
REQUIRED = (f"{MODEL_DIR}/.metadata", f"{MODEL_DIR}/metadata.json", f"{MODEL_DIR}/common.pt", RNG, STATE)
MAX_STATE_BYTES = 256 << 20


def read_trainer_state(path: str) -> dict:
    """trainer_state.json of the checkpoint folder `path` through the bounded reader: a dict with an int
    step, else JsonFileError (a ValueError) naming the file."""
    state = read_json(os.path.join(path, STATE), max_bytes=MAX_STATE_BYTES)
    if not isinstance(state.get("step"), int) or isinstance(state.get("step"), bool):
        raise JsonFileError(f"{os.path.join(path, STATE)}: no integer 'step'")
    return state


def check_run_checkpoint(path: str, compatible: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """None when the step checkpoint `path` can be used, else why not (one line): the manifest's sizes and
    checksums (store.verify), then every JSON file in it (trainer_state.json, the shards' metadata.json)
    through the bounded reader, then every floating-point chunk of the weights and the optimizer state
    (master weights, moments) finite. Whatever the corruption, the caller falls back to the previous
    checkpoint. `compatible(path)` (a resume's checks of model, data and settings) runs before the shards are
    read: a checkpoint of another run is an error naming the differences, not a corruption to fall back past."""
    reason = store.verify(path, REQUIRED)
    if reason:
        return reason
    try:
        read_trainer_state(path)
        for sub in (MODEL_DIR, OPTIMIZER_DIR):
            if os.path.isfile(os.path.join(path, sub, "metadata.json")):
                read_json(os.path.join(path, sub, "metadata.json"))
        if compatible is not None:
            compatible(path)  # raises CheckpointError
        for sub in (MODEL_DIR, OPTIMIZER_DIR):
            if os.path.isdir(os.path.join(path, sub)):
                bad = dist_checkpoint.first_nonfinite_chunk(os.path.join(path, sub))
                if bad:
                    return f"{sub}/{bad}"
    except (JsonFileError, DistCheckpointError) as exc:
        return str(exc).replace(os.path.join(path, ""), "", 1)
    except OSError as exc:
        return store.VANISHED if not os.path.isdir(path) else \
            f"a file cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
    return None


def resolve_checkpoint(path: str, say: Callable[[str], None] = print,
                       compatible: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The one answer to "which checkpoint does this path hold", shared by --resume / checkpoint.resume=<path>,
    `megagspo export` and `model.init_from`: a step_XXXXXX folder itself (must be intact), else the newest
    intact step checkpoint of a checkpoints folder or a run folder (falling back past corrupt ones, skipping
    ones pruned while being read). None when the path holds no step checkpoint. `compatible`: see
    check_run_checkpoint."""
    if os.path.isfile(os.path.join(path, store.MANIFEST)):
        reason = check_run_checkpoint(path, compatible)
        if reason:
            raise CheckpointError(f"checkpoint {path} is corrupt ({reason})")
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        if store.list_checkpoints(root):
            return store.latest_good(root, REQUIRED, say, check=lambda p: check_run_checkpoint(p, compatible))
    return None


def _jsonable(obj):
    return json.loads(json.dumps(obj))


def arch_dict(arch) -> dict:
    return _jsonable(dict(arch.__dict__))


# ------------------------------------------------------------------------------------------------- RNG
class RunRng:
    """Every random state a run draws from on this rank: the global torch (and CUDA) generators (HF
    `generate` samples with them), Python's and NumPy's, and the mini-batch permutation generator. A per-rank
    checkpoint part (megagspo.checkpoint.parts.PerRank): generator states as tensors, Python's and NumPy's as
    JSON; on another process layout it is reseeded from (seed, step, data-parallel rank)."""

    def __init__(self, sample_gen: torch.Generator, seed: int = 0, dp_rank: int = 0) -> None:
        self.sample_gen = sample_gen
        self.seed = seed
        self.dp_rank = dp_rank

    def state_dict(self) -> dict:
        captured = capture_rng(self.sample_gen)
        tensors = {"torch": captured["torch"], "sample_gen": captured["sample_gen"]}
        if "cuda" in captured:  # this rank's GPU generator, where the run uses CUDA
            tensors["cuda"] = captured["cuda"]
        return {"tensors": tensors, "meta": {"python": captured["python"], "numpy": captured["numpy"]}}

    def load_state_dict(self, tensors: Dict[str, torch.Tensor], meta: dict) -> None:
        restore_rng({f"rank0/{name}": t for name, t in tensors.items()}, meta, 0, self.sample_gen)

    def start_afresh(self, step: int) -> None:
        """Seeded by the DATA-parallel rank, as a fresh run is: tensor-parallel peers must draw the same
        mini-batch permutation (they hold chunks of the same rows under sequence parallelism)."""
        self.reseed(self.seed * 7919 + 1_000_003 * int(step) + self.dp_rank)

    def reseed(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.sample_gen.manual_seed(seed)
        random.seed(seed)


def capture_rng(sample_gen: torch.Generator) -> dict:
    import numpy as np

    np_state = np.random.get_state()
    py_state = random.getstate()
    out = {"torch": torch.get_rng_state(), "sample_gen": sample_gen.get_state(),
           "python": [py_state[0], list(py_state[1]), py_state[2]],
           "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    if use_cuda():  # the embedded engine samples on this GPU with its generator
        out["cuda"] = cuda_calls.cuda_rng_state()
    return out


def restore_rng(tensors: Dict[str, torch.Tensor], meta: dict, rank: int, sample_gen: torch.Generator) -> None:
    import numpy as np

    torch.set_rng_state(tensors[f"rank{rank}/torch"])
    sample_gen.set_state(tensors[f"rank{rank}/sample_gen"])
    if use_cuda() and f"rank{rank}/cuda" in tensors:
        cuda_calls.set_cuda_rng_state(tensors[f"rank{rank}/cuda"])
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


# ------------------------------------------------------------------------------------- optimizer state
@torch.no_grad()
def gather_optimizer_state(policy, optimizer) -> Dict[str, torch.Tensor]:
    """The distributed optimizer's state of every parameter under full (TP=EP=PP=1) names and shapes,
    `<kind>/<full name>` for kind in master (fp32 master weight), exp_avg, exp_avg_sq and step; collective over
    every rank, like the weights (for checks and tests: checkpoints store the state sharded). Each rank's
    per-parameter shards come from moe.dist_checkpoint.local_optimizer_state (gathered over data
    parallelism), then go through the weights' own gather (policy.gather_full), so TP shards are concatenated
    like their parameters and experts / pipeline stages collected the same way."""
    out: Dict[str, torch.Tensor] = {}
    if optimizer is None or not dist_checkpoint.optimizer_has_state(optimizer):
        return out
    local = dist_checkpoint.local_optimizer_state(policy.model, optimizer)
    for kind, key in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        full = policy.gather_full({name: local[name][key] for name in local})
        out.update({f"{kind}/{name}": t for name, t in full.items()})
    steps = policy.gather_full({name: local[name]["step"].expand(p.shape).contiguous()
                                for name, p in policy.model.named_parameters()})
    out.update({f"step/{name}": t.reshape(-1)[:1].clone() for name, t in steps.items()})
    return out


# What defines a run: a resume that changes any of these continues another experiment than the one its
# checkpoint, metrics and config.yaml describe. Section names cover every key of the section.
# The rollout keys too: how stale the batches are, who generates them and whether a batch mixes versions decide
# which policy the updates learn from.
DEFINING_KEYS = ("seed", "model", "data", "reward", "rl.loss", "rl.kl", "rl.old_policy", "rl.advantage", "rl.filter",
                 "rl.routing_replay", "rl.batch.group_size", "rollout.staleness", "rollout.producer",
                 "rollout.partial")
# How the same model is computed (kernels, attention and expert implementations, recompute, the loss's input
# checks) may change.
IMPLEMENTATION_KEYS = ("model.experts", "model.attention", "model.recompute", "model.logprob_path",
                       "model.logprob_chunk_tokens", "reward.timeout_s", "rl.loss.impl", "rl.loss.validate")


def defining_differences(saved: dict, now: dict) -> list:
    """['rl.loss.name: gspo in the checkpoint, grpo now', ...] over DEFINING_KEYS (dotted, flattened)."""
    return [line for _, _, _, line in defining_changes(saved, now)]


def _producer(values: dict) -> Optional[str]:
    """Who generates ahead in a flattened config: None at rollout.staleness 0 (nobody), else rollout.producer with
    auto resolved as megagspo.rl.sources resolves it (a process for the embedded engine, the thread for sglang)."""
    if not values.get("rollout.staleness"):
        return None
    producer = values.get("rollout.producer")
    if producer == "auto":
        return "process" if values.get("rollout.engine") == "hf" else "thread"
    return producer


def defining_changes(saved: dict, now: dict) -> list:
    """[(key, value in the checkpoint, value now, the line that says it), ...] over DEFINING_KEYS (dotted,
    flattened). rollout.producer counts where it changes who generates (auto is the process for the embedded
    engine; at rollout.staleness 0 nobody does, and rollout.staleness names that change)."""
    # a checkpoint saved before the rl sections holds the flat keys: compared under their new paths
    before, after = flatten_keys(move_old_keys(saved, "the checkpoint's config")), flatten_keys(now)
    # A key the checkpoint predates ran at its default then: a value other than the default now is a change.
    defaults = flatten_keys(_jsonable(Config().to_dict()))
    keys = sorted(k for k in set(before) | set(after)
                  if any(k == d or k.startswith(d + ".") for d in DEFINING_KEYS) and k not in IMPLEMENTATION_KEYS)

    def shown(values: dict, k: str) -> str:
        return repr(values[k]) if k in values else f"unset (default {defaults.get(k)!r})"

    old, new = {**defaults, **before}, {**defaults, **after}
    changed = [k for k in keys if old.get(k) != new.get(k)]
    if "rollout.producer" in changed and (_producer(old) == _producer(new) or None in (_producer(old), _producer(new))):
        changed.remove("rollout.producer")
    return [(k, old.get(k), new.get(k), f"{k}: {shown(before, k)} in the checkpoint, {shown(after, k)} now")
            for k in changed]


def changes_record(state: dict, changes: list) -> list:
    """The run's record of its defining settings changed on a resume (checkpoint.allow_config_change): the
    checkpoint's record (its summary's config_changes) plus one entry per key changed now, {step, key, old, new}:
    the RL steps up to `step` ran with `old`, the ones after it with `new` (until a later entry). Kept in the
    summary (checkpoints, summary.json) and said atop config.yaml, which holds the values in force now."""
    earlier = list((state.get("summary") or {}).get("config_changes") or [])
    step = int(state.get("step", 0))
    return earlier + [{"step": step, "key": key, "old": old, "new": new} for key, old, new, _ in changes]


# ---------------------------------------------------------------------------- the parts a checkpoint holds
@dataclass
class RunParts:
    """What a checkpoint is written from: the state-dict parts in their one table (megagspo.checkpoint.parts:
    data position, RNGs, the batch generated ahead, the summary, ...), and beside them the policy and optimizer
    (Megatron's sharded checkpointing, moe.dist_checkpoint), the metrics tail and the run's identity."""

    policy: object                    # megagspo.policy.megatron_policy.MegatronPolicy
    optimizer: object                 # Megatron's distributed optimizer, None before RL
    dataset: object                   # megagspo.data.PromptDataset (its size: the data position's meaning)
    metrics: object                   # megagspo.metrics_log.MetricsLogger
    arch: object                      # moe.architecture.Qwen3MoeArchitecture
    table: CheckpointParts            # the state-dict parts, restored in one pass (restore_parts)


# ------------------------------------------------------------------------------------------- manager
class CheckpointManager:
    """Saving, pruning and resume for one run. `save` and `find_resume` are collective (every rank calls).
    `dims`: the run's moe.parallel.ParallelDims (ranks, world size, the layout a checkpoint records)."""

    def __init__(self, cfg, dims, say: Optional[Callable[[str], None]] = None) -> None:
        self.cfg = cfg
        self.ck = cfg.checkpoint
        self.dims = dims
        self.rank = dims.rank
        self.world = dims.world_size
        self._say = say or (lambda msg: print(msg, flush=True))
        self.root = os.path.join(cfg.run_dir(), "checkpoints")
        self.run_id = uuid.uuid4().hex[:12]
        self._retire_pending = False  # a fresh run found earlier checkpoints (rank 0)

    # ---- resume ------------------------------------------------------------------------------------
    def _resolve(self, compatible: Callable[[str], None]) -> Optional[str]:
        mode = self.ck.resume

        def check(path):  # intact, and (before its shards are read) this run's
            return check_run_checkpoint(path, compatible)

        if mode in ("", "never"):  # "": a plain start; never: --overwrite
            return self._fresh(refuse_earlier_run=mode == "")
        if mode == "auto":
            return (store.latest_good(self.root, REQUIRED, self.say, check=check)
                    or self._fresh(refuse_earlier_run=False))
        if mode == "latest":
            found = store.latest_good(self.root, REQUIRED, self.say, check=check)
            if found is None:
                raise CheckpointError(nothing_to_resume(self.cfg.run_dir(), self.root))
            return found
        path = mode
        if os.path.isfile(os.path.join(path, store.MANIFEST)):
            reason = check(path)
            if reason:
                raise CheckpointError(f"checkpoint.resume = {path!r} is corrupt ({reason})")
            return path
        found = resolve_checkpoint(path, self.say, compatible)
        if found:
            return found
        raise CheckpointError(f"checkpoint.resume = {path!r}: no checkpoint there (expected a step_XXXXXX folder, "
                              "a checkpoints folder or a run folder)")

    def _fresh(self, refuse_earlier_run: bool) -> None:
        """A fresh run over an earlier one (megagspo.checkpoint.run_folder): a plain start is refused (a finished
        run of this config: RunAlreadyFinished); --overwrite / auto move the whole earlier run aside in
        retire_previous(), once this run has been validated (a start that fails its checks leaves the folder as
        it was), so nothing of it is read or overwritten as this run's."""
        if refuse_earlier_run:
            check_fresh_start(self.cfg.run_dir(), self.cfg.to_dict())
        self._retire_pending = bool(earlier_run(self.cfg.run_dir()))
        return None

    def find_resume(self, arch, dataset_size: int) -> Optional[dict]:
        """Collective: rank 0 picks and verifies the checkpoint, every rank gets {path, state} or None.
        Raises CheckpointError (on every rank) when it is corrupt or was written for another model."""
        def pick():
            try:
                path = self._resolve(lambda p: self._check_compatible(p, read_trainer_state(p), arch, dataset_size))
                if path is None:
                    return None
                state = read_trainer_state(path)
                changed = self._check_compatible(path, state, arch, dataset_size)
                check_not_finished(self.cfg.run_dir(), path, int(state["step"]), self.cfg.rl.steps)
                return {"path": path, "state": state, "config_changes": changes_record(state, changed)}
            except RunAlreadyFinished as exc:  # not an error: every rank gets it and stops the same way
                return {"finished": str(exc), "summary": exc.summary}
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{type(exc).__name__}: {exc}") from None

        answer = run_on_rank0("choosing the checkpoint to resume", pick, peer_error=CheckpointError)
        if answer and "finished" in answer:
            raise RunAlreadyFinished(answer["finished"], answer["summary"])
        if answer:
            self.run_id = answer["state"].get("run_id", self.run_id)
            self.say(f"resuming from {answer['path']} (step {answer['state']['step']})")
        return answer

    def retire_previous(self) -> None:
        """Collective: a fresh run over an earlier run (--overwrite, or auto with nothing to resume) moves ALL of
        it (metrics, summary, plots, config, TensorBoard events, checkpoints, full-state files) into one sibling
        folder <run>.replaced-<time>/ (megagspo.checkpoint.run_folder; never deletes or truncates), so that
        `megagspo export`, `model.init_from`, --resume and TensorBoard only ever find this run's files here.
        Called once everything the run needs has been checked, before its first write."""
        def move():
            if not self._retire_pending:
                return None
            moved = earlier_run(self.cfg.run_dir())  # named as they are: a run stopped early has no summary
            aside = move_earlier_run_aside(self.cfg.run_dir())
            self._retire_pending = False
            if aside:
                self.say(f"a fresh run: the earlier run in {self.cfg.run_dir()} ({listing(aside, moved)}) moved whole "
                         f"to {aside}; nothing was deleted")
            return None

        run_on_rank0("moving the earlier run aside", move)

    def _check_compatible(self, path: str, state: dict, arch, dataset_size: int) -> list:
        """Raise CheckpointError where the checkpoint is not this run's. -> the defining changes
        checkpoint.allow_config_change lets through (defining_changes), [] without."""
        saved, now = state.get("arch", {}), arch_dict(arch)
        diff = [f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now"
                for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if diff:
            raise CheckpointError(f"{path} was written for a different model ({'; '.join(diff[:6])}); "
                                  "use the run's own config or a fresh run name")
        tok = self.cfg.data.tokenizer
        if state.get("tokenizer") != tok:
            raise CheckpointError(f"{path} used tokenizer {state.get('tokenizer')!r}, this run {tok!r}")
        if state.get("dataset_size") != dataset_size:
            raise CheckpointError(f"{path} was trained on {state.get('dataset_size')} training prompts, this run "
                                  f"has {dataset_size}: the data-loader position would not carry over")
        changes = defining_changes(state.get("config") or {}, _jsonable(self.cfg.to_dict()))
        changed = [line for _, _, _, line in changes]
        if changed and not self.ck.allow_config_change:
            raise CheckpointError(f"{path} belongs to a run with other settings than these: " + "; ".join(changed)
                                  + ". Resume with the run's own settings, start a fresh run (another name= or no "
                                  "--resume), or pass checkpoint.allow_config_change=true to continue with the new "
                                  "values")
        if changed:
            self.say("continuing with changed settings (checkpoint.allow_config_change): " + "; ".join(changed))
        return changes

    # ---- restore ----------------------------------------------------------------------------------
    def load_model(self, policy, point: dict) -> None:
        """Collective: this rank's slices of the weights, whatever layout wrote them."""
        try:
            dist_checkpoint.load_model(policy.model, os.path.join(point["path"], MODEL_DIR))
        except DistCheckpointError as exc:
            raise CheckpointError(f"{point['path']}: weights do not fit this model or are unreadable: {exc}") from None

    def load_optimizer(self, policy, optimizer, point: dict) -> None:
        """Collective: AdamW moments (resharded to this layout) and steps; nothing when the checkpoint was
        written before the first update. Hyper-parameters come from the config (a change is reported)."""
        if not point["state"].get("optimizer"):
            return
        try:
            changed = dist_checkpoint.load_optimizer(policy.model, optimizer,
                                                     os.path.join(point["path"], OPTIMIZER_DIR))
        except DistCheckpointError as exc:
            raise CheckpointError(f"{point['path']}: optimizer state does not fit this model or is unreadable: "
                                  f"{exc}") from None
        if changed:
            self.say("optimizer hyper-parameters differ from the checkpoint's; the config's are used: "
                     + "; ".join(changed))

    def restore_parts(self, table: CheckpointParts, point: dict) -> None:
        """The one restore pass, once the run has built every part: each part of the table, in its order, gets
        its state from the checkpoint `point` (megagspo.checkpoint.parts: Shared parts from trainer_state.json,
        PerRank parts from their file when this process layout wrote it, else start_afresh and one line said). A
        part the checkpoint predates keeps the state it was built with. The weights and the optimizer are not
        in the table: see megagspo.checkpoint.parts for why and where they are read."""
        state = point["state"]
        same_layout = self._written_by_this_layout(state)
        for part in table:
            storage = part.storage
            if isinstance(storage, Shared):
                if storage.key in state:
                    part.obj.load_state_dict(state[storage.key])
                continue
            # its key, else where an earlier version filed it
            stored = next(((k, f) for k, f in ((storage.key, storage.file), *storage.legacy) if k in state), None)
            if stored is None:
                continue
            metas = state[stored[0]] or []
            meta = metas[self.rank] if self.rank < len(metas) else None
            if same_layout and meta is not None:
                prefix = f"rank{self.rank}/"
                tensors = load_safetensors(os.path.join(point["path"], stored[1]))
                part.obj.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                                         meta)
            elif not same_layout and any(m is not None for m in metas):
                start_afresh = getattr(part.obj, "start_afresh", None)
                if start_afresh is not None:
                    start_afresh(int(state["step"]))
                self.say(f"checkpoint written by {state['world']} processes with layout {state.get('layout')}, "
                         f"resumed on {self.world} with {self.dims.shape.as_dict()}: {storage.note} (the run "
                         "continues; it is not a bit-for-bit replay of the uninterrupted one)")

    def _written_by_this_layout(self, state: dict) -> bool:
        """Whether the checkpoint's process count and layout are this run's (per-rank states then map 1:1)."""
        saved = dict(state.get("layout") or {})
        saved.setdefault("pipeline_parallel", 1)  # written before pipeline parallelism existed
        return state["world"] == self.world and saved == self.dims.shape.as_dict()

    def prior_metrics(self, point: dict, metrics_path: str) -> list:
        """The metrics rows logged up to the checkpoint: from metrics.jsonl when it still holds them all,
        else the checkpoint's own tail."""
        m = point["state"]["metrics"]
        count, tail = m["count"], m["rows"]
        lines = []
        if os.path.isfile(metrics_path):
            with open(metrics_path) as f:
                lines = [line for line in f if line.strip()]
        if len(lines) >= count:
            try:
                return [loads_bounded(line, metrics_path) for line in lines[:count]]
            except ValueError:
                pass
        if len(tail) < count:
            self.say(f"metrics.jsonl lost rows and the checkpoint keeps the last {len(tail)} of {count}: "
                     "earlier rows are not restored")
        return list(tail)

    # ---- save --------------------------------------------------------------------------------------
    def due(self, steps_done: int, total: int) -> bool:
        every = self.ck.every_steps
        return steps_done == total or (every > 0 and steps_done % every == 0)

    def save(self, parts: "RunParts", steps_done: int, last_eval: dict, phase: str = "rl") -> Optional[str]:
        """Collective. Every rank writes its model / optimizer shards into step_<steps_done>.tmp-<pid>, rank 0
        adds RNG, trainer state and the manifest and renames; prunes to keep_last. -> the path on rank 0.
        A failure on any rank (disk full, quota, permissions) raises CheckpointError on every rank, with the
        earlier checkpoints untouched."""
        t0 = time.perf_counter()
        # every rank's per-rank parts, in table order (collective)
        per_rank = {part.name: self._gather(part.obj.state_dict()) for part in parts.table.per_rank()}
        # 1. rank 0 opens the temporary folder; every rank learns its path (or that it failed)
        def begin():
            try:
                return store.begin_checkpoint(self.root, steps_done)
            except OSError as exc:
                raise CheckpointError(self._failed(steps_done, exc)) from None

        tmp = run_on_rank0("opening the checkpoint folder", begin, peer_error=CheckpointError)
        # 2. every rank writes its shards (collective)
        index, has_optimizer, failure = self._write_shards(parts, tmp, steps_done)
        failure = next((f for f in self._gather(failure) if f), None)
        # 3. rank 0 writes the rest, the manifest, renames
        path = None
        if self.rank == 0 and failure is None:
            state = self._trainer_state(parts, steps_done, phase, last_eval, per_rank, index, has_optimizer)
            try:
                path = self._commit(tmp, steps_done, state, parts.table, per_rank)
            except (OSError, SafetensorError) as exc:  # disk full, quota, permissions: earlier ones are untouched
                failure = self._failed(steps_done, exc)
        if failure and self.rank == 0:
            store.remove_stale_tmp(self.root)
        box = [failure]
        if self.world > 1:
            torch.distributed.broadcast_object_list(box, src=0)  # every rank stops together on a failure
        if box[0]:
            raise CheckpointError(box[0])
        if self.rank == 0:
            self.say_quiet(f"checkpoint {path} written in {time.perf_counter() - t0:.1f} s")
        return path

    def _gather(self, obj) -> list:
        """obj of every rank, in rank order (collective)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def _write_shards(self, parts: "RunParts", tmp: str, steps_done: int):
        """This rank's model / optimizer shards into `tmp` -> (model index, optimizer written, failure or None)."""
        optimizer = parts.optimizer
        has_optimizer = optimizer is not None and dist_checkpoint.optimizer_has_state(optimizer)
        try:
            dist_checkpoint.save_model(parts.policy.model, os.path.join(tmp, MODEL_DIR))
            if has_optimizer:
                dist_checkpoint.save_optimizer(parts.policy.model, optimizer, os.path.join(tmp, OPTIMIZER_DIR))
            return dist_checkpoint.model_index(parts.policy.model), has_optimizer, None
        except (OSError, dist_checkpoint.DistCheckpointError, *dist_checkpoint.save_errors()) as exc:
            return None, has_optimizer, self._failed(steps_done, exc)

    def _trainer_state(self, parts: "RunParts", steps_done: int, phase: str, last_eval: dict, per_rank: dict,
                       index, has_optimizer: bool) -> dict:
        """trainer_state.json: step, identity, layout, model, tokenizer, config, the metrics tail, and every
        table part's state (Shared: rank 0's state dict; PerRank: each rank's meta, by rank)."""
        state = {
            "step": steps_done, "phase": phase, "run_id": self.run_id, "world": self.world,
            "layout": self.dims.shape.as_dict(),
            "arch": arch_dict(parts.arch), "tokenizer": self.cfg.data.tokenizer,
            "dataset_size": len(parts.dataset), "config": _jsonable(self.cfg.to_dict()),
            "last_eval": last_eval, "metrics": parts.metrics.state_dict(self.ck.metrics_tail),
            "optimizer": has_optimizer, "model_index": index,
        }
        for part in parts.table.shared():
            state[part.storage.key] = _jsonable(part.obj.state_dict())
        for part in parts.table.per_rank():
            state[part.storage.key] = [None if s is None else s["meta"] for s in per_rank[part.name]]
        return state

    def _commit(self, tmp: str, steps_done: int, state: dict, table: CheckpointParts, per_rank: dict) -> str:
        """Rank 0: each per-rank part's tensors (rank<r>/<name>) and the trainer state into `tmp`, then the
        manifest and the rename; prune. A per-rank part with no tensors on any rank writes no file."""
        from safetensors.torch import save_file

        def dump_json(p):
            with open(p, "w") as f:
                json.dump(state, f)

        writers = {STATE: dump_json}
        for part in table.per_rank():
            tensors = {f"rank{r}/{name}": t.contiguous() for r, s in enumerate(per_rank[part.name]) if s is not None
                       for name, t in s["tensors"].items()}
            if tensors:
                writers[part.storage.file] = lambda p, tensors=tensors: save_file(tensors, p)
        path = store.commit_checkpoint(self.root, steps_done, tmp, writers, {"run_id": self.run_id})
        store.prune(self.root, self.ck.keep_last)
        return path

    def _failed(self, steps_done: int, exc: Exception) -> str:
        """One line naming the cause (disk full, read-only, ...); called before the partial files are removed,
        so that a full disk still shows as one."""
        return (f"writing checkpoint {store.step_dir_name(steps_done)} under {self.root} failed: "
                f"{write_failure_message(exc, self.root)}; the earlier checkpoints are intact")

    def say(self, msg: str) -> None:
        if self.rank == 0:
            self._say(f"megagspo checkpoint: {msg}")

    def say_quiet(self, msg: str) -> None:
        if os.environ.get("MEGAGSPO_CHECKPOINT_VERBOSE"):
            self.say(msg)


def load_run_checkpoint(path: str, say: Callable[[str], None] = print) -> dict:
    """Weights + identity of a checkpoint folder (`step_XXXXXX`, a `checkpoints` folder or a run folder; the
    newest intact one, falling back past corrupt ones) in `load_checkpoint`'s form:
    {"state", "arch", "tokenizer", "config", "path"}; "state" is the full TP=EP=1 state dict rebuilt from the
    shards in this process (no process group needed). Only JSON, safetensors, allow-listed metadata and
    weights-only tensors are read."""
    for _ in range(store._RESCANS):
        chosen = resolve_checkpoint(path, say)
        if chosen is None:
            raise CheckpointError(f"no checkpoint at {path!r} (expected checkpoint.pt, a step_XXXXXX folder, a "
                                  "checkpoints folder or a run folder)")
        try:
            state = read_trainer_state(chosen)
            index = state.get("model_index")
            if not isinstance(index, dict) or not index:
                raise CheckpointError(f"{chosen}/{STATE} has no model_index (written by another megagspo version?)")
            if not isinstance(state.get("arch"), dict) or not isinstance(state.get("tokenizer"), str):
                raise CheckpointError(f"{chosen}/{STATE} names no model architecture or tokenizer")
            full = dist_checkpoint.read_full_state_dict(os.path.join(chosen, MODEL_DIR), index)
            return {"state": full, "arch": state.get("arch"), "tokenizer": state.get("tokenizer"),
                    "config": state.get("config"), "path": chosen}
        except (DistCheckpointError, JsonFileError, OSError) as exc:
            if os.path.isdir(chosen) or chosen == path:
                raise CheckpointError(f"checkpoint {chosen}: {exc}") from None
            # pruned between the check and the read by a trainer still writing this run: not corruption
            say(f"checkpoint {os.path.basename(chosen)} was pruned while being read (a trainer still writes this "
                "run?); taking the next newest")
    raise CheckpointError(f"the checkpoints under {path} kept being pruned while being read (is a trainer still "
                          "writing this run? try again, or export once it has finished)")
