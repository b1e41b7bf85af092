/* The code search of the one-pass 8-bit Adam kernel (lean_adam8bit.c, which this file is put into in place of its
 * LEAN_CODE_SEARCH line: lightning_mp/kernels/native.py, compose): torchao's quantize_8bit_with_qmap of a block's new
 * moments divided by the block's scale, the same codes as its branchless binary search and round-up, faster.
 *
 * Exact by construction: for a map of finite values sorted non-decreasing, torchao's code f(x) is a non-decreasing
 * function of x over the non-NaN values (the binary search gives the last c with map[c] <= x, or 0; inside [map[c],
 * map[c + 1]) the rounded residual x - map[c] grows with x, so the round-up to c + 1 switches on at most once, and
 * from map[c + 1] on the code is at least c + 1); a NaN gives 0. Ordering the fp32 values by a key (their bits, the
 * negatives' flipped: key_of), the code of a key is the number of thresholds at or below it, a threshold being the
 * first key whose code is c (c = 1..255, found by bisection with the reference search).
 *
 * The table (any CPU): each bucket of 65536 consecutive keys (key >> 16) of a non-NaN range whose first and last
 * codes (from the reference search) differ by at most one holds the codes first + (the key's low 16 bits >= t): its
 * table entry keeps first and t. So a value's code is one table read, a compare and an add, vectorised (gcc's
 * emulated gathers: lane extracts and scalar loads; hardware gathers and other widths measured slower); buckets with
 * more than one step, or with an infinity and NaNs, are marked and their values take the reference search; a map
 * that is not sorted and finite has no table (all values take the reference search).
 *
 * The bins (CPUs with AVX-512 VBMI: byte permutes of 128 entries): a value's octave is its sign and exponent
 * (exponents below 2^-30 joined into octave 0 with zero and the subnormals; |x| >= 2, infinities and NaNs outside
 * every octave: their group of 64 values takes the table search). Each octave is cut into 2^b bins by the top b of
 * the key's low 23 bits, b the fewest for which no bin holds more than 1, 2 or 3 thresholds (the fewest of these
 * that keep the bins within 256; an octave of one code throughout shares an earlier such octave's bin). Inside a
 * bin the keys share their top 9 + b bits, so a value's code is the bin's first code plus the number of its
 * thresholds whose low 23 bits are at or below the key's. 64 values at a time: their bins' first codes and
 * thresholds (three bytes each) by byte permutes of tables held in 64-byte rows (the bins reordered so that two
 * rounds of unpacks give the thresholds in the values' order), compared as 32-bit lanes, the masks added to the
 * codes. torchao's maps take two thresholds per bin (223 and 225 bins for its signed and unsigned maps). 16.8M
 * pairs of moments on one Zen 4 thread: the table search 21.8 ms, the bins 15.4 (benchmarks/RESULTS.md).
 *
 * Tables and bins are built before the threads start and cached by the map's contents (compared on every call,
 * never by address: a map edited in place gets its own), a few maps at a time. tests/test_lean_adam8bit.py checks
 * every search against the reference over more than 8M chosen values per map (every key of the table's stepping
 * buckets among them) and against torchao.
 */

/* torchao's quantize_8bit_with_qmap of one value already divided by its block's scale, comparison for comparison:
 * the reference search (any map), and the definition the tables below are built from. */
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

/* An fp32 value's key: its bits made unsigned in the order of the values (-0 just below +0, NaNs at the ends). */
static inline uint32_t key_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}

