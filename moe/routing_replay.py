"""Routing replay for MoE RL (R2 and R3) on Megatron-Core 0.16.1's `RouterReplay`.

R2 records the top-k experts every MoE layer picks for every token in the pi_old log-prob forward and
replays them in the training forward (and backward recompute) of each mini-batch. R3 replays routes the
rollout engine captured (transformers router hooks, SGLang) in both the pi_old forward and training.
GSPO paper §5.3: with routes replayed, pi_theta and pi_old share the activated network of each token, so
token ratios w_{i,t} = pi_theta(y_t|..)/pi_old(y_t|..) stay meaningful.

Legend (docs/architecture.md, with two local axes): T packed tokens of one micro-batch in storage order, K
top-k, E experts, B rows and S sequence length of the model input [B, S]; here L is the MoE layers (of this
pipeline stage unless "total"; Ly in the shared legend), S_loc the sequence chunk a router sees (S / TP with
sequence parallelism) and N = S_loc * B the router tokens.

Storage order. `routes_TLK` is indexed t = b * S + s for the model input [B, S]: batch-major, i.e. the
packed order of `padded_to_packed` ([B, S] row by row) and, for a packed [1, T] input, the packed order
itself. Megatron's MoE layer flattens its [S_loc, B, H] hidden states sequence-major, and with sequence
parallelism TP rank r holds s in [r*S_loc, (r+1)*S_loc): `router_token_index` maps between the two.
With expert parallelism routing happens on each rank's own tokens before dispatch, so no mapping is needed.

Compact storage: uint8 ids for E <= 256, int16 for E <= 32768 (`route_dtype`). A pipeline stage holds only
its own MoE layers; a data-parallel rank only its micro-batches; the TP ranks of one DP rank hold the
same [T, L, K] (recorded chunks are all-gathered over TP, a few bytes per token).
Bytes per token = L * K * itemsize: Qwen3-30B-A3B (48 MoE layers, top-8, 128 experts) = 384.

Safety: Megatron's replay state lives on its `RouterReplay` instances (and a class-level list this module
never touches). `RoutingReplay` only sets the instances of the model it was given and always clears them
in `finally`, so a failed step never leaves replay (or recording) on. Replay with routes missing, of the
wrong length, for the wrong number of layers or with out-of-range / repeated expert ids raises
`RouteValidationError` naming the sample; replay asked for with routes None raises too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

class RoutingReplayError(RuntimeError):
    """Routing replay cannot do its job (model built without it, routes absent, state misuse)."""


class RouteValidationError(ValueError):
    """A route tensor does not fit the batch or the model; the message names the sample."""


# --------------------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------------------


def route_dtype(num_experts: int) -> torch.dtype:
    """uint8 when expert ids fit a byte (E <= 256), int16 up to E = 32768."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit int16 route storage (max 32768)")


