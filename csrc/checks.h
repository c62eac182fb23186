// Argument checks shared by the CPU (csrc/cpu/) and CUDA (csrc/cuda/) kernels. Each op calls ONE of the
// check_*_args functions below as its first statement, before it allocates or launches anything, so a bad
// argument is a c10::Error (a Python RuntimeError) naming the argument, on either device, and never reaches
// a kernel: no kernel then reads a pointer of another device, a missing tensor, a dtype it did not
// dispatch on or a non-contiguous buffer as if it were contiguous. Every message names the argument, its
// shape, dtype and device, so a caller sees what was passed, not only what was wrong.
//
// What is NOT checked here: tensor VALUES (target ids inside the vocabulary, cu_seqlens non-decreasing).
// Those need the data on the host: the CPU kernels check them before computing; the CUDA kernels do not
// (that would be a device-to-host sync per call) and are written so that bad values cannot read or write
// out of bounds (an out-of-vocab target gives a NaN log-prob; cu_seqlens are clamped to [0, T]).
//
// Shape suffixes used across csrc/: T tokens, V vocabulary (or a vocab shard), S sequences, S1 = S + 1.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <sstream>
#include <string>

namespace megagspo {

inline std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream os;
  os << "shape " << t.sizes() << ", dtype " << t.scalar_type() << ", device " << t.device();
  return os.str();
}

inline bool is_float_dtype(at::ScalarType dt) {
  return dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf;
}

// Accumulation dtype of the kernels: float64 for float64 inputs, float32 otherwise.
inline at::ScalarType acc_dtype(at::ScalarType dt) { return dt == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_defined(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "megagspo: ", name, " is an undefined tensor");
}

// `t` (argument `name`) must be on the device of `ref` (argument `ref_name`): a kernel gets raw pointers
// of one device only.
inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "megagspo: ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; every tensor argument must be on one device (", name, ": ", describe(t), ")");
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "megagspo: ", name, " must be contiguous; got ", describe(t), " with strides ",
              t.strides());
}

// ---- log-prob ops ------------------------------------------------------------------------------------------

// logits_TV: [T, V], last dimension contiguous (rows may be strided), a floating dtype.
inline void check_logits(const at::Tensor& logits_TV, const char* name = "logits") {
  check_defined(logits_TV, name);
  TORCH_CHECK(logits_TV.dim() == 2, "megagspo: ", name, " must be 2-D [tokens, vocab]; got ",
              describe(logits_TV));
  TORCH_CHECK(is_float_dtype(logits_TV.scalar_type()), "megagspo: ", name,
              " must be float32, float64, bfloat16 or float16; got ", describe(logits_TV));
  TORCH_CHECK(logits_TV.size(1) > 0, "megagspo: ", name, " has an empty vocab dimension; got ",
              describe(logits_TV));
  TORCH_CHECK(logits_TV.size(0) == 0 || logits_TV.size(1) == 1 || logits_TV.stride(1) == 1,
              "megagspo: ", name, " must be contiguous along vocab (stride(1) == 1); got ", describe(logits_TV),
              " with strides ", logits_TV.strides());
}

// target_T: [T] int64 / int32 on the logits' device (any strides: the kernels take a contiguous copy).
inline void check_target(const at::Tensor& target_T, const at::Tensor& logits_TV) {
  check_defined(target_T, "target");
  TORCH_CHECK(target_T.dim() == 1 && target_T.size(0) == logits_TV.size(0),
              "megagspo: target must be 1-D [tokens] matching logits ", logits_TV.sizes(), "; got ",
              describe(target_T));
  TORCH_CHECK(target_T.scalar_type() == at::kLong || target_T.scalar_type() == at::kInt,
              "megagspo: target must be int64 or int32; got ", describe(target_T));
  check_same_device(target_T, "target", logits_TV, "logits");
}

inline void check_vocab_start(int64_t vocab_start) {
  TORCH_CHECK(vocab_start >= 0, "megagspo: vocab_start must be >= 0; got ", vocab_start);
}

// A per-token float vector: [T], contiguous, given dtype, on the logits' device.
inline void check_vec(const at::Tensor& v, int64_t T, at::ScalarType dtype, const at::Tensor& logits_TV,
                      const char* name) {
  check_defined(v, name);
  TORCH_CHECK(v.dim() == 1 && v.size(0) == T, "megagspo: ", name, " must be 1-D [", T, "]; got ", describe(v));
  TORCH_CHECK(v.scalar_type() == dtype, "megagspo: ", name, " must be ", dtype, "; got ", describe(v));
  check_contiguous(v, name);
  check_same_device(v, name, logits_TV, "logits");
}

