/* kvstore._int8: the int8 codec's quantizer and dequantizer in one pass over a block.
 *
 * Why native: the torch version (kvstore/int8.py) makes seven passes over a float32 copy of
 * each chunk, and a full store spent a third of its put time there (docs/benchmarks.md, stop
 * 54: 1.2 ms for a 2 MiB block). Here each K or V matrix of one (layer, head) is read twice
 * from L1 (absmax, then quantize) straight from fp16, bf16 or fp32, with no scratch, and the
 * GIL is let go.
 *
 * The values are the very bytes kvstore/int8.py makes, by the same float32 steps: K per channel
 * over tokens and V per token over head_dim; scale = absmax / 127, floored at FLT_MIN;
 * q = round_half_even(x * (1 / scale)); with float16 scales, the rounded float16 scale is the one
 * divided by, and q is clamped to [-127, 127]. tests/test_int8_native.py compares them.
 *
 * The caller (kvstore/int8.py) owns every check of shapes, strides and buffer sizes: the source
 * is an address with element strides, the outputs writable buffers whose sizes are checked here
 * too. Contract: 0 done, every scale sound; 1 a NaN seen (nothing usable written); 2 a scale
 * under float16's smallest normal for a non-zero channel (float16 scales only); 3 Inf or values
 * too large for the scales (those kvstore.int8.scales_sound rejects).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__GNUC__) || !defined(__x86_64__)
#error "kvstore._int8 is written for x86_64 (AVX2) with GCC or Clang; elsewhere kvstore uses torch"
#endif
#include <immintrin.h>

enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2 }; /* kvstore.int8._NATIVE_DTYPES */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp16 -> fp32 exactly, for the scalar tails (the vector loops use F16C): the exponent and
 * mantissa shifted into place are the value times 2^-112 for normals and subnormals alike; Inf
 * and NaN (exponent all ones) get float's all-ones exponent instead. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t em = (uint32_t)(h & 0x7fffu) << 13, sign = (uint32_t)(h & 0x8000u) << 16, u;
    float f;
    memcpy(&f, &em, 4);
    f *= 0x1p112f;
    memcpy(&u, &f, 4);
    u = em >= (0x7c00u << 13) ? (em | 0x7f800000u) : u;
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
}

#define LOAD_F16(p, i) (f16_to_f32(((const uint16_t *)(p))[i]))
#define LOAD_BF16(p, i) (bf16_to_f32(((const uint16_t *)(p))[i]))
#define LOAD_F32(p, i) (((const float *)(p))[i])

/* One scale from an absmax, as torch: absmax / 127, floored at FLT_MIN; with float16 scales the
 * stored (rounded) value. Returns what to multiply by: the reciprocal of the stored scale, or 0
 * where a float16 scale rounds to 0 (an all-zero channel: torch's 0 * inf makes NaN there, which
 * its conversion to int8 makes 0). Sets *bad, the first time only, to 2 for a scale under
 * float16's smallest normal, or to 3 for one kvstore.int8.scales_sound would refuse (Inf, or
 * past MAX_SCALE: float32's max / 128). */
__attribute__((target("f16c"))) static inline float make_rcp(float amax, int s16, void *dst, Py_ssize_t i,
                                                             int *bad) {
    float s = amax / 127.0f;
    if (!(s >= FLT_MIN)) s = FLT_MIN; /* clamp_min: NaN never reaches here (code 1 first) */
    if (!s16) {
        ((float *)dst)[i] = s;
    } else {
        uint16_t h = (uint16_t)_cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT);
        ((uint16_t *)dst)[i] = h;
        if (s < 6.103515625e-05f && amax > 0.0f && !*bad) *bad = 2; /* float16's smallest normal */
        if (h == 0) return 0.0f;
        s = f16_to_f32(h);
    }
    if (!(s <= FLT_MAX / 128.0f) && !*bad) *bad = 3;
    return 1.0f / s;
}

static inline int8_t to_q(float y, int s16) {
    y = __builtin_roundevenf(y);
    if (s16) y = y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y);
    return (int8_t)(int)y;
}

