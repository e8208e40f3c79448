// Fused CPU kernels for the engine's decode and verify forwards (see __init__.py for why and when they run).
//
// Each kernel works row by row, and a row's arithmetic does not depend on which other rows share the batch: a token
// gets the same numbers whether it is decoded alone, in a batch of 64 or as one of k + 1 verified positions, which
// keeps speculative and plain decoding token-identical under greedy decoding.
// Built with -ffp-contract=off so that a * b + c is two roundings, as in torch's eager ops, and with
// -fno-trapping-math, without which GCC vectorises no loop that calls exp_approx (values are unchanged by it).

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

constexpr int LANES = 16;  // independent partial sums, so a reduction vectorises without reordering a lane's adds

template <typename T>
inline float f(T v) { return static_cast<float>(v); }

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of an fp32: widen and shift, exact
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// Round a float to T the way a torch op with output dtype T does (bf16: round to nearest even).
template <typename T>
inline float r(float v) { return static_cast<float>(static_cast<T>(v)); }

// e^x for x <= 88 (softmax's shifted scores, SiLU's -x), written so that GCC vectorises the loops calling it
// (std::exp is a libm call per element): e^x = 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r from its
// Taylor series to r^7 (truncation < 2e-8 relative). Within 2 ulp of std::exp; below -87 it returns 2^-126, not
// the denormal, which a softmax or a SiLU of that input cannot tell apart from 0 after its sum or product.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-6f;  // ln 2 in two parts: n * hi is exact
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// sum over i < n of term(i), in LANES independent partial sums (the same order whatever the batch).
template <typename Term>
inline float lane_sum(int64_t n, Term term) {
  float lane[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) lane[l] += term(i + l);
  for (; i < n; ++i) lane[0] += term(i);
  float total = 0;
  for (int l = 0; l < LANES; ++l) total += lane[l];
  return total;
}

// Indices are checked before any write: a bad slot or position must fail, not scribble over another sequence.
void check_indices(const Tensor& slots, const Tensor& positions, const Tensor& k_cache) {
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* p = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < k_cache.size(0), "slot ", s[i], " is outside the cache");
  for (int64_t i = 0; i < positions.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < k_cache.size(3), "position ", p[i], " is outside the cache");
}

// y = w * T(x * rsqrt(mean(x^2) + eps)): normalised in fp32, scaled in T (the model's RMSNorm).
template <typename T>
inline void norm_row(const T* x, const T* w, T* y, int64_t n, float eps) {
  const float squares = lane_sum(n, [x](int64_t i) { return f(x[i]) * f(x[i]); });
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(f(w[i]) * r<T>(f(x[i]) * inv));
}

template <typename T>
void rms_norm_impl(const Tensor& x, const Tensor& w, Tensor& y, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) norm_row(xp + i * n, wp, yp + i * n, n, static_cast<float>(eps));
  });
}

Tensor rms_norm(const Tensor& x_in, const Tensor& w_in, double eps) {
  Tensor x = x_in.contiguous(), w = w_in.contiguous();
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.numel() == x.size(-1), "rms_norm: weight must match x");
  Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, w, y, eps);
  else if (x.scalar_type() == at::kBFloat16) rms_norm_impl<c10::BFloat16>(x, w, y, eps);
  else TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  return y;
}

// silu(gate) * up for gate_up = [gate | up] along the last axis; each op rounds to T, as silu then mul would.
// The denominators 1 + e^-a go through a row buffer first: one loop with the division vectorises about 3x worse
// under GCC than two (the same operations, so the same bits).
template <typename T>
void silu_mul_impl(const Tensor& gu, Tensor& out) {
  const int64_t inner = out.size(-1), rows = out.numel() / inner;
  const T* g = gu.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> denominators(inner);
    float* denominator = denominators.data();
    for (int64_t i = begin; i < end; ++i) {
      const T* gate = g + i * 2 * inner;
      const T* up = gate + inner;
      T* y = o + i * inner;
      for (int64_t j = 0; j < inner; ++j) denominator[j] = 1.0f + exp_approx(-f(gate[j]));
      for (int64_t j = 0; j < inner; ++j) y[j] = static_cast<T>(r<T>(f(gate[j]) / denominator[j]) * f(up[j]));
    }
  });
}

Tensor silu_mul(const Tensor& gate_up_in) {
  Tensor gu = gate_up_in.contiguous();
  auto sizes = gu.sizes().vec();
  TORCH_CHECK(sizes.back() % 2 == 0, "silu_mul: the last axis holds gate and up, so it must be even");
  sizes.back() /= 2;
  Tensor out = at::empty(sizes, gu.options());
  if (gu.scalar_type() == at::kFloat) silu_mul_impl<float>(gu, out);
  else if (gu.scalar_type() == at::kBFloat16) silu_mul_impl<c10::BFloat16>(gu, out);
  else TORCH_CHECK(false, "silu_mul: float32 or bfloat16 only");
  return out;
}

// One head's vector through the optional per-head norm and the rotary embedding: out = T(T(x * cos) + T(rot * sin))
// with rot = [-x2, x1], each product and the sum rounded to T as torch's eager ops round them.
template <typename T>
inline void norm_rope(const T* x, const T* norm_w, const T* cos, const T* sin, int64_t d, float eps, T* normed,
                      float* out) {
  if (norm_w != nullptr) {
    norm_row(x, norm_w, normed, d, eps);
    x = normed;
  }
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float rot = i < half ? -f(x[i + half]) : f(x[i - half]);
    out[i] = r<T>(r<T>(f(x[i]) * f(cos[i])) + r<T>(rot * f(sin[i])));
  }
}

