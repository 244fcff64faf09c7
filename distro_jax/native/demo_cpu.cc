// DeMo's two param-sized passes as fused CPU kernels, for 64x64 chunks.
//
// XLA's CPU backend runs the chunked DCT as dense 64x64 matmuls and the top-k
// as a heap over each row, each a pass of its own over param-sized buffers.
// Here each chunk is read once, transformed, selected from and written back
// while it sits in cache, and the DCT is the even/odd recursion (a third of
// the dense matmul's multiply-adds).
//
// Determinism: every replica must compute the same bits. The code uses no
// fused multiply-add (built with -ffp-contract=off), no reassociation and no
// libm call; the DCT tables come from the caller. So the result of each
// float operation is fixed by IEEE 754 whatever the vector width the
// compiler picked for this machine.
//
// Layout: a tensor is (batch, n1, n2) in row-major order, both n1 and n2
// multiples of 64; chunk (b, a, c) covers rows 64a.. and columns 64c.. of
// matrix b, and chunks are numbered row-major over (b, a, c), as
// distro_jax.dct's block view numbers them.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kC = 64;           // chunk side
constexpr int kN = kC * kC;      // coefficients per chunk
constexpr int kGroup = 8;        // entries per group in the top-k's first stage
constexpr int kGroups = kN / kGroup;

// The caller's table: the unnormalized DCT-IV matrices of sizes 32, 16, ...,
// 1 (entry [r][n] = cos(pi (2n+1)(2r+1) / 4M)), then the two orthonormal
// scales (1/8 and 1/sqrt(32)), then the orthonormal 64x64 DCT-II basis.
constexpr int kDct4Floats = 1024 + 256 + 64 + 16 + 4 + 1;
constexpr int kTableFloats = kDct4Floats + 2 + kN;

struct Tables {
  const float* dct4[7];  // by log2 of the size; [6] unused
  float scale0, scale;
  const float* basis;
};

Tables ReadTables(const float* t) {
  Tables out{};
  const float* p = t;
  for (int m = 5; m >= 0; --m) {
    out.dct4[m] = p;
    p += (1 << m) * (1 << m);
  }
  out.scale0 = p[0];
  out.scale = p[1];
  out.basis = p + 2;
  return out;
}

// out[r] = sum_n dct4[r][n] * v[n] for M = 2^m rows of kC floats each.
void Dct4Rows(const Tables& t, const float* v, float* out, int m) {
  const int M = 1 << m;
  const float* c = t.dct4[m];
  if (M == 1) {
    for (int w = 0; w < kC; ++w) out[w] = c[0] * v[w];
    return;
  }
  for (int r = 0; r < M; r += 2) {
    // Two output rows per sweep over v halve its loads.
    float acc0[kC], acc1[kC];
    for (int w = 0; w < kC; ++w) acc0[w] = acc1[w] = 0.f;
    const float* c0 = c + r * M;
    const float* c1 = c0 + M;
    for (int n = 0; n < M; ++n) {
      const float a = c0[n], b = c1[n];
      const float* vn = v + n * kC;
      for (int w = 0; w < kC; ++w) {
        acc0[w] += a * vn[w];
        acc1[w] += b * vn[w];
      }
    }
    std::memcpy(out + r * kC, acc0, sizeof(acc0));
    std::memcpy(out + (r + 1) * kC, acc1, sizeof(acc1));
  }
}

// Unnormalized DCT-II down the 2^n_log rows of x (each row kC floats, one
// transform per column): even outputs are the half-size DCT-II of the folded
// sums, odd ones the half-size DCT-IV of the folded differences.
void Dct2Rows(const Tables& t, const float* x, float* out, int n_log, float* scratch) {
  const int N = 1 << n_log;
  if (N == 1) {
    std::memcpy(out, x, kC * sizeof(float));
    return;
  }
  const int H = N / 2;
  float* u = scratch;
  float* v = u + H * kC;
  for (int n = 0; n < H; ++n) {
    const float* lo = x + n * kC;
    const float* hi = x + (N - 1 - n) * kC;
    for (int w = 0; w < kC; ++w) {
      u[n * kC + w] = lo[w] + hi[w];
      v[n * kC + w] = lo[w] - hi[w];
    }
  }
  float* even = v + H * kC;
  float* odd = even + H * kC;
  Dct4Rows(t, v, odd, n_log - 1);
  Dct2Rows(t, u, even, n_log - 1, odd + H * kC);
  for (int r = 0; r < H; ++r) {
    std::memcpy(out + (2 * r) * kC, even + r * kC, kC * sizeof(float));
    std::memcpy(out + (2 * r + 1) * kC, odd + r * kC, kC * sizeof(float));
  }
}

