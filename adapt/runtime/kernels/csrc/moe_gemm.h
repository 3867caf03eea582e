// MoE experts in one call: the routed slots grouped by expert, each expert's gate|up GEMM, SiLU-and-mul
// and down GEMM over its gathered rows, with the weights packed once at load, then the weighted combine.
#pragma once

#include "common.h"
#include "moe.h"

#include <atomic>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ADAPT_AMX 1
#endif

namespace adapt_cpu {

// ---------------------------------------------------------------------------------------------------
// Packed expert weights (packing and unpacking are torch reshapes: kernels/moe_tiled.py). For W [E, N, K]
// (out x in, the F.linear layout):
//  - float32, "panel": [E, N / P, K, P], P = FMA_NR (64 with AVX-512, 16 with AVX2), p[e, nb, k, c] = W[e, nb * P + c,
//    k]: a P-column panel of the transposed weight, read one k row (FMA_NV vectors) at a time by the FMA kernel;
//  - bfloat16, "vnni" (AMX): [E, N / 16, K / 32, 16, 32], p[e, nb, kb, r, 2c + q] = W[e, nb * 16 + c,
//    kb * 32 + 2r + q]: each [16, 32] block is one AMX B tile (16 k-pairs x 16 columns), 1 KB contiguous.
// The vnni form needs N % 32 == 0 (the AMX kernel takes two B tiles at a time) and K % 32 == 0.

#ifdef ADAPT_AMX
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands AMX's tile state to a process only on request (once per process, every thread)
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// tiles 0-3: a 32 x 32 float32 C block; 4, 5: two 16-row A tiles (32 bf16 of k); 6, 7: two B tiles
inline void amx_config() {
  TileConfig c{};
  c.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// MB 16-row blocks of C (MB = 1 or 2) at c (row stride ldc) = A rows at a0 (row stride K) @ the 32 columns of
// the B tile columns b0, b1 (vnni-packed, kbs tiles of k each)
template <int MB>
inline void amx_block(const bf16* a0, int64_t K, const bf16* b0, const bf16* b1, int64_t kbs, float* c, int64_t ldc,
                      const bf16* pf = nullptr) {
  const int64_t sa = K * 2, sc = ldc * 4;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (MB == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < kbs; ++kb) {
    if (pf)  // the next column pair's tiles for this kb, 2 x 1 KB (6% faster at 512 tokens than without)
      for (int64_t o = 0; o < 512; o += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(pf + kb * 512 + o), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(pf + (kbs + kb) * 512 + o), _MM_HINT_T1);
      }
    _tile_loadd(4, a0 + kb * 32, sa);
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_loadd(7, b1 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB == 2) {
      _tile_loadd(5, a0 + 16 * K + kb * 32, sa);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  if constexpr (MB == 2) {
    _tile_stored(2, c + 16 * ldc, sc);
    _tile_stored(3, c + 16 * ldc + 16, sc);
  }
}

// C [M, N] float32 (row stride ldc) = A [M, K] bf16 (row stride K) @ B^T, B vnni-packed [N / 16, K / 32,
// 16, 32]. M % 16 == 0 (rows past the caller's are zeros), N % 32 == 0, K % 32 == 0. Columns outer, so
// that a 32-column B panel stays in L1 while the row blocks stream past it.
inline void amx_gemm(const bf16* A, int64_t M, int64_t K, const bf16* B, int64_t N, float* C, int64_t ldc) {
  const int64_t kbs = K / 32;
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    const bf16* b0 = B + (n0 / 16) * kbs * 512;
    const bf16* b1 = b0 + kbs * 512;
    const bf16* pf = n0 + 32 < N ? b1 + kbs * 512 : nullptr;  // the next pair, fetched by the first block
    int64_t m0 = 0;
    for (; m0 + 32 <= M; m0 += 32, pf = nullptr) amx_block<2>(A + m0 * K, K, b0, b1, kbs, C + m0 * ldc + n0, ldc, pf);
    if (m0 < M) amx_block<1>(A + m0 * K, K, b0, b1, kbs, C + m0 * ldc + n0, ldc, pf);  // a last 16-row block
  }
}
#endif

// ---------------------------------------------------------------------------------------------------
// f(std::integral_constant<int, r>{}) for the row count r = rows of a tail block (0 < rows <= MR): the
// register-blocked kernels take their row count as a template parameter
template <int MR, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (MR > 0) {
    if (rows == MR) return f(std::integral_constant<int, MR>{});
    with_rows<MR - 1>(rows, f);
  }
}

// f(std::integral_constant<int, rows>{}, m0, block index) for each row block of an M-row GEMM: MR rows each,
// the last one the M % MR left over
template <int MR, typename F>
inline void each_row_block(int64_t M, F&& f) {
  int64_t m0 = 0, rb = 0;
  for (; m0 + MR <= M; m0 += MR, ++rb) f(std::integral_constant<int, MR>{}, m0, rb);
  if (m0 < M) with_rows<MR - 1>(M - m0, [&](auto r) { f(r, m0, rb); });
}

// A GEMM's row blocks share out the prefetch of the panel that follows (pf, pf_all 64-byte lines): block rb
// takes at most ceil(pf_all / blocks) lines, from its own first one. (q, lines); (nullptr, 0) without pf.
template <typename W>
struct PrefetchShare {
  const W* q;
  int64_t lines;
};
template <typename W>
inline PrefetchShare<W> prefetch_share(const W* pf, int64_t pf_all, int64_t blocks, int64_t rb) {
  if (!pf) return {nullptr, 0};
  const int64_t per = (pf_all + blocks - 1) / blocks, first = rb * per;
  return {pf + first * (64 / (int64_t)sizeof(W)), std::max<int64_t>(0, std::min(per, pf_all - first))};
}

#ifdef ADAPT_VW
// registers: MR * NV accumulators + NV vectors of B + 1 broadcast (32 with AVX-512, 16 with AVX2)
// AVX-512: 6 rows x 4 vectors (64 columns); 12 x 2 was 5-8% slower at 512 tokens (A/B in one process)
#ifndef ADAPT_FMA_NV
#define ADAPT_FMA_NV (VW == 16 ? 4 : 2)
#endif
#ifndef ADAPT_FMA_MR
#define ADAPT_FMA_MR 6
#endif
constexpr int FMA_NV = ADAPT_FMA_NV;
constexpr int FMA_MR = ADAPT_FMA_MR;
constexpr int64_t FMA_NR = FMA_NV * VW;  // columns per packed panel

// the sums c [MR, FMA_NR] = A [MR, K] @ one packed panel b [K, FMA_NR] (+ bias [FMA_NR]), handed to ``store``:
// FMA accumulation in k order, in registers, in float32. A by row pointers (row r at A[r]), so that A's rows
// can be a gathered subset of x read in place. W: the panel's element type, float32 or bfloat16 (widened to
// float32 as it is loaded: a CPU without bf16 dot products reads half the bytes and runs the float32 FMAs).
// store (StoreRows, or the SiLU-and-mul of fma_gate_up) writes them out: C rows of float32 or bfloat16 (rounded
// to nearest even once, after the bias). pf, pf_lines: this block's share of the next panel (64-byte lines),
// pulled into L2 evenly as k advances.
// NV: vectors per panel row (FMA_NV, the experts' and linears' panels; fewer for a narrow router's).
template <int MR, int NV = FMA_NV, typename W, typename Store>
inline void fma_block(const float* const* A, int64_t K, const W* b, const float* bias, const W* pf, int64_t pf_lines,
                      Store&& store) {
  constexpr int64_t NR = NV * VW;
  const float* a[MR];
  for (int r = 0; r < MR; ++r) a[r] = A[r];
  vf c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) c[r][j] = vzero();
  // this block's share of the prefetch, spread evenly over k: a line each time a running sum of pf_lines
  // passes K (a division per step instead, an idiv in the loop, was 4-5% slower at 512 tokens)
  const char* pq = reinterpret_cast<const char*>(pf);
  int64_t due = 0;
  // four k steps per prefetch check and loop test: 512 tokens 5.67 -> 5.24 ms with AVX-512 (AVX2 9.1 -> 8.6),
  // a 256-row dense linear 9% faster (A/B in one process); the same accumulation order, so the same bits. (The
  // step as a lambda called four times was 3-4% slower than the unrolled loop.)
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    for (due += 4 * pf_lines; due >= K; due -= K, pq += 64) _mm_prefetch(pq, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int64_t kk = k; kk < k + 4; ++kk) {
      vf v[NV];
      for (int j = 0; j < NV; ++j) v[j] = vload(b + kk * NR + j * VW);
      for (int r = 0; r < MR; ++r) {
        const vf av = vset1(a[r][kk]);
        for (int j = 0; j < NV; ++j) c[r][j] = vfma(av, v[j], c[r][j]);
      }
    }
  }
  for (; k < K; ++k) {  // the last K % 4 steps
    for (due += pf_lines; due >= K; due -= K, pq += 64) _mm_prefetch(pq, _MM_HINT_T1);
    vf v[NV];
    for (int j = 0; j < NV; ++j) v[j] = vload(b + k * NR + j * VW);
    for (int r = 0; r < MR; ++r) {
      const vf av = vset1(a[r][k]);
      for (int j = 0; j < NV; ++j) c[r][j] = vfma(av, v[j], c[r][j]);
    }
  }
  if (bias)
    for (int j = 0; j < NV; ++j) {
      const vf bv = vloadu(bias + j * VW);
      for (int r = 0; r < MR; ++r) c[r][j] = vadd(c[r][j], bv);
    }
  store(c);
}

