/* The one-pass update of lean master weights with torchao's 8-bit Adam/AdamW state, on the CPU: for every
 * quantization block of a parameter, join the bf16 weights and their int16 remainders into the exact fp32 masters,
 * dequantize the block's first and second moments, apply torchao's step in fp32, write the weights back split, and
 * requantize the moments with torchao's maps, scale and code choice. Each byte is read and written once (a block of
 * more than CHUNK elements, not torchao's default of 256, is read twice: its scales first, then the update). See
 * lightning_mp/kernels/adam8bit.py (how it is built, loaded and called) and lightning_mp/kernels/bits.py (the join and
 * the split).
 *
 * Exactness: torchao 0.18's AdamW8bit / Adam8bit step (torchao/optim/adam.py, single_param_adam) runs compiled by
 * torch.compile (inductor's C++ backend on the CPU), which builds its kernels with -ffp-contract=off and without
 * unsafe math: every fp32 operation of its graph is one IEEE operation, vectorised or not. This file performs the
 * same operations in the same order for each element (the order of inductor's decomposition of lerp included), at
 * whatever vector width (see Speed), and is compiled with -ffp-contract=off as well, so the result is the same bits:
 *
 *   w  = join(high, low)                        g  = grad (fp32) [* grad_mul] [clamped to [-clamp, clamp]]
 *   AdamW: w = w - (lr * wd) * w                Adam: g = g + w * wd
 *   m0 = qmap1[code1] * scale1                  v0 = qmap2[code2] * scale2    (or the fp32 state, unquantized)
 *   m  = lerp(m0, g, 1 - beta1)                 v  = lerp(v0, g * g, 1 - beta2)
 *        lerp(a, b, t) = a + (b - a) * t if |t| < 0.5, else b + (b - a) * (t - 1)   (t and t - 1 in double, then fp32)
 *   bc1 = 1 - powf(beta1, step)                 bc2 = 1 - powf(beta2, step)
 *   w  = w - (lr * (m / bc1)) / (sqrtf(v) / sqrtf(bc2) + eps)            (m and v unquantized)
 *   scale = max(max |m| over the block, 1e-12)   (a NaN propagates, as the all-ones NaN inductor's x86 amax makes)
 *   code  = torchao's branchless binary search of m / scale in the sorted map, then rounded up to the next code
 *           when (m / scale - map[code]) >= (map[code + 1] - map[code]) * 0.5
 *
 * with the scalars beta1, beta2, wd and eps rounded to fp32 (torch.compile makes them fp32 constants) and lr the
 * fp32 value of torchao's lr tensor. A parameter whose torchao state is plain fp32 (fewer than 4096 elements, or a
 * size that is not a multiple of the block) is updated the same way with its moments stored unquantized.
 *
 * The codes: lean_code_search.h (put in place of the LEAN_CODE_SEARCH line below), the same codes as torchao's
 * search by a table of 65536-key buckets, or, where the CPU has AVX-512 VBMI, by byte permutes of bins held in
 * registers.
 *
 * Speed: the update is one loop per combination of the loop-invariant choices (weights lean or fp32, gradient bf16 or
 * fp32, AdamW or Adam, writing or not, bc1 and sqrt(bc2) 1 or not), with no branch inside, vectorised by the compiler; on AMD's
 * AVX-512 CPUs (Zen 4) 512 bits wide (step_range's target attribute): half the instructions of the build's 256 for the
 * same work on double-pumped units, the loop being bound by instruction throughput rather than by the divider (whose
 * throughput per fp32 value is the same at either width). 16.8M elements on one Zen 4 thread: the update ~13.4 -> ~10.8
 * ms, the whole step ~33 -> ~32 ms (2-8% over runs). The table search stays 256 bits wide (its emulated gathers are
 * slower at 512 and at 128 bits, slower still as hardware gathers or as a scalar pass). The divisions stay IEEE
 * divisions in torchao's order: replacing the four by constants (m / bc1, sqrt(v) / sqrt(bc2), the two by a block's
 * scales) with a division-free correctly rounded quotient (RN(1/b) and two fmas, Markstein) was measured slower here,
 * in both loops, checks left out: the divider (a unit of its own: ~0.1 ns per fp32 division at full throughput here)
 * runs beside the loops' other work, which the quotient's four operations add to. Where the CPU has AVX-512 VBMI, a
 * block's codes are dequantized by byte permutes of the map's values held in registers (a lookup: the same values);
 * elsewhere by indexed loads.
 *
 * Parallel work: units of whole blocks of one parameter (at most `grain` elements each), on the OpenMP threads of the
 * calling thread (torch's pool) where built with OpenMP, else on threads of its own, as lean_update.c. Each block's
 * arithmetic is the same whichever thread runs it.
 *
 * Plain C, no torch headers: compiled at first use with the system's C compiler and loaded with ctypes.
 */
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint16_t *high;        /* bf16 weights (bit patterns), n elements; with low NULL: fp32 weights updated in place */
    int16_t *low;          /* int16 remainders, or NULL */
    const void *grad;      /* bf16 (bit patterns) or fp32 gradients, n elements */
    uint8_t *codes1;       /* exp_avg: codes (n), one scale per block, the signed map (256 entries); or NULL ... */
    float *scale1;
    const float *qmap1;
    uint8_t *codes2;       /* exp_avg_sq: the same with the unsigned map */
    float *scale2;
    const float *qmap2;
    float *state1;         /* ... and the fp32 moments where the state is not quantized (codes NULL) */
    float *state2;
    const float *step;     /* the parameter's step count (fp32), already advanced */
    int64_t n;
    int64_t block;         /* elements per scale (quantized state); ignored for fp32 state */
    int64_t grad_fp32;     /* the gradient is fp32 (else bf16) */
} a8_piece;
/* Every field is 8 bytes wide, so that the caller passes pieces as a plain array of 15 int64 per piece (addresses,
 * NULL as 0), in this order (lightning_mp/kernels/adam8bit.py, PIECE_FIELDS). */