// qkv [B, T, (H + 2 KV) * D] -> rotated queries [B, T, H, D]; this step's rotated keys and values go into the
// layer's cache at (slots[b], :, positions[b, t]), keys transposed ([slot, KV, D, L]), values not ([slot, KV, L, D]).
template <typename T>
void rope_store_impl(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& q_norm,
                     const Tensor& k_norm, double eps, Tensor& k_cache, Tensor& v_cache, const Tensor& slots,
                     const Tensor& positions, int64_t heads, int64_t kv_heads, Tensor& q_out) {
  const int64_t B = qkv.size(0), Tn = qkv.size(1), D = k_cache.size(2), L = k_cache.size(3);
  const int64_t row = (heads + 2 * kv_heads) * D;
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const T* qn = q_norm.defined() ? q_norm.data_ptr<T>() : nullptr;
  const T* kn = k_norm.defined() ? k_norm.data_ptr<T>() : nullptr;
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, B * Tn, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> normed(D);
    std::vector<float> rotated(D);
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / Tn, p = pos[bt];
      const T* x = src + bt * row;
      const T* c = cp + bt * D;
      const T* s = sp + bt * D;
      for (int64_t h = 0; h < heads; ++h) {
        norm_rope(x + h * D, qn, c, s, D, e, normed.data(), rotated.data());
        for (int64_t i = 0; i < D; ++i) qo[(bt * heads + h) * D + i] = static_cast<T>(rotated[i]);
      }
      for (int64_t g = 0; g < kv_heads; ++g) {
        norm_rope(x + (heads + g) * D, kn, c, s, D, e, normed.data(), rotated.data());
        T* keys = kc + (slot[b] * kv_heads + g) * D * L;
        for (int64_t i = 0; i < D; ++i) keys[i * L + p] = static_cast<T>(rotated[i]);
        const T* v = x + (heads + kv_heads + g) * D;
        T* values = vc + ((slot[b] * kv_heads + g) * L + p) * D;
        for (int64_t i = 0; i < D; ++i) values[i] = v[i];
      }
    }
  });
}

Tensor rope_store(const Tensor& qkv_in, const Tensor& cos_in, const Tensor& sin_in, const c10::optional<Tensor>& q_norm,
                  const c10::optional<Tensor>& k_norm, double eps, Tensor k_cache, Tensor v_cache,
                  const Tensor& slots_in, const Tensor& positions_in, int64_t heads, int64_t kv_heads) {
  Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  Tensor slots = slots_in.to(at::kLong).contiguous(), positions = positions_in.to(at::kLong).contiguous();
  const int64_t B = qkv.size(0), Tn = qkv.size(1), D = k_cache.size(2);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "rope_store: the cache layer must be contiguous");
  TORCH_CHECK(k_cache.size(1) == kv_heads &&
                  v_cache.sizes() == at::IntArrayRef({k_cache.size(0), kv_heads, k_cache.size(3), D}),
              "rope_store: the cache layers do not hold kv_heads heads of the keys' size");
  TORCH_CHECK(qkv.size(2) == (heads + 2 * kv_heads) * D && cos.numel() == B * Tn * D && sin.numel() == B * Tn * D,
              "rope_store: qkv / cos / sin shapes do not match the cache's head size");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && cos.scalar_type() == qkv.scalar_type(),
              "rope_store: qkv, cos/sin and the cache must share a dtype");
  TORCH_CHECK(slots.numel() == B && positions.numel() == B * Tn,
              "rope_store: one slot per sequence, one position per token");
  check_indices(slots, positions, k_cache);
  Tensor qn = q_norm.has_value() ? q_norm->contiguous() : Tensor();
  Tensor kn = k_norm.has_value() ? k_norm->contiguous() : Tensor();
  Tensor q = at::empty({B, Tn, heads, D}, qkv.options());
  if (qkv.scalar_type() == at::kFloat)
    rope_store_impl<float>(qkv, cos, sin, qn, kn, eps, k_cache, v_cache, slots, positions, heads, kv_heads, q);
  else if (qkv.scalar_type() == at::kBFloat16)
    rope_store_impl<c10::BFloat16>(qkv, cos, sin, qn, kn, eps, k_cache, v_cache, slots, positions, heads, kv_heads, q);
  else TORCH_CHECK(false, "rope_store: float32 or bfloat16 only");
  return q;
}

// Query t of sequence b (position p = positions[b, t]) attends to its slot's keys 0..p: scores, softmax and the
// weighted sum of values in fp32 (no mask and no keys beyond p are read), one output row [B, T, H * D] in T.
// Each score is q[0] k[0] + q[1] k[1] + ... in channel order and each output channel sum_j w_j v_j in key order,
// every product rounded before its add, whatever the batch; the vector code keeps those orders (eight scores or
// eight channels in a register), so its bits are the scalar loops'. It works on NR query rows at once that read
// the same keys and values (a KV head's query heads, a verify's tokens of one sequence): each key and value is
// loaded once for them, and NR x 4 independent sums keep the adds from waiting on each other.