// fma_block's plain store: row r of the block's sums to C[r] + c0
template <typename O>
struct StoreRows {
  O* const* C;
  int64_t c0;
  template <int MR, int NV>
  inline void operator()(const vf (&c)[MR][NV]) const {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) vstore(C[r] + c0 + j * VW, c[r][j]);
  }
};


// C [M, N] (float32 or bfloat16) = A [M, K] float32 @ B^T (+ bias [N]), B panel-packed [N / FMA_NR, K, FMA_NR]
// of W (float32, or bfloat16 widened as it is read); A's row r at A[r], C's at C[r] (each N wide). Panels
// outer, so that one (K x FMA_NR) stays in L2 while the row blocks stream past it; the row blocks of a panel
// share out the prefetch of the next one.
template <typename W, typename O>
inline void fma_gemm(const float* const* A, int64_t M, int64_t K, const W* B, int64_t N, O* const* C,
                     const W* next = nullptr, int64_t next_k = 0, const float* bias = nullptr) {
  constexpr int64_t per_line = 64 / sizeof(W);  // panel elements per 64-byte line
  const int64_t blocks = (M + FMA_MR - 1) / FMA_MR, lines = K * FMA_NR / per_line;  // 64-byte lines of a panel
  // the next panel's prefetch, shared out between this panel's row blocks and spread evenly over each one's k
  // loop: 512 tokens, float32, 32 experts of 2I = 512, H = 512: 7.3-8.5 -> 6.4-7.0 ms against the whole panel
  // in the first row block (4 lines a step); 16 tokens (one row block) the same; 64 tokens 4%, 2048 4.5% faster
  for (int64_t n0 = 0; n0 < N; n0 += FMA_NR) {
    const W* b = B + n0 * K;
    const bool last = n0 + FMA_NR >= N;
    // the last panel prefetches the first of the GEMM that follows (``next``, of depth next_k), if any: 1.5-3.5%
    // at 16 and 512 tokens (A/B in one process); two or more panels ahead was slower (3-8% at 512 tokens)
    const W* pf = !last ? b + K * FMA_NR : next;
    const int64_t pf_all = !last ? lines : next_k * FMA_NR / per_line;
    const float* bn = bias ? bias + n0 : nullptr;
    each_row_block<FMA_MR>(M, [&](auto rows, int64_t m0, int64_t rb) {
      const auto sh = prefetch_share(pf, pf_all, blocks, rb);
      fma_block<decltype(rows)::value>(A + m0, K, b, bn, sh.q, sh.lines, StoreRows<O>{C + m0, n0});
    });
  }
}

// SiLU-and-mul as the torch form rounds it, on float32 vectors of gate and up: T(silu(T(g))) * T(u), T = X's
// rounding (none for float32); the caller stores the product in A (rounded to X, or X's rounding kept in float)
template <typename X>
inline vf silu_mul_v(vf g, vf u) {
  const vf gv = vrnd<X>(g), uv = vrnd<X>(u);
  return vmul(vrnd<X>(vdiv(gv, vadd(vset1(1.f), vexp(vsub(vzero(), gv))))), uv);
}

