// CPU log-prob kernels: per-token log-prob / entropy by an online log-sum-exp, vocab-parallel partial
// statistics, and the one-pass backward d logits = g_logp (onehot - p) - g_H p (log p + H).
//
// Shapes: T tokens, V vocab (the local shard under tensor parallelism). Rows are split over threads with
// at::parallel_for; each row is streamed through an 8 KiB float32 staging chunk (bf16/fp16 converted on
// load), so nothing of size T x V is ever allocated in float32 and every logit is read from memory once
// per pass (forward: once; backward: once, plus one write).
//
// Softmax identities used (m = row max, s = sum exp(x - m), q = sum exp(x - m) (x - m)):
//   lse = m + log s,   log p_j = x_j - lse,   H = -sum p log p = log s - q / s.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "checks.h"
#include "cpu/simd.h"

namespace megagspo::cpu {
namespace {

using at::Tensor;

// ---- chunk staging: logits row -> float32 (no copy for float32) and back ------------------------------
template <typename scalar_t>
const float* load_chunk(const scalar_t* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    bf16_to_f32(reinterpret_cast<const uint16_t*>(src), buf, n);
    return buf;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

template <typename scalar_t>
void store_chunk(scalar_t* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (dst != src) std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    f32_to_bf16(src, reinterpret_cast<uint16_t*>(dst), n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
  }
}

struct RowStats {
  double m, s, q;  // max, sum exp(x - m), sum exp(x - m) (x - m)
};

// Online (chunked) log-sum-exp over one row, float32 arithmetic inside a chunk.
template <typename scalar_t>
RowStats row_stats(const scalar_t* row, int64_t V) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) m = m < row[j] ? row[j] : m;
    double s = 0, q = 0;
    for (int64_t j = 0; j < V; ++j) {
      const double d0 = row[j] - m;
      const double d = d0 > -1000.0 ? d0 : -1000.0;  // -1000 also for NaN (all -inf row): exp = 0
      const double e = std::exp(d);
      s += e;
      q += e * d;
    }
    return {m, s, q};
  } else {
    float buf[kChunk];
    float m = -INFINITY;
    double s = 0, q = 0;
    for (int64_t j0 = 0; j0 < V; j0 += kChunk) {
      const int64_t n = std::min(kChunk, V - j0);
      const float* x = load_chunk(row + j0, buf, n);
      const float cm = chunk_max(x, n);
      if (cm > m) {  // rescale the running sums to the new max
        if (s > 0) {
          const double shift = static_cast<double>(m) - cm;
          const double r = std::exp(shift);
          q = r * (q + shift * s);
          s = r * s;
        }
        m = cm;
      }
      float cs, cq;
      chunk_sumexp(x, n, m, cs, cq);
      s += cs;
      q += cq;
    }
    return {static_cast<double>(m), s, q};
  }
}

// One row of d logits: out_j = -p_j (k + b log p_j) (+ a at the local target index y, if in [0, V)).
template <typename scalar_t, typename acc_t>
void backward_row(const scalar_t* row_in, scalar_t* row_out, int64_t V, int64_t y, acc_t a, acc_t b, acc_t k,
                  acc_t lse) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    for (int64_t j = 0; j < V; ++j) {
      const double c0 = row_in[j] - lse;
      const double c = c0 > -1000.0 ? c0 : -1000.0;
      row_out[j] = -std::exp(c) * (k + b * c);
    }
    if (y >= 0 && y < V) row_out[y] += a;
  } else {
    float buf[kChunk];
    for (int64_t j0 = 0; j0 < V; j0 += kChunk) {
      const int64_t n = std::min(kChunk, V - j0);
      const float* x = load_chunk(row_in + j0, buf, n);
      float* work = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(row_out + j0) : buf;
      chunk_grad(x, work, n, static_cast<float>(lse), static_cast<float>(k), static_cast<float>(b));
      if (y >= j0 && y < j0 + n) work[y - j0] += static_cast<float>(a);
      store_chunk(row_out + j0, work, n);
    }
  }
}