static inline float value_of(uint32_t key) {
    uint32_t u = key & 0x80000000u ? key ^ 0x80000000u : ~key;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

#define BUCKETS 65536 /* key >> 16 */
#define REFERENCE 0x80000000u /* a table entry's flag: this bucket's values take the reference search */

/* The table of a sorted map of finite values, one entry per bucket of 65536 keys (key >> 16): the code of the
 * bucket's lowest key in the low 8 bits and, above them, the low 16 bits of the first key whose code is one more
 * (65536: none); or REFERENCE, where a bucket's codes differ by more than one or it holds an infinity and NaNs.
 * Returns 0 for a map that is not sorted or not finite (its values take the reference search). */
static int build_table(const float *q, uint32_t *table) {
    for (int i = 0; i < 256; i++)
        if (!(q[i] - q[i] == 0.0f) || (i < 255 && !(q[i] <= q[i + 1]))) return 0; /* inf - inf and NaNs are NaN */
    for (uint32_t b = 0; b < BUCKETS; b++) {
        uint32_t base = b << 16, low = 0, high = 0xFFFFu, step = 65536;
        if (b < 0x007Fu || b > 0xFF80u) { /* NaNs only: code 0 */
            table[b] = step << 8;
            continue;
        }
        int first = quantize(value_of(base), q), last = quantize(value_of(base | high), q);
        if (b == 0x007Fu || b == 0xFF80u || last < first || last > first + 1) {
            table[b] = REFERENCE | step << 8;
            continue;
        }
        if (last != first) {
            while (high - low > 1) { /* quantize(low) == first, quantize(high) == last */
                uint32_t mid = (low + high) / 2;
                if (quantize(value_of(base | mid), q) == first) low = mid;
                else high = mid;
            }
            step = high;
        }
        table[b] = (uint32_t)first | step << 8;
    }
    return 1;
}

/* The tables of the maps last seen, by contents (a map's address is never trusted: its values are compared on every
 * call). A slot in use by a call (users > 0) is never rebuilt; with every slot in use, a map gets no table. */
#define MAPS 8
typedef struct {
    float qmap[256];
    uint8_t planes[4][256]; /* byte k of every value in planes[k] (dequantize) */
    uint32_t *table;        /* BUCKETS entries */
    int valid, users;
    int steps_per_bin;      /* the register search's bins (build_bins): thresholds per bin (1-3), 0: no bins */
    uint8_t bin_base[64], bin_shift[64]; /* per octave (sign << 5 | octave): its first bin, the key bits shifted out */
    uint8_t bin_first[256];             /* each bin's code at its lowest key */
    uint8_t bin_steps[3][3][256];       /* [k][byte][bin]: the low 23 bits of its k-th threshold (STEP_NONE: none) */
    uint64_t used;
} a8_map;
/* The bins of the register search (where the CPU has AVX-512 VBMI; see the file's header). */
#define OCTAVE_LOW 96       /* the exponent (biased) of octave 1; octave 0 takes every exponent up to this one */
#define STEP_NONE 0x800000u /* above every 23-bit key: a bin's unused threshold */

/* The lowest and highest keys of bin j of octave o (sign << 5 | octave) cut by b bits; octave 0: every |x| below
 * 2^-30 (zero and the subnormals with them), one bin. */
static void bin_keys(int o, int b, uint32_t j, uint32_t *low, uint32_t *high) {
    const int sign = o >> 5, octave = o & 31;
    if (octave == 0) {
        const uint32_t edge = (uint32_t)(OCTAVE_LOW + 1) << 23; /* 2^-30's bits */
        *low = sign ? ~(edge - 1) & 0x7FFFFFFFu : 0x80000000u;
        *high = sign ? 0x7FFFFFFFu : 0x80000000u | (edge - 1);
        return;
    }
    const uint32_t exponent = (uint32_t)(OCTAVE_LOW + octave) << 23;
    *low = (sign ? ~exponent & 0x7F800000u : 0x80000000u | exponent) | j << (23 - b);
    *high = *low | ((1u << (23 - b)) - 1);
}

static int steps_in(const uint32_t *steps, int n, uint32_t low, uint32_t high) { /* thresholds in (low, high] */
    int count = 0;
    for (int c = 0; c < n; c++) count += steps[c] > low && steps[c] <= high;
    return count;
}

/* Octave o's bins with `per_bin` thresholds each at most, from bin `bins` on (an octave of one code throughout
 * shares the bin of an earlier such octave of that code: the octaves of negative values of an unsigned map, ...).
 * Returns the bins in use after it, or -1: more than 256, or the codes not as the thresholds say (a map whose code
 * is not monotone: no bins). */
static int octave_bins(a8_map *slot, const uint32_t *steps, int n, int o, int per_bin, int bins) {
    const float *q = slot->qmap;
    uint32_t low, high;
    int b = 0;
    for (;; b++) { /* the fewest bits whose bins hold at most per_bin thresholds each (octave 0: none, one bin) */
        if (bins + (1 << b) > 256 || ((o & 31) == 0 && b > 0)) return -1;
        int fits = 1;
        for (uint32_t j = 0; j < 1u << b && fits; j++) {
            bin_keys(o, b, j, &low, &high);
            fits = steps_in(steps, n, low, high) <= ((o & 31) == 0 ? 0 : per_bin);
        }
        if (fits) break;
    }
    slot->bin_shift[o] = (uint8_t)(23 - b);
    bin_keys(o, b, 0, &low, &high);
    const int first = quantize(value_of(low), q);
    if (b == 0 && steps_in(steps, n, low, high) == 0) /* one code: an earlier octave's bin of that code */
        for (int earlier = 0; earlier < o; earlier++) {
            const int bin = slot->bin_base[earlier];
            if (slot->bin_shift[earlier] == 23 && slot->bin_first[bin] == first &&
                slot->bin_steps[0][2][bin] == (uint8_t)(STEP_NONE >> 16)) {
                slot->bin_base[o] = (uint8_t)bin;
                return bins;
            }
        }
    slot->bin_base[o] = (uint8_t)bins;
    for (uint32_t j = 0; j < 1u << b; j++, bins++) {
        bin_keys(o, b, j, &low, &high);
        int code = quantize(value_of(low), q), k = 0;
        for (int c = 0; c < n; c++)
            if (steps[c] > low && steps[c] <= high) {
                for (int byte = 0; byte < 3; byte++)
                    slot->bin_steps[k][byte][bins] = (uint8_t)((steps[c] & 0x7FFFFFu) >> 8 * byte);
                k++;
            }
        if (quantize(value_of(high), q) != code + k) return -1;
        for (; k < 3; k++)
            for (int byte = 0; byte < 3; byte++) slot->bin_steps[k][byte][bins] = (uint8_t)(STEP_NONE >> 8 * byte);
        slot->bin_first[bins] = (uint8_t)code;
    }
    return bins;
}

/* The slot's bins: the thresholds per bin (1-3) of the fewest that keep the bins within 256, or 0 (no bins: the
 * table search). The thresholds are found by bisection with the reference search, as the table's steps. */
static int build_bins(a8_map *slot) {
    const float *q = slot->qmap;
    uint32_t steps[255];
    const uint32_t lowest = key_of(-INFINITY), highest = key_of(INFINITY);
    if (quantize(value_of(lowest), q) != 0) return 0;
    const int n = quantize(value_of(highest), q); /* thresholds 1..n: steps[c - 1], the first key of code >= c */
    for (int c = 1; c <= n; c++) {
        uint32_t low = lowest, high = highest; /* code(low) < c <= code(high) */
        while (high - low > 1) {
            uint32_t mid = low + (high - low) / 2;
            if (quantize(value_of(mid), q) >= c) high = mid;
            else low = mid;
        }
        steps[c - 1] = high;
    }
    for (int per_bin = 1; per_bin <= 3; per_bin++) {
        int bins = 0;
        for (int o = 0; o < 64 && bins >= 0; o++) bins = octave_bins(slot, steps, n, o, per_bin, bins);
        if (bins >= 0) return per_bin;
    }
    return 0;
}

static a8_map map_slots[MAPS];
static uint64_t map_clock;
static pthread_mutex_t map_lock = PTHREAD_MUTEX_INITIALIZER;

/* The slot holding q's table (users incremented: release it), or NULL (no table: the reference search). */
static a8_map *acquire_map(const float *q) {
    a8_map *slot = 0;
    pthread_mutex_lock(&map_lock);
    for (int i = 0; i < MAPS && !slot; i++)
        if (map_slots[i].table && memcmp(map_slots[i].qmap, q, sizeof map_slots[i].qmap) == 0) slot = &map_slots[i];
    if (!slot) { /* an empty slot, else the least recently used free one */
        for (int i = 0; i < MAPS; i++) {
            a8_map *s = &map_slots[i];
            if (s->users == 0 && (!slot || !s->table || (slot->table && s->used < slot->used))) slot = s;
            if (slot && !slot->table) break;
        }
        if (slot && !slot->table) slot->table = (uint32_t *)malloc(BUCKETS * sizeof(uint32_t));
        if (slot && slot->table) {
            memcpy(slot->qmap, q, sizeof slot->qmap);
            slot->valid = build_table(slot->qmap, slot->table);
            slot->steps_per_bin = slot->valid ? build_bins(slot) : 0;
            for (int c = 0; c < 256; c++) {
                uint32_t bits;
                memcpy(&bits, &slot->qmap[c], 4);
                for (int k = 0; k < 4; k++) slot->planes[k][c] = (uint8_t)(bits >> 8 * k);
            }
        } else {
            slot = 0;
        }
    }
    if (slot) {
        slot->users++;
        slot->used = ++map_clock;
    }
    pthread_mutex_unlock(&map_lock);
    return slot;
}

static void release_map(a8_map *slot) {
    if (!slot) return;
    pthread_mutex_lock(&map_lock);
    slot->users--;
    pthread_mutex_unlock(&map_lock);
}

/* codes[i] = quantize(x[i] / scale): one table entry per value, (key & 0xFFFF) >= the entry's step adding one;
 * values whose entry says REFERENCE take the reference search afterwards. */
static void quantize_range(const float *restrict x, int64_t n, float scale, uint8_t *restrict codes,
                           const uint32_t *restrict table, const float *q) {
    if (!table) {
        for (int64_t i = 0; i < n; i++) codes[i] = quantize(x[i] / scale, q);
        return;
    }
    uint32_t flags = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t key = key_of(x[i] / scale), entry = table[key >> 16];
        codes[i] = (uint8_t)((entry & 255u) + ((key & 0xFFFFu) >= (entry >> 8)));
        flags |= entry;
    }
    if (!(flags & REFERENCE)) return;
    for (int64_t i = 0; i < n; i++) {
        float value = x[i] / scale;
        if (table[key_of(value) >> 16] & REFERENCE) codes[i] = quantize(value, q);
    }
}