// act [M, I] (row stride I, elements A: float32, or X's rounding kept in float32) = T(silu(T(gate))) * T(up) for
// gate|up [M, 2I] = A [M, K] @ B^T, B the panel-packed [2I / FMA_NR, K, FMA_NR] gate|up weight, I % FMA_NR == 0:
// gate panel j and up panel j run back to back on each row block, the gate sums parked in a block-sized buffer
// in L1 and the up sums never leaving the registers before the SiLU-and-mul; no [M, 2I] buffer and no second
// pass over it (512 tokens, float32, 32 experts top-4, H 512, I 256: 1.2% faster, A/B in one process; the same
// bits). The panel pair's row blocks prefetch the next pair; the last pair's gate blocks prefetch ``next`` (the
// down GEMM's first panel, of depth next_k).
template <typename X, typename W>
inline void fma_gate_up(const float* const* Arows, int64_t M, int64_t K, const W* B, int64_t I, float* act,
                        const W* next, int64_t next_k) {
  constexpr int64_t per_line = 64 / sizeof(W);
  const int64_t np = I / FMA_NR, blocks = (M + FMA_MR - 1) / FMA_MR, lines = K * FMA_NR / per_line;
  alignas(64) float gate[FMA_MR * FMA_NR];
  for (int64_t j = 0; j < np; ++j) {
    const W* bg = B + j * FMA_NR * K;
    const W* bu = B + (np + j) * FMA_NR * K;
    const bool last = j + 1 == np;
    const W* pfg = !last ? bg + FMA_NR * K : next;
    const W* pfu = !last ? bu + FMA_NR * K : nullptr;
    const int64_t pfg_all = !last ? lines : next_k * FMA_NR / per_line;
    auto block = [&](auto rows, int64_t m0, int64_t rb) {
      constexpr int MR = decltype(rows)::value;
      const auto sg = prefetch_share(pfg, pfg_all, blocks, rb), su = prefetch_share(pfu, lines, blocks, rb);
      fma_block<MR>(Arows + m0, K, bg, nullptr, sg.q, sg.lines, [&](const vf (&c)[MR][FMA_NV]) {
        for (int r = 0; r < MR; ++r)
          for (int v = 0; v < FMA_NV; ++v) vstore(gate + r * FMA_NR + v * VW, c[r][v]);
      });
      fma_block<MR>(Arows + m0, K, bu, nullptr, su.q, su.lines, [&](const vf (&c)[MR][FMA_NV]) {
        for (int r = 0; r < MR; ++r) {
          float* o = act + (m0 + r) * I + j * FMA_NR;
          for (int v = 0; v < FMA_NV; ++v) {
            // X's rounding kept in float32, as the two-pass form stores it (vstored_as<float, X>)
            vstoreu(o + v * VW, vrnd<X>(silu_mul_v<X>(vload(gate + r * FMA_NR + v * VW), c[r][v])));
          }
        }
      });
    };
    each_row_block<FMA_MR>(M, block);
  }
}

