/* The exact join and split of lean masters (lightning_mp/kernels/bits.py states the contract): an fp32 value is its
 * bf16 half, rounded half up, plus the signed int16 remainder of its low bits. One definition for both kernels
 * (lean_update.c, lean_adam8bit.c): lightning_mp/kernels/native.py puts it where a source says LEAN_BITS. */
static inline float join(uint16_t high, int16_t low) {
    uint32_t bits = ((uint32_t)high << 16) + (uint32_t)(int32_t)low;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline void split(float value, uint16_t *high, int16_t *low) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint32_t rounded = (bits + 0x8000u) >> 16;
    if (value != value) rounded = (bits >> 16) | 0x0040u; /* a NaN stays a (quiet) NaN in the bf16 half */
    *high = (uint16_t)rounded;
    *low = (int16_t)(uint16_t)(bits & 0xFFFFu);
}