_Static_assert(sizeof(a8_piece) == 15 * 8, "a8_piece must be 15 packed 8-byte fields");

typedef struct {
    int adamw;             /* 1: decoupled weight decay (AdamW8bit), 0: L2 (Adam8bit) */
    double beta1, beta2, weight_decay, eps;
    const float *lr;       /* torchao's lr (a 0-dim fp32 tensor) */
    const float *grad_mul; /* a factor every gradient is multiplied by first (unscaling, clipping), NULL: none */
    double clamp;          /* then clip by value to [-clamp, clamp] (NaN kept); negative: none */
} a8_options;

/* join() and split(): the exact join and split, in place of the next line (lean_bits.h) */
LEAN_BITS

typedef struct {
    float lr, decay, eps, bc1, bc2_sqrt, t1, t2, factor, bound; /* bound: the clamp, or +inf (no clamp) */
    int adamw, big1, big2; /* big: lerp's |t| >= 0.5 form */
} a8_consts;

static void consts_of(const a8_piece *p, const a8_options *o, a8_consts *k) {
    float lr = *o->lr, step = *p->step;
    double t1 = 1.0 - o->beta1, t2 = 1.0 - o->beta2; /* Python's `1 - beta`, a double */
    k->adamw = o->adamw;
    k->lr = lr;
    k->decay = o->adamw ? lr * (float)o->weight_decay : (float)o->weight_decay;
    k->eps = (float)o->eps;
    k->bc1 = 1.0f - powf((float)o->beta1, step);
    k->bc2_sqrt = sqrtf(1.0f - powf((float)o->beta2, step));
    k->big1 = fabs(t1) >= 0.5;
    k->big2 = fabs(t2) >= 0.5;
    k->t1 = k->big1 ? (float)(t1 - 1.0) : (float)t1;
    k->t2 = k->big2 ? (float)(t2 - 1.0) : (float)t2;
    k->factor = o->grad_mul ? *o->grad_mul : 1.0f;
    k->bound = o->clamp >= 0 ? (float)o->clamp : INFINITY;
}

LEAN_CODE_SEARCH

/* ---------------------------------------------------------------------- the update */
/* torchao's scale of a block from the largest |x| (as bits: the order of non-negative floats) of its moments: the
 * amax clipped below at 1e-12. A NaN (bits above inf's) is kept, as the all-ones pattern at::vec's maximum (x86)
 * makes of it in inductor's vectorised amax. */