/* The loops run 8 (load, max) or 32 (quantize) lanes at a time, with a scalar tail for a
 * head_dim that is not a multiple. Loads of each source dtype as 8 float32 lanes: */
#define WIDE __attribute__((target("avx2,fma,f16c")))
WIDE static inline __m256 ld8_f16(const char *p, Py_ssize_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}
WIDE static inline __m256 ld8_bf16(const char *p, Py_ssize_t i) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
WIDE static inline __m256 ld8_f32(const char *p, Py_ssize_t i) { return _mm256_loadu_ps((const float *)p + i); }

/* 32 products -> 32 int8, rounded half to even (as torch.round), clamped for float16 scales.
 * Values are integral and within int8 once rounded, so the saturating packs only reorder. */
WIDE static inline void q32(int8_t *out, __m256 y0, __m256 y1, __m256 y2, __m256 y3, int s16) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256 y[4] = {_mm256_round_ps(y0, mode), _mm256_round_ps(y1, mode), _mm256_round_ps(y2, mode),
                   _mm256_round_ps(y3, mode)};
    if (s16) {
        for (int i = 0; i < 4; i++)
            y[i] = _mm256_min_ps(_mm256_max_ps(y[i], _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    }
    __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(y[0]), _mm256_cvtps_epi32(y[1]));
    __m256i cd = _mm256_packs_epi32(_mm256_cvtps_epi32(y[2]), _mm256_cvtps_epi32(y[3]));
    __m256i all = _mm256_packs_epi16(ab, cd); /* 4-byte groups: a0 b0 c0 d0 | a1 b1 c1 d1 */
    all = _mm256_permutevar8x32_epi32(all, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, all);
}

