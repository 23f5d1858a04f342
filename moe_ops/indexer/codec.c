/* The compact (MOEI) indexer codec's payload loops in C: moe_ops/indexer/wire.py is the format's
 * definition and its numpy twin (the two write the same bytes and read the same rows; the tests
 * compare them). Python checks the header and the sizes; these functions code the rows. Built at
 * first use by moe_ops/_runtime/native.py with the system C compiler (C99, no dependencies).
 *
 * Records are layer-major: record (layer j, row t) codes row t of layer j against row t - 1 of the
 * same layer (row 0 is FULL). A row is a set of positions in [0, context), sorted ascending.
 * FULL: the gaps of the row (p[0], then p[i] - p[i-1] - 1) in w1 bits each; DELTA: the gaps of the
 * positions the previous row had and this one drops (w1 bits), then of those it adds (w2 bits).
 * Widths: the bit length of the widest gap. Payload: every record's gaps in record order, LSB
 * first, no alignment. A DELTA is chosen when it codes in fewer bits than the FULL row.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MOEI_ERR_RANGE (-1)     /* a position outside [-1, context) */
#define MOEI_ERR_REPEAT (-2)    /* a position repeated within its row */
#define MOEI_ERR_PAYLOAD (-3)   /* the payload ends before the headers say */
#define MOEI_ERR_CONTEXT (-4)   /* a decoded position at or beyond context */
#define MOEI_ERR_DROP (-5)      /* a DELTA drops a position its previous row lacks */
#define MOEI_ERR_ADD (-6)       /* a DELTA adds a position its previous row has */
#define MOEI_ERR_COUNT (-7)     /* a row's count disagrees with k or its header */
#define MOEI_ERR_HEADER (-8)    /* a record header the format does not define */

static int bit_length(uint32_t x) {
    int n = 0;
    while (x) {
        n++;
        x >>= 1;
    }
    return n;
}

/* LSD radix sort of m values below 2**bits (bits <= 32), 11 bits at most a pass; tmp: m values */
static uint32_t *radix_sort(uint32_t *a, uint32_t *tmp, int64_t m, int bits) {
    uint32_t count[2048];
    int passes = (bits + 10) / 11;
    if (passes == 0 || m < 2) return a;
    int digit = (bits + passes - 1) / passes;
    uint32_t mask = (1u << digit) - 1u;
    for (int p = 0; p < passes; p++) {
        int shift = p * digit;
        memset(count, 0, sizeof(uint32_t) * ((size_t)mask + 1));
        for (int64_t i = 0; i < m; i++) count[(a[i] >> shift) & mask]++;
        uint32_t sum = 0;
        for (uint32_t d = 0; d <= mask; d++) {
            uint32_t c = count[d];
            count[d] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < m; i++) tmp[count[(a[i] >> shift) & mask]++] = a[i];
        uint32_t *t = a;
        a = tmp;
        tmp = t;
    }
    return a;
}

typedef struct {
    uint8_t *out;
    int64_t at; /* bytes written */
    uint64_t acc;
    int nbits;
} writer_t;

static inline void put(writer_t *w, uint32_t value, int width) {
    if (!width) return;
    w->acc |= (uint64_t)value << w->nbits;
    w->nbits += width;
    while (w->nbits >= 32) {
        uint32_t low = (uint32_t)w->acc;
        memcpy(w->out + w->at, &low, 4); /* little-endian hosts: x86-64, aarch64 */
        w->at += 4;
        w->acc >>= 32;
        w->nbits -= 32;
    }
}

static int64_t flush(writer_t *w) {
    while (w->nbits > 0) {
        w->out[w->at++] = (uint8_t)w->acc;
        w->acc >>= 8;
        w->nbits -= 8;
    }
    return w->at;
}

static uint32_t max_gap(const uint32_t *v, int64_t m) {
    uint32_t widest = m ? v[0] : 0;
    for (int64_t i = 1; i < m; i++) {
        uint32_t g = v[i] - v[i - 1] - 1u;
        if (g > widest) widest = g;
    }
    return widest;
}