// The transpose of Dct2Rows (an unnormalized DCT-III down the rows).
void Dct3Rows(const Tables& t, const float* z, float* out, int n_log, float* scratch) {
  const int N = 1 << n_log;
  if (N == 1) {
    std::memcpy(out, z, kC * sizeof(float));
    return;
  }
  const int H = N / 2;
  float* ze = scratch;
  float* zo = ze + H * kC;
  for (int r = 0; r < H; ++r) {
    std::memcpy(ze + r * kC, z + (2 * r) * kC, kC * sizeof(float));
    std::memcpy(zo + r * kC, z + (2 * r + 1) * kC, kC * sizeof(float));
  }
  float* a = zo + H * kC;
  float* b = a + H * kC;
  Dct4Rows(t, zo, b, n_log - 1);  // a DCT-IV matrix is symmetric
  Dct3Rows(t, ze, a, n_log - 1, b + H * kC);
  for (int n = 0; n < H; ++n) {
    float* lo = out + n * kC;
    float* hi = out + (N - 1 - n) * kC;
    for (int w = 0; w < kC; ++w) {
      lo[w] = a[n * kC + w] + b[n * kC + w];
      hi[w] = a[n * kC + w] - b[n * kC + w];
    }
  }
}

void Transpose(const float* in, float* out) {
  for (int i = 0; i < kC; i += 8)
    for (int j = 0; j < kC; j += 8)
      for (int a = 0; a < 8; ++a)
        for (int b = 0; b < 8; ++b) out[(j + b) * kC + i + a] = in[(i + a) * kC + j + b];
}

// Scratch a chunk's work needs, in floats.
constexpr int kScratch = 8 * kN;

// Orthonormal 2-D DCT of one chunk x (rows contiguous) into y.
void Dct2d(const Tables& t, const float* x, float* y, float* scratch) {
  float* t1 = scratch;
  float* t2 = t1 + kN;
  float* rest = t2 + kN;
  Dct2Rows(t, x, t1, 6, rest);  // along the chunk's first axis
  Transpose(t1, t2);
  Dct2Rows(t, t2, t1, 6, rest);  // along its second, transposed
  float s[kC];
  for (int i = 0; i < kC; ++i) s[i] = i ? t.scale : t.scale0;
  // Transposed back in 8x8 tiles, scaled by both frequencies' factors.
  for (int i0 = 0; i0 < kC; i0 += 8)
    for (int j0 = 0; j0 < kC; j0 += 8)
      for (int i = i0; i < i0 + 8; ++i)
        for (int j = j0; j < j0 + 8; ++j) y[i * kC + j] = t1[j * kC + i] * s[i] * s[j];
}

struct Entry {
  float mag;
  int32_t pos;
};

// jax.lax.top_k's order: larger first, ties to the lower position.
inline bool Before(const Entry& a, const Entry& b) {
  return a.mag > b.mag || (a.mag == b.mag && a.pos < b.pos);
}

// Positions and values of the k largest magnitudes of chunk y, in top_k's
// order. Every one of the k lies in a group of 8 whose maximum is at least
// the k-th largest group maximum, tau, so only entries of at least tau are
// ranked. A chunk holding a non-finite entry gives positions 0..k-1 and its
// first non-finite value in the first slot, so the caller sees it.
void SelectTopK(const float* y, int k, int32_t* idx, float* val, std::vector<Entry>& cands) {
  alignas(64) float maxima[kGroups];
  bool finite = true;
  for (int g = 0; g < kGroups; ++g) maxima[g] = y[g * kGroup] < 0 ? -y[g * kGroup] : y[g * kGroup];
  for (int e = 1; e < kGroup; ++e)
    for (int g = 0; g < kGroups; ++g) {
      float a = y[g * kGroup + e];
      a = a < 0 ? -a : a;
      maxima[g] = maxima[g] < a ? a : maxima[g];
    }
  float bad = 0.f;
  for (int p = 0; p < kN; ++p) {
    // x - x is 0 for finite x and NaN for inf or NaN.
    if (!(y[p] - y[p] == 0.f)) {
      finite = false;
      bad = y[p];
      break;
    }
  }
  if (!finite) {
    for (int e = 0; e < k; ++e) {
      idx[e] = e;
      val[e] = y[e];
    }
    val[0] = bad;
    return;
  }
  // tau, the k-th largest maximum, by bisection on the bit patterns (a
  // non-negative float orders as its bits do): the largest pattern with at
  // least k maxima at or above it.
  alignas(64) uint32_t bits[kGroups];
  std::memcpy(bits, maxima, sizeof(bits));
  uint32_t lo = 0, hi = 0x7f800000u;  // count(>= lo) >= k; +inf bounds every finite max
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    int count = 0;
    for (int g = 0; g < kGroups; ++g) count += bits[g] >= mid;
    if (count >= k)
      lo = mid;
    else
      hi = mid - 1;
  }
  float tau;
  std::memcpy(&tau, &lo, sizeof(tau));
  size_t n = 0;
  for (int g = 0; g < kGroups; ++g) {
    if (maxima[g] < tau) continue;
    for (int e = 0; e < kGroup; ++e) {
      const int p = g * kGroup + e;
      const float a = y[p] < 0 ? -y[p] : y[p];
      if (a >= tau) {
        if (n == cands.size()) cands.resize(2 * n);
        cands[n++] = {a, p};
      }
    }
  }
  std::sort(cands.begin(), cands.begin() + n, Before);
  for (int e = 0; e < k; ++e) {
    idx[e] = cands[e].pos;
    val[e] = y[cands[e].pos];
  }
}

