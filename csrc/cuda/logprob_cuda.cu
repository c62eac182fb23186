// CUDA log-prob kernels: one block per token row, 16-byte vectorised loads (8 bf16/fp16, 4 fp32, 2 fp64),
// a per-thread online log-sum-exp in float32 (float64 for float64 logits), warp-shuffle then shared-memory
// combination of the (max, sum exp, sum exp * shift) triples. Forward reads each logit once; backward
// reads it once and writes its gradient once (in the logits' dtype, optionally over the logits).
//
// Shapes: T tokens, V vocab (shard). Identities (m = row max, s = sum exp(x - m), q = sum exp(x - m)(x - m)):
//   lse = m + log s,  log p_j = x_j - lse,  H = log s - q / s,
//   d x_j = g (onehot_j - p_j) - g_H p_j (log p_j + H).
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "checks.h"
#include "cuda/compat.h"

namespace megagspo::cuda {
namespace {

using at::Tensor;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <typename scalar_t>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(scalar_t);
  scalar_t v[N];
};

__device__ __forceinline__ float dexp(float x) { return __expf(x); }
__device__ __forceinline__ double dexp(double x) { return ::exp(x); }
__device__ __forceinline__ float dlog(float x) { return ::logf(x); }
__device__ __forceinline__ double dlog(double x) { return ::log(x); }

// Running (max, sum exp(x - max), sum exp(x - max) (x - max)).
template <typename acc_t>
struct Lse {
  acc_t m, s, q;