#if defined(__AVX2__) && defined(__FMA__)
// The one inner loop of both products: acc[r][m] += x[r][i] * row_i[8m .. 8m + 8) for i = i0, i0 + 1, .. i1 - 1 in
// turn, row_i = base + i * stride (32 values), each product rounded before its add.
template <typename T, int NR>
inline void accumulate32(const float* const* x, const T* base, int64_t stride, int64_t i0, int64_t i1,
                         __m256 (&acc)[NR][4]) {
  for (int64_t i = i0; i < i1; ++i) {
    const T* row = base + i * stride;
    const __m256 v0 = load8(row), v1 = load8(row + 8), v2 = load8(row + 16), v3 = load8(row + 24);
    for (int r = 0; r < NR; ++r) {
      const __m256 xi = _mm256_set1_ps(x[r][i]);
      acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_mul_ps(xi, v0));
      acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_mul_ps(xi, v1));
      acc[r][2] = _mm256_add_ps(acc[r][2], _mm256_mul_ps(xi, v2));
      acc[r][3] = _mm256_add_ps(acc[r][3], _mm256_mul_ps(xi, v3));
    }
  }
}
#endif

// scores[r][j] for keys j0 <= j < n of NR queries [r][D] (keys transposed, [D, L]).
template <typename T, int NR>
inline void query_scores(const float* const* query, const T* keys, int64_t D, int64_t L, int64_t j0, int64_t n,
                         float* const* scores) {
  int64_t j = j0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; j + 32 <= n; j += 32) {  // 32 keys in four registers a query, channel after channel
    __m256 s[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < 4; ++m) s[r][m] = _mm256_setzero_ps();
    accumulate32<T, NR>(query, keys + j, L, 0, D, s);
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < 4; ++m) _mm256_storeu_ps(scores[r] + j + 8 * m, s[r][m]);
  }
#endif
  if (j == n) return;
  for (int r = 0; r < NR; ++r) {
    std::fill(scores[r] + j, scores[r] + n, 0.0f);
    for (int64_t c = 0; c < D; ++c) {  // channel-major over the transposed keys: contiguous in j
      const float qc = query[r][c];
      const T* kr = keys + c * L;
      for (int64_t i = j; i < n; ++i) scores[r][i] += qc * f(kr[i]);
    }
  }
}

// acc[r][c] += sum over j0 <= j < n of w[r][j] * values[j, c], in key order (acc starts at 0 where j0 is 0).
template <typename T, int NR>
inline void weighted_values(const float* const* w, const T* values, int64_t D, int64_t j0, int64_t n,
                            float* const* acc) {
  if (j0 == 0)
    for (int r = 0; r < NR; ++r) std::fill(acc[r], acc[r] + D, 0.0f);
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; c + 32 <= D; c += 32) {  // 32 channels in four registers a query, key after key
    __m256 a[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < 4; ++m) a[r][m] = _mm256_loadu_ps(acc[r] + c + 8 * m);
    accumulate32<T, NR>(w, values + c, D, j0, n, a);
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < 4; ++m) _mm256_storeu_ps(acc[r] + c + 8 * m, a[r][m]);
  }
#endif
  for (int r = 0; r < NR; ++r)
    for (int64_t j = j0; j < n; ++j) {
      const float wj = w[r][j];
      const T* vr = values + j * D;
      for (int64_t i = c; i < D; ++i) acc[r][i] += wj * f(vr[i]);
    }
}

// softmax weights in place over scores[0, n): e^(s - max), and their sum in LANES partial sums.
inline float exp_weights(float* scores, int64_t n) {
  float lane[LANES];  // the maximum lane by lane, which vectorises (a maximum is exact in any order)
  std::fill(lane, lane + LANES, -std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; ++l) lane[l] = std::max(lane[l], scores[j + l]);
  for (; j < n; ++j) lane[0] = std::max(lane[0], scores[j]);
  const float top = *std::max_element(lane, lane + LANES);
  for (j = 0; j < n; ++j) scores[j] = exp_approx(scores[j] - top);
  return lane_sum(n, [scores](int64_t j) { return scores[j]; });
}

// NR query rows (scores, query, sums) that read the same keys and values: together over the keys all of them see,
// then each on its own over the rest (a later token of a verify sees more).
template <typename T, int NR>
inline void attend_rows(float* const* scores, float* const* query, float* const* acc, const int64_t* n,
                        const T* keys, const T* values, int64_t D, int64_t L, float* total) {
  const int64_t shared = *std::min_element(n, n + NR);
  query_scores<T, NR>(query, keys, D, L, 0, shared, scores);
  if (NR > 1)
    for (int r = 0; r < NR; ++r) query_scores<T, 1>(query + r, keys, D, L, shared, n[r], scores + r);
  for (int r = 0; r < NR; ++r) total[r] = exp_weights(scores[r], n[r]);
  weighted_values<T, NR>(scores, values, D, 0, shared, acc);
  if (NR > 1)
    for (int r = 0; r < NR; ++r) weighted_values<T, 1>(scores + r, values, D, shared, n[r], acc + r);
}