/* quantize_range of both moments: one loop where both maps have tables (their reads interleave). */
static void quantize_tables(const float *restrict x1, const float *restrict x2, int64_t n, float scale1, float scale2,
                          uint8_t *restrict codes1, uint8_t *restrict codes2, const uint32_t *restrict table1,
                          const uint32_t *restrict table2, const float *q1, const float *q2) {
    if (!table1 || !table2) {
        quantize_range(x1, n, scale1, codes1, table1, q1);
        quantize_range(x2, n, scale2, codes2, table2, q2);
        return;
    }
    uint32_t flags = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t key1 = key_of(x1[i] / scale1), entry1 = table1[key1 >> 16];
        uint32_t key2 = key_of(x2[i] / scale2), entry2 = table2[key2 >> 16];
        codes1[i] = (uint8_t)((entry1 & 255u) + ((key1 & 0xFFFFu) >= (entry1 >> 8)));
        codes2[i] = (uint8_t)((entry2 & 255u) + ((key2 & 0xFFFFu) >= (entry2 >> 8)));
        flags |= entry1 | entry2;
    }
    if (!(flags & REFERENCE)) return;
    for (int64_t i = 0; i < n; i++) {
        float value1 = x1[i] / scale1, value2 = x2[i] / scale2;
        if (table1[key_of(value1) >> 16] & REFERENCE) codes1[i] = quantize(value1, q1);
        if (table2[key_of(value2) >> 16] & REFERENCE) codes2[i] = quantize(value2, q2);
    }
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define REGISTER_SEARCH 1
/* 64 bytes of a 256-entry byte table at 64 byte indices: two permutes of 128 entries, the index's top bit choosing. */
static inline __m512i lookup256(const uint8_t *table, __m512i index, __mmask64 top) {
    return _mm512_mask_blend_epi8(top,
                                  _mm512_permutex2var_epi8(_mm512_loadu_si512(table), index,
                                                           _mm512_loadu_si512(table + 64)),
                                  _mm512_permutex2var_epi8(_mm512_loadu_si512(table + 128), index,
                                                           _mm512_loadu_si512(table + 192)));
}

