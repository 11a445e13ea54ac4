// Python bindings of the LUT-GEMM ops in lutgemm.cu; quantkit/kernels/lutgemm.py is the caller. The ops
// (argument checks + launchers) are defined in the nvcc-compiled lutgemm.cu, as gptq's are: this unit only binds.
#include <torch/extension.h>

#include <optional>

void lutgemm_lut_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                      const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                      int64_t group_size, const at::Tensor& out, int64_t mma_min_batch,
                      const std::optional<at::Tensor>& workspace, int64_t blocks, bool overlap);
void lutgemm_lut_accumulate(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                            const std::optional<at::Tensor>& offset, int64_t group_size, const at::Tensor& acc,
                            int64_t mma_min_batch, int64_t blocks, bool overlap);
int64_t lutgemm_workspace_floats_op(int64_t n, int64_t k);
void lutgemm_dequantize(const at::Tensor& qweight, const at::Tensor& alpha, const std::optional<at::Tensor>& offset,
                        int64_t group_size, const at::Tensor& out);

constexpr int64_t kMaxBatch = 8;  // columns of x per launch (lutgemm::kMaxBatch, lutgemm_common.cuh)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "LUT-GEMM for BCQ weights (see quantkit/kernels/lutgemm.py)";
  // workspace: optional zero fp32 buffer of workspace_floats(n, k) elements, left zero (else one is zeroed per
  // call); blocks: grid cap, 0 = one wave of resident blocks (benchmarks sweep it); overlap: programmatic
  // dependent launch on sm_90+ (grid_dependency.h), the weights' first copies overlapping the previous kernel;
  // alpha [G, q, k], or [G, 1, k] where α_i = 2^i·α_0 (lut_gemm and lut_accumulate: the LUT kernel makes α_i)
  m.def("lut_gemm", &lutgemm_lut_gemm, "out[n, k] = x[n, d] @ BCQ weight^T (+ bias), fp16", py::arg("x"),
        py::arg("qweight"), py::arg("alpha"), py::arg("offset"), py::arg("bias"), py::arg("group_size"),
        py::arg("out"), py::arg("mma_min_batch") = kMaxBatch + 1, py::arg("workspace") = py::none(),
        py::arg("blocks") = 0, py::arg("overlap") = false);
  // acc: fp32, at least n·k elements; += x @ wᵀ as [n, k], bias-free, left for the caller to read and clear
  m.def("lut_accumulate", &lutgemm_lut_accumulate, "acc[n, k] += x[n, d] @ BCQ weight^T in fp32 (no fp16 output)",
        py::arg("x"), py::arg("qweight"), py::arg("alpha"), py::arg("offset"), py::arg("group_size"), py::arg("acc"),
        py::arg("mma_min_batch") = kMaxBatch + 1, py::arg("blocks") = 0, py::arg("overlap") = false);
  m.def("workspace_floats", &lutgemm_workspace_floats_op, "fp32 elements of lut_gemm's workspace for n columns, k rows",
        py::arg("n"), py::arg("k"));
  m.def("dequantize", &lutgemm_dequantize, "out[k, d] = the BCQ weight, exact, in out.dtype", py::arg("qweight"),
        py::arg("alpha"), py::arg("offset"), py::arg("group_size"), py::arg("out"));
  m.attr("max_batch") = kMaxBatch;
}
