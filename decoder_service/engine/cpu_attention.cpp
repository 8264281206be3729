// Decode attention read in place from the paged K/V pool on the CPU (decoder_service/engine/cpu_attention.py).
//
// One query per row; row r reads positions [0, lens[r]) of its block table, so no position past its length is
// touched and nothing is gathered. Work is split over (row, K/V head) pairs with ATen's parallel_for; each pair
// scores its positions for the query heads sharing that K/V head (grouped-query attention: query head i reads
// K/V head i / group), takes an exact softmax (max subtracted) and sums V. Accumulation is float32.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
            const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_pool.size(0), blocks = k_pool.size(1), block = k_pool.size(2);
  const int64_t group = heads / kv_heads, width = table.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * dim), query(group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const int64_t len = std::min<int64_t>(lp[r], width * block);
      if (len <= 0) continue;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) query[g * dim + d] = to_float(qp[r * qs0 + (h * group + g) * qs1 + d]) * sc;
      // each of the row's first len positions in its block, in order: fn(position, that position's vector)
      auto positions = [&](const T* pool, auto&& fn) {
        for (int64_t p0 = 0, b = 0; p0 < len; p0 += block, ++b) {
          const T* base = pool + (h * blocks + tp[r * width + b]) * block * dim;
          for (int64_t p = 0, n = std::min(block, len - p0); p < n; ++p) fn(p0 + p, base + p * dim);
        }
      };
      positions(kp, [&](int64_t at, const T* kr) {
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
      positions(vp, [&](int64_t at, const T* vr) {
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + at];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += w * to_float(vr[d]);
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / total[g];
        T* o = op + r * os0 + (h * group + g) * os1;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

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
    case at::kFloat: decode<float>(q, k_pool, v_pool, table, lens, scale, out); break;
    case at::kBFloat16: decode<at::BFloat16>(q, k_pool, v_pool, table, lens, scale, out); break;
    case at::kHalf: decode<at::Half>(q, k_pool, v_pool, table, lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "decode attention over paged K/V"); }