static inline float scale_of(uint32_t amax_bits) {
    if (amax_bits > 0x7F800000u) amax_bits = 0xFFFFFFFFu;
    float amax;
    memcpy(&amax, &amax_bits, 4);
    return amax_bits == 0xFFFFFFFFu || amax > 1e-12f ? amax : 1e-12f;
}

/* Elements [at, at + n) of piece p: its weights (joined, or fp32) and gradients (times the factor: the same value when
 * there is none) read; m and v hold the old moments and receive the new ones (unquantized: torchao's step uses these,
 * its state keeps their quantization) and amax[0], amax[1] their largest |m|, |v| (as bits, see scale_of); with
 * `write`, the new weights are written (split). lean, grad32, adamw, write and unit are constants where this is
 * inlined (one loop each, no branch inside); lerp's form is a select. unit & 1: bc1 is 1 (from step ~165 on with the
 * default beta1), unit & 2: sqrt(bc2) is 1 (from step ~17,300 on with the default beta2: most steps of a long run),
 * where m / bc1 is m and sqrt(v) / sqrt(bc2) is sqrt(v), bit for bit (a NaN's payload too: x86 returns the
 * dividend's), and the division is left out. */
static inline __attribute__((always_inline)) void step_n(const a8_piece *p, const a8_consts *k, int64_t at, int64_t n,
                                                        float *restrict m, float *restrict v, uint32_t *amax,
                                                        const int lean, const int grad32, const int adamw,
                                                        const int write, const int unit) {
    uint16_t *restrict high = p->high + at;
    int16_t *restrict low = lean ? p->low + at : 0;
    float *restrict w32 = lean ? 0 : (float *)(void *)p->high + at;
    const uint16_t *restrict g16 = (const uint16_t *)p->grad + at;
    const float *restrict g32 = (const float *)p->grad + at;
    const float lr = k->lr, decay = k->decay, eps = k->eps, bc1 = k->bc1, bc2_sqrt = k->bc2_sqrt;
    const float t1 = k->t1, t2 = k->t2, factor = k->factor, bound = k->bound;
    const int big1 = k->big1, big2 = k->big2;
    uint32_t amax1 = amax[0], amax2 = amax[1];
    for (int64_t i = 0; i < n; i++) {
        float wi = lean ? join(high[i], low[i]) : w32[i], gi;
        if (grad32) {
            gi = g32[i];
        } else {
            uint32_t bits = (uint32_t)g16[i] << 16;
            memcpy(&gi, &bits, 4);
        }
        gi = gi * factor;
        gi = gi < -bound ? -bound : gi; /* torch's clamp_min_ then clamp_max_ (a NaN stays; +inf bound: no-op) */
        gi = gi > bound ? bound : gi;
        if (adamw) wi = wi - decay * wi;
        else gi = gi + wi * decay;
        float g2 = gi * gi, mi = m[i], vi = v[i];
        mi = (big1 ? gi : mi) + (gi - mi) * t1;
        vi = (big2 ? g2 : vi) + (g2 - vi) * t2;
        m[i] = mi;
        v[i] = vi;
        uint32_t bits1, bits2;
        memcpy(&bits1, &mi, 4);
        memcpy(&bits2, &vi, 4);
        amax1 = (bits1 & 0x7FFFFFFFu) > amax1 ? bits1 & 0x7FFFFFFFu : amax1;
        amax2 = (bits2 & 0x7FFFFFFFu) > amax2 ? bits2 & 0x7FFFFFFFu : amax2;
        if (!write) continue;
        wi = wi - (lr * (unit & 1 ? mi : mi / bc1)) / ((unit & 2 ? sqrtf(vi) : sqrtf(vi) / bc2_sqrt) + eps);
        if (lean) split(wi, &high[i], &low[i]);
        else w32[i] = wi;
    }
    amax[0] = amax1;
    amax[1] = amax2;
}

/* On AMD's AVX-512 CPUs (gcc 12 calls Zen 4 znver3), step_n's loops are vectorised 512 bits wide, whatever
 * -mprefer-vector-width the build asks for (see the header's Speed): the same IEEE operations per element. */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8 && \
    (defined(__znver3__) || defined(__znver4__) || defined(__znver5__))
