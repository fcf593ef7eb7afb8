/* The verifier's compiled lane: a thread's plain transitions, checked in one pass each.
 *
 * services/verify/checks.py is the verifier, and the reference. This lane takes a
 * line of a bundle's records.jsonl only when it can confirm, by itself, everything
 * the reference would check of it and that the reference would find nothing: then it
 * advances the thread's chain exactly as the reference would (the next version, the
 * parent digest, the replayed state, the policy the thread is bound to, the states a
 * revert may restore, the last record). Anything else (a finding, a form it does not
 * know, a genesis, a revert, a receipt, a checkpoint at the version, a float, an
 * escaped object member name...) it declines, changing nothing, and the reference
 * takes the line. So the lane can only make a run faster, never change its verdict or
 * its findings: tests/unit/test_verify_lane.py runs the verifier with and without it
 * over hostile bundles and compares every finding.
 *
 * What it confirms of a line (docs/verification.md, "The compiled lane"):
 *  - the exporter's exact layout: {"thread_id":...,"version":...,...,"committed_at":...}
 *    with every member, in the exporter's order, no whitespace, the strings valid
 *    UTF-8 (record and state may hold escapes; the other strings none);
 *  - the record: canonical RFC 8785 bytes (checked while scanning: no whitespace,
 *    member names in ascending order, unescaped and inside the Basic Multilingual
 *    Plane, so that byte order is UTF-16 order; only the escapes RFC 8785 writes;
 *    integers of at most 15 digits, no floats), a format 1 or 2 transition record of
 *    the thread at the next version, its digest (SHA-256) and signature (HMAC-SHA256
 *    under its key id, when a keyring is given), the copies in the line's columns,
 *    the policy (known, the thread's), the role (asked of the reference once per
 *    node id), the parent digest;
 *  - the replay: the previous state's members with the patch's (a member sets its
 *    key, a null removes it), written in canonical form on the bytes, hashed to the
 *    record's state_digest, and equal to the kept state body when there is one;
 *  - the risk rules: none matched (asked of the reference once per distinct input of
 *    the policy's risk rules, and remembered), no receipt, format 2's risk_rules [].
 *
 * SHA-256 is OpenSSL's (libcrypto), called directly: its SHA256_Init/Update/Final, with
 * no provider dispatch and no allocation per call (the EVP interface's HMAC copied
 * its key's contexts through the heap twice a record). HMAC-SHA256 (RFC 2104) is built
 * on it: each key's inner and outer states are hashed once, and copied per record.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <datetime.h>
/* SHA256_Init/Update/Final: deprecated in OpenSSL 3, still in 3 and 4 (an OpenSSL
 * built without its deprecated interfaces leaves the lane unbuilt: the reference runs) */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 64
#define MAX_DIGITS 15 /* below 2^53: an integer's canonical form is its digits */
#define MEMO_SIZE 4096
#define NODES 16     /* node ids whose role the lane remembers */
#define NODE_MAX 256 /* the longest it remembers */

/* --- growable buffers and member lists ----------------------------------------- */

typedef struct {
    unsigned char *p;
    Py_ssize_t len, cap;
} Buf;

static int
buf_reserve(Buf *b, Py_ssize_t more)
{
    if (b->len + more <= b->cap)
        return 1;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more) {
        if (cap > PY_SSIZE_T_MAX / 2)
            return 0;
        cap *= 2;
    }
    unsigned char *p = PyMem_Realloc(b->p, cap);
    if (p == NULL)
        return 0;
    b->p = p;
    b->cap = cap;
    return 1;
}

static int
buf_put(Buf *b, const unsigned char *data, Py_ssize_t n)
{
    if (n == 0)
        return 1;
    if (!buf_reserve(b, n))
        return 0;
    memcpy(b->p + b->len, data, n);
    b->len += n;
    return 1;
}

typedef struct {
    Py_ssize_t key, key_len, value, value_len; /* offsets: the name without quotes */
} Member;

typedef struct {
    Member *m;
    Py_ssize_t n, cap;
} Members;

static int
members_add(Members *ms, Member m)
{
    if (ms->n == ms->cap) {
        Py_ssize_t cap = ms->cap ? ms->cap * 2 : 32;
        Member *p = PyMem_Realloc(ms->m, cap * sizeof(Member));
        if (p == NULL)
            return 0;
        ms->m = p;
        ms->cap = cap;
    }
    ms->m[ms->n++] = m;
    return 1;
}

/* --- scanning ------------------------------------------------------------------ */

/* What a byte is inside a JSON string: 0 an ASCII character that stands for itself
 * (0x20-0x7F but the quote and the backslash), 1 the quote, 2 the backslash, 3 a
 * control character, 4 a byte of a multi-byte UTF-8 sequence. */
static unsigned char STRING_BYTE[256];

static void
init_string_bytes(void)
{
    for (int c = 0; c < 256; c++)
        STRING_BYTE[c] = c < 0x20 ? 3 : c == '"' ? 1 : c == '\\' ? 2 : c < 0x80 ? 0 : 4;
}


/* The bytes of the 8 at w (in memory order, little-endian) that are not plain: a
 * control character, the quote, the backslash, or 0x80 and above; a flag in the high
 * bit of each such byte, exact from the lowest (borrows only run upwards). */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
static inline uint64_t
not_plain(uint64_t w)
{
    uint64_t quote = w ^ (ONES * '"'), backslash = w ^ (ONES * '\\');
    return (((w - ONES * 0x20) & ~w) | ((quote - ONES) & ~quote) |
            ((backslash - ONES) & ~backslash) | w) &
           HIGHS;
}

#if defined(__SSE2__)
#include <emmintrin.h>

/* The bytes of the 16 at v that are a control character or 0x80 and above: bit i for
 * byte i (what no plain run holds besides the quote and the backslash). */
static inline unsigned
control_or_high(__m128i v)
{
    const __m128i controls = _mm_set1_epi8(0x1F);
    return (unsigned)(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(v, controls), controls)) |
                      _mm_movemask_epi8(v));
}
#endif

/* Past the run of plain ASCII characters at p: 16 bytes at a time where SSE2 is (every
 * x86-64), then 8, then one by one. */
static inline const unsigned char *
skip_plain(const unsigned char *p, const unsigned char *end)
{
#if defined(__SSE2__)
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\');
    while (end - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        unsigned mask = (unsigned)_mm_movemask_epi8(
                            _mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash))) |
                        control_or_high(v);
        if (mask)
            return p + __builtin_ctz(mask);
        p += 16;
    }
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (end - p >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint64_t special = not_plain(w);
        if (special)
            return p + (__builtin_ctzll(special) >> 3);
        p += 8;
    }
#endif
    while (p < end && STRING_BYTE[*p] == 0)
        p++;
    return p;
}

/* One UTF-8 sequence at p (first byte >= 0x80), as Python and orjson accept it: no
 * overlong form, no surrogate, nothing above U+10FFFF. Its length, or 0. */
