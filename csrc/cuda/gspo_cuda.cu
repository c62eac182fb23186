// CUDA segmented GSPO kernel (paper eqs. 6, 8, 11); the formulas are written out in csrc/cpu/gspo_cpu.cpp.
//
// Forward: one launch, one block per sequence (block reduction of sum mask (logp - old_logp) and sum mask);
// each block writes its sequence's outputs and objective, and the last block to finish (atomic ticket)
// sums the S objectives in a fixed order, so the loss is deterministic and no host sync is needed. The
// ticket is one int32 per (device, stream), zeroed once when first used and reset to 0 by each launch's last
// block: kernels of one stream run one after another, so no zero-fill kernel runs per call (it was ~2 us of
// a ~8 us forward on an H200). Backward: one elementwise launch over T, each token finding its sequence by
// binary search in cu_seqlens (tokens outside every sequence get 0), staged in shared memory when it has at
// most kSharedCu entries (a search through global memory is a chain of dependent loads).
#include <map>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstdint>

#include "checks.h"
#include "cuda/compat.h"

namespace megagspo::cuda {
namespace {

using at::Tensor;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kSharedCu = 2048;  // cu_seqlens entries staged in shared memory by the backward (16 KB int64)

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the block in a fixed order; the result is valid in every thread.
template <typename acc_t>
__device__ __forceinline__ acc_t block_sum(acc_t v, acc_t* shared) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  acc_t r = lane < kWarps ? shared[lane] : acc_t(0);
  return warp_sum(r);
}

template <typename cu_t>
__device__ __forceinline__ int64_t clamp_pos(cu_t v, int64_t T) {
  const int64_t x = static_cast<int64_t>(v);
  return x < 0 ? 0 : (x > T ? T : x);
}

template <typename scalar_t, typename mask_t, typename cu_t>
__global__ void __launch_bounds__(kThreads) gspo_fwd_kernel(
    const scalar_t* __restrict__ logp, const scalar_t* __restrict__ old_logp, const mask_t* __restrict__ mask,
    const cu_t* __restrict__ cu, const at::acc_type<scalar_t, true>* __restrict__ adv, int64_t T, int64_t S,
    at::acc_type<scalar_t, true> lo, at::acc_type<scalar_t, true> hi, at::acc_type<scalar_t, true> inv_n,
    at::acc_type<scalar_t, true>* __restrict__ logratio, at::acc_type<scalar_t, true>* __restrict__ ratio,
    bool* __restrict__ clipped, at::acc_type<scalar_t, true>* __restrict__ coef,
    at::acc_type<scalar_t, true>* __restrict__ obj, unsigned int* __restrict__ ticket,
    at::acc_type<scalar_t, true>* __restrict__ loss) {
  using acc_t = at::acc_type<scalar_t, true>;
  __shared__ acc_t shared[kWarps];
  __shared__ bool is_last;
  const int64_t i = blockIdx.x;
  const int64_t b = clamp_pos(cu[i], T);
  int64_t e = clamp_pos(cu[i + 1], T);
  e = e < b ? b : e;
  acc_t sum = 0, cnt = 0;
  for (int64_t t = b + threadIdx.x; t < e; t += kThreads) {
    const acc_t w = static_cast<acc_t>(mask[t]);
    sum += w * (static_cast<acc_t>(logp[t]) - static_cast<acc_t>(old_logp[t]));
    cnt += w;
  }
  sum = block_sum(sum, shared);
  cnt = block_sum(cnt, shared);
  if (threadIdx.x == 0) {
    const acc_t denom = cnt > acc_t(1) ? cnt : acc_t(1);
    const acc_t m = sum / denom;  // eq. 8 in log space
    const acc_t s = ::exp(m);
    const acc_t a = adv[i];
    const bool empty = cnt == acc_t(0);
    const bool clip = !empty && ((a > acc_t(0) && s > hi) || (a < acc_t(0) && s < lo));
    const acc_t sc = s < lo ? lo : (s > hi ? hi : s);
    const acc_t o1 = s * a, o2 = sc * a;
    logratio[i] = m;
    ratio[i] = s;
    clipped[i] = clip;
    obj[i] = empty ? acc_t(0) : (o1 < o2 ? o1 : o2);  // eq. 6
    coef[i] = (empty || clip) ? acc_t(0) : -(a * s) / denom * inv_n;
    __threadfence();
    is_last = atomicAdd(ticket, 1u) == static_cast<unsigned int>(S - 1);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  acc_t total = 0;  // fixed per-thread strides and a fixed tree: deterministic
  for (int64_t k = threadIdx.x; k < S; k += kThreads) total += static_cast<volatile acc_t*>(obj)[k];
  total = block_sum(total, shared);
  if (threadIdx.x == 0) {
    *loss = -total * inv_n;
    *ticket = 0u;  // every other block has taken its ticket: ready for the stream's next launch
  }
}

template <typename scalar_t, typename mask_t, typename cu_t>
__global__ void gspo_bwd_kernel(const at::acc_type<scalar_t, true>* __restrict__ grad_loss,
                                const at::acc_type<scalar_t, true>* __restrict__ coef,
                                const mask_t* __restrict__ mask, const cu_t* __restrict__ cu, int64_t T, int64_t S,
                                scalar_t* __restrict__ out) {
  using acc_t = at::acc_type<scalar_t, true>;
  __shared__ cu_t cu_shared[kSharedCu];
  const bool staged = S + 1 <= kSharedCu;
  if (staged) {
    for (int64_t k = threadIdx.x; k <= S; k += blockDim.x) cu_shared[k] = cu[k];
  }
  __syncthreads();
  const cu_t* bounds = staged ? cu_shared : cu;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  // Sequence of t: the number of boundaries cu[1..S] that are <= t.
  int64_t lo = 0, hi = S;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(bounds[mid + 1]) <= t) lo = mid + 1; else hi = mid;
  }
  const bool inside = S > 0 && lo < S && t >= static_cast<int64_t>(bounds[0]);
  const acc_t g = inside ? grad_loss[0] * coef[lo] * static_cast<acc_t>(mask[t]) : acc_t(0);
  out[t] = static_cast<scalar_t>(g);
}

