/* The one-pass update of lean master weights on the CPU: for every element, join the bf16 weight and its int16
 * remainder into the exact fp32 value, apply torch's fused AdamW/Adam/SGD arithmetic to it, and split the result
 * back, reading and writing each byte once. See lightning_mp/kernels/native.py (how it is built and loaded) and
 * lightning_mp/kernels/bits.py (the join and split).
 *
 * Exactness: torch's fused CPU kernels (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, FusedSGDKernel.cpp, fp32
 * case) compute each element of a tensor's vector body (8 floats a vector in torch 2.13) with at::vec operations and
 * the last `numel % 8` elements (its scalar tail) with scalar code; torch's compiler contracted some multiply-adds of
 * both into fused multiply-adds, differently in the body and the tail (found by comparing bits with the kernel:
 * tests/test_onepass.py). This file performs the same IEEE operations in the same order for each element, the fused
 * multiply-adds as explicit fmaf, and is compiled with -ffp-contract=off so that the compiler adds none of its own:
 * the result is the same bits. Vectorising is left to the compiler (-O3 -march=native), which does not change any
 * element's operations.
 *
 * Plain C, no torch headers: it compiles in about a second with the system's C compiler and is loaded with ctypes.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint16_t *high;      /* bf16 weights (bit patterns), n elements; with low NULL: fp32 weights (a parameter kept in
                          * fp32, updated in place as torch's fused kernel updates it) */
    int16_t *low;        /* int16 remainders, n elements, or NULL */
    const void *grad;    /* bf16 (uint16 bit patterns) or fp32 gradients, n elements */
    float *state1;       /* Adam: exp_avg; SGD: momentum buffer (may be NULL without momentum) */
    float *state2;       /* Adam: exp_avg_sq */
    float *state3;       /* Adam: max_exp_avg_sq (amsgrad) */
    const float *step;   /* Adam: the parameter's step count (already incremented, as torch's kernel sees it) */
    int64_t n;
    int grad_fp32;       /* the gradient is fp32 (else bf16) */
} lean_piece;

/* The optimizer kinds (LEAN_ADAM, LEAN_ADAMW, LEAN_SGD) and the options struct, lean_options: generated from their one
 * definition, lightning_mp/kernels/options.py's KINDS and OPTION_FIELDS (options.c_declarations), in place of the next
 * line when the kernel is built. */
LEAN_DECLARATIONS

/* join() and split(): the exact join and split, in place of the next line (lean_bits.h) */
LEAN_BITS

#define BLOCK 512 /* elements staged at a time in fp32 on the stack (a multiple of every vector width) */

/* Stage elements [begin, begin + n) of piece p: exact fp32 weights into w, fp32 gradients (clipping applied) into g.
 * Each loop is simple enough for the compiler to vectorise. */
static inline void stage(const lean_piece *p, const lean_options *o, int64_t begin, int64_t n, float *w, float *g) {
    if (p->low) {
        const uint16_t *high = p->high + begin;
        const int16_t *low = p->low + begin;
        for (int64_t i = 0; i < n; i++) w[i] = join(high[i], low[i]);
    } else {
        memcpy(w, (const float *)(const void *)p->high + begin, (size_t)n * 4);
    }
    if (p->grad_fp32) {
        memcpy(g, (const float *)p->grad + begin, (size_t)n * 4);
    } else {
        const uint16_t *grad = (const uint16_t *)p->grad + begin;
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)grad[i] << 16;
            memcpy(&g[i], &bits, 4);
        }
    }
    if (o->grad_mul) {
        float factor = *o->grad_mul;
        for (int64_t i = 0; i < n; i++) g[i] = g[i] * factor;
    }
    if (o->clamped) { /* clamp_min_ then clamp_max_, NaN kept */
        float bound = (float)o->clamp;
        for (int64_t i = 0; i < n; i++) g[i] = g[i] < -bound ? -bound : g[i];
        for (int64_t i = 0; i < n; i++) g[i] = g[i] > bound ? bound : g[i];
    }
}

static inline void unstage(const lean_piece *p, int64_t begin, int64_t n, const float *w) {
    if (!p->low) {
        memcpy((float *)(void *)p->high + begin, w, (size_t)n * 4);
        return;
    }
    uint16_t *high = p->high + begin;
    int16_t *low = p->low + begin;
    for (int64_t i = 0; i < n; i++) split(w[i], &high[i], &low[i]);
}

