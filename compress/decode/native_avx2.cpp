// Decode kernels for one to a few rows on AVX2 + FMA CPUs, where torch has no fast bf16 or int4
// product (oneDNN takes no bf16 weights without AVX-512; torch's int4 kernel is compute-bound
// there). Built on first use by compress/decode/native.py; every product accumulates in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (Cephes' expf: range reduction by ln 2, a degree-5 polynomial; ~1 ulp)
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  }
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(power));
}

// The eight lane sums of a[0..7], in one vector (the same additions for every slot of a chunk).
inline __m256 sums8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Working memory that outlives a call: one buffer per thread and per use (``Use``), grown as needed,
// so the ~150 products and attentions of a decode step do not each allocate and free their working
// vectors (malloc showed in a profile of the W4 step). Inside a parallel region it is the running
// thread's buffer: take the pointer where it is used, never through a lambda's capture from another
// thread. 64-byte aligned, so no load of it splits a cache line (the W4 products ran 4-8% slower on
// a buffer that happened to sit off a line).
template <typename T, int Use>
T* scratch(size_t n) {
  thread_local std::vector<T> buffer;
  const size_t pad = 64 / sizeof(T);
  if (buffer.size() < n + pad) buffer.resize(n + pad);
  const auto at = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<T*>((at + 63) & ~uintptr_t{63});
}

void check_rows(const at::Tensor& x, int64_t width) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "rows: a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == width, "rows of width ", x.size(1), " for a weight of width ", width);
}

// Each row's sum over each group of ``group`` values (rows x [M, K]), for the groups' offsets.
void group_sums(const float* x, int64_t M, int64_t K, int64_t group, float* sums) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < K / group; ++g) {
      float s = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += x[m * K + k];
      sums[m * (K / group) + g] = s;
    }
  }
}

// The W4 products' arguments: packed codes [N, K / 8], scale and offset [N, K / group], rows of width K.
// W4A8 takes groups of 64k only (a group may not split a block of 64 met by one activation scale).
void check_w4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offset,
              int64_t group, bool a8) {
  const int64_t K = packed.size(1) * 8, N = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && K % 64 == 0,
              "packed: contiguous int32, width a multiple of 64");
  TORCH_CHECK(((group == 32 && !a8) || group % 64 == 0) && K % group == 0, "group size ", group, " for width ", K,
              a8 ? " (W4A8: groups of 64k)" : "");
  for (const auto* t : {&scale, &offset}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == N && t->size(1) == K / group,
                "scale and offset: contiguous float32 [out, groups]");
  }
  check_rows(x, K);
}

}  // namespace

// One bf16 weight row (as int32 lanes of two weights, H = K / 2 of them) times a row split into even
// and odd values. A 32-bit lane holds two weights: the even one is its low half shifted up, the odd
// one its high half masked. ``Ahead``: also prefetch the weights 4 KB ahead, for products streamed
// from memory (the distance that did best among 1, 2 and 4 KB, and against prefetching a row's next
// 4 KB before its products).
template <bool Ahead>
inline float bf16_row(const int32_t* row, const float* even, const float* odd, int64_t H) {
  const __m256i high = _mm256_set1_epi32(0xFFFF0000);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 16 <= H; k += 16) {
    if (Ahead) _mm_prefetch(reinterpret_cast<const char*>(row + k) + 4096, _MM_HINT_T0);
    __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k + 8));
    a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b0, 16)), _mm256_loadu_ps(even + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(b0, high)), _mm256_loadu_ps(odd + k), a1);
    a2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b1, 16)), _mm256_loadu_ps(even + k + 8), a2);
    a3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(b1, high)), _mm256_loadu_ps(odd + k + 8), a3);
  }
  for (; k < H; k += 8) {
    __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b0, 16)), _mm256_loadu_ps(even + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(b0, high)), _mm256_loadu_ps(odd + k), a1);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// y = x @ w.T for bf16 w [N, K] (K % 16 == 0); x is split into even and odd values once. Each weight
// row meets every row of x while it is in L1 (read from memory once for a verify step's rows, the
// first row's pass prefetching), each product summed as a one-row call sums it: a row's output never
// depends on the others.
at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.size(1) % 16 == 0,
              "weight: a contiguous 2-D bf16 tensor, width a multiple of 16");
  check_rows(x, w.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), H = K / 2;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;  // (the first row's pass below writes row 0)
  const float* xp = x.data_ptr<float>();
  const int32_t* wp = reinterpret_cast<const int32_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  float* split = scratch<float, 0>(M * K);  // row m: its even values [H], then its odd ones [H]
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < H; ++k) {
      split[m * K + k] = xp[m * K + 2 * k];
      split[m * K + H + k] = xp[m * K + 2 * k + 1];
    }
  }
  const float* sp = split;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int32_t* row = wp + n * H;
      yp[n] = bf16_row<true>(row, sp, sp + H, H);
      for (int64_t m = 1; m < M; ++m) yp[m * N + n] = bf16_row<false>(row, sp + m * K, sp + m * K + H, H);
    }
  });
  return y;
}