// logprob_forward(logits_TV, target_T, ...)
inline void check_logprob_forward_args(const at::Tensor& logits_TV, const at::Tensor& target_T) {
  check_logits(logits_TV);
  check_target(target_T, logits_TV);
}

// logprob_stats(logits_TV, target_T, vocab_start, ...)
inline void check_logprob_stats_args(const at::Tensor& logits_TV, const at::Tensor& target_T, int64_t vocab_start) {
  check_logits(logits_TV);
  check_target(target_T, logits_TV);
  check_vocab_start(vocab_start);
}

// logprob_backward / logprob_backward_ (in_place: d logits are written over logits_TV).
inline void check_logprob_backward_args(const at::Tensor& grad_logp_T, const c10::optional<at::Tensor>& grad_entropy_T,
                                        const at::Tensor& logits_TV, const at::Tensor& target_T,
                                        const at::Tensor& lse_T, const c10::optional<at::Tensor>& entropy_T,
                                        int64_t vocab_start, bool in_place) {
  check_logits(logits_TV);
  check_target(target_T, logits_TV);
  check_vocab_start(vocab_start);
  const int64_t T = logits_TV.size(0);
  const auto acc = acc_dtype(logits_TV.scalar_type());
  check_vec(grad_logp_T, T, acc, logits_TV, "grad_logp");
  check_vec(lse_T, T, acc, logits_TV, "lse");
  const bool has_ge = grad_entropy_T.has_value() && grad_entropy_T->defined();
  const bool has_e = entropy_T.has_value() && entropy_T->defined();
  TORCH_CHECK(has_ge == has_e, "megagspo: logprob_backward needs both grad_entropy and entropy, or neither; got ",
              has_ge ? "grad_entropy" : "entropy", " only");
  if (has_ge) {
    check_vec(*grad_entropy_T, T, acc, logits_TV, "grad_entropy");
    check_vec(*entropy_T, T, acc, logits_TV, "entropy");
  }
  if (in_place) {
    // Rows that share memory (an expanded tensor) would be written by several threads / blocks at once.
    TORCH_CHECK(at::has_internal_overlap(logits_TV) != at::MemOverlap::Yes,
                "megagspo: the in-place backward writes d logits over logits, whose elements overlap in memory "
                "(an expanded tensor?); got ", describe(logits_TV), " with strides ", logits_TV.strides());
  }
}

// ---- GSPO ops ----------------------------------------------------------------------------------------------

struct GspoArgs {
  int64_t T;
  int64_t S;
};

inline void check_cu_seqlens(const at::Tensor& cu_seqlens_S1) {
  check_defined(cu_seqlens_S1, "cu_seqlens");
  TORCH_CHECK(cu_seqlens_S1.dim() == 1 && cu_seqlens_S1.size(0) >= 1,
              "megagspo: cu_seqlens must be 1-D [sequences + 1]; got ", describe(cu_seqlens_S1));
  TORCH_CHECK(cu_seqlens_S1.scalar_type() == at::kInt || cu_seqlens_S1.scalar_type() == at::kLong,
              "megagspo: cu_seqlens must be int32 or int64; got ", describe(cu_seqlens_S1));
  check_contiguous(cu_seqlens_S1, "cu_seqlens");
}

inline void check_loss_mask(const at::Tensor& mask_T, int64_t T) {
  check_defined(mask_T, "loss_mask");
  TORCH_CHECK(mask_T.dim() == 1 && mask_T.size(0) == T, "megagspo: loss_mask must be 1-D [", T, "]; got ",
              describe(mask_T));
  check_contiguous(mask_T, "loss_mask");
}

