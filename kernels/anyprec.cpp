// Python bindings of the any-precision ops in anyprec.cu; quantkit/kernels/anyprec_gemm.py is the caller. The
// ops (argument checks + launchers) are defined in the nvcc-compiled anyprec.cu, as gptq's are: this unit only binds.
#include <torch/extension.h>

#include <optional>

at::Tensor anyprec_matvec(const at::Tensor& x, const at::Tensor& planes, const at::Tensor& lut, int64_t k,
                          int64_t words, const std::optional<at::Tensor>& bias, const at::Tensor& out, int64_t flags,
                          int64_t tiles, bool overlap);
at::Tensor anyprec_dequantize(const at::Tensor& planes, const at::Tensor& lut, int64_t k, int64_t in_features,
                              const at::Tensor& out);
bool anyprec_has_matvec(at::ScalarType dtype, int64_t k, int64_t tiles, int64_t flags);

constexpr int kMaxBatch = 8;  // anyprec::kMaxBatch (anyprec_bits.cuh), the mma's N

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Any-precision bitplane matvec and dequantize kernels (quantkit)";
  m.def("matvec", &anyprec_matvec, "y = x @ W_k^T (+ bias) from the top k bitplanes, batch 1..8", py::arg("x"),
        py::arg("planes"), py::arg("lut"), py::arg("bits"), py::arg("words"), py::arg("bias"), py::arg("out"),
        py::arg("flags") = 7, py::arg("tiles") = 1, py::arg("overlap") = false);
  m.def("dequantize", &anyprec_dequantize, "dequantize the top k bitplanes into out [M, in_features]",
        py::arg("planes"), py::arg("lut"), py::arg("bits"), py::arg("in_features"), py::arg("out"));
  m.def("has_matvec", &anyprec_has_matvec, "whether an instance for (dtype, bits, tiles, flags) was built",
        py::arg("dtype"), py::arg("bits"), py::arg("tiles"), py::arg("flags"));
  m.attr("MAX_BATCH") = kMaxBatch;
}