// W4 with one scale and one offset per group of 32, 64, 128 or 256 weights: w = scale * u + offset,
// u in 0..15. packed [N, K / 8] int32: in each block of 64 weights, lane l of the block's eight int32
// holds weight 8 * j + l in its nibble j, so nibble j of a block is 8 weights in a row.
// y[m, n] = sum_g scale[n, g] * dot(x[m, g], u[n, g]) + offset[n, g] * sum(x[m, g]).
// Nibble j is masked in place (u * 16^j, exact in fp32) and met by x / 16^j (a power of two: exact),
// so a weight costs a mask, a conversion and an FMA; nibble 7 is shifted down (its mask would set the
// sign bit). One output: one row of weights read front to back, prefetched 4 KB ahead (as w4aq_row).
inline float w4_row(const int32_t* row, const float* srow, const float* orow, int64_t K, int64_t G, int64_t group,
                    const float* xs, const float* sums) {
  __m256i masks[7];
  for (int j = 0; j < 7; ++j) masks[j] = _mm256_set1_epi32(0xF << (4 * j));
  __m256 total = _mm256_setzero_ps();
  float extra = 0.f;
  for (int64_t g = 0; g < G; ++g) extra += orow[g] * sums[g];
#define NIBBLE(j) _mm256_cvtepi32_ps((j) == 7 ? _mm256_srli_epi32(b, 28) : _mm256_and_si256(b, masks[(j) % 7]))
  if (group == 32) {
    for (int64_t blk = 0; blk < K / 64; ++blk) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + blk * 8));
      _mm_prefetch(reinterpret_cast<const char*>(row + blk * 8) + 4096, _MM_HINT_T0);
      const float* xb = xs + blk * 64;
      __m256 a0 = _mm256_mul_ps(NIBBLE(0), _mm256_loadu_ps(xb));
      __m256 a1 = _mm256_mul_ps(NIBBLE(1), _mm256_loadu_ps(xb + 8));
      __m256 c0 = _mm256_mul_ps(NIBBLE(4), _mm256_loadu_ps(xb + 32));
      __m256 c1 = _mm256_mul_ps(NIBBLE(5), _mm256_loadu_ps(xb + 40));
      a0 = _mm256_fmadd_ps(NIBBLE(2), _mm256_loadu_ps(xb + 16), a0);
      a1 = _mm256_fmadd_ps(NIBBLE(3), _mm256_loadu_ps(xb + 24), a1);
      c0 = _mm256_fmadd_ps(NIBBLE(6), _mm256_loadu_ps(xb + 48), c0);
      c1 = _mm256_fmadd_ps(NIBBLE(7), _mm256_loadu_ps(xb + 56), c1);
      total = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(srow[2 * blk]), total);
      total = _mm256_fmadd_ps(_mm256_add_ps(c0, c1), _mm256_set1_ps(srow[2 * blk + 1]), total);
    }
  } else {
    const int64_t per = group / 64;
    for (int64_t g = 0; g < G; ++g) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t blk = g * per; blk < (g + 1) * per; ++blk) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + blk * 8));
        _mm_prefetch(reinterpret_cast<const char*>(row + blk * 8) + 4096, _MM_HINT_T0);
        const float* xb = xs + blk * 64;
        a0 = _mm256_fmadd_ps(NIBBLE(0), _mm256_loadu_ps(xb), a0);
        a1 = _mm256_fmadd_ps(NIBBLE(1), _mm256_loadu_ps(xb + 8), a1);
        a2 = _mm256_fmadd_ps(NIBBLE(2), _mm256_loadu_ps(xb + 16), a2);
        a3 = _mm256_fmadd_ps(NIBBLE(3), _mm256_loadu_ps(xb + 24), a3);
        a0 = _mm256_fmadd_ps(NIBBLE(4), _mm256_loadu_ps(xb + 32), a0);
        a1 = _mm256_fmadd_ps(NIBBLE(5), _mm256_loadu_ps(xb + 40), a1);
        a2 = _mm256_fmadd_ps(NIBBLE(6), _mm256_loadu_ps(xb + 48), a2);
        a3 = _mm256_fmadd_ps(NIBBLE(7), _mm256_loadu_ps(xb + 56), a3);
      }
      __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
      total = _mm256_fmadd_ps(sum, _mm256_set1_ps(srow[g]), total);
    }
  }
#undef NIBBLE
  return hsum(total) + extra;
}