__attribute__((target("prefer-vector-width=512")))
#endif
static void step_range(const a8_piece *p, const a8_consts *k, int64_t at, int64_t n, float *m, float *v,
                       uint32_t *amax, int write) {
    int unit = write ? (k->bc1 == 1.0f) | (k->bc2_sqrt == 1.0f) << 1 : 0; /* no divisions without the write */
    int choice = unit << 4 | (p->low != 0) << 3 | (p->grad_fp32 != 0) << 2 | (k->adamw != 0) << 1;
    switch (choice | (write != 0)) {
#define STEP(c) \
    case c: step_n(p, k, at, n, m, v, amax, c >> 3 & 1, c >> 2 & 1, c >> 1 & 1, c & 1, c >> 4); break;
        STEP(0) STEP(2) STEP(4) STEP(6) STEP(8) STEP(10) STEP(12) STEP(14) /* without the write */
        STEP(1) STEP(3) STEP(5) STEP(7) STEP(9) STEP(11) STEP(13) STEP(15)
        STEP(17) STEP(19) STEP(21) STEP(23) STEP(25) STEP(27) STEP(29) STEP(31)
        STEP(33) STEP(35) STEP(37) STEP(39) STEP(41) STEP(43) STEP(45) STEP(47)
        STEP(49) STEP(51) STEP(53) STEP(55) STEP(57) STEP(59) STEP(61) STEP(63)
#undef STEP
    }
}

#define CHUNK 1024 /* elements staged at a time: a block up to this size in one pass, larger blocks in two */

/* x[i] = q[codes[i]] * scale (dequant_with_qmap); map: q's cached slot, or NULL. */
static void dequantize(const uint8_t *restrict codes, int64_t n, const float *restrict q, const a8_map *map,
                       float scale, float *restrict x) {
    int64_t i = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    /* 64 at a time: each byte of the values by a byte permute of 128 entries (two, the code's top bit choosing), the
     * four interleaved back into values within 128-bit lanes (the codes reordered first: values come out in order) */
    if (map && n >= 64) {
        __m512i plane[4][4], b[4];
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 4; j++) plane[k][j] = _mm512_loadu_si512(map->planes[k] + 64 * j);
        const __m512i reorder = _mm512_loadu_si512(unpack_order); /* lean_code_search.h */
        const __m512 s = _mm512_set1_ps(scale);
        for (; i + 64 <= n; i += 64) {
            __m512i c = _mm512_permutexvar_epi8(reorder, _mm512_loadu_si512(codes + i));
            __mmask64 top = _mm512_movepi8_mask(c);
            for (int k = 0; k < 4; k++)
                b[k] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(plane[k][0], c, plane[k][1]),
                                              _mm512_permutex2var_epi8(plane[k][2], c, plane[k][3]));
            __m512i low01 = _mm512_unpacklo_epi8(b[0], b[1]), high01 = _mm512_unpackhi_epi8(b[0], b[1]);
            __m512i low23 = _mm512_unpacklo_epi8(b[2], b[3]), high23 = _mm512_unpackhi_epi8(b[2], b[3]);
            _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23)), s));
            _mm512_storeu_ps(x + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23)), s));
            _mm512_storeu_ps(x + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23)), s));
            _mm512_storeu_ps(x + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23)), s));
        }
    }
#else
    (void)map;
#endif
    for (; i < n; i++) x[i] = q[codes[i]] * scale;
}

/* One block [at, at + b) of a quantized piece (maps: its maps' slots, or NULL). A block of at most CHUNK elements
 * is done in one pass: dequantized, updated, requantized. A larger one takes two passes over CHUNK-element parts: the
 * new moments' scales first (no write), then the same arithmetic again (the same largest values), the weights written
 * and the moments quantized with those scales. */
static void run_block(const a8_piece *p, const a8_consts *k, a8_map *const *maps, int64_t at, int64_t b) {
    float m[CHUNK], v[CHUNK];
    const int64_t blk = at / b;
    const float s1 = p->scale1[blk], s2 = p->scale2[blk];
    uint32_t amax[2] = {0, 0};
    for (int pass = b > CHUNK ? 0 : 1; pass < 2; pass++) {
        for (int64_t part = at; part < at + b; part += CHUNK) {
            int64_t n = at + b - part < CHUNK ? at + b - part : CHUNK;
            dequantize(p->codes1 + part, n, p->qmap1, maps[0], s1, m);
            dequantize(p->codes2 + part, n, p->qmap2, maps[1], s2, v);
            step_range(p, k, part, n, m, v, amax, pass);
            if (pass == 0) continue;
            quantize_pair(m, v, n, scale_of(amax[0]), scale_of(amax[1]), p->codes1 + part, p->codes2 + part, maps[0],
                          maps[1], p->qmap1, p->qmap2);
        }
    }
    p->scale1[blk] = scale_of(amax[0]);
    p->scale2[blk] = scale_of(amax[1]);
}