@dataclass(frozen=True)
class RouteSpec:
    """What a route tensor must look like on this pipeline stage.

    `moe_layers` are the global MoE-layer indices (0..num_moe_layers_total-1, counting MoE layers only)
    this stage owns, in the order of the L axis of its routes."""

    num_experts: int
    topk: int
    moe_layers: tuple[int, ...]
    num_moe_layers_total: int

    def __post_init__(self) -> None:
        for name in ("num_experts", "topk", "num_moe_layers_total"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RouteSpec.{name} must be a positive integer, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"RouteSpec.topk={self.topk} exceeds num_experts={self.num_experts}")
        layers = tuple(int(i) for i in self.moe_layers)
        if any(not 0 <= i < self.num_moe_layers_total for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"RouteSpec.moe_layers={layers} must be distinct indices < {self.num_moe_layers_total}")
        object.__setattr__(self, "moe_layers", layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token this stage stores (its own layers only)."""
        return self.num_moe_layers * self.topk * self.dtype.itemsize

    def stage_slice(self, routes_TLK: Tensor) -> Tensor:
        """This stage's layers of routes covering every MoE layer of the model ([T, L_total, K] -> [T, L, K])."""
        if routes_TLK.dim() != 3 or routes_TLK.shape[1] != self.num_moe_layers_total:
            raise RouteValidationError(
                f"stage_slice expects routes [T, {self.num_moe_layers_total}, K] (all MoE layers), got {tuple(routes_TLK.shape)}"
            )
        if self.moe_layers == tuple(range(self.num_moe_layers_total)):
            return routes_TLK
        return routes_TLK[:, list(self.moe_layers)]


# --------------------------------------------------------------------------------------------------------
# Validation and packing of per-sample routes (R3)
# --------------------------------------------------------------------------------------------------------


def _sample_name(index: int, sample_ids: Optional[Sequence]) -> str:
    if sample_ids is not None and index < len(sample_ids):
        return f"sample {index} (id {sample_ids[index]!r})"
    return f"sample {index}"


def _check_ids(routes_nLK: Tensor, num_experts: int, what: str) -> None:
    """Expert ids in range and distinct within each (token, layer); raises naming `what`."""
    if routes_nLK.numel() == 0:
        return
    if routes_nLK.dtype.is_floating_point or routes_nLK.dtype == torch.bool or routes_nLK.is_complex():
        raise RouteValidationError(f"{what}: routes must hold integer expert ids, got dtype {routes_nLK.dtype}")
    ids = routes_nLK.long()
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_experts:
        bad = ((ids < 0) | (ids >= num_experts)).nonzero()[0].tolist()
        raise RouteValidationError(
            f"{what}: expert id {int(ids[tuple(bad)])} at (token {bad[0]}, layer {bad[1]}, k {bad[2]}) is "
            f"outside 0..{num_experts - 1}"
        )
    if ids.shape[-1] > 1:
        srt = ids.sort(dim=-1).values
        dup = (srt[..., 1:] == srt[..., :-1]).any(dim=-1)
        if bool(dup.any()):
            t, l = dup.nonzero()[0].tolist()
            raise RouteValidationError(f"{what}: token {t} layer {l} repeats an expert: {ids[t, l].tolist()}")


def validate_sample_routes(routes, length: int, spec: RouteSpec, *, index: int = 0, sample_ids=None,
                           all_layers: bool = True, allow_missing_final_token: bool = False) -> None:
    """Check one sample's routes [n, L, K] against its token count and the model; raise naming the sample.

    `all_layers`: the routes cover every MoE layer of the model (as an engine returns them) rather than
    only this stage's."""
    name = _sample_name(index, sample_ids)
    if routes is None:
        raise RouteValidationError(
            f"{name}: no routes while routing replay is on (the rollout engine returned none?); refusing to "
            "train without replay"
        )
    if not isinstance(routes, Tensor):
        raise RouteValidationError(f"{name}: routes must be a tensor, got {type(routes).__name__}")
    layers = spec.num_moe_layers_total if all_layers else spec.num_moe_layers
    if routes.dim() != 3:
        raise RouteValidationError(f"{name}: routes must be [tokens, {layers} MoE layers, {spec.topk}], got shape {tuple(routes.shape)}")
    n, got_layers, k = routes.shape
    if got_layers != layers:
        raise RouteValidationError(
            f"{name}: routes are for {got_layers} MoE layers, the model {'has' if all_layers else 'stage holds'} {layers}"
        )
    if k != spec.topk:
        raise RouteValidationError(f"{name}: routes hold top-{k} experts, the model routes top-{spec.topk}")
    ok_lengths = (length, length - 1) if allow_missing_final_token else (length,)
    if n not in ok_lengths:
        raise RouteValidationError(
            f"{name}: routes cover {n} tokens, the sequence has {length}"
            + (" (or one fewer when the final token is missing)" if allow_missing_final_token else "")
        )
    _check_ids(routes, spec.num_experts, name)


def filler_routes(num_tokens: int, spec: RouteSpec, num_layers: Optional[int] = None, device=None) -> Tensor:
    """A fixed valid route (experts 0..K-1) for positions whose routing cannot affect any scored log-prob
    (padding, the final token of a sequence)."""
    layers = spec.num_moe_layers if num_layers is None else num_layers
    base_K = torch.arange(spec.topk, dtype=spec.dtype, device=device)
    return base_K.expand(num_tokens, layers, spec.topk).clone()


def pack_sample_routes(samples: Sequence[Optional[Tensor]], lengths: Sequence[int], spec: RouteSpec, *,
                       sample_ids: Optional[Sequence] = None, total_tokens: Optional[int] = None,
                       all_layers: bool = True, allow_missing_final_token: bool = False) -> Tensor:
    """Validate per-sample routes and pack them into this stage's [T, L, K] in packed-sequence order.

    `samples[i]` is sample i's routes [n_i, L_total, K] (all_layers) or [n_i, L, K]; `lengths[i]` its token
    count in the packed batch (cu_seqlens differences). Tokens past sum(lengths) up to `total_tokens`
    (padding) get filler routes. Returns the compact dtype."""
    if samples is None:
        raise RouteValidationError("routing replay is on but the batch carries no routes at all (routes=None)")
    if len(samples) != len(lengths):
        raise RouteValidationError(f"{len(samples)} route tensors for {len(lengths)} samples")
    pieces = []
    for i, (routes, length) in enumerate(zip(samples, lengths)):
        length = int(length)
        validate_sample_routes(routes, length, spec, index=i, sample_ids=sample_ids, all_layers=all_layers,
                               allow_missing_final_token=allow_missing_final_token)
        routes = spec.stage_slice(routes) if all_layers else routes
        routes = routes.to(spec.dtype)
        if routes.shape[0] == length - 1:
            routes = torch.cat([routes, filler_routes(1, spec, device=routes.device)])
        pieces.append(routes)
    packed = torch.cat(pieces) if pieces else filler_routes(0, spec)
    if total_tokens is not None:
        if total_tokens < packed.shape[0]:
            raise RouteValidationError(f"samples hold {packed.shape[0]} tokens, more than total_tokens={total_tokens}")
        if total_tokens > packed.shape[0]:
            packed = torch.cat([packed, filler_routes(total_tokens - packed.shape[0], spec, device=packed.device)])
    return packed


def validate_routes(routes_TLK, spec: RouteSpec, num_tokens: Optional[int] = None,
                    cu_seqlens_S1: Optional[Tensor] = None, sample_ids: Optional[Sequence] = None) -> None:
    """Check a packed [T, L, K] route tensor of this stage; errors name the sample owning the bad token
    when `cu_seqlens_S1` is given."""
    if routes_TLK is None:
        raise RouteValidationError("routing replay is on but routes are None; refusing to run without replay")
    if not isinstance(routes_TLK, Tensor) or routes_TLK.dim() != 3:
        shape = tuple(routes_TLK.shape) if isinstance(routes_TLK, Tensor) else type(routes_TLK).__name__
        raise RouteValidationError(f"routes must be a [T, {spec.num_moe_layers}, {spec.topk}] tensor, got {shape}")
    if cu_seqlens_S1 is not None:
        bounds = [int(x) for x in cu_seqlens_S1.tolist()]
        if routes_TLK.shape[0] < bounds[-1]:
            last = max(i for i in range(len(bounds) - 1) if bounds[i] < routes_TLK.shape[0]) if routes_TLK.shape[0] else 0
            raise RouteValidationError(
                f"{_sample_name(last, sample_ids)}: routes end at token {routes_TLK.shape[0]}, the packed batch "
                f"has {bounds[-1]} tokens (sample spans {bounds[last]}..{bounds[last + 1]})"
            )
        for i in range(len(bounds) - 1):
            validate_sample_routes(routes_TLK[bounds[i]:bounds[i + 1]], bounds[i + 1] - bounds[i], spec,
                                   index=i, sample_ids=sample_ids, all_layers=False)
        return
    if num_tokens is not None and routes_TLK.shape[0] != num_tokens:
        raise RouteValidationError(f"routes cover {routes_TLK.shape[0]} tokens, the micro-batch has {num_tokens}")
    validate_sample_routes(routes_TLK, routes_TLK.shape[0], spec, index=0, sample_ids=sample_ids, all_layers=False)


# --------------------------------------------------------------------------------------------------------
# Token order: storage [B, S] batch-major <-> Megatron router [S_loc, B] sequence-major
# --------------------------------------------------------------------------------------------------------


def router_token_index(batch: int, seq_local: int, tp_rank: int = 0, sequence_parallel: bool = False,
                       tp_size: int = 1, device=None) -> Tensor:
    """index_N[n] = storage position t (= b * S + s) of router token n (= s_loc * B + b) on this TP rank.

    S = seq_local * tp_size with sequence parallelism (rank r holds s = r * seq_local + s_loc), else
    S = seq_local (every TP rank routes every token)."""
    seq = seq_local * tp_size if sequence_parallel else seq_local
    s_S = torch.arange(seq_local, device=device) + (tp_rank * seq_local if sequence_parallel else 0)
    b_B = torch.arange(batch, device=device)
    return (b_B[None, :] * seq + s_S[:, None]).reshape(-1)


# --------------------------------------------------------------------------------------------------------
# The replay controller
# --------------------------------------------------------------------------------------------------------


def _in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation recompute inside it)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Layer:
    moe_index: int  # global MoE-layer index
    layer_number: int  # global 1-based transformer layer number
    router: torch.nn.Module


