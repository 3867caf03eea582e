/* SHA-256 with the x86 SHA extensions, two independent streams in lock-step.
 *
 * One stream is bound by the latency of sha256rnds2 (each pair of rounds waits for the last); the unit can
 * take more. Two streams, their rounds interleaved, ran at 3.4 GB/s on one Zen 4 core against 1.8 for one
 * stream (OpenSSL's SHA-NI code runs at the one-stream rate). A shard run hashes every source byte and every
 * output byte, two streams over the same bytes, so it feeds them here in pairs (adapt/shard/hashing.py).
 *
 * Plain C with no Python API, loaded with ctypes (ctypes releases the GIL for the call). Built for any
 * x86-64: the SHA code carries its own target attribute and runs only where cpuid reports SHA
 * (adapt_sha256_native() says whether).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_X86 1
#endif

typedef struct {
  uint32_t h[8];
  uint64_t len; /* bytes taken so far */
  uint32_t nbuf; /* bytes of a partial block in buf */
  uint8_t buf[64];
} adapt_sha256;

size_t adapt_sha256_size(void) { return sizeof(adapt_sha256); }

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

void adapt_sha256_init(adapt_sha256 *c) {
  static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(c->h, H0, sizeof H0);
  c->len = 0;
  c->nbuf = 0;
}

#ifdef HAVE_X86
int adapt_sha256_native(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  if (!(b & (1u << 29))) return 0; /* SHA */
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  return (c & (1u << 19)) && (c & (1u << 9)); /* SSE4.1, SSSE3 */
}

#define SHA_TARGET __attribute__((target("sha,sse4.1,ssse3")))

/* The SHA instructions keep the state as (A,B,E,F) and (C,D,G,H). */
SHA_TARGET static inline void to_abef(const uint32_t h[8], __m128i *abef, __m128i *cdgh) {
  __m128i dcba = _mm_loadu_si128((const __m128i *)h), hgfe = _mm_loadu_si128((const __m128i *)(h + 4));
  __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1), efgh = _mm_shuffle_epi32(hgfe, 0x1B);
  *abef = _mm_alignr_epi8(cdab, efgh, 8);
  *cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
}

SHA_TARGET static inline void from_abef(__m128i abef, __m128i cdgh, uint32_t h[8]) {
  __m128i feba = _mm_shuffle_epi32(abef, 0x1B), dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  _mm_storeu_si128((__m128i *)h, _mm_blend_epi16(feba, dchg, 0xF0));
  _mm_storeu_si128((__m128i *)(h + 4), _mm_alignr_epi8(dchg, feba, 8));
}

/* nblk 64-byte blocks of each of L streams. w[l][g % 4] holds message words 4g..4g+3 of lane l; a group's
 * words come from the four before it (msg1, the alignr term, msg2). Fully unrolled, so the lanes' round pairs
 * interleave and the four message registers stay in registers. */
#define SHA_LANES(L)                                                                                          \
  SHA_TARGET __attribute__((noinline)) static void blocks##L(uint32_t *const h[], const uint8_t *const p[],   \
                                                               size_t nblk) {                               \
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);                     \
    __m128i s0[L], s1[L];                                                                                    \
    for (int l = 0; l < L; l++) to_abef(h[l], &s0[l], &s1[l]);                                               \
    for (size_t blk = 0; blk < nblk; blk++) {                                                                \
      __m128i w[L][4], a0[L], a1[L];                                                                         \
      _Pragma("GCC unroll 4") for (int l = 0; l < L; l++) {                                                  \
        a0[l] = s0[l];                                                                                       \
        a1[l] = s1[l];                                                                                       \
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) w[l][j] =                                        \
            _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p[l] + 64 * blk + 16 * j)), bswap);           \
      }                                                                                                      \
      _Pragma("GCC unroll 16") for (int g = 0; g < 16; g++) {                                                \
        __m128i k = _mm_loadu_si128((const __m128i *)(K + 4 * g));                                           \
        _Pragma("GCC unroll 4") for (int l = 0; l < L; l++) {                                                \
          if (g >= 4)                                                                                        \
            w[l][g & 3] = _mm_sha256msg2_epu32(                                                              \
                _mm_add_epi32(_mm_sha256msg1_epu32(w[l][g & 3], w[l][(g + 1) & 3]),                          \
                              _mm_alignr_epi8(w[l][(g + 3) & 3], w[l][(g + 2) & 3], 4)),                     \
                w[l][(g + 3) & 3]);                                                                          \
          __m128i m = _mm_add_epi32(w[l][g & 3], k);                                                         \
          s1[l] = _mm_sha256rnds2_epu32(s1[l], s0[l], m);                                                    \
          s0[l] = _mm_sha256rnds2_epu32(s0[l], s1[l], _mm_shuffle_epi32(m, 0x0E));                           \
        }                                                                                                    \
      }                                                                                                      \
      for (int l = 0; l < L; l++) {                                                                          \
        s0[l] = _mm_add_epi32(s0[l], a0[l]);                                                                 \
        s1[l] = _mm_add_epi32(s1[l], a1[l]);                                                                 \
      }                                                                                                      \
    }                                                                                                        \
    for (int l = 0; l < L; l++) from_abef(s0[l], s1[l], h[l]);                                               \
  }
