// Launchers and PyTorch ops of LUT-GEMM (bound in lutgemm.cpp; quantkit/kernels/lutgemm.py is the caller).
// The ops live here, in the nvcc-compiled unit; their checks are QK_CHECKs (check.h says why).
//
// Which kernel serves a launch of at most 8 columns of x:
//   columns >= mma_min_batch and whole 128-column chunks per group -> bcq_mma_kernel<q or 0>
//                                                                     (lutgemm_mma_kernel.cuh)
//   otherwise                                                      -> lut_gemm_kernel<padded batch>
//                                                                     (lutgemm_lut_kernel.cuh)
//   dense weight for cuBLAS                                        -> dequant_kernel<out type>
//                                                                     (lutgemm_dequant_kernel.cuh)
// The matvec grids are one wave of resident blocks (SMs × the occupancy query), capped by the steps.

#include "lutgemm_dequant_kernel.cuh"
#include "lutgemm_plan.cuh"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "check.h"
#include "kernel_attrs.h"
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // the stream c10::cuda::getCurrentCUDAStream() returns, without cuBLAS headers

#include <optional>

namespace {
using LutKernel = void (*)(lutgemm::LutParams);

// The LUT kernel for BP padded columns (lean: the LUT_MIN_BLOCKS_LEAN register budget; compact: α [G, 1, k]),
// its dynamic shared memory allowed on the current device.
template <int BP, bool LEAN = false, bool COMPACT = false>
LutKernel lut_kernel() {
  constexpr int kMinBlocks = LEAN ? LUT_MIN_BLOCKS_LEAN : LUT_MIN_BLOCKS;
  // a failure shows at launch
  qk::configure_once<lutgemm::lut_gemm_kernel<BP, kMinBlocks, COMPACT>>(lutgemm::Cfg<BP>::kSmemBytes, -1);
  return lutgemm::lut_gemm_kernel<BP, kMinBlocks, COMPACT>;
}

template <int BP>
LutKernel lut_kernel_for(bool lean, bool compact) {
  if constexpr (BP <= lutgemm::kCompactAlphaMaxBatch) {
    if (compact) return lean ? lut_kernel<BP, true, true>() : lut_kernel<BP, false, true>();
  }
  if constexpr (BP == 8) return lut_kernel<8>();  // no lean instance: 8 columns need the registers
  else return lean ? lut_kernel<BP, true>() : lut_kernel<BP>();
}

// The instance a launch of bp padded columns runs. There is no compact-α instance past kCompactAlphaMaxBatch
// columns: lutgemm_cuda_gemm refuses a compact α there before it gets here.
LutKernel lut_instance(int bp, bool lean, bool compact) {
  switch (bp) {
    case 1: return lut_kernel_for<1>(lean, compact);
    case 2: return lut_kernel_for<2>(lean, compact);
    case 4: return lut_kernel_for<4>(lean, compact);
    default: return lut_kernel_for<8>(lean, compact);
  }
}

// Whether `device` runs the lean LUT instances (1-4 columns): where the decode measured faster with them,
// the H100s (lutgemm_tuning.h). With the default ring, shared memory, not registers, sets their residency, so
// the grid is the same.
bool lut_lean_registers(int device) {
  static std::atomic<int> known[64];
  return qk::once_per_device(known, device, [](int dev) {
    cudaDeviceProp prop{};
    return cudaGetDeviceProperties(&prop, dev) == cudaSuccess && std::strstr(prop.name, "H100") != nullptr;
  });
}

// The tensor-core kernel, its dynamic shared memory (the ring; it depends on q) allowed on the current
// device, with all of L1 as shared memory so the blocks the occupancy query counts fit.
template <int Q>
auto mma_kernel_q() {
  qk::configure_once<lutgemm::bcq_mma_kernel<Q>>(lutgemm::kMmaMaxSmemBytes, 100);  // a failure shows at launch
  return lutgemm::bcq_mma_kernel<Q>;
}

// the instance for q sign planes: compiled for that q up to MMA_STATIC_Q_MAX, else q read at run time
auto mma_kernel(int q) {
  if (q <= MMA_STATIC_Q_MAX) {
    switch (q) {
      case 1: return mma_kernel_q<1>();
      case 2: return mma_kernel_q<2>();
      case 3: return mma_kernel_q<3>();
      case 4: return mma_kernel_q<4>();
      default: break;
    }
  }
  return mma_kernel_q<0>();
}

inline int mma_smem_bytes(int q, int planes) { return MMA_STAGES * lutgemm::mma_stage_bytes(q, planes); }

// Resident blocks per SM of the tensor-core kernel, whose ring grows with the planes, asked once per process
// (one GPU model assumed).
int mma_resident_blocks(int planes, int q) {
  static int cached[lutgemm::kMmaMaxPlanes + 1][9] = {};
  int& slot = cached[planes][q];
  if (slot == 0) {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, mma_kernel(q), lutgemm::kThreads, mma_smem_bytes(q, planes));
    slot = n > 0 ? n : 1;
  }
  return slot;
}

