// Paged attention for XLA:CPU as XLA FFI custom calls: the block-table gather fused into
// an online softmax, so every K/V byte a row needs is read once, straight from its page.
// (The plain-jnp path, xla_attention.py, has XLA write the gathered K and V out before the
// dot and the reduce read them back: each byte crosses memory three times.)
//
// Built and registered by pallas_kernels/cpu/custom_calls.py; semantics are
// pallas_kernels/reference.py's: scale, then optional tanh soft cap; a query at position p
// sees keys j <= p, j < kv_len and, with a sliding window W > 0, j > p - W; a query that
// sees nothing returns zeros. f32 q and pages. Work items (a sequence's query tile x one KV
// head) run on OpenMP threads; each keeps its G query heads' running max, sum and
// accumulator, and reads each K/V row once for all G of them.
//
// Shapes:
//   q         f32[T, Hq, D]            (decode: T = B, one query per sequence)
//   k/v pages f32[Hkv, NB, bs, D]
//   tables    i32[S, W]                 block ids; entries past a sequence's blocks unread;
//                                        ids outside [0, NB) are clamped (as XLA's gather)
//   kv_lens   i32[S]                    decode: lengths (0: zeros)
//   cu_q_lens i32[S + 1], num_seqs i32[] (ragged only)
//   out       f32[T, Hq, D]

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 16;   // query tokens of one sequence per ragged work item

struct Pages {
  const float* k;
  const float* v;
  int64_t num_kv_heads, num_blocks, block_size, head_dim;
  const float* row(const float* base, int64_t h, int64_t blk, int64_t j) const {
    return base + ((h * num_blocks + blk) * block_size + j) * head_dim;
  }
};

struct Semantics {
  float scale, soft_cap;   // soft_cap <= 0: none
  int32_t window;          // <= 0: none
};

// out[j] = q . k[j] for keys j in [j0, j1) of a block (rows of D floats). Four keys at a
// time: each q element is loaded once for four products, and the four sums stay in
// registers until the end (one dot at a time reduces a vector per key).
inline void Dots(const float* q, const float* k, int64_t D, int64_t j0, int64_t j1,
                 float* out) {
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) {
    const float* k0 = k + j * D;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float x = q[d];
      a0 += x * k0[d];
      a1 += x * k0[D + d];
      a2 += x * k0[2 * D + d];
      a3 += x * k0[3 * D + d];
    }
    out[j] = a0; out[j + 1] = a1; out[j + 2] = a2; out[j + 3] = a3;
  }
  for (; j < j1; ++j) {
    float a = 0.f;
    for (int64_t d = 0; d < D; ++d) a += q[d] * k[j * D + d];
    out[j] = a;
  }
}

// Attention of `n` queries (positions pos[0..n), each with G heads at q + (i * G + g) * D,
// stride q_stride between queries) of one sequence over KV head h; writes out likewise.
void AttendTile(const float* q, int64_t q_stride, float* out, const int64_t* pos, int64_t n,
                int64_t G, int64_t h, const int32_t* table, int64_t table_width,
                int64_t kv_len, const Pages& p, const Semantics& s) {
  const int64_t D = p.head_dim, bs = p.block_size;
  const int64_t rows = n * G;
  std::vector<float> acc(rows * D, 0.f), mx(rows, -INFINITY), sum(rows, 0.f), logit(bs);
  int64_t hi = 0, lo = kv_len;   // keys any query of the tile sees: [lo, hi)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t last = std::min(pos[i], kv_len - 1);
    if (last < 0) continue;
    hi = std::max(hi, last + 1);
    lo = std::min(lo, s.window > 0 ? std::max<int64_t>(0, pos[i] - s.window + 1) : 0);
  }
  for (int64_t b0 = (lo / bs) * bs; b0 < hi; b0 += bs) {
    int64_t blk = table[std::min(b0 / bs, table_width - 1)];
    blk = std::clamp<int64_t>(blk, 0, p.num_blocks - 1);
    const int64_t m = std::min(bs, hi - b0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t first = s.window > 0 ? std::max<int64_t>(0, pos[i] - s.window + 1) : 0;
      const int64_t last = std::min(pos[i], kv_len - 1);   // visible keys: [first, last]
      const int64_t j0 = std::max<int64_t>(0, first - b0);
      const int64_t j1 = std::min<int64_t>(m, last - b0 + 1);
      if (j1 <= j0) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float* qr = q + i * q_stride + g * D;
        const int64_t r = i * G + g;
        Dots(qr, p.row(p.k, h, blk, 0), D, j0, j1, logit.data());
        float new_max = mx[r];
        for (int64_t j = j0; j < j1; ++j) {
          float dot = logit[j] * s.scale;
          if (s.soft_cap > 0.f) dot = s.soft_cap * std::tanh(dot / s.soft_cap);
          logit[j] = dot;
          new_max = std::max(new_max, dot);
        }
        const float corr = std::exp(mx[r] - new_max);   // exp(-inf) = 0 at the start
        float* a = acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= corr;
        float total = sum[r] * corr;
        for (int64_t j = j0; j < j1; ++j) {
          const float w = std::exp(logit[j] - new_max);
          total += w;
          const float* vr = p.row(p.v, h, blk, j);
          for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
        }
        mx[r] = new_max;
        sum[r] = total;
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
      float* o = out + i * q_stride + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
    }
  }
}