/* The order of dequantize's byte permutes: after two rounds of unpacks, 32-bit lanes in the values' order. */
static const uint8_t unpack_order[64] = { /* position 16 L + 4 j + t takes byte 16 j + 4 L + t */
    0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21,
    22, 23, 36, 37, 38, 39, 52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43,
    56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

/* codes[i] = quantize(x[i] / scale) for i < n - n % 64 by the slot's bins (per: its steps_per_bin, a constant where
 * inlined); returns the count done. A group of 64 with a value outside the octaves takes the table search. */
static inline __attribute__((always_inline)) int64_t search_bins(const float *restrict x, int64_t n, float scale,
                                                                uint8_t *restrict codes, const a8_map *slot,
                                                                const int per) {
    const __m512 s = _mm512_set1_ps(scale);
    const __m512i sign_mask = _mm512_set1_epi32((int)0x80000000u), low23 = _mm512_set1_epi32(0x7FFFFF);
    const __m512i byte = _mm512_set1_epi32(0xFF), low = _mm512_set1_epi32(OCTAVE_LOW);
    const __m512i sign_bit = _mm512_set1_epi32(32), top_exponent = _mm512_set1_epi32(OCTAVE_LOW + 31);
    const __m512i bases = _mm512_loadu_si512(slot->bin_base), shifts = _mm512_loadu_si512(slot->bin_shift);
    const __m512i order = _mm512_loadu_si512(unpack_order), zero = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i key23[4];
        __m128i bin8[4];
        __mmask16 outside = 0;
        for (int k = 0; k < 4; k++) {
            __m512i bits = _mm512_castps_si512(_mm512_div_ps(_mm512_loadu_ps(x + i + 16 * k), s));
            __m512i key = _mm512_xor_si512(bits, _mm512_or_si512(_mm512_srai_epi32(bits, 31), sign_mask));
            __m512i exponent = _mm512_and_si512(_mm512_srli_epi32(bits, 23), byte);
            outside |= _mm512_cmpgt_epu32_mask(exponent, top_exponent);
            __m512i octave = _mm512_or_si512(_mm512_sub_epi32(_mm512_max_epu32(exponent, low), low),
                                             _mm512_and_si512(_mm512_srli_epi32(bits, 26), sign_bit));
            key23[k] = _mm512_and_si512(key, low23);
            __m512i base = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, octave, bases);
            __m512i shift = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, octave, shifts);
            bin8[k] = _mm512_cvtepi32_epi8(_mm512_add_epi32(base, _mm512_srlv_epi32(key23[k], shift)));
        }
        if (outside) {
            for (int j = 0; j < 64; j++) codes[i + j] = quantize(x[i + j] / scale, slot->qmap);
            continue;
        }
        __m512i bin = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(bin8[0]), bin8[1], 1)),
            _mm256_inserti128_si256(_mm256_castsi128_si256(bin8[2]), bin8[3], 1), 1);
        __m512i code = lookup256(slot->bin_first, bin, _mm512_movepi8_mask(bin));
        __m512i reordered = _mm512_permutexvar_epi8(order, bin);
        __mmask64 top = _mm512_movepi8_mask(reordered);
        __m512i count = _mm512_setzero_si512();
        for (int k = 0; k < per; k++) {
            __m512i b0 = lookup256(slot->bin_steps[k][0], reordered, top);
            __m512i b1 = lookup256(slot->bin_steps[k][1], reordered, top);
            __m512i b2 = lookup256(slot->bin_steps[k][2], reordered, top);
            __m512i low01 = _mm512_unpacklo_epi8(b0, b1), high01 = _mm512_unpackhi_epi8(b0, b1);
            __m512i low2 = _mm512_unpacklo_epi8(b2, zero), high2 = _mm512_unpackhi_epi8(b2, zero);
            __mmask64 at_or_above = _mm512_kunpackd(
                _mm512_kunpackw(_mm512_cmpge_epu32_mask(key23[3], _mm512_unpackhi_epi16(high01, high2)),
                                _mm512_cmpge_epu32_mask(key23[2], _mm512_unpacklo_epi16(high01, high2))),
                _mm512_kunpackw(_mm512_cmpge_epu32_mask(key23[1], _mm512_unpackhi_epi16(low01, low2)),
                                _mm512_cmpge_epu32_mask(key23[0], _mm512_unpacklo_epi16(low01, low2))));
            count = _mm512_sub_epi8(count, _mm512_movm_epi8(at_or_above)); /* -1 per threshold at or below */
        }
        _mm512_storeu_si512(codes + i, _mm512_add_epi8(code, count));
    }
    return i;
}