// Resident blocks per SM of the LUT instance lut_instance(bp, lean, compact), asked once per process.
int lut_resident_blocks(int bp, bool lean, bool compact) {
  static int cached[2][2][4] = {};
  int& slot = cached[lean ? 1 : 0][compact ? 1 : 0][bp == 1 ? 0 : bp == 2 ? 1 : bp == 4 ? 2 : 3];
  if (slot == 0) {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, lut_instance(bp, lean, compact), lutgemm::kThreads,
                                                  lutgemm::lut_smem_bytes(bp));
    slot = n > 0 ? n : 1;
  }
  return slot;
}
}  // namespace

// Floats of zeroed workspace lutgemm_cuda_gemm needs for n columns of x and k rows.
size_t lutgemm_workspace_floats(int64_t n, int64_t k) {
  const int64_t launches = (n + lutgemm::kMaxBatch - 1) / lutgemm::kMaxBatch;
  return size_t(n * k + launches * lutgemm::max_row_tiles(int(k)));
}

// y[n, k] = x[n, d] · wᵀ (+ bias), all fp16, as launches of at most 8 columns on `stream`; a launch
// of at least mma_min_batch columns takes the tensor-core kernel when the groups allow it.
// ws: lutgemm_workspace_floats(n, k) zeroed floats, zero again on return. Without y (nullptr):
// ws[n, k] += x · wᵀ in fp32, bias ignored, counters untouched. overlap: programmatic dependent
// launches (grid_dependency.h; sm_90+ only). alpha_planes: q, or 1 for compact α [G, 1, k] (lutgemm_common.cuh),
// which keeps every launch on the LUT kernel. Returns the first launch error.
cudaError_t lutgemm_cuda_gemm(const void* x, int n, int d, const int* qweight, const void* alpha, int alpha_planes,
                              const void* offset, const void* bias, void* y, float* ws, int q, int W, int k, int G,
                              int g, int mma_min_batch, int blocks, bool overlap, int device, cudaStream_t stream) {
  using namespace lutgemm;
  static int sm_count[64] = {0};  // per device, asked once
  cudaError_t err = cudaSuccess;
  int sms = device >= 0 && device < 64 ? sm_count[device] : 0;
  if (sms == 0) {
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    if (device >= 0 && device < 64) sm_count[device] = sms;
  }
  // the op checks the α layout first
  if (!alpha_layout_ok(alpha_planes, q, n)) return cudaErrorInvalidValue;
  const bool compact = alpha_planes != q;
  const int launches = (n + kMaxBatch - 1) / kMaxBatch, n_rt = max_row_tiles(k);
  overlap = overlap && qk::overlap_supported<lut_gemm_kernel<1>>(device);  // one build: one answer for all
  int* counters = reinterpret_cast<int*>(ws + size_t(n) * k);  // zero bits are int 0
  for (int l = 0; l < launches; ++l) {
    const int nb = n - l * kMaxBatch < kMaxBatch ? n - l * kMaxBatch : kMaxBatch;
    const LutParams p = make_lut_params(static_cast<const __half*>(x) + size_t(l) * kMaxBatch * d, nb, d,
                                        reinterpret_cast<const uint32_t*>(qweight), static_cast<const __half*>(alpha),
                                        static_cast<const __half*>(offset), static_cast<const __half*>(bias),
                                        y ? static_cast<__half*>(y) + size_t(l) * kMaxBatch * k : nullptr,
                                        ws + size_t(l) * kMaxBatch * k, counters + l * n_rt, q, W, k, G, g);
    const int bp = padded_batch(nb);
    if (nb >= mma_min_batch && mma_supported(g, G) && !compact) {
      const LutParams pm = make_mma_params(p);
      const int grid = lut_grid(pm, blocks > 0 ? blocks : sms * mma_resident_blocks(pm.planes, pm.q));
      err = qk::launch_kernel(mma_kernel(pm.q), grid, kThreads, mma_smem_bytes(pm.q, pm.planes), stream, overlap, pm);
      if (err != cudaSuccess) return err;
      continue;
    }
    const bool lean = bp <= 4 && lut_lean_registers(device);
    const int grid = lut_grid(p, blocks > 0 ? blocks : sms * lut_resident_blocks(bp, lean, compact));
    err = qk::launch_kernel(lut_instance(bp, lean, compact), grid, kThreads, lut_smem_bytes(bp), stream, overlap, p);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// out[k, d] = the dense weight; out_kind 0 = fp16, 1 = bf16, 2 = fp32.
cudaError_t lutgemm_cuda_dequantize(const int* qweight, const void* alpha, const void* offset, void* out, int out_kind,
                                    int k, int d, int q, int W, int g, cudaStream_t stream) {
  using namespace lutgemm;
  DequantParams p{};
  p.qw = reinterpret_cast<const uint32_t*>(qweight);
  p.alpha = static_cast<const __half*>(alpha);
  p.offset = static_cast<const __half*>(offset);
  p.out = out;
  p.k = k, p.d = d, p.q = q, p.W = W, p.g = g;
  const dim3 grid((k + kDqRows - 1) / kDqRows, (W + kDqWords - 1) / kDqWords);
  if (out_kind == 0) dequant_kernel<__half><<<grid, kThreads, 0, stream>>>(p);
  else if (out_kind == 1) dequant_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  else dequant_kernel<float><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// ---- the PyTorch ops: argument checks (shapes, dtypes, devices) with messages that name both sides,
// then the launchers on the current stream. No allocation other than the zeroed split-K workspace
// (through the caching allocator), no synchronisation: the ops can be captured in a CUDA graph.

namespace {

const void* ptr_or_null(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// The kernels read 4 rows at a time with vector loads: tensors (views included) must start aligned.
void check_aligned(const at::Tensor& t, int bytes, const char* name) {
  QK_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0, name, " must start at a ", bytes,
              "-byte aligned address (pass a fresh contiguous tensor, not an offset view)");
}

// The stored BCQ tensors of quantkit/formats/bcq.py for a [k, d] weight; with `compact`, alpha may also be the
// compact [G, 1, k] of power-of-two planes (lutgemm_common.cuh).
void check_bcq(const at::Tensor& qweight, const at::Tensor& alpha, const std::optional<at::Tensor>& offset,
               int64_t group_size, int64_t d, bool compact = false) {
  QK_CHECK(qweight.is_cuda() && qweight.scalar_type() == at::kInt && qweight.dim() == 3 && qweight.is_contiguous(),
              "qweight must be a contiguous CUDA int32 tensor [q, W, k], got ", qweight.sizes(), " ",
              qweight.scalar_type(), " on ", qweight.device());
  const int64_t q = qweight.size(0), W = qweight.size(1), k = qweight.size(2);
  QK_CHECK(q >= 1 && q <= 8, "BCQ kernels take 1..8 planes, got q = ", q);
  QK_CHECK(group_size >= 1, "group_size must be positive, got ", group_size);
  QK_CHECK(W == (d + 31) / 32, "qweight has ", W, " words per row but in_features = ", d, " needs ", (d + 31) / 32);
  QK_CHECK(W < (1 << 15), "in_features = ", d, " is above the kernels' limit of 2^20 columns");
  QK_CHECK(k < (int64_t(1) << 30), "out_features = ", k, " is above the kernels' limit of 2^30 rows");
  const int64_t G = (d + group_size - 1) / group_size;
  const bool shape_ok = alpha.sizes() == at::IntArrayRef({G, q, k}) ||
                        (compact && alpha.sizes() == at::IntArrayRef({G, 1, k}));
  QK_CHECK(alpha.scalar_type() == at::kHalf && alpha.is_contiguous() && shape_ok,
              "alpha must be a contiguous fp16 tensor [G, q, k] = [", G, ", ", q, ", ", k, "]",
              compact ? " (or [G, 1, k]: compact power-of-two planes)" : "", ", got ", alpha.sizes(), " ",
              alpha.scalar_type());
  QK_CHECK(alpha.device() == qweight.device(), "alpha is on ", alpha.device(), " but qweight on ", qweight.device());
  if (offset.has_value()) {
    const at::Tensor& z = *offset;
    QK_CHECK(z.scalar_type() == at::kHalf && z.is_contiguous() && z.sizes() == at::IntArrayRef({G, k}),
                "offset must be a contiguous fp16 tensor [G, k] = [", G, ", ", k, "], got ", z.sizes(), " ",
                z.scalar_type());
    QK_CHECK(z.device() == qweight.device(), "offset is on ", z.device(), " but qweight on ", qweight.device());
  }
}

// The checks lut_gemm and lut_accumulate share: x and the BCQ tensors, and the LUT kernel's limits.
void check_lut_operands(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                        const std::optional<at::Tensor>& offset, int64_t group_size) {
  QK_CHECK(x.is_cuda() && x.scalar_type() == at::kHalf && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CUDA fp16 tensor [n, d], got ", x.sizes(), " ", x.scalar_type(), " on ", x.device());
  const int64_t d = x.size(1);
  check_bcq(qweight, alpha, offset, group_size, d, /*compact=*/true);
  const int64_t q = qweight.size(0), W = qweight.size(1), k = qweight.size(2), G = alpha.size(0);
  QK_CHECK(x.device() == qweight.device(), "x is on ", x.device(), " but qweight on ", qweight.device());
  QK_CHECK(lutgemm::alpha_layout_ok(int(alpha.size(1)), int(q), int(x.size(0))),
           "a compact alpha [G, 1, k] serves up to ",
           lutgemm::kCompactAlphaMaxBatch, " rows of x, got ", x.size(0), " (pass alpha [G, q, k])");
  QK_CHECK(k % 4 == 0, "the LUT kernel needs out_features % 4 == 0, got ", k, " (use dequantize)");
  QK_CHECK(q * W * k < (int64_t(1) << 31) && G * q * k < (int64_t(1) << 31),
           "the LUT kernel addresses a weight with 32-bit offsets: q x words x out_features = ", q * W * k,
           " must stay below 2^31 (use dequantize)");
  QK_CHECK(group_size % 32 == 0 || G == 1, "the LUT kernel needs group_size % 32 == 0 or one group per row, got g = ",
              group_size, " with in_features = ", d, " (use dequantize)");
  check_aligned(qweight, 16, "qweight");
  check_aligned(alpha, 8, "alpha");
  if (offset.has_value()) check_aligned(*offset, 8, "offset");
}

void check_workspace(const at::Tensor& ws, int64_t floats, const at::Tensor& x, const char* name) {
  QK_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.numel() >= floats && ws.device() == x.device(),
           name, " must be a contiguous fp32 tensor of at least ", floats, " elements on ", x.device(), ", got ",
           ws.sizes(), " ", ws.scalar_type(), " on ", ws.device());
  check_aligned(ws, 16, name);
}

void launch_lut_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                     const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                     int64_t group_size, void* out, float* ws, int64_t mma_min_batch, int64_t blocks, bool overlap) {
  const int64_t q = qweight.size(0), W = qweight.size(1), k = qweight.size(2), G = alpha.size(0);
  const cudaError_t err = lutgemm_cuda_gemm(x.data_ptr(), int(x.size(0)), int(x.size(1)), qweight.data_ptr<int>(),
                                            alpha.data_ptr(), int(alpha.size(1)), ptr_or_null(offset),
                                            ptr_or_null(bias), out, ws,
                                            int(q), int(W), int(k), int(G), int(group_size),
                                            int(std::min<int64_t>(mma_min_batch, lutgemm::kMaxBatch + 1)),
                                            int(std::clamp<int64_t>(blocks, 0, 1 << 20)), overlap, x.device().index(),
                                            c10::cuda::getCurrentCUDAStream());
  QK_CHECK(err == cudaSuccess, "lut_gemm launch failed for x [", x.size(0), ", ", x.size(1), "], weight ", k, "x",
              x.size(1), ", q = ", q, ", g = ", group_size, ", offset = ", offset.has_value(), ": ",
              cudaGetErrorString(err));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

int64_t lutgemm_workspace_floats_op(int64_t n, int64_t k) {
  QK_CHECK(n >= 0 && k >= 0, "workspace_floats needs n, k >= 0, got ", n, ", ", k);
  return int64_t(lutgemm_workspace_floats(n, k));
}

// out[n, k] = x[n, d] @ wᵀ (+ bias), fp16 in and out, written into `out`. Launches of at least
// mma_min_batch columns (of at most 8 each) run on the tensor-core kernel when group_size % 128 == 0
// or there is one group per row; kMaxBatch + 1 keeps every launch on the LUT kernel, and so does a compact
// alpha [G, 1, k] (power-of-two planes, lutgemm_common.cuh).
void lutgemm_lut_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                      const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                      int64_t group_size, const at::Tensor& out, int64_t mma_min_batch,
                      const std::optional<at::Tensor>& workspace, int64_t blocks, bool overlap) {
  check_lut_operands(x, qweight, alpha, offset, group_size);
  const int64_t n = x.size(0), k = qweight.size(2);
  QK_CHECK(out.scalar_type() == at::kHalf && out.is_contiguous() && out.sizes() == at::IntArrayRef({n, k}) &&
                  out.device() == x.device(),
              "out must be a contiguous fp16 tensor [", n, ", ", k, "] on ", x.device(), ", got ", out.sizes(), " ",
              out.scalar_type(), " on ", out.device());
  if (bias.has_value()) {
    QK_CHECK(bias->scalar_type() == at::kHalf && bias->is_contiguous() && bias->numel() == k &&
                    bias->device() == x.device(),
                "bias must be a contiguous fp16 tensor of ", k, " elements on ", x.device(), ", got ", bias->sizes(), " ",
                bias->scalar_type(), " on ", bias->device());
    check_aligned(*bias, 8, "bias");
  }
  check_aligned(out, 8, "out");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t ws_floats = int64_t(lutgemm_workspace_floats(n, k));
  at::Tensor ws;
  if (workspace.has_value()) {  // kept by the caller, all zero: the kernels leave it zero again
    ws = *workspace;
    check_workspace(ws, ws_floats, x, "workspace");
  } else {
    ws = at::zeros({ws_floats}, x.options().dtype(at::kFloat));
  }
  launch_lut_gemm(x, qweight, alpha, offset, bias, group_size, out.data_ptr(), ws.data_ptr<float>(), mma_min_batch,
                  blocks, overlap);
}

// acc[0 : n·k] (fp32, read as [n, k]) += x[n, d] @ wᵀ: the same kernels stopping at their fp32 partial sums,
// with no tile counter, read-back or fp16 output. The next kernel reads acc and clears it (runtime.fusion).
void lutgemm_lut_accumulate(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& alpha,
                            const std::optional<at::Tensor>& offset, int64_t group_size, const at::Tensor& acc,
                            int64_t mma_min_batch, int64_t blocks, bool overlap) {
  check_lut_operands(x, qweight, alpha, offset, group_size);
  check_workspace(acc, x.size(0) * qweight.size(2), x, "acc");
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  launch_lut_gemm(x, qweight, alpha, offset, std::nullopt, group_size, nullptr, acc.data_ptr<float>(), mma_min_batch,
                  blocks, overlap);
}

// out[k, d] (fp16, bf16 or fp32) = the dense weight, bit-identical to BCQQuantizedTensor.dequantize(out.dtype).
void lutgemm_dequantize(const at::Tensor& qweight, const at::Tensor& alpha, const std::optional<at::Tensor>& offset,
                        int64_t group_size, const at::Tensor& out) {
  QK_CHECK(out.dim() == 2 && out.is_contiguous(), "out must be a contiguous tensor [k, d], got ", out.sizes());
  const int64_t d = out.size(1);
  check_bcq(qweight, alpha, offset, group_size, d);
  const int64_t q = qweight.size(0), W = qweight.size(1), k = qweight.size(2);
  QK_CHECK(out.size(0) == k && out.device() == qweight.device(), "out must be [", k, ", ", d, "] on ",
              qweight.device(), ", got ", out.sizes(), " on ", out.device());
  int kind = 0;
  switch (out.scalar_type()) {
    case at::kHalf: kind = 0; break;
    case at::kBFloat16: kind = 1; break;
    case at::kFloat: kind = 2; break;
    default: QK_CHECK(false, "dequantize writes fp16, bf16 or fp32, not ", out.scalar_type());
  }
  if (k == 0 || d == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaError_t err = lutgemm_cuda_dequantize(qweight.data_ptr<int>(), alpha.data_ptr(), ptr_or_null(offset),
                                                  out.data_ptr(), kind, int(k), int(d), int(q), int(W),
                                                  int(group_size), c10::cuda::getCurrentCUDAStream());
  QK_CHECK(err == cudaSuccess, "dequantize launch failed for weight ", k, "x", d, ", q = ", q, ", g = ", group_size,
              ", out ", out.scalar_type(), ": ", cudaGetErrorString(err));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