static int
utf8_seq(const unsigned char *p, const unsigned char *end, int *four)
{
    unsigned char c = p[0];
    if (c >= 0xC2 && c <= 0xDF)
        return (end - p >= 2 && (p[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (end - p < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80)
            return 0;
        if (c == 0xE0 && p[1] < 0xA0)
            return 0;
        if (c == 0xED && p[1] > 0x9F)
            return 0; /* a surrogate */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (end - p < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 ||
            (p[3] & 0xC0) != 0x80)
            return 0;
        if (c == 0xF0 && p[1] < 0x90)
            return 0;
        if (c == 0xF4 && p[1] > 0x8F)
            return 0;
        *four = 1;
        return 4;
    }
    return 0;
}

static int
lower_hex(unsigned char c)
{
    return (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
}

/* 1 for the lower-case hex digits */
static unsigned char LOWER_HEX[256];

static void
init_hex(void)
{
    for (int c = 0; c < 256; c++)
        LOWER_HEX[c] = lower_hex((unsigned char)c) >= 0;
}

/* A canonical string at *pp (on its opening quote): only the escapes RFC 8785 writes
 * (\" \\ \b \f \n \r \t, and \u00xx in lower case for the other control characters),
 * every other character as valid UTF-8. *plain: no escape and no character outside
 * the BMP (so its bytes order as its UTF-16 code units). 1 if it is one. */
static int
scan_string(const unsigned char **pp, const unsigned char *end, int *plain)
{
    const unsigned char *p = *pp + 1;
    int escaped = 0, four = 0;
    while ((p = skip_plain(p, end)) < end) {
        unsigned char c = *p;
        if (c == '"') {
            *pp = p + 1;
            *plain = !escaped && !four;
            return 1;
        }
        if (c == '\\') {
            escaped = 1;
            if (end - p < 2)
                return 0;
            unsigned char e = p[1];
            if (e == '"' || e == '\\' || e == 'b' || e == 'f' || e == 'n' || e == 'r' ||
                e == 't') {
                p += 2;
                continue;
            }
            if (e != 'u' || end - p < 6 || p[2] != '0' || p[3] != '0')
                return 0;
            int hi = lower_hex(p[4]), lo = lower_hex(p[5]);
            if (hi < 0 || lo < 0 || hi > 1)
                return 0;
            int code = hi * 16 + lo;
            if (code == 8 || code == 9 || code == 10 || code == 12 || code == 13)
                return 0; /* written short */
            p += 6;
            continue;
        }
        if (c < 0x20)
            return 0;
        if (c < 0x80) {
            p++;
            continue;
        }
        int n = utf8_seq(p, end, &four);
        if (n == 0)
            return 0;
        p += n;
    }
    return 0;
}

/* Whether the n bytes at a and b are equal: inline for the short spans a row is made
 * of (names, ids, digests), without a call. */
static inline int
bytes_equal(const unsigned char *a, const unsigned char *b, Py_ssize_t n)
{
    uint64_t x, y, diff = 0;
    Py_ssize_t i = 0;
    for (; n - i >= 8; i += 8) {
        memcpy(&x, a + i, 8);
        memcpy(&y, b + i, 8);
        diff |= x ^ y;
    }
    if (i < n && n >= 8) { /* the last word, overlapping the one before */
        memcpy(&x, a + n - 8, 8);
        memcpy(&y, b + n - 8, 8);
        diff |= x ^ y;
    }
    else
        for (; i < n; i++)
            diff |= (uint64_t)(a[i] ^ b[i]);
    return diff == 0;
}

/* The order of two member names (memcmp's sign, then the shorter first). */
static inline int
name_order(const unsigned char *a, Py_ssize_t a_len, const unsigned char *b, Py_ssize_t b_len)
{
    if (a_len > 0 && b_len > 0 && a[0] != b[0])
        return a[0] < b[0] ? -1 : 1; /* most names differ at once: no call */
    Py_ssize_t n = a_len < b_len ? a_len : b_len;
    int order = memcmp(a, b, (size_t)n);
    if (order == 0)
        order = (a_len > b_len) - (a_len < b_len);
    return order;
}

static int scan_value(const unsigned char **pp, const unsigned char *end, int depth);

/* The n bytes of text at *pp (then *pp past them), or 0. */
static inline int
literal_n(const unsigned char **pp, const unsigned char *end, const char *text, Py_ssize_t n)
{
    if (end - *pp < n || memcmp(*pp, text, (size_t)n) != 0)
        return 0;
    *pp += n;
    return 1;
}

/* A string literal at *pp: its length known when compiled, so that the comparison
 * is inlined (a line has about fifteen of them). */
#define literal(pp, end, text) literal_n((pp), (end), "" text, (Py_ssize_t)sizeof(text) - 1)

/* After an item of an object or an array: a comma (1: another item follows, *pp past
 * it), the closing bracket (2: *pp past it), or anything else (0). */
static int
after_item(const unsigned char **pp, const unsigned char *end, unsigned char closing)
{
    if (*pp < end && (**pp == ',' || **pp == closing)) {
        return *(*pp)++ == ',' ? 1 : 2;
    }
    return 0;
}

/* The members of a canonical object at *pp (on its '{'), names strictly ascending
 * and plain; each member's offsets from base taken into out (when not NULL). */
static int
scan_object(const unsigned char **pp, const unsigned char *end, int depth,
            const unsigned char *base, Members *out, int *oom)
{
    const unsigned char *p = *pp + 1;
    const unsigned char *last = NULL;
    Py_ssize_t last_len = 0;
    if (depth > MAX_DEPTH)
        return 0;
    if (p < end && *p == '}') {
        *pp = p + 1;
        return 1;
    }
    for (;;) {
        if (p >= end || *p != '"')
            return 0;
        const unsigned char *name = p + 1;
        int plain = 0;
        if (!scan_string(&p, end, &plain) || !plain)
            return 0;
        Py_ssize_t name_len = (p - 1) - name;
        if (last != NULL && name_order(last, last_len, name, name_len) >= 0)
            return 0; /* not ascending, or a repeat */
        last = name;
        last_len = name_len;
        if (p >= end || *p != ':')
            return 0;
        p++;
        const unsigned char *value = p;
        if (!scan_value(&p, end, depth + 1))
            return 0;
        if (out != NULL) {
            Member m = {name - base, name_len, value - base, p - value};
            if (!members_add(out, m)) {
                *oom = 1;
                return 0;
            }
        }
        int next = after_item(&p, end, '}');
        if (next != 1) {
            *pp = p;
            return next == 2;
        }
    }
}

static int
scan_value(const unsigned char **pp, const unsigned char *end, int depth)
{
    const unsigned char *p = *pp;
    int plain, oom = 0;
    if (p >= end || depth > MAX_DEPTH)
        return 0;
    switch (*p) {
    case '{':
        return scan_object(pp, end, depth, p, NULL, &oom);
    case '[':
        p++;
        if (p < end && *p == ']') {
            *pp = p + 1;
            return 1;
        }
        for (;;) {
            if (!scan_value(&p, end, depth + 1))
                return 0;
            int next = after_item(&p, end, ']');
            if (next != 1) {
                *pp = p;
                return next == 2;
            }
        }
    case '"':
        return scan_string(pp, end, &plain);
    case 't':
        return literal(pp, end, "true");
    case 'f':
        return literal(pp, end, "false");
    case 'n':
        return literal(pp, end, "null");
    default: {
        int negative = 0, digits = 0;
        if (*p == '-') {
            negative = 1;
            p++;
        }
        if (p >= end || *p < '0' || *p > '9')
            return 0;
        if (*p == '0') {
            if (negative)
                return 0; /* -0 is written 0 */
            p++;
            digits = 1;
        }
        else {
            while (p < end && *p >= '0' && *p <= '9') {
                p++;
                digits++;
            }
        }
        if (digits > MAX_DIGITS)
            return 0;
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9')))
            return 0; /* a float (the reference's), or a leading zero */
        *pp = p;
        return 1;
    }
    }
}

/* A whole buffer that is one canonical object; its members into out. */
static int
scan_members(const unsigned char *data, Py_ssize_t len, Members *out, int *oom)
{
    const unsigned char *p = data, *end = data + len;
    out->n = 0;
    if (len < 2 || *p != '{')
        return 0;
    if (!scan_object(&p, end, 1, data, out, oom))
        return 0;
    return p == end;
}

/* --- the line ------------------------------------------------------------------- */

typedef struct {
    const unsigned char *p;
    Py_ssize_t len;
} Span;

/* A JSON string of the line with no escape and no control character, valid UTF-8
 * (what orjson parses to the same characters): its content. */
static int
line_plain(const unsigned char **pp, const unsigned char *end, Span *out)
{
    const unsigned char *p = *pp;
    int four = 0;
    if (p >= end || *p != '"')
        return 0;
    const unsigned char *start = ++p;
    while ((p = skip_plain(p, end)) < end) {
        unsigned char c = *p;
        if (c == '"') {
            out->p = start;
            out->len = p - start;
            *pp = p + 1;
            return 1;
        }
        if (c == '\\' || c < 0x20)
            return 0;
        if (c < 0x80) {
            p++;
            continue;
        }
        int n = utf8_seq(p, end, &four);
        if (n == 0)
            return 0;
        p += n;
    }
    return 0;
}

/* A string's run of plain characters and escaped quotes, 16 bytes at a time, with no
 * branch per escape (x86-64 with SSSE3; elsewhere line_decoded's word loop does it
 * all). A record embedded in a line has an escaped quote every dozen bytes or so: a
 * loop that stops at each one mispredicts a branch at each one.
 *
 * A block of 16 is taken when its only bytes that are not plain are backslashes each
 * followed by a quote (and each quote follows a backslash): its bytes but the
 * backslashes are packed to the output by a byte shuffle chosen by the backslash
 * mask, 8 at a time. A block may end in a backslash when the next opens with its quote.
 * Any other block (the closing quote, another escape, a control character, a byte of
 * 0x80 and above) stops the run where it is, for the word loop to go on. A byte of 0x80
 * and above must stop it: the word loop checks a UTF-8 sequence whole, from its first
 * byte (packed, a sequence cut at a block's end would reach it as a lone continuation
 * byte; the escape property test fails so). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PACKED_RUNS 1
static uint64_t PACK[256]; /* the shuffle moving a word's bytes whose bit is clear first */
static unsigned char KEPT[256]; /* how many bits of a byte are clear */
static int pack_ok;        /* the CPU has SSSE3 */

static int
kept_of(int m)
{
    int kept = 8;
    for (; m; m &= m - 1)
        kept--;
    return kept;
}

static void
init_pack(void)
{
    for (int m = 0; m < 256; m++) {
        uint64_t order = 0;
        int j = 0;
        for (int i = 0; i < 8; i++)
            if (!((m >> i) & 1))
                order |= (uint64_t)i << (8 * j++);
        for (; j < 8; j++)
            order |= (uint64_t)0x80 << (8 * j); /* a zero byte, never kept */
        PACK[m] = order;
        KEPT[m] = (unsigned char)kept_of(m);
    }
    __builtin_cpu_init();
    pack_ok = __builtin_cpu_supports("ssse3");
}

/* From p (inside a string) to where the run stops, the decoded bytes written at *o
 * (then *o past them); writes up to 16 bytes past *o's new place, never past the
 * input's length from *o on. */
__attribute__((target("ssse3"))) static const unsigned char *
packed_run(const unsigned char *p, const unsigned char *end, unsigned char **o)
{
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\'),
                  high_half = _mm_set_epi64x(0x0808080808080808LL, 0);
    unsigned char *out = *o;
    unsigned carried = 0; /* the last block ended in a backslash: this one must open
                             with its quote */
    while (end - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        unsigned bs = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v, backslash));
        unsigned q = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v, quote));
        if (control_or_high(v) || q != (((bs << 1) | carried) & 0xFFFF))
            break;
        __m128i order = _mm_add_epi8(
            _mm_set_epi64x((long long)PACK[bs >> 8], (long long)PACK[bs & 0xFF]), high_half);
        __m128i packed = _mm_shuffle_epi8(v, order);
        unsigned low = KEPT[bs & 0xFF];
        _mm_storel_epi64((__m128i *)out, packed);
        _mm_storel_epi64((__m128i *)(out + low), _mm_srli_si128(packed, 8));
        out += low + KEPT[bs >> 8];
        carried = bs >> 15;
        p += 16;
    }
    *o = out;
    return p - carried; /* a backslash whose quote is not yet seen: the word loop's */
}
#endif