class RecordedRoutes:
    """What `RoutingReplay.recording()` captured: one [T, L, K] tensor per forward call (micro-batch)."""

    def __init__(self) -> None:
        self.microbatches: list[Tensor] = []

    @property
    def routes(self) -> Tensor:
        """The single micro-batch's routes; raises when the context saw zero or several forwards."""
        if len(self.microbatches) != 1:
            raise RoutingReplayError(f"recording saw {len(self.microbatches)} forward calls; use .microbatches")
        return self.microbatches[0]


class ReplayHandle:
    """State of one `RoutingReplay.replaying()` context: how many forwards consumed routes."""

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.forwards_done = 0


class RoutingReplay:
    """Record and replay the top-k routes of one model (or list of virtual-pipeline chunks) on this rank.

        replay = RoutingReplay(model)                   # model built with routing_replay=True
        with torch.no_grad(), replay.recording() as rec:  # R2: pi_old forward
            old_logp = forward(model, batch)
        routes_TLK = rec.routes                          # [T, L_stage, K] uint8 / int16
        with replay.replaying(routes_TLK):               # training forward + backward of that micro-batch
            loss = loss_fn(forward(model, batch)); loss.backward()

    `replaying` also takes a list of per-micro-batch routes, consumed one per model forward call in order
    (Megatron's pipeline / gradient-accumulation schedules run several forwards before their backwards):
    each router takes the next micro-batch's routes on its forward (REPLAY_FORWARD), and activation
    recompute inside backward replays them again in FIFO order (REPLAY_BACKWARD), chosen automatically by
    whether autograd is running a backward pass.

    Process groups: `tp_group` (default Megatron's TP group) is used to all-gather recorded sequence
    chunks under sequence parallelism.
    """

    def __init__(self, model, *, tp_group=None, sequence_parallel: Optional[bool] = None) -> None:
        if not hasattr(torch._C, "_current_graph_task_id"):
            raise RoutingReplayError("this torch lacks torch._C._current_graph_task_id, needed to tell recompute from forward")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        from megatron.core.transformer.moe.router import TopKRouter

        config = None
        layers: list[_Layer] = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    config = module.config
                    if module.router_replay is None:
                        raise RoutingReplayError(
                            f"MoE layer {module.layer_number} has no RouterReplay: build the model with "
                            "routing_replay=True (TransformerConfig.moe_enable_routing_replay)"
                        )
                    if module.layer_number is None:
                        raise RoutingReplayError("a TopKRouter has no layer_number; cannot place its routes")
                    layers.append(_Layer(-1, int(module.layer_number), module))
        if config is None:
            raise RoutingReplayError("the model has no MoE layers (no TopKRouter): nothing to record or replay")
        if config.moe_router_fusion:
            raise RoutingReplayError("moe_router_fusion bypasses Megatron's RouterReplay; turn it off for routing replay")
        if config.moe_expert_capacity_factor is not None:
            raise RoutingReplayError("routing replay with token dropping (moe_expert_capacity_factor) would drop replayed routes")
        if getattr(config, "context_parallel_size", 1) > 1:
            raise RoutingReplayError("routing replay with context parallelism is not implemented (token order)")
        pattern = _moe_layer_pattern(config)
        moe_index_of = {n + 1: sum(pattern[:n]) for n in range(len(pattern)) if pattern[n]}
        layers.sort(key=lambda x: x.layer_number)
        for layer in layers:
            if layer.layer_number not in moe_index_of:
                raise RoutingReplayError(f"layer {layer.layer_number} has a router but is dense in moe_layer_freq")
            layer.moe_index = moe_index_of[layer.layer_number]
        if len({l.layer_number for l in layers}) != len(layers):
            raise RoutingReplayError("two routers claim the same layer number (MTP layers are not supported)")
        self.layers = layers
        self.config = config
        self.spec = RouteSpec(num_experts=config.num_moe_experts, topk=config.moe_router_topk,
                              moe_layers=tuple(l.moe_index for l in layers), num_moe_layers_total=sum(pattern))
        self.sequence_parallel = bool(config.sequence_parallel if sequence_parallel is None else sequence_parallel)
        self._tp_group = tp_group
        self._active = False

    def _tp(self):
        from megatron.core import parallel_state as ps

        group = self._tp_group or ps.get_tensor_model_parallel_group()
        return group, torch.distributed.get_rank(group), torch.distributed.get_world_size(group)

    # --- state handling ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self, what: str):
        if self._active:
            raise RoutingReplayError(f"{what}: a recording/replaying context is already open on this model")
        for layer in self.layers:
            rr = layer.router.router_replay
            if rr.router_replay_action is not None or rr.target_topk_idx is not None:
                raise RoutingReplayError(
                    f"{what}: router of layer {layer.layer_number} already has replay state "
                    f"({rr.router_replay_action}); something else drives RouterReplay"
                )
        hooks = []
        self._active = True
        try:
            yield hooks
        finally:
            for hook in hooks:
                hook.remove()
            for layer in self.layers:
                rr = layer.router.router_replay
                rr.clear_router_replay_action()
                rr.clear_indices()
                rr.__dict__.pop("record_indices", None)
                rr.__dict__.pop("get_replay_topk", None)
            self._active = False

    # --- recording --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self) -> Iterator[RecordedRoutes]:
        """Record each MoE layer's own top-k on every forward call inside the context (Megatron RECORD).

        After the context, `rec.microbatches[i]` is forward call i's routes [T, L, K] in storage order
        (compact dtype), all-gathered over TP under sequence parallelism. Calls made inside a backward
        (activation recompute) are not recorded."""
        result = RecordedRoutes()
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        calls: list[list] = [[] for _ in self.layers]  # per layer: (indices_NK, batch, seq_local)
        with self._session("recording") as hooks:
            for i, layer in enumerate(self.layers):
                rr = layer.router.router_replay
                shape_box = _watch_input_shape(layer, hooks)

                def record(indices_NK, calls_l=calls[i], shape_box=shape_box):
                    if _in_backward():
                        return
                    calls_l.append((indices_NK.detach(), *shape_box["shape"]))

                rr.record_indices = record
                rr.set_router_replay_action(RouterReplayAction.RECORD)
            yield result
            result.microbatches.extend(self._stacked(calls))

    def _stacked(self, calls: list) -> list:
        """Per forward call, every layer's recorded (indices_NK, batch, seq_local) as one [T, L, K] in storage
        order (compact dtype)."""
        counts = {len(c) for c in calls}
        if len(counts) != 1:
            raise RoutingReplayError(f"MoE layers recorded different numbers of forward calls: {[len(c) for c in calls]}")
        out = []
        for call in range(counts.pop()):
            per_layer = [self._to_storage(*calls[l][call]) for l in range(len(self.layers))]
            out.append(torch.stack(per_layer, dim=1).to(self.spec.dtype))
        return out

    def _capture_live(self, hooks: list) -> list:
        """Inside a replaying session: each router's own top-k (Megatron's default top-k on the scores it was
        given) on every forward call that replays (not backward recompute), per layer as recording keeps them.
        Megatron's RouterReplay.get_replay_topk is wrapped on the instance for the session (the session's cleanup
        removes it with the other replay state)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        calls: list[list] = [[] for _ in self.layers]
        for i, layer in enumerate(self.layers):
            rr = layer.router.router_replay
            shape_box = _watch_input_shape(layer, hooks)

            def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None,
                                rr=rr, calls_l=calls[i], shape_box=shape_box):
                if rr.router_replay_action == RouterReplayAction.REPLAY_FORWARD and not _in_backward():
                    _, own_NK = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    calls_l.append((own_NK.detach(), *shape_box["shape"]))
                return type(rr).get_replay_topk(rr, scores, topk, num_groups, group_topk, default_compute_topk)

            rr.get_replay_topk = get_replay_topk
        return calls

    def _to_storage(self, indices_NK: Tensor, batch: int, seq_local: int) -> Tensor:
        """Router-order [S_loc*B, K] -> storage-order [B*S, K] (gathering sequence chunks over TP)."""
        if self.sequence_parallel:
            group, _, tp_size = self._tp()
            if tp_size > 1:
                chunks = [torch.empty_like(indices_NK) for _ in range(tp_size)]
                torch.distributed.all_gather(chunks, indices_NK.contiguous(), group=group)
                indices_NK = torch.cat(chunks)  # [S*B, K], sequence chunks in rank order
            seq = seq_local * tp_size
        else:
            seq = seq_local
        return indices_NK.view(seq, batch, -1).transpose(0, 1).reshape(batch * seq, -1)

    # --- replaying --------------------------------------------------------------------------------------

    # Over 60 lines: route checks, per-layer hook install and the guaranteed removal, one context manager.
    @contextlib.contextmanager
    def replaying(self, routes: Union[Tensor, Sequence[Tensor], None], *,
                  validate: bool = True, live: Optional[RecordedRoutes] = None) -> Iterator[ReplayHandle]:
        """Replay `routes` ([T, L, K] for one micro-batch, or a list with one per forward call) in every
        MoE layer of this stage, forward and backward recompute. Raises `RouteValidationError` when routes
        are None or do not fit; a forward whose token count differs from its routes raises at that layer.

        A single tensor is reused for every forward call (e.g. one micro-batch's forward and backward, or
        several forwards over the same tokens). `validate=False` skips the id checks (range, distinct; they
        sync the host) for routes already checked by `pack_sample_routes`; shapes are always checked.

        `live`: also what each router would have chosen itself, the top-k of its own scores on the same forward,
        appended per forward call as `recording` does (how far the replayed routes are from the live router's:
        the route-gap metrics). The replayed routes still drive the forward."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routes is None:
            raise RouteValidationError("routing replay is on but routes are None; refusing to run without replay")
        single = isinstance(routes, Tensor)
        queue = [routes] if single else list(routes)
        if not queue:
            raise RouteValidationError("routing replay is on but the list of micro-batch routes is empty")
        for i, routes_TLK in enumerate(queue):
            if routes_TLK is None:
                raise RouteValidationError(f"micro-batch {i}: routes are None while routing replay is on")
            if validate:
                validate_routes(routes_TLK, self.spec)
            elif routes_TLK.dim() != 3 or tuple(routes_TLK.shape[1:]) != (self.spec.num_moe_layers, self.spec.topk):
                raise RouteValidationError(
                    f"micro-batch {i}: routes shape {tuple(routes_TLK.shape)} does not fit "
                    f"[T, {self.spec.num_moe_layers}, {self.spec.topk}]"
                )
        handle = ReplayHandle(len(queue))
        tp_rank, tp_size = 0, 1
        if self.sequence_parallel:
            _, tp_rank, tp_size = self._tp()
        recompute = self.config.recompute_granularity is not None or bool(getattr(self.config, "moe_layer_recompute", False))
        with self._session("replaying") as hooks:
            for l, layer in enumerate(self.layers):
                rr = layer.router.router_replay
                state = {"next": 0}

                def pre_hook(module, args, kwargs, l=l, rr=rr, state=state, layer=layer):
                    if _in_backward():  # activation recompute: Megatron pops its FIFO of this layer's targets
                        if not rr.replay_backward_list:
                            raise RoutingReplayError(
                                f"layer {layer.layer_number}: backward recompute with no replayed forward left to match"
                            )
                        rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                        return
                    hidden = args[0] if args else kwargs["input"]
                    seq_local, batch = hidden.shape[0], hidden.shape[1]
                    index = 0 if single else state["next"]
                    if index >= len(queue):
                        raise RoutingReplayError(
                            f"layer {layer.layer_number}: forward call {index + 1} but routes were given for "
                            f"{len(queue)} micro-batch(es)"
                        )
                    routes_TLK = queue[index]
                    seq = seq_local * tp_size if self.sequence_parallel else seq_local
                    if routes_TLK.shape[0] != batch * seq:
                        raise RouteValidationError(
                            f"micro-batch {index}: routes cover {routes_TLK.shape[0]} tokens, the model input has "
                            f"{batch} x {seq} = {batch * seq} (layer {layer.layer_number})"
                        )
                    index_N = router_token_index(batch, seq_local, tp_rank, self.sequence_parallel, tp_size,
                                                 device=routes_TLK.device)
                    target_NK = routes_TLK[index_N, l].long().to(hidden.device)
                    rr.set_target_indices(target_NK)
                    if not recompute:  # Megatron keeps every target for backward recompute; none will come
                        rr.replay_backward_list.clear()
                    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                    state["next"] += 1
                    if l == 0:
                        handle.forwards_done = state["next"]

                hooks.append(layer.router.register_forward_pre_hook(pre_hook, with_kwargs=True))
            live_calls = self._capture_live(hooks) if live is not None else None
            yield handle
            if live is not None:
                live.microbatches.extend(self._stacked(live_calls))