typedef struct {
    float bc2_sqrt, eps, beta2, c1, c2, decay, neg_step, step, coeff, one_minus_c1;
    int small;
} adam_consts;

/* The vector body of torch's kernel, element by element: moments and the weight (weight decay already applied). */
static void adam_body(const adam_consts *k, int amsgrad, float *w, const float *g, float *m, float *v, float *vmax,
                      int64_t n) {
    const float coeff = k->coeff, c2 = k->c2, beta2 = k->beta2, bc2_sqrt = k->bc2_sqrt, eps = k->eps;
    const float neg_step = k->neg_step;
    if (k->small) {
        for (int64_t i = 0; i < n; i++) m[i] = fmaf(coeff, g[i] - m[i], m[i]);
    } else {
        for (int64_t i = 0; i < n; i++) m[i] = fmaf(coeff, g[i] - m[i], g[i]);
    }
    /* torch's `v * beta2 + c2 * g * g`, which its compiler contracted into one fused multiply-add */
    for (int64_t i = 0; i < n; i++) v[i] = fmaf(c2 * g[i], g[i], v[i] * beta2);
    if (amsgrad) {
        for (int64_t i = 0; i < n; i++) { /* at::vec maximum: a NaN wins */
            float a = vmax[i], b = v[i];
            vmax[i] = (a != a || b != b) ? a + b : (a > b ? a : b);
        }
        for (int64_t i = 0; i < n; i++) w[i] = w[i] + neg_step * m[i] / (sqrtf(vmax[i]) / bc2_sqrt + eps);
    } else {
        for (int64_t i = 0; i < n; i++) w[i] = w[i] + neg_step * m[i] / (sqrtf(v[i]) / bc2_sqrt + eps);
    }
}

/* torch's scalar tail (the last numel % vec_size elements of a tensor), element by element. */
static void adam_tail(const adam_consts *k, int amsgrad, float *w, const float *g, float *m, float *v, float *vmax,
                      int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float mi = m[i], gi = g[i];
        mi = k->small ? fmaf(k->c1, gi - mi, mi) : fmaf(-(gi - mi), k->one_minus_c1, gi); /* contracted as well */
        m[i] = mi;
        float vi = fmaf(v[i], k->beta2, k->c2 * gi * gi); /* torch's two statements, contracted into one */
        v[i] = vi;
        if (amsgrad) {
            vmax[i] = vmax[i] < vi ? vi : vmax[i]; /* std::max */
            vi = vmax[i];
        }
        float denom = sqrtf(vi) / k->bc2_sqrt + k->eps;
        w[i] = w[i] - k->step * mi / denom;
    }
}

/* The common case in one loop (each value loaded and stored once, no staging): the vector body of Adam/AdamW with
 * beta1 > 0.5, no amsgrad, no maximize, no clamp; the flags are constants in each instance. */
static inline __attribute__((always_inline)) void adam_fused(const lean_piece *p, const lean_options *o,
                                                             const adam_consts *k, int64_t begin, int64_t end,
                                                             const int adamw, const int grad_fp32, const int has_mul,
                                                             const int decays) {
    const float coeff = k->coeff, c2 = k->c2, beta2 = k->beta2, bc2_sqrt = k->bc2_sqrt, eps = k->eps;
    const float neg_step = k->neg_step, decay = k->decay, factor = has_mul ? *o->grad_mul : 1.0f;
    uint16_t *restrict high = p->high;
    int16_t *restrict low = p->low;
    float *restrict m = p->state1;
    float *restrict v = p->state2;
    const uint16_t *restrict g16 = (const uint16_t *)p->grad;
    const float *restrict g32 = (const float *)p->grad;
    for (int64_t i = begin; i < end; i++) {
        float w = join(high[i], low[i]);
        float g;
        if (grad_fp32) {
            g = g32[i];
        } else {
            uint32_t bits = (uint32_t)g16[i] << 16;
            memcpy(&g, &bits, 4);
        }
        if (has_mul) g = g * factor;
        if (decays && adamw) w = w * decay;
        if (decays && !adamw) g = fmaf(w, decay, g);
        float mi = fmaf(coeff, g - m[i], m[i]);
        float vi = fmaf(c2 * g, g, v[i] * beta2);
        m[i] = mi;
        v[i] = vi;
        w = w + neg_step * mi / (sqrtf(vi) / bc2_sqrt + eps);
        split(w, &high[i], &low[i]);
    }
}