template <typename T>
void attention_impl(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                    const Tensor& positions, Tensor& out) {
  const int64_t B = q.size(0), Tn = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t KV = k_cache.size(1), L = k_cache.size(3), group = H / KV;
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Work items: pairs of the query rows (t, head) of one sequence and KV head, t-major, so a pair's two rows
  // read the same keys; an odd row count leaves a single row at the end of each sequence's KV head.
  const int64_t rows = Tn * group, pairs = (rows + 1) / 2;
  at::parallel_for(0, B * KV * pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * (L + 2 * D));  // scores, query and sums of two rows
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (KV * pairs), kv = item / pairs % KV, first = 2 * (item % pairs);
      const int nr = first + 1 < rows ? 2 : 1;
      const T* keys = kc + (slot[b] * KV + kv) * D * L;  // [D, L]: key j's channel c at c * L + j
      const T* values = vc + (slot[b] * KV + kv) * L * D;
      float *scores[2], *query[2], *acc[2];
      int64_t n[2], index[2];
      for (int r = 0; r < nr; ++r) {
        const int64_t t = (first + r) / group, h = kv * group + (first + r) % group;
        index[r] = (b * Tn + t) * H + h;
        n[r] = pos[b * Tn + t] + 1;
        scores[r] = buffer.data() + r * (L + 2 * D), query[r] = scores[r] + L, acc[r] = query[r] + D;
        for (int64_t c = 0; c < D; ++c) query[r][c] = f(qp[index[r] * D + c]) * scale;
      }
      float total[2];
      if (nr == 2) attend_rows<T, 2>(scores, query, acc, n, keys, values, D, L, total);
      else attend_rows<T, 1>(scores, query, acc, n, keys, values, D, L, total);
      for (int r = 0; r < nr; ++r)
        for (int64_t c = 0; c < D; ++c) op[index[r] * D + c] = static_cast<T>(acc[r][c] / total[r]);
    }
  });
}

Tensor attention(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots_in,
                 const Tensor& positions_in) {
  Tensor q = q_in.contiguous();
  Tensor slots = slots_in.to(at::kLong).contiguous(), positions = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(q.dim() == 4 && q.size(3) == k_cache.size(2) && q.size(2) % k_cache.size(1) == 0,
              "attention: q is [B, T, H, D] with H a multiple of the cache's KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == q.scalar_type(),
              "attention: the cache layer must be contiguous and share q's dtype");
  TORCH_CHECK(slots.numel() == q.size(0) && positions.numel() == q.size(0) * q.size(1),
              "attention: one slot per sequence, one position per token");
  check_indices(slots, positions, k_cache);
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2) * q.size(3)}, q.options());
  if (q.scalar_type() == at::kFloat) attention_impl<float>(q, k_cache, v_cache, slots, positions, out);
  else if (q.scalar_type() == at::kBFloat16) attention_impl<c10::BFloat16>(q, k_cache, v_cache, slots, positions, out);
  else TORCH_CHECK(false, "attention: float32 or bfloat16 only");
  return out;
}

// y = x w^T + bias for a few rows x [R, K] (decode and verify batches), w [N, K] as the model stores it.
// Decoding a few rows is bound by streaming the weights from memory, which this reads once per call, row after row
// and prefetched, whatever R is. Every output y[r, n] is computed the same way whatever R is and whichever tile
// computes it: one 8-lane fp32 accumulator over k = 0, 8, 16, ... (fused multiply-adds, each rounded once), the
// lanes summed pairwise, the bias added, one rounding to T. So a row's outputs do not depend on its batch, and the
// scalar fallback (CPUs without AVX2 + FMA) gives the same bits as the vector code.
constexpr int64_t PAIRS_GRAIN = 64;  // weight-row pairs a thread takes at least
constexpr int64_t PREFETCH_BYTES = 2048;  // how far ahead in the weights to prefetch: fastest of 512-4096 measured
constexpr int64_t MANY_ROWS = 32;  // from this many rows a cache-resident weight takes 2 x 6 tiles (see `block`)
constexpr int64_t CACHE_RESIDENT_BYTES = 512 << 10;  // a weight this small stays in a core's L2 between calls

inline float pairwise8(const float* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

#if defined(__AVX2__) && defined(__FMA__)

// The pairwise8 sums of 8 accumulators, in registers: two rounds of hadd leave lane pairs (0+1)+(2+3) and
// (4+5)+(6+7) of four accumulators in the two halves of one register, and the halves' sum is pairwise8's last add,
// so the bits are pairwise8's. At K = 96 (the tiny models) summing through memory is a large share of a tile (about
// a fifth of the deep tiny model's gate/up at 16 rows).
inline void pairwise8_x8(const __m256* v, float* out) {
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(g0), _mm256_extractf128_ps(g0, 1)));
  _mm_storeu_ps(out + 4, _mm_add_ps(_mm256_castps256_ps128(g1), _mm256_extractf128_ps(g1, 1)));
}

// The same for 4 accumulators: one hadd round fewer.
inline void pairwise8_x4(const __m256* v, float* out) {
  const __m256 g = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1)));
}

// The R x NB outputs y[0..R, n..n+NB] before the bias (each pairwise8 of its 8 lanes): each weight row is read once
// for the R rows.
template <typename T, int R, int NB>
inline void linear_tile(const float* x, const T* w, int64_t K, int64_t n, float (*out)[NB]) {
  __m256 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = _mm256_loadu_ps(x + r * K + k);
    for (int j = 0; j < NB; ++j) {
      const T* wk = w + (n + j) * K + k;
      // One prefetch for every four weight rows, into the next tile: a prefetch for each row at every step mostly
      // asks for lines the tile's own loads are already bringing in, and the instructions are the cost (SmolLM2's
      // fp32 layers and head read 1.1-1.2x faster this way, bf16's single row 1.23x; `research/kernel_ab.py`).
      // bf16 pairs (2 to 32 rows) are slightly faster with a prefetch per row, so they keep it.
      if constexpr (std::is_same<T, float>::value || NB == 8) {
        if (j % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(wk + NB * K) + PREFETCH_BYTES, _MM_HINT_T0);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(wk) + PREFETCH_BYTES, _MM_HINT_T0);
      }
      const __m256 wv = load8(wk);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(wv, xs[r], acc[r][j]);
    }
  }
  if constexpr (R * NB % 4 == 0) {  // the R x NB sums are consecutive in acc and in out
    int i = 0;
    for (; i + 8 <= R * NB; i += 8) pairwise8_x8(&acc[0][0] + i, &out[0][0] + i);
    if (i < R * NB) pairwise8_x4(&acc[0][0] + i, &out[0][0] + i);
  } else {
    float lanes[8];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) _mm256_storeu_ps(lanes, acc[r][j]), out[r][j] = pairwise8(lanes);
  }
}
#else
template <typename T, int R, int NB>
inline void linear_tile(const float* x, const T* w, int64_t K, int64_t n, float (*out)[NB]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      float lane[8] = {0};
      for (int64_t k = 0; k < K; k += 8)
        for (int l = 0; l < 8; ++l) lane[l] = std::fma(f(w[(n + j) * K + k + l]), x[r * K + k + l], lane[l]);
      out[r][j] = pairwise8(lane);
    }
}
#endif

