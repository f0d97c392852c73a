// The package's compiled extension, vllm_dualgpu._C.
// Other csrc/*.cpp files add their functions through the register_* hooks declared here.
#include <pybind11/pybind11.h>

namespace py = pybind11;

// sm_hook.cpp: per-device compute capability for vLLM's compiled library (docs/sm-hook.md).
void register_sm_hook(py::module_& m);

#ifndef VLLM_DUALGPU_VERSION
#define VLLM_DUALGPU_VERSION "dev"
#endif

PYBIND11_MODULE(_C, m) {
    m.doc() = "vllm-dualgpu native helpers";
    m.attr("__version__") = VLLM_DUALGPU_VERSION;
    m.def("abi_ok", []() { return true; }, "Returns True: proves the extension loads.");
    register_sm_hook(m);
}