WIDE static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* quantize one block [L, 2, H, T, D] (element strides sl, sp, sh, st; D's is 1) into q
 * (contiguous) and scales (K's [L, H, 1, D] then V's [L, H, T, 1]). work: 2 * D floats.
 * Every absmax is a max of non-negative, non-NaN values (NaN returns first), so the order the
 * lanes take them in cannot change it. */
#define DEFINE_QUANT(NAME, LD8, LOAD)                                                             \
    WIDE static int NAME(const char *src, Py_ssize_t L, Py_ssize_t H, Py_ssize_t T, Py_ssize_t D, \
                         Py_ssize_t sl, Py_ssize_t sp, Py_ssize_t sh, Py_ssize_t st, int8_t *q,    \
                         void *scales, int s16, float *work) {                                    \
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));                \
        float *amax = work, *rcp = work + D;                                                      \
        const Py_ssize_t n_k = L * H * D, D8 = D & ~(Py_ssize_t)7, D32 = D & ~(Py_ssize_t)31;     \
        int bad = 0;                                                                              \
        for (Py_ssize_t l = 0; l < L; l++) {                                                      \
            for (Py_ssize_t h = 0; h < H; h++) {                                                  \
                __m256 nanv = _mm256_setzero_ps();                                                \
                int nan = 0;                                                                      \
                /* K: per channel d, absmax over tokens */                                        \
                Py_ssize_t base = l * sl + h * sh;                                                \
                for (Py_ssize_t d = 0; d < D; d++) amax[d] = 0.0f;                                \
                for (Py_ssize_t t = 0; t < T; t++) {                                              \
                    const Py_ssize_t row = base + t * st;                                         \
                    for (Py_ssize_t d = 0; d < D8; d += 8) {                                      \
                        __m256 v = _mm256_and_ps(LD8(src, row + d), absmask);                     \
                        nanv = _mm256_or_ps(nanv, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));             \
                        _mm256_storeu_ps(amax + d, _mm256_max_ps(_mm256_loadu_ps(amax + d), v));  \
                    }                                                                             \
                    for (Py_ssize_t d = D8; d < D; d++) {                                         \
                        float v = fabsf(LOAD(src, row + d));                                      \
                        nan |= v != v;                                                            \
                        amax[d] = v > amax[d] ? v : amax[d];                                      \
                    }                                                                             \
                }                                                                                 \
                if (nan || _mm256_movemask_ps(nanv)) return 1;                                    \
                const Py_ssize_t ks = (l * H + h) * D;                                            \
                for (Py_ssize_t d = 0; d < D; d++)                                                \
                    rcp[d] = make_rcp(amax[d], s16, scales, ks + d, &bad);               \
                int8_t *qk = q + ((l * 2 + 0) * H + h) * T * D;                                   \
                for (Py_ssize_t t = 0; t < T; t++) {                                              \
                    const Py_ssize_t row = base + t * st;                                         \
                    int8_t *out = qk + t * D;                                                     \
                    for (Py_ssize_t d = 0; d < D32; d += 32)                                      \
                        q32(out + d, _mm256_mul_ps(LD8(src, row + d), _mm256_loadu_ps(rcp + d)),  \
                            _mm256_mul_ps(LD8(src, row + d + 8), _mm256_loadu_ps(rcp + d + 8)),   \
                            _mm256_mul_ps(LD8(src, row + d + 16), _mm256_loadu_ps(rcp + d + 16)), \
                            _mm256_mul_ps(LD8(src, row + d + 24), _mm256_loadu_ps(rcp + d + 24)), \
                            s16);                                                                 \
                    for (Py_ssize_t d = D32; d < D; d++) out[d] = to_q(LOAD(src, row + d) * rcp[d], s16); \
                }                                                                                 \
                /* V: per token t, absmax over head_dim */                                        \
                base += sp;                                                                       \
                int8_t *qv = q + ((l * 2 + 1) * H + h) * T * D;                                   \
                const Py_ssize_t vs = n_k + (l * H + h) * T;                                      \
                for (Py_ssize_t t = 0; t < T; t++) {                                              \
                    const Py_ssize_t row = base + t * st;                                         \
                    __m256 mv = _mm256_setzero_ps();                                              \
                    for (Py_ssize_t d = 0; d < D8; d += 8) {                                      \
                        __m256 v = _mm256_and_ps(LD8(src, row + d), absmask);                     \
                        nanv = _mm256_or_ps(nanv, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));             \
                        mv = _mm256_max_ps(mv, v);                                                \
                    }                                                                             \
                    float m = hmax8(mv);                                                          \
                    for (Py_ssize_t d = D8; d < D; d++) {                                         \
                        float v = fabsf(LOAD(src, row + d));                                      \
                        nan |= v != v;                                                            \
                        m = v > m ? v : m;                                                        \
                    }                                                                             \
                    if (nan || _mm256_movemask_ps(nanv)) return 1;                                \
                    const float r = make_rcp(m, s16, scales, vs + t, &bad);              \
                    const __m256 rv = _mm256_set1_ps(r);                                          \
                    int8_t *out = qv + t * D;                                                     \
                    for (Py_ssize_t d = 0; d < D32; d += 32)                                      \
                        q32(out + d, _mm256_mul_ps(LD8(src, row + d), rv),                        \
                            _mm256_mul_ps(LD8(src, row + d + 8), rv),                             \
                            _mm256_mul_ps(LD8(src, row + d + 16), rv),                            \
                            _mm256_mul_ps(LD8(src, row + d + 24), rv), s16);                      \
                    for (Py_ssize_t d = D32; d < D; d++) out[d] = to_q(LOAD(src, row + d) * r, s16); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        return bad;                                                                       \
    }

/* dequantize: out (element strides as the source above; D's is 1) = q * scale in float32, rounded
 * once to the output dtype (nearest even), as torch's copy of the float32 product does. */
