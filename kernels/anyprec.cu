// Launchers and PyTorch ops of the any-precision kernels (bound in anyprec.cpp; quantkit/kernels/
// anyprec_gemm.py is the caller). The ops live here, in the nvcc-compiled unit; their checks are QK_CHECKs
// (check.h says why).
//
// launch_matvec dispatches (dtype, k, tiles, flags) to the compiled instances of matvec_kernel
// (anyprec_matvec_kernel.cuh; which exist: compiled_rule in anyprec_decode.cuh), one block per 16·tiles
// rows, those with FLAG_PAIR to anyprec_variants.cu; launch_dequant runs dequant_kernel
// (anyprec_dequant_kernel.cuh).

#include <ATen/core/Tensor.h>

#include "check.h"
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // the stream c10::cuda::getCurrentCUDAStream() returns, without cuBLAS headers

#include <optional>
#include <string>

#include "anyprec_dequant_kernel.cuh"
#include "anyprec_launch.cuh"
#include "anyprec_rows.cuh"

namespace anyprec {

// ---------------------------------------------------------------------------------------------
// launchers

bool has_matvec(int dtype, int k, int tiles, int flags) {
  if (dtype != 0 && dtype != 1) return false;
  if (flags & FLAG_ROWS) return rows_rule(k, tiles, normalize_flags(k, flags));
  return compiled_rule(dtype == 0, k, tiles, normalize_flags(k, flags));
}

// The variants of the shared-memory-table widths (flags with FLAG_PAIR), compiled in anyprec_variants.cu so
// that the two units build in parallel.
int launch_matvec_variant(int dtype, int k, int tiles, int flags, const MatvecArgs& a, const Launch& on);

// The row-per-lane kernel (FLAG_ROWS, anyprec_rows.cu); `split` = the op's tiles.
int launch_matvec_rows(int dtype, int k, int split, int flags, const MatvecArgs& a, const Launch& on);

template <typename T, int TILES>
int launch_flags(int k, int flags, const MatvecArgs& a, const Launch& s) {
  switch (flags) {
    case 0: return launch_k<T, TILES, 0>(k, a, s);
    case 3: return launch_k<T, TILES, 3>(k, a, s);
    case 4: return launch_k<T, TILES, 4>(k, a, s);
    case 5: return launch_k<T, TILES, 5>(k, a, s);
    case 6: return launch_k<T, TILES, 6>(k, a, s);
    case 7: return launch_k<T, TILES, 7>(k, a, s);
    default: return kUnsupported;
  }
}

// dtype: 0 = fp16, 1 = bf16
int launch_matvec(int dtype, int k, int tiles, int flags, const MatvecArgs& args, const Launch& on) {
  MatvecArgs a = args;
  for (int i = 0; i < 32; ++i) a.pow2.v[i] = 1u << i;
  if (a.B < 1 || a.B > kMaxBatch || a.M < 1 || a.W < 1 || a.wstride < a.W || a.wstride % 4 != 0 || a.ldx < 32 * a.W)
    return kBadArgs;
  if (!has_matvec(dtype, k, tiles, flags)) return kUnsupported;
  flags = normalize_flags(k, flags);
  if (flags & FLAG_ROWS) return launch_matvec_rows(dtype, k, tiles, flags, a, on);
  if (flags & FLAG_PAIR) return launch_matvec_variant(dtype, k, tiles, flags, a, on);
  if (tiles == 1) return dtype == 0 ? launch_flags<__half, 1>(k, flags, a, on) : launch_flags<__nv_bfloat16, 1>(k, flags, a, on);
  return dtype == 0 ? launch_flags<__half, 2>(k, flags, a, on) : launch_flags<__nv_bfloat16, 2>(k, flags, a, on);
}

// dtype: 0 = fp16, 1 = bf16, 2 = fp32
int launch_dequant(int dtype, int k, const uint32_t* planes, int M, int W, int wstride, int N, const uint16_t* lut,
                   void* out, cudaStream_t stream) {
  if (k < 1 || k > 8 || M < 1 || W < 1 || wstride < W || N > 32 * W || N <= 32 * (W - 1)) return kBadArgs;
  const dim3 grid(M, (W + 127) / 128);
  if (dtype == 0) dequant_kernel<__half><<<grid, 128, 0, stream>>>(planes, M, W, wstride, N, lut, k, static_cast<__half*>(out));
  else if (dtype == 1) dequant_kernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(planes, M, W, wstride, N, lut, k, static_cast<__nv_bfloat16*>(out));
  else if (dtype == 2) dequant_kernel<float><<<grid, 128, 0, stream>>>(planes, M, W, wstride, N, lut, k, static_cast<float*>(out));
  else return kUnsupported;
  return kOk;
}

}  // namespace anyprec

// ---------------------------------------------------------------------------------------------
// PyTorch ops (bound in anyprec.cpp): argument checks (shape, dtype, device, layout) before any
// launch, launch on the current stream, launcher status codes turned into messages. They live
// here, in the nvcc-compiled unit; their checks are QK_CHECKs (check.h says why).