  __device__ __forceinline__ void init() {
    m = -INFINITY;
    s = 0;
    q = 0;
  }
  // Move the reference point to m_new >= m.
  __device__ __forceinline__ void rebase(acc_t m_new) {
    if (s > acc_t(0)) {
      const acc_t sh = m - m_new;
      const acc_t r = dexp(sh);
      q = r * (q + sh * s);
      s = r * s;
    }
    m = m_new;
  }
  __device__ __forceinline__ void add(acc_t x) {  // x <= m
    // d = -100 also for NaN (x = m = -inf: a shard of -inf logits); exp(-inf) = 0 without 0 * inf.
    const acc_t d = x - m > acc_t(-100) ? x - m : acc_t(-100);
    const acc_t e = d > acc_t(-100) ? dexp(d) : acc_t(0);
    s += e;
    q += e * d;
  }
  __device__ __forceinline__ void merge(acc_t m2, acc_t s2, acc_t q2) {
    const acc_t mm = m > m2 ? m : m2;
    if (mm == -INFINITY) return;  // both empty
    acc_t s1 = 0, q1 = 0;
    if (s > acc_t(0)) {
      const acc_t sh = m - mm, r = dexp(sh);
      s1 = r * s;
      q1 = r * (q + sh * s);
    }
    if (s2 > acc_t(0)) {
      const acc_t sh = m2 - mm, r = dexp(sh);
      s1 += r * s2;
      q1 += r * (q2 + sh * s2);
    }
    m = mm;
    s = s1;
    q = q1;
  }
};

// Block-wide combination; every thread returns the row's triple.
template <typename acc_t>
__device__ __forceinline__ Lse<acc_t> block_reduce(Lse<acc_t> st) {
  __shared__ acc_t sm[kWarps], ss[kWarps], sq[kWarps];
  __shared__ acc_t fm, fs, fq;
  for (int off = 16; off > 0; off >>= 1) {
    const acc_t m2 = __shfl_xor_sync(0xffffffffu, st.m, off);
    const acc_t s2 = __shfl_xor_sync(0xffffffffu, st.s, off);
    const acc_t q2 = __shfl_xor_sync(0xffffffffu, st.q, off);
    st.merge(m2, s2, q2);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sm[warp] = st.m;
    ss[warp] = st.s;
    sq[warp] = st.q;
  }
  __syncthreads();
  if (warp == 0) {
    Lse<acc_t> w;
    w.init();
    if (lane < kWarps) {
      w.m = sm[lane];
      w.s = ss[lane];
      w.q = sq[lane];
    }
    for (int off = 16; off > 0; off >>= 1) {
      const acc_t m2 = __shfl_xor_sync(0xffffffffu, w.m, off);
      const acc_t s2 = __shfl_xor_sync(0xffffffffu, w.s, off);
      const acc_t q2 = __shfl_xor_sync(0xffffffffu, w.q, off);
      w.merge(m2, s2, q2);
    }
    if (lane == 0) {
      fm = w.m;
      fs = w.s;
      fq = w.q;
    }
  }
  __syncthreads();
  Lse<acc_t> out;
  out.m = fm;
  out.s = fs;
  out.q = fq;
  return out;
}

// kStats = false: out0 = logp (<= 0), out1 = entropy (nullptr: skip), out2 = lse.
// kStats = true : out0 = max, out1 = sumexp, out2 = sxm (nullptr: skip), out3 = target logit (0 off-shard).
template <typename scalar_t, bool kStats, bool kVec>
__global__ void __launch_bounds__(kThreads) logprob_fwd_kernel(
    const scalar_t* __restrict__ logits, int64_t ld, int64_t V, const int64_t* __restrict__ target,
    int64_t vocab_start, at::acc_type<scalar_t, true>* __restrict__ out0, at::acc_type<scalar_t, true>* __restrict__ out1,
    at::acc_type<scalar_t, true>* __restrict__ out2, at::acc_type<scalar_t, true>* __restrict__ out3) {
  using acc_t = at::acc_type<scalar_t, true>;
  const int64_t t = blockIdx.x;
  const scalar_t* row = logits + t * ld;
  Lse<acc_t> st;
  st.init();
  int64_t j = threadIdx.x;
  if constexpr (kVec) {
    constexpr int N = Pack<scalar_t>::N;
    const int64_t nvec = V / N;
    const Pack<scalar_t>* rowv = reinterpret_cast<const Pack<scalar_t>*>(row);
    for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
      const Pack<scalar_t> pk = rowv[i];
      acc_t x[N];
      acc_t vmax = static_cast<acc_t>(pk.v[0]);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        x[k] = static_cast<acc_t>(pk.v[k]);
        vmax = x[k] > vmax ? x[k] : vmax;
      }
      if (vmax > st.m) st.rebase(vmax);
#pragma unroll
      for (int k = 0; k < N; ++k) st.add(x[k]);
    }
    j = nvec * N + threadIdx.x;
  }
  for (; j < V; j += kThreads) {
    const acc_t x = static_cast<acc_t>(row[j]);
    if (x > st.m) st.rebase(x);
    st.add(x);
  }
  st = block_reduce(st);
  if (threadIdx.x != 0) return;
  const int64_t y = target[t] - vocab_start;
  const bool owned = y >= 0 && y < V;
  const acc_t xt = owned ? static_cast<acc_t>(row[y]) : acc_t(0);
  if constexpr (kStats) {
    out0[t] = st.m;
    out1[t] = st.s;
    if (out2) out2[t] = st.q;
    out3[t] = xt;
  } else {
    const acc_t log_s = dlog(st.s);
    const acc_t lse = st.m + log_s;
    const acc_t lp = xt - lse;
    out0[t] = owned ? (lp < acc_t(0) ? lp : acc_t(0)) : acc_t(NAN);  // never positive; NaN: bad target
    if (out1) {
      const acc_t h = log_s - st.q / st.s;
      out1[t] = h > acc_t(0) ? h : acc_t(0);
    }
    out2[t] = lse;
  }
}

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t grad_of(acc_t x, acc_t lse, acc_t k, acc_t b) {
  const acc_t c = x - lse > acc_t(-100) ? x - lse : acc_t(-100);
  return c > acc_t(-100) ? -dexp(c) * (k + b * c) : acc_t(0);
}

// d logits (may alias logits: every element is read before it is written, by the same thread).
template <typename scalar_t, bool kVec>
__global__ void __launch_bounds__(kThreads) logprob_bwd_kernel(
    const scalar_t* logits, int64_t ld_in, scalar_t* out, int64_t ld_out, int64_t V,
    const int64_t* __restrict__ target, int64_t vocab_start, const at::acc_type<scalar_t, true>* __restrict__ g_lp,
    const at::acc_type<scalar_t, true>* __restrict__ g_h, const at::acc_type<scalar_t, true>* __restrict__ ent,
    const at::acc_type<scalar_t, true>* __restrict__ lse_T) {
  using acc_t = at::acc_type<scalar_t, true>;
  const int64_t t = blockIdx.x;
  const scalar_t* row = logits + t * ld_in;
  scalar_t* orow = out + t * ld_out;
  const acc_t a = g_lp[t];
  const acc_t b = g_h ? g_h[t] : acc_t(0);
  const acc_t k = a + (g_h ? b * ent[t] : acc_t(0));
  const acc_t lse = lse_T[t];
  const int64_t y = target[t] - vocab_start;
  int64_t j = threadIdx.x;
  if constexpr (kVec) {
    constexpr int N = Pack<scalar_t>::N;
    const int64_t nvec = V / N;
    for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
      const Pack<scalar_t> pk = reinterpret_cast<const Pack<scalar_t>*>(row)[i];
      Pack<scalar_t> po;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        acc_t g = grad_of<scalar_t>(static_cast<acc_t>(pk.v[e]), lse, k, b);
        if (i * N + e == y) g += a;
        po.v[e] = static_cast<scalar_t>(g);
      }
      reinterpret_cast<Pack<scalar_t>*>(orow)[i] = po;
    }
    j = nvec * N + threadIdx.x;
  }
  for (; j < V; j += kThreads) {
    acc_t g = grad_of<scalar_t>(static_cast<acc_t>(row[j]), lse, k, b);
    if (j == y) g += a;
    orow[j] = static_cast<scalar_t>(g);
  }
}

