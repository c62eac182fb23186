// CPU segmented GSPO kernel (paper eqs. 6, 8, 11) over packed sequences, one pass each way.
//
// Shapes: T tokens, S sequences, cu_seqlens_S1 the sequence boundaries (sequence i = [cu[i], cu[i+1])).
// Per sequence i (accumulated in float32; float64 for float64 inputs):
//   n_i = sum_t mask_t                                   (|y_i|, the loss-mask token count)
//   m_i = sum_t mask_t (logp_t - old_logp_t) / max(n_i, 1)
//   s_i = exp(m_i)                                                          (eq. 8)
//   obj_i = min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)         (eq. 6), 0 when n_i = 0
//   clipped_i = (A_i > 0 and s_i > 1 + clip_high) or (A_i < 0 and s_i < 1 - clip_low)
//   loss = -sum_i obj_i / N                                    (N = num_global_sequences)
//   d loss / d logp_t = -(1/N) A_i s_i mask_t / max(n_i, 1) [not clipped_i]     (eq. 11)
// The forward stores coef_i = -(A_i s_i) / (N max(n_i, 1)) [not clipped_i] so the backward is
// d logp_t = grad_loss * coef_{seq(t)} * mask_t, and 0 for tokens outside every sequence.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <type_traits>

#include "checks.h"

namespace megagspo::cpu {
namespace {

using at::Tensor;

template <typename F>
void with_mask_and_cu(const Tensor& mask_T, const Tensor& cu_seqlens_S1, F&& f) {
  auto with_cu = [&](const auto* mask) {
    if (cu_seqlens_S1.scalar_type() == at::kLong)
      f(mask, cu_seqlens_S1.const_data_ptr<int64_t>());
    else
      f(mask, cu_seqlens_S1.const_data_ptr<int32_t>());
  };
  if (mask_T.scalar_type() == at::kBool) {
    with_cu(mask_T.const_data_ptr<bool>());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mask_T.scalar_type(), "gspo_mask",
                                    [&] { with_cu(mask_T.const_data_ptr<scalar_t>()); });
  }
}

// cu_seqlens must be non-decreasing within [0, T]: checked on the host BEFORE the kernel runs (O(S)).
void check_cu_values(const Tensor& cu_seqlens_S1, int64_t T) {
  const int64_t S1 = cu_seqlens_S1.size(0);
  auto check = [&](const auto* cu) {
    for (int64_t i = 0; i < S1; ++i) {
      TORCH_CHECK(cu[i] >= 0 && cu[i] <= T && (i == 0 || cu[i] >= cu[i - 1]),
                  "megagspo.gspo_segment_loss: cu_seqlens must be non-decreasing within [0, ", T,
                  "]; cu_seqlens[", i, "] = ", static_cast<int64_t>(cu[i]), " (", describe(cu_seqlens_S1), ")");
    }
  };
  if (cu_seqlens_S1.scalar_type() == at::kLong)
    check(cu_seqlens_S1.const_data_ptr<int64_t>());
  else
    check(cu_seqlens_S1.const_data_ptr<int32_t>());
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> gspo_segment_forward(
    const Tensor& logp_T, const Tensor& old_logp_T, const Tensor& mask_T, const Tensor& cu_seqlens_S1,
    const Tensor& advantages_S, double clip_low, double clip_high, double num_global_sequences) {
  const auto [T, S] = check_gspo_forward_args(logp_T, old_logp_T, mask_T, cu_seqlens_S1, advantages_S, clip_low,
                                              clip_high, num_global_sequences);
  check_cu_values(cu_seqlens_S1, T);
  const auto acc = acc_dtype(logp_T.scalar_type());
  const auto opts = logp_T.options().dtype(acc);
  Tensor loss = at::empty({}, opts);
  Tensor logratio_S = at::empty({S}, opts), ratio_S = at::empty({S}, opts), coef_S = at::empty({S}, opts);
  Tensor clipped_S = at::empty({S}, logp_T.options().dtype(at::kBool));
  Tensor obj_S = at::empty({S}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logp_T.scalar_type(), "gspo_segment_forward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* lp = logp_T.const_data_ptr<scalar_t>();
    const scalar_t* old = old_logp_T.const_data_ptr<scalar_t>();
    const acc_t* adv = advantages_S.const_data_ptr<acc_t>();
    acc_t *lr = logratio_S.data_ptr<acc_t>(), *ra = ratio_S.data_ptr<acc_t>();
    acc_t *co = coef_S.data_ptr<acc_t>(), *ob = obj_S.data_ptr<acc_t>();
    bool* cl = clipped_S.data_ptr<bool>();
    const acc_t lo = static_cast<acc_t>(1.0 - clip_low), hi = static_cast<acc_t>(1.0 + clip_high);
    const acc_t inv_n = static_cast<acc_t>(1.0 / num_global_sequences);
    with_mask_and_cu(mask_T, cu_seqlens_S1, [&](const auto* mask, const auto* cu) {
      at::parallel_for(0, S, 64, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          acc_t sum = 0, cnt = 0;
          for (int64_t t = cu[i]; t < cu[i + 1]; ++t) {
            const acc_t w = static_cast<acc_t>(mask[t]);
            sum += w * (static_cast<acc_t>(lp[t]) - static_cast<acc_t>(old[t]));
            cnt += w;
          }
          const acc_t denom = std::max(cnt, acc_t(1));
          const acc_t m = sum / denom;                   // eq. 8, in log space
          const acc_t s = std::exp(m);                   // s_i
          const acc_t a = adv[i];
          const bool empty = cnt == acc_t(0);
          const bool clipped = !empty && ((a > 0 && s > hi) || (a < 0 && s < lo));
          const acc_t sc = std::min(std::max(s, lo), hi);
          lr[i] = m;
          ra[i] = s;
          cl[i] = clipped;
          ob[i] = empty ? acc_t(0) : std::min(s * a, sc * a);  // eq. 6
          co[i] = (empty || clipped) ? acc_t(0) : -(a * s) / denom * inv_n;
        }
      });
    });
    acc_t total = 0;  // fixed order: deterministic
    for (int64_t i = 0; i < S; ++i) total += ob[i];
    loss.data_ptr<acc_t>()[0] = -total * inv_n;
  });
  return {loss, logratio_S, ratio_S, clipped_S, coef_S};
}