// The forward's ticket of (device, stream): allocated and zeroed on first use (on that stream), then kept for
// the life of the process (deliberately never freed: a static tensor would be destroyed after CUDA shuts down).
unsigned int* stream_ticket(const at::Device& device, cudaStream_t stream) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, Tensor*> tickets;
  const std::lock_guard<std::mutex> lock(mutex);
  Tensor*& ticket = tickets[{device.index(), stream}];
  if (ticket == nullptr) ticket = new Tensor(at::zeros({1}, at::TensorOptions().device(device).dtype(at::kInt)));
  return reinterpret_cast<unsigned int*>(ticket->data_ptr<int32_t>());
}

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
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mask_T.scalar_type(), "gspo_mask_cuda",
                                    [&] { with_cu(mask_T.const_data_ptr<scalar_t>()); });
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> gspo_segment_forward(
    const Tensor& logp_T, const Tensor& old_logp_T, const Tensor& mask_T, const Tensor& cu_seqlens_S1,
    const Tensor& advantages_S, double clip_low, double clip_high, double num_global_sequences) {
  // cu_seqlens VALUES are not checked (a host sync): the kernel clamps them to [0, T] (see checks.h).
  const auto [T, S] = check_gspo_forward_args(logp_T, old_logp_T, mask_T, cu_seqlens_S1, advantages_S, clip_low,
                                              clip_high, num_global_sequences);
  TORCH_CHECK(S <= static_cast<int64_t>(INT32_MAX), "megagspo: the CUDA GSPO kernel runs one block per sequence "
              "and takes at most ", INT32_MAX, " sequences per call; got ", S);
  const c10::DeviceGuard guard(logp_T.device());
  const auto acc = acc_dtype(logp_T.scalar_type());
  const auto opts = logp_T.options().dtype(acc);
  Tensor loss = S == 0 ? at::zeros({}, opts) : at::empty({}, opts);  // written by the kernel's last block
  Tensor logratio_S = at::empty({S}, opts), ratio_S = at::empty({S}, opts), coef_S = at::empty({S}, opts);
  Tensor clipped_S = at::empty({S}, logp_T.options().dtype(at::kBool));
  if (S == 0) return {loss, logratio_S, ratio_S, clipped_S, coef_S};
  Tensor obj_S = at::empty({S}, opts);
  const auto stream = current_stream();
  unsigned int* ticket = stream_ticket(logp_T.device(), stream);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logp_T.scalar_type(), "gspo_fwd_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    const scalar_t* lp = logp_T.const_data_ptr<scalar_t>();
    const scalar_t* old = old_logp_T.const_data_ptr<scalar_t>();
    const acc_t lo = static_cast<acc_t>(1.0 - clip_low), hi = static_cast<acc_t>(1.0 + clip_high);
    const acc_t inv_n = static_cast<acc_t>(1.0 / num_global_sequences);
    with_mask_and_cu(mask_T, cu_seqlens_S1, [&](const auto* mask, const auto* cu) {
      using mask_t = std::remove_cv_t<std::remove_pointer_t<decltype(mask)>>;
      using cu_t = std::remove_cv_t<std::remove_pointer_t<decltype(cu)>>;
      gspo_fwd_kernel<scalar_t, mask_t, cu_t><<<S, kThreads, 0, stream>>>(
          lp, old, mask, cu, advantages_S.const_data_ptr<acc_t>(), T, S, lo, hi, inv_n, logratio_S.data_ptr<acc_t>(),
          ratio_S.data_ptr<acc_t>(), clipped_S.data_ptr<bool>(), coef_S.data_ptr<acc_t>(), obj_S.data_ptr<acc_t>(),
          ticket, loss.data_ptr<acc_t>());
      MEGAGSPO_CUDA_LAUNCH_CHECK();
    });
  });
  return {loss, logratio_S, ratio_S, clipped_S, coef_S};
}