template <typename T, int R, int NB>
inline void linear_rows(const float* x, const T* w, const T* bias, int64_t K, int64_t N, int64_t n, T* y) {
  float sums[R][NB];
  linear_tile<T, R, NB>(x, w, K, n, sums);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      y[r * N + n + j] = static_cast<T>(sums[r][j] + (bias != nullptr ? f(bias[n + j]) : 0.0f));
}

template <typename T>
void linear_impl(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const T* wp = w.data_ptr<T>();
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  // Rows [r0, r1) against weight rows [2 * p0, 2 * p1): pairs of weight rows, so NB = 2 tiles fit.
  auto block = [&](int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
    int64_t n = 2 * p0;
    // One row (a batch of one) streams eight weight rows at once into eight independent sums: about 1.2x the
    // bandwidth of one or two at a time on SmolLM2's layers, close to a plain sum of memory; 4 / 6 / 12 / 16 rows
    // at once, and prefetch distances other than 2048 bytes, read slower. bf16 gains as much with the tile's
    // prefetch into the next one (above).
    if (r1 - r0 == 1)
      for (; n + 8 <= 2 * p1; n += 8) linear_rows<T, 1, 8>(xp + r0 * K, wp, bp, K, N, n, yp + r0 * N);
    // Many rows against a weight that stays in the cache (the tiny models' layers in a batch's decode or verify):
    // there loads and FMAs, not memory, are the limit, and 2 rows x 6 weight rows load 8 vectors for 12 FMAs where
    // 4 x 2 load 6 for 8 (the deep tiny model's layers and head at 64-256 rows: about 1.2x faster;
    // `research/kernel_ab.py`). Streaming a large weight this tile is slower (about 0.9x on SmolLM2), so those keep
    // the tiles below.
    if (R >= MANY_ROWS && N * K * static_cast<int64_t>(sizeof(T)) <= CACHE_RESIDENT_BYTES)
      for (; n + 6 <= 2 * p1; n += 6) {
        int64_t r = r0;
        for (; r + 2 <= r1; r += 2) linear_rows<T, 2, 6>(xp + r * K, wp, bp, K, N, n, yp + r * N);
        for (; r < r1; ++r) linear_rows<T, 1, 6>(xp + r * K, wp, bp, K, N, n, yp + r * N);
      }
    for (; n < 2 * p1; n += 2) {
      int64_t r = r0;
      // Several rows share each weight load across up to 8 accumulators (4 rows x 2 weight rows), which keeps
      // FMA rather than loads the limit.
      for (; r + 4 <= r1; r += 4) linear_rows<T, 4, 2>(xp + r * K, wp, bp, K, N, n, yp + r * N);
      for (; r + 2 <= r1; r += 2) linear_rows<T, 2, 2>(xp + r * K, wp, bp, K, N, n, yp + r * N);
      for (; r < r1; ++r)
        if (std::is_same<T, float>::value) linear_rows<T, 1, 1>(xp + r * K, wp, bp, K, N, n, yp + r * N),
                                             linear_rows<T, 1, 1>(xp + r * K, wp, bp, K, N, n + 1, yp + r * N);
        else linear_rows<T, 1, 2>(xp + r * K, wp, bp, K, N, n, yp + r * N);
    }
    if (N % 2 && p1 == N / 2)
      for (int64_t r = r0; r < r1; ++r) linear_rows<T, 1, 1>(xp + r * K, wp, bp, K, N, N - 1, yp + r * N);
  };
  // The threads split the weights, each streaming its share once for all the rows, unless there are too few
  // weight rows to share (a small layer's projections: the tiny models' o / down have 96): then that split ran on
  // one thread, and 8 or more rows are split between the threads instead, in blocks of 4, each reading the whole
  // (small, cache-resident) weight (the deep tiny model's o and down at 64 rows: 15-20 % faster).
  if (N / 2 > PAIRS_GRAIN || R < 8) {
    at::parallel_for(0, N / 2, PAIRS_GRAIN, [&](int64_t begin, int64_t end) { block(0, R, begin, end); });
    if (N / 2 == 0) block(0, R, 0, 0);
  } else {
    at::parallel_for(0, (R + 3) / 4, 1, [&](int64_t begin, int64_t end) {
      block(4 * begin, std::min(R, 4 * end), 0, N / 2);
    });
  }
}