// gspo_segment_forward(logp_T, old_logp_T, loss_mask_T, cu_seqlens_S1, advantages_S, clip_low, clip_high, N)
inline GspoArgs check_gspo_forward_args(const at::Tensor& logp_T, const at::Tensor& old_logp_T,
                                        const at::Tensor& mask_T, const at::Tensor& cu_seqlens_S1,
                                        const at::Tensor& advantages_S, double clip_low, double clip_high,
                                        double num_global_sequences) {
  check_defined(logp_T, "logp");
  TORCH_CHECK(logp_T.dim() == 1, "megagspo: logp must be 1-D [tokens]; got ", describe(logp_T));
  const auto dt = logp_T.scalar_type();
  TORCH_CHECK(is_float_dtype(dt), "megagspo: logp must be a floating dtype; got ", describe(logp_T));
  check_contiguous(logp_T, "logp");
  const int64_t T = logp_T.size(0);
  check_defined(old_logp_T, "old_logp");
  TORCH_CHECK(old_logp_T.dim() == 1 && old_logp_T.size(0) == T && old_logp_T.scalar_type() == dt,
              "megagspo: old_logp must match logp (", describe(logp_T), "); got ", describe(old_logp_T));
  check_contiguous(old_logp_T, "old_logp");
  check_same_device(old_logp_T, "old_logp", logp_T, "logp");
  check_loss_mask(mask_T, T);
  TORCH_CHECK(mask_T.scalar_type() == at::kBool || mask_T.scalar_type() == dt,
              "megagspo: loss_mask must be bool or the dtype of logp (", dt, "); got ", describe(mask_T));
  check_same_device(mask_T, "loss_mask", logp_T, "logp");
  check_cu_seqlens(cu_seqlens_S1);
  check_same_device(cu_seqlens_S1, "cu_seqlens", logp_T, "logp");
  const int64_t S = cu_seqlens_S1.size(0) - 1;
  check_defined(advantages_S, "advantages");
  TORCH_CHECK(advantages_S.dim() == 1 && advantages_S.size(0) == S,
              "megagspo: advantages must be 1-D [", S, "] (one per sequence of cu_seqlens ",
              cu_seqlens_S1.sizes(), "); got ", describe(advantages_S));
  TORCH_CHECK(advantages_S.scalar_type() == acc_dtype(dt), "megagspo: advantages must be ", acc_dtype(dt),
              " for logp of dtype ", dt, "; got ", describe(advantages_S));
  check_contiguous(advantages_S, "advantages");
  check_same_device(advantages_S, "advantages", logp_T, "logp");
  TORCH_CHECK(clip_low >= 0.0 && clip_low < 1.0, "megagspo: clip_low must be in [0, 1); got ", clip_low);
  TORCH_CHECK(clip_high >= 0.0, "megagspo: clip_high must be >= 0; got ", clip_high);  // NaN fails both
  TORCH_CHECK(std::isfinite(num_global_sequences) && num_global_sequences > 0.0,
              "megagspo: num_global_sequences must be > 0 and finite; got ", num_global_sequences);
  return {T, S};
}

// gspo_segment_backward(grad_loss, coef_S, loss_mask_T, cu_seqlens_S1, out_dtype) -> T
inline int64_t check_gspo_backward_args(const at::Tensor& grad_loss, const at::Tensor& coef_S,
                                        const at::Tensor& mask_T, const at::Tensor& cu_seqlens_S1,
                                        at::ScalarType out_dtype) {
  TORCH_CHECK(is_float_dtype(out_dtype), "megagspo: out_dtype must be float32, float64, bfloat16 or float16; got ",
              out_dtype);
  check_cu_seqlens(cu_seqlens_S1);
  check_defined(coef_S, "coef");
  TORCH_CHECK(coef_S.dim() == 1 && coef_S.size(0) == cu_seqlens_S1.size(0) - 1,
              "megagspo: coef must be 1-D [sequences] matching cu_seqlens ", cu_seqlens_S1.sizes(), "; got ",
              describe(coef_S));
  TORCH_CHECK(coef_S.scalar_type() == acc_dtype(out_dtype), "megagspo: coef must be ", acc_dtype(out_dtype),
              " for out_dtype ", out_dtype, "; got ", describe(coef_S));
  check_contiguous(coef_S, "coef");
  check_defined(mask_T, "loss_mask");
  TORCH_CHECK(mask_T.dim() == 1, "megagspo: loss_mask must be 1-D [tokens]; got ", describe(mask_T));
  check_loss_mask(mask_T, mask_T.size(0));
  TORCH_CHECK(mask_T.scalar_type() == at::kBool || is_float_dtype(mask_T.scalar_type()),
              "megagspo: loss_mask must be bool or a floating dtype; got ", describe(mask_T));
  check_defined(grad_loss, "grad_loss");
  TORCH_CHECK(grad_loss.numel() == 1, "megagspo: grad_loss must hold one value; got ", describe(grad_loss));
  TORCH_CHECK(is_float_dtype(grad_loss.scalar_type()), "megagspo: grad_loss must be a floating dtype; got ",
              describe(grad_loss));
  // The kernels read grad_loss, the mask and cu_seqlens through raw pointers of coef's device.
  check_same_device(grad_loss, "grad_loss", coef_S, "coef");
  check_same_device(mask_T, "loss_mask", coef_S, "coef");
  check_same_device(cu_seqlens_S1, "cu_seqlens", coef_S, "coef");
  return mask_T.size(0);
}

}  // namespace megagspo
