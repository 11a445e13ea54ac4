// CPU emulation driver of the LUT-GEMM kernels, for the CPU tests (tests/test_kernel_lutgemm.py): the
// kernel headers compiled as plain C++ (g++ -std=c++20 -DLUTGEMM_HOST_EMU -I<CUDA include>), every CUDA
// thread a std::thread, blocks one at a time (lutgemm_emu.h). It reads the operands from files, runs
// the same launch plan as lutgemm.cu (lutgemm_plan.cuh) and writes the result back.
#ifndef LUTGEMM_HOST_EMU
#define LUTGEMM_HOST_EMU
#endif

#include "lutgemm_dequant_kernel.cuh"
#include "lutgemm_plan.cuh"

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

namespace emu {
template <class Kernel>
void launch(dim3 grid, int threads, Kernel kernel) {
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> block_bar(threads);
      std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
      for (int w = 0; w < threads / 32; ++w) warp_bars.push_back(std::make_unique<std::barrier<>>(32));
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          tid = uint3{unsigned(t), 0, 0};
          bid = uint3{bx, by, 0};
          gdim = uint3{grid.x, grid.y, 1};
          bdim = uint3{unsigned(threads), 1, 1};
          bar = &block_bar;
          warp_bar = warp_bars[t / 32].get();
          kernel();
        });
      for (auto& th : ts) th.join();
    }
}

template <class T>
std::vector<T> read_file(const std::string& path, size_t count) {
  std::vector<T> v(count);
  std::ifstream f(path, std::ios::binary);
  if (!f || !f.read(reinterpret_cast<char*>(v.data()), std::streamsize(count * sizeof(T)))) {
    std::fprintf(stderr, "cannot read %zu values from %s\n", count, path.c_str());
    std::exit(2);
  }
  return v;
}

template <class T>
void write_file(const std::string& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * sizeof(T)));
}
}  // namespace emu