Tensor gspo_segment_backward(const Tensor& grad_loss, const Tensor& coef_S, const Tensor& mask_T,
                             const Tensor& cu_seqlens_S1, at::ScalarType out_dtype) {
  check_gspo_backward_args(grad_loss, coef_S, mask_T, cu_seqlens_S1, out_dtype);
  const c10::DeviceGuard guard(coef_S.device());
  const int64_t T = mask_T.size(0), S = coef_S.size(0);
  Tensor grad_T = at::empty({T}, mask_T.options().dtype(out_dtype));
  if (T == 0) return grad_T;
  const Tensor g = grad_loss.reshape({}).to(coef_S.scalar_type());
  const auto stream = current_stream();
  const int64_t blocks = (T + kThreads - 1) / kThreads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "gspo_bwd_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    with_mask_and_cu(mask_T, cu_seqlens_S1, [&](const auto* mask, const auto* cu) {
      using mask_t = std::remove_cv_t<std::remove_pointer_t<decltype(mask)>>;
      using cu_t = std::remove_cv_t<std::remove_pointer_t<decltype(cu)>>;
      gspo_bwd_kernel<scalar_t, mask_t, cu_t><<<blocks, kThreads, 0, stream>>>(
          g.const_data_ptr<acc_t>(), coef_S.const_data_ptr<acc_t>(), mask, cu, T, S, grad_T.data_ptr<scalar_t>());
      MEGAGSPO_CUDA_LAUNCH_CHECK();
    });
  });
  return grad_T;
}

}  // namespace

TORCH_LIBRARY_IMPL(megagspo, CUDA, m) {
  m.impl("gspo_segment_forward", &gspo_segment_forward);
  m.impl("gspo_segment_backward", &gspo_segment_backward);
}

}  // namespace megagspo::cuda
