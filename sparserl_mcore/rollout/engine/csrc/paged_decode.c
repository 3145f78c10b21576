/* Paged decode attention, fp32: one query per request over its own K/V, read in place from the pool.
 *
 * Why C: on CPU at rollout batch sizes the torch path pays for copying every request's pages
 * (index_select) before SDPA reads them again; this reads each K/V entry once, where it lives.
 * Written so `cc -O3 -ffast-math -march=native` auto-vectorises it (no intrinsics): the inner
 * loops run over the head dim d or over a contiguous scores array; the g = Hq / Hk query heads of
 * a KV head are handled together so each K/V entry is loaded once per KV head; common (g, d)
 * pairs get their own copy with both as constants, so the loops over them fully unroll.
 *
 * Layout (sparserl_mcore/rollout/kv_pool.py): k_rows / v_rows [pages, page_size, Hk, d] (entry
 * major within a page). q [B, Hq, d]; pages [B, P] (padded); lengths [B] (1 <= len <= P *
 * page_size); out [B, Hq, d]; mass NULL or [B, Hk, P * page_size]: the attention each entry got,
 * max over the g query heads of its KV head (what H2O accumulates; entries past a request's length
 * are left as they are, so pass zeros). Returns 0, -1 for a length out of range, -2 if out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE static inline
#endif

/* e^x for x <= 0 (scores minus their max): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p the
 * degree-6 Taylor polynomial (relative error < 3e-7). Plain arithmetic, so the loop calling it
 * vectorises inline, where expf would call libm (or glibc's libmvec) per element or vector. */
ALWAYS_INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* e^-87 is still a normal float */
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693145752f - n * 1.42860677e-6f; /* ln2 split in two for accuracy */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-126, 0] */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* One (request, KV head): g query rows qh [g, d] against n entries; writes oh [g, d] and, unless
 * mh is NULL, mh [n]. */
ALWAYS_INLINE void head_attention(const float *restrict qh, const float *restrict k_rows,
                                  const float *restrict v_rows, const int64_t *restrict table, int64_t n,
                                  int64_t g, int64_t d, int64_t head, int64_t hk, int64_t page_size,
                                  float scale, float *restrict scores, float *restrict oh,
                                  float *restrict mh) {
    const int64_t row = page_size * hk * d, stride = hk * d;
    /* scores[i * n + j] = scale * <q_i, k_j> */
    for (int64_t j0 = 0, p = 0; j0 < n; j0 += page_size, ++p) {
        const float *kp = k_rows + table[p] * row + head * d;
        const int64_t m = n - j0 < page_size ? n - j0 : page_size;
        for (int64_t e = 0; e < m; ++e) {
            const float *restrict kv = kp + e * stride;
            for (int64_t i = 0; i < g; ++i) {
                const float *restrict qi = qh + i * d;
                float s = 0.0f;
                for (int64_t c = 0; c < d; ++c) s += qi[c] * kv[c];
                scores[i * n + j0 + e] = s * scale;
            }
        }
    }
    /* softmax numerators per query row; each row's 1 / sum scales its output at the end */
    float inv[g];
    for (int64_t i = 0; i < g; ++i) {
        float *restrict si = scores + i * n;
        float mx = si[0];
        for (int64_t j = 1; j < n; ++j) mx = si[j] > mx ? si[j] : mx;
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
            si[j] = exp_nonpositive(si[j] - mx);
            sum += si[j];
        }
        inv[i] = 1.0f / sum;
        for (int64_t c = 0; c < d; ++c) oh[i * d + c] = 0.0f;
    }
    for (int64_t j0 = 0, p = 0; j0 < n; j0 += page_size, ++p) {
        const float *vp = v_rows + table[p] * row + head * d;
        const int64_t m = n - j0 < page_size ? n - j0 : page_size;
        for (int64_t e = 0; e < m; ++e) {
            const float *restrict vv = vp + e * stride;
            for (int64_t i = 0; i < g; ++i) {
                const float w = scores[i * n + j0 + e];
                float *restrict oi = oh + i * d;
                for (int64_t c = 0; c < d; ++c) oi[c] += w * vv[c];
            }
        }
    }
    for (int64_t i = 0; i < g; ++i)
        for (int64_t c = 0; c < d; ++c) oh[i * d + c] *= inv[i];
    if (mh != NULL) {
        for (int64_t j = 0; j < n; ++j) mh[j] = scores[j] * inv[0];
        for (int64_t i = 1; i < g; ++i) {
            const float *restrict si = scores + i * n;
            for (int64_t j = 0; j < n; ++j) mh[j] = si[j] * inv[i] > mh[j] ? si[j] * inv[i] : mh[j];
        }
    }
}

