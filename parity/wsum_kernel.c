/* WSUM64's run sums in one pass (parity/checksum.py defines the checksum).
 *
 * (S, T) = (sum_j w_j, sum_j j * w_j) mod 2^64 over n little-endian 64-bit words, j from 0.
 * Words are taken as rows of LANES; per lane, p accumulates the words and q accumulates p after
 * each row, so that after R rows q = sum_r (R - r) * w_r and sum_r r * w_r = R * p - q. Only
 * additions touch the data: they vectorise with SSE2, and each word is read once.
 * Unsigned arithmetic wraps mod 2^64, which is the checksum's modulus. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define LANES 8

void parity_wsum_run_sums(const unsigned char *bytes, size_t n_words, uint64_t *out) {
    uint64_t p[LANES] = {0}, q[LANES] = {0}, row[LANES];
    const size_t rows = n_words / LANES;
    for (size_t r = 0; r < rows; r++) {
        memcpy(row, bytes + r * LANES * 8, sizeof row); /* no alignment assumed */
        for (int k = 0; k < LANES; k++) {
            p[k] += row[k];
            q[k] += p[k];
        }
    }
    uint64_t s = 0, t = 0;
    for (int k = 0; k < LANES; k++) {
        s += p[k];
        t += LANES * ((uint64_t)rows * p[k] - q[k]) + (uint64_t)k * p[k];
    }
    for (size_t j = rows * LANES; j < n_words; j++) {
        uint64_t w;
        memcpy(&w, bytes + j * 8, 8);
        s += w;
        t += (uint64_t)j * w;
    }
    out[0] = s;
    out[1] = t;
}