static int
hex4(const unsigned char *p)
{
    int v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned char c = p[i];
        int d = (c >= '0' && c <= '9')   ? c - '0'
                : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                                         : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* A JSON string of the line, decoded into out as UTF-8 (what the reference's
 * str.encode("utf-8", "surrogatepass") gives): any JSON escape but a surrogate. */
static int
line_decoded(const unsigned char **pp, const unsigned char *end, Buf *out, int *oom)
{
    const unsigned char *p = *pp;
    int four = 0;
    out->len = 0;
    if (p >= end || *p != '"')
        return 0;
    p++;
    /* decoding never lengthens a string: room for all of it, once, and for the 8
     * bytes a word copied ahead may write past it */
    if (!buf_reserve(out, end - p + 8)) {
        *oom = 1;
        return 0;
    }
    unsigned char *o = out->p;
    while (p < end) {
#ifdef PACKED_RUNS
        if (pack_ok)
            p = packed_run(p, end, &o);
#endif
        /* plain characters, copied as they are scanned: 8 at a time (a word written
         * whole, then kept up to its first byte that is not plain), then one by one */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        int again = 0; /* an escaped quote taken: the packed run may go on */
        while (end - p >= 8) {
            uint64_t w;
            memcpy(&w, p, 8);
            memcpy(o, &w, 8);
            uint64_t special = not_plain(w);
            if (!special) {
                p += 8;
                o += 8;
                continue;
            }
            int k = __builtin_ctzll(special) >> 3;
            p += k;
            o += k;
            /* an escaped quote inside the word, taken from the word (a record
             * embedded in a line has one every dozen bytes or so) */
            if (k < 7 && ((w >> (8 * k)) & 0xFFFF) == ('\\' | ('"' << 8))) {
                *o++ = '"';
                p += 2;
#ifdef PACKED_RUNS
                if (pack_ok) {
                    again = 1;
                    break;
                }
#endif
                continue;
            }
            break;
        }
        if (again)
            continue;
#endif
        while (p < end && STRING_BYTE[*p] == 0)
            *o++ = *p++;
        if (p >= end)
            return 0;
        /* the escaped quote first: a record embedded in a line has one every dozen
         * bytes or so */
        if (*p == '\\' && end - p >= 2 && p[1] == '"') {
            *o++ = '"';
            p += 2;
            continue;
        }
        if (STRING_BYTE[*p] == 3)
            return 0;
        if (STRING_BYTE[*p] == 4) {
            int n = utf8_seq(p, end, &four);
            if (n == 0)
                return 0;
            memcpy(o, p, n);
            o += n;
            p += n;
            continue;
        }
        if (*p == '"') {
            out->len = o - out->p;
            *pp = p + 1;
            return 1;
        }
        /* another escape */
        if (end - p < 2)
            return 0;
        switch (p[1]) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '/': *o++ = '/'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            /* six bytes in, at most three out */
            if (end - p < 6)
                return 0;
            int v = hex4(p + 2);
            if (v < 0 || (v >= 0xD800 && v <= 0xDFFF))
                return 0; /* surrogates: the reference's */
            if (v < 0x80)
                *o++ = (unsigned char)v;
            else if (v < 0x800) {
                *o++ = (unsigned char)(0xC0 | (v >> 6));
                *o++ = (unsigned char)(0x80 | (v & 0x3F));
            }
            else {
                *o++ = (unsigned char)(0xE0 | (v >> 12));
                *o++ = (unsigned char)(0x80 | ((v >> 6) & 0x3F));
                *o++ = (unsigned char)(0x80 | (v & 0x3F));
            }
            p += 6;
            continue;
        }
        default:
            return 0;
        }
        p += 2;
    }
    return 0;
}

/* Digits of a non-negative integer of at most MAX_DIGITS digits, no leading zero. */
static int
line_version(const unsigned char **pp, const unsigned char *end, long long *out)
{
    const unsigned char *p = *pp;
    long long v = 0;
    int digits = 0;
    if (p >= end || *p < '0' || *p > '9')
        return 0;
    if (*p == '0') {
        p++;
        digits = 1;
    }
    else
        while (p < end && *p >= '0' && *p <= '9') {
            v = v * 10 + (*p++ - '0');
            if (++digits > MAX_DIGITS)
                return 0;
        }
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9')))
        return 0;
    *out = v;
    *pp = p;
    return 1;
}

/* --- small checks ---------------------------------------------------------------- */

static int
is_hex64(const unsigned char *p, Py_ssize_t len)
{
    if (len != 64)
        return 0;
    unsigned char all = 1;
    for (int i = 0; i < 64; i++)
        all &= LOWER_HEX[p[i]];
    return all;
}

static inline int
same(Span a, const unsigned char *p, Py_ssize_t len)
{
    return a.len == len && bytes_equal(a.p, p, len);
}

static int
digits_at(const unsigned char *p, int n, int *out)
{
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9')
            return 0;
        v = v * 10 + (p[i] - '0');
    }
    *out = v;
    return 1;
}

/* A time exactly as format_time writes it, and a real date (what parse_time takes). */
static int
is_time(const unsigned char *p, Py_ssize_t len)
{
    static const char shape[] = "dddd-dd-ddTdd:dd:dd.ddddddZ";
    static const int days[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (len != 27)
        return 0;
    for (int i = 0; i < 27; i++) {
        if (shape[i] == 'd') {
            if (p[i] < '0' || p[i] > '9')
                return 0;
        }
        else if (p[i] != (unsigned char)shape[i])
            return 0;
    }
    int year = 0, month = 0, day = 0, hour = 0, minute = 0, second = 0;
    digits_at(p, 4, &year);
    digits_at(p + 5, 2, &month);
    digits_at(p + 8, 2, &day);
    digits_at(p + 11, 2, &hour);
    digits_at(p + 14, 2, &minute);
    digits_at(p + 17, 2, &second);
    if (year < 1 || month < 1 || month > 12 || hour > 23 || minute > 59 || second > 59)
        return 0;
    int leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    int most = days[month - 1] + (month == 2 && leap);
    return day >= 1 && day <= most;
}

static void
to_hex(const unsigned char *bytes, int n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < n; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
}

/* --- the lane ---------------------------------------------------------------------- */

typedef struct {
    PyObject *id;              /* bytes: the key id in UTF-8 */
    SHA256_CTX inner, outer;   /* HMAC: the states after the key's padded block */
} Key;

typedef struct {
    PyObject_HEAD
    /* the run's */
    Key *keys;
    Py_ssize_t nkeys;
    int keyring; /* HMAC checked */
    int ready;   /* __init__ completed */
    PyObject *policies; /* digest -> (name, has risk rules, inputs) */
    PyObject *role_ok;  /* node id -> bool, asked once per node id */
    PyObject *roles;
    PyObject *derive; /* (policy digest, old, state, patch, node id) -> bool: none matched */
    PyObject *memo;
    int began; /* __init__ called */
    Buf record, body, next, state, riskkey;
    Members members, old, patch;
    /* the thread's */
    int active;
    PyObject *thread_id; /* bytes */
    long long expected, stop;
    unsigned char parent[64];
    PyObject *policy_name; /* str or NULL */
    Buf earlier;           /* the state digests taken, 64 hex digits each */
    /* what was asked of the reference, for the rows that follow: node ids (whether
     * each has the role a transition needs), the last policy digest, and the last
     * risk rules' input (whether it matched none) */
    struct {
        unsigned char node[NODE_MAX];
        Py_ssize_t len;
        int genesis, allowed;
    } nodes[NODES];
    int nodes_known, nodes_next;
    PyObject *policy_digest, *policy; /* the last policy digest (str) and its entry */
    Buf risk_seen;                    /* the last risk key asked; risk_none its answer */
    int risk_known, risk_none;
    long long records;
    int last_kept; /* the last record taken (any, once records > 0) */
    long long last_version;
    char last_digest[64], last_state_digest[64];
} Lane;

static int
sha256_hex(const unsigned char *data, Py_ssize_t len, char out[64], unsigned char raw[32])
{
    SHA256_CTX c;
    if (!SHA256_Init(&c) || !SHA256_Update(&c, data, (size_t)len) || !SHA256_Final(raw, &c)) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
        return 0;
    }
    to_hex(raw, 32, out);
    return 1;
}