namespace {

int dtype_code(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return 0;
  if (t.scalar_type() == at::kBFloat16) return 1;
  if (t.scalar_type() == at::kFloat) return 2;
  return -1;
}

std::string status_text(int rc) {
  switch (rc) {
    case anyprec::kUnsupported: return "no compiled instance for this configuration";
    case anyprec::kBadArgs: return "arguments rejected by the launcher";
    case anyprec::kLaunchFailed: return "could not raise the kernel's shared-memory limit, or the launch failed";
    default: return "status " + std::to_string(rc);
  }
}

// rows: the planes are in the rows layout (FLAG_ROWS, anyprec_gemm.rows_layout), int32 [n, G, words', 32] with
// G = 2 * ceil(M / 64) for the lut's M rows; otherwise [n, M, words'].
void check_planes(const at::Tensor& planes, const at::Tensor& lut, int64_t k, int64_t words, bool rows = false) {
  QK_CHECK(planes.is_cuda() && planes.scalar_type() == at::kInt && planes.dim() == (rows ? 4 : 3) &&
               planes.is_contiguous(),
           "anyprec: planes must be a contiguous CUDA int32 tensor ", rows ? "[n, G, words, 32] (rows layout)" : "[n, M, words]",
           ", got ", planes.sizes(), " ", planes.scalar_type(), planes.is_cuda() ? "" : " on CPU");
  QK_CHECK(k >= 1 && k <= 8 && k <= planes.size(0), "anyprec: bits=", k, " needs 1..8 and at most the ",
              planes.size(0), " stored planes");
  QK_CHECK(words >= 1 && words <= planes.size(2), "anyprec: words=", words, " but planes hold ", planes.size(2),
              " words per row");
  const int64_t M = rows ? lut.size(0) : planes.size(1);
  QK_CHECK(lut.is_cuda() && lut.scalar_type() == at::kHalf && lut.dim() == 2 && lut.is_contiguous() &&
                  lut.size(0) == M && lut.size(1) == (int64_t(1) << k),
              "anyprec: lut must be a contiguous CUDA fp16 tensor [", M, ", ", int64_t(1) << k,
              "] for bits=", k, ", got ", lut.sizes(), " ", lut.scalar_type());
  if (rows)
    QK_CHECK(planes.size(1) == 2 * ((M + 63) / 64) && planes.size(3) == 32, "anyprec: rows-layout planes ",
             planes.sizes(), " do not hold the lut's ", M, " rows as [n, 2 * ceil(M / 64), words, 32]");
  QK_CHECK(lut.device() == planes.device(), "anyprec: lut on ", lut.device(), " but planes on ", planes.device());
  QK_CHECK(planes.size(1) <= INT32_MAX && planes.size(2) <= INT32_MAX, "anyprec: planes too large");
}

}  // namespace