#define ADAM_FUSED(A, F, M, D) \
    static void adam_fused_##A##F##M##D(const lean_piece *p, const lean_options *o, const adam_consts *k, \
                                        int64_t begin, int64_t end) { \
        adam_fused(p, o, k, begin, end, A, F, M, D); \
    }
ADAM_FUSED(0, 0, 0, 0) ADAM_FUSED(0, 0, 0, 1) ADAM_FUSED(0, 0, 1, 0) ADAM_FUSED(0, 0, 1, 1)
ADAM_FUSED(0, 1, 0, 0) ADAM_FUSED(0, 1, 0, 1) ADAM_FUSED(0, 1, 1, 0) ADAM_FUSED(0, 1, 1, 1)
ADAM_FUSED(1, 0, 0, 0) ADAM_FUSED(1, 0, 0, 1) ADAM_FUSED(1, 0, 1, 0) ADAM_FUSED(1, 0, 1, 1)
ADAM_FUSED(1, 1, 0, 0) ADAM_FUSED(1, 1, 0, 1) ADAM_FUSED(1, 1, 1, 0) ADAM_FUSED(1, 1, 1, 1)
typedef void (*adam_fused_fn)(const lean_piece *, const lean_options *, const adam_consts *, int64_t, int64_t);
static const adam_fused_fn ADAM_FUSED_FNS[16] = {
    adam_fused_0000, adam_fused_0001, adam_fused_0010, adam_fused_0011,
    adam_fused_0100, adam_fused_0101, adam_fused_0110, adam_fused_0111,
    adam_fused_1000, adam_fused_1001, adam_fused_1010, adam_fused_1011,
    adam_fused_1100, adam_fused_1101, adam_fused_1110, adam_fused_1111,
};

static void adam_range(const lean_piece *p, const lean_options *o, int64_t begin, int64_t end, int tail) {
    double step = (double)*p->step;
    double bias_correction1 = 1 - pow(o->beta1, step);
    double bias_correction2 = 1 - pow(o->beta2, step);
    double step_size = o->lr / bias_correction1;
    adam_consts k;
    k.bc2_sqrt = (float)sqrt(bias_correction2);
    k.eps = (float)o->eps;
    k.beta2 = (float)o->beta2;
    k.c1 = (float)(1 - o->beta1);
    k.c2 = (float)(1 - o->beta2);
    k.decay = o->kind == LEAN_ADAMW ? (float)(1 - o->lr * o->weight_decay) : (float)o->weight_decay;
    k.neg_step = (float)(-step_size);
    k.step = (float)step_size;
    k.small = fabsf(k.c1) < 0.5f;
    k.coeff = k.small ? k.c1 : k.c1 - 1.0f;
    k.one_minus_c1 = 1.0f - k.c1;
    int decays = o->weight_decay != 0.0, adamw = o->kind == LEAN_ADAMW;
    if (!tail && k.small && !o->amsgrad && !o->maximize && !o->clamped && p->low) { /* lean weights */
        int which = adamw * 8 + (p->grad_fp32 != 0) * 4 + (o->grad_mul != 0) * 2 + decays;
        ADAM_FUSED_FNS[which](p, o, &k, begin, end);
        return;
    }
    float w[BLOCK], g[BLOCK];
    for (int64_t at = begin; at < end; at += BLOCK) {
        int64_t n = end - at < BLOCK ? end - at : BLOCK;
        stage(p, o, at, n, w, g);
        if (o->maximize) {
            for (int64_t i = 0; i < n; i++) g[i] = -g[i];
        }
        if (decays && adamw) {
            for (int64_t i = 0; i < n; i++) w[i] = w[i] * k.decay;
        } else if (decays) { /* torch's `g += param * wd`, contracted (body and tail) */
            for (int64_t i = 0; i < n; i++) g[i] = fmaf(w[i], k.decay, g[i]);
        }
        float *m = p->state1 + at, *v = p->state2 + at, *vmax = o->amsgrad ? p->state3 + at : 0;
        if (tail) adam_tail(&k, o->amsgrad, w, g, m, v, vmax, n);
        else adam_body(&k, o->amsgrad, w, g, m, v, vmax, n);
        unstage(p, at, n, w);
    }
}