// The products of w4_row for rows x; each row's group sums and x / 16^j are prepared once, before
// the outputs are split between the threads (every thread had prepared them, with a scalar ldexp
// per value: the products took 10-15% longer).
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& offset, int64_t group) {
  check_w4(x, packed, scale, offset, group, false);
  const int64_t K = packed.size(1) * 8, N = packed.size(0), G = K / group;
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int32_t* wp = packed.data_ptr<int32_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float *sums = scratch<float, 1>(M * G), *scaled = scratch<float, 2>(M * K);
  __m256 power[8];  // 16^-j, exact
  for (int j = 0; j < 8; ++j) power[j] = _mm256_set1_ps(j == 7 ? 1.f : std::ldexp(1.f, -4 * j));
  group_sums(xp, M, K, group, sums);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    for (int64_t k = 0; k < K; k += 8) {
      _mm256_storeu_ps(scaled + m * K + k, _mm256_mul_ps(_mm256_loadu_ps(xr + k), power[(k % 64) / 8]));
    }
  }
  const float *xs = scaled, *gs = sums;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {  // a weight row meets every row (as bf16_matmul)
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; ++m)
        yp[m * N + n] = w4_row(wp + n * (K / 8), sp + n * G, op + n * G, K, G, group, xs + m * K, gs + m * G);
    }
  });
  return y;
}

// The 64 products of a block's 4-bit codes (lo: the low nibbles, hi: the high ones) and int8 values
// (xl, xh: those the low and high nibbles meet), summed exactly in int32 per lane: VNNI's vpdpbusd
// where the CPU has it, else AVX2's maddubs (pairs of 15 * 128 sum to at most 3840 per int16 lane:
// no saturation).
inline __m256i block_dot(__m256i lo, __m256i hi, __m256i xl, __m256i xh) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The lane sums of a[0..7] in one vector, exact in int32.
inline __m256i int_sums8(const __m256i* a) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// The exact int32 products of blocks b0 .. b0 + 7 (``product(b)``: a block's int32 lanes), one block a lane.
template <typename Product>
inline __m256i eight_block_sums(int64_t b0, const Product& product) {
  __m256i d[8];
  for (int j = 0; j < 8; ++j) d[j] = product(b0 + j);
  return int_sums8(d);
}

// The sum of the eight int32 lanes (exact).
inline int32_t lane_sum(__m256i d) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The int32 lanes of one block's product (``codes``: its 8 int32; ``v``: its low-nibble values, the
// high-nibble ones K / 2 later, for Wide the fine parts K and 3K / 2 later).
template <bool Wide>
inline __m256i block_product(const int32_t* codes, const int8_t* v, int64_t K) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256i lo = _mm256_and_si256(b, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
  __m256i dot = block_dot(lo, hi, load32(v), load32(v + K / 2));
  if (Wide) dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), block_dot(lo, hi, load32(v + K), load32(v + 3 * K / 2)));
  return dot;
}

// Output n of int4_matmul_a8 / _a16: one row's weights read front to back, the line 4 KB ahead
// prefetched. Eight blocks at a time: each block's lanes summed exactly in int32, then the eight
// sums scaled and added as one vector, the offset terms too. Each block had its own scalar scale
// broadcast into an FMA, its lanes converted apart, the offsets summed in a scalar loop: that was
// markedly slower (512-bit products over two blocks: no faster). Rows taken four at a time (one
// load of the int8 values per block for four rows) ran slower from memory: four interleaved
// streams defeat the hardware prefetcher, which a single front-to-back stream keeps busy. ``values``: the row's int8 values met by the low nibbles [K / 2], then by the high ones
// [K / 2]; Wide: then the fine parts, the same way (a value is 256 * coarse + fine).
template <bool Wide>
inline float w4aq_row(const int32_t* row, const float* srow, const float* orow, int64_t K, int64_t G, int64_t per,
                      const int8_t* values, const float* block_scale, const float* sums) {
  const int64_t B = K / 64;
  const auto product = [&](int64_t b) {
    _mm_prefetch(reinterpret_cast<const char*>(row + b * 8) + 4096, _MM_HINT_T0);
    return block_product<Wide>(row + b * 8, values + b * 32, K);
  };
  __m256 total = _mm256_setzero_ps();
  int64_t b0 = 0;
  for (; b0 + 8 <= B; b0 += 8) {
    const __m256i products = eight_block_sums(b0, product);
    // the blocks' weight scales: one per block, or one per group of ``per`` blocks
    const __m256 weight_scale =
        per == 1 ? _mm256_loadu_ps(srow + b0)
                 : _mm256_setr_ps(srow[b0 / per], srow[(b0 + 1) / per], srow[(b0 + 2) / per], srow[(b0 + 3) / per],
                                  srow[(b0 + 4) / per], srow[(b0 + 5) / per], srow[(b0 + 6) / per],
                                  srow[(b0 + 7) / per]);
    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(block_scale + b0), weight_scale);
    total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), scale, total);
    if (per == 1) total = _mm256_fmadd_ps(_mm256_loadu_ps(orow + b0), _mm256_loadu_ps(sums + b0), total);
  }
  float extra = 0.f;
  for (int64_t b = b0; b < B; ++b) {  // the last 1-7 blocks, one at a time
    extra += static_cast<float>(lane_sum(product(b))) * (block_scale[b] * srow[b / per]);
  }
  // the offset terms not added above (all of them for groups of 128 or more)
  for (int64_t g = per == 1 ? b0 : 0; g < G; ++g) extra += orow[g] * sums[g];
  return hsum(total) + extra;
}