inline int64_t target_at(const Tensor& target_T, int64_t t) {
  return target_T.scalar_type() == at::kLong ? target_T.data_ptr<int64_t>()[t]
                                             : static_cast<int64_t>(target_T.data_ptr<int32_t>()[t]);
}

inline int64_t grain_rows(int64_t V) { return std::max<int64_t>(1, 32768 / V); }

// Every target id must index the logits' vocabulary: checked on the host BEFORE the kernel runs (O(T)).
void check_target_range(const Tensor& target, int64_t V, const Tensor& logits_TV) {
  const int64_t T = target.size(0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t y = target_at(target, t);
    TORCH_CHECK(y >= 0 && y < V, "megagspo.token_logprobs: target[", t, "] = ", y,
                " is outside the vocabulary [0, ", V, ") of logits ", describe(logits_TV));
  }
}

std::tuple<Tensor, Tensor, Tensor> logprob_forward(const Tensor& logits_TV, const Tensor& target_T,
                                                   bool with_entropy, bool /*inplace_backward: autograd only*/) {
  check_logprob_forward_args(logits_TV, target_T);
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  const Tensor target = target_T.contiguous();
  check_target_range(target, V, logits_TV);
  const auto acc = acc_dtype(logits_TV.scalar_type());
  const auto opts = logits_TV.options().dtype(acc);
  Tensor logp_T = at::empty({T}, opts), lse_T = at::empty({T}, opts);
  Tensor entropy_T = at::empty({with_entropy ? T : 0}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits_TV.scalar_type(), "logprob_forward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* base = logits_TV.const_data_ptr<scalar_t>();
    const int64_t ld = logits_TV.stride(0);
    acc_t* logp = logp_T.data_ptr<acc_t>();
    acc_t* lse = lse_T.data_ptr<acc_t>();
    acc_t* ent = with_entropy ? entropy_T.data_ptr<acc_t>() : nullptr;
    at::parallel_for(0, T, grain_rows(V), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* row = base + t * ld;
        const int64_t y = target_at(target, t);  // in [0, V): check_target_range
        const RowStats st = row_stats(row, V);
        const double lse_t = st.m + std::log(st.s);
        lse[t] = static_cast<acc_t>(lse_t);
        // Clamped: a log-probability is never positive, not even by rounding.
        logp[t] = static_cast<acc_t>(std::min(static_cast<double>(row[y]) - lse_t, 0.0));
        if (ent) ent[t] = static_cast<acc_t>(std::max(std::log(st.s) - st.q / st.s, 0.0));
      }
    });
  });
  return {logp_T, entropy_T, lse_T};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> logprob_stats(const Tensor& logits_TV, const Tensor& target_T,
                                                         int64_t vocab_start, bool with_entropy) {
  check_logprob_stats_args(logits_TV, target_T, vocab_start);
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  const auto opts = logits_TV.options().dtype(acc_dtype(logits_TV.scalar_type()));
  Tensor max_T = at::empty({T}, opts), sumexp_T = at::empty({T}, opts);
  Tensor sxm_T = at::empty({T}, opts), tgt_T = at::empty({T}, opts);
  const Tensor target = target_T.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits_TV.scalar_type(), "logprob_stats", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* base = logits_TV.const_data_ptr<scalar_t>();
    const int64_t ld = logits_TV.stride(0);
    acc_t *mx = max_T.data_ptr<acc_t>(), *se = sumexp_T.data_ptr<acc_t>();
    acc_t *sq = sxm_T.data_ptr<acc_t>(), *tg = tgt_T.data_ptr<acc_t>();
    at::parallel_for(0, T, grain_rows(V), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* row = base + t * ld;
        const RowStats st = row_stats(row, V);
        mx[t] = static_cast<acc_t>(st.m);
        se[t] = static_cast<acc_t>(st.s);
        sq[t] = with_entropy ? static_cast<acc_t>(st.q) : acc_t(0);
        const int64_t y = target_at(target, t) - vocab_start;
        tg[t] = (y >= 0 && y < V) ? static_cast<acc_t>(row[y]) : acc_t(0);
      }
    });
  });
  return {max_T, sumexp_T, sxm_T, tgt_T};
}