static void sgd_range(const lean_piece *p, const lean_options *o, int64_t begin, int64_t end, int tail) {
    const float decay = (float)o->weight_decay, momentum = (float)o->momentum, damp = (float)(1 - o->dampening);
    const float lr = (float)o->lr, neg_lr = (float)(-o->lr);
    int decays = o->weight_decay != 0.0, has_momentum = o->momentum != 0.0;
    float w[BLOCK], g[BLOCK];
    for (int64_t at = begin; at < end; at += BLOCK) {
        int64_t n = end - at < BLOCK ? end - at : BLOCK;
        stage(p, o, at, n, w, g);
        if (o->maximize) {
            for (int64_t i = 0; i < n; i++) g[i] = -g[i];
        }
        if (decays) { /* body: at::vec fmadd; tail: torch's `g += param * wd`, contracted */
            for (int64_t i = 0; i < n; i++) g[i] = fmaf(w[i], decay, g[i]);
        }
        if (has_momentum) {
            float *buf = p->state1 + at;
            if (o->first_step) {
                memcpy(buf, g, (size_t)n * 4);
            } else if (tail) {
                for (int64_t i = 0; i < n; i++) buf[i] = fmaf(buf[i], momentum, g[i] * damp); /* contracted so */
            } else {
                for (int64_t i = 0; i < n; i++) buf[i] = fmaf(damp, g[i], buf[i] * momentum);
            }
            if (o->nesterov) {
                for (int64_t i = 0; i < n; i++) g[i] = fmaf(buf[i], momentum, g[i]);
            } else {
                memcpy(g, buf, (size_t)n * 4);
            }
        }
        if (tail) {
            for (int64_t i = 0; i < n; i++) w[i] = fmaf(-g[i], lr, w[i]); /* `param -= g * lr`, contracted */
        } else {
            for (int64_t i = 0; i < n; i++) w[i] = fmaf(g[i], neg_lr, w[i]); /* `param += g * -lr`, contracted */
        }
        unstage(p, at, n, w);
    }
}

static void run_range(const lean_piece *p, const lean_options *o, int64_t begin, int64_t end) {
    int64_t body = p->n - p->n % o->vec_size;
    void (*f)(const lean_piece *, const lean_options *, int64_t, int64_t, int) = o->kind == LEAN_SGD ? sgd_range : adam_range;
    if (begin < body) f(p, o, begin, end < body ? end : body, 0);
    if (end > body) f(p, o, begin > body ? begin : body, end, 1);
}

/* Work (the update's, the check's) is cut into units of at most `grain` elements (a multiple of 64) of one tensor;
 * threads take units in turn. `first_unit[k]` is the first unit of tensor k (count + 1 entries, filled by the
 * caller with add_units). */
typedef struct {
    int64_t grain;
    int64_t units;
    int64_t *first_unit;
    int64_t next;     /* the next unit to take (atomic) */
    int64_t elements; /* in all units */
} unit_queue;

static void add_units(unit_queue *q, int64_t k, int64_t n) {
    if (k == 0) q->first_unit[0] = 0, q->elements = 0;
    q->first_unit[k + 1] = q->first_unit[k] + (n + q->grain - 1) / q->grain;
    q->units = q->first_unit[k + 1];
    q->elements += n;
}

/* Take the next unit: its tensor *k (a thread's units only increase, so *k only moves forward) and its first
 * element *begin; 0 when none is left. */
static int take_unit(unit_queue *q, int64_t *k, int64_t *begin) {
    int64_t unit = __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED);
    if (unit >= q->units) return 0;
    while (q->first_unit[*k + 1] <= unit) (*k)++;
    *begin = (unit - q->first_unit[*k]) * q->grain;
    return 1;
}

static int64_t unit_end(const unit_queue *q, int64_t begin, int64_t n) {
    return begin + q->grain < n ? begin + q->grain : n;
}

/* Run work(arg) on the calling thread and up to threads - 1 others: no more than there are units, nor than there
 * are `grain`s of elements in all (many small tensors are many units but little work: a thread started for them
 * costs more than it saves, milliseconds on a busy machine). A thread that cannot be started is simply not there:
 * the threads that are take its units. */
static void run_threads(void *(*work)(void *), void *arg, int threads, const unit_queue *q) {
    int64_t units = q->units, useful = (q->elements + q->grain - 1) / q->grain;
    if (useful < units) units = useful;
    if (threads > 64) threads = 64;
#ifdef _OPENMP
    if ((int64_t)threads > units) threads = (int)units;
    if (threads <= 1) {
        work(arg);
        return;
    }
#pragma omp parallel num_threads(threads)
    work(arg);
    return;
#endif
    pthread_t ids[64];
    int started = 0;
    for (int t = 1; t < threads && (int64_t)t < units; t++) {
        if (pthread_create(&ids[started], 0, work, arg) != 0) break;
        started++;
    }
    work(arg);
    for (int t = 0; t < started; t++) pthread_join(ids[t], 0);
}

