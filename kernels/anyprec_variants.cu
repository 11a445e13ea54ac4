// The variants of the shared-memory-table widths (k = 4..8; flags 7 | FLAG_PAIR, with or without FLAG_OCC:
// anyprec_decode.cuh variant_rule), in their own unit so that it compiles beside anyprec.cu. Reached through
// anyprec.cu's launch_matvec, which has checked the arguments.

#include "anyprec_launch.cuh"

namespace anyprec {

template <typename T, int TILES, int FLAGS>
int launch_variant_k(int k, const MatvecArgs& a, const Launch& s) {
  switch (k) {
    case 4: return launch_instance<T, 4, TILES, FLAGS>(a, s);
    case 5: return launch_instance<T, 5, TILES, FLAGS>(a, s);
    case 6: return launch_instance<T, 6, TILES, FLAGS>(a, s);
    case 7: return launch_instance<T, 7, TILES, FLAGS>(a, s);
    case 8: return launch_instance<T, 8, TILES, FLAGS>(a, s);
    default: return kUnsupported;
  }
}

template <typename T, int TILES>
int launch_variant_flags(int k, int flags, const MatvecArgs& a, const Launch& s) {
  switch (flags) {
    case 7 | FLAG_PAIR: return launch_variant_k<T, TILES, 7 | FLAG_PAIR>(k, a, s);
    case 7 | FLAG_PAIR | FLAG_OCC: return launch_variant_k<T, TILES, 7 | FLAG_PAIR | FLAG_OCC>(k, a, s);
    default: return kUnsupported;
  }
}

// dtype: 0 = fp16, 1 = bf16; flags normalised (normalize_flags)
int launch_matvec_variant(int dtype, int k, int tiles, int flags, const MatvecArgs& a, const Launch& on) {
  if (!variant_rule(k, tiles, flags)) return kUnsupported;
  if (tiles == 1)
    return dtype == 0 ? launch_variant_flags<__half, 1>(k, flags, a, on) : launch_variant_flags<__nv_bfloat16, 1>(k, flags, a, on);
  return dtype == 0 ? launch_variant_flags<__half, 2>(k, flags, a, on) : launch_variant_flags<__nv_bfloat16, 2>(k, flags, a, on);
}

}  // namespace anyprec