/* All KV heads of one request. */
ALWAYS_INLINE void request_attention(const float *restrict q, const float *restrict k_rows,
                                     const float *restrict v_rows, const int64_t *restrict table,
                                     int64_t n, int64_t g, int64_t d, int64_t hk, int64_t page_size,
                                     float scale, float *restrict scores, float *restrict out,
                                     float *restrict mass, int64_t width) {
    for (int64_t h = 0; h < hk; ++h)
        head_attention(q + h * g * d, k_rows, v_rows, table, n, g, d, h, hk, page_size, scale, scores,
                       out + h * g * d, mass == NULL ? NULL : mass + h * width);
}

#define REQUEST_ARGS                                                                                    \
    const float *restrict q, const float *restrict k_rows, const float *restrict v_rows,                \
        const int64_t *restrict table, int64_t n, int64_t hk, int64_t page_size, float scale,           \
        float *restrict scores, float *restrict out, float *restrict mass, int64_t width
#define SPECIALISE(G, D)                                                                                \
    static void request_g##G##_d##D(REQUEST_ARGS) {                                                     \
        request_attention(q, k_rows, v_rows, table, n, G, D, hk, page_size, scale, scores, out, mass,   \
                          width);                                                                       \
    }
/* g: Qwen2.5 0.5B-72B, Llama 3 and the test / bench models; d: 32 (bench), 64, 128 */
#define FOR_EACH_D(G) SPECIALISE(G, 32) SPECIALISE(G, 64) SPECIALISE(G, 128)
FOR_EACH_D(1) FOR_EACH_D(2) FOR_EACH_D(4) FOR_EACH_D(5) FOR_EACH_D(6) FOR_EACH_D(7) FOR_EACH_D(8)

typedef void (*request_fn)(REQUEST_ARGS);

static request_fn specialised(int64_t g, int64_t d) {
#define CASE(G)                                                                                         \
    case G:                                                                                             \
        return d == 32 ? request_g##G##_d32 : d == 64 ? request_g##G##_d64 : d == 128 ? request_g##G##_d128 : NULL;
    switch (g) {
        CASE(1) CASE(2) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    default:
        return NULL;
    }
#undef CASE
}

int paged_decode_f32(const float *restrict q, const float *restrict k_rows, const float *restrict v_rows,
                     const int64_t *restrict pages, const int64_t *restrict lengths, float *restrict out,
                     float *restrict mass, int64_t b, int64_t hq, int64_t hk, int64_t d, int64_t page_size, int64_t p,
                     float scale) {
    int64_t longest = 0;
    for (int64_t r = 0; r < b; ++r) {
        if (lengths[r] < 1 || lengths[r] > p * page_size) return -1;
        longest = lengths[r] > longest ? lengths[r] : longest;
    }
    const int64_t g = hq / hk;
    /* the scores of one (request, KV head): g rows of up to `longest` entries */
    float *scratch = malloc(sizeof(float) * (size_t)g * (size_t)longest);
    if (scratch == NULL) return -2;
    const request_fn fn = specialised(g, d);
    const int64_t width = p * page_size;
    for (int64_t r = 0; r < b; ++r) {
        const float *qr = q + r * hq * d;
        float *outr = out + r * hq * d;
        float *massr = mass == NULL ? NULL : mass + r * hk * width;
        if (fn != NULL)
            fn(qr, k_rows, v_rows, pages + r * p, lengths[r], hk, page_size, scale, scratch, outr, massr,
               width);
        else
            request_attention(qr, k_rows, v_rows, pages + r * p, lengths[r], g, d, hk, page_size, scale,
                              scratch, outr, massr, width);
    }
    free(scratch);
    return 0;
}