/* A key's HMAC-SHA256 states (RFC 2104): the key (hashed first when longer than a
 * block) padded to the block, XORed with 0x36 and 0x5c, each hashed as the first
 * block of its state. */
static int
hmac_key(Key *k, const unsigned char *key, size_t len)
{
    unsigned char block[SHA256_CBLOCK] = {0}, pad[SHA256_CBLOCK];
    int ok = 1;
    if (len > SHA256_CBLOCK) {
        SHA256_CTX c;
        ok = SHA256_Init(&c) && SHA256_Update(&c, key, len) && SHA256_Final(block, &c);
        /* SHA256_Final clears the block it buffered, not the chaining words: they
         * are SHA-256(key), the key HMAC uses */
        OPENSSL_cleanse(&c, sizeof(c));
    }
    else if (len > 0)
        memcpy(block, key, len);
    for (int i = 0; i < SHA256_CBLOCK; i++)
        pad[i] = block[i] ^ 0x36;
    ok = ok && SHA256_Init(&k->inner) && SHA256_Update(&k->inner, pad, SHA256_CBLOCK);
    for (int i = 0; i < SHA256_CBLOCK; i++)
        pad[i] = block[i] ^ 0x5c;
    ok = ok && SHA256_Init(&k->outer) && SHA256_Update(&k->outer, pad, SHA256_CBLOCK);
    OPENSSL_cleanse(block, sizeof(block));
    OPENSSL_cleanse(pad, sizeof(pad));
    return ok;
}

/* HMAC-SHA256 of the 32 bytes at data under k. */
static int
hmac_sha256(const Key *k, const unsigned char data[32], unsigned char mac[32])
{
    SHA256_CTX c = k->inner;
    int ok = SHA256_Update(&c, data, 32) && SHA256_Final(mac, &c);
    c = k->outer;
    ok = ok && SHA256_Update(&c, mac, 32) && SHA256_Final(mac, &c);
    OPENSSL_cleanse(&c, sizeof(c));
    return ok;
}

static void
lane_clear_thread(Lane *self)
{
    self->active = 0;
    Py_CLEAR(self->thread_id);
    Py_CLEAR(self->policy_name);
    self->earlier.len = 0;
}

static void
Lane_dealloc(Lane *self)
{
    lane_clear_thread(self);
    for (Py_ssize_t i = 0; i < self->nkeys; i++) {
        Py_XDECREF(self->keys[i].id);
        OPENSSL_cleanse(&self->keys[i].inner, sizeof(SHA256_CTX));
        OPENSSL_cleanse(&self->keys[i].outer, sizeof(SHA256_CTX));
    }
    PyMem_Free(self->keys);
    Py_XDECREF(self->policies);
    Py_XDECREF(self->role_ok);
    Py_XDECREF(self->roles);
    Py_XDECREF(self->derive);
    Py_XDECREF(self->memo);
    PyMem_Free(self->record.p);
    PyMem_Free(self->body.p);
    PyMem_Free(self->next.p);
    PyMem_Free(self->state.p);
    PyMem_Free(self->riskkey.p);
    PyMem_Free(self->earlier.p);
    PyMem_Free(self->risk_seen.p);
    Py_XDECREF(self->policy_digest);
    Py_XDECREF(self->policy);
    PyMem_Free(self->members.m);
    PyMem_Free(self->old.m);
    PyMem_Free(self->patch.m);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int policies_well_formed(PyObject *policies);

/* Lane(keys, policies, role_ok, derive): keys maps key id to key (None: no keyring,
 * no HMAC check); policies maps digest to (name, has risk rules, inputs), inputs a
 * tuple of (variable, names or None); role_ok(kind, node_id) and derive(...) ask
 * the reference. */
static int
Lane_init(Lane *self, PyObject *args, PyObject *kwds)
{
    PyObject *keys, *policies, *role_ok, *derive;
    static char *names[] = {"keys", "policies", "role_ok", "derive", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OO", names, &keys, &PyDict_Type,
                                     &policies, &role_ok, &derive))
        return -1;
    if (self->began) {
        PyErr_SetString(PyExc_RuntimeError, "Lane is initialised once");
        return -1;
    }
    if (!policies_well_formed(policies)) {
        PyErr_SetString(PyExc_TypeError,
                        "policies maps str to (str, bool, ((str, (bytes, ...) or None), ...))");
        return -1;
    }
    self->began = 1;
    if (keys != Py_None) {
        if (!PyDict_Check(keys)) {
            PyErr_SetString(PyExc_TypeError, "keys must be a dict or None");
            return -1;
        }
        self->keyring = 1;
        Py_ssize_t n = PyDict_Size(keys), pos = 0, i = 0;
        self->keys = PyMem_Calloc(n ? n : 1, sizeof(Key));
        if (self->keys == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        PyObject *id, *key;
        while (PyDict_Next(keys, &pos, &id, &key)) {
            if (!PyUnicode_Check(id) || !PyBytes_Check(key)) {
                PyErr_SetString(PyExc_TypeError, "keys maps str to bytes");
                return -1;
            }
            Key *k = &self->keys[i++];
            self->nkeys = i;
            k->id = PyUnicode_AsEncodedString(id, "utf-8", "surrogatepass");
            if (k->id == NULL)
                return -1;
            if (!hmac_key(k, (const unsigned char *)PyBytes_AS_STRING(key),
                          (size_t)PyBytes_GET_SIZE(key))) {
                PyErr_SetString(PyExc_RuntimeError, "OpenSSL HMAC failed");
                return -1;
            }
        }
    }
    self->policies = Py_NewRef(policies);
    self->role_ok = Py_NewRef(role_ok);
    self->derive = Py_NewRef(derive);
    self->roles = PyDict_New();
    self->memo = PyDict_New();
    if (self->roles == NULL || self->memo == NULL)
        return -1;
    self->ready = 1;
    return 0;
}

/* Each policy (name, has risk rules, inputs), each input (variable, names or None),
 * each name bytes: what risk_key reads without checking again. */
static int
policies_well_formed(PyObject *policies)
{
    Py_ssize_t pos = 0;
    PyObject *digest, *policy;
    while (PyDict_Next(policies, &pos, &digest, &policy)) {
        if (!PyUnicode_Check(digest) || !PyTuple_Check(policy) || PyTuple_GET_SIZE(policy) != 3 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(policy, 0)) ||
            !PyBool_Check(PyTuple_GET_ITEM(policy, 1)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(policy, 2)))
            return 0;
        PyObject *inputs = PyTuple_GET_ITEM(policy, 2);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inputs); i++) {
            PyObject *input = PyTuple_GET_ITEM(inputs, i);
            if (!PyTuple_Check(input) || PyTuple_GET_SIZE(input) != 2 ||
                !PyUnicode_Check(PyTuple_GET_ITEM(input, 0)))
                return 0;
            PyObject *names = PyTuple_GET_ITEM(input, 1);
            if (names == Py_None)
                continue;
            if (!PyTuple_Check(names))
                return 0;
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(names); j++)
                if (!PyBytes_Check(PyTuple_GET_ITEM(names, j)))
                    return 0;
        }
    }
    return 1;
}