/* quantize_range by the slot's bins where it has them (the rest, and a CPU without VBMI, as quantize_range). */
static int64_t search_by_bins(const float *restrict x, int64_t n, float scale, uint8_t *restrict codes,
                              const a8_map *slot) {
    switch (slot ? slot->steps_per_bin : 0) {
    case 1: return search_bins(x, n, scale, codes, slot, 1);
    case 2: return search_bins(x, n, scale, codes, slot, 2);
    case 3: return search_bins(x, n, scale, codes, slot, 3);
    default: return 0;
    }
}
#else
#define REGISTER_SEARCH 0
static int64_t search_by_bins(const float *x, int64_t n, float scale, uint8_t *codes, const a8_map *slot) {
    (void)x, (void)n, (void)scale, (void)codes, (void)slot;
    return 0;
}
#endif

/* Both moments' codes: by the maps' bins where they have them (their slots: map1, map2, or NULL), the rest by
 * their tables (quantize_tables) or the reference search (q1, q2: the maps). */
static void quantize_pair(const float *restrict x1, const float *restrict x2, int64_t n, float scale1, float scale2,
                          uint8_t *restrict codes1, uint8_t *restrict codes2, const a8_map *map1, const a8_map *map2,
                          const float *q1, const float *q2) {
    const uint32_t *table1 = map1 && map1->valid ? map1->table : 0, *table2 = map2 && map2->valid ? map2->table : 0;
    int64_t done1 = search_by_bins(x1, n, scale1, codes1, map1), done2 = search_by_bins(x2, n, scale2, codes2, map2);
    if (done1 == done2) {
        quantize_tables(x1 + done1, x2 + done1, n - done1, scale1, scale2, codes1 + done1, codes2 + done1, table1,
                        table2, q1, q2);
        return;
    }
    quantize_range(x1 + done1, n - done1, scale1, codes1 + done1, table1, q1);
    quantize_range(x2 + done2, n - done2, scale2, codes2 + done2, table2, q2);
}