// row pointers p[r] = base + r * stride, r < n (into ``out``, resized)
template <typename T>
inline void row_pointers(T* base, int64_t n, int64_t stride, std::vector<T*>& out) {
  out.resize(n);
  for (int64_t r = 0; r < n; ++r) out[r] = base + r * stride;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ADAPT_DPBF16 1
// bfloat16 without AMX (AVX512-BF16: Zen 4, Cooper Lake; or AMX not granted): rows of C [MR, 16 * DP_NB]
// (float32, or bfloat16 rounded to nearest even once) = A [MR, K] (bf16, row stride K) @ DP_NB vnni-packed
// 16-column blocks (block j at b + j * bstride, [K / 32, 16, 32]: k pair kp's 16 column pairs at kp * 32).
// Each vdpbf16ps adds a pair of k products per column into float32: A's pair broadcast, B's row of 16 column
// pairs. On a 2-core Zen 4 EPYC, 12 x 2, 6 x 4, 8 x 3 and 14 x 2 accumulators all ran at the unit's peak (a
// vdpbf16ps a cycle, 225-232 GFLOP/s a core) on data in L1 and L2, and 12 x 2 and 6 x 4 alike in the MoE
// kernel; 8 and 10 rows were slower. pf, pf_lines: this block's share of the next panel's prefetch, as in
// fma_block (without it, 512 tokens 4.8 -> 5.4 ms).
constexpr int DP_NB = 2, DP_MR = 12;
template <int MR, typename O>
inline void dp_block(const bf16* A, int64_t K, const bf16* b, int64_t bstride, O* C, int64_t ldc, const bf16* pf,
                     int64_t pf_lines) {
  __m512 c[MR][DP_NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < DP_NB; ++j) c[r][j] = _mm512_setzero_ps();
  const char* pq = reinterpret_cast<const char*>(pf);
  const int64_t KP = K / 2;
  int64_t due = 0;
  // four k pairs per prefetch check (as fma_block; one per pair was 4.45 -> 4.85 ms at 512 tokens); the vnni
  // layout's K is a multiple of 32, so KP one of 16 and there is no tail
  for (int64_t kp = 0; kp < KP; kp += 4) {
    for (due += 4 * pf_lines; due >= KP; due -= KP, pq += 64) _mm_prefetch(pq, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int64_t kk = kp; kk < kp + 4; ++kk) {
      __m512bh v[DP_NB];
      for (int j = 0; j < DP_NB; ++j) v[j] = (__m512bh)_mm512_loadu_si512(b + j * bstride + kk * 32);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, A + r * K + 2 * kk, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < DP_NB; ++j) c[r][j] = _mm512_dpbf16_ps(c[r][j], a, v[j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < DP_NB; ++j) vstore(C + r * ldc + 16 * j, c[r][j]);
}


// C [M, N] (float32, or bfloat16 rounded once) = A [M, K] bf16 @ B^T, B vnni-packed [N / 16, K / 32, 16, 32] (the
// AMX layout), N % 32 == 0, K % 32 == 0. Panels of 32 columns outer; their row blocks share out the next
// panel's prefetch.
// Kept out of line: inlined into moe_experts_tiled's task loop, GCC's code for the 12-row block ran the call
// at 2.2x its time (10 against 4.6 ms at 512 tokens)
template <typename O>
__attribute__((noinline)) void dp_gemm(const bf16* A, int64_t M, int64_t K, const bf16* B, int64_t N, O* C, int64_t ldc,
                    const bf16* next = nullptr, int64_t next_k = 0) {
  constexpr int64_t NC = 16 * DP_NB;
  const int64_t bs = K * 16, blocks = (M + DP_MR - 1) / DP_MR;  // bs: elements of one 16-column block
  for (int64_t n0 = 0; n0 < N; n0 += NC) {
    const bf16* b = B + n0 * K;
    const bool last = n0 + NC >= N;  // the last panel prefetches the first of the GEMM that follows, if any
    const bf16* pf = !last ? b + NC * K : next;
    const int64_t pf_all = (last ? next_k : K) * NC * 2 / 64;  // 64-byte lines of that panel
    auto block = [&](auto rows, int64_t m0, int64_t rb) {
      const auto sh = prefetch_share(pf, pf_all, blocks, rb);
      dp_block<decltype(rows)::value>(A + m0 * K, K, b, bs, C + m0 * ldc + n0, ldc, sh.q, sh.lines);
    };
    // the loop written out, not each_row_block: through that helper GCC's code for this kernel ran 4.5% slower
    // at 512 tokens (A/B in one process)
    int64_t m0 = 0, rb = 0;
    for (; m0 + DP_MR <= M; m0 += DP_MR, ++rb) block(std::integral_constant<int, DP_MR>{}, m0, rb);
    if (m0 < M) with_rows<DP_MR - 1>(M - m0, [&](auto r) { block(r, m0, rb); });
  }
}
#endif

// Which bfloat16 GEMM this process runs: AMX where compiled in and granted, else AVX512-BF16, else none
inline int bf16_gemm_kind() {
#ifdef ADAPT_AMX
  if (amx_permitted()) return 2;
#endif
#ifdef ADAPT_DPBF16
  return 1;
#else
  return 0;
#endif
}

// C: float32, or bfloat16 (rounded once; AVX512-BF16 only: the AMX kernel stores float32)
template <typename O>
inline void bf16_gemm(int kind, const bf16* A, int64_t M, int64_t K, const bf16* B, int64_t N, O* C, int64_t ldc,
                      const bf16* next = nullptr, int64_t next_k = 0) {
#ifdef ADAPT_AMX
  if constexpr (std::is_same_v<O, float>)
    if (kind == 2) return amx_gemm(A, M, K, B, N, C, ldc);
#endif
#ifdef ADAPT_DPBF16
  if (kind == 1) return dp_gemm(A, M, K, B, N, C, ldc, next, next_k);
#endif
  TORCH_CHECK(false, "moe_experts_tiled: no bfloat16 GEMM in this build");
}

// whether router_softmax_topk takes the vnni-packed bfloat16 router (dp_gemm compiled in: AVX512-BF16)
inline bool router_vnni_runs() {
#ifdef ADAPT_DPBF16
  return true;
#else
  return false;
#endif
}

// Which dtypes moe_experts_tiled runs on this build and host: float32 with a vector layer; bfloat16 with AMX
// (compiled in and granted by the kernel) or AVX512-BF16 on vnni-packed weights, else with a vector layer on
// panel-packed weights, widened to float32 as they are read ("fma": AMD Zen 3, AVX2-only CPUs); float16
// on panels, widened the same way, where the vector layer converts it (F16C, AVX-512).
inline std::vector<std::string> moe_tiled_dtypes() {
  std::vector<std::string> out;
#ifdef ADAPT_VW
  out.push_back("float32");
  out.push_back("bfloat16");
#ifdef ADAPT_HALF
  out.push_back("float16");
#endif
#else
  if (bf16_gemm_kind() > 0) out.push_back("bfloat16");
#endif
  return out;
}

// the bfloat16 GEMM the tiled kernel and linear_tiled run here: "amx", "avx512_bf16" (both on vnni-packed
// weights), "fma" (panel-packed weights widened to float32) or "none"
inline std::string moe_tiled_bf16_gemm() {
  const int k = bf16_gemm_kind();
#ifdef ADAPT_VW
  if (k == 0) return "fma";
#endif
  return k == 2 ? "amx" : k == 1 ? "avx512_bf16" : "none";
}

// the float value T stores for f, kept in A: T itself (rounded), or a float holding T's rounding (bfloat16
// values widened for the FMA GEMM)
template <typename A, typename T>
inline A stored_as(float f) {
  if constexpr (std::is_same_v<A, T>) return from_f32<T>(f);
  else return rnd<T>(f);
}
#ifdef ADAPT_VW
template <typename A, typename T>
inline void vstored_as(A* p, vf v) {
  if constexpr (std::is_same_v<A, T>) vstore(p, v);
  else vstoreu(p, vrnd<T>(v));
}
#endif

// y [M, N] = x [M, K] @ W^T (+ bias), float32, bfloat16 or float16, W packed in the experts' column panels [N /
// FMA_NR, K, FMA_NR] of x's dtype (16-bit widened as it is read, x's rows taken as float32; the bias, float32 or x's
// dtype, added to the float32 sums before the one rounding). Each thread takes a contiguous range of panels and
// runs every row against it, in row chunks of about 8 MB of x. On this 2-core Xeon, float32, the bench dense
// model's 49 weights (400 MB) streamed in model order: 1 row 17.5-18.5 -> 14.3-15.7 ms, 16 rows 27.3-27.6 ->
// 23.8-24.3 ms against oneDNN's packed linear.
torch::Tensor linear_tiled(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#ifdef ADAPT_VW
  bool dtype_ok = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
#ifdef ADAPT_HALF
  dtype_ok = dtype_ok || x.scalar_type() == at::kHalf;
#endif
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && dtype_ok && w.dim() == 3 && w.is_contiguous() &&
                  w.scalar_type() == x.scalar_type() && w.size(2) == FMA_NR && w.size(1) == x.size(1),
              "linear_tiled: contiguous float32, bfloat16 or float16 x [M, K] and a panel-packed weight [N / ",
              FMA_NR, ", K, ", FMA_NR, "] of its dtype");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0), N = P * FMA_NR;
  torch::Tensor bf;  // the bias as float32: added to the float32 sums before the one rounding
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK((bias->scalar_type() == at::kFloat || bias->scalar_type() == x.scalar_type()) && bias->numel() == N,
                "linear_tiled: a bias of N values, float32 or x's dtype");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xf = x.to(at::kFloat);  // the GEMM's A is float32 (x itself when it is)
  const float* A = xf.data_ptr<float>();
  // rows per pass over the weight: as many as keep x's chunk near 8 MB (L3), so that a prefill streams each
  // weight from memory once or a few times (256-row chunks: 4x256-token prefill 10% slower than oneDNN)
  const int64_t MC = std::max<int64_t>(256, std::min<int64_t>(4096, (8 << 20) / (4 * std::max<int64_t>(K, 1))));
  float_bf16_or_half(x, "linear_tiled", [&](auto tag) {
    using X = decltype(tag);
    const X* B = w.data_ptr<X>();
    X* C = y.data_ptr<X>();
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      const int64_t c0 = p0 * FMA_NR, cols = (p1 - p0) * FMA_NR;
      std::vector<const float*> ar;
      std::vector<X*> cr;
      for (int64_t r0 = 0; r0 < M; r0 += MC) {
        const int64_t m = std::min<int64_t>(MC, M - r0);
        row_pointers(A + r0 * K, m, K, ar);
        row_pointers(C + r0 * N + c0, m, N, cr);
        fma_gemm(ar.data(), m, K, B + p0 * K * FMA_NR, cols, cr.data(), static_cast<const X*>(nullptr), 0,
                 bp ? bp + c0 : nullptr);
      }
    });
  });
  return y;