// The bytes of q[0..7] (int32 lanes, q[j] lane l: value 8 j + l of a block) in int4_matmul's order:
// byte 4 l + c of a block holds weight 16 c + l in its low nibble and 16 c + 8 + l in its high one,
// so the values the low nibbles meet are q[2 c] lane l, those the high ones meet q[2 c + 1] lane l.
inline void store_block_bytes(const __m256i* q, int8_t* low, int8_t* high) {
  const __m256i byte = _mm256_set1_epi32(0xFF);
  for (int half = 0; half < 2; ++half) {
    const __m256i bytes = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(q[half], byte), _mm256_slli_epi32(_mm256_and_si256(q[2 + half], byte), 8)),
        _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(q[4 + half], byte), 16), _mm256_slli_epi32(q[6 + half], 24)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(half ? high : low), bytes);
  }
}

// int4_matmul's weights times rows rounded per block of 64 values, the block's products summed
// exactly in int32 (block_dot), so a weight costs a fraction of int4_matmul's float work and the
// product streams the weights near the memory's rate. The offset term uses the unrounded row.
// W4A8 (Wide false, as llama.cpp's Q4 x Q8 products): a block's scale is max|x| / 127; lossy, about
// 1% of a product's size. W4A16 (Wide true): max|x| / 32639, each value split into int8 parts
// 256 * coarse + fine (coarse = (v + 128) >> 8 stays within int8 below 32640), two integer products
// a block: a value's error is at most 2^-16 of its block's largest, below bf16's rounding of it
// (2^-9 of itself) for every value above 1/128 of the block's largest.
template <bool Wide>
at::Tensor int4_matmul_aq(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor& offset, int64_t group) {
  check_w4(x, packed, scale, offset, group, true);
  const int64_t K = packed.size(1) * 8, N = packed.size(0), G = K / group, B = K / 64, per = group / 64;
  const int64_t M = x.size(0);
  const float limit = Wide ? 32639.f : 127.f;
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int32_t* wp = packed.data_ptr<int32_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t V = Wide ? 2 * K : K;  // a row's int8 values
  int8_t* all_values = scratch<int8_t, 3>(M * V);
  float *all_block_scales = scratch<float, 4>(M * B), *all_sums = scratch<float, 5>(M * G);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    int8_t* values = all_values + m * V;
    float *block_scale = all_block_scales + m * B, *sums = all_sums + m * G;
    for (int64_t g = 0; g < G; ++g) sums[g] = 0.f;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t blk = 0; blk < B; ++blk) {
      __m256 v[8], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
      for (int j = 0; j < 8; ++j) {  // v[j] lane l: value 8 j + l of the block
        v[j] = _mm256_loadu_ps(xr + blk * 64 + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], magnitude));
        sum = _mm256_add_ps(sum, v[j]);
      }
      __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      a = _mm_max_ps(a, _mm_movehl_ps(a, a));
      const float top = _mm_cvtss_f32(_mm_max_ss(a, _mm_shuffle_ps(a, a, 1)));
      block_scale[blk] = top / limit;
      const __m256 inv = _mm256_set1_ps(top > 0.f ? limit / top : 0.f);
      __m256i q[8];  // rounded to nearest, ties to even (the default rounding mode)
      for (int j = 0; j < 8; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      if (Wide) {
        __m256i fine[8];
        for (int j = 0; j < 8; ++j) {
          const __m256i coarse = _mm256_srai_epi32(_mm256_add_epi32(q[j], _mm256_set1_epi32(128)), 8);
          fine[j] = _mm256_sub_epi32(q[j], _mm256_slli_epi32(coarse, 8));
          q[j] = coarse;
        }
        store_block_bytes(fine, values + K + blk * 32, values + 3 * K / 2 + blk * 32);
      }
      store_block_bytes(q, values + blk * 32, values + K / 2 + blk * 32);
      sums[blk / per] += hsum(sum);
    }
  }
  const int8_t* vp = all_values;
  const float *bp = all_block_scales, *gp = all_sums;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {  // a weight row meets every row (as bf16_matmul)
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; ++m)
        yp[m * N + n] = w4aq_row<Wide>(wp + n * (K / 8), sp + n * G, op + n * G, K, G, per, vp + m * V, bp + m * B,
                                       gp + m * G);
    }
  });
  return y;
}

