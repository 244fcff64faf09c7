// DeMo's two param-sized passes as fused CPU kernels, for 64x64 chunks.
//
// XLA's CPU backend runs the chunked DCT as dense 64x64 matmuls and the top-k
// as a heap over each row, each a pass of its own over param-sized buffers.
// Here each chunk is read once, transformed, selected from and written back
// while it sits in cache, and the DCT is the even/odd recursion, with the
// DCT-IV taken from a DCT-II (about a tenth of the dense matmul's flops).
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kC = 64;           // chunk side
constexpr int kN = kC * kC;      // coefficients per chunk
constexpr int kGroup = 8;        // entries per group in the top-k's first stage
constexpr int kGroups = kN / kGroup;

// The caller's table: for sizes M = 32, 16, ..., 2 the twiddles
// 2 cos(pi (2n+1) / 4M), n < M, then cos(pi / 4) (the DCT-IV of size 1), then
// the two orthonormal scales (1/8 and 1/sqrt(32)), then the orthonormal
// 64x64 DCT-II basis.
constexpr int kTwiddleFloats = 32 + 16 + 8 + 4 + 2 + 1;
constexpr int kTableFloats = kTwiddleFloats + 2 + kN;

struct Tables {
  const float* twiddle[6];  // by log2 of the size; [0] is cos(pi / 4)
  float scale0, scale;
  const float* basis;
};

Tables ReadTables(const float* t) {
  Tables out{};
  const float* p = t;
  for (int m = 5; m >= 0; --m) {
    out.twiddle[m] = p;
    p += 1 << m;
  }
  out.scale0 = p[0];
  out.scale = p[1];
  out.basis = p + 2;
  return out;
}

// Eight floats as one value, for loops the compiler does not vectorize well
// on its own (it cannot rule out that the rows alias). GCC and Clang lower it
// to the machine's vectors, or to scalars; each lane is its own IEEE
// operation, so the bits are those of the plain loop.
typedef float F8 __attribute__((vector_size(32)));

inline F8 Load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store8(float* p, F8 v) { std::memcpy(p, &v, sizeof(v)); }

// The 1-D transforms below run down the rows of an array of rows of kC
// floats, one transform per column, so each step is a vector op over a row.
// Row r of an input or output sits at base + r * stride floats, which lets
// the even and odd halves of an output land in place without a copy. N is a
// compile-time size so every loop unrolls as far as the compiler likes.
template <int N>
struct Dct {
  static constexpr int H = N / 2;

  // Unnormalized DCT-II: out_k = sum_n x_n cos(pi (2n+1) k / 2N). Its even
  // outputs are the half-size DCT-II of the folded sums, its odd outputs the
  // half-size DCT-IV of the folded differences.
  static void II(const Tables& t, const float* x, int64_t xs, float* out, int64_t os,
                 float* scratch) {
    float* u = scratch;
    float* v = u + H * kC;
    for (int n = 0; n < H; ++n) {
      const float* lo = x + n * xs;
      const float* hi = x + (N - 1 - n) * xs;
      for (int w = 0; w < kC; w += 8) {
        const F8 a = Load8(lo + w), b = Load8(hi + w);
        Store8(u + n * kC + w, a + b);
        Store8(v + n * kC + w, a - b);
      }
    }
    Dct<H>::IV(t, v, kC, out + os, 2 * os, v + H * kC);
    Dct<H>::II(t, u, kC, out, 2 * os, v + H * kC);
  }

  // Unnormalized DCT-III, the transpose of II: out_n = sum_k z_k cos(pi (2n+1) k / 2N).
  static void III(const Tables& t, const float* z, int64_t zs, float* out, int64_t os,
                  float* scratch) {
    float* a = scratch;
    float* b = a + H * kC;
    Dct<H>::III(t, z, 2 * zs, a, kC, b + H * kC);
    Dct<H>::IV(t, z + zs, 2 * zs, b, kC, b + H * kC);  // a DCT-IV matrix is symmetric
    for (int n = 0; n < H; ++n) {
      float* lo = out + n * os;
      float* hi = out + (N - 1 - n) * os;
      for (int w = 0; w < kC; w += 8) {
        const F8 x = Load8(a + n * kC + w), y = Load8(b + n * kC + w);
        Store8(lo + w, x + y);
        Store8(hi + w, x - y);
      }
    }
  }