typedef struct {
    const lean_piece *pieces;
    const lean_options *options;
    unit_queue queue;
} lean_work;

static void *worker(void *arg) {
    lean_work *w = (lean_work *)arg;
    int64_t piece = 0, begin;
    while (take_unit(&w->queue, &piece, &begin)) {
        const lean_piece *p = &w->pieces[piece];
        run_range(p, w->options, begin, unit_end(&w->queue, begin, p->n));
    }
    return 0;
}

/* Update every piece; returns 0. */
int lean_update(const lean_piece *pieces, int64_t npieces, const lean_options *options, const float *found_inf,
                int threads, int64_t grain, int64_t *first_unit) {
    if (found_inf && *found_inf != 0.0f) return 0; /* a skipped step leaves every byte as it was */
    lean_work work = {pieces, options, {grain, 0, first_unit, 0, 0}};
    for (int64_t k = 0; k < npieces; k++) add_units(&work.queue, k, pieces[k].n);
    run_threads(worker, &work, threads, &work.queue);
    return 0;
}

/* Step counts (0-dim fp32 tensors): *counts[k] -= *found, as torch's `_foreach_sub_(steps, [found_inf] * n)` after
 * its fused kernels (nothing without a flag). */
void lean_settle(float *const *counts, int64_t ncounts, const float *found_inf) {
    if (!found_inf) return;
    for (int64_t k = 0; k < ncounts; k++) *counts[k] = *counts[k] - *found_inf;
}

/* One step of a plan (lightning_mp/master/plan.py): the pieces' static addresses were laid out once; this step's
 * gradients (`grads[k]`, fp32 where `grad_fp32[k]`, else bf16) are written into them, every step count in `counts`
 * (the lean pieces' and the group's fp32 parameters') advances by one first, as torch's `_foreach_add_(steps, 1)`,
 * and with `settle` the found flag is subtracted after the update (lean_settle); without it, the caller does that
 * after its fp32 parameters' kernel, which reads the advanced counts. */
int lean_step(lean_piece *pieces, int64_t npieces, const void *const *grads, const signed char *grad_fp32,
              const lean_options *options, const float *found_inf, float *const *counts, int64_t ncounts, int settle,
              int threads, int64_t grain, int64_t *first_unit) {
    for (int64_t k = 0; k < npieces; k++) {
        pieces[k].grad = grads[k];
        pieces[k].grad_fp32 = grad_fp32[k];
    }
    for (int64_t k = 0; k < ncounts; k++) *counts[k] = *counts[k] + 1.0f;
    lean_update(pieces, npieces, options, found_inf, threads, grain, first_unit);
    if (settle) lean_settle(counts, ncounts, found_inf);
    return 0;
}

/* The generic path's join: values[i] = join(high[i], low[i]); and its split back. */
void lean_join(const uint16_t *high, const int16_t *low, float *values, int64_t n) {
    for (int64_t i = 0; i < n; i++) values[i] = join(high[i], low[i]);
}

void lean_split(const float *values, uint16_t *high, int16_t *low, int64_t n) {
    for (int64_t i = 0; i < n; i++) split(values[i], &high[i], &low[i]);
}

/* The non-finite check of a step that only checks (bf16, no loss scale): read-only, where torch's
 * _amp_foreach_non_finite_check_and_unscale_ also writes every gradient back (multiplied by one). `pointers[k]`
 * holds numels[k] values of `width` bytes (2: bf16 or fp16 patterns given by `exponent_mask`; 4: fp32); sets
 * *found to 1.0f when any value's exponent bits are all ones (an inf or a NaN).
 *
 * A value is an inf or a NaN exactly when its magnitude bits (sign cleared) are at least its exponent mask, so each
 * unit is one max-reduction of those bits in the values' own width (no widening: it vectorises to one max per
 * vector), compared once at its end. Work is cut into units of `grain` values across all tensors, as the update's,
 * so that one large tensor (an embedding) is shared by the threads too; a thread stops taking units once one is
 * found bad. */
typedef struct {
    const void *const *pointers;
    const int64_t *numels;
    int width;
    uint32_t exponent_mask;
    unit_queue queue;
    int bad;
} check_work;

/* The largest magnitude (sign bit cleared) of values[0..n) of type T: four interleaved streams (the quarters of the
 * range) in one vectorised loop, so that each thread keeps several reads in flight (one stream reads at about half
 * the memory bandwidth the update reaches, measured with benchmarks/grad_check.py). */
