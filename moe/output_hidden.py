"""The LM head's input and weight of a Megatron-Core GPTModel, without running its output layer.

Log-probs straight from hidden states (a chunked, vocab-parallel linear log-prob kernel) need the two operands
of the LM head, never the [tokens, vocab] logits it would produce:

    hidden_BSH = forward_hidden(model, input_ids_BS)    # last stage: what the output layer would multiply
    weight_VH = output_weight(model)                     # this TP rank's vocab rows [V/TP, H]
    main_grad_VH = output_weight_grad_buffer(model)      # Megatron DDP's fp32 gradient buffer of it, or None

`forward_hidden` runs GPTModel.forward unchanged (embedding, decoder, final norm) and stops where the output
layer would start: it clears `model.post_process` for the duration of the call, which in Megatron-Core 0.16.1
is read in forward only by `_postprocess` ("if not self.post_process: return hidden_states"). The switch is a
logged, scoped patch; tests/test_output_hidden.py checks that `output_layer(hidden)` equals the logits of the
normal forward, values and gradients, at TP = 1, TP = 2 (sequence parallel) and on the last PP stage.

Gradient semantics are the output layer's: with sequence parallelism (TP > 1) the decoder's output is split
over the sequence and the output layer all-gathers it (its backward reduce-scatters the d input that each TP
rank computed from its vocab shard); with TP > 1 and no SP the input is copied and its gradient all-reduced.
`forward_hidden` applies the same communication, so a vocab-parallel kernel fed with `hidden_BSH` and
`weight_VH` gives exactly the gradients of the logits path.

Shape legend: B batch, S sequence length (S/TP per rank under sequence parallelism), H hidden, V vocabulary
(V/TP rows per rank).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from moe.model import forward_logits

log = logging.getLogger(__name__)
_LOGGED = []


def output_weight(model) -> torch.Tensor:
    """The LM head weight [V/TP, H] of the last pipeline stage: `output_layer.weight`, or with tied
    embeddings the embedding (first stage = last stage at PP = 1) or the last stage's copy of it (PP > 1), the
    parameter Megatron's own output layer multiplies by (so its gradient lands where Megatron's would)."""
    _check_last_stage(model, "output_weight")
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def output_weight_grad_buffer(model):
    """Megatron DDP's float32 gradient buffer of the LM head weight (`main_grad`, the buffer its grad-ready hook
    would add the weight's gradient into), or None where there is none (no DDP wrapper, a frozen model). A
    kernel that adds d weight straight into it spares the [V/TP, H] gradient tensor, and follows Megatron's
    protocol for it (moe.optimizer.gradient_added_to_main_grad): it sets `grad_added_to_main_grad`, so the
    grad-ready hook does not add the placeholder gradient it hands to autograd (an alias of the weight,
    no allocation) and still marks the weight ready for its bucket's reduction. With tied embeddings at
    PP = 1 (Megatron's `zero_out_wgrad`) the kernel hands autograd nothing and the embedding's own gradient
    goes through the hook alone: the two contributions sum in main_grad as on the logits path."""
    weight = output_weight(model)
    if not weight.requires_grad:
        return None
    return getattr(weight, "main_grad", None)


@contextlib.contextmanager
def _stop_before_output_layer(model):
    """GPTModel.forward returns the decoder's output (after the final norm) instead of the logits."""
    if not _LOGGED:
        log.info("moe.output_hidden: GPTModel.post_process cleared around forward: hidden states instead of "
                 "logits (megatron-core GPTModel._postprocess)")
        _LOGGED.append(True)
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = True


def forward_hidden(model, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None,
                   padding_mask_BS: torch.Tensor | None = None, packed=None) -> torch.Tensor:
    """Last pipeline stage: the output layer's input, hidden_BSH [B, S, H], full sequence on every TP rank
    (all-gathered under sequence parallelism, with the output layer's gradient semantics). Other stages: the
    activations the stage sends on, as the plain forward returns them. Arguments as moe.model.forward_logits."""
    if not model.post_process:  # not the last stage: nothing to stop
        return forward_logits(model, input_ids_BS, position_ids_BS, padding_mask_BS, packed)
    _check_supported(model)
    with _stop_before_output_layer(model):
        hidden_SBH = forward_logits(model, input_ids_BS, position_ids_BS, padding_mask_BS, packed)
    return output_layer_input(model, hidden_SBH).transpose(0, 1)


def output_layer_input(model, hidden_SBH: torch.Tensor) -> torch.Tensor:
    """The decoder's output [S/TP, B, H] -> the output layer's effective input [S, B, H], communicating as
    ColumnParallelLinear does: all-gather over the sequence under SP (backward: reduce-scatter of the partial
    d input), copy with an all-reduced gradient for TP > 1 without SP, identity at TP = 1."""
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer = model.output_layer
    if layer.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=True,
                                                    group=layer.tp_group)
    if layer.tp_group is not None and torch.distributed.get_world_size(layer.tp_group) > 1:
        return copy_to_tensor_model_parallel_region(hidden_SBH, group=layer.tp_group)
    return hidden_SBH


def _check_last_stage(model, fn: str) -> None:
    if not model.post_process:
        raise ValueError(f"moe.output_hidden.{fn}: this pipeline stage has no output layer (post_process=False)")


def _check_supported(model) -> None:
    """Output-layer features whose computation the hidden path would skip: refused, never silently changed."""
    config = model.config
    unsupported = {
        "mtp_num_layers (multi-token prediction)": getattr(config, "mtp_num_layers", None) is not None,
        "defer_embedding_wgrad_compute": getattr(config, "defer_embedding_wgrad_compute", False),
        "an output-layer bias": getattr(model.output_layer, "bias", None) is not None,
        "gather_output (logits gathered over TP)": getattr(model.output_layer, "gather_output", False),
    }
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"moe.output_hidden.forward_hidden: the hidden-state path does not support {', '.join(bad)}; "
                         "compute the logits (moe.model.forward_logits) instead")


__all__ = ["forward_hidden", "output_layer_input", "output_weight", "output_weight_grad_buffer"]