  // Unnormalized DCT-IV: out_k = sum_n v_n cos(pi (2n+1)(2k+1) / 4N). With V
  // the DCT-II of v_n * 2 cos(pi (2n+1) / 4N), V_0 = 2 out_0 and
  // V_k = out_k + out_{k-1} (a product of cosines is a sum of two), so out
  // follows from V in one pass: O(N log N) in all, not the N^2 of the matrix.
  static void IV(const Tables& t, const float* v, int64_t vs, float* out, int64_t os,
                 float* scratch) {
    const float* tw = t.twiddle[Log2()];
    float* u = scratch;
    for (int n = 0; n < N; ++n)
      for (int w = 0; w < kC; w += 8) Store8(u + n * kC + w, Load8(v + n * vs + w) * tw[n]);
    II(t, u, kC, out, os, u + N * kC);
    for (int w = 0; w < kC; w += 8) Store8(out + w, Load8(out + w) * 0.5f);
    for (int k = 1; k < N; ++k)
      for (int w = 0; w < kC; w += 8)
        Store8(out + k * os + w, Load8(out + k * os + w) - Load8(out + (k - 1) * os + w));
  }

  static constexpr int Log2() { return N == 1 ? 0 : 1 + Dct<H>::Log2(); }
};

template <>
struct Dct<1> {
  static void II(const Tables&, const float* x, int64_t, float* out, int64_t, float*) {
    std::memcpy(out, x, kC * sizeof(float));
  }
  static void III(const Tables&, const float* z, int64_t, float* out, int64_t, float*) {
    std::memcpy(out, z, kC * sizeof(float));
  }
  static void IV(const Tables& t, const float* v, int64_t, float* out, int64_t, float*) {
    for (int w = 0; w < kC; w += 8) Store8(out + w, t.twiddle[0][0] * Load8(v + w));
  }
  static constexpr int Log2() { return 0; }
};

