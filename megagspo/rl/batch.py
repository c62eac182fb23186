"""One batch of sequences from the rollout engine to the loss: `SequenceBatch`, flat per-token tensors built once
from the engine's `RolloutOutput`, and its two views of a micro-batch — the model's input (`ModelInput`: one packed
stream of whole sequences, `rl.batch.packing: true`, or one right-padded row per sequence) and the loss's (the same
flat tensors, segmented by the sequences' offsets).

Legend (docs/architecture.md): R sequences of this rank's rollout batch (one per response), S the padded row
length, T tokens (the model-input positions of the sequences, one after another), N sequences of a micro-batch,
Ly MoE layers of this pipeline stage, K top-k. Sequence i holds positions [cu[i], cu[i+1]) of every `_T` tensor:
its prompt and response up to its last real token, minus the final target (at least one position).

A packed stream under sequence parallelism is rounded up to a multiple of TP with pad tokens that form a
sequence of their own (the model's cu_seqlens), left out of the router aux loss and of the loss; padded rows
mark every position past the sequence as padding for the aux loss. Both layouts route, score and balance exactly
the same real tokens.

`rl.batch.packing: false` stays, as this batch's one-sequence-per-row view, not as a second data path: it is the
reference the packed stream is tested against (same gradients, tests/test_packing.py), the only layout Megatron's
local attention takes (model.attention = local), and the view the cold-start SFT trains on. SFT is not packed: its
router aux loss has always counted the row padding (`model_input(aux_len=)`), which a packed stream has none of,
so packing it would change the cold start's numbers (tests/test_golden_metrics.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from megagspo.policy.megatron_policy import ModelInput
from megagspo.rollout import RolloutOutput
from moe.model import PackedSequences
from moe.parallel import ParallelDims
from moe.routing_replay import RouteSpec, filler_routes, pack_sample_routes


def sequence_lengths(prompt_ids: list, response_mask_RL: torch.Tensor) -> List[int]:
    """Model-input positions of each sequence: prompt + response up to its last real token, minus the final
    target (at least one position)."""
    resp_len = response_mask_RL.shape[1]
    position_L = torch.arange(1, resp_len + 1)
    extent_R = torch.where(response_mask_RL.bool(), position_L, 0).amax(1) if resp_len else torch.zeros(len(prompt_ids))
    lengths = torch.tensor([len(p) for p in prompt_ids]) + extent_R.long() - 1
    return lengths.clamp(min=1).tolist()


def _per_token(host: bool = False, optional: bool = False):
    """A per-token field ([T, ...]: select takes its sequences' tokens, the DP exchange moves them); `host`: it stays
    where it is when the batch moves to the model's device."""
    return field(default=None, metadata={"per": "token", "host": host}) if optional else \
        field(metadata={"per": "token", "host": host})


@dataclass
class SequenceBatch:
    """Every per-token and per-sequence tensor is declared once, by its field's metadata: `select`, `to` and the
    data-parallel exchange (megagspo.rl.dp_balance) iterate the declaration, so a new field travels everywhere."""

    tokens_T: torch.Tensor = _per_token()                  # model input ids, int64
    targets_T: torch.Tensor = _per_token()                 # the token each position predicts, int64
    loss_mask_T: torch.Tensor = _per_token()               # bool: the target is a token the engine sampled
    rollout_logp_T: torch.Tensor = _per_token()            # float32: the engine's log-prob of that target (0 elsewhere)
    advantages_S: torch.Tensor = field(metadata={"per": "sequence"})  # float32, per sequence (eq. 7)
    lengths: List[int]                     # per sequence, on the host (select and the DP exchange keep them apart)
    pad_id: int
    row_len: int                           # S of the padded layout (rl.batch.packing = false)
    # the engine's routes [T, Ly, K] of this stage (R3, rollout pi_old); moved per micro-batch, not with the batch
    routes_TLy: Optional[torch.Tensor] = _per_token(host=True, optional=True)
    route_spec: Optional[RouteSpec] = None      # the policy's, with routes_TLy
    # int64: the policy version that sampled the target (0 elsewhere); partial rollouts only (RolloutOutput.version_RL)
    version_T: Optional[torch.Tensor] = _per_token(optional=True)
    cu_seqlens_S1: torch.Tensor = field(init=False)

    @classmethod
    def per_token_fields(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("per") == "token"]

    @classmethod
    def per_sequence_tensors(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("per") == "sequence"]

    def __post_init__(self) -> None:
        offsets = [0]
        for n in self.lengths:
            offsets.append(offsets[-1] + n)
        self.cu_seqlens_S1 = torch.tensor(offsets, dtype=torch.int64, device=self.tokens_T.device)
        self._offsets = offsets

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @classmethod
    def from_rollouts(cls, out: RolloutOutput, advantages_R: torch.Tensor, pad_id: int, row_len: int,
                      route_spec=None) -> "SequenceBatch":
        """The engine's rows as sequences: prompt + response, shifted into (input, target) pairs, the engine's
        log-probs at the response targets; its routes packed per sequence for this stage (`route_spec`: the
        policy's, when the step uses the engine's routes)."""
        lengths = sequence_lengths(out.prompt_ids, out.response_mask_RL)
        pieces = {"tokens": [], "targets": [], "mask": [], "logp": [], "version": []}
        sampled_RL = out.sampled_RL  # multi-turn: tool, user and boundary tokens are context, never loss
        for r, (prompt, n) in enumerate(zip(out.prompt_ids, lengths)):
            p = len(prompt)
            full = torch.cat([torch.tensor(prompt, dtype=torch.long), out.response_ids_RL[r].long()])
            mask = torch.cat([torch.zeros(p, dtype=torch.bool), sampled_RL[r]])
            logp = torch.cat([torch.zeros(p), torch.where(sampled_RL[r], out.logp_RL[r], 0.0)])
            pieces["tokens"].append(full[:n])
            pieces["targets"].append(full[1:n + 1])
            pieces["mask"].append(mask[1:n + 1])
            pieces["logp"].append(logp[1:n + 1].float())
            if out.version_RL is not None:
                version = torch.cat([torch.zeros(p, dtype=torch.long),
                                     torch.where(sampled_RL[r], out.version_RL[r].long(), 0)])
                pieces["version"].append(version[1:n + 1])
        routes = None
        if out.routes_RPLyK is not None and route_spec is not None:
            samples = [out.routes_RPLyK[r, :n].long() for r, n in enumerate(lengths)]
            samples = [torch.where(s < 0, torch.arange(s.shape[-1]).expand_as(s), s) for s in samples]
            routes = pack_sample_routes(samples, lengths, route_spec)
        cat = {k: torch.cat(v) for k, v in pieces.items() if v}
        return cls(cat["tokens"], cat["targets"], cat["mask"], cat["logp"], advantages_R.float(), lengths, pad_id,
                   row_len, routes, route_spec if routes is not None else None, cat.get("version"))

    @classmethod
    def from_demonstrations(cls, prompt_ids: list, answer_ids: list, pad_id: int, row_len: int,
                            answer_masks: Optional[list] = None) -> "SequenceBatch":
        """Cold-start SFT's batch: prompt + answer (+ eos, the caller's) per sequence, the answer's tokens as the
        loss targets (`answer_masks`: only the answer tokens marked True, e.g. a multi-turn demonstration's
        assistant turns, not its tool responses). As SFT's padded rows always had, a sequence also holds its last
        token as an input (its target pad_id, outside the loss) where the row has room for it (`row_len`: at least
        the longest prompt + the longest answer - 1). No rollout log-probs or advantages: zeros."""
        tokens, targets, mask, lengths = [], [], [], []
        for i, (prompt, answer) in enumerate(zip(prompt_ids, answer_ids)):
            full = torch.tensor(list(prompt) + list(answer) + [pad_id], dtype=torch.long)
            n = min(len(prompt) + len(answer), row_len)
            tokens.append(full[:n])
            targets.append(full[1:n + 1])
            # targets from the answer's first token to its last (not the appended pad)
            marked = torch.ones(len(answer), dtype=torch.bool) if answer_masks is None else \
                torch.tensor(list(answer_masks[i]), dtype=torch.bool)
            target_mask = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), marked, torch.zeros(1, dtype=torch.bool)])
            mask.append(target_mask[1:n + 1])
            lengths.append(n)
        total = sum(lengths)
        return cls(torch.cat(tokens), torch.cat(targets), torch.cat(mask), torch.zeros(total),
                   torch.zeros(len(lengths)), lengths, pad_id, row_len)

    def select(self, indices: Sequence[int]) -> "SequenceBatch":
        """The sub-batch of these sequences, in this order."""
        idx = [int(i) for i in indices]
        spans = [torch.arange(self._offsets[i], self._offsets[i + 1]) for i in idx]
        take = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)
        seq_idx = torch.tensor(idx, dtype=torch.long)
        picked = {name: x[take.to(x.device)] for name in self.per_token_fields()
                  if (x := getattr(self, name)) is not None}
        picked.update({name: getattr(self, name)[seq_idx.to(getattr(self, name).device)]
                       for name in self.per_sequence_tensors()})
        return dataclasses.replace(self, **picked, lengths=[self.lengths[i] for i in idx])

    def to(self, device) -> "SequenceBatch":
        """The tensors on `device`, but those declared `host` (the routes: they go per micro-batch)."""
        names = [f.name for f in dataclasses.fields(self) if f.metadata.get("per") and not f.metadata.get("host")]
        return dataclasses.replace(self, **{name: x.to(device) for name in names
                                            if (x := getattr(self, name)) is not None})

    # ---- the views of one micro-batch -------------------------------------------------------------------
    def model_input(self, packed: bool, dims: ParallelDims, *, aux_len: Optional[int] = None) -> "ModelView":
        """What the model sees of these sequences: one packed stream (with the TP alignment tail) or padded rows.

        Padded rows leave every position past a sequence out of the router aux loss; with `aux_len` only the
        positions from aux_len on (ModelInput.padded's alignment padding): the row padding below it counts, as it
        always has in the cold-start SFT (megagspo.trainer.sft)."""
        dev, T = self.tokens_T.device, self.num_tokens
        if packed:
            total = dims.seq_length(T)
            tail = total - T

            def stream(x_T, fill):
                return (torch.cat([x_T, x_T.new_full((tail,), fill)]) if tail else x_T)[None]

            sequences = PackedSequences.from_lengths(self.lengths + ([tail] if tail else []), device=dev)
            padding = (torch.arange(total, device=dev) >= T)[None] if tail else None
            return ModelView(ModelInput(stream(self.tokens_T, self.pad_id), stream(self.targets_T, self.pad_id),
                                        padding, sequences), None)
        flat_T = self._row_positions()
        tokens_BS, targets_BS = self.rows_of(self.tokens_T, self.pad_id), self.rows_of(self.targets_T, self.pad_id)
        if aux_len is not None:
            return ModelView(ModelInput.padded(tokens_BS, targets_BS, aux_len), flat_T)
        padding_BS = ~self.rows_of(torch.ones_like(self.loss_mask_T), False)
        return ModelView(ModelInput(tokens_BS, targets_BS, padding_BS if bool(padding_BS.any()) else None), flat_T)

    def _row_positions(self) -> torch.Tensor:
        """Where each token sits in the padded rows [R, S], flattened: sequence i's positions in row i."""
        S = self.row_len
        position_T = torch.cat([torch.arange(n) for n in self.lengths]) if self.lengths else torch.zeros(0, dtype=torch.long)
        row_T = torch.repeat_interleave(torch.arange(self.num_sequences), torch.tensor(self.lengths, dtype=torch.long))
        return (row_T * S + position_T).to(self.tokens_T.device)

    def rows_of(self, x_T: torch.Tensor, fill) -> torch.Tensor:
        """A per-token tensor as one right-padded row per sequence [R, S], `fill` past each sequence."""
        out = x_T.new_full((self.num_sequences * self.row_len,), fill)
        out[self._row_positions().to(x_T.device)] = x_T
        return out.view(self.num_sequences, self.row_len)

    def routes_for(self, view: "ModelView", device) -> Optional[torch.Tensor]:
        """The engine's routes of these sequences in the storage order of `view`'s model input ([T', Ly, K]);
        positions outside the sequences (alignment tail, row padding) get a fixed valid route (never scored)."""
        if self.routes_TLy is None:
            return None
        r_TLK = self.routes_TLy
        computed = view.computed_tokens
        if view.flat_T is None:
            out = torch.cat([r_TLK, filler_routes(computed - r_TLK.shape[0], self.route_spec)])
        else:
            out = filler_routes(computed, self.route_spec)
            out[view.flat_T.cpu()] = r_TLK
        return out.to(device)


@dataclass
class ModelView:
    """One micro-batch's model input and where its sequences' tokens sit in it: the first T positions of the packed
    stream (flat_T None) or, in padded rows, the flattened positions flat_T."""

    model: ModelInput
    flat_T: Optional[torch.Tensor]

    def tokens_of(self, x_BS: Optional[torch.Tensor], num_tokens: int) -> Optional[torch.Tensor]:
        """A per-position result of the model ([B, S] / [1, T'], or routes [T', Ly, K] in its storage order) at the
        sequences' tokens, in sequence order ([T] / [T, Ly, K])."""
        if x_BS is None:
            return None
        flat = x_BS.reshape(-1) if x_BS.dim() == 2 else x_BS  # [B, S] results; routes are [T', Ly, K] already
        return flat[:num_tokens] if self.flat_T is None else flat[self.flat_T.to(flat.device)]

    @property
    def computed_tokens(self) -> int:
        return self.model.input_ids_BS.numel()


__all__ = ["ModelView", "SequenceBatch", "sequence_lengths"]
