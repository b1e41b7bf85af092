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
 * same operations in the same order for each element (the order of inductor's decomposition of lerp included) and
 * is compiled with -ffp-contract=off as well, so the result is the same bits:
 *
 *   w  = join(high, low)                        g  = grad (fp32) [* grad_mul]
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
 * Parallel work: units of whole blocks of one parameter (at most `grain` elements each), on the OpenMP threads of the
 * calling thread (torch's pool) where built with OpenMP, else on threads of its own, as lean_update.c. Each block's
 * arithmetic is the same whichever thread runs it.
 *
 * Plain C, no torch headers: compiled at first use with the system's C compiler and loaded with ctypes.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
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
} a8_options;

/* join() and split(): the exact join and split, in place of the next line (lean_bits.h) */
LEAN_BITS

typedef struct {
    float lr, decay, eps, bc1, bc2_sqrt, t1, t2, factor;
    int adamw, big1, big2; /* big: lerp's |t| >= 0.5 branch */
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
}

/* torchao's quantize_8bit_with_qmap of one value already divided by its block's scale, comparison for comparison. */
static inline uint8_t quantize(float x, const float *q) {
    int c = x >= q[128] ? 128 : 0;
    c += x >= q[c + 64] ? 64 : 0;
    c += x >= q[c + 32] ? 32 : 0;
    c += x >= q[c + 16] ? 16 : 0;
    c += x >= q[c + 8] ? 8 : 0;
    c += x >= q[c + 4] ? 4 : 0;
    c += x >= q[c + 2] ? 2 : 0;
    c += x >= q[c + 1] ? 1 : 0;
    int up = c + 1 < 255 ? c + 1 : 255;
    float down = q[c], residual = x - down;
    return (uint8_t)(residual >= (q[up] - down) * 0.5f ? up : c);
}

/* Running maximum of |x[i]| (inductor's amax: -inf to start, NaN when any is NaN). */
static void amax_of(const float *x, int64_t n, float *amax, int *nan) {
    float a_max = *amax;
    int any_nan = *nan;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        any_nan |= a != a;
        a_max = a > a_max ? a : a_max;
    }
    *amax = a_max;
    *nan = any_nan;
}

/* torchao's scale of a block: its amax clipped below at 1e-12. A NaN is kept, as the all-ones pattern at::vec's
 * maximum (x86) makes of it in inductor's vectorised amax. */
static inline float scale_of(float amax, int nan) {
    if (nan) {
        uint32_t bits = 0xFFFFFFFFu;
        float value;
        memcpy(&value, &bits, 4);
        return value;
    }
    return amax > 1e-12f ? amax : 1e-12f;
}

static void quantize_range(const float *x, int64_t n, float scale, uint8_t *codes, const float *q) {
    for (int64_t i = 0; i < n; i++) codes[i] = quantize(x[i] / scale, q);
}

/* Elements [begin, begin + n) of piece p: m and v hold the old moments (dequantized) and receive the new ones
 * (unquantized: torchao's step uses these, its state keeps their quantization); with `write`, the weights' update. */
static void update_range(const a8_piece *p, const a8_consts *k, int64_t begin, int64_t n, float *m, float *v,
                         int write) {
    const uint16_t *g16 = (const uint16_t *)p->grad + begin;
    const float *g32 = (const float *)p->grad + begin;
    uint16_t *high = p->high + begin;
    int16_t *low = p->low ? p->low + begin : 0;
    float *w32 = (float *)(void *)p->high + begin;
    const float lr = k->lr, decay = k->decay, eps = k->eps, bc1 = k->bc1, bc2_sqrt = k->bc2_sqrt;
    const float t1 = k->t1, t2 = k->t2, factor = k->factor;
    for (int64_t i = 0; i < n; i++) {
        float w = low ? join(high[i], low[i]) : w32[i];
        float g;
        if (p->grad_fp32) {
            g = g32[i];
        } else {
            uint32_t bits = (uint32_t)g16[i] << 16;
            memcpy(&g, &bits, 4);
        }
        g = g * factor; /* the same value when there is no factor (1.0f) */
        if (k->adamw) w = w - decay * w;
        else g = g + w * decay;
        float g2 = g * g, mi = m[i], vi = v[i];
        mi = k->big1 ? g + (g - mi) * t1 : mi + (g - mi) * t1;
        vi = k->big2 ? g2 + (g2 - vi) * t2 : vi + (g2 - vi) * t2;
        m[i] = mi;
        v[i] = vi;
        if (!write) continue;
        w = w - (lr * (mi / bc1)) / (sqrtf(vi) / bc2_sqrt + eps);
        if (low) split(w, &high[i], &low[i]);
        else w32[i] = w;
    }
}

#define CHUNK 1024 /* elements staged at a time: a block up to this size in one pass, larger blocks in two */