// The int32 lanes of one block's product: 64 int8 codes (q, |q| <= 127) times 64 int8 values in the
// same order. VNNI multiplies unsigned bytes by signed ones, so it takes q + 128 (q xor 0x80) and the
// caller subtracts 128 times the values' sum; AVX2's maddubs takes the values' magnitudes times q with
// their signs (a value of -128 has magnitude 128 as an unsigned byte; pairs of 128 * 127 sum to at most
// 32512 per int16 lane: no saturation, but two such lanes would overflow, so each widens to int32 alone).
inline __m256i int8_block_dot(__m256i w0, __m256i w1, const int8_t* v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_xor_si256(w0, flip), load32(v)),
                             _mm256_xor_si256(w1, flip), load32(v + 32));
#elif defined(__AVXVNNI__)
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  return _mm256_dpbusd_avx_epi32(
      _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_xor_si256(w0, flip), load32(v)),
      _mm256_xor_si256(w1, flip), load32(v + 32));
#else
  const __m256i v0 = load32(v), v1 = load32(v + 32), ones = _mm256_set1_epi16(1);
  const __m256i pairs0 = _mm256_maddubs_epi16(_mm256_abs_epi8(v0), _mm256_sign_epi8(w0, v0));
  const __m256i pairs1 = _mm256_maddubs_epi16(_mm256_abs_epi8(v1), _mm256_sign_epi8(w1, v1));
  return _mm256_add_epi32(_mm256_madd_epi16(pairs0, ones), _mm256_madd_epi16(pairs1, ones));  // no int16 sum
#endif
}

// Whether int8_block_dot's lanes sum to the product plus 128 times the values' sum (VNNI's form).
constexpr bool kUnsignedDot =
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    true;
#else
    false;
#endif

// The int32 lanes of one block's product: its 64 codes at ``w`` times the coarse parts at ``v`` and the
// fine parts K later (a value is 256 * coarse + fine).
inline __m256i int8_block_product(const int8_t* w, const int8_t* v, int64_t K) {
  const __m256i w0 = load32(w), w1 = load32(w + 32);
  return _mm256_add_epi32(_mm256_slli_epi32(int8_block_dot(w0, w1, v), 8), int8_block_dot(w0, w1, v + K));
}

// A row of int8 codes times a row rounded to 16 bits per block of 64 (``values``: [K] coarse parts,
// then the fine ones), scaled: sum over blocks of the block's
// scale times its exact integer product. ``shift``: per block, what int8_block_dot's lanes add to it.
inline float int8_row(const int8_t* row, const int8_t* values, const float* block_scale, const int32_t* shift,
                      int64_t K) {
  const int64_t B = K / 64;
  const auto product = [&](int64_t b) {
    _mm_prefetch(reinterpret_cast<const char*>(row + b * 64) + 4096, _MM_HINT_T0);
    return int8_block_product(row + b * 64, values + b * 64, K);
  };
  __m256 total = _mm256_setzero_ps();
  int64_t b0 = 0;
  for (; b0 + 8 <= B; b0 += 8) {
    const __m256i exact = _mm256_sub_epi32(eight_block_sums(b0, product),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(shift + b0)));
    total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_loadu_ps(block_scale + b0), total);
  }
  float extra = 0.f;
  for (int64_t b = b0; b < B; ++b) {  // the last 1-7 blocks, one at a time
    extra += static_cast<float>(lane_sum(product(b)) - shift[b]) * block_scale[b];
  }
  return hsum(total) + extra;
}

