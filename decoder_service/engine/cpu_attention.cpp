// Decode attention read in place from the paged K/V pool on the CPU (decoder_service/engine/cpu_attention.py).
//
// One query per row; row r reads positions [0, lens[r]) of its block table, so no position past its length is
// touched and nothing is gathered. Work is split over (row, K/V head) pairs with ATen's parallel_for; each pair
// scores its positions for the query heads sharing that K/V head (grouped-query attention: query head i reads
// K/V head i / group), takes an exact softmax (max subtracted) and sums V. Accumulation is float32.
//
// Two bodies: float32 with a head dim that is a multiple of 16, where the compiler targets AVX-512 (the CPUs this
// serves; `-march=native`), goes through decode_f32_avx512: one pass per block (its K scored, then its V summed while
// both are near, the next block's lines prefetched), the softmax kept online, exp on 16 lanes at once. Everything else
// (bfloat16, float16, other head dims, CPUs without AVX-512) goes through `decode`, two passes with scalar exp.
// Both agree with SDPA over the row's gathered positions to float32 rounding (tests/decoder_service/test_cpu_attention.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// One call's sizes, strides and data, shared by both bodies: a task is one row's one K/V head.
template <typename T>
struct Problem {
  int64_t rows, heads, dim, kv_heads, blocks, block, group, width, qs0, qs1, os0, os1;
  const T *qp, *kp, *vp;
  const int64_t *tp, *lp;
  T* op;
  float sc;

  Problem(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
          const at::Tensor& lens, double scale, at::Tensor& out)
      : rows(q.size(0)), heads(q.size(1)), dim(q.size(2)), kv_heads(k_pool.size(0)), blocks(k_pool.size(1)),
        block(k_pool.size(2)), group(heads / kv_heads), width(table.size(1)), qs0(q.stride(0)), qs1(q.stride(1)),
        os0(out.stride(0)), os1(out.stride(1)), qp(q.data_ptr<T>()), kp(k_pool.data_ptr<T>()),
        vp(v_pool.data_ptr<T>()), tp(table.data_ptr<int64_t>()), lp(lens.data_ptr<int64_t>()), op(out.data_ptr<T>()),
        sc(static_cast<float>(scale)) {}

  // the row's positions that are read: its length, at most what its table holds
  int64_t length(int64_t r) const { return std::min<int64_t>(lp[r], width * block); }
  // the offset of the row's b-th block of K/V head h in a pool
  int64_t block_at(int64_t r, int64_t h, int64_t b) const { return (h * blocks + tp[r * width + b]) * block * dim; }
  // the head group's queries, scaled, into query (group x dim floats)
  void load_query(int64_t r, int64_t h, float* query) const {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < dim; ++d) query[g * dim + d] = to_float(qp[r * qs0 + (h * group + g) * qs1 + d]) * sc;
  }
  // acc (group x dim) divided by each head's softmax sum, into the output
  void store(int64_t r, int64_t h, const float* acc, const float* total) const {
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.f / total[g];
      T* o = op + r * os0 + (h * group + g) * os1;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[g * dim + d] * inv);
    }
  }
};

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
            const at::Tensor& lens, double scale, at::Tensor& out) {
  const Problem<T> P(q, k_pool, v_pool, table, lens, scale, out);
  const int64_t group = P.group, dim = P.dim, block = P.block;

  at::parallel_for(0, P.rows * P.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * dim), query(group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / P.kv_heads, h = task % P.kv_heads;
      const int64_t len = P.length(r);
      if (len <= 0) continue;
      scores.resize(group * len);
      P.load_query(r, h, query.data());
      // each of the row's first len positions in its block, in order: fn(position, that position's vector)
      auto positions = [&](const T* pool, auto&& fn) {
        for (int64_t p0 = 0, b = 0; p0 < len; p0 += block, ++b) {
          const T* base = pool + P.block_at(r, h, b);
          for (int64_t p = 0, n = std::min(block, len - p0); p < n; ++p) fn(p0 + p, base + p * dim);
        }
      };
      positions(P.kp, [&](int64_t at, const T* kr) {
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * to_float(kr[d]);
          scores[g * len + at] = s;
        }
      });
      std::vector<float> total(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float top = sg[0];
        for (int64_t p = 1; p < len; ++p) top = std::max(top, sg[p]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < len; ++p) {
          sg[p] = std::exp(sg[p] - top);
          sum += sg[p];
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      positions(P.vp, [&](int64_t at, const T* vr) {
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + at];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += w * to_float(vr[d]);
        }
      });
      P.store(r, h, acc.data(), total.data());
    }
  });
}