static void dequantize(const a8_piece *p, int64_t at, int64_t n, float s1, float s2, float *m, float *v) {
    const uint8_t *c1 = p->codes1 + at, *c2 = p->codes2 + at;
    for (int64_t i = 0; i < n; i++) m[i] = p->qmap1[c1[i]] * s1; /* dequant_with_qmap */
    for (int64_t i = 0; i < n; i++) v[i] = p->qmap2[c2[i]] * s2;
}

/* One block [at, at + b) of a quantized piece. A block of at most CHUNK elements is staged whole: dequantized,
 * updated, requantized. A larger one takes two passes over CHUNK-element parts: the new moments' scales first (no
 * write), then the same arithmetic again, the weights written and the moments quantized with those scales. */
static void run_block(const a8_piece *p, const a8_consts *k, int64_t at, int64_t b) {
    float m[CHUNK], v[CHUNK];
    const int64_t blk = at / b;
    const float s1 = p->scale1[blk], s2 = p->scale2[blk];
    float amax1 = -INFINITY, amax2 = -INFINITY;
    int nan1 = 0, nan2 = 0;
    if (b > CHUNK) {
        for (int64_t part = at; part < at + b; part += CHUNK) {
            int64_t n = at + b - part < CHUNK ? at + b - part : CHUNK;
            dequantize(p, part, n, s1, s2, m, v);
            update_range(p, k, part, n, m, v, 0);
            amax_of(m, n, &amax1, &nan1);
            amax_of(v, n, &amax2, &nan2);
        }
    }
    for (int64_t part = at; part < at + b; part += CHUNK) {
        int64_t n = at + b - part < CHUNK ? at + b - part : CHUNK;
        dequantize(p, part, n, s1, s2, m, v);
        update_range(p, k, part, n, m, v, 1);
        if (b <= CHUNK) {
            amax_of(m, n, &amax1, &nan1);
            amax_of(v, n, &amax2, &nan2);
        }
        quantize_range(m, n, scale_of(amax1, nan1), p->codes1 + part, p->qmap1);
        quantize_range(v, n, scale_of(amax2, nan2), p->codes2 + part, p->qmap2);
    }
    p->scale1[blk] = scale_of(amax1, nan1);
    p->scale2[blk] = scale_of(amax2, nan2);
}

/* Elements [begin, end) of piece p: whole blocks (quantized state) or any range (fp32 state). */
static void run_range(const a8_piece *p, const a8_options *o, int64_t begin, int64_t end) {
    a8_consts k;
    consts_of(p, o, &k);
    if (!p->codes1) {
        for (int64_t at = begin; at < end; at += CHUNK) {
            int64_t n = end - at < CHUNK ? end - at : CHUNK;
            update_range(p, &k, at, n, p->state1 + at, p->state2 + at, 1);
        }
        return;
    }
    for (int64_t at = begin; at < end; at += p->block) run_block(p, &k, at, p->block);
}

/* Work is cut into units of whole blocks (at most `grain` elements, at least one block) of one piece;
 * first_unit[k] is piece k's first unit (npieces + 1 entries, filled here). */
typedef struct {
    const a8_piece *pieces;
    const a8_options *options;
    const int64_t *first_unit;
    int64_t npieces, units, grain;
    int64_t next; /* the next unit to take (atomic; threads of its own) */
} a8_work;

static int64_t unit_size(const a8_piece *p, int64_t grain) {
    if (!p->codes1) return grain;
    int64_t blocks = grain / p->block;
    return (blocks > 0 ? blocks : 1) * p->block;
}

static void run_unit(const a8_work *w, int64_t unit) {
    int64_t lo = 0, hi = w->npieces - 1; /* the piece k with first_unit[k] <= unit < first_unit[k + 1] */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (w->first_unit[mid] <= unit) lo = mid;
        else hi = mid - 1;
    }
    const a8_piece *p = &w->pieces[lo];
    int64_t size = unit_size(p, w->grain), begin = (unit - w->first_unit[lo]) * size;
    run_range(p, w->options, begin, begin + size < p->n ? begin + size : p->n);
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

/* One step of every piece (torchao's step of each parameter: the pieces' elements are independent). Unless
 * *found_inf is nonzero (then nothing is written at all), every step count in `counts` first advances by one, as
 * torchao's `state["step"] += 1` (the pieces read their counts after that). The options are a8_options'
 * fields. */
void lean_adam8bit(const a8_piece *pieces, int64_t npieces, int adamw, double beta1, double beta2,
                   double weight_decay, double eps, const float *lr, const float *grad_mul, const float *found_inf,
                   float *const *counts, int64_t ncounts, int threads, int64_t grain, int64_t *first_unit) {
    if (found_inf && *found_inf != 0.0f) return;
    a8_options option_values = {adamw, beta1, beta2, weight_decay, eps, lr, grad_mul}, *options = &option_values;
    for (int64_t k = 0; k < ncounts; k++) *counts[k] = *counts[k] + 1.0f;
    if (npieces <= 0) return;
    a8_work work = {pieces, options, first_unit, npieces, 0, grain, 0};
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
}