// Logits whose largest is exactly the bf16 weight's, for about half of its reads (for greedy decoding's
// lm_head). ``codes`` [N, K] int8 with one ``scale`` per row (|q| <= 127) score every row; ``error``[n]
// is the largest |w - scale * q| of row n, so a score is within
//   bound[n] = (error[n] + 2e-3 scale[n]) |x|_1 + 4300 scale[n] sum_b block_scale[b]
// of the exact product: the weights' rounding, the row's rounding to 16 bits per block (each value
// within 0.508 of its block's step, times |q| <= 127, 64 to a block; 4300 > 127 * 64 * 0.508), and a
// margin far above the float rounding of both this score and bf16_row's sum. A row whose score plus
// its bound stays below the largest score minus its bound cannot hold the largest exact product; the
// others (about 5 on average on SmolLM2 and Gemma-3, at most 33 of 49152 and 101 of 262144 in 192 steps:
// scripts/check_argmax_head.py) are recomputed
// from the bf16 weights as bf16_matmul computes them, so the largest logit, its position and its value
// equal bf16_matmul's. The other logits keep their int8 scores.
at::Tensor int8_argmax_logits(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& error, const at::Tensor& weight) {
  const int64_t N = codes.size(0), K = codes.size(1), B = K / 64, H = K / 2;
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous() && K % 64 == 0,
              "codes: a contiguous 2-D int8 tensor, width a multiple of 64");
  for (const auto* t : {&scale, &error}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 1 && t->size(0) == N,
                "scale and error: contiguous float32 [out]");
  }
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.size(0) == N &&
                  weight.size(1) == K, "weight: the contiguous bf16 [out, in] the codes round");
  check_rows(x, K);
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  int8_t* all_values = scratch<int8_t, 9>(M * 2 * K);
  float *all_block_scales = scratch<float, 10>(M * B), *split = scratch<float, 11>(M * K);
  int32_t* all_shifts = scratch<int32_t, 12>(M * B);
  std::vector<float> l1(M), act(M);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    int8_t* values = all_values + m * 2 * K;
    float total_scale = 0.f, norm = 0.f;
    for (int64_t b = 0; b < B; ++b) {
      float top = 0.f;
      for (int64_t k = b * 64; k < (b + 1) * 64; ++k) {
        top = std::max(top, std::fabs(xr[k]));
        norm += std::fabs(xr[k]);
      }
      const float inv = top > 0.f ? 32639.f / top : 0.f;
      int32_t sum = 0;
      for (int64_t k = b * 64; k < (b + 1) * 64; ++k) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(xr[k] * inv)), coarse = (q + 128) >> 8;
        values[k] = static_cast<int8_t>(coarse);
        values[K + k] = static_cast<int8_t>(q - 256 * coarse);
        sum += q;
      }
      all_block_scales[m * B + b] = top / 32639.f;
      all_shifts[m * B + b] = kUnsignedDot ? 128 * sum : 0;
      total_scale += top / 32639.f;
    }
    l1[m] = norm;
    act[m] = 4300.f * total_scale;
    for (int64_t k = 0; k < H; ++k) {  // as bf16_matmul splits a row
      split[m * K + k] = xr[2 * k];
      split[m * K + H + k] = xr[2 * k + 1];
    }
  }
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *ep = error.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto bound = [&](int64_t n, int64_t m) { return (ep[n] + 2e-3f * sp[n]) * l1[m] + sp[n] * act[m]; };
  const int8_t* vp = all_values;
  const float* bp = all_block_scales;
  const int32_t* hp = all_shifts;
  // fixed chunks of rows, each with its own largest score less bound per input row: the same for
  // any number of threads
  constexpr int64_t chunk = 512;
  const int64_t C = (N + chunk - 1) / chunk;
  std::vector<float> lower(C * M, -INFINITY);
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t n = c * chunk; n < std::min(N, (c + 1) * chunk); ++n) {
        for (int64_t m = 0; m < M; ++m) {
          const float score = sp[n] * int8_row(cp + n * K, vp + m * 2 * K, bp + m * B, hp + m * B, K);
          yp[m * N + n] = score;
          lower[c * M + m] = std::max(lower[c * M + m], score - bound(n, m));
        }
      }
    }
  });
  std::vector<float> threshold(M, -INFINITY);  // the largest score less its bound: no exact product is above it
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t m = 0; m < M; ++m) threshold[m] = std::max(threshold[m], lower[c * M + m]);
  }
  const int32_t* wp = reinterpret_cast<const int32_t*>(weight.data_ptr<at::BFloat16>());
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {  // the rows that may hold the largest
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = begin * chunk; n < std::min(N, end * chunk); ++n) {
        if (yp[m * N + n] + bound(n, m) >= threshold[m])
          yp[m * N + n] = bf16_row<false>(wp + n * H, split + m * K, split + m * K + H, H);
      }
    }
  });
  return y;
}

// Eight fp32 values rounded to bf16 (to nearest, ties to even, as torch rounds; no NaN comes here).
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i tie = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), tie)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
}

// The weights of int4_matmul's layout [N, K], for products over many rows (prompts): float32, or
// bf16 (``bf16``: the fp32 values rounded, for a bf16 GEMM, without writing and reading them in fp32).
at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offset,
                           int64_t group, bool bf16) {
  const int64_t N = packed.size(0), K = packed.size(1) * 8, G = K / group;
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && scale.is_contiguous() &&
              offset.is_contiguous() && scale.size(1) == G, "packed int32, scale and offset [out, groups]");
  auto w = at::empty({N, K}, scale.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const int32_t* wp = packed.data_ptr<int32_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  float* out = bf16 ? nullptr : w.data_ptr<float>();
  at::BFloat16* out16 = bf16 ? w.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t blk = 0; blk < K / 64; ++blk) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + n * (K / 8) + blk * 8));
        for (int j = 0; j < 8; ++j) {
          const int64_t k = blk * 64 + 8 * j, g = n * G + k / group;
          const __m256 u = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 4 * j), low));
          const __m256 value = _mm256_fmadd_ps(u, _mm256_set1_ps(sp[g]), _mm256_set1_ps(op[g]));
          if (bf16) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out16 + n * K + k), to_bf16(value));
          } else {
            _mm256_storeu_ps(out + n * K + k, value);
          }
        }
      }
    }
  });
  return w;
}