def _watch_input_shape(layer: _Layer, hooks: list) -> dict:
    """A dict whose "shape" is (B, S_loc) of the router's last input ([S_loc, B, H]): a forward pre-hook, appended
    to the session's hooks (removed with them)."""
    shape_box: dict = {}

    def pre_hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["input"]
        shape_box["shape"] = (hidden.shape[1], hidden.shape[0])

    hooks.append(layer.router.register_forward_pre_hook(pre_hook, with_kwargs=True))
    return shape_box


def _moe_layer_pattern(config) -> list[int]:
    """1 per MoE layer, 0 per dense one, as Megatron's gpt_layer_specs parses moe_layer_freq."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    pattern = [int(x) for x in freq]
    if len(pattern) != config.num_layers:
        raise RoutingReplayError(f"moe_layer_freq has {len(pattern)} entries for {config.num_layers} layers")
    return pattern


__all__ = [
    "RecordedRoutes", "ReplayHandle", "RouteSpec", "RouteValidationError", "RoutingReplay", "RoutingReplayError",
    "filler_routes", "pack_sample_routes", "route_dtype", "router_token_index", "validate_routes",
    "validate_sample_routes",
]


def replay_available() -> tuple[bool, str]:
    """(True, "") where routing replay can run: Megatron-Core's router replay (megatron-core >= 0.16) imports;
    else (False, why). The config asks before a recipe with rl.routing_replay r2 / r3 is accepted."""
    try:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: F401
    except ImportError as exc:
        return False, f"Megatron-Core's router replay cannot be imported ({exc})"
    return True, ""