Tensor stream_linear(const Tensor& x_in, const Tensor& w_in, const c10::optional<Tensor>& bias_in) {
  Tensor w = w_in.contiguous();
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "linear: x is [R, K] and w [N, K]");
  TORCH_CHECK(w.size(1) % 8 == 0, "linear: the input size must be a multiple of 8");
  TORCH_CHECK(x_in.scalar_type() == w.scalar_type(), "linear: x and w must share a dtype");
  Tensor bias = bias_in.has_value() ? bias_in->contiguous() : Tensor();
  TORCH_CHECK(!bias.defined() || (bias.numel() == w.size(0) && bias.scalar_type() == w.scalar_type()),
              "linear: bias must be [N] in w's dtype");
  Tensor x = x_in.to(at::kFloat).contiguous();  // bf16 inputs widen exactly
  Tensor y = at::empty({x.size(0), w.size(0)}, w.options());
  if (w.scalar_type() == at::kFloat) linear_impl<float>(x, w, bias, y);
  else if (w.scalar_type() == at::kBFloat16) linear_impl<c10::BFloat16>(x, w, bias, y);
  else TORCH_CHECK(false, "linear: float32 or bfloat16 only");
  return y;
}

// A layer's rotated queries [B, T, heads, D] for its input x [B, T, hidden]: q/k/v of norm(x) through `rope_store`,
// which stores this step's keys and values.
Tensor layer_queries(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& in_norm, double eps,
                     const Tensor& w_qkv, const c10::optional<Tensor>& b_qkv, const c10::optional<Tensor>& q_norm,
                     const c10::optional<Tensor>& k_norm, double qk_eps, Tensor k_cache, Tensor v_cache,
                     const Tensor& slots, const Tensor& positions, int64_t heads, int64_t kv_heads) {
  const Tensor normed = rms_norm(x, in_norm, eps);
  const Tensor qkv = stream_linear(normed.reshape({-1, x.size(-1)}), w_qkv, b_qkv).view({x.size(0), x.size(1), -1});
  return rope_store(qkv, cos, sin, q_norm, k_norm, qk_eps, k_cache, v_cache, slots, positions, heads, kv_heads);
}

// A whole dense decoder layer of the engine's forwards, from the kernels above in the order the model's modules
// call them (so its outputs are the same bits as theirs wherever they take the kernels' linear):
//   h = x + o(attention(rope_store(qkv(norm(x)))));  out = h + down(silu_mul(gate_up(post_norm(h)))).
// One call a layer instead of ~20 torch ops and as many Python calls, which at one row (a batch of one) took about
// a quarter of a SmolLM2 step on 2 cores.
Tensor decoder_layer(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& in_norm,
                     const Tensor& post_norm, double eps, const Tensor& w_qkv, const c10::optional<Tensor>& b_qkv,
                     const Tensor& w_o, const c10::optional<Tensor>& b_o, const c10::optional<Tensor>& q_norm,
                     const c10::optional<Tensor>& k_norm, double qk_eps, const Tensor& w_gate_up, const Tensor& w_down,
                     Tensor k_cache, Tensor v_cache, const Tensor& slots, const Tensor& positions, int64_t heads,
                     int64_t kv_heads) {
  TORCH_CHECK(x.dim() == 3, "decoder_layer: x is [B, T, hidden]");
  const int64_t B = x.size(0), Tn = x.size(1), H = x.size(2);
  auto rows = [](const Tensor& t) { return t.reshape({-1, t.size(-1)}); };
  const Tensor q = layer_queries(x, cos, sin, in_norm, eps, w_qkv, b_qkv, q_norm, k_norm, qk_eps, k_cache, v_cache,
                                 slots, positions, heads, kv_heads);
  const Tensor h = x + stream_linear(rows(attention(q, k_cache, v_cache, slots, positions)), w_o, b_o).view({B, Tn, H});
  const Tensor act = silu_mul(stream_linear(rows(rms_norm(h, post_norm, eps)), w_gate_up, c10::nullopt));
  return h + stream_linear(act, w_down, c10::nullopt).view({B, Tn, H});
}

// An MTP depth's decoder-layer input [B, T, hidden]: eh([enorm(embeds), hnorm(hidden)]).
Tensor mtp_input(const Tensor& hidden, const Tensor& embeds, const Tensor& enorm, const Tensor& hnorm, double eps,
                 const Tensor& w_eh) {
  const int64_t B = hidden.size(0), Tn = hidden.size(1), H = hidden.size(2);
  const Tensor joined = at::cat({rms_norm(embeds, enorm, eps), rms_norm(hidden, hnorm, eps)}, -1);
  return stream_linear(joined.reshape({-1, 2 * H}), w_eh, c10::nullopt).view({B, Tn, H});
}

// One MTP depth of the engine's drafting (`models/mtp.py`, MTPLayer), from the kernels its modules call, in their
// order: out = final_norm(layer(eh([enorm(embeds), hnorm(hidden)]))). Drafting runs a depth per round, several
// rounds a step, and on a tiny head the ~10 Python calls and torch ops around its decoder layer cost more than the
// layer itself.
Tensor mtp_layer(const Tensor& hidden, const Tensor& embeds, const Tensor& enorm, const Tensor& hnorm, double eps,
                 const Tensor& w_eh, const Tensor& final_norm, double final_eps, const Tensor& cos, const Tensor& sin,
                 const Tensor& in_norm, const Tensor& post_norm, double layer_eps, const Tensor& w_qkv,
                 const c10::optional<Tensor>& b_qkv, const Tensor& w_o, const c10::optional<Tensor>& b_o,
                 const c10::optional<Tensor>& q_norm, const c10::optional<Tensor>& k_norm, double qk_eps,
                 const Tensor& w_gate_up, const Tensor& w_down, Tensor k_cache, Tensor v_cache, const Tensor& slots,
                 const Tensor& positions, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(hidden.dim() == 3 && embeds.sizes() == hidden.sizes(), "mtp_layer: hidden and embeds are [B, T, hidden]");
  const Tensor x = mtp_input(hidden, embeds, enorm, hnorm, eps, w_eh);
  const Tensor out = decoder_layer(x, cos, sin, in_norm, post_norm, layer_eps, w_qkv, b_qkv, w_o, b_o, q_norm, k_norm,
                                   qk_eps, w_gate_up, w_down, k_cache, v_cache, slots, positions, heads, kv_heads);
  return rms_norm(out, final_norm, final_eps);
}