/* Elements [begin, end) of piece p: whole blocks (quantized state) or any range (fp32 state). */
static void run_range(const a8_piece *p, const a8_options *o, a8_map *const *maps, int64_t begin,
                      int64_t end) {
    a8_consts k;
    consts_of(p, o, &k);
    if (!p->codes1) {
        uint32_t amax[2] = {0, 0}; /* not used */
        for (int64_t at = begin; at < end; at += CHUNK) {
            int64_t n = end - at < CHUNK ? end - at : CHUNK;
            step_range(p, &k, at, n, p->state1 + at, p->state2 + at, amax, 1);
        }
        return;
    }
    for (int64_t at = begin; at < end; at += p->block) run_block(p, &k, maps, at, p->block);
}

/* Work is cut into units of whole blocks (at most `grain` elements, at least one block) of one piece;
 * first_unit[k] is piece k's first unit (npieces + 1 entries, filled here). */
typedef struct {
    const a8_piece *pieces;
    const a8_options *options;
    const int64_t *first_unit;
    a8_map *const *maps; /* two per piece: its maps' slots (tables), NULL: none (the reference search) */
    int64_t npieces, units, grain;
    int64_t next; /* the next unit to take (atomic; threads of its own) */
} a8_work;

static int64_t unit_size(const a8_piece *p, int64_t grain) {
    if (!p->codes1) return grain;
    int64_t blocks = grain / p->block;
    return (blocks > 0 ? blocks : 1) * p->block;
}

static a8_map *const no_maps[2] = {0, 0};

static void run_unit(const a8_work *w, int64_t unit) {
    int64_t lo = 0, hi = w->npieces - 1; /* the piece k with first_unit[k] <= unit < first_unit[k + 1] */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (w->first_unit[mid] <= unit) lo = mid;
        else hi = mid - 1;
    }
    const a8_piece *p = &w->pieces[lo];
    int64_t size = unit_size(p, w->grain), begin = (unit - w->first_unit[lo]) * size;
    run_range(p, w->options, w->maps ? w->maps + 2 * lo : no_maps, begin, begin + size < p->n ? begin + size : p->n);
}

#ifndef _OPENMP
static void *a8_worker(void *arg) {
    a8_work *w = (a8_work *)arg;
    for (;;) {
        int64_t unit = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (unit >= w->units) return 0;
        run_unit(w, unit);
    }
}
#endif

/* Whether elements [begin, end) of piece p's gradient hold an inf or a NaN (exponent bits all ones), reading only. */
static uint32_t non_finite_in(const a8_piece *p, int64_t begin, int64_t end) {
    uint32_t seen = 0;
    if (p->grad_fp32) {
        const uint32_t *g = (const uint32_t *)p->grad;
        for (int64_t i = begin; i < end; i++) seen |= (g[i] & 0x7F800000u) == 0x7F800000u;
    } else {
        const uint16_t *g = (const uint16_t *)p->grad;
        for (int64_t i = begin; i < end; i++) seen |= (g[i] & 0x7F80u) == 0x7F80u;
    }
    return seen;
}

#define CHECK_PART (1 << 16) /* elements a thread checks at a time */

/* Whether any gradient of the pieces holds an inf or a NaN, on `threads` threads (OpenMP build) in parts. */
static int any_non_finite(const a8_piece *pieces, int64_t npieces, int threads) {
    for (int64_t k = 0; k < npieces; k++) {
        const a8_piece *p = &pieces[k];
        const int64_t parts = (p->n + CHECK_PART - 1) / CHECK_PART;
        uint32_t seen = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) reduction(| : seen) num_threads(threads) if (parts > 1 && threads > 1)
#endif
        for (int64_t part = 0; part < parts; part++) {
            int64_t begin = part * CHECK_PART, end = begin + CHECK_PART < p->n ? begin + CHECK_PART : p->n;
            seen |= non_finite_in(p, begin, end);
        }
        if (seen) return 1;
    }
    return 0;
}

