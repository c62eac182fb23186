// Input checks shared by the CPU (csrc/cpu/) and CUDA (csrc/cuda/) kernels: every message names the
// argument, its shape and its dtype, so a caller sees what was passed, not only what was wrong.
//
// Shape suffixes used across csrc/: T tokens, V vocabulary (or a vocab shard), S sequences, S1 = S + 1.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <string>

namespace megagspo {

inline std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << "shape " << t.sizes() << ", dtype " << t.scalar_type() << ", device " << t.device();
  return os.str();
}

// logits_TV: [T, V], last dimension contiguous (rows may be strided), a floating dtype.
inline void check_logits(const at::Tensor& logits_TV, const char* name = "logits") {
  TORCH_CHECK(logits_TV.dim() == 2, "megagspo: ", name, " must be 2-D [tokens, vocab]; got ",
              describe(logits_TV));
  const auto dt = logits_TV.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
              "megagspo: ", name, " must be float32, float64, bfloat16 or float16; got ", describe(logits_TV));
  TORCH_CHECK(logits_TV.size(1) > 0, "megagspo: ", name, " has an empty vocab dimension; got ",
              describe(logits_TV));
  TORCH_CHECK(logits_TV.size(0) == 0 || logits_TV.size(1) == 1 || logits_TV.stride(1) == 1,
              "megagspo: ", name, " must be contiguous along vocab (stride(1) == 1); got ", describe(logits_TV),
              " with strides ", logits_TV.strides());
}

inline void check_target(const at::Tensor& target_T, const at::Tensor& logits_TV) {
  TORCH_CHECK(target_T.dim() == 1 && target_T.size(0) == logits_TV.size(0),
              "megagspo: target must be 1-D [tokens] matching logits ", logits_TV.sizes(), "; got ",
              describe(target_T));
  TORCH_CHECK(target_T.scalar_type() == at::kLong || target_T.scalar_type() == at::kInt,
              "megagspo: target must be int64 or int32; got ", describe(target_T));
  TORCH_CHECK(target_T.device() == logits_TV.device(), "megagspo: target is on ", target_T.device(),
              " but logits are on ", logits_TV.device());
}

// A per-token float vector: [T], contiguous, given dtype, same device as `like`.
inline void check_vec(const at::Tensor& v, int64_t T, at::ScalarType dtype, const at::Tensor& like,
                      const char* name) {
  TORCH_CHECK(v.dim() == 1 && v.size(0) == T, "megagspo: ", name, " must be 1-D [", T, "]; got ",
              describe(v));
  TORCH_CHECK(v.scalar_type() == dtype, "megagspo: ", name, " must be ", dtype, "; got ", describe(v));
  TORCH_CHECK(v.is_contiguous(), "megagspo: ", name, " must be contiguous; got ", describe(v));
  TORCH_CHECK(v.device() == like.device(), "megagspo: ", name, " is on ", v.device(), " but logits are on ",
              like.device());
}

// Accumulation dtype of the log-prob kernels: float64 for float64 logits, float32 otherwise.
inline at::ScalarType acc_dtype(at::ScalarType dt) { return dt == at::kDouble ? at::kDouble : at::kFloat; }

struct GspoArgs {
  int64_t T;
  int64_t S;
};

inline GspoArgs check_gspo(const at::Tensor& logp_T, const at::Tensor& old_logp_T, const at::Tensor& mask_T,
                           const at::Tensor& cu_seqlens_S1, const at::Tensor& advantages_S) {
  TORCH_CHECK(logp_T.dim() == 1, "megagspo: logp must be 1-D [tokens]; got ", describe(logp_T));
  const auto dt = logp_T.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
              "megagspo: logp must be a floating dtype; got ", describe(logp_T));
  const int64_t T = logp_T.size(0);
  TORCH_CHECK(old_logp_T.dim() == 1 && old_logp_T.size(0) == T && old_logp_T.scalar_type() == dt,
              "megagspo: old_logp must match logp (", describe(logp_T), "); got ", describe(old_logp_T));
  TORCH_CHECK(mask_T.dim() == 1 && mask_T.size(0) == T, "megagspo: loss_mask must be 1-D [", T, "]; got ",
              describe(mask_T));
  TORCH_CHECK(mask_T.scalar_type() == at::kBool || mask_T.scalar_type() == dt,
              "megagspo: loss_mask must be bool or the dtype of logp (", dt, "); got ", describe(mask_T));
  TORCH_CHECK(cu_seqlens_S1.dim() == 1 && cu_seqlens_S1.size(0) >= 1,
              "megagspo: cu_seqlens must be 1-D [sequences + 1]; got ", describe(cu_seqlens_S1));
  TORCH_CHECK(cu_seqlens_S1.scalar_type() == at::kInt || cu_seqlens_S1.scalar_type() == at::kLong,
              "megagspo: cu_seqlens must be int32 or int64; got ", describe(cu_seqlens_S1));
  const int64_t S = cu_seqlens_S1.size(0) - 1;
  TORCH_CHECK(advantages_S.dim() == 1 && advantages_S.size(0) == S,
              "megagspo: advantages must be 1-D [", S, "] (one per sequence of cu_seqlens ",
              cu_seqlens_S1.sizes(), "); got ", describe(advantages_S));
  TORCH_CHECK(advantages_S.scalar_type() == acc_dtype(dt), "megagspo: advantages must be ", acc_dtype(dt),
              " for logp of dtype ", dt, "; got ", describe(advantages_S));
  for (const at::Tensor* t : {&old_logp_T, &mask_T, &cu_seqlens_S1, &advantages_S}) {
    TORCH_CHECK(t->device() == logp_T.device(), "megagspo: GSPO inputs must share one device; logp is on ",
                logp_T.device(), ", got ", describe(*t));
  }
  for (const at::Tensor* t : {&logp_T, &old_logp_T, &mask_T, &cu_seqlens_S1, &advantages_S}) {
    TORCH_CHECK(t->is_contiguous(), "megagspo: GSPO inputs must be contiguous; got ", describe(*t));
  }
  return {T, S};
}

}  // namespace megagspo