/* start(thread_id, expected, parent, state, policy_name, stop) -> bool: the chain the
 * next line continues, as the reference holds it; stop: a version the lane leaves to
 * the reference (a checkpoint's), or -1. False (and no chain) when the lane cannot
 * replay on the state (a member name it does not order). */
static PyObject *
Lane_start(Lane *self, PyObject *args)
{
    PyObject *thread_id, *policy_name;
    long long expected, stop;
    const char *parent, *state;
    Py_ssize_t parent_len, state_len;
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Lane is not initialised");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!Ls#y#OL", &PyBytes_Type, &thread_id, &expected, &parent,
                          &parent_len, &state, &state_len, &policy_name, &stop))
        return NULL;
    /* the parent is 64 lower-case hex digits, as every digest the lane computes: a row's
     * parent_digest equal to it is one too, with no check of its own */
    if (!is_hex64((const unsigned char *)parent, parent_len) ||
        (policy_name != Py_None && !PyUnicode_Check(policy_name))) {
        PyErr_SetString(PyExc_ValueError,
                        "a parent of 64 lower-case hex digits and a policy name or None");
        return NULL;
    }
    lane_clear_thread(self);
    self->state.len = 0;
    if (!buf_put(&self->state, (const unsigned char *)state, state_len))
        return PyErr_NoMemory();
    int oom = 0;
    if (!scan_members(self->state.p, self->state.len, &self->old, &oom)) {
        if (oom)
            return PyErr_NoMemory();
        Py_RETURN_FALSE; /* a state the lane cannot replay on: the reference's */
    }
    self->earlier.len = 0;
    self->thread_id = Py_NewRef(thread_id);
    self->policy_name = policy_name == Py_None ? NULL : Py_NewRef(policy_name);
    self->expected = expected;
    self->stop = stop;
    memcpy(self->parent, parent, 64);
    self->records = 0;
    self->active = 1;
    Py_RETURN_TRUE;
}

static int
role_asked(Lane *self, int genesis, const unsigned char *node, Py_ssize_t len);

/* Whether the node id has the role its record's kind needs (a genesis's: genesis). */
static int
role_allowed(Lane *self, int genesis, const unsigned char *node, Py_ssize_t len)
{
    for (int i = 0; i < self->nodes_known; i++)
        if (self->nodes[i].genesis == genesis && self->nodes[i].len == len &&
            memcmp(self->nodes[i].node, node, len) == 0)
            return self->nodes[i].allowed;
    int allowed = role_asked(self, genesis, node, len);
    if (allowed >= 0 && len <= NODE_MAX) {
        int at = self->nodes_next;
        self->nodes_next = (at + 1) % NODES;
        if (self->nodes_known < NODES)
            self->nodes_known++;
        memcpy(self->nodes[at].node, node, len);
        self->nodes[at].len = len;
        self->nodes[at].genesis = genesis;
        self->nodes[at].allowed = allowed;
    }
    return allowed;
}

/* Whether a node id has the role a record of the kind needs, as the reference says
 * (remembered by kind and node id). */
static int
role_asked(Lane *self, int genesis, const unsigned char *node, Py_ssize_t len)
{
    PyObject *node_id = PyUnicode_DecodeUTF8((const char *)node, len, "strict");
    if (node_id == NULL)
        return -1;
    PyObject *kind = PyUnicode_FromString(genesis ? "genesis" : "transition");
    PyObject *key = kind == NULL ? NULL : PyTuple_Pack(2, kind, node_id);
    Py_XDECREF(kind);
    Py_DECREF(node_id);
    if (key == NULL)
        return -1;
    PyObject *known = PyDict_GetItemWithError(self->roles, key);
    if (known == NULL) {
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            return -1;
        }
        known = PyObject_Call(self->role_ok, key, NULL);
        if (known != NULL && PyDict_Size(self->roles) >= MEMO_SIZE)
            PyDict_Clear(self->roles); /* bounded, as the risk memo */
        if (known == NULL || PyDict_SetItem(self->roles, key, known) < 0) {
            Py_XDECREF(known);
            Py_DECREF(key);
            return -1;
        }
        Py_DECREF(known); /* the dict holds it */
    }
    Py_DECREF(key);
    return PyObject_IsTrue(known);
}

static int
risk_piece(Buf *key, unsigned char tag, const unsigned char *data, Py_ssize_t len)
{
    unsigned char head[9];
    head[0] = tag;
    for (int i = 0; i < 8; i++)
        head[1 + i] = (unsigned char)(((unsigned long long)len >> (8 * i)) & 0xFF);
    return buf_put(key, head, 9) && buf_put(key, data, len);
}

/* What the policy's risk rules see of the change, as bytes: the same inputs give
 * the same bytes and no two differ in what they see (each piece tagged and sized). */
static int
risk_key(Lane *self, PyObject *inputs, PyObject *digest, const unsigned char *node,
         Py_ssize_t node_len, const unsigned char *patch, Py_ssize_t patch_len)
{
    Buf *key = &self->riskkey;
    key->len = 0;
    Py_ssize_t digest_len;
    const char *d = PyUnicode_AsUTF8AndSize(digest, &digest_len);
    if (d == NULL || !risk_piece(key, 'p', (const unsigned char *)d, digest_len))
        return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(inputs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *input = PyTuple_GET_ITEM(inputs, i);
        const char *var = PyUnicode_AsUTF8(PyTuple_GET_ITEM(input, 0));
        PyObject *names = PyTuple_GET_ITEM(input, 1);
        if (var == NULL)
            return 0;
        const unsigned char *value;
        Py_ssize_t value_len;
        const Members *ms;
        if (strcmp(var, "node") == 0) {
            if (!risk_piece(key, 'n', node, node_len))
                return 0;
            continue;
        }
        if (strcmp(var, "state") == 0) {
            value = self->next.p, value_len = self->next.len, ms = &self->members;
        }
        else if (strcmp(var, "old") == 0) {
            value = self->state.p, value_len = self->state.len, ms = &self->old;
        }
        else if (strcmp(var, "patch") == 0) {
            value = patch, value_len = patch_len, ms = &self->patch;
        }
        else {
            PyErr_SetString(PyExc_ValueError, "a risk input other than state, old, patch, node");
            return 0;
        }
        if (names == Py_None) {
            if (!risk_piece(key, 'w', value, value_len))
                return 0;
            continue;
        }
        Py_ssize_t count = PyTuple_GET_SIZE(names);
        for (Py_ssize_t j = 0; j < count; j++) {
            PyObject *name = PyTuple_GET_ITEM(names, j);
            const unsigned char *want = (const unsigned char *)PyBytes_AS_STRING(name);
            Py_ssize_t want_len = PyBytes_GET_SIZE(name);
            const Member *found = NULL;
            for (Py_ssize_t k = 0; k < ms->n; k++)
                if (ms->m[k].key_len == want_len &&
                    memcmp(value + ms->m[k].key, want, want_len) == 0) {
                    found = &ms->m[k];
                    break;
                }
            if (found == NULL) {
                if (!risk_piece(key, 'a', want, want_len))
                    return 0;
            }
            else if (!risk_piece(key, 'k', want, want_len) ||
                     !risk_piece(key, 'v', value + found->value, found->value_len))
                return 0;
        }
    }
    return 1;
}

static int risk_memo(Lane *self, PyObject *digest, const unsigned char *node,
                     Py_ssize_t node_len, const unsigned char *patch, Py_ssize_t patch_len);

/* 1: no risk rule matches; 0: one may (the reference decides); -1: an error. */
static int
no_risk(Lane *self, PyObject *policy, PyObject *digest, const unsigned char *node,
        Py_ssize_t node_len, const unsigned char *patch, Py_ssize_t patch_len)
{
    if (!PyObject_IsTrue(PyTuple_GET_ITEM(policy, 1)))
        return 1; /* the policy has no risk rules */
    if (!risk_key(self, PyTuple_GET_ITEM(policy, 2), digest, node, node_len, patch, patch_len))
        return PyErr_Occurred() ? -1 : (PyErr_NoMemory(), -1);
    if (self->risk_known && self->risk_seen.len == self->riskkey.len &&
        memcmp(self->risk_seen.p, self->riskkey.p, self->riskkey.len) == 0)
        return self->risk_none; /* the input of the row before */
    int none = risk_memo(self, digest, node, node_len, patch, patch_len);
    if (none >= 0) {
        self->risk_seen.len = 0;
        if (!buf_put(&self->risk_seen, self->riskkey.p, self->riskkey.len))
            return PyErr_NoMemory(), -1;
        self->risk_known = 1;
        self->risk_none = none;
    }
    return none;
}