/* One step of every piece (torchao's step of each parameter: the pieces' elements are independent). With `check`
 * (a flag: the step inside backward's slot of this parameter), the gradients are read first and *check set to 1 where
 * one holds an inf or a NaN (as torch's check-only non-finite check), and the flag is found_inf. Unless *found_inf is
 * nonzero (then nothing is written at all), every step count in `counts` first advances by one, as torchao's
 * `state["step"] += 1` (the pieces read their counts after that). The options are a8_options' fields. */
void lean_adam8bit(const a8_piece *pieces, int64_t npieces, int adamw, double beta1, double beta2,
                   double weight_decay, double eps, const float *lr, const float *grad_mul, double clamp,
                   const float *found_inf, float *check, float *const *counts, int64_t ncounts, int threads,
                   int64_t grain, int64_t *first_unit) {
    if (check) {
        if (any_non_finite(pieces, npieces, threads > 64 ? 64 : threads)) *check = 1.0f;
        found_inf = check;
    }
    if (found_inf && *found_inf != 0.0f) return;
    a8_options option_values = {adamw, beta1, beta2, weight_decay, eps, lr, grad_mul, clamp};
    a8_options *options = &option_values;
    for (int64_t k = 0; k < ncounts; k++) *counts[k] = *counts[k] + 1.0f;
    if (npieces <= 0) return;
    /* the maps' tables, found (or built) before the threads start; pieces without them search as the reference */
    a8_map **maps = (a8_map **)calloc((size_t)npieces * 2, sizeof(a8_map *));
    for (int64_t k = 0; maps && k < 2 * npieces; k++)
        if (pieces[k / 2].codes1) maps[k] = acquire_map(k % 2 ? pieces[k / 2].qmap2 : pieces[k / 2].qmap1);
    a8_work work = {pieces, options, first_unit, maps, npieces, 0, grain, 0};
    first_unit[0] = 0;
    for (int64_t k = 0; k < npieces; k++) {
        int64_t size = unit_size(&pieces[k], grain);
        first_unit[k + 1] = first_unit[k] + (pieces[k].n + size - 1) / size;
    }
    work.units = first_unit[npieces];
    if (threads > 64) threads = 64;
    if ((int64_t)threads > work.units) threads = (int)work.units;
#ifdef _OPENMP
    if (threads <= 1) {
        for (int64_t u = 0; u < work.units; u++) run_unit(&work, u);
    } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int64_t u = 0; u < work.units; u++) run_unit(&work, u);
    }
#else
    pthread_t ids[64];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[started], 0, a8_worker, &work) != 0) break;
        started++;
    }
    a8_worker(&work);
    for (int t = 0; t < started; t++) pthread_join(ids[t], 0);
#endif
    for (int64_t k = 0; maps && k < 2 * npieces; k++) release_map(maps[k]);
    free(maps);
}

/* The host part of a step run elsewhere (the CUDA kernel, lightning_mp/kernels/cuda_adam8bit.py): for each of `n`
 * pieces out[2k] = bc1 and out[2k + 1] = sqrt(bc2) of the count its step will have, formed as consts_of forms them.
 * With `advance`, every count in `counts` first advances by one (as lean_adam8bit's) and the terms are those of
 * *steps[k]; without it nothing is written and the terms are those of *steps[k] + 1 (a step inside backward whose
 * skip flag is on the device: its counts advance after backward, where they were not skipped). torchao keeps the step
 * counts on the CPU, and its compiled step forms these terms there too, whatever the parameters' device. */
void lean_adam8bit_bias(float *const *counts, int64_t ncounts, float *const *steps, int64_t n, double beta1,
                        double beta2, int advance, float *out) {
    if (advance)
        for (int64_t k = 0; k < ncounts; k++) *counts[k] = *counts[k] + 1.0f;
    for (int64_t k = 0; k < n; k++) {
        float step = advance ? *steps[k] : *steps[k] + 1.0f;
        out[2 * k] = 1.0f - powf((float)beta1, step);
        out[2 * k + 1] = sqrtf(1.0f - powf((float)beta2, step));
    }
}