static void put_gaps(writer_t *w, const uint32_t *v, int64_t m, int width) {
    if (!width || !m) return;
    put(w, v[0], width);
    for (int64_t i = 1; i < m; i++) put(w, v[i] - v[i - 1] - 1u, width);
}

/* the set bits of words[0, n_words) as ascending positions into out; returns their count */
static int64_t bits_to_positions(const uint64_t *words, int64_t n_words, uint32_t *out) {
    int64_t m = 0;
    for (int64_t w = 0; w < n_words; w++) {
        uint64_t x = words[w];
        while (x) {
            out[m++] = (uint32_t)(w * 64 + __builtin_ctzll(x));
            x &= x - 1;
        }
    }
    return m;
}

/* Encodes positions (n, L, k) int32 with element strides (s_t, s_l, s_k) into the record headers
 * (R = L * n each) and the payload (capacity: R * k * 4 + 8 bytes at the least). scratch: 5 * k
 * uint32. bitmaps: 2 * n_words zeroed words, n_words = ceil(context / 64), or n_words 0: a row is
 * compared with its previous one by a merge instead of bitmaps (for contexts whose bitmaps would
 * not stay in cache). Returns the payload's bytes, or a MOEI_ERR_* code (*bad: the offending
 * value); the bitmaps are left zeroed on success. */