#else
  TORCH_CHECK(false, "linear_tiled: needs a vector layer, not in this build");
#endif
}

#ifdef ADAPT_VW
// f(std::integral_constant<int, nv>{}) for the panel vectors nv: FMA_NV, or a narrower router panel's 2 or 1
template <typename F>
inline void with_nv(int64_t nv, F&& f) {
  if (nv == FMA_NV) return f(std::integral_constant<int, FMA_NV>{});
  if constexpr (FMA_NV > 2)
    if (nv == 2) return f(std::integral_constant<int, 2>{});
  TORCH_CHECK(nv == 1, "a panel of ", nv, " vectors: the build takes 1 to ", FMA_NV);
  f(std::integral_constant<int, 1>{});
}
#endif

// The softmax router (Mixtral, Qwen-MoE) in one call: logits [T, E] = x @ Wr^T (x's dtype, rounded once from
// float32 sums), the float32 softmax of the logits as stored, its K largest in order (topk_row; the rows it
// leaves undecided, ties and NaNs, take at::topk, torch.topk's order), divided by their sum where ``renorm``.
// Returns (logits, weights [T, K] float32, ids [T, K] int64, the undecided rows [U] int64). Wr: the router weight
// [E, H], zero past E, either
//  - in column panels [ceil(E / RP), H, RP] of x's dtype (RP = VW * nv, nv = FMA_NV or fewer, so that few
//    experts pad little) for the FMA GEMM (sums in k order); or
//  - bfloat16 vnni-packed [EP / 16, H / 32, 16, 32] (EP = E rounded up to 32; H % 32 == 0) for the AVX512-BF16
//    GEMM (dp_gemm; pairs of k per step), where the CPU has it (AMX hosts too: the logits of a decode step are
//    a few rows, for which oneDNN's AMX linear took 53-115 us a layer against ~5 here).
// In place of F.linear, softmax, topk and a division: right after the experts' kernel has swept the caches,
// the float32 bench router at 512 tokens (H 512, 32 experts, top-4) took 0.44-0.54 ms through those four
// dispatches (0.25 ms with hot caches), and 0.20-0.27 ms here.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> router_softmax_topk(torch::Tensor x,
                                                                                          torch::Tensor wr, int64_t E,
                                                                                          int64_t K, bool renorm) {
#ifdef ADAPT_VW
  const bool vnni = wr.dim() == 4;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && wr.is_contiguous() && wr.scalar_type() == x.scalar_type() &&
                  E >= 1 && (vnni || wr.dim() == 3),
              "router_softmax_topk: contiguous x [T, H] and the router weight in its dtype, in panels [ceil(E / RP), "
              "H, RP] or vnni-packed [EP / 16, H / 32, 16, 32]");
  const int64_t T = x.size(0), H = x.size(1);
  int64_t EP, RP = 0;  // the weight's columns (E padded); RP: a panel's
  if (vnni) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && router_vnni_runs() && wr.size(1) * 32 == H &&
                    wr.size(2) == 16 && wr.size(3) == 32 && wr.size(0) % 2 == 0 && wr.size(0) * 16 >= E,
                "router_softmax_topk: vnni-packed panels [EP / 16, H / 32, 16, 32] of bfloat16, EP a multiple of 32 "
                "and H of 32, on a CPU with AVX512-BF16");
    EP = wr.size(0) * 16;
  } else {
    TORCH_CHECK(wr.size(1) == H && wr.size(2) % VW == 0 && wr.size(0) * wr.size(2) >= E,
                "router_softmax_topk: panels [ceil(E / RP), H, RP] for x [T, H], RP a multiple of ", VW);
    RP = wr.size(2);
    EP = wr.size(0) * RP;
  }
  TORCH_CHECK(K >= 1 && K <= E, "router_softmax_topk: need 1 <= K <= E");
  const int64_t NP = EP / std::max<int64_t>(RP, 1);
  auto logits = torch::empty({T, E}, x.options());
  auto weights = torch::empty({T, K}, x.options().dtype(at::kFloat));
  auto ids = torch::empty({T, K}, x.options().dtype(at::kLong));
  std::vector<uint8_t> undecided(T, 0);
  std::unique_ptr<float[]> held(new float[T * E]);  // the probabilities of undecided rows, for at::topk
  float* vp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  auto norm = [&](float* v) {
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s += v[k];
    for (int64_t k = 0; k < K; ++k) v[k] /= s;
  };
  // rows per thread: about 2 MFLOP of logits each, at least one pass of RC rows
  constexpr int64_t RC = 48;  // rows per pass over the weight: 4 row blocks of the narrow FMA panels' 12
  const int64_t rows_per = std::max<int64_t>(RC, (int64_t{1} << 20) / std::max<int64_t>(1, H * EP));
  float_bf16_or_half(x, "router_softmax_topk", [&](auto tag) {
    using X = decltype(tag);
    const X* xp = x.data_ptr<X>();
    const X* wp = wr.data_ptr<X>();
    X* lp = logits.data_ptr<X>();
    // c [n, EP]: rows r0 .. r0 + n - 1's float32 sums -> their logits, softmax, top-k and weights
    auto finish = [&](float* c, int64_t r0, int64_t n) {
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = r0 + r;
        float* l = c + r * EP;
        X* lo = lp + t * E;
        float mx = -std::numeric_limits<float>::infinity();
        bool nan = false;
        for (int64_t j = 0; j < E; ++j) {  // the logits as stored, and their max
          lo[j] = from_f32<X>(l[j]);
          l[j] = f32(lo[j]);
          nan = nan || std::isnan(l[j]);
          mx = std::max(mx, l[j]);
        }
        if (nan || (std::isinf(mx) && mx > 0)) {
          // torch's softmax: the whole row NaN (topk_row leaves the row to at::topk)
          std::fill(l, l + E, std::numeric_limits<float>::quiet_NaN());
        } else {
          int64_t j = 0;
          vf vs = vzero();
          for (; j + VW <= E; j += VW) {
            const vf e = vexp(vsub(vloadu(l + j), vset1(mx)));
            vstoreu(l + j, e);
            vs = vadd(vs, e);
          }
          float sum = vsum(vs);
          for (; j < E; ++j) sum += (l[j] = exp_f32(l[j] - mx));
          j = 0;
          for (; j + VW <= E; j += VW) vstoreu(l + j, vdiv(vloadu(l + j), vset1(sum)));
          for (; j < E; ++j) l[j] /= sum;
        }
        float* v = vp + t * K;
        undecided[t] = !topk_row(l, E, K, v, ip + t * K);
        if (undecided[t]) std::memcpy(held.get() + t * E, l, E * sizeof(float));
        else if (renorm) norm(v);
      }
    };
    if (vnni) {
#ifdef ADAPT_DPBF16
      if constexpr (std::is_same_v<X, bf16>) {
        at::parallel_for(0, T, rows_per, [&](int64_t t0, int64_t t1) {
          std::unique_ptr<float[]> c(new float[RC * EP]);
          for (int64_t r0 = t0; r0 < t1; r0 += RC) {
            const int64_t n = std::min<int64_t>(RC, t1 - r0);
            dp_gemm(xp + r0 * H, n, H, wp, EP, c.get(), EP);
            finish(c.get(), r0, n);
          }
        });
      }
#endif
      return;
    }
    with_nv(RP / VW, [&](auto nvc) {
      constexpr int NV = decltype(nvc)::value;
      constexpr int MR = NV == FMA_NV ? FMA_MR : 12;  // 12 x 2 or 12 x 1 accumulators for a narrow panel
      at::parallel_for(0, T, rows_per, [&](int64_t t0, int64_t t1) {
        std::unique_ptr<float[]> xa(std::is_same_v<X, float> ? nullptr : new float[RC * H]), c(new float[RC * EP]);
        const float* arow[RC];
        float* crow[RC];
        for (int64_t r0 = t0; r0 < t1; r0 += RC) {
          const int64_t n = std::min<int64_t>(RC, t1 - r0);
          for (int64_t r = 0; r < n; ++r) {
            if constexpr (std::is_same_v<X, float>) {
              arow[r] = xp + (r0 + r) * H;
            } else {
              row_f32(xp + (r0 + r) * H, xa.get() + r * H, H, 1.f);  // 16-bit x widened (exact)
              arow[r] = xa.get() + r * H;
            }
            crow[r] = c.get() + r * EP;
          }
          for (int64_t pb = 0; pb < NP; ++pb)
            each_row_block<MR>(n, [&](auto rows, int64_t m0, int64_t) {
              fma_block<decltype(rows)::value, NV>(arow + m0, H, wp + pb * H * RP, nullptr,
                                                   static_cast<const X*>(nullptr), 0, StoreRows<float>{crow + m0, pb * RP});
            });
          finish(c.get(), r0, n);
        }
      });
    });
  });
  // undecided rows: torch.topk's choice and order among equal values (the transformers routers call it), here
  // rather than in Python (bfloat16 logits tie in some row of nearly every 512-token call: the Python fallback
  // cost 0.19 ms right after the experts' kernel)
  auto rows = flagged_rows(undecided, x.options());
  const int64_t U = rows.numel();
  if (U) {
    const int64_t* rp = rows.data_ptr<int64_t>();
    auto probs = torch::empty({U, E}, weights.options());
    for (int64_t u = 0; u < U; ++u) std::memcpy(probs.data_ptr<float>() + u * E, held.get() + rp[u] * E, E * 4);
    auto [tv, ti] = at::topk(probs, K, -1, true, true);
    auto tvc = tv.contiguous();
    auto tic = ti.contiguous();
    for (int64_t u = 0; u < U; ++u) {
      float* v = vp + rp[u] * K;
      std::memcpy(v, tvc.data_ptr<float>() + u * K, K * 4);
      std::memcpy(ip + rp[u] * K, tic.data_ptr<int64_t>() + u * K, K * 8);
      if (renorm) norm(v);
    }
  }
  return {logits, weights, ids, rows};