// Integers of up to 8 bits (int8 codes c [N, K]) with one scale and one offset per group of 16k
// weights: w = scale * c + offset, the layout every GGUF block type unpacks to (Q5_0, Q6_K, Q8_0,
// the k-quants) and our W3/W8 groups. As w4_row: y[m, n] = sum_g scale[n, g] * dot(x[m, g],
// c[n, g]) + offset[n, g] * sum(x[m, g]); a weight costs a sign extension, a conversion and an FMA,
// one byte read. Two running totals, so that a group's scaling does not wait for the last one.
inline float i8_row(const int8_t* row, const float* srow, const float* orow, int64_t G, int64_t group,
                    const float* xr, const float* sums) {
  __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  float extra = 0.f;
  for (int64_t g = 0; g < G; ++g) extra += orow[g] * sums[g];
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* c = row + g * group;
    const float* xg = xr + g * group;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t k = 0; k < group; k += 16) {
      if ((reinterpret_cast<uintptr_t>(c + k) & 63) < 16) _mm_prefetch(reinterpret_cast<const char*>(c + k) + 4096, _MM_HINT_T0);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k));
      a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_loadu_ps(xg + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), _mm256_loadu_ps(xg + k + 8), a1);
    }
    total[g & 1] = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(srow[g]), total[g & 1]);
  }
  return hsum(_mm256_add_ps(total[0], total[1])) + extra;
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& offset, int64_t group) {
  const int64_t N = codes.size(0), K = codes.size(1), G = K / std::max<int64_t>(group, 1);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(), "codes: contiguous int8");
  TORCH_CHECK(group > 0 && group % 16 == 0 && K % group == 0, "group size ", group, " for width ", K,
              " (groups of 16k weights)");
  for (const auto* t : {&scale, &offset}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == N && t->size(1) == G,
                "scale and offset: contiguous float32 [out, groups]");
  }
  check_rows(x, K);
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* sums = scratch<float, 1>(M * G);
  group_sums(xp, M, K, group, sums);
  const float* gs = sums;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {  // a weight row meets every row (as bf16_matmul)
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; ++m)
        yp[m * N + n] = i8_row(cp + n * K, sp + n * G, op + n * G, G, group, xp + m * K, gs + m * G);
    }
  });
  return y;
}