/* For tests: the codes of x[0..n) by the fast searches and by the reference search. fast: the codes of quantize_pair
 * (the map's bins where it has them and the CPU has VBMI, else its table, else the reference) for either moment of
 * two, where they agree with the table search (quantize_tables for either moment, quantize_range); reference: the
 * reference search. Returns 2 where the bins were used, 1 where the table (not the bins) was, 0 where neither was,
 * -1 where the searches disagree (or memory ran out). */
int lean_adam8bit_quantize_check(const float *x, int64_t n, const float *qmap, uint8_t *fast, uint8_t *reference) {
    float *zeros = (float *)calloc((size_t)n, sizeof(float));
    uint8_t *other = (uint8_t *)malloc((size_t)n);
    a8_map *slot = acquire_map(qmap);
    const uint32_t *table = slot && slot->valid ? slot->table : 0;
    int same = zeros && other, bins = REGISTER_SEARCH && slot && slot->steps_per_bin;
    if (same) {
        quantize_pair(x, zeros, n, 1.0f, 1.0f, fast, other, slot, slot, qmap, qmap);
        quantize_pair(zeros, x, n, 1.0f, 1.0f, other, reference, slot, slot, qmap, qmap);
        same = memcmp(fast, reference, (size_t)n) == 0;
        quantize_tables(x, zeros, n, 1.0f, 1.0f, reference, other, table, table, qmap, qmap);
        same = same && memcmp(fast, reference, (size_t)n) == 0;
        quantize_tables(zeros, x, n, 1.0f, 1.0f, other, reference, table, table, qmap, qmap);
        same = same && memcmp(fast, reference, (size_t)n) == 0;
        quantize_range(x, n, 1.0f, reference, table, qmap);
        same = same && memcmp(fast, reference, (size_t)n) == 0;
    }
    release_map(slot);
    free(zeros);
    free(other);
    for (int64_t i = 0; i < n; i++) reference[i] = quantize(x[i], qmap);
    return same ? (bins ? 2 : table != 0) : -1;
}