#else
  TORCH_CHECK(false, "router_softmax_topk: needs a vector layer, not in this build");
#endif
}

// out [T, H] = sum over k with a local expert of w[t, k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, k]
// - expert_offset, for x [T, H] (float32 / bfloat16), int64 ids [T, K], float32 w [T, K] and the packed
// gate|up [E, 2I, H] and down [E, H, I] (see above; bfloat16 in either layout: vnni for AMX / AVX512-BF16,
// panels for the FMA GEMM). Rounding as the torch form of the loop: in bfloat16 gate|up and down round to
// bfloat16 after their float32 accumulation, silu rounds, then the product; the combine sums in float32 in k
// order and rounds once. Slots of experts held elsewhere add nothing.
torch::Tensor moe_experts_tiled(torch::Tensor x, torch::Tensor ids, torch::Tensor w, torch::Tensor wgu,
                                torch::Tensor wd, int64_t expert_offset) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && ids.dim() == 2 && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous() && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "moe_experts_tiled: contiguous x [T, H], int64 ids [T, K] and float32 weights [T, K]");
  TORCH_CHECK(wgu.scalar_type() == x.scalar_type() && wd.scalar_type() == x.scalar_type() && wgu.is_contiguous() &&
                  wd.is_contiguous() && wgu.size(0) == wd.size(0) && wgu.dim() == wd.dim(),
              "moe_experts_tiled: packed weights of x's dtype, both in one layout");
  bool fp16 = false;  // float16: panels only, where the vector layer converts it
