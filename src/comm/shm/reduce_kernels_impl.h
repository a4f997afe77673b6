// The body of the reduction kernels, included twice by reduce_kernels.cpp: once compiled for the
// baseline x86-64 target and once for AVX2/F16C (chosen at run time). Not a public header.
//
// Everything here lives in the namespace the includer opens. SHOAL_KERNELS_F16C says whether
// float16 may use the F16C conversion instructions.

// Combines `m` elements per block through a float (or the dtype itself) accumulator that stays in
// L1: 512 elements are 2 KiB of float, a few percent of L1, so the block's passes never leave it.
constexpr size_t kBlock = 512;

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  return f != f ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
}

template <class T>
struct Plain {
  using Elem = T;
  using Acc = T;
  static void load_block(Acc* out, const Elem* in, size_t m) {
    for (size_t i = 0; i < m; ++i) out[i] = in[i];
  }
  static void store_block(Elem* out, const Acc* in, size_t m) {
    for (size_t i = 0; i < m; ++i) out[i] = in[i];
  }
};

struct BFloat16 {
  using Elem = uint16_t;
  using Acc = float;
  static void load_block(Acc* out, const Elem* in, size_t m) {
    for (size_t i = 0; i < m; ++i) out[i] = bf16_to_float(in[i]);
  }
  static void store_block(Elem* out, const Acc* in, size_t m) {
    for (size_t i = 0; i < m; ++i) out[i] = float_to_bf16(in[i]);
  }
};

struct Float16 {
  using Elem = uint16_t;
  using Acc = float;
  static void load_block(Acc* out, const Elem* in, size_t m) {
    size_t i = 0;
#if SHOAL_KERNELS_F16C
    for (; i + 8 <= m; i += 8) {
      _mm256_storeu_ps(out + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
    }
#endif
    for (; i < m; ++i) out[i] = c10::detail::fp16_ieee_to_fp32_value(in[i]);
  }
  static void store_block(Elem* out, const Acc* in, size_t m) {
    size_t i = 0;
#if SHOAL_KERNELS_F16C
    for (; i + 8 <= m; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < m; ++i) out[i] = c10::detail::fp16_ieee_from_fp32_value(in[i]);
  }
};

struct SumOp {
  template <class A>
  static A apply(A a, A b) { return a + b; }
};
struct ProductOp {
  template <class A>
  static A apply(A a, A b) { return a * b; }
};
struct MinOp {
  template <class A>
  static A apply(A a, A b) { return b < a ? b : a; }
};
struct MaxOp {
  template <class A>
  static A apply(A a, A b) { return a < b ? b : a; }
};

template <class Traits, class Op>
void combine(const ReduceArgs& args) {
  using Elem = typename Traits::Elem;
  using Acc = typename Traits::Acc;
  auto* dst = static_cast<Elem*>(args.dst);
  auto* dst2 = static_cast<Elem*>(args.dst2);
  alignas(64) Acc acc[kBlock];
  alignas(64) Acc next[kBlock];
  for (size_t base = 0; base < args.count; base += kBlock) {
    const size_t m = std::min(kBlock, args.count - base);
    Traits::load_block(acc, static_cast<const Elem*>(args.src[0]) + base, m);
    for (int s = 1; s < args.num_src; ++s) {
      const Elem* in = static_cast<const Elem*>(args.src[s]) + base;
      if constexpr (std::is_same_v<Elem, Acc>) {
        for (size_t i = 0; i < m; ++i) acc[i] = Op::apply(acc[i], in[i]);
      } else {
        Traits::load_block(next, in, m);
        for (size_t i = 0; i < m; ++i) acc[i] = Op::apply(acc[i], next[i]);
      }
    }
    if (args.op == ReduceOp::kAvg) {
      const Acc divisor = static_cast<Acc>(args.divisor);
      for (size_t i = 0; i < m; ++i) acc[i] = acc[i] / divisor;
    }
    Traits::store_block(dst + base, acc, m);
    if (dst2 != nullptr) Traits::store_block(dst2 + base, acc, m);
  }
}

// Two float32 sources into one or two destinations, summed, or averaged by a power-of-two divisor
// (every 2-rank average: DDP's buckets), in a single streaming pass with no accumulator block. The
// average multiplies by the divisor's exact reciprocal: the division combine() does and this
// multiplication round the same real number once, so the bits are the same, and the loop
// vectorises without a division's throughput.
template <bool kAverage>
void sum2_float(const ReduceArgs& args) {
  const float* a = static_cast<const float*>(args.src[0]);
  const float* b = static_cast<const float*>(args.src[1]);
  float* dst = static_cast<float*>(args.dst);
  float* dst2 = static_cast<float*>(args.dst2);
  const float scale = 1.0f / static_cast<float>(args.divisor);
  const size_t n = args.count;
  auto value = [&](size_t i) {
    const float v = a[i] + b[i];
    return kAverage ? v * scale : v;
  };
  if (dst2 == nullptr) {
    for (size_t i = 0; i < n; ++i) dst[i] = value(i);
  } else {
    for (size_t i = 0; i < n; ++i) {
      const float v = value(i);
      dst[i] = v;
      dst2[i] = v;
    }
  }
}

template <class Traits>
void dispatch_op(const ReduceArgs& args) {
  switch (args.op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return combine<Traits, SumOp>(args);
    case ReduceOp::kProduct:
      return combine<Traits, ProductOp>(args);
    case ReduceOp::kMin:
      return combine<Traits, MinOp>(args);
    case ReduceOp::kMax:
      return combine<Traits, MaxOp>(args);
  }
}

inline void reduce(const ReduceArgs& args) {
  switch (args.dtype) {
    case at::kFloat:
      if (args.num_src == 2 && args.op == ReduceOp::kSum) return sum2_float<false>(args);
      if (args.num_src == 2 && args.op == ReduceOp::kAvg && args.divisor > 0 &&
          (args.divisor & (args.divisor - 1)) == 0) {
        return sum2_float<true>(args);
      }
      return dispatch_op<Plain<float>>(args);
    case at::kDouble:
      return dispatch_op<Plain<double>>(args);
    case at::kHalf:
      return dispatch_op<Float16>(args);
    case at::kBFloat16:
      return dispatch_op<BFloat16>(args);
    case at::kInt:
      return dispatch_op<Plain<int32_t>>(args);
    case at::kLong:
      return dispatch_op<Plain<int64_t>>(args);
    case at::kByte:
      return dispatch_op<Plain<uint8_t>>(args);
    case at::kChar:
      return dispatch_op<Plain<int8_t>>(args);
    default:
      SHOAL_THROW(InvalidArgument, "shm: dtype ", c10::toString(args.dtype),
                  " cannot be reduced");
  }
}