int64_t moei_encode(const int32_t *pos, int64_t n, int64_t n_layers, int64_t k, int64_t s_t, int64_t s_l,
                    int64_t s_k, int64_t context, uint8_t *mode_w1, uint8_t *w2, uint16_t *c1, uint16_t *c2,
                    uint8_t *payload, uint32_t *scratch, uint64_t *bitmaps, int64_t n_words, int64_t *bad) {
    writer_t w = {payload, 0, 0, 0};
    int bits = bit_length((uint32_t)(context - 1));
    uint32_t *cur_a = scratch, *tmp_a = scratch + k, *prev = scratch + 2 * k;
    uint32_t *drop = scratch + 3 * k, *add = scratch + 4 * k;
    for (int64_t j = 0; j < n_layers; j++) {
        int64_t m_prev = 0;
        for (int64_t t = 0; t < n; t++) {
            int64_t r = j * n + t;
            const int32_t *row = pos + t * s_t + j * s_l;
            int64_t m = 0;
            int64_t nd = 0, na = 0;
            int sorted = 1;
            for (int64_t i = 0; i < k; i++) {
                int32_t v = row[i * s_k];
                if (v == -1) continue;
                if (v < -1 || (int64_t)v >= context) {
                    *bad = v;
                    return MOEI_ERR_RANGE;
                }
                sorted &= !m || cur_a[m - 1] <= (uint32_t)v;
                cur_a[m++] = (uint32_t)v;
            }
            /* rows from moe-ops' own selection come sorted; SGLang's indexer lists them by score:
             * a dense row (4+ positions a bitmap word: 8K context, k >= 512) sorts by setting its
             * bits and reading them back, any other by a radix sort */
            uint32_t *cur = cur_a;
            if (!sorted && n_words && 4 * n_words <= m) {
                uint64_t *now = bitmaps + (t & 1) * n_words;
                for (int64_t i = 0; i < m; i++) now[cur_a[i] >> 6] |= 1ull << (cur_a[i] & 63);
                cur = tmp_a;
                if (bits_to_positions(now, n_words, cur) != m) { /* a repeat collapsed into one bit */
                    *bad = -1;
                    return MOEI_ERR_REPEAT;
                }
            } else if (!sorted) {
                cur = radix_sort(cur_a, tmp_a, m, bits);
            }
            /* sorted, a repeat is a gap of -1: the widest gap (as uint32) tells both */
            uint32_t widest = max_gap(cur, m);
            if (widest == UINT32_MAX) {
                for (int64_t i = 1; i < m; i++) {
                    if (cur[i] == cur[i - 1]) *bad = cur[i];
                }
                return MOEI_ERR_REPEAT;
            }
            uint32_t *free_a = cur == cur_a ? tmp_a : cur_a; /* the sort's other buffer */
            if (n_words) {
                /* membership through bitmaps of the context: this row's bits in `now`, the previous
                 * row's in `before` (cleared word by word through its positions, not by a memset);
                 * independent steps, where a merge's steps each wait for the last comparison */
                uint64_t *now = bitmaps + (t & 1) * n_words, *before = bitmaps + ((t + 1) & 1) * n_words;
                for (int64_t i = 0; i < m; i++) {
                    uint32_t v = cur[i];
                    now[v >> 6] |= 1ull << (v & 63);
                    add[na] = v;
                    na += !((before[v >> 6] >> (v & 63)) & 1u); /* before is all zero at row 0 */
                }
                if (t > 0) {
                    for (int64_t i = 0; i < m_prev; i++) {
                        uint32_t v = prev[i];
                        drop[nd] = v;
                        nd += !((now[v >> 6] >> (v & 63)) & 1u);
                        before[v >> 6] = 0; /* read by the loop above only */
                    }
                }
            }
            int w_full = bit_length(widest);
            int64_t full_bits = m * (int64_t)w_full;
            int use_delta = 0;
            int w_drop = 0, w_add = 0;
            if (t > 0 && !n_words) {
                /* a merge without branches on the values (they are unpredictable for sets that
                 * changed a lot: a branchy merge cost 20 us a 2048-row): each step writes both
                 * candidates and advances by the comparisons */
                int64_t i = 0, q = 0;
                while (i < m_prev && q < m) {
                    uint32_t a = prev[i], b = cur[q];
                    drop[nd] = a;
                    add[na] = b;
                    nd += a < b;
                    na += b < a;
                    i += a <= b;
                    q += b <= a;
                }
                while (i < m_prev) drop[nd++] = prev[i++];
                while (q < m) add[na++] = cur[q++];
            }
            if (t > 0) {
                w_drop = bit_length(max_gap(drop, nd));
                w_add = bit_length(max_gap(add, na));
                use_delta = nd * (int64_t)w_drop + na * (int64_t)w_add < full_bits;
            }
            if (use_delta) {
                mode_w1[r] = (uint8_t)(0x80 | w_drop);
                w2[r] = (uint8_t)w_add;
                c1[r] = (uint16_t)nd;
                c2[r] = (uint16_t)na;
                put_gaps(&w, drop, nd, w_drop);
                put_gaps(&w, add, na, w_add);
            } else {
                mode_w1[r] = (uint8_t)w_full;
                w2[r] = 0;
                c1[r] = (uint16_t)m;
                c2[r] = 0;
                put_gaps(&w, cur, m, w_full);
            }
            /* this row is the next one's previous; its old buffer and the free one take the next row */
            cur_a = prev;
            tmp_a = free_a;
            prev = cur;
            m_prev = m;
        }
        if (n_words) { /* the layer's last row: its bits cleared for the next layer's row 0 */
            uint64_t *last = bitmaps + ((n - 1) & 1) * n_words;
            for (int64_t i = 0; i < m_prev; i++) last[prev[i] >> 6] = 0;
        }
    }
    return flush(&w);
}

typedef struct {
    const uint8_t *data;
    int64_t bits;  /* payload bits */
    int64_t at;    /* next bit */
} reader_t;