bool vec_ok(const void* p, int64_t ld, int64_t elem) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (ld * elem) % 16 == 0;
}

// One block per token row: the grid's x dimension holds at most 2^31 - 1 blocks.
void check_grid_rows(int64_t T) {
  TORCH_CHECK(T <= static_cast<int64_t>(INT32_MAX), "megagspo: the CUDA log-prob kernels run one block per token "
              "and take at most ", INT32_MAX, " tokens per call; got ", T, " (split the call)");
}

Tensor target_i64(const Tensor& target_T) {
  return target_T.scalar_type() == at::kLong ? target_T.contiguous() : target_T.to(at::kLong).contiguous();
}

void launch_forward(const Tensor& logits_TV, const Tensor& target_T, int64_t vocab_start, bool stats,
                    const Tensor& o0, const Tensor& o1, const Tensor& o2, const Tensor& o3, bool skip1, bool skip2) {
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  if (T == 0) return;
  const Tensor target = target_i64(target_T);
  const auto stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits_TV.scalar_type(), "logprob_fwd_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    const scalar_t* x = logits_TV.const_data_ptr<scalar_t>();
    const int64_t ld = logits_TV.stride(0);
    const bool vec = vec_ok(x, ld, sizeof(scalar_t));
    acc_t* p0 = o0.data_ptr<acc_t>();
    acc_t* p1 = skip1 ? nullptr : o1.data_ptr<acc_t>();
    acc_t* p2 = skip2 ? nullptr : o2.data_ptr<acc_t>();
    acc_t* p3 = stats ? o3.data_ptr<acc_t>() : nullptr;
    const int64_t* y = target.const_data_ptr<int64_t>();
    auto launch = [&](auto stats_c, auto vec_c) {
      logprob_fwd_kernel<scalar_t, decltype(stats_c)::value, decltype(vec_c)::value>
          <<<T, kThreads, 0, stream>>>(x, ld, V, y, vocab_start, p0, p1, p2, p3);
    };
    using Y = std::true_type;
    using N = std::false_type;
    if (stats) {
      if (vec) launch(Y{}, Y{}); else launch(Y{}, N{});
    } else {
      if (vec) launch(N{}, Y{}); else launch(N{}, N{});
    }
    MEGAGSPO_CUDA_LAUNCH_CHECK();
  });
}