Pages MakePages(const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v) {
  auto kd = k.dimensions();
  return Pages{k.typed_data(), v.typed_data(), kd[0], kd[1], kd[2], kd[3]};
}

ffi::Error Check(const ffi::Buffer<ffi::F32>& q, const Pages& p, int64_t table_rows,
                 int64_t table_width) {
  auto qd = q.dimensions();
  if (qd.size() != 3 || qd[2] != p.head_dim || qd[1] % p.num_kv_heads != 0) {
    return ffi::Error::InvalidArgument("q must be [T, Hq, D] with Hq a multiple of Hkv");
  }
  if (table_width < 1 || table_rows < 0) {
    return ffi::Error::InvalidArgument("block_tables must be [S, W] with W >= 1");
  }
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                      ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> tables,
                      ffi::Buffer<ffi::S32> lengths, float scale, float soft_cap,
                      int32_t window, ffi::ResultBuffer<ffi::F32> out) {
  const Pages p = MakePages(k_pages, v_pages);
  const int64_t S = tables.dimensions()[0], W = tables.dimensions()[1];
  if (auto e = Check(q, p, S, W); e.failure()) return e;
  const int64_t B = q.dimensions()[0], Hq = q.dimensions()[1], D = p.head_dim;
  if (B != S || lengths.dimensions()[0] != B) {
    return ffi::Error::InvalidArgument("q, block_tables and lengths disagree on the batch");
  }
  const int64_t Hkv = p.num_kv_heads, G = Hq / Hkv;
  const Semantics s{scale, soft_cap, window};
  const float* Q = q.typed_data();
  const int32_t* T = tables.typed_data();
  const int32_t* L = lengths.typed_data();
  float* O = out->typed_data();
  const int64_t max_len = W * p.block_size;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < B * Hkv; ++item) {
    const int64_t b = item / Hkv, h = item % Hkv;
    const int64_t len = std::clamp<int64_t>(L[b], 0, max_len);
    const int64_t pos = len - 1;
    const int64_t off = (b * Hq + h * G) * D;
    AttendTile(Q + off, Hq * D, O + off, &pos, 1, G, h, T + b * W, W, len, p, s);
  }
  return ffi::Error::Success();
}

ffi::Error RaggedImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                      ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> tables,
                      ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                      ffi::Buffer<ffi::S32> num_seqs, float scale, float soft_cap,
                      int32_t window, ffi::ResultBuffer<ffi::F32> out) {
  const Pages p = MakePages(k_pages, v_pages);
  const int64_t S = tables.dimensions()[0], W = tables.dimensions()[1];
  if (auto e = Check(q, p, S, W); e.failure()) return e;
  if (kv_lens.dimensions()[0] != S || cu_q_lens.dimensions()[0] != S + 1) {
    return ffi::Error::InvalidArgument("kv_lens must be [S] and cu_q_lens [S + 1]");
  }
  const int64_t Tn = q.dimensions()[0], Hq = q.dimensions()[1], D = p.head_dim;
  const int64_t Hkv = p.num_kv_heads, G = Hq / Hkv;
  const Semantics s{scale, soft_cap, window};
  const float* Q = q.typed_data();
  const int32_t* T = tables.typed_data();
  const int32_t* KL = kv_lens.typed_data();
  const int32_t* CU = cu_q_lens.typed_data();
  float* O = out->typed_data();
  std::fill(O, O + Tn * Hq * D, 0.f);   // padding rows are zeros
  const int64_t live = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, S);
  const int64_t max_len = W * p.block_size;
  std::vector<int64_t> tile_seq, tile_start;   // (sequence, first q row) of each tile
  for (int64_t i = 0; i < live; ++i) {
    const int64_t start = std::clamp<int64_t>(CU[i], 0, Tn);
    const int64_t end = std::clamp<int64_t>(CU[i + 1], start, Tn);
    for (int64_t r = start; r < end; r += kTile) {
      tile_seq.push_back(i);
      tile_start.push_back(r);
    }
  }
  const int64_t items = static_cast<int64_t>(tile_seq.size()) * Hkv;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t t = item / Hkv, h = item % Hkv;
    const int64_t i = tile_seq[t], r0 = tile_start[t];
    const int64_t start = std::clamp<int64_t>(CU[i], 0, Tn);
    const int64_t end = std::clamp<int64_t>(CU[i + 1], start, Tn);
    const int64_t n = std::min(kTile, end - r0);
    const int64_t kv_len = std::clamp<int64_t>(KL[i], 0, max_len);
    const int64_t q_len = CU[i + 1] - CU[i];
    int64_t pos[kTile];
    for (int64_t j = 0; j < n; ++j) pos[j] = kv_len - q_len + (r0 - CU[i]) + j;
    const int64_t off = (r0 * Hq + h * G) * D;
    AttendTile(Q + off, Hq * D, O + off, pos, n, G, h, T + i * W, W, kv_len, p, s);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedJaxCpuDecode, DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedJaxCpuRagged, RaggedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>());
