// Python binding of the fused GPTQ / k-OOC tile kernel and the static-group params kernel (gptq.cu);
// quantkit/kernels/gptq_cuda.py is the caller.
#include <torch/extension.h>

#include <optional>

void gptq_tile(const at::Tensor& w, const at::Tensor& u, const at::Tensor& codes, const at::Tensor& err,
               const at::Tensor& scales, const at::Tensor& zeros, const at::Tensor& hscales,
               const at::Tensor& hzeros, const at::Tensor& loss, const std::optional<at::Tensor>& clear,
               const std::optional<at::Tensor>& high_bits, const std::optional<at::Tensor>& col_group,
               int64_t row_lo, int64_t row_hi, int64_t rows_per_unit, int64_t i1, int64_t i2, int64_t g,
               int64_t low_bits, bool sym, bool clip, double min_scale, int64_t clip_steps, int64_t clip_grid,
               double clip_norm, int64_t tpr);
void gptq_group_params(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros, int64_t g,
                       int64_t bits, bool sym, bool clip, double min_scale, int64_t clip_steps, int64_t clip_grid,
                       double clip_norm, int64_t tpr);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused GPTQ / k-OOC column loop, one tile of columns per call (see kernels/gptq.cu)";
  m.def("tile", &gptq_tile,
        "Run columns [i1, i2) of the GPTQ column loop for rows [row_lo, row_hi) of w; writes codes, err, "
        "scales/zeros (dynamic groups), hscales, hzeros and loss of those rows. Launches on the current stream.",
        py::arg("w"), py::arg("u"), py::arg("codes"), py::arg("err"), py::arg("scales"), py::arg("zeros"),
        py::arg("hscales"), py::arg("hzeros"), py::arg("loss"), py::arg("clear"), py::arg("high_bits"),
        py::arg("col_group"), py::arg("row_lo"), py::arg("row_hi"), py::arg("rows_per_unit"), py::arg("i1"),
        py::arg("i2"), py::arg("g"), py::arg("low_bits"), py::arg("sym"), py::arg("clip"), py::arg("min_scale"),
        py::arg("clip_steps"), py::arg("clip_grid"), py::arg("clip_norm"), py::arg("tpr"));
  m.def("group_params", &gptq_group_params,
        "Scales and zeros [R, G] of every group of g columns of w [R, d] (static groups), clip-searched if asked. "
        "Launches on the current stream.",
        py::arg("w"), py::arg("scales"), py::arg("zeros"), py::arg("g"), py::arg("bits"), py::arg("sym"),
        py::arg("clip"), py::arg("min_scale"), py::arg("clip_steps"), py::arg("clip_grid"), py::arg("clip_norm"),
        py::arg("tpr"));
}