std::tuple<Tensor, Tensor, Tensor> logprob_forward(const Tensor& logits_TV, const Tensor& target_T,
                                                   bool with_entropy, bool /*inplace_backward: autograd only*/) {
  // Target VALUES are not checked (a host sync): an out-of-vocab target gives a NaN log-prob (see checks.h).
  check_logprob_forward_args(logits_TV, target_T);
  check_grid_rows(logits_TV.size(0));
  const c10::DeviceGuard guard(logits_TV.device());
  const int64_t T = logits_TV.size(0);
  const auto opts = logits_TV.options().dtype(acc_dtype(logits_TV.scalar_type()));
  Tensor logp_T = at::empty({T}, opts), lse_T = at::empty({T}, opts);
  Tensor entropy_T = at::empty({with_entropy ? T : 0}, opts);
  launch_forward(logits_TV, target_T, 0, false, logp_T, entropy_T, lse_T, Tensor(), !with_entropy, false);
  return {logp_T, entropy_T, lse_T};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> logprob_stats(const Tensor& logits_TV, const Tensor& target_T,
                                                         int64_t vocab_start, bool with_entropy) {
  check_logprob_stats_args(logits_TV, target_T, vocab_start);
  check_grid_rows(logits_TV.size(0));
  const c10::DeviceGuard guard(logits_TV.device());
  const int64_t T = logits_TV.size(0);
  const auto opts = logits_TV.options().dtype(acc_dtype(logits_TV.scalar_type()));
  Tensor max_T = at::empty({T}, opts), sumexp_T = at::empty({T}, opts), tgt_T = at::empty({T}, opts);
  Tensor sxm_T = with_entropy ? at::empty({T}, opts) : at::zeros({T}, opts);
  launch_forward(logits_TV, target_T, vocab_start, true, max_T, sumexp_T, sxm_T, tgt_T, false, !with_entropy);
  return {max_T, sumexp_T, sxm_T, tgt_T};
}

// Writes d logits into out (may be the logits themselves). The caller has checked the arguments.
void run_backward(const Tensor& grad_logp_T, const c10::optional<Tensor>& grad_entropy_T, const Tensor& logits_TV,
                  const Tensor& out_TV, const Tensor& target_T, const Tensor& lse_T,
                  const c10::optional<Tensor>& entropy_T, int64_t vocab_start) {
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  const bool with_h = grad_entropy_T.has_value() && grad_entropy_T->defined();
  if (T == 0) return;
  const Tensor target = target_i64(target_T);
  const auto stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits_TV.scalar_type(), "logprob_bwd_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    const scalar_t* x = logits_TV.const_data_ptr<scalar_t>();
    scalar_t* o = out_TV.data_ptr<scalar_t>();
    const int64_t ld_in = logits_TV.stride(0), ld_out = out_TV.stride(0);
    const bool vec = vec_ok(x, ld_in, sizeof(scalar_t)) && vec_ok(o, ld_out, sizeof(scalar_t));
    const acc_t* gh = with_h ? grad_entropy_T->const_data_ptr<acc_t>() : nullptr;
    const acc_t* en = with_h ? entropy_T->const_data_ptr<acc_t>() : nullptr;
    const int64_t* y = target.const_data_ptr<int64_t>();
    const acc_t* glp = grad_logp_T.const_data_ptr<acc_t>();
    const acc_t* l = lse_T.const_data_ptr<acc_t>();
    if (vec)
      logprob_bwd_kernel<scalar_t, true><<<T, kThreads, 0, stream>>>(x, ld_in, o, ld_out, V, y, vocab_start, glp, gh, en, l);
    else
      logprob_bwd_kernel<scalar_t, false><<<T, kThreads, 0, stream>>>(x, ld_in, o, ld_out, V, y, vocab_start, glp, gh, en, l);
    MEGAGSPO_CUDA_LAUNCH_CHECK();
  });
}

Tensor logprob_backward(const Tensor& grad_logp_T, const c10::optional<Tensor>& grad_entropy_T,
                        const Tensor& logits_TV, const Tensor& target_T, const Tensor& lse_T,
                        const c10::optional<Tensor>& entropy_T, int64_t vocab_start) {
  check_logprob_backward_args(grad_logp_T, grad_entropy_T, logits_TV, target_T, lse_T, entropy_T, vocab_start,
                              /*in_place=*/false);
  check_grid_rows(logits_TV.size(0));
  const c10::DeviceGuard guard(logits_TV.device());
  Tensor grad_TV = at::empty(logits_TV.sizes(), logits_TV.options());
  run_backward(grad_logp_T, grad_entropy_T, logits_TV, grad_TV, target_T, lse_T, entropy_T, vocab_start);
  return grad_TV;
}

void logprob_backward_(const Tensor& logits_TV, const Tensor& grad_logp_T, const c10::optional<Tensor>& grad_entropy_T,
                       const Tensor& target_T, const Tensor& lse_T, const c10::optional<Tensor>& entropy_T,
                       int64_t vocab_start) {
  check_logprob_backward_args(grad_logp_T, grad_entropy_T, logits_TV, target_T, lse_T, entropy_T, vocab_start,
                              /*in_place=*/true);
  check_grid_rows(logits_TV.size(0));
  const c10::DeviceGuard guard(logits_TV.device());
  run_backward(grad_logp_T, grad_entropy_T, logits_TV, logits_TV, target_T, lse_T, entropy_T, vocab_start);
}

}  // namespace

TORCH_LIBRARY_IMPL(megagspo, CUDA, m) {
  m.impl("logprob_forward", &logprob_forward);
  m.impl("logprob_stats", &logprob_stats);
  m.impl("logprob_backward", &logprob_backward);
  m.impl("logprob_backward_", &logprob_backward_);
}

}  // namespace megagspo::cuda