/* m gaps of `width` bits into ascending positions (first = gap, then prev + gap + 1); 0 or error */
static int read_values(reader_t *rd, int64_t m, int width, int64_t context, uint32_t *out) {
    if (rd->at + m * (int64_t)width > rd->bits) return MOEI_ERR_PAYLOAD;
    int64_t value = -1;
    uint64_t mask = width ? ((1ull << width) - 1ull) : 0;
    for (int64_t i = 0; i < m; i++) {
        uint64_t gap = 0;
        if (width) {
            int64_t byte = rd->at >> 3;
            int shift = (int)(rd->at & 7);
            uint64_t word = 0;
            /* 5 bytes hold any 31-bit field at any bit offset; the caller pads the payload by 8 */
            memcpy(&word, rd->data + byte, 8);
            gap = (word >> shift) & mask;
            rd->at += width;
        }
        value += (int64_t)gap + 1;
        if (value >= context) return MOEI_ERR_CONTEXT;
        out[i] = (uint32_t)value;
    }
    return 0;
}

/* Decodes the payload (payload_bits: its bytes * 8; padded by 8 zero bytes) of R = L * n records
 * into out (n, L, k) int32, -1 after each row's m positions. Python checked the fixed header and
 * that the record headers fit; this checks the rest, as the numpy twin does: the modes and widths,
 * every count, every position, the payload's length. scratch: 4 * k uint32. Returns 0 or a
 * MOEI_ERR_* code (the twin then decodes again to name the problem). */
int64_t moei_decode(const uint8_t *payload, int64_t payload_bits, int64_t n, int64_t n_layers, int64_t k,
                    int64_t context, const uint8_t *mode_w1, const uint8_t *w2, const uint16_t *c1,
                    const uint16_t *c2, int32_t *out, uint32_t *scratch) {
    reader_t rd = {payload, payload_bits, 0};
    uint32_t *prev = scratch, *cur = scratch + k, *drop = scratch + 2 * k, *add = scratch + 3 * k;
    for (int64_t j = 0; j < n_layers; j++) {
        int64_t m_prev = 0;
        for (int64_t t = 0; t < n; t++) {
            int64_t r = j * n + t;
            int delta = (mode_w1[r] & 0x80) != 0;
            int width1 = mode_w1[r] & 0x3F;
            int64_t m;
            int err;
            if ((mode_w1[r] & 0x40) || width1 > 31 || w2[r] > 31) return MOEI_ERR_HEADER;
            if (!delta) {
                m = c1[r];
                if (m > k || c2[r] || w2[r]) return MOEI_ERR_HEADER;
                if ((err = read_values(&rd, m, width1, context, cur))) return err;
            } else {
                int64_t nd = c1[r], na = c2[r];
                if (t == 0 || nd > m_prev || na > k) return MOEI_ERR_COUNT;
                if ((err = read_values(&rd, nd, width1, context, drop))) return err;
                if ((err = read_values(&rd, na, w2[r], context, add))) return err;
                /* cur = (prev - drop) | add: every drop in prev, no add in prev */
                int64_t i = 0, d = 0, a = 0;
                m = 0;
                while (i < m_prev || a < na) {
                    if (a >= na || (i < m_prev && prev[i] < add[a])) {
                        if (d < nd && drop[d] == prev[i]) {
                            d++;
                        } else {
                            if (d < nd && drop[d] < prev[i]) return MOEI_ERR_DROP;
                            if (m >= k) return MOEI_ERR_COUNT;
                            cur[m++] = prev[i];
                        }
                        i++;
                    } else if (i < m_prev && prev[i] == add[a]) {
                        return MOEI_ERR_ADD;
                    } else {
                        if (m >= k) return MOEI_ERR_COUNT;
                        cur[m++] = add[a++];
                    }
                }
                if (d < nd) return MOEI_ERR_DROP;
            }
            int32_t *row = out + (t * n_layers + j) * k;
            for (int64_t i = 0; i < m; i++) row[i] = (int32_t)cur[i];
            for (int64_t i = m; i < k; i++) row[i] = -1;
            uint32_t *swap = prev;
            prev = cur;
            cur = swap;
            m_prev = m;
        }
    }
    /* the payload is the records' bits to a whole byte, no more */
    return (rd.at + 7) / 8 == (payload_bits + 7) / 8 ? 0 : MOEI_ERR_PAYLOAD;
}