#ifdef ADAPT_HALF
  fp16 = x.scalar_type() == at::kHalf;
#endif
  const bool lowp = x.scalar_type() == at::kBFloat16 || fp16;
  const bool vnni = lowp && !fp16 && wgu.dim() == 5;  // bf16 on AMX / AVX512-BF16; else the FMA GEMM on panels
  const int64_t T = x.size(0), H = x.size(1), K = ids.size(1), E = wgu.size(0), S = T * K;
  int64_t N1, K1, N2, K2, cols;  // cols: the kernel's column block
  if (vnni) {
    TORCH_CHECK(bf16_gemm_kind() > 0, "moe_experts_tiled: vnni-packed bfloat16 needs AMX (granted) or AVX512-BF16");
    TORCH_CHECK(wgu.size(3) == 16 && wgu.size(4) == 32 && wd.size(3) == 16 && wd.size(4) == 32,
                "moe_experts_tiled: bfloat16 weights vnni-packed [E, N/16, K/32, 16, 32]");
    N1 = wgu.size(1) * 16, K1 = wgu.size(2) * 32, N2 = wd.size(1) * 16, K2 = wd.size(2) * 32, cols = 32;
  } else {
#ifdef ADAPT_VW
    TORCH_CHECK((x.scalar_type() == at::kFloat || lowp) && wgu.dim() == 4 && wgu.size(3) == FMA_NR &&
                    wd.size(3) == FMA_NR,
                "moe_experts_tiled: weights panel-packed [E, N/P, K, P], P = ", FMA_NR);
    N1 = wgu.size(1) * FMA_NR, K1 = wgu.size(2), N2 = wd.size(1) * FMA_NR, K2 = wd.size(2), cols = FMA_NR;
#else
    TORCH_CHECK(false, "moe_experts_tiled: panel-packed weights need a vector layer, not in this build");
#endif
  }
  const int64_t I = N1 / 2;
  TORCH_CHECK(K1 == H && N2 == H && K2 == I && N1 % cols == 0 && N2 % cols == 0,
              "moe_experts_tiled: weights [E, 2I, H] and [E, H, I] for x [T, H], 2I and H multiples of ", cols);
  // slots grouped by expert (moe.h); pos[s]: row of slot s in ys, or -1
  const SlotGroups groups = group_slots(ids.data_ptr<int64_t>(), S, E, expert_offset);
  const std::vector<int64_t>&start = groups.start, &slot = groups.slot, &pos = groups.pos;
  const int64_t R = start[E];
  // tasks: row chunks of one expert, at most MC rows, so that the buffers stay near L2 and two threads share
  // a busy expert. A chunk streams its expert's weights once, so MC is at least 64 rows (DeepSeek-V3's
  // experts: 64 rows, 4 MB of buffers per thread); an expert's rows split evenly between its chunks.
  const int64_t per_row = (H + I) * (vnni ? 2 : 4) + (N1 + H) * 4;
  const int64_t MC = std::max<int64_t>(64, std::min<int64_t>(256, ((1 << 20) / per_row) / 32 * 32));
  struct Task {
    int64_t e, r0, n;
  };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = start[e + 1] - start[e], chunks = (rows + MC - 1) / MC;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
      tasks.push_back({e, start[e] + r0, r1 - r0});
    }
  }
  // largest first, taken by the threads as they come free: a static split by rows left one thread 0.5-2.5
  // ms behind the other at 512 tokens (their experts' weights stream from memory at different rates); 7.4 ->
  // 6.7 ms (float32, 32 experts of 2I = 512, H = 512, the bench's routing; A/B in one process)
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.n > b.n; });
  std::atomic<int64_t> next_task{0};
  auto ys = torch::empty({R, H}, x.options());
  auto out = torch::empty({T, H}, x.options());
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (int64_t)tasks.size()));
  const int kind = vnni ? bf16_gemm_kind() : 0;
  // X: x's and the weights' dtype; A: the GEMMs' A operand (X, or float32 for the FMA GEMM on bfloat16 panels)
  auto run = [&](auto xtag, auto atag) {
    using X = decltype(xtag);
    using A = decltype(atag);
    constexpr bool direct = std::is_same_v<A, float>;  // the FMA GEMM: down writes the expert rows itself
    // AVX512-BF16's GEMM rounds as it stores, so it writes gate|up in X and down straight into the expert rows
    // (AMX's stores float32): half the buffer bytes and no copy pass; the same bits (time: within noise)
    const bool rounded = !direct && kind == 1;
    const X* xp = x.data_ptr<X>();
    X* yp = ys.data_ptr<X>();
    const X* gup = wgu.data_ptr<X>();
    const X* dp = wd.data_ptr<X>();
    // C [M, N] (row stride N) = A [M, K] (row stride K, or the FMA GEMM's rows at arow[r] where given) @ packed
    // B^T, by this layout's GEMM
    auto gemm = [kind](const A* a, const A* const* arow, int64_t M, int64_t Kd, const X* B, int64_t N, auto* C,
                       const X* next, int64_t next_k) {
      if constexpr (direct) {
#ifdef ADAPT_VW
        std::vector<const float*> ap;
        std::vector<std::remove_pointer_t<decltype(C)>*> cp;
        if (!arow) {
          row_pointers(a, M, Kd, ap);
          arow = ap.data();
        }
        row_pointers(C, M, N, cp);
        fma_gemm(arow, M, Kd, B, N, cp.data(), next, next_k);
#endif
      } else {
        (void)arow;
        bf16_gemm(kind, a, M, Kd, B, N, C, N, next, next_k);
      }
    };
    at::parallel_for(0, nt, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t ti = i0; ti < i1; ++ti) {
        const int64_t mp = direct ? MC : (MC + 15) / 16 * 16;
        // uninitialized (every row read is written first; std::vector would zero ~1.5 MB per thread per call)
        // xa: the gathered rows of x, none where the FMA GEMM reads float32 x in place
        constexpr bool in_place = direct && std::is_same_v<X, float>;
        std::unique_ptr<A[]> xa_(in_place ? nullptr : new A[mp * H]), act_(new A[mp * I]);
        // c2: the vnni form's down output before rounding (the FMA GEMM writes the expert rows directly)
        std::unique_ptr<float[]> c1_(new float[mp * N1]), c2_(direct || rounded ? nullptr : new float[mp * H]);
        A* const xa = xa_.get();
        A* const act = act_.get();
        float* const c1 = c1_.get();
        X* const c1x = reinterpret_cast<X*>(c1);  // c1's memory, for gate|up rounded to X as it is stored
        float* const c2 = c2_.get();
        std::vector<const A*> xrow(mp);  // the task's rows of x (in place, or of its widened copy): the FMA GEMM's A
#ifdef ADAPT_AMX
        if constexpr (!direct)
          if (kind == 2) amx_config();
#endif
        const int64_t ntasks = tasks.size();
        // a thread claims its next task before the down GEMM of the one it runs, whose last panel prefetches
        // the next task's first
        for (int64_t j = next_task.fetch_add(1), jn; j < ntasks; j = jn) {
          const Task& tk = tasks[j];
          // AMX takes whole 16-row tiles (AVX512-BF16's rows were padded too: 512 tokens 4.8 -> 4.5 ms without)
          const int64_t n = tk.n, m = kind == 2 ? (n + 15) / 16 * 16 : n;
          // the FMA GEMM reads float32 x's rows where they are (the gather copied 4 MB at 512 tokens, top-4; in
          // place 1% faster, A/B in one process); the others read a gathered copy, bfloat16 widened to float32
          // for the FMA GEMM
          if constexpr (in_place) {
            for (int64_t r = 0; r < n; ++r) xrow[r] = reinterpret_cast<const A*>(xp + (slot[tk.r0 + r] / K) * H);
          } else {
            for (int64_t r = 0; r < n; ++r) {
              const X* src = xp + (slot[tk.r0 + r] / K) * H;
              if constexpr (std::is_same_v<A, X>) std::memcpy(xa + r * H, src, H * sizeof(X));
              else row_f32(src, xa + r * H, H, 1.f);  // bfloat16 widened (exact)
            }
            if (m > n) std::memset(static_cast<void*>(xa + n * H), 0, (m - n) * H * sizeof(A));
          }
          if constexpr (direct && !in_place)
            for (int64_t r = 0; r < n; ++r) xrow[r] = xa + r * H;
          const A* const* arow = direct ? xrow.data() : nullptr;
          const X* w1 = gup + tk.e * N1 * H;
          const X* w2 = dp + tk.e * H * I;
          // act = T(silu(T(gate))) * T(up), rounded to X (the torch form's F.linear then silu_and_mul), from
          // gate|up c [m, N1] in float32, or already rounded to X
          auto silu_mul = [&](const auto* c) {
            using G = std::remove_cv_t<std::remove_pointer_t<decltype(c)>>;
            for (int64_t r = 0; r < m; ++r) {
              const G* g = c + r * N1;
              const G* u = g + I;
              A* o = act + r * I;
              int64_t i = 0;
#ifdef ADAPT_VW
              for (; i + VW <= I; i += VW) vstored_as<A, X>(o + i, silu_mul_v<X>(vload(g + i), vload(u + i)));
#endif
              for (; i < I; ++i) {
                const float gv = rnd<X>(f32(g[i]));
                o[i] = stored_as<A, X>(rnd<X>(gv / (1.f + exp_f32(-gv))) * rnd<X>(f32(u[i])));
              }
            }
          };
          bool one_pass = false;  // gate|up and SiLU-and-mul in one pass: the FMA GEMM, I a multiple of its panel
#ifdef ADAPT_VW
          if constexpr (direct) one_pass = I % FMA_NR == 0;
#endif
          if (one_pass) {
#ifdef ADAPT_VW
            if constexpr (direct) fma_gate_up<X>(arow, m, H, w1, I, act, w2, I);  // its last pair prefetches down's
#endif
          } else if (rounded) {  // AVX512-BF16: gate|up rounded to X as it is stored (half the bytes through L2)
            gemm(xa, arow, m, H, w1, N1, c1x, w2, I);
            silu_mul(static_cast<const X*>(c1x));
          } else {
            gemm(xa, arow, m, H, w1, N1, c1, w2, I);  // its last panel prefetches down's first
            silu_mul(static_cast<const float*>(c1));
          }
          // the next task's gate|up, for the prefetch of its first panel (nothing when it is the same expert's,
          // still in cache)
          jn = next_task.fetch_add(1);
          const X* w1_next = jn < ntasks && tasks[jn].e != tk.e ? gup + tasks[jn].e * N1 * H : nullptr;
          if (direct || rounded) {
            gemm(act, nullptr, m, I, w2, H, yp + tk.r0 * H, w1_next, H);  // straight into the expert rows (m == n), rounded
          } else {
            gemm(act, nullptr, m, I, w2, H, c2, w1_next, H);
            for (int64_t r = 0; r < n; ++r) {
              const float* c = c2 + r * H;
              X* y = yp + (tk.r0 + r) * H;
              int64_t i = 0;
#ifdef ADAPT_VW
              for (; i + VW <= H; i += VW) vstore(y + i, vloadu(c + i));
#endif
              for (; i < H; ++i) y[i] = from_f32<X>(c[i]);
            }
          }
        }
#ifdef ADAPT_AMX
        if constexpr (!direct)
          if (kind == 2) _tile_release();
#endif
      }
    });
    // the combine: out[t] = sum over local k of w[t, k] * ys[pos], float32 in k order, rounded once
    combine_rows(static_cast<const X*>(yp), pos.data(), w.data_ptr<float>(), T, K, H, out.data_ptr<X>());
  };
  if (!lowp) {
    run(float{}, float{});
  } else if (vnni) {
    run(bf16{}, bf16{});
  } else if (!fp16) {
    run(bf16{}, float{});
  } else {
#ifdef ADAPT_HALF
    run(half{}, float{});
#endif
  }
  return out;
}

}  // namespace adapt_cpu