// Writes d logits into out (may be the logits themselves). The caller has checked the arguments.
void run_backward(const Tensor& grad_logp_T, const c10::optional<Tensor>& grad_entropy_T, const Tensor& logits_TV,
                  const Tensor& out_TV, const Tensor& target_T, const Tensor& lse_T,
                  const c10::optional<Tensor>& entropy_T, int64_t vocab_start) {
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  const bool with_h = grad_entropy_T.has_value() && grad_entropy_T->defined();
  const Tensor target = target_T.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits_TV.scalar_type(), "logprob_backward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* in = logits_TV.const_data_ptr<scalar_t>();
    scalar_t* out = out_TV.data_ptr<scalar_t>();
    const int64_t ld_in = logits_TV.stride(0), ld_out = out_TV.stride(0);
    const acc_t* g_lp = grad_logp_T.const_data_ptr<acc_t>();
    const acc_t* g_h = with_h ? grad_entropy_T->const_data_ptr<acc_t>() : nullptr;
    const acc_t* ent = with_h ? entropy_T->const_data_ptr<acc_t>() : nullptr;
    const acc_t* lse = lse_T.const_data_ptr<acc_t>();
    at::parallel_for(0, T, grain_rows(V), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* row_in = in + t * ld_in;
        scalar_t* row_out = out + t * ld_out;
        const int64_t y = target_at(target, t) - vocab_start;  // local index; outside [0, V) on other shards
        const acc_t a = g_lp[t];
        const acc_t b = g_h ? g_h[t] : acc_t(0);
        const acc_t k = a + (g_h ? b * ent[t] : acc_t(0));  // -p (a + b (log p + H)) = -p (k + b log p)
        backward_row(row_in, row_out, V, y, a, b, k, lse[t]);
      }
    });
  });
}

// A fresh [T, V] gradient buffer is first touched by this kernel: back it with transparent huge pages where
// the kernel allows it (THP "madvise" mode), which cuts ~250k 4 KiB page faults per GB to ~500. Advisory only.
void advise_huge_pages(const Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(t.nbytes());
  const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1), hi = end & ~(kHuge - 1);
  if (t.nbytes() >= (size_t(32) << 20) && hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
}

Tensor logprob_backward(const Tensor& grad_logp_T, const c10::optional<Tensor>& grad_entropy_T,
                        const Tensor& logits_TV, const Tensor& target_T, const Tensor& lse_T,
                        const c10::optional<Tensor>& entropy_T, int64_t vocab_start) {
  check_logprob_backward_args(grad_logp_T, grad_entropy_T, logits_TV, target_T, lse_T, entropy_T, vocab_start,
                              /*in_place=*/false);
  Tensor grad_TV = at::empty(logits_TV.sizes(), logits_TV.options());
  advise_huge_pages(grad_TV);
  run_backward(grad_logp_T, grad_entropy_T, logits_TV, grad_TV, target_T, lse_T, entropy_T, vocab_start);
  return grad_TV;
}

void logprob_backward_(const Tensor& logits_TV, const Tensor& grad_logp_T, const c10::optional<Tensor>& grad_entropy_T,
                       const Tensor& target_T, const Tensor& lse_T, const c10::optional<Tensor>& entropy_T,
                       int64_t vocab_start) {
  check_logprob_backward_args(grad_logp_T, grad_entropy_T, logits_TV, target_T, lse_T, entropy_T, vocab_start,
                              /*in_place=*/true);
  run_backward(grad_logp_T, grad_entropy_T, logits_TV, logits_TV, target_T, lse_T, entropy_T, vocab_start);
}

}  // namespace

TORCH_LIBRARY_IMPL(megagspo, CPU, m) {
  m.impl("logprob_forward", &logprob_forward);
  m.impl("logprob_stats", &logprob_stats);
  m.impl("logprob_backward", &logprob_backward);
  m.impl("logprob_backward_", &logprob_backward_);
}

}  // namespace megagspo::cpu
