// Decode kernels for one to a few rows on AVX2 + FMA CPUs, where torch has no fast bf16 or int4
// product (oneDNN takes no bf16 weights without AVX-512; torch's int4 kernel is compute-bound
// there). Built on first use by compress/decode/native.py; every product accumulates in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

void check_rows(const at::Tensor& x, int64_t width) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "rows: a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == width, "rows of width ", x.size(1), " for a weight of width ", width);
}

}  // namespace

// y = x @ w.T for bf16 w [N, K] (K % 16 == 0). A 32-bit lane holds two weights: the even one is
// its low half shifted up, the odd one its high half masked, so x is split into even and odd once.
at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.size(1) % 16 == 0,
              "weight: a contiguous 2-D bf16 tensor, width a multiple of 16");
  check_rows(x, w.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), H = K / 2;
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int32_t* wp = reinterpret_cast<const int32_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    const __m256i high = _mm256_set1_epi32(0xFFFF0000);
    std::vector<float> split(2 * H);
    float *even = split.data(), *odd = even + H;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < H; ++k) {
        even[k] = xp[m * K + 2 * k];
        odd[k] = xp[m * K + 2 * k + 1];
      }
      for (int64_t n = begin; n < end; ++n) {
        const int32_t* row = wp + n * H;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t k = 0;
        for (; k + 16 <= H; k += 16) {
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
        yp[m * N + n] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      }
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
// sign bit).
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& offset, int64_t group) {
  const int64_t K = packed.size(1) * 8, N = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && K % 64 == 0,
              "packed: contiguous int32, width a multiple of 64");
  TORCH_CHECK((group == 32 || group % 64 == 0) && K % group == 0, "group size ", group, " for width ", K);
  const int64_t G = K / group;
  for (const auto* t : {&scale, &offset}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == N && t->size(1) == G,
                "scale and offset: contiguous float32 [out, groups]");
  }
  check_rows(x, K);
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int32_t* wp = packed.data_ptr<int32_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    __m256i masks[7];
    for (int j = 0; j < 7; ++j) masks[j] = _mm256_set1_epi32(0xF << (4 * j));
    std::vector<float> sums(G), scaled(K);
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = xp + m * K;
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) s += xr[k];
        sums[g] = s;
      }
      for (int64_t k = 0; k < K; ++k) {
        const int j = (k % 64) / 8;
        scaled[k] = j == 7 ? xr[k] : std::ldexp(xr[k], -4 * j);
      }
      const float* xs = scaled.data();
      for (int64_t n = begin; n < end; ++n) {
        const int32_t* row = wp + n * (K / 8);
        const float *srow = sp + n * G, *orow = op + n * G;
        __m256 total = _mm256_setzero_ps();
        float extra = 0.f;
        for (int64_t g = 0; g < G; ++g) extra += orow[g] * sums[g];
#define NIBBLE(j) _mm256_cvtepi32_ps((j) == 7 ? _mm256_srli_epi32(b, 28) : _mm256_and_si256(b, masks[(j) % 7]))
        if (group == 32) {
          for (int64_t blk = 0; blk < K / 64; ++blk) {
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + blk * 8));
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
        yp[m * N + n] = hsum(total) + extra;
      }
    }
  });
  return y;
}

// The float32 weights of int4_matmul's layout [N, K], for products over many rows (prompts).
at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offset,
                           int64_t group) {
  const int64_t N = packed.size(0), K = packed.size(1) * 8, G = K / group;
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && scale.is_contiguous() &&
              offset.is_contiguous() && scale.size(1) == G, "packed int32, scale and offset [out, groups]");
  auto w = at::empty({N, K}, scale.options());
  const int32_t* wp = packed.data_ptr<int32_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  float* out = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t blk = 0; blk < K / 64; ++blk) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + n * (K / 8) + blk * 8));
        for (int j = 0; j < 8; ++j) {
          const int64_t k = blk * 64 + 8 * j, g = n * G + k / group;
          const __m256 u = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 4 * j), low));
          _mm256_storeu_ps(out + n * K + k, _mm256_fmadd_ps(u, _mm256_set1_ps(sp[g]), _mm256_set1_ps(op[g])));
        }
      }
    }
  });
  return w;
}

// Attention of query rows over a KV cache: row m of q [H, M, D] attends to slots
// [max(0, positions[m] - window + 1), positions[m]] of k and v [H / groups, slots, D] (window 0: from
// slot 0). Every row is computed alone, so a verify step's rows equal one-token steps exactly.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& positions, int64_t window, double scaling) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attention: float32 queries, keys and values");
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(D % 8 == 0 && H % Hkv == 0 && k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 &&
              v.stride(1) == D && v.size(1) == S, "attention: head size a multiple of 8, rows of k and v contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == M, "attention: one position per row");
  auto qc = q.contiguous();
  auto pc = positions.contiguous();
  auto out = at::empty({H, M, D}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(0 <= pp[m] && pp[m] < S, "attention: position ", pp[m], " outside the cache");
  }
  float* op = out.data_ptr<float>();
  const int64_t groups = H / Hkv;
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, H * M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(S);
    for (int64_t hm = begin; hm < end; ++hm) {
      const int64_t h = hm / M, last = pp[hm % M];
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      const float* qr = qp + hm * D;
      const float* kh = kp + (h / groups) * k.stride(0);
      const float* vh = vp + (h / groups) * v.stride(0);
      float best = -INFINITY;
      for (int64_t s = first; s <= last; ++s) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(kh + s * D + d), a);
        }
        p[s] = hsum(a) * scale;
        best = std::max(best, p[s]);
      }
      float total = 0.f;
      for (int64_t s = first; s <= last; ++s) {
        p[s] = std::exp(p[s] - best);
        total += p[s];
      }
      float* o = op + hm * D;
      for (int64_t d = 0; d < D; d += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t s = first; s <= last; ++s) {
          a = _mm256_fmadd_ps(_mm256_set1_ps(p[s]), _mm256_loadu_ps(vh + s * D + d), a);
        }
        _mm256_storeu_ps(o + d, _mm256_mul_ps(a, _mm256_set1_ps(1.f / total)));
      }
    }
  });
  return out;
}

TORCH_LIBRARY(compress, m) {
  m.def("bf16_matmul(Tensor x, Tensor w) -> Tensor");
  m.def("int4_matmul(Tensor x, Tensor packed, Tensor scale, Tensor offset, int group) -> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor scale, Tensor offset, int group) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor positions, int window, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("bf16_matmul", &bf16_matmul);
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("decode_attention", &decode_attention);
}