// One 8x8 tile transposed: out[b][a] = in[a][b], rows at strides is and os.
// A transpose moves values and computes nothing, so the vector form and the
// plain loop give the same bits.
inline void Transpose8x8(const float* __restrict__ in, int64_t is, float* __restrict__ out,
                         int64_t os) {
#if defined(__AVX__)
  __m256 r[8];
  for (int a = 0; a < 8; ++a) r[a] = _mm256_loadu_ps(in + a * is);
  // Pairs, then quads, then halves: the usual three rounds of shuffles.
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(out + 0 * os, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(out + 1 * os, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(out + 2 * os, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(out + 3 * os, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(out + 4 * os, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(out + 5 * os, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(out + 6 * os, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(out + 7 * os, _mm256_permute2f128_ps(u3, u7, 0x31));
#else
  for (int a = 0; a < 8; ++a)
    for (int b = 0; b < 8; ++b) out[b * os + a] = in[a * is + b];
#endif
}

// A 64x64 block transposed: out[j][i] = in[i][j], rows at strides is and os.
void Transpose(const float* in, int64_t is, float* out, int64_t os) {
  for (int i = 0; i < kC; i += 8)
    for (int j = 0; j < kC; j += 8) Transpose8x8(in + i * is + j, is, out + j * os + i, os);
}

// Scratch a chunk's work needs, in floats.
constexpr int kScratch = 8 * kN;

// The orthonormal scale of frequency i: 1/8 for 0, 1/sqrt(32) for the rest.
inline float Scale(const Tables& t, int i) { return i ? t.scale : t.scale0; }

// Orthonormal 2-D DCT of a chunk given transposed (xt[j][i] = x[i][j]), into
// y in the chunk's own orientation. Starting transposed saves a transpose:
// C xt = C x^T, its transpose is x C^T, and C (x C^T) is the transform.
__attribute__((flatten)) void Dct2dFromTransposed(const Tables& t, const float* xt, float* y,
                                                  float* scratch) {
  float* t1 = scratch;
  float* t2 = t1 + kN;
  float* rest = t2 + kN;
  Dct<kC>::II(t, xt, kC, t1, kC, rest);
  Transpose(t1, kC, t2, kC);
  Dct<kC>::II(t, t2, kC, y, kC, rest);
  float s[kC];
  for (int i = 0; i < kC; ++i) s[i] = Scale(t, i);
  for (int i = 0; i < kC; ++i)
    for (int j = 0; j < kC; ++j) y[i * kC + j] = y[i * kC + j] * s[i] * s[j];
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
  // Magnitudes by clearing the sign bit (std::fabs compiles to a mask), so
  // -0.0 counts as 0.0, as jnp.abs has it.
  alignas(64) float maxima[kGroups];
  for (int g = 0; g < kGroups; ++g) maxima[g] = std::fabs(y[g * kGroup]);
  for (int e = 1; e < kGroup; ++e)
    for (int g = 0; g < kGroups; ++g) {
      const float a = std::fabs(y[g * kGroup + e]);
      maxima[g] = maxima[g] < a ? a : maxima[g];
    }
  // Any entry with an all-ones exponent (inf or NaN)? An OR over the words
  // vectorizes where a search with an early exit would not.
  uint32_t special = 0;
  for (int p = 0; p < kN; ++p) {
    uint32_t u;
    std::memcpy(&u, y + p, sizeof(u));
    special |= (u & 0x7f800000u) == 0x7f800000u;
  }
  if (special) {
    int first = 0;
    while (y[first] - y[first] == 0.f) ++first;
    for (int e = 0; e < k; ++e) {
      idx[e] = e;
      val[e] = y[e];
    }
    val[0] = y[first];
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
      const float a = std::fabs(y[p]);
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

// Each thread's buffers for a chunk's work, allocated once: a fresh
// allocation per piece of work would map and fault in new pages every time.
struct Workspace {
  std::vector<float> floats;
  std::vector<int32_t> ints;
  std::vector<Entry> cands;
  std::vector<int32_t> touched;
  Workspace() : floats(3 * kN + kScratch), ints(kN, 0) {}
};

Workspace& ThreadWorkspace() {
  thread_local Workspace w;
  return w;
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

// One chunk of CompressImpl; g, m and m_out point at the chunk's first entry
// in matrices with rows of `stride` floats.
void CompressChunk(const Tables& t, const float* g, const float* m, float* m_out, int64_t stride,
                   float decay, float lr, int k, const int32_t* given, int32_t* idx, float* val,
                   float* x, float* y, float* scratch, std::vector<Entry>& cands) {
  // Read transposed: x[j][i] = g[i][j].
  Transpose(g, stride, x, kC);
  Dct2dFromTransposed(t, x, y, scratch);
  for (int i = 0; i < kC; ++i) {
    const float* mr = m + i * stride;
    float* yr = y + i * kC;
    for (int j = 0; j < kC; ++j) yr[j] = decay * mr[j] + lr * yr[j];
  }
  if (given == nullptr) {
    SelectTopK(y, k, idx, val, cands);
  } else {
    // Drawn positions: the values there, as codec.gather_blocks reads them.
    for (int e = 0; e < k; ++e) val[e] = y[given[e] & (kN - 1)];
  }
  for (int i = 0; i < kC; ++i) std::memcpy(m_out + i * stride, y + i * kC, kC * sizeof(float));
}

// distro_jax.codec._mix32: a bijective scramble of a 32-bit word.
inline uint32_t Mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  return h ^ (h >> 16);
}

// distro_jax.codec.worker_order: the workers sorted by two wrapping sums of
// a hash of each (flat position, value bits) they sent, ties kept in order.
std::vector<int64_t> WorkerOrder(ffi::ThreadPool& pool, const int32_t* ip, const float* vp,
                                 int64_t workers, int64_t rows, int64_t k, uint32_t chunk_size) {
  std::vector<uint32_t> key_a(workers), key_b(workers);
  ParallelFor(pool, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      uint32_t a = 0, b = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t* iw = ip + (w * rows + r) * k;
        const float* vw = vp + (w * rows + r) * k;
        for (int64_t e = 0; e < k; ++e) {
          const uint32_t pos = static_cast<uint32_t>(r) * chunk_size + static_cast<uint32_t>(iw[e]);
          uint32_t bits;
          std::memcpy(&bits, vw + e, sizeof(bits));
          a += Mix32(Mix32(pos ^ 0x27D4EB2Fu) ^ bits);
          b += Mix32(Mix32(pos ^ 0x165667B1u) ^ bits);
        }
      }
      key_a[w] = a;
      key_b[w] = b;
    }
  });
  std::vector<int64_t> order(workers);
  for (int64_t w = 0; w < workers; ++w) order[w] = w;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return key_a[x] != key_a[y] ? key_a[x] < key_a[y] : key_b[x] < key_b[y];
  });
  return order;
}


// ---------------------------------------------------------------------------
// Drawn positions: distro_jax.codec.draw_positions, bit for bit.
//
// jax.random.randint(key, shape, lo, hi) with the threefry2x32 generator and
// jax_threefry_partitionable (JAX's default): the key is split in two, each
// half hashes the entry's flat index (as a 64-bit counter, high word first)
// into 32 bits (the two output words xor-ed), and the two draws are folded
// into [lo, hi) with JAX's modular arithmetic. With a frequency bias the
// draw is a ticket, and the position is the number of ticket ends at or
// below it (jnp.searchsorted(ends, ticket, side="right")).

inline uint32_t Rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// Threefry-2x32, 20 rounds, of the counter (hi, lo) under key (k0, k1);
// returns the xor of the two output words.
inline uint32_t ThreefryBits(uint32_t k0, uint32_t k1, uint32_t hi, uint32_t lo) {
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  uint32_t x0 = hi + k0, x1 = lo + k1;
#define DISTRO_JAX_ROUND(r) \
  x0 += x1;                 \
  x1 = Rotl(x1, r);         \
  x1 ^= x0;
#define DISTRO_JAX_ROUNDS_A \
  DISTRO_JAX_ROUND(13) DISTRO_JAX_ROUND(15) DISTRO_JAX_ROUND(26) DISTRO_JAX_ROUND(6)
#define DISTRO_JAX_ROUNDS_B \
  DISTRO_JAX_ROUND(17) DISTRO_JAX_ROUND(29) DISTRO_JAX_ROUND(16) DISTRO_JAX_ROUND(24)
  DISTRO_JAX_ROUNDS_A x0 += k1; x1 += k2 + 1u;
  DISTRO_JAX_ROUNDS_B x0 += k2; x1 += k0 + 2u;
  DISTRO_JAX_ROUNDS_A x0 += k0; x1 += k1 + 3u;
  DISTRO_JAX_ROUNDS_B x0 += k1; x1 += k2 + 4u;
  DISTRO_JAX_ROUNDS_A x0 += k2; x1 += k0 + 5u;
#undef DISTRO_JAX_ROUNDS_B
#undef DISTRO_JAX_ROUNDS_A
#undef DISTRO_JAX_ROUND
  return x0 ^ x1;
}

// a % d for every 32-bit a and a fixed d > 0, without a division (which
// does not vectorize): Lemire's multiply-high with magic = ceil(2^64 / d)
// (0 for d = 1, where every remainder is 0), exact for all a.
struct ModBy {
  uint32_t d;
  uint64_t magic;
  explicit ModBy(uint32_t divisor) : d(divisor), magic(~uint64_t{0} / divisor + 1) {}
  uint32_t operator()(uint32_t a) const {
    const uint64_t low = magic * a;
    return static_cast<uint32_t>(((low >> 32) * d + (((low & 0xffffffffu) * d) >> 32)) >> 32);
  }
};

// One run's part of jax.random.randint: two 32-bit draws folded into
// [lo, hi) as JAX folds them (its multiplier is 2^32 mod span, and the
// products wrap at 32 bits as XLA's do).
struct Fold {
  int32_t lo;
  ModBy mod;
  uint32_t mult;
  Fold(int32_t lo_, int32_t hi_)
      : lo(lo_), mod(hi_ > lo_ ? static_cast<uint32_t>(hi_ - lo_) : 1u), mult(0) {
    const uint32_t m = 65536u % mod.d;
    mult = (m * m) % mod.d;
  }
  int32_t operator()(uint32_t higher, uint32_t lower) const {
    const uint32_t offset = mod(mod(higher) * mult + mod(lower));
    return lo + static_cast<int32_t>(offset);
  }
};

// The number of ends at or below t (ends strictly increasing, n >= 1): a
// search with a fixed number of steps and no branch on the data.
inline int32_t CountAtOrBelow(const int32_t* ends, int64_t n, int32_t t) {
  const int32_t* base = ends;
  while (n > 1) {
    const int64_t half = n / 2;
    base = base[half] <= t ? base + half : base;
    n -= half;
  }
  return static_cast<int32_t>(base - ends) + (base[0] <= t);
}

// ---------------------------------------------------------------------------
// 8x8 chunks (one drawn position of each, the message recommended past
// 1,000x). A chunk is 8 floats of 8 rows, so the kernels work on bands: the
// 8 rows of one chunk row, cut into tiles of columns. Along the rows every
// step is a vector op over a tile; within a chunk, over its 8 outputs. The
// 8-point transforms are dense (8 products per entry and axis), from the
// orthonormal basis the caller passes (distro_jax.dct's own).

constexpr int kS = 8;             // chunk side
constexpr int kSN = kS * kS;      // coefficients per chunk
constexpr int64_t kTile = 512;    // columns per piece of work

// The 8x8 blocks of an 8-row band, each transposed: out[j][8c + i] = in[i][8c + j].
void TransposeBlocks8(const float* __restrict__ in, int64_t is, float* __restrict__ out, int64_t os,
                      int64_t cols) {
  for (int64_t c = 0; c < cols; c += kS) Transpose8x8(in + c, is, out + c, os);
}

// out = D in along the band's rows (each column on its own): 8 products per
// entry, each column's 8 inputs read once and its 8 outputs written once.
// cols is a multiple of 8.
void Rows8(const float* __restrict__ D, const float* __restrict__ in, int64_t is,
           float* __restrict__ out, int64_t os, int64_t cols) {
  for (int64_t c = 0; c < cols; c += kS) {
    F8 x[kS];
    for (int p = 0; p < kS; ++p) x[p] = Load8(in + p * is + c);
    for (int i = 0; i < kS; ++i) {
      F8 a = D[i * kS] * x[0];
      for (int p = 1; p < kS; ++p) a = a + D[i * kS + p] * x[p];
      Store8(out + i * os + c, a);
    }
  }
}

// y = D x D^T for the chunks of a band tile: x is 8 rows of `cols` floats at
// row stride xs, y 8 rows of `cols` at stride cols. Both stages run down the
// rows: D x, then (D (D x)^T)^T with each block transposed around it. t and u
// hold 8 * cols floats each.
void Forward8(const float* D, const float* x, int64_t xs, float* y, int64_t cols, float* t,
              float* u) {
  Rows8(D, x, xs, t, cols, cols);
  TransposeBlocks8(t, cols, u, cols, cols);
  Rows8(D, u, cols, t, cols, cols);
  TransposeBlocks8(t, cols, y, cols, cols);
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
  ParallelFor(pool, chunks, 64, [&](int64_t begin, int64_t end) {
    Workspace& ws = ThreadWorkspace();
    float* x = ws.floats.data();
    float* y = x + kN;
    float* scratch = y + kN;
    std::vector<Entry>& cands = ws.cands;
    if (cands.size() < static_cast<size_t>(8 * k)) cands.resize(static_cast<size_t>(8 * k));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t b = c / (A * B), a = (c / B) % A, col = c % B;
      const int64_t base = (b * n1 + a * kC) * n2 + col * kC;
      CompressChunk(t, gp + base, mp + base, mo + base, n2, decay, lr, static_cast<int>(k),
                    nullptr, ip + c * k, vp + c * k, x, y, scratch, cands);
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
// that chose each coefficient (folded in distro_jax.codec.worker_order's
// order with distro_jax.codec.aggregate_blocks's running mean, so the same bits),
// then its inverse DCT. The first stage of the inverse runs over the
// coefficients sent only (at most workers * k of 4096).
static ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> idx,
                             ffi::Buffer<ffi::F32> val, ffi::Buffer<ffi::S32> valid,
                             ffi::Buffer<ffi::F32> table,
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
  const int32_t* ok = valid.typed_data();
  const std::vector<int64_t> order = WorkerOrder(pool, ip, vp, workers, rows, k, kN);
  const int64_t* op = order.data();
  float* qp = out->typed_data();
  ParallelFor(pool, rows, 64, [&](int64_t begin, int64_t end) {
    Workspace& ws = ThreadWorkspace();
    float* z = ws.floats.data();
    float* r = z + kN;
    float* q = r + kN;
    float* scratch = q + kN;
    // z and count stay zero between chunks: each chunk clears what it touched.
    std::fill(z, z + kN, 0.f);
    std::vector<int32_t>& count = ws.ints;
    std::vector<int32_t>& touched = ws.touched;
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
      Dct<kC>::III(t, r, kC, q, kC, scratch);
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// codec.draw_positions for one or more keys (a vmap over the senders stacks
// them): keys (N, 4) uint32, each the key data of jax.random.split(key) (the
// key of the higher draw, then of the lower); lo and hi (k) the tickets of
// each run; ends (n) each position's last ticket plus one, or a single -1 for
// a uniform draw, whose ticket is the position. out (N, rows, k): the
// positions of every chunk, entry f of a key drawn from counter f.
static ffi::Error DrawImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys,
                           ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                           ffi::Buffer<ffi::S32> ends, ffi::ResultBuffer<ffi::S32> out) {
  const int64_t k = static_cast<int64_t>(lo.element_count());
  const int64_t n_keys = static_cast<int64_t>(keys.element_count()) / 4;
  const int64_t total = static_cast<int64_t>(out->element_count());
  if (k < 1 || static_cast<int64_t>(hi.element_count()) != k || keys.element_count() % 4 ||
      n_keys < 1 || total % (n_keys * k))
    return ffi::Error::InvalidArgument("demo_draw: bad shapes");
  const int64_t per_key = total / n_keys;
  if (per_key > static_cast<int64_t>(UINT32_MAX))
    return ffi::Error::InvalidArgument("demo_draw: more than 2^32 positions per key");
  const int64_t n = static_cast<int64_t>(ends.element_count());
  const int32_t* ep = ends.typed_data();
  const bool uniform = n == 1 && ep[0] < 0;
  std::vector<Fold> folds;
  for (int64_t j = 0; j < k; ++j) folds.emplace_back(lo.typed_data()[j], hi.typed_data()[j]);
  const uint32_t* kp = keys.typed_data();
  int32_t* op = out->typed_data();
  constexpr int64_t kPiece = 4096;
  const int64_t pieces = (per_key + kPiece - 1) / kPiece;
  ParallelFor(pool, n_keys * pieces, 4, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t higher[kPiece], lower[kPiece];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t key = w / pieces;
      const int64_t f0 = (w % pieces) * kPiece;
      const int64_t len = std::min(kPiece, per_key - f0);
      const uint32_t* kk = kp + 4 * key;
      // The hashes first, in a loop of their own, which vectorizes.
      for (int64_t i = 0; i < len; ++i) {
        const uint32_t f = static_cast<uint32_t>(f0 + i);
        higher[i] = ThreefryBits(kk[0], kk[1], 0u, f);
        lower[i] = ThreefryBits(kk[2], kk[3], 0u, f);
      }
      int32_t* o = op + key * per_key + f0;
      if (k == 1) {
        const Fold fold = folds[0];
        for (int64_t i = 0; i < len; ++i) o[i] = fold(higher[i], lower[i]);
      } else {
        for (int64_t i = 0; i < len; ++i) o[i] = folds[(f0 + i) % k](higher[i], lower[i]);
      }
      if (!uniform)
        for (int64_t i = 0; i < len; ++i) o[i] = CountAtOrBelow(ep, n, o[i]);
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistroJaxDemoDraw, DrawImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// The worker side for 64x64 chunks at positions given (drawn): as
// CompressImpl, with the values at `positions` (rows, k) in place of the top-k.
static ffi::Error CompressAtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> g,
                                 ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> decay_lr,
                                 ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> positions,
                                 ffi::ResultBuffer<ffi::F32> m_out,
                                 ffi::ResultBuffer<ffi::F32> val_out) {
  const auto dims = g.dimensions();
  if (dims.size() < 2 || table.element_count() != kTableFloats)
    return ffi::Error::InvalidArgument("demo_compress_at: bad shapes");
  const int64_t n1 = dims[dims.size() - 2], n2 = dims[dims.size() - 1];
  if (n1 % kC || n2 % kC) return ffi::Error::InvalidArgument("demo_compress_at: not 64x64 chunks");
  const int64_t A = n1 / kC, B = n2 / kC;
  const int64_t chunks = static_cast<int64_t>(g.element_count()) / kN;
  const int64_t k = static_cast<int64_t>(positions.element_count()) / chunks;
  if (k < 1 || k * chunks != static_cast<int64_t>(positions.element_count()))
    return ffi::Error::InvalidArgument("demo_compress_at: positions do not match the chunks");
  const Tables t = ReadTables(table.typed_data());
  const float decay = decay_lr.typed_data()[0], lr = decay_lr.typed_data()[1];
  const float* gp = g.typed_data();
  const float* mp = m.typed_data();
  const int32_t* pp = positions.typed_data();
  float* mo = m_out->typed_data();
  float* vp = val_out->typed_data();
  ParallelFor(pool, chunks, 64, [&](int64_t begin, int64_t end) {
    Workspace& ws = ThreadWorkspace();
    float* x = ws.floats.data();
    float* y = x + kN;
    float* scratch = y + kN;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t b = c / (A * B), a = (c / B) % A, col = c % B;
      const int64_t base = (b * n1 + a * kC) * n2 + col * kC;
      CompressChunk(t, gp + base, mp + base, mo + base, n2, decay, lr, static_cast<int>(k),
                    pp + c * k, nullptr, vp + c * k, x, y, scratch, ws.cands);
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistroJaxDemoCompressAt, CompressAtImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

namespace {

// The shape of a (batch, n1, n2) tensor of 8x8 chunks, cut into pieces of
// work: a band (8 rows of one matrix) by a tile of up to kTile columns.
struct Bands8 {
  int64_t n1, n2, A, B, bands, tiles;
  bool Init(ffi::Span<const int64_t> dims, int64_t elements) {
    if (dims.size() < 2) return false;
    n1 = dims[dims.size() - 2];
    n2 = dims[dims.size() - 1];
    if (n1 % kS || n2 % kS || n1 == 0 || n2 == 0) return false;
    A = n1 / kS;
    B = n2 / kS;
    bands = elements / (kS * n2);
    tiles = (n2 + kTile - 1) / kTile;
    return true;
  }
  int64_t rows() const { return bands * B; }
};

}  // namespace

// The worker side for 8x8 chunks, at positions given (drawn): the momentum
// m' = decay * m + lr * DCT(g) and the values of m' at `positions` (rows, k).
// basis: the orthonormal 8x8 DCT-II matrix, row-major.
static ffi::Error Compress8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> g,
                                ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> decay_lr,
                                ffi::Buffer<ffi::F32> basis, ffi::Buffer<ffi::S32> positions,
                                ffi::ResultBuffer<ffi::F32> m_out,
                                ffi::ResultBuffer<ffi::F32> val_out) {
  Bands8 s;
  if (!s.Init(g.dimensions(), static_cast<int64_t>(g.element_count())) ||
      basis.element_count() != kSN)
    return ffi::Error::InvalidArgument("demo_compress8: not 8x8 chunks");
  const int64_t k = static_cast<int64_t>(positions.element_count()) / s.rows();
  if (k < 1 || k * s.rows() != static_cast<int64_t>(positions.element_count()))
    return ffi::Error::InvalidArgument("demo_compress8: positions do not match the chunks");
  const float* D = basis.typed_data();
  const float decay_value = decay_lr.typed_data()[0], lr_value = decay_lr.typed_data()[1];
  const float* gp = g.typed_data();
  const float* mp = m.typed_data();
  const int32_t* pp = positions.typed_data();
  float* mo = m_out->typed_data();
  float* vp = val_out->typed_data();
  ParallelFor(pool, s.bands * s.tiles, 4, [&, s](int64_t begin, int64_t end) {
    // Locals, not captures: a store through a float pointer could alias a
    // captured reference, and the compiler would reload it every time.
    const float decay = decay_value, lr = lr_value;
    const int64_t n2 = s.n2;
    Workspace& ws = ThreadWorkspace();
    float* t = ws.floats.data();
    float* u = t + kS * kTile;
    float* y = u + kS * kTile;
    for (int64_t piece = begin; piece < end; ++piece) {
      const int64_t band = piece / s.tiles, c0 = (piece % s.tiles) * kTile;
      const int64_t w = std::min(kTile, n2 - c0);
      const int64_t base = band * kS * n2 + c0;
      Forward8(D, gp + base, n2, y, w, t, u);
      for (int i = 0; i < kS; ++i) {
        const float* mr = mp + base + i * n2;
        float* mw = mo + base + i * n2;
        float* yr = y + i * w;
        for (int64_t c = 0; c < w; c += kS) {
          const F8 v = decay * Load8(mr + c) + lr * Load8(yr + c);
          Store8(yr + c, v);
          Store8(mw + c, v);
        }
      }
      const int64_t row0 = band * s.B + c0 / kS;
      for (int64_t cc = 0; cc < w / kS; ++cc) {
        const int32_t* pr = pp + (row0 + cc) * k;
        float* vr = vp + (row0 + cc) * k;
        for (int64_t e = 0; e < k; ++e) {
          const int32_t p = pr[e] & (kSN - 1);
          vr[e] = y[(p / kS) * w + cc * kS + p % kS];
        }
      }
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistroJaxDemoCompress8, Compress8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The receiving side for a tensor of 8x8 chunks: every chunk's mean over the
// workers that sent each coefficient (folded in distro_jax.codec.worker_order's
// order with codec.aggregate_blocks's running mean, so the same bits), then its
// inverse DCT, D^T Z D, whose first stage reads only the coefficients sent.
static ffi::Error Decode8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> idx,
                              ffi::Buffer<ffi::F32> val, ffi::Buffer<ffi::S32> valid,
                              ffi::Buffer<ffi::F32> basis, ffi::ResultBuffer<ffi::F32> out) {
  const auto d = idx.dimensions();
  Bands8 s;
  if (d.size() != 3 || basis.element_count() != kSN ||
      !s.Init(out->dimensions(), static_cast<int64_t>(out->element_count())))
    return ffi::Error::InvalidArgument("demo_decode8: bad shapes");
  const int64_t workers = d[0], rows = d[1], k = d[2];
  if (rows != s.rows()) return ffi::Error::InvalidArgument("demo_decode8: rows do not match");
  const float* D = basis.typed_data();
  alignas(32) float DT[kSN];
  for (int i = 0; i < kS; ++i)
    for (int j = 0; j < kS; ++j) DT[j * kS + i] = D[i * kS + j];
  const int32_t* ip = idx.typed_data();
  const float* vp = val.typed_data();
  const int32_t* ok = valid.typed_data();
  const std::vector<int64_t> order = WorkerOrder(pool, ip, vp, workers, rows, k, kSN);
  const int64_t* op = order.data();
  float* qp = out->typed_data();
  ParallelFor(pool, s.bands * s.tiles, 4, [&](int64_t begin, int64_t end) {
    Workspace& ws = ThreadWorkspace();
    float* r = ws.floats.data();  // Z D of the tile's chunks, 8 rows of w
    float* z = r + kS * kTile;    // one chunk's mean; zero between chunks
    std::fill(z, z + kSN, 0.f);
    std::vector<int32_t>& count = ws.ints;
    std::vector<int32_t>& touched = ws.touched;
    for (int64_t piece = begin; piece < end; ++piece) {
      const int64_t band = piece / s.tiles, c0 = (piece % s.tiles) * kTile;
      const int64_t w = std::min(kTile, s.n2 - c0);
      std::memset(r, 0, kS * w * sizeof(float));
      const int64_t row0 = band * s.B + c0 / kS;
      for (int64_t cc = 0; cc < w / kS; ++cc) {
        const int64_t c = row0 + cc;
        touched.clear();
        for (int64_t i = 0; i < workers; ++i) {
          const int64_t wk = op[i];
          if (!ok[wk]) continue;
          const int32_t* iw = ip + (wk * rows + c) * k;
          const float* vw = vp + (wk * rows + c) * k;
          for (int64_t e = 0; e < k; ++e) {
            const int32_t p = iw[e] & (kSN - 1);
            const int n = ++count[p];
            if (n == 1) touched.push_back(p);
            z[p] = z[p] + (vw[e] - z[p]) / static_cast<float>(n);
          }
        }
        // R = Z D along the chunk's second axis, in the order the
        // coefficients first arrived (fixed by the worker order).
        for (const int32_t p : touched) {
          const float v = z[p];
          z[p] = 0.f;
          count[p] = 0;
          float* ri = r + (p / kS) * w + cc * kS;
          Store8(ri, Load8(ri) + v * Load8(D + (p % kS) * kS));
        }
      }
      // Q = D^T R along the first axis, straight into the output's rows.
      Rows8(DT, r, w, qp + band * kS * s.n2 + c0, s.n2, w);
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistroJaxDemoDecode8, Decode8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