// Eight cache values as fp32: a bf16 value is the top half of its fp32 (a shift, exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// Attention of query rows over a KV cache: row m of q [H, M, D] attends to slots
// [max(0, positions[m] - window + 1), positions[m]] of k and v [H / groups, slots, D] (window 0: from
// slot 0). The work is split by KV head and chunk of 64 slots (split-K, as flash-decoding does): each
// chunk's keys and values are read once for the query heads that share them, both cores get work
// whatever the head count, and the chunks' partial softmaxes are merged at the end. Chunks are fixed
// slot ranges and every row is computed alone, so a verify step's rows equal one-token steps exactly.
// Keys and values are float32 or bf16 (an int4-a8 engine's cache), read as float32.
template <typename T>
void decode_attention_body(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                           int64_t window, double scaling, at::Tensor& out) {
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(D % 8 == 0 && H % Hkv == 0 && k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 &&
              v.stride(1) == D && v.size(1) == S, "attention: head size a multiple of 8, rows of k and v contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == M, "attention: one position per row");
  auto qc = q.contiguous();
  auto pc = positions.contiguous();
  const float* qp = qc.data_ptr<float>();
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  int64_t earliest = S, latest = 0;  // the slots any row attends to
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(0 <= pp[m] && pp[m] < S, "attention: position ", pp[m], " outside the cache");
    earliest = std::min(earliest, window > 0 ? std::max<int64_t>(0, pp[m] - window + 1) : 0);
    latest = std::max(latest, pp[m]);
  }
  constexpr int64_t chunk = 64;
  const int64_t C = (S + chunk - 1) / chunk, groups = H / Hkv;
  // the work is split over the chunks that hold attended slots only: a sliding-window layer (Gemma-3's
  // 512 slots) attends to the last chunks of a longer span, and a split over all of them gave one
  // core most of the work
  const int64_t c0 = earliest / chunk, used = latest / chunk + 1 - c0;
  const float scale = static_cast<float>(scaling);
  // per (head, row, chunk): the largest score, the sum of exp(score - largest), the unnormalised output
  float *top = scratch<float, 6>(H * M * C), *mass = scratch<float, 7>(H * M * C);
  float* partial = scratch<float, 8>(H * M * C * D);
  std::fill(top, top + H * M * C, -INFINITY);
  std::fill(mass, mass + H * M * C, 0.f);
  at::parallel_for(0, Hkv * used, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float p[chunk];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t hk = item / used, c = c0 + item % used;
      const T* kh = kp + hk * k.stride(0);
      const T* vh = vp + hk * v.stride(0);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t last = pp[m], first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
        const int64_t lo = std::max(first, c * chunk), hi = std::min(last + 1, (c + 1) * chunk);
        if (lo >= hi) continue;
        for (int64_t h = hk * groups; h < (hk + 1) * groups; ++h) {
          const float* qr = qp + (h * M + m) * D;
          // scores, eight slots at a time, their eight sums interleaved (one slot's sum alone waits on
          // each FMA's latency: 3x slower); past ``hi`` the last slot again, its copies never used
          const int64_t n = hi - lo;
          for (int64_t s0 = 0; s0 < n; s0 += 8) {
            const T* kr[8];
            __m256 a[8];
            for (int j = 0; j < 8; ++j) {
              kr[j] = kh + (lo + std::min<int64_t>(s0 + j, n - 1)) * D;
              a[j] = _mm256_setzero_ps();
            }
            for (int64_t d = 0; d < D; d += 8) {
              const __m256 qd = _mm256_loadu_ps(qr + d);
              for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qd, load8(kr[j] + d), a[j]);
            }
            _mm256_storeu_ps(p + s0, _mm256_mul_ps(sums8(a), _mm256_set1_ps(scale)));
          }
          float best = -INFINITY;
          for (int64_t s = 0; s < n; ++s) best = std::max(best, p[s]);
          float total = 0.f;
          for (int64_t s0 = 0; s0 < n; s0 += 8) {
            const __m256 shifted = _mm256_sub_ps(_mm256_loadu_ps(p + s0), _mm256_set1_ps(best));
            _mm256_storeu_ps(p + s0, exp_nonpositive(shifted));
          }
          for (int64_t s = 0; s < n; ++s) total += p[s];
          const int64_t at = (h * M + m) * C + c;
          float* o = partial + at * D;
          for (int64_t d0 = 0; d0 < D; d0 += 64) {  // one pass over the values per 64 dims, in registers
            const int width = static_cast<int>(std::min<int64_t>(64, D - d0)) / 8;
            __m256 acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
            for (int64_t s = 0; s < n; ++s) {
              const __m256 w = _mm256_set1_ps(p[s]);
              const T* vr = vh + (lo + s) * D + d0;
              if (width == 8) {
                for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(w, load8(vr + 8 * j), acc[j]);
              } else {
                for (int j = 0; j < width; ++j) acc[j] = _mm256_fmadd_ps(w, load8(vr + 8 * j), acc[j]);
              }
            }
            for (int j = 0; j < width; ++j) _mm256_storeu_ps(o + d0 + 8 * j, acc[j]);
          }
          top[at] = best;
          mass[at] = total;
        }
      }
    }
  });
  float* op = out.data_ptr<float>();
  for (int64_t hm = 0; hm < H * M; ++hm) {  // merge the chunks: rescale each to the row's largest score
    float best = -INFINITY, total = 0.f;
    for (int64_t c = 0; c < C; ++c) {
      if (mass[hm * C + c] > 0.f) best = std::max(best, top[hm * C + c]);
    }
    float* o = op + hm * D;
    std::fill(o, o + D, 0.f);
    for (int64_t c = 0; c < C; ++c) {
      if (mass[hm * C + c] == 0.f) continue;
      const float f = std::exp(top[hm * C + c] - best);
      total += f * mass[hm * C + c];
      const float* part = partial + (hm * C + c) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += f * part[d];
    }
    for (int64_t d = 0; d < D; ++d) o[d] /= total;
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                            int64_t window, double scaling) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "attention: float32 queries, float32 or bf16 keys and values");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (k.scalar_type() == at::kBFloat16) {
    decode_attention_body<at::BFloat16>(q, k, v, positions, window, scaling, out);
  } else {
    decode_attention_body<float>(q, k, v, positions, window, scaling, out);
  }
  return out;
}

TORCH_LIBRARY(compress, m) {
  m.def("bf16_matmul(Tensor x, Tensor w) -> Tensor");
  m.def("int4_matmul(Tensor x, Tensor packed, Tensor scale, Tensor offset, int group) -> Tensor");
  m.def("int4_matmul_a8(Tensor x, Tensor packed, Tensor scale, Tensor offset, int group) -> Tensor");
  m.def("int4_matmul_a16(Tensor x, Tensor packed, Tensor scale, Tensor offset, int group) -> Tensor");
  m.def("int8_matmul(Tensor x, Tensor codes, Tensor scale, Tensor offset, int group) -> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor scale, Tensor offset, int group, bool bf16=False) -> Tensor");
  m.def("int8_argmax_logits(Tensor x, Tensor codes, Tensor scale, Tensor error, Tensor weight) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor positions, int window, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("bf16_matmul", &bf16_matmul);
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int4_matmul_a8", &int4_matmul_aq<false>);
  m.impl("int4_matmul_a16", &int4_matmul_aq<true>);
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_argmax_logits", &int8_argmax_logits);
  m.impl("decode_attention", &decode_attention);
}