// usage: lutgemm_emu gemm DIR n d k q g has_offset has_bias max_blocks mma_min_batch [alpha_planes]
//        lutgemm_emu accumulate DIR n d k q g has_offset 0 max_blocks mma_min_batch [alpha_planes]
//        lutgemm_emu dequant DIR d k q g has_offset out_bytes(2 = fp16, 3 = bf16, 4 = fp32)
// DIR holds qweight.bin (int32 [q,W,k]), alpha.bin (fp16 [G,q,k], or [G,1,k] with alpha_planes 1: compact α,
// every launch on the LUT kernel, as lutgemm.cu runs it), offset.bin, x.bin (fp16 [n,d]),
// bias.bin; the result goes to DIR/y.bin (fp16 [n,k]), DIR/acc.bin (fp32 [n,k]: what accumulate adds to
// the zero workspace) or DIR/w.bin ([k,d]). Output buffers start as NaN so an element the kernel skips
// shows up.
int main(int argc, char** argv) {
  using namespace lutgemm;
  if (argc < 3) return 2;
  const std::string mode = argv[1], dir = std::string(argv[2]) + "/";
  auto arg = [&](int i) { return std::stoi(argv[i]); };
  if ((mode == "gemm" || mode == "accumulate") && (argc == 12 || argc == 13)) {
    const bool accumulate = mode == "accumulate";
    const int n = arg(3), d = arg(4), k = arg(5), q = arg(6), g = arg(7), has_off = arg(8), has_bias = arg(9),
              max_blocks = arg(10), mma_min_batch = arg(11);
    const int W = (d + 31) / 32, G = (d + g - 1) / g, alpha_planes = argc == 13 ? arg(12) : q;
    const bool compact = alpha_planes != q;  // the instance lutgemm.cu launches for it
    if (!alpha_layout_ok(alpha_planes, q, n)) {  // as lutgemm.cu refuses it
      std::fprintf(stderr, "compact alpha: one plane, up to %d columns\n", kCompactAlphaMaxBatch);
      return 2;
    }
    auto qw = emu::read_file<uint32_t>(dir + "qweight.bin", size_t(q) * W * k);
    auto al = emu::read_file<__half>(dir + "alpha.bin", size_t(G) * alpha_planes * k);
    std::vector<__half> z, bias;
    if (has_off) z = emu::read_file<__half>(dir + "offset.bin", size_t(G) * k);
    if (has_bias) bias = emu::read_file<__half>(dir + "bias.bin", size_t(k));
    auto x = emu::read_file<__half>(dir + "x.bin", size_t(n) * d);
    std::vector<__half> y(size_t(n) * k, __float2half(NAN));
    const int launches = (n + kMaxBatch - 1) / kMaxBatch, n_rt = max_row_tiles(k);
    std::vector<float> ws(size_t(n) * k + size_t(launches) * n_rt, 0.f);
    int* counters = reinterpret_cast<int*>(ws.data() + size_t(n) * k);
    for (int l = 0; l < launches; ++l) {
      const int nb = std::min(kMaxBatch, n - l * kMaxBatch);
      const LutParams p = make_lut_params(x.data() + size_t(l) * kMaxBatch * d, nb, d, qw.data(), al.data(),
                                          has_off ? z.data() : nullptr, has_bias ? bias.data() : nullptr,
                                          accumulate ? nullptr : y.data() + size_t(l) * kMaxBatch * k,
                                          ws.data() + size_t(l) * kMaxBatch * k,
                                          counters + l * n_rt, q, W, k, G, g);
      if (nb >= mma_min_batch && mma_supported(g, G) && !compact) {
        const LutParams pm = make_mma_params(p);
        const dim3 grid(lut_grid(pm, max_blocks));
        switch (q <= MMA_STATIC_Q_MAX ? q : 0) {
          case 1: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<1>(pm); }); break;
          case 2: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<2>(pm); }); break;
          case 3: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<3>(pm); }); break;
          case 4: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<4>(pm); }); break;
          default: emu::launch(grid, kThreads, [&] { bcq_mma_kernel<0>(pm); }); break;
        }
        continue;
      }
      const dim3 grid(lut_grid(p, max_blocks));
      auto run = [&](void (*kernel)(LutParams)) { emu::launch(grid, kThreads, [&] { kernel(p); }); };
      switch (padded_batch(nb)) {
        case 1: run(compact ? lut_gemm_kernel<1, LUT_MIN_BLOCKS, true> : lut_gemm_kernel<1>); break;
        case 2: run(compact ? lut_gemm_kernel<2, LUT_MIN_BLOCKS, true> : lut_gemm_kernel<2>); break;
        case 4: run(lut_gemm_kernel<4>); break;
        default: run(lut_gemm_kernel<8>); break;
      }
    }
    if (accumulate) {  // the sums stay; the counters must not have moved
      for (size_t i = size_t(n) * k; i < ws.size(); ++i)
        if (ws[i] != 0.f) {
          std::fprintf(stderr, "accumulate touched counter %zu\n", i - size_t(n) * k);
          return 3;
        }
      emu::write_file(dir + "acc.bin", std::vector<float>(ws.begin(), ws.begin() + size_t(n) * k));
      return 0;
    }
    for (size_t i = 0; i < ws.size(); ++i)
      if (ws[i] != 0.f) {  // a later launch on the same workspace would add to it
        std::fprintf(stderr, "workspace not left zero at float %zu of %zu\n", i, ws.size());
        return 3;
      }
    emu::write_file(dir + "y.bin", y);
    return 0;
  }
  if (mode == "dequant" && argc == 9) {
    const int d = arg(3), k = arg(4), q = arg(5), g = arg(6), has_off = arg(7), out_bytes = arg(8);
    const int W = (d + 31) / 32, G = (d + g - 1) / g;
    auto qw = emu::read_file<uint32_t>(dir + "qweight.bin", size_t(q) * W * k);
    auto al = emu::read_file<__half>(dir + "alpha.bin", size_t(G) * q * k);
    std::vector<__half> z;
    if (has_off) z = emu::read_file<__half>(dir + "offset.bin", size_t(G) * k);
    DequantParams p{};
    p.qw = qw.data(), p.alpha = al.data(), p.offset = has_off ? z.data() : nullptr;
    p.k = k, p.d = d, p.q = q, p.W = W, p.g = g;
    const dim3 grid((k + kDqRows - 1) / kDqRows, (W + kDqWords - 1) / kDqWords);
    const size_t elems = size_t(k) * d;
    std::vector<unsigned char> out(elems * (out_bytes == 3 ? 2 : out_bytes), 0xFF);  // NaN in every format
    p.out = out.data();
    if (out_bytes == 2) emu::launch(grid, kThreads, [&] { dequant_kernel<__half>(p); });
    else if (out_bytes == 3) emu::launch(grid, kThreads, [&] { dequant_kernel<__nv_bfloat16>(p); });
    else emu::launch(grid, kThreads, [&] { dequant_kernel<float>(p); });
    emu::write_file(dir + "w.bin", out);
    return 0;
  }
  std::fprintf(stderr, "bad arguments\n");
  return 2;
}
