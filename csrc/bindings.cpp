// The only binding file of megagspo._C: it registers ops and nothing else. Kernels live in csrc/cpu/
// (and csrc/cuda/ when built with CUDA); their Python wrappers live in megagspo/kernels/.
#include <torch/extension.h>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megagspo fused kernels (CPU always, CUDA when built with it)";
  m.def("built_with_cuda", &megagspo::built_with_cuda,
        "Whether this build of the extension includes the CUDA kernels");
}