#if defined(__AVX512F__)
// exp over 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error under 1e-8),
// times 2^n by scalef; below -87 the result is taken at -87 (1e-38: nothing beside the row's largest term, e^0).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// float32 with dim a multiple of 16: one pass over each block, its K and then its V while both are
// near, with the softmax kept online (running max and sum per query head, the sums rescaled when the max grows).
void decode_f32_avx512(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                       const at::Tensor& table, const at::Tensor& lens, double scale, at::Tensor& out) {
  const Problem<float> P(q, k_pool, v_pool, table, lens, scale, out);
  const int64_t group = P.group, dim = P.dim, block = P.block, chunks = dim / 16;

  at::parallel_for(0, P.rows * P.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), acc(group * dim), top(group), sum(group), probs(block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / P.kv_heads, h = task % P.kv_heads;
      const int64_t len = P.length(r);
      if (len <= 0) continue;
      P.load_query(r, h, query.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top.begin(), top.end(), -INFINITY);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t p0 = 0, b = 0; p0 < len; p0 += block, ++b) {
        const int64_t n = std::min(block, len - p0);
        const float* kb = P.kp + P.block_at(r, h, b);
        const float* vb = P.vp + P.block_at(r, h, b);
        if (p0 + block < len) {  // the next block's K and V into cache while this one computes
          const int64_t next = P.block_at(r, h, b + 1);
          for (int64_t i = 0; i < block * dim; i += 16) {
            _mm_prefetch(reinterpret_cast<const char*>(P.kp + next + i), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(P.vp + next + i), _MM_HINT_T0);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query.data() + g * dim;
          float best = top[g];
          for (int64_t p = 0; p < n; ++p) {
            const float* kr = kb + p * dim;
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(kr));
            for (int64_t c = 1; c < chunks; ++c)
              s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_loadu_ps(kr + 16 * c), s);
            probs[p] = _mm512_reduce_add_ps(s);
            best = std::max(best, probs[p]);
          }
          const float rescale = std::exp(top[g] - best);  // 0 on the first block (top is -inf)
          float total = 0.f;
          for (int64_t p = 0; p < n; p += 16) {
            const __mmask16 m = static_cast<__mmask16>((n - p >= 16) ? 0xFFFF : ((1u << (n - p)) - 1));
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, probs.data() + p),
                                                                       _mm512_set1_ps(best))));
            _mm512_mask_storeu_ps(probs.data() + p, m, e);
            total += _mm512_reduce_add_ps(e);
          }
          sum[g] = sum[g] * rescale + total;
          top[g] = best;
          float* ag = acc.data() + g * dim;
          for (int64_t c = 0; c < chunks; ++c) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), _mm512_set1_ps(rescale));
            for (int64_t p = 0; p < n; ++p)
              a = _mm512_fmadd_ps(_mm512_set1_ps(probs[p]), _mm512_loadu_ps(vb + p * dim + 16 * c), a);
            _mm512_storeu_ps(ag + 16 * c, a);
          }
        }
      }
      P.store(r, h, acc.data(), sum.data());
    }
  });
}
#endif

// q (rows, heads, dim) with its last dimension contiguous; k_pool, v_pool (kv_heads, blocks, block, dim)
// contiguous; table (rows, width) int64; lens (rows,) int64; out (rows, heads, dim), last dimension contiguous.
void paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                  const at::Tensor& lens, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "paged_decode: shapes");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && table.is_contiguous() && lens.is_contiguous(),
              "paged_decode: the pools, table and lens must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && q.sizes() == out.sizes(), "paged_decode: q/out layout");
  TORCH_CHECK(q.size(1) % k_pool.size(0) == 0 && q.size(2) == k_pool.size(3), "paged_decode: heads or dim");
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && table.size(0) == q.size(0),
              "paged_decode: table/lens");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == out.scalar_type(), "paged_decode: dtype");
  switch (q.scalar_type()) {
    case at::kFloat:
#if defined(__AVX512F__)
      if (q.size(2) % 16 == 0) {  // the vectorized body
        decode_f32_avx512(q, k_pool, v_pool, table, lens, scale, out);
        break;
      }
#endif
      decode<float>(q, k_pool, v_pool, table, lens, scale, out); break;
    case at::kBFloat16: decode<at::BFloat16>(q, k_pool, v_pool, table, lens, scale, out); break;
    case at::kHalf: decode<at::Half>(q, k_pool, v_pool, table, lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "decode attention over paged K/V"); }
