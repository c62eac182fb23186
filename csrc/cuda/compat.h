// What the CUDA kernels need from torch beyond ATen: the current stream and a launch check.
//
// torch's CPU wheel ships c10/cuda/*.h without the generated c10/cuda/impl/cuda_cmake_macros.h, so
// `make cuda-check` (nvcc against a CPU torch) cannot include c10/cuda. There, and only there, the current
// stream falls back to the legacy default stream: that build is compile-only and never runs. Real CUDA
// builds of torch have the header and use c10::cuda::getCurrentCUDAStream().
#pragma once

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
namespace megagspo::cuda {
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
}  // namespace megagspo::cuda
#else
#define MEGAGSPO_CUDA_COMPILE_CHECK_ONLY 1
namespace megagspo::cuda {
inline cudaStream_t current_stream() { return nullptr; }
}  // namespace megagspo::cuda
#endif

#define MEGAGSPO_CUDA_LAUNCH_CHECK()                                                            \
  do {                                                                                          \
    const cudaError_t megagspo_err = cudaGetLastError();                                        \
    TORCH_CHECK(megagspo_err == cudaSuccess, "megagspo: CUDA kernel launch failed: ",           \
                cudaGetErrorString(megagspo_err));                                             \
  } while (0)