WIDE static inline void st8_f32(char *p, Py_ssize_t i, __m256 v) { _mm256_storeu_ps((float *)p + i, v); }
WIDE static inline void st8_f16(char *p, Py_ssize_t i, __m256 v) {
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
WIDE static inline void st8_bf16(char *p, Py_ssize_t i, __m256 v) {
    /* no NaN reaches here: q is finite and the scales were checked sound */
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    u = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_castsi256_si128(u));
}
static inline void st1_f32(char *p, Py_ssize_t i, float v) { ((float *)p)[i] = v; }
WIDE static inline void st1_f16(char *p, Py_ssize_t i, float v) {
    ((uint16_t *)p)[i] = (uint16_t)_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
}
static inline void st1_bf16(char *p, Py_ssize_t i, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

WIDE static inline __m256 deq8(const int8_t *q, __m256 s) {
    __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(w), s);
}

#define DEFINE_DEQUANT(NAME, ST8, ST1)                                                            \
    WIDE static void NAME(char *dst, Py_ssize_t L, Py_ssize_t H, Py_ssize_t T, Py_ssize_t D,       \
                          Py_ssize_t sl, Py_ssize_t sp, Py_ssize_t sh, Py_ssize_t st,              \
                          const int8_t *q, const float *scales) {                                  \
        const Py_ssize_t n_k = L * H * D, D8 = D & ~(Py_ssize_t)7;                                 \
        for (Py_ssize_t l = 0; l < L; l++) {                                                      \
            for (Py_ssize_t h = 0; h < H; h++) {                                                  \
                Py_ssize_t base = l * sl + h * sh;                                                \
                const int8_t *qk = q + ((l * 2 + 0) * H + h) * T * D;                             \
                const float *ks = scales + (l * H + h) * D;                                       \
                for (Py_ssize_t t = 0; t < T; t++) {                                              \
                    const Py_ssize_t row = base + t * st;                                         \
                    for (Py_ssize_t d = 0; d < D8; d += 8)                                        \
                        ST8(dst, row + d, deq8(qk + t * D + d, _mm256_loadu_ps(ks + d)));         \
                    for (Py_ssize_t d = D8; d < D; d++) ST1(dst, row + d, (float)qk[t * D + d] * ks[d]); \
                }                                                                                 \
                base += sp;                                                                       \
                const int8_t *qv = q + ((l * 2 + 1) * H + h) * T * D;                             \
                const float *vs = scales + n_k + (l * H + h) * T;                                 \
                for (Py_ssize_t t = 0; t < T; t++) {                                              \
                    const Py_ssize_t row = base + t * st;                                         \
                    const __m256 sv = _mm256_set1_ps(vs[t]);                                      \
                    for (Py_ssize_t d = 0; d < D8; d += 8) ST8(dst, row + d, deq8(qv + t * D + d, sv)); \
                    for (Py_ssize_t d = D8; d < D; d++) ST1(dst, row + d, (float)qv[t * D + d] * vs[t]); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_QUANT(quant_f16, ld8_f16, LOAD_F16)
DEFINE_QUANT(quant_bf16, ld8_bf16, LOAD_BF16)
DEFINE_QUANT(quant_f32, ld8_f32, LOAD_F32)
DEFINE_DEQUANT(deq_f16, st8_f16, st1_f16)
DEFINE_DEQUANT(deq_bf16, st8_bf16, st1_bf16)
DEFINE_DEQUANT(deq_f32, st8_f32, st1_f32)

typedef int (*quant_fn)(const char *, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                        Py_ssize_t, Py_ssize_t, Py_ssize_t, int8_t *, void *, int, float *);
typedef void (*deq_fn)(char *, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                       Py_ssize_t, Py_ssize_t, const int8_t *, const float *);

static const quant_fn QUANT[3] = {[DT_F16] = quant_f16, [DT_BF16] = quant_bf16, [DT_F32] = quant_f32};
static const deq_fn DEQ[3] = {[DT_F16] = deq_f16, [DT_BF16] = deq_bf16, [DT_F32] = deq_f32};

enum { STACK_DIM = 1024 }; /* head_dims up to this need no heap work area (8 KiB of stack) */

static int shape_ok(Py_ssize_t L, Py_ssize_t H, Py_ssize_t T, Py_ssize_t D) {
    if (L <= 0 || H <= 0 || T <= 0 || D <= 0 || D > (1 << 20)) return 0;
    /* L * 2 * H * T * D must not overflow */
    double n = (double)L * 2.0 * (double)H * (double)T * (double)D;
    return n < 9.0e15;
}

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    unsigned long long addr;
    int dt, s16;
    Py_ssize_t L, H, T, D, sl, sp, sh, st;
    Py_buffer qb, sb;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kinnnnnnnnw*w*p", &addr, &dt, &L, &H, &T, &D, &sl, &sp, &sh, &st, &qb,
                          &sb, &s16))
        return NULL;
    PyObject *res = NULL;
    /* K's absmax and reciprocals, one per channel: on the stack for any usual head_dim, so a put's
     * quantize allocates nothing; only a head_dim past STACK_DIM takes the heap */
    float stack_work[2 * STACK_DIM], *work = stack_work;
    if (dt < 0 || dt > 2 || !shape_ok(L, H, T, D)) {
        PyErr_SetString(PyExc_ValueError, "kvstore._int8.quantize: bad dtype or shape");
        goto done;
    }
    Py_ssize_t numel = L * 2 * H * T * D, n_scales = L * H * (D + T);
    if (qb.len < numel || sb.len < n_scales * (s16 ? 2 : 4)) {
        PyErr_SetString(PyExc_ValueError, "kvstore._int8.quantize: output buffers too small");
        goto done;
    }
    if (D > STACK_DIM && !(work = PyMem_RawMalloc(sizeof(float) * 2 * (size_t)D))) {
        PyErr_NoMemory();
        goto done;
    }
    int rc;
    quant_fn fn = QUANT[dt];
    Py_BEGIN_ALLOW_THREADS
    rc = fn((const char *)(uintptr_t)addr, L, H, T, D, sl, sp, sh, st, (int8_t *)qb.buf, sb.buf, s16, work);
    Py_END_ALLOW_THREADS
    res = PyLong_FromLong(rc);
done:
    if (work != stack_work) PyMem_RawFree(work);
    PyBuffer_Release(&qb);
    PyBuffer_Release(&sb);
    return res;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    unsigned long long addr;
    int dt;
    Py_ssize_t L, H, T, D, sl, sp, sh, st;
    Py_buffer qb, sb;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kinnnnnnnny*y*", &addr, &dt, &L, &H, &T, &D, &sl, &sp, &sh, &st, &qb, &sb))
        return NULL;
    PyObject *res = NULL;
    if (dt < 0 || dt > 2 || !shape_ok(L, H, T, D)) {
        PyErr_SetString(PyExc_ValueError, "kvstore._int8.dequantize: bad dtype or shape");
        goto done;
    }
    if (qb.len < L * 2 * H * T * D || sb.len < L * H * (D + T) * 4) {
        PyErr_SetString(PyExc_ValueError, "kvstore._int8.dequantize: input buffers too small");
        goto done;
    }
    deq_fn fn = DEQ[dt];
    Py_BEGIN_ALLOW_THREADS
    fn((char *)(uintptr_t)addr, L, H, T, D, sl, sp, sh, st, (const int8_t *)qb.buf, (const float *)sb.buf);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    res = Py_None;
done:
    PyBuffer_Release(&qb);
    PyBuffer_Release(&sb);
    return res;
}

static PyMethodDef METHODS[] = {
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(src_addr, dtype, L, H, T, D, sl, sp, sh, st, q, scales, scales_f16) -> 0 or 1 (NaN), 2 (under float16 scales), 3 (Inf, too large)"},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(dst_addr, dtype, L, H, T, D, sl, sp, sh, st, q, scales_f32) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, .m_name = "kvstore._int8", .m_doc = NULL, .m_size = -1, .m_methods = METHODS};

PyMODINIT_FUNC PyInit__int8(void) {
    /* A CPU without them imports nothing: kvstore.int8 then quantizes with torch. */
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) {
        PyErr_SetString(PyExc_ImportError, "kvstore._int8 needs AVX2, FMA and F16C");
        return NULL;
    }
    return PyModule_Create(&MODULE);
}