// out[b, r] = sum_c x[b, c] * lut[r, code_k(r, c)] (+ bias[r]); x [B <= 8, ldx] holds at least
// 32 * words columns, zero past in_features; planes in the layout `flags` says (LAYOUT bit set:
// anyprec_gemm.kernel_layout; FLAG_ROWS: anyprec_gemm.rows_layout, with tiles = the blocks that split a 64-row
// block's words). overlap: programmatic dependent launch on sm_90+ (grid_dependency.h).
// Returns out.
at::Tensor anyprec_matvec(const at::Tensor& x, const at::Tensor& planes, const at::Tensor& lut, int64_t k,
                          int64_t words, const std::optional<at::Tensor>& bias, const at::Tensor& out, int64_t flags,
                          int64_t tiles, bool overlap) {
  const bool rows = (flags & anyprec::FLAG_ROWS) != 0;
  check_planes(planes, lut, k, words, rows);
  const int dt = dtype_code(x);
  QK_CHECK(x.is_cuda() && (dt == 0 || dt == 1) && x.dim() == 2 && x.is_contiguous(),
              "anyprec.matvec: x must be a contiguous CUDA fp16/bf16 tensor [B, columns], got ", x.sizes(), " ",
              x.scalar_type());
  QK_CHECK(x.device() == planes.device(), "anyprec.matvec: x on ", x.device(), " but planes on ", planes.device());
  const int64_t B = x.size(0), M = rows ? lut.size(0) : planes.size(1);
  const int64_t stored_rows = rows ? 32 * planes.size(1) : M;  // the rows layout pads to whole 64-row blocks
  QK_CHECK(B >= 1 && B <= anyprec::kMaxBatch, "anyprec.matvec: batch ", B, " outside 1..", anyprec::kMaxBatch);
  QK_CHECK(x.size(1) >= 32 * words && x.size(1) % 4 == 0,
              "anyprec.matvec: x has ", x.size(1), " columns; needs >= 32 * words = ", 32 * words,
              " and a multiple of 4 (pad in_features to whole words)");
  QK_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0, "anyprec.matvec: x must be 8-byte aligned");
  QK_CHECK(!rows || (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.size(1) % 8 == 0),
           "anyprec.matvec: the rows kernel reads x in 16-byte vectors: x must be 16-byte aligned with a multiple of 8 "
           "columns, got ", x.size(1));
  QK_CHECK(planes.size(2) % 4 == 0, "anyprec.matvec: planes have ", planes.size(2),
              " words per row; the kernel reads 16-byte vectors and needs a multiple of 4 (use kernel_layout)");
  QK_CHECK(out.is_cuda() && out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == B && out.size(1) == M && out.device() == x.device(),
              "anyprec.matvec: out must be a contiguous ", x.scalar_type(), " tensor [", B, ", ", M, "] on ",
              x.device(), ", got ", out.sizes(), " ", out.scalar_type());
  const void* bias_ptr = nullptr;
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    QK_CHECK(b.is_cuda() && b.scalar_type() == x.scalar_type() && b.dim() == 1 && b.size(0) == M &&
                    b.is_contiguous() && b.device() == x.device(),
                "anyprec.matvec: bias must be a contiguous ", x.scalar_type(), " tensor [", M, "] on ", x.device(),
                ", got ", b.sizes(), " ", b.scalar_type());
    bias_ptr = b.data_ptr();
  }
  QK_CHECK(anyprec::has_matvec(dt, int(k), int(tiles), int(flags)), "anyprec.matvec: no kernel built for dtype=",
              x.scalar_type(), " bits=", k, " tiles=", tiles, " flags=", flags);
  QK_CHECK(x.size(1) <= INT32_MAX / 2, "anyprec.matvec: x row too long");
  QK_CHECK(k * stored_rows * planes.size(2) <= INT32_MAX, "anyprec.matvec: the top ", k, " planes hold ",
           k * stored_rows * planes.size(2),
           " words; the kernel's 32-bit offsets need fewer than 2^31 (split the layer)");
  QK_CHECK(reinterpret_cast<uintptr_t>(planes.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(lut.data_ptr()) % 16 == 0,
           "anyprec.matvec: planes and lut must be 16-byte aligned");

  const c10::cuda::CUDAGuard guard(x.device());
  anyprec::MatvecArgs a{x.data_ptr(), int(x.size(1)), int(B), reinterpret_cast<const uint32_t*>(planes.data_ptr()),
                        int(M), int(words), int(planes.size(2)), reinterpret_cast<const uint16_t*>(lut.data_ptr()),
                        bias_ptr, out.data_ptr(), {}};
  const anyprec::Launch on{c10::cuda::getCurrentCUDAStream(), overlap, x.device().index()};
  const int rc = anyprec::launch_matvec(dt, int(k), int(tiles), int(flags), a, on);
  QK_CHECK(rc == 0, "anyprec.matvec failed (", status_text(rc),
           on.error != cudaSuccess ? std::string(": ") + cudaGetErrorString(on.error) : std::string(), ") for x ",
           x.sizes(), ", planes ", planes.sizes(),
              ", bits=", k, ", words=", words, ", tiles=", tiles, ", flags=", flags);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// out [M, in_features] (fp16/bf16/fp32) = lut[r, code_k(r, c)] from natural-layout planes.
at::Tensor anyprec_dequantize(const at::Tensor& planes, const at::Tensor& lut, int64_t k, int64_t in_features,
                              const at::Tensor& out) {
  const int64_t words = (in_features + 31) / 32;
  check_planes(planes, lut, k, words);
  QK_CHECK(planes.size(2) == words, "anyprec.dequantize: planes have ", planes.size(2), " words per row but ",
              in_features, " columns need ", words, " (natural layout)");
  const int dt = dtype_code(out);
  const int64_t M = planes.size(1);
  QK_CHECK(out.is_cuda() && dt >= 0 && out.is_contiguous() && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == in_features && out.device() == planes.device(),
              "anyprec.dequantize: out must be a contiguous fp16/bf16/fp32 tensor [", M, ", ", in_features, "] on ",
              planes.device(), ", got ", out.sizes(), " ", out.scalar_type());
  const c10::cuda::CUDAGuard guard(planes.device());
  const int rc = anyprec::launch_dequant(dt, int(k), reinterpret_cast<const uint32_t*>(planes.data_ptr()), int(M),
                                         int(words), int(words), int(in_features),
                                         reinterpret_cast<const uint16_t*>(lut.data_ptr()), out.data_ptr(),
                                         c10::cuda::getCurrentCUDAStream());
  QK_CHECK(rc == 0, "anyprec.dequantize failed (", status_text(rc), ") for planes ", planes.sizes(), ", bits=", k,
              ", in_features=", in_features);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

bool anyprec_has_matvec(at::ScalarType dtype, int64_t k, int64_t tiles, int64_t flags) {
  const int dt = dtype == at::kHalf ? 0 : dtype == at::kBFloat16 ? 1 : -1;
  return dt >= 0 && anyprec::has_matvec(dt, int(k), int(tiles), int(flags));
}
