#include <stdint.h>
#include <string.h>
#define MOD 65521
/* the same walk as deltastore/kernels/apply.py _walk + _sums, 2-byte words, int32 positions */
int stage16(const uint8_t *raw, int64_t k, int64_t e, int64_t L, int64_t n,
            const uint16_t *words, int64_t start, int32_t *pos_out, uint16_t *mask_out,
            int64_t *sums) {
  int64_t width = (L + 7) / 8, at_low = 12 + k, at_esc = at_low + width * k, at_mask = at_esc + 4 * e;
  uint64_t top = (uint64_t)((n - 1) >> L), cap = 1ull << L;
  int64_t esc = 0, prev = -1, total = 0, jsum = 0, psum = 0;
  uint16_t old[512];
  int64_t blk = 0;
  for (int64_t i = 0; i < k; i++) {
    uint64_t high = raw[12 + i];
    if (high == 255) {
      if (esc >= e) return 2;
      uint64_t v = 0;
      for (int j = 0; j < 4; j++) v |= (uint64_t)raw[at_esc + j * e + esc] << (8 * j);
      high += v; esc++;
    }
    if (high > top) return 3;
    uint64_t gap = high << L;
    if (width) {
      uint64_t low = 0;
      for (int j = 0; j < width; j++) low |= (uint64_t)raw[at_low + j * k + i] << (8 * j);
      if (low >= cap) return 1;
      gap |= low;
    }
    int64_t p = prev + 1 + (int64_t)gap;
    if (p >= n) return 3;
    prev = p;
    uint16_t m = raw[at_mask + i] | (raw[at_mask + k + i] << 8);
    if (!m) return 4;
    mask_out[i] = m;
    pos_out[i] = (int32_t)(start + p);
    __builtin_prefetch(&words[start + p], 1, 3);
    if ((i + 1) % 512 == 0 || i + 1 == k) {
      int64_t lo = blk, hi = i + 1;
      for (int64_t t = lo; t < hi; t++) old[t - lo] = words[pos_out[t]];
      for (int64_t t = lo; t < hi; t++) {
        uint16_t was = old[t - lo], now = was ^ mask_out[t];
        int64_t d0 = (int64_t)(now & 255) - (int64_t)(was & 255);
        int64_t d1 = (int64_t)(now >> 8) - (int64_t)(was >> 8);
        int64_t d = d0 + d1;
        jsum += d1; total += d; psum += ((int64_t)pos_out[t] % MOD) * d;
      }
      blk = hi;
    }
  }
  if (esc != e) return 2;
  sums[0] = total; sums[1] = jsum; sums[2] = psum;
  return 0;
}