// Greedy drafting of the last MTP depth in one call (`models/mtp.py`, MTP.draft), as the proposer's Python rounds
// did it, with the same kernels in the same order:
// 1. catch-up: the depth over each sequence's rows (hidden [B, T, hidden], the next tokens `ids` [B, T] at
//    `positions` [B, T]); only each sequence's row `last` [B] is read on, and the other rows' keys depend on their
//    own inputs alone, so those rows go as far as their keys and values (`MTPLayer.store`);
// 2. `rounds` drafts: draft r is the argmax of the target's head on the state, then the depth reads its own state
//    and draft r at the next position.
// In Python each round was ~15 torch ops and ~40 calls around one small kernel: on the main job's tiny head at
// B = 1 a round's layer took ~0.08 ms of ~0.3 ms; at B = 64 the whole layer on every catch-up row was ~1.4 ms of
// drafting's ~2.7 ms.
Tensor mtp_draft(const Tensor& hidden, const Tensor& ids, const Tensor& positions, const Tensor& last,
                 int64_t rounds, const Tensor& w_head, const c10::optional<Tensor>& b_head, const Tensor& embed,
                 const Tensor& cos_table, const Tensor& sin_table, const Tensor& enorm, const Tensor& hnorm, double eps,
                 const Tensor& w_eh, const Tensor& final_norm, double final_eps, const Tensor& in_norm,
                 const Tensor& post_norm, double layer_eps, const Tensor& w_qkv, const c10::optional<Tensor>& b_qkv,
                 const Tensor& w_o, const c10::optional<Tensor>& b_o, const c10::optional<Tensor>& q_norm,
                 const c10::optional<Tensor>& k_norm, double qk_eps, const Tensor& w_gate_up, const Tensor& w_down,
                 Tensor k_cache, Tensor v_cache, const Tensor& slots, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(hidden.dim() == 3 && ids.sizes() == hidden.sizes().slice(0, 2) && positions.sizes() == ids.sizes() &&
                  last.dim() == 1 && last.size(0) == hidden.size(0),
              "mtp_draft: hidden is [B, T, hidden], ids and positions [B, T], last [B]");
  TORCH_CHECK(rounds >= 1, "mtp_draft: rounds must be at least 1");
  const int64_t B = hidden.size(0), Tn = hidden.size(1), H = hidden.size(2), D = cos_table.size(1);
  auto rope = [&](const Tensor& pos, const Tensor& table) {
    return table.index_select(0, pos.reshape(-1)).view({pos.size(0), 1, pos.size(1), D});
  };
  auto depth = [&](const Tensor& h, const Tensor& e, const Tensor& pos) {
    return mtp_layer(h, e, enorm, hnorm, eps, w_eh, final_norm, final_eps, rope(pos, cos_table), rope(pos, sin_table),
                     in_norm, post_norm, layer_eps, w_qkv, b_qkv, w_o, b_o, q_norm, k_norm, qk_eps, w_gate_up, w_down,
                     k_cache, v_cache, slots, pos, heads, kv_heads);
  };
  Tensor h = hidden.contiguous(), e = embed.index_select(0, ids.reshape(-1)).view({B, Tn, H}), pos = positions;
  if (Tn > 1) {
    layer_queries(mtp_input(h, e, enorm, hnorm, eps, w_eh), rope(pos, cos_table), rope(pos, sin_table), in_norm,
                  layer_eps, w_qkv, b_qkv, q_norm, k_norm, qk_eps, k_cache, v_cache, slots, pos, heads, kv_heads);
    const Tensor rows = at::arange(B, last.options()) * Tn + last;
    h = h.view({B * Tn, H}).index_select(0, rows).view({B, 1, H});
    e = e.view({B * Tn, H}).index_select(0, rows).view({B, 1, H});
    pos = pos.reshape(-1).index_select(0, rows).view({B, 1});
  }
  Tensor state = depth(h, e, pos).view({B, H});
  // Padding is all that may run past the cache (the engine leaves room for every draft): it is parked on the last
  // row, as `BatchView` parks it.
  const int64_t end = std::min(cos_table.size(0), k_cache.size(-1)) - 1;
  Tensor tokens = at::empty({B, rounds}, last.options());
  for (int64_t r = 0;; ++r) {
    const Tensor token = stream_linear(state, w_head, b_head).argmax(-1);
    tokens.select(1, r).copy_(token);
    if (r + 1 == rounds) break;
    pos = (pos + 1).clamp_max(end);
    state = depth(state.view({B, 1, H}), embed.index_select(0, token).view({B, 1, H}), pos).view({B, H});
  }
  return tokens;
}

// A processed distribution's CDF as `sample_inverse_cdf` builds it (torch's cumsum: a double running sum, each
// prefix rounded to float) of e^lp. Returns the total.
inline float probs_cdf(const float* lp, int64_t V, float* cdf) {
  const float none = -std::numeric_limits<float>::infinity();
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) cdf[v] = lp[v] == none ? 0.0f : exp_approx(lp[v]);  // top-k / top-p: exactly 0
  for (int64_t v = 0; v < V; ++v) cdf[v] = static_cast<float>(sum += cdf[v]);
  return cdf[V - 1];
}