// Runs body(begin, end) over [0, total) in pieces on the calling thread and
// on XLA's intra-op pool. The caller takes pieces too and waits only for
// pieces others have claimed, so a busy or single-threaded pool costs no
// deadlock: tasks that start late find nothing left.
void ParallelFor(ffi::ThreadPool& pool, int64_t total, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& body) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> busy{0};
  };
  auto shared = std::make_shared<Shared>();
  // A worker counts itself busy before it claims a piece, and the caller
  // returns only once no piece is left and nobody is busy. So body runs only
  // while the caller waits, and a task that starts after that claims nothing
  // and touches only `shared`, which its own copy keeps alive.
  auto work = [shared, total, grain, &body] {
    for (;;) {
      shared->busy.fetch_add(1);
      const int64_t begin = shared->next.fetch_add(grain);
      if (begin >= total) {
        shared->busy.fetch_sub(1);
        return;
      }
      body(begin, std::min(total, begin + grain));
      shared->busy.fetch_sub(1);
    }
  };
  const int64_t pieces = (total + grain - 1) / grain;
  const int64_t threads = std::min<int64_t>(pool.num_threads(), pieces);
  for (int64_t i = 1; i < threads; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (shared->busy.load() != 0) std::this_thread::yield();
}

}  // namespace

// DeMo's worker side for one tensor of 64x64 chunks: the momentum
// m' = decay * m + lr * DCT(g) and the top-k of every chunk of it. Error
// feedback (zeroing what was sent) is left to the caller, which may need m'
// whole (the overlapped mode keeps it).
static ffi::Error CompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> g,
                               ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> decay_lr,
                               ffi::Buffer<ffi::F32> table, ffi::ResultBuffer<ffi::F32> m_out,
                               ffi::ResultBuffer<ffi::S32> idx_out,
                               ffi::ResultBuffer<ffi::F32> val_out, int64_t k) {
  const auto dims = g.dimensions();
  if (dims.size() < 2 || table.element_count() != kTableFloats || k < 1 || k > kGroups)
    return ffi::Error::InvalidArgument("demo_compress: bad shapes or k");
  const int64_t n1 = dims[dims.size() - 2], n2 = dims[dims.size() - 1];
  if (n1 % kC || n2 % kC) return ffi::Error::InvalidArgument("demo_compress: not 64x64 chunks");
  const int64_t A = n1 / kC, B = n2 / kC;
  const int64_t chunks = static_cast<int64_t>(g.element_count()) / kN;
  const Tables t = ReadTables(table.typed_data());
  const float decay = decay_lr.typed_data()[0], lr = decay_lr.typed_data()[1];
  const float* gp = g.typed_data();
  const float* mp = m.typed_data();
  float* mo = m_out->typed_data();
  int32_t* ip = idx_out->typed_data();
  float* vp = val_out->typed_data();
  ParallelFor(pool, chunks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * kN + kScratch + 16);
    float* x = buf.data();
    float* y = x + kN;
    float* scratch = y + kN;
    std::vector<Entry> cands(static_cast<size_t>(8 * k));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t b = c / (A * B), a = (c / B) % A, col = c % B;
      const int64_t base = (b * n1 + a * kC) * n2 + col * kC;
      for (int i = 0; i < kC; ++i) std::memcpy(x + i * kC, gp + base + i * n2, kC * sizeof(float));
      Dct2d(t, x, y, scratch);
      for (int i = 0; i < kC; ++i) {
        const float* mr = mp + base + i * n2;
        float* yr = y + i * kC;
        for (int j = 0; j < kC; ++j) yr[j] = decay * mr[j] + lr * yr[j];
      }
      SelectTopK(y, static_cast<int>(k), ip + c * k, vp + c * k, cands);
      for (int i = 0; i < kC; ++i) std::memcpy(mo + base + i * n2, y + i * kC, kC * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistroJaxDemoCompress, CompressImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k"));

// The receiving side for one tensor: every chunk's mean over the workers
// that chose each coefficient (folded in the given worker order with
// distro_jax.codec.aggregate's running mean, so the same bits), then its
// inverse DCT. The first stage of the inverse runs over the chunk's nonzero
// coefficients only (at most workers * k of 4096).
static ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> idx,
                             ffi::Buffer<ffi::F32> val, ffi::Buffer<ffi::S32> order,
                             ffi::Buffer<ffi::S32> valid, ffi::Buffer<ffi::F32> table,
                             ffi::ResultBuffer<ffi::F32> out) {
  const auto d = idx.dimensions();
  const auto od = out->dimensions();
  if (d.size() != 3 || od.size() < 2 || table.element_count() != kTableFloats)
    return ffi::Error::InvalidArgument("demo_decode: bad shapes");
  const int64_t workers = d[0], rows = d[1], k = d[2];
  const int64_t n1 = od[od.size() - 2], n2 = od[od.size() - 1];
  if (n1 % kC || n2 % kC || static_cast<int64_t>(out->element_count()) != rows * kN)
    return ffi::Error::InvalidArgument("demo_decode: output does not match the chunks");
  const int64_t A = n1 / kC, B = n2 / kC;
  const Tables t = ReadTables(table.typed_data());
  const int32_t* ip = idx.typed_data();
  const float* vp = val.typed_data();
  const int32_t* op = order.typed_data();
  const int32_t* ok = valid.typed_data();
  float* qp = out->typed_data();
  ParallelFor(pool, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(3 * kN + kScratch + 16);
    float* z = buf.data();
    float* r = z + kN;
    float* q = r + kN;
    float* scratch = q + kN;
    // z and count stay zero between chunks: each chunk clears what it touched.
    std::fill(buf.begin(), buf.begin() + kN, 0.f);
    std::vector<int32_t> count(kN, 0);
    std::vector<int32_t> touched;
    touched.reserve(static_cast<size_t>(workers * k));
    for (int64_t c = begin; c < end; ++c) {
      touched.clear();
      for (int64_t i = 0; i < workers; ++i) {
        const int64_t w = op[i];
        if (!ok[w]) continue;
        const int32_t* iw = ip + (w * rows + c) * k;
        const float* vw = vp + (w * rows + c) * k;
        for (int64_t e = 0; e < k; ++e) {
          const int32_t p = iw[e] & (kN - 1);  // a corrupt index stays in the chunk
          const int n = ++count[p];
          if (n == 1) touched.push_back(p);
          z[p] = z[p] + (vw[e] - z[p]) / static_cast<float>(n);
        }
      }
      // R = Z D along the chunk's second axis, from the coefficients sent, in
      // the order they first arrived (fixed by the worker order).
      std::memset(r, 0, kN * sizeof(float));
      for (const int32_t p : touched) {
        const float v = z[p];
        z[p] = 0.f;
        count[p] = 0;
        const float* dj = t.basis + (p % kC) * kC;
        float* ri = r + (p / kC) * kC;
        for (int n = 0; n < kC; ++n) ri[n] += v * dj[n];
      }
      // D^T R along the first axis: the orthonormal scale of row i, then DCT-III.
      for (int j = 0; j < kC; ++j) r[j] *= t.scale0;
      for (int i = 1; i < kC; ++i)
        for (int j = 0; j < kC; ++j) r[i * kC + j] *= t.scale;
      Dct3Rows(t, r, q, 6, scratch);
      const int64_t b = c / (A * B), a = (c / B) % A, col = c % B;
      const int64_t base = (b * n1 + a * kC) * n2 + col * kC;
      for (int i = 0; i < kC; ++i) std::memcpy(qp + base + i * n2, q + i * kC, kC * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistroJaxDemoDecode, DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