Tensor gspo_segment_backward(const Tensor& grad_loss, const Tensor& coef_S, const Tensor& mask_T,
                             const Tensor& cu_seqlens_S1, at::ScalarType out_dtype) {
  check_gspo_backward_args(grad_loss, coef_S, mask_T, cu_seqlens_S1, out_dtype);
  check_cu_values(cu_seqlens_S1, mask_T.size(0));
  const int64_t T = mask_T.size(0), S = coef_S.size(0);
  Tensor grad_T = at::empty({T}, mask_T.options().dtype(out_dtype));
  const Tensor g = grad_loss.reshape({}).to(coef_S.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "gspo_segment_backward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const acc_t gl = g.const_data_ptr<acc_t>()[0];
    const acc_t* co = coef_S.const_data_ptr<acc_t>();
    scalar_t* out = grad_T.data_ptr<scalar_t>();
    with_mask_and_cu(mask_T, cu_seqlens_S1, [&](const auto* mask, const auto* cu) {
      for (int64_t t = 0; t < cu[0]; ++t) out[t] = scalar_t(0);
      for (int64_t t = cu[S]; t < T; ++t) out[t] = scalar_t(0);
      at::parallel_for(0, S, 64, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const acc_t c = gl * co[i];
          for (int64_t t = cu[i]; t < cu[i + 1]; ++t) out[t] = static_cast<scalar_t>(c * static_cast<acc_t>(mask[t]));
        }
      });
    });
  });
  return grad_T;
}

}  // namespace

TORCH_LIBRARY_IMPL(megagspo, CPU, m) {
  m.impl("gspo_segment_forward", &gspo_segment_forward);
  m.impl("gspo_segment_backward", &gspo_segment_backward);
}

}  // namespace megagspo::cpu
