// The only binding file of megagspo._C: it declares the op schemas and nothing else. Kernels live in
// csrc/cpu/ (and csrc/cuda/ when built with CUDA), each registering its own TORCH_LIBRARY_IMPL; their
// Python wrappers, autograd formulas and fake (meta) implementations live in megagspo/kernels/.
//
// Shapes: T tokens, V vocab (a shard of it under tensor parallelism), S sequences, S1 = S + 1.
#include <torch/extension.h>
#include <torch/library.h>

namespace megagspo {
// True when this build compiled the CUDA sources in csrc/cuda/.
bool built_with_cuda() {
#ifdef MEGAGSPO_WITH_CUDA
  return true;
#else
  return false;
#endif
}
}  // namespace megagspo

TORCH_LIBRARY(megagspo, m) {
  // Per-token log-prob (clamped to <= 0), entropy (empty [0] unless with_entropy) and log-sum-exp, fp32
  // (fp64 for fp64 logits), by an online log-sum-exp over the whole vocabulary. `inplace_backward` is read
  // only by the autograd formula (megagspo/kernels/_ops.py): the backward then overwrites the logits.
  m.def("logprob_forward(Tensor logits_TV, Tensor target_T, bool with_entropy, bool inplace_backward=False) -> (Tensor logp_T, Tensor entropy_T, Tensor lse_T)");
  // Vocab-parallel partial statistics of a vocab shard [vocab_start, vocab_start + V): row max, sum of
  // exp(x - max), sum of exp(x - max) * (x - max) (zeros unless with_entropy) and the target logit (0 when
  // the target is on another shard).
  m.def("logprob_stats(Tensor logits_TV, Tensor target_T, int vocab_start, bool with_entropy) -> (Tensor max_T, Tensor sumexp_T, Tensor sxm_T, Tensor target_logit_T)");
  // d logits = g_logp * (onehot - softmax) - g_entropy * softmax * (log softmax + entropy), one pass,
  // written to a new tensor of the logits' dtype ...
  m.def("logprob_backward(Tensor grad_logp_T, Tensor? grad_entropy_T, Tensor logits_TV, Tensor target_T, Tensor lse_T, Tensor? entropy_T, int vocab_start) -> Tensor");
  // ... or over the logits themselves (destroys them).
  m.def("logprob_backward_(Tensor(a!) logits_TV, Tensor grad_logp_T, Tensor? grad_entropy_T, Tensor target_T, Tensor lse_T, Tensor? entropy_T, int vocab_start) -> ()");
  // Segmented GSPO (paper eqs. 6, 8, 11): loss, per-sequence mean log-ratio, ratio s_i, clip flags and the
  // per-sequence gradient coefficient used by the backward.
  m.def("gspo_segment_forward(Tensor logp_T, Tensor old_logp_T, Tensor loss_mask_T, Tensor cu_seqlens_S1, Tensor advantages_S, float clip_low, float clip_high, float num_global_sequences) -> (Tensor loss, Tensor seq_logratio_S, Tensor ratio_S, Tensor clipped_S, Tensor coef_S)");
  m.def("gspo_segment_backward(Tensor grad_loss, Tensor coef_S, Tensor loss_mask_T, Tensor cu_seqlens_S1, ScalarType out_dtype) -> Tensor");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megagspo fused kernels (CPU always, CUDA when built with it); ops live in torch.ops.megagspo";
  m.def("built_with_cuda", &megagspo::built_with_cuda,
        "Whether this build of the extension includes the CUDA kernels");
}