// Verification of a deterministic drafter's drafts against processed log-probs `lp` [B, k + 1, V] that emits the
// tokens plain sampling would, and the log-probs of the tokens it emits, in one call: `spec/verify.py`'s
// `verify_coupled`, then the engine's gather. Position j's token is drawn from p_j with u[b, j] (inverse CDF, as
// `sample_inverse_cdf` draws it), and draft j stands while it equals that token. With k = 0 this is plain sampling,
// so a plain step and a verify step draw each position's token by the same arithmetic. One call where torch takes
// a dozen small ops over every position's whole distribution, and a sequence exponentiates only the rows it draws
// from, up to the first draft that does not stand.
// Returns the accepted counts [B], the next tokens [B] and the emitted tokens' log-probs [B, k + 1] (past the next
// token: 0).
std::tuple<Tensor, Tensor, Tensor> verify_coupled(const Tensor& lp_in, const Tensor& drafts_in, const Tensor& len_in,
                                                  const Tensor& u_in) {
  const Tensor lp = lp_in.contiguous(), drafts = drafts_in.to(at::kLong).contiguous();
  const Tensor len = len_in.to(at::kLong).contiguous(), u = u_in.to(at::kFloat).contiguous();
  TORCH_CHECK(lp.dim() == 3 && lp.scalar_type() == at::kFloat, "verify_coupled: log-probs are float32 [B, k + 1, V]");
  const int64_t B = lp.size(0), K1 = lp.size(1), V = lp.size(2), K = K1 - 1;
  TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == B && drafts.size(1) == K && len.numel() == B && u.dim() == 2 &&
                  u.size(0) == B && u.size(1) == K1,
              "verify_coupled: drafts are [B, k], draft lengths [B], uniforms [B, k + 1]");
  const float* lpp = lp.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  const int64_t* x = drafts.data_ptr<int64_t>();
  const int64_t* n_max = len.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(n_max[b] >= 0 && n_max[b] <= K, "verify_coupled: a draft length is outside [0, k]");
    for (int64_t j = 0; j < n_max[b]; ++j)
      TORCH_CHECK(x[b * K + j] >= 0 && x[b * K + j] < V, "verify_coupled: a draft is outside the vocabulary");
  }
  Tensor accepted = at::empty({B}, drafts.options()), next = at::empty({B}, drafts.options());
  Tensor emitted = at::zeros({B, K1}, lp.options());
  int64_t* ap = accepted.data_ptr<int64_t>();
  int64_t* np = next.data_ptr<int64_t>();
  float* ep = emitted.data_ptr<float>();
  at::parallel_for(0, B, std::max<int64_t>(1, 32768 / V), [&](int64_t begin, int64_t end) {
    std::vector<float> cdf(V);
    for (int64_t b = begin; b < end; ++b) {
      const float* row = lpp + b * K1 * V;
      for (int64_t n = 0;; ++n) {
        const float* p = row + n * V;
        const float target = up[b * K1 + n] * probs_cdf(p, V, cdf.data());
        const int64_t t = std::min<int64_t>(std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin(), V - 1);
        ep[b * K1 + n] = p[t];
        if (n == n_max[b] || t != x[b * K + n]) {
          ap[b] = n, np[b] = t;
          break;
        }
      }
    }
  });
  return {accepted, next, emitted};
}

}  // namespace

TORCH_LIBRARY(megatron_spec, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", silu_mul);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots, Tensor positions, int heads, int kv_heads) -> Tensor",
        rope_store);
  m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", stream_linear);
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor positions) -> Tensor", attention);
  m.def("decoder_layer(Tensor x, Tensor cos, Tensor sin, Tensor in_norm, Tensor post_norm, float eps, Tensor w_qkv, "
        "Tensor? b_qkv, Tensor w_o, Tensor? b_o, Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor w_gate_up, "
        "Tensor w_down, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor positions, int heads, "
        "int kv_heads) -> Tensor",
        decoder_layer);
  m.def("mtp_layer(Tensor hidden, Tensor embeds, Tensor enorm, Tensor hnorm, float eps, Tensor w_eh, Tensor final_norm, "
        "float final_eps, Tensor cos, Tensor sin, Tensor in_norm, Tensor post_norm, float layer_eps, Tensor w_qkv, "
        "Tensor? b_qkv, Tensor w_o, Tensor? b_o, Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor w_gate_up, "
        "Tensor w_down, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor positions, int heads, "
        "int kv_heads) -> Tensor",
        mtp_layer);
  m.def("mtp_draft(Tensor hidden, Tensor ids, Tensor positions, Tensor last, int rounds, Tensor w_head, "
        "Tensor? b_head, Tensor embed, Tensor cos_table, Tensor sin_table, Tensor enorm, Tensor hnorm, float eps, "
        "Tensor w_eh, Tensor final_norm, float final_eps, Tensor in_norm, Tensor post_norm, float layer_eps, "
        "Tensor w_qkv, Tensor? b_qkv, Tensor w_o, Tensor? b_o, Tensor? q_norm, Tensor? k_norm, float qk_eps, "
        "Tensor w_gate_up, Tensor w_down, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int heads, "
        "int kv_heads) -> Tensor",
        mtp_draft);
  m.def("verify_coupled(Tensor logprobs, Tensor drafts, Tensor draft_len, Tensor u) -> (Tensor, Tensor, Tensor)",
        verify_coupled);
}