/* no_risk's answer from the memo, or from the reference (then remembered). */
static int
risk_memo(Lane *self, PyObject *digest, const unsigned char *node, Py_ssize_t node_len,
          const unsigned char *patch, Py_ssize_t patch_len)
{
    PyObject *key = PyBytes_FromStringAndSize((const char *)self->riskkey.p, self->riskkey.len);
    if (key == NULL)
        return -1;
    PyObject *known = PyDict_GetItemWithError(self->memo, key);
    if (known != NULL) {
        Py_DECREF(key);
        return PyObject_IsTrue(known);
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    PyObject *old = PyBytes_FromStringAndSize((const char *)self->state.p, self->state.len);
    PyObject *state = PyBytes_FromStringAndSize((const char *)self->next.p, self->next.len);
    PyObject *patch_bytes = PyBytes_FromStringAndSize((const char *)patch, patch_len);
    PyObject *node_id = PyUnicode_DecodeUTF8((const char *)node, node_len, "strict");
    PyObject *answer = NULL;
    if (old && state && patch_bytes && node_id)
        answer = PyObject_CallFunctionObjArgs(self->derive, digest, old, state, patch_bytes,
                                              node_id, NULL);
    Py_XDECREF(old);
    Py_XDECREF(state);
    Py_XDECREF(patch_bytes);
    Py_XDECREF(node_id);
    if (answer == NULL) {
        Py_DECREF(key);
        return -1;
    }
    if (PyDict_Size(self->memo) >= MEMO_SIZE)
        PyDict_Clear(self->memo);
    int stored = PyDict_SetItem(self->memo, key, answer);
    Py_DECREF(key);
    int none = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return stored < 0 ? -1 : none;
}

/* The previous state (self->state, its members in self->old) with the patch applied,
 * in canonical bytes, into self->next; the new state's members into self->members.
 * 1, 0 (declined) or -1. */
static int
replay(Lane *self, const unsigned char *patch, Py_ssize_t patch_len)
{
    int oom = 0;
    if (!scan_members(patch, patch_len, &self->patch, &oom))
        return oom ? (PyErr_NoMemory(), -1) : 0;
    Buf *out = &self->next;
    out->len = 0;
    self->members.n = 0;
    const unsigned char *ob = self->state.p;
    Py_ssize_t i = 0, j = 0;
    int first = 1;
    if (!buf_put(out, (const unsigned char *)"{", 1))
        return PyErr_NoMemory(), -1;
    while (i < self->old.n || j < self->patch.n) {
        const unsigned char *base;
        const Member *m;
        int take_patch;
        if (j >= self->patch.n)
            take_patch = 0;
        else if (i >= self->old.n)
            take_patch = 1;
        else {
            const Member *a = &self->old.m[i], *b = &self->patch.m[j];
            int order = name_order(ob + a->key, a->key_len, patch + b->key, b->key_len);
            if (order == 0)
                i++; /* the patch's member replaces (or removes) the old one */
            take_patch = order >= 0;
        }
        if (take_patch) {
            base = patch;
            m = &self->patch.m[j++];
            if (m->value_len == 4 && memcmp(base + m->value, "null", 4) == 0)
                continue; /* a null removes its key */
        }
        else {
            base = ob;
            m = &self->old.m[i++];
        }
        Py_ssize_t at = out->len + (first ? 0 : 1);
        if ((!first && !buf_put(out, (const unsigned char *)",", 1)) ||
            !buf_put(out, (const unsigned char *)"\"", 1) ||
            !buf_put(out, base + m->key, m->key_len) ||
            !buf_put(out, (const unsigned char *)"\":", 2) ||
            !buf_put(out, base + m->value, m->value_len))
            return PyErr_NoMemory(), -1;
        Member placed = {at + 1, m->key_len, at + 1 + m->key_len + 2, m->value_len};
        if (!members_add(&self->members, placed))
            return PyErr_NoMemory(), -1;
        first = 0;
    }
    if (!buf_put(out, (const unsigned char *)"}", 1))
        return PyErr_NoMemory(), -1;
    return 1;
}

typedef struct {
    Span thread, digest, parent, node, key_id, signature;
    Span committed; /* p NULL: the column is null */
    long long version;
    const unsigned char *record, *body; /* body NULL: no kept state */
    Py_ssize_t record_len, body_len;
} Row;

/* The checks of one row, whatever it was read from: 1 taken (the chain advanced), 0
 * declined (nothing changed), -1 an error. */
static int
lane_row(Lane *self, const Row *row)
{
    int oom = 0, failed = 0;
    PyObject *result = Py_False;
    Span thread = row->thread, digest = row->digest, parent = row->parent, node = row->node,
         key_id = row->key_id, signature = row->signature, committed = row->committed;
    long long version = row->version;
    int has_state = row->body != NULL;

    /* the row's place in the chain */
    if (!same(thread, (const unsigned char *)PyBytes_AS_STRING(self->thread_id),
              PyBytes_GET_SIZE(self->thread_id)) ||
        version != self->expected || version == self->stop)
        goto done;

    /* the record: canonical, and a plain transition */
    const unsigned char *rec = row->record;
    Py_ssize_t rec_len = row->record_len;
    if (!scan_members(rec, rec_len, &self->members, &oom))
        goto done;
    static const char *format1[] = {"committed_at", "format", "key_id", "kind", "node_id",
                                    "parent_digest", "patch", "policy_digest",
                                    "receipt_digest", "state_digest", "thread_id",
                                    "version", NULL};
    static const char *format2[] = {"committed_at", "format", "key_id", "kind", "node_id",
                                    "parent_digest", "patch", "policy_digest",
                                    "receipt_digest", "risk_rules", "state_digest",
                                    "thread_id", "version", NULL};
    Members *ms = &self->members;
    const char **names = ms->n == 12 ? format1 : ms->n == 13 ? format2 : NULL;
    if (names == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < ms->n; i++) {
        Span name = {rec + ms->m[i].key, ms->m[i].key_len};
        if (!same(name, (const unsigned char *)names[i], (Py_ssize_t)strlen(names[i])))
            goto done;
    }
#define VALUE(i) (rec + ms->m[i].value)
#define VALUE_LEN(i) (ms->m[i].value_len)
/* a string member's content, when it holds no escape */
#define STRING(i, span)                                                              \
    do {                                                                             \
        if (VALUE_LEN(i) < 2 || VALUE(i)[0] != '"' ||                                \
            memchr(VALUE(i), '\\', VALUE_LEN(i)) != NULL)                            \
            goto done;                                                               \
        (span).p = VALUE(i) + 1;                                                     \
        (span).len = VALUE_LEN(i) - 2;                                               \
    } while (0)
    int v2 = ms->n == 13, at = 0;
    Span r_committed, r_key_id, r_kind, r_node, r_parent, r_policy, r_state_digest, r_thread;
    STRING(at, r_committed);
    at++;
    if (!(VALUE_LEN(at) == 1 && VALUE(at)[0] == (v2 ? '2' : '1')))
        goto done;
    at++;
    STRING(at, r_key_id);
    at++;
    STRING(at, r_kind);
    at++;
    STRING(at, r_node);
    at++;
    STRING(at, r_parent);
    at++;
    const unsigned char *patch = VALUE(at);
    Py_ssize_t patch_len = VALUE_LEN(at);
    if (patch[0] != '{')
        goto done;
    at++;
    STRING(at, r_policy);
    at++;
    if (!(VALUE_LEN(at) == 4 && memcmp(VALUE(at), "null", 4) == 0))
        goto done; /* a receipt: the reference's */
    at++;
    if (v2) {
        if (!(VALUE_LEN(at) == 2 && memcmp(VALUE(at), "[]", 2) == 0))
            goto done; /* carried risk rules: the reference's */
        at++;
    }
    STRING(at, r_state_digest);
    at++;
    STRING(at, r_thread);
    at++;
    long long r_version;
    const unsigned char *vp = VALUE(at);
    if (!line_version(&vp, vp + VALUE_LEN(at), &r_version) || vp != VALUE(at) + VALUE_LEN(at))
        goto done;
#undef STRING
#undef VALUE
#undef VALUE_LEN
    /* a genesis at version 0 (its parent the 64 zeros the chain starts from), a
     * transition after it */
    int genesis = version == 0;
    if (!(genesis ? same(r_kind, (const unsigned char *)"genesis", 7)
                  : same(r_kind, (const unsigned char *)"transition", 10)) ||
        r_version != version ||
        !same(r_thread, thread.p, thread.len) || r_parent.len != 64 ||
        !is_time(r_committed.p, r_committed.len))
        goto done;
    /* the columns the line copies, and the chain (the record's parent_digest equal to
     * the chain's, and its state_digest below to the replay's, each is 64 lower-case
     * hex digits with no check of its own) */
    if (!same(parent, r_parent.p, r_parent.len) || !same(node, r_node.p, r_node.len) ||
        !same(key_id, r_key_id.p, r_key_id.len) ||
        (committed.p != NULL && !same(committed, r_committed.p, r_committed.len)) ||
        memcmp(r_parent.p, self->parent, 64) != 0)
        goto done;

    /* digest and signature */
    char hex[64];
    unsigned char raw[32];
    if (!sha256_hex(rec, rec_len, hex, raw)) {
        failed = 1;
        goto done;
    }
    if (!same(digest, (const unsigned char *)hex, 64))
        goto done;
    if (self->keyring) {
        Key *key = NULL;
        for (Py_ssize_t i = 0; i < self->nkeys; i++)
            if (same(key_id, (const unsigned char *)PyBytes_AS_STRING(self->keys[i].id),
                     PyBytes_GET_SIZE(self->keys[i].id))) {
                key = &self->keys[i];
                break;
            }
        if (key == NULL)
            goto done;
        unsigned char mac[32];
        char mac_hex[64];
        if (!hmac_sha256(key, raw, mac)) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL HMAC failed");
            failed = 1;
            goto done;
        }
        to_hex(mac, 32, mac_hex);
        if (!same(signature, (const unsigned char *)mac_hex, 64))
            goto done;
    }

    /* the role and the policy */
    int role = role_allowed(self, genesis, r_node.p, r_node.len);
    if (role < 0) {
        failed = 1;
        goto done;
    }
    if (!role)
        goto done;
    PyObject *policy_digest, *policy;
    Py_ssize_t cached_len = 0;
    const char *cached = self->policy_digest == NULL
                             ? NULL
                             : PyUnicode_AsUTF8AndSize(self->policy_digest, &cached_len);
    if (cached != NULL && same(r_policy, (const unsigned char *)cached, cached_len)) {
        policy_digest = Py_NewRef(self->policy_digest);
        policy = self->policy;
    }
    else {
        policy_digest = PyUnicode_DecodeUTF8((const char *)r_policy.p, r_policy.len, "strict");
        if (policy_digest == NULL) {
            failed = 1;
            goto done;
        }
        policy = PyDict_GetItemWithError(self->policies, policy_digest);
        if (policy == NULL || !PyTuple_Check(policy) || PyTuple_GET_SIZE(policy) != 3) {
            failed = PyErr_Occurred() != NULL;
            Py_DECREF(policy_digest);
            goto done;
        }
        Py_XSETREF(self->policy_digest, Py_NewRef(policy_digest));
        Py_XSETREF(self->policy, Py_NewRef(policy));
    }
    PyObject *name = PyTuple_GET_ITEM(policy, 0);
    if (self->policy_name != NULL && !genesis) { /* a genesis binds the thread */
        int equal = PyUnicode_Compare(self->policy_name, name);
        if (equal != 0) {
            failed = PyErr_Occurred() != NULL;
            Py_DECREF(policy_digest);
            goto done;
        }
    }

    /* the replay, and the kept state body */
    int replayed = replay(self, patch, patch_len);
    if (replayed <= 0) {
        failed = replayed < 0;
        Py_DECREF(policy_digest);
        goto done;
    }
    char state_hex[64];
    unsigned char state_raw[32];
    if (!sha256_hex(self->next.p, self->next.len, state_hex, state_raw)) {
        failed = 1;
        Py_DECREF(policy_digest);
        goto done;
    }
    if (!same(r_state_digest, (const unsigned char *)state_hex, 64) ||
        (has_state &&
         (row->body_len != self->next.len ||
          memcmp(row->body, self->next.p, self->next.len) != 0))) {
        Py_DECREF(policy_digest);
        goto done;
    }

    /* the risk rules: none may match a transition without a receipt */
    int none =
        genesis ? 1 : no_risk(self, policy, policy_digest, r_node.p, r_node.len, patch, patch_len);
    Py_DECREF(policy_digest);
    if (none <= 0) {
        failed = none < 0;
        goto done;
    }

    /* taken: the chain advances as the reference's would */
    if (!buf_put(&self->earlier, (const unsigned char *)state_hex, 64)) {
        oom = 1;
        goto done;
    }
    if (self->policy_name == NULL || genesis)
        Py_XSETREF(self->policy_name, Py_NewRef(name));
    Buf swap = self->state;
    self->state = self->next;
    self->next = swap;
    Members swap_members = self->old;
    self->old = self->members;
    self->members = swap_members;
    memcpy(self->parent, hex, 64);
    self->expected = version + 1;
    self->records++;
    self->last_version = version;
    memcpy(self->last_digest, hex, 64);
    memcpy(self->last_state_digest, state_hex, 64);
    self->last_kept = has_state;
    result = Py_True;

done:
    if (failed || oom) {
        if (oom && !PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    return result == Py_True;
}

/* One line of records.jsonl from p on, in the exporter's layout, parsed into row up
 * to its closing brace (*after: just past it; what follows is the caller's to
 * check). A line that is not in that layout: 0 (a JSON string holds no raw control
 * character, so a line parsed never runs on past its newline). */
static int
line_row(Lane *self, const unsigned char *p, const unsigned char *end, Row *row,
         const unsigned char **after, int *oom)
{
    Span optional;
    if (!(literal(&p, end, "{\"thread_id\":") && line_plain(&p, end, &row->thread) &&
          literal(&p, end, ",\"version\":") && line_version(&p, end, &row->version) &&
          literal(&p, end, ",\"digest\":") && line_plain(&p, end, &row->digest) &&
          literal(&p, end, ",\"parent_digest\":") && line_plain(&p, end, &row->parent) &&
          literal(&p, end, ",\"node_id\":") && line_plain(&p, end, &row->node) &&
          literal(&p, end, ",\"key_id\":") && line_plain(&p, end, &row->key_id) &&
          literal(&p, end, ",\"signature\":") && line_plain(&p, end, &row->signature) &&
          literal(&p, end, ",\"record\":") && line_decoded(&p, end, &self->record, oom) &&
          literal(&p, end, ",\"state\":")))
        return 0;
    if (!literal(&p, end, "null")) {
        if (!line_decoded(&p, end, &self->body, oom))
            return 0;
        row->body = self->body.p;
        row->body_len = self->body.len;
    }
    if (!literal(&p, end, ",\"receipt\":null,\"receipt_signature\":"))
        return 0;
    if (!literal(&p, end, "null") && !line_plain(&p, end, &optional))
        return 0;
    if (!literal(&p, end, ",\"receipt_key_id\":"))
        return 0;
    if (!literal(&p, end, "null") && !line_plain(&p, end, &optional))
        return 0;
    if (!literal(&p, end, ",\"committed_at\":"))
        return 0;
    if (!literal(&p, end, "null") && !line_plain(&p, end, &row->committed))
        return 0;
    if (!literal(&p, end, "}"))
        return 0;
    row->record = self->record.p;
    row->record_len = self->record.len;
    *after = p;
    return 1;
}

/* One line of records.jsonl (its newline, if any, at its end): the exporter's layout,
 * then the row's checks. 1 taken, 0 declined, -1 an error. */
static int
lane_line(Lane *self, const unsigned char *p, const unsigned char *end)
{
    int oom = 0, taken = 0;
    Row row = {0};
    const unsigned char *after = NULL;
    if (end > p && end[-1] == '\n')
        end--;
    if (line_row(self, p, end, &row, &after, &oom) && after == end)
        taken = lane_row(self, &row);
    if (oom) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    return taken;
}

/* add(line) -> bool: True when the line was a plain transition of the thread at the
 * next version that the lane confirmed and took (the chain advanced), False when it
 * left the line to the reference (nothing changed). */
static PyObject *
Lane_add(Lane *self, PyObject *arg)
{
    Py_buffer view;
    if (!self->active) {
        PyErr_SetString(PyExc_RuntimeError, "no chain started");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = view.buf;
    int taken = lane_line(self, p, p + view.len);
    PyBuffer_Release(&view);
    if (taken < 0)
        return NULL;
    return PyBool_FromLong(taken);
}

/* feed(block, pos) -> (pos, taken, last): add() for each whole line of block from
 * offset pos on (each ended by a newline in block), while the lane takes them. pos:
 * where it stopped (the line it declined, or one block does not end); taken: how
 * many lines it took; last: where the last of them begins (-1: none). */
static PyObject *
Lane_feed(Lane *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos, taken = 0, last = -1;
    if (!self->active) {
        PyErr_SetString(PyExc_RuntimeError, "no chain started");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*n", &view, &pos))
        return NULL;
    const unsigned char *data = view.buf;
    if (pos < 0 || pos > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "pos outside the block");
        return NULL;
    }
    const unsigned char *block_end = data + view.len;
    while (pos < view.len) {
        /* parsed first, its newline checked after (no search for it): a line that
         * does not parse, or does not end in the block, is where the lane stops */
        Row row = {0};
        const unsigned char *after = NULL;
        int oom = 0, took = 0;
        if (line_row(self, data + pos, block_end, &row, &after, &oom) && after < block_end &&
            *after == '\n')
            took = lane_row(self, &row);
        if (oom || took < 0) {
            if (oom && !PyErr_Occurred())
                PyErr_NoMemory();
            PyBuffer_Release(&view);
            return NULL;
        }
        if (!took)
            break;
        last = pos;
        pos = after - data + 1;
        taken++;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(nnn)", pos, taken, last);
}

/* A text column as UTF-8 (anything else, or text with a lone surrogate: 0, the
 * reference's). */
static int
column_text(PyObject *value, Span *out)
{
    if (!PyUnicode_Check(value))
        return 0;
    Py_ssize_t len;
    const char *text = PyUnicode_AsUTF8AndSize(value, &len);
    if (text == NULL) {
        PyErr_Clear();
        return 0;
    }
    out->p = (const unsigned char *)text;
    out->len = len;
    return 1;
}

/* A bytea column (bytes), or None when it may be null (then *p is NULL). */
static int
column_bytes(PyObject *value, const unsigned char **p, Py_ssize_t *len, int nullable)
{
    if (value == Py_None && nullable) {
        *p = NULL;
        *len = 0;
        return 1;
    }
    if (!PyBytes_Check(value))
        return 0;
    *p = (const unsigned char *)PyBytes_AS_STRING(value);
    *len = PyBytes_GET_SIZE(value);
    return 1;
}

/* Two digits of a time, as format_time writes them. */
static void
two(char *out, int value)
{
    out[0] = (char)('0' + value / 10);
    out[1] = (char)('0' + value % 10);
}

/* The checks of a database row, a sequence of the first columns of checks.ROWS in its
 * order (thread_id, version, digest, parent_digest, node_id, key_id, signature,
 * record, state, receipt, receipt_signature, receipt_key_id, committed_at: an aware
 * datetime in UTC, compared as format_time writes it). 1 taken, 0 declined, -1 an
 * error. */
static int
lane_db_row(Lane *self, PyObject *arg)
{
    PyObject *columns[13];
    int got = 0, taken = 0;
    Row row = {0};
    char time[27];
    for (; got < 13; got++) {
        columns[got] = PySequence_GetItem(arg, got);
        if (columns[got] == NULL) {
            taken = -1;
            goto done;
        }
    }
    PyObject *when = columns[12];
    if (!(column_text(columns[0], &row.thread) && PyLong_CheckExact(columns[1]) &&
          column_text(columns[2], &row.digest) && column_text(columns[3], &row.parent) &&
          column_text(columns[4], &row.node) && column_text(columns[5], &row.key_id) &&
          column_text(columns[6], &row.signature) &&
          column_bytes(columns[7], &row.record, &row.record_len, 0) &&
          column_bytes(columns[8], &row.body, &row.body_len, 1) && columns[9] == Py_None))
        goto done;
    int overflow = 0;
    row.version = PyLong_AsLongLongAndOverflow(columns[1], &overflow);
    if (overflow || (row.version == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        goto done;
    }
    {
        /* format_time's form; a year below 1000 (strftime's), and a null column (a
         * database's committed_at is never null), the reference's */
        if (!PyDateTime_Check(when) ||
            PyDateTime_DATE_GET_TZINFO(when) != PyDateTime_TimeZone_UTC ||
            PyDateTime_GET_YEAR(when) < 1000)
            goto done;
        int year = PyDateTime_GET_YEAR(when), micro = PyDateTime_DATE_GET_MICROSECOND(when);
        two(time, year / 100);
        two(time + 2, year % 100);
        time[4] = '-';
        two(time + 5, PyDateTime_GET_MONTH(when));
        time[7] = '-';
        two(time + 8, PyDateTime_GET_DAY(when));
        time[10] = 'T';
        two(time + 11, PyDateTime_DATE_GET_HOUR(when));
        time[13] = ':';
        two(time + 14, PyDateTime_DATE_GET_MINUTE(when));
        time[16] = ':';
        two(time + 17, PyDateTime_DATE_GET_SECOND(when));
        time[19] = '.';
        two(time + 20, micro / 10000);
        two(time + 22, micro / 100 % 100);
        two(time + 24, micro % 100);
        time[26] = 'Z';
        row.committed.p = (const unsigned char *)time;
        row.committed.len = 27;
    }
    taken = lane_row(self, &row);

done:
    for (int i = 0; i < got; i++)
        Py_DECREF(columns[i]);
    return taken;
}

/* add_rows(rows, start) -> (next, taken, head): lane_db_row() for rows[start],
 * rows[start + 1], ... (a list) while the lane takes them. next: the first row it did
 * not take (or len(rows)); taken: how many it took; head: the index of the last row
 * taken whose head_version (its 14th column) is not null, or -1. */
static PyObject *
Lane_add_rows(Lane *self, PyObject *args)
{
    PyObject *rows;
    Py_ssize_t at, taken = 0, head = -1;
    if (!self->active) {
        PyErr_SetString(PyExc_RuntimeError, "no chain started");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &rows, &at))
        return NULL;
    if (at < 0) {
        PyErr_SetString(PyExc_ValueError, "start must not be negative");
        return NULL;
    }
    for (; at < PyList_GET_SIZE(rows); at++) {
        PyObject *row = Py_NewRef(PyList_GET_ITEM(rows, at));
        int took = lane_db_row(self, row);
        PyObject *head_version = took > 0 ? PySequence_GetItem(row, 13) : NULL;
        Py_DECREF(row);
        if (took < 0 || (took > 0 && head_version == NULL))
            return NULL;
        if (!took)
            break;
        if (head_version != Py_None)
            head = at;
        Py_DECREF(head_version);
        taken++;
    }
    return Py_BuildValue("(nnn)", at, taken, head);
}

/* take() -> (records, expected, parent, state, policy_name, earlier, last): what the
 * lane took since start, for the reference to carry on from; earlier is the state
 * digests taken, 64 hex digits each, one after the other in one str; last is
 * (version, digest, state_digest, kept) or None. The lane holds no chain after it. */
static PyObject *
Lane_take(Lane *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->active) {
        PyErr_SetString(PyExc_RuntimeError, "no chain started");
        return NULL;
    }
    PyObject *last;
    if (self->records > 0)
        last = Py_BuildValue("(Ls#s#O)", self->last_version, self->last_digest,
                             (Py_ssize_t)64, self->last_state_digest, (Py_ssize_t)64,
                             self->last_kept ? Py_True : Py_False);
    else
        last = Py_NewRef(Py_None);
    if (last == NULL)
        return NULL;
    /* the digests as one string: the reference reads them only at a revert */
    PyObject *earlier =
        PyUnicode_FromStringAndSize((const char *)self->earlier.p, self->earlier.len);
    if (earlier == NULL) {
        Py_DECREF(last);
        return NULL;
    }
    PyObject *out = Py_BuildValue(
        "(LLs#y#ONN)", self->records, self->expected, (const char *)self->parent,
        (Py_ssize_t)64, (const char *)self->state.p, self->state.len,
        self->policy_name ? self->policy_name : Py_None, earlier, last);
    if (out != NULL)
        lane_clear_thread(self);
    return out;
}

static PyMethodDef Lane_methods[] = {
    {"start", (PyCFunction)Lane_start, METH_VARARGS, NULL},
    {"add", (PyCFunction)Lane_add, METH_O, NULL},
    {"feed", (PyCFunction)Lane_feed, METH_VARARGS, NULL},
    {"add_rows", (PyCFunction)Lane_add_rows, METH_VARARGS, NULL},
    {"take", (PyCFunction)Lane_take, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ztate.services.verify._chain.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lane_init,
    .tp_dealloc = (destructor)Lane_dealloc,
    .tp_methods = Lane_methods,
};

/* canonical(data) -> bool: whether the lane's scanner takes data as a canonical
 * object (for the tests that hold it to the reference). */
static PyObject *
canonical(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    Members ms = {NULL, 0, 0};
    int oom = 0;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int ok = scan_members(view.buf, view.len, &ms, &oom);
    PyBuffer_Release(&view);
    PyMem_Free(ms.m);
    if (oom)
        return PyErr_NoMemory();
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"canonical", canonical, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chain", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    init_string_bytes();
    init_hex();
#ifdef PACKED_RUNS
    init_pack();
#endif
    PyDateTime_IMPORT;
    if (PyDateTimeAPI == NULL)
        return NULL;
    if (PyType_Ready(&LaneType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