SHA_LANES(1)
SHA_LANES(2)
#else
#error "x86-64 only: elsewhere adapt hashes with hashlib"
#endif

static void one(adapt_sha256 *c, const uint8_t *p, size_t nblk) {
  uint32_t *h[1] = {c->h};
  const uint8_t *q[1] = {p};
  if (nblk) blocks1(h, q, nblk);
}

/* Take bytes into c's partial block; returns how many were taken. */
static size_t top_up(adapt_sha256 *c, const uint8_t *p, size_t n) {
  size_t k = 64 - c->nbuf < n ? 64 - c->nbuf : n;
  memcpy(c->buf + c->nbuf, p, k);
  c->nbuf += (uint32_t)k;
  c->len += k;
  if (c->nbuf == 64) {
    one(c, c->buf, 1);
    c->nbuf = 0;
  }
  return k;
}

void adapt_sha256_update(adapt_sha256 *c, const uint8_t *p, size_t n) {
  if (c->nbuf) {
    size_t k = top_up(c, p, n);
    p += k, n -= k;
  }
  if (!n) return;
  one(c, p, n / 64);
  c->len += n / 64 * 64;
  p += n / 64 * 64, n %= 64;
  if (n) top_up(c, p, n);
}

/* The updates (ctx[i], p[i], n[i]) in order, two streams at a time: a lane takes the next job whose stream
 * is not in the other lane and has no earlier job left undone, so each stream sees its bytes in order. The
 * lanes go in lock-step over their whole blocks; a stream's partial blocks go through its buffer. */
typedef struct {
  adapt_sha256 *c;
  const uint8_t *p;
  size_t n;
  int on;
} lane_t;

static int pick(size_t njobs, adapt_sha256 *const ctx[], unsigned char done[], const adapt_sha256 *other) {
  for (size_t i = 0; i < njobs; i++) {
    if (done[i] || ctx[i] == other) continue;
    size_t j = 0;
    for (; j < i; j++)
      if (!done[j] && ctx[j] == ctx[i]) break; /* an earlier job of the stream is still to do (in a lane) */
    if (j == i) return (int)i;
  }
  return -1;
}

void adapt_sha256_many(size_t njobs, adapt_sha256 *const ctx[], const uint8_t *const p[], const size_t n[],
                       unsigned char done[]) {
  lane_t ln[2] = {{0}, {0}};
  memset(done, 0, njobs);
  for (;;) {
    for (int l = 0; l < 2; l++) {
      while (!ln[l].on) { /* take the next job: its partial block first */
        int i = pick(njobs, ctx, done, ln[1 - l].on ? ln[1 - l].c : NULL);
        if (i < 0) break;
        done[i] = 1; /* taken: a later job of its stream waits for this lane to release it */
        ln[l] = (lane_t){ctx[i], p[i], n[i], 1};
        if (ln[l].c->nbuf && ln[l].n) {
          size_t k = top_up(ln[l].c, ln[l].p, ln[l].n);
          ln[l].p += k, ln[l].n -= k;
        }
        if (ln[l].n < 64) { /* all of it buffered: done with this job */
          if (ln[l].n) top_up(ln[l].c, ln[l].p, ln[l].n);
          ln[l].on = 0;
        }
      }
    }
    if (!ln[0].on && !ln[1].on) break;
    size_t b0 = ln[0].on ? ln[0].n / 64 : 0, b1 = ln[1].on ? ln[1].n / 64 : 0;
    if (ln[0].on && ln[1].on) {
      size_t b = b0 < b1 ? b0 : b1;
      uint32_t *h[2] = {ln[0].c->h, ln[1].c->h};
      const uint8_t *q[2] = {ln[0].p, ln[1].p};
      blocks2(h, q, b);
      for (int l = 0; l < 2; l++) {
        ln[l].p += 64 * b, ln[l].n -= 64 * b, ln[l].c->len += 64 * b;
      }
    } else {
      int l = ln[0].on ? 0 : 1;
      one(ln[l].c, ln[l].p, ln[l].n / 64);
      ln[l].c->len += ln[l].n / 64 * 64;
      ln[l].p += ln[l].n / 64 * 64, ln[l].n %= 64;
    }
    for (int l = 0; l < 2; l++) {
      if (ln[l].on && ln[l].n < 64) { /* the tail to the buffer; the lane is free */
        if (ln[l].n) top_up(ln[l].c, ln[l].p, ln[l].n);
        ln[l].on = 0;
      }
    }
  }
}

/* The digest of what c has taken so far; c itself is left as it was. */
void adapt_sha256_digest(const adapt_sha256 *c, uint8_t out[32]) {
  adapt_sha256 t = *c;
  uint64_t bits = t.len * 8;
  uint8_t pad[128] = {0x80};
  size_t npad = (t.nbuf < 56 ? 56 : 120) - t.nbuf;
  uint8_t tail[8];
  for (int i = 0; i < 8; i++) tail[i] = (uint8_t)(bits >> (56 - 8 * i));
  adapt_sha256_update(&t, pad, npad);
  adapt_sha256_update(&t, tail, 8);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (uint8_t)(t.h[i] >> 24), out[4 * i + 1] = (uint8_t)(t.h[i] >> 16);
    out[4 * i + 2] = (uint8_t)(t.h[i] >> 8), out[4 * i + 3] = (uint8_t)t.h[i];
  }
}