#define DEFINE_MAX_MAGNITUDE(name, T, magnitude_bits)                                         \
    static T name(const T *values, int64_t n) {                                              \
        int64_t q = n / 4;                                                                   \
        const T *a = values, *b = values + q, *c = values + 2 * q, *d = values + 3 * q;      \
        T t0 = 0, t1 = 0, t2 = 0, t3 = 0;                                                    \
        for (int64_t i = 0; i < q; i++) {                                                    \
            T m0 = a[i] & magnitude_bits, m1 = b[i] & magnitude_bits;                        \
            T m2 = c[i] & magnitude_bits, m3 = d[i] & magnitude_bits;                        \
            t0 = m0 > t0 ? m0 : t0;                                                          \
            t1 = m1 > t1 ? m1 : t1;                                                          \
            t2 = m2 > t2 ? m2 : t2;                                                          \
            t3 = m3 > t3 ? m3 : t3;                                                          \
        }                                                                                    \
        for (int64_t i = 4 * q; i < n; i++) {                                                \
            T m = values[i] & magnitude_bits;                                                \
            t0 = m > t0 ? m : t0;                                                            \
        }                                                                                    \
        t0 = t1 > t0 ? t1 : t0;                                                              \
        t0 = t2 > t0 ? t2 : t0;                                                              \
        return t3 > t0 ? t3 : t0;                                                            \
    }
DEFINE_MAX_MAGNITUDE(max_magnitude16, uint16_t, 0x7FFFu)
DEFINE_MAX_MAGNITUDE(max_magnitude32, uint32_t, 0x7FFFFFFFu)

static int unit_bad(const check_work *w, int64_t k, int64_t begin, int64_t end) {
    if (w->width == 2) return max_magnitude16((const uint16_t *)w->pointers[k] + begin, end - begin) >= w->exponent_mask;
    return max_magnitude32((const uint32_t *)w->pointers[k] + begin, end - begin) >= w->exponent_mask;
}

static void *check_worker(void *arg) {
    check_work *w = (check_work *)arg;
    int64_t k = 0, begin;
    while (!__atomic_load_n(&w->bad, __ATOMIC_RELAXED) && take_unit(&w->queue, &k, &begin)) {
        if (unit_bad(w, k, begin, unit_end(&w->queue, begin, w->numels[k])))
            __atomic_store_n(&w->bad, 1, __ATOMIC_RELAXED);
    }
    return 0;
}

void lean_check_nonfinite(const void *const *pointers, const int64_t *numels, int64_t count, int width,
                          uint32_t exponent_mask, float *found, int threads, int64_t grain, int64_t *first_unit) {
    check_work work = {pointers, numels, width, exponent_mask, {grain, 0, first_unit, 0, 0}, 0};
    for (int64_t k = 0; k < count; k++) add_units(&work.queue, k, numels[k]);
    run_threads(check_worker, &work, threads, &work.queue);
    if (work.bad) *found = 1.0f;
}

/* The step inside backward's call for one parameter (lightning_mp/master/in_backward/prepared.py): everything laid
 * out once, only `grad` written per call. With `check_width` (2 or 4: the gradient's width), the gradient's
 * non-finite check first, as lean_check_nonfinite (sets *found_inf to 1.0f on an inf or a NaN), then its step, as
 * lean_step (skipped where *found_inf is 1): the separate check and the step in one call. */
typedef struct {
    lean_piece *pieces;  /* the plan's one piece */
    const signed char *grad_fp32;
    const lean_options *options;
    float *found_inf;    /* the parameter's flag slot, or NULL */
    float *const *counts;
    int64_t ncounts;
    int settle, threads;
    int64_t grain;
    int64_t *first_unit; /* two entries */
    const void *grad;    /* written per call */
    int64_t numel;       /* the gradient's, for the check */
    int check_width;     /* 0: no check */
    uint32_t exponent_mask;
} lean_call;

int lean_step_call(lean_call *call) {
    if (call->check_width && call->found_inf)
        lean_check_nonfinite(&call->grad, &call->numel, 1, call->check_width, call->exponent_mask, call->found_inf,
                             call->threads, call->grain, call->first_unit);
    return lean_step(call->pieces, 1, &call->grad, call->grad_fp32, call->options, call->found_inf, call->counts,
                     call->ncounts, call->settle, call->threads, call->grain, call->first_unit);
}
