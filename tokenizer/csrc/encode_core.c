/* tokenizer._encode_core: the hot loops of byte-level BPE encoding, in C.
 *
 * Mirrors, one to one, the pure-Python reference (which stays the readable version):
 *   - pre-tokenization: tokenizer/pretokenize.py PATTERNS["gpt2"] and ["gpt4"] run by `regex`
 *     (split_gpt2 / split_gpt4 below follow each alternative of the pattern in order);
 *   - BPE per chunk: tokenizer/bpe.py BPETokenizer._encode_chunk (list scan for short chunks)
 *     and _merge_heap (lazy heap over a linked list for long ones), lowest rank then leftmost;
 *   - the chunk cache: tokenizer/bpe.py _ChunkCache (cleared when it holds CACHE_MAX entries);
 *   - chunk counting for training: tokenizer/pretokenize.py count_chunks_in_text.
 *
 * Character classes (\p{L}, \p{N}, \s and the case-insensitive contraction letters) are not
 * compiled in: tokenizer/c_core.py builds a table of all code points with the installed
 * `regex` module and hands it to set_tables(), so this file agrees with whatever Unicode
 * version `regex` has. Work runs with the GIL released; each Encoder / ChunkCounter is used by
 * one thread at a time (a second concurrent call raises RuntimeError instead of racing).
 * Strings holding surrogates are not handled here: the calls return None and the Python side
 * replaces lone surrogates with U+FFFD (tiktoken's behaviour) and calls again.
 *
 * Plain CPython C API, C99; no numpy, no other dependency.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- character classes ------------------------------------------------------------------ */

enum {
    C_L = 1,     /* \p{L} */
    C_N = 2,     /* \p{N} */
    C_S = 4,     /* \s */
    F_SDMT = 8,  /* (?i:[sdmt]) */
    F_L = 16,    /* (?i:l) */
    F_V = 32,    /* (?i:v) */
    F_E = 64,    /* (?i:e) */
    F_R = 128,   /* (?i:r) */
};
enum { CAT_L = 1, CAT_N = 2, CAT_S = 4, CAT_O = 0 }; /* \p{L}, \p{N}, \s are disjoint */

#define N_CODEPOINTS 0x110000
static uint8_t *g_table = NULL;

enum { PAT_GPT2 = 0, PAT_GPT4 = 1 };

typedef struct {
    int kind;
    int ascii; /* then data is its own UTF-8 */
    const void *data;
    Py_ssize_t n;
} Text;

static inline Py_UCS4 cp_at(const Text *t, Py_ssize_t i) {
    switch (t->kind) {
    case PyUnicode_1BYTE_KIND: return ((const Py_UCS1 *)t->data)[i];
    case PyUnicode_2BYTE_KIND: return ((const Py_UCS2 *)t->data)[i];
    default: return ((const Py_UCS4 *)t->data)[i];
    }
}

static inline int cat_at(const Text *t, Py_ssize_t i) {
    return g_table[cp_at(t, i)] & (C_L | C_N | C_S);
}

static inline Py_ssize_t run_of(const Text *t, Py_ssize_t i, int cat) {
    while (i < t->n && cat_at(t, i) == cat) i++;
    return i;
}

static inline int is_crlf(Py_UCS4 c) { return c == '\r' || c == '\n'; }

/* End of the chunk that starts at i (< n), as regex's leftmost alternative would match. */

/* '(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static Py_ssize_t chunk_end_gpt2(const Text *t, Py_ssize_t i) {
    Py_ssize_t n = t->n;
    Py_UCS4 c = cp_at(t, i);
    if (c == '\'' && i + 1 < n) {
        Py_UCS4 a = cp_at(t, i + 1);
        if (a == 's' || a == 'd' || a == 'm' || a == 't') return i + 2;
        if (i + 2 < n) {
            Py_UCS4 b = cp_at(t, i + 2);
            if ((a == 'l' && b == 'l') || (a == 'v' && b == 'e') || (a == 'r' && b == 'e'))
                return i + 3;
        }
    }
    int cat = cat_at(t, i);
    if (c == ' ' && i + 1 < n) {
        int next = cat_at(t, i + 1);
        if (next != CAT_S) return run_of(t, i + 1, next); /* " ?" + a letter/number/other run */
    }
    if (cat != CAT_S) return run_of(t, i, cat);
    Py_ssize_t j = run_of(t, i, CAT_S);
    if (j == n) return n;            /* \s+(?!\S) at the end of the text */
    if (j - i >= 2) return j - 1;    /* \s+(?!\S): leave the last space to the next chunk */
    return j;                        /* \s+ */
}

/* '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+
 * |\s++$|\s*[\r\n]|\s+(?!\S)|\s */
static Py_ssize_t chunk_end_gpt4(const Text *t, Py_ssize_t i) {
    Py_ssize_t n = t->n;
    Py_UCS4 c = cp_at(t, i);
    if (c == '\'' && i + 1 < n) {
        uint8_t a = g_table[cp_at(t, i + 1)];
        if (a & F_SDMT) return i + 2;
        if (i + 2 < n) {
            uint8_t b = g_table[cp_at(t, i + 2)];
            if ((a & F_L && b & F_L) || (a & F_V && b & F_E) || (a & F_R && b & F_E)) return i + 3;
        }
    }
    int cat = cat_at(t, i);
    if (cat == CAT_L) return run_of(t, i, CAT_L);
    if (cat != CAT_N && !is_crlf(c) && i + 1 < n && cat_at(t, i + 1) == CAT_L)
        return run_of(t, i + 1, CAT_L); /* one possessive prefix character, then letters */
    if (cat == CAT_N) {
        Py_ssize_t j = i;
        while (j < n && j - i < 3 && cat_at(t, j) == CAT_N) j++;
        return j;
    }
    Py_ssize_t s = -1;
    if (c == ' ' && i + 1 < n && cat_at(t, i + 1) == CAT_O) s = i + 1;
    else if (cat == CAT_O) s = i;
    if (s >= 0) {
        Py_ssize_t j = run_of(t, s, CAT_O);
        while (j < n && is_crlf(cp_at(t, j))) j++;
        return j;
    }
    Py_ssize_t j = run_of(t, i, CAT_S); /* c is whitespace */
    if (j == n) return n;               /* \s++$ ($ before a final \n is inside the run) */
    for (Py_ssize_t p = j - 1; p >= i; p--)
        if (is_crlf(cp_at(t, p))) return p + 1; /* \s*[\r\n], greedy: the last line break */
    if (j - i >= 2) return j - 1;               /* \s+(?!\S) */
    return i + 1;                               /* \s */
}

static inline Py_ssize_t chunk_end(int pattern, const Text *t, Py_ssize_t i) {
    return pattern == PAT_GPT4 ? chunk_end_gpt4(t, i) : chunk_end_gpt2(t, i);
}

static int has_surrogates(const Text *t) {
    if (t->kind == PyUnicode_1BYTE_KIND) return 0;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        Py_UCS4 c = cp_at(t, i);
        if (c >= 0xD800 && c <= 0xDFFF) return 1;
    }
    return 0;
}

static int text_of(PyObject *obj, Text *t) {
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "expected str, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(obj) < 0) return -1; /* a no-op (deprecated) from Python 3.12 on */
#endif
    t->kind = PyUnicode_KIND(obj);
    t->ascii = PyUnicode_IS_ASCII(obj);
    t->data = PyUnicode_DATA(obj);
    t->n = PyUnicode_GET_LENGTH(obj);
    return 0;
}

/* ---- growable buffers (no Python calls: used without the GIL) --------------------------- */

typedef struct {
    uint8_t *p;
    size_t len, cap;
} ByteBuf;

static int bytebuf_reserve(ByteBuf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

typedef struct {
    uint32_t *p;
    size_t len, cap;
} IdBuf;

static int idbuf_reserve(IdBuf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < b->len + extra) cap *= 2;
    uint32_t *p = realloc(b->p, cap * sizeof(uint32_t));
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

/* UTF-8 of t[i:j] into buf (reset first); the text holds no surrogates. */
static int utf8_of(const Text *t, Py_ssize_t i, Py_ssize_t j, ByteBuf *buf) {
    buf->len = 0;
    if (bytebuf_reserve(buf, (size_t)(j - i) * 4)) return -1;
    uint8_t *o = buf->p;
    for (Py_ssize_t k = i; k < j; k++) {
        Py_UCS4 c = cp_at(t, k);
        if (c < 0x80) {
            *o++ = (uint8_t)c;
        } else if (c < 0x800) {
            *o++ = (uint8_t)(0xC0 | (c >> 6));
            *o++ = (uint8_t)(0x80 | (c & 0x3F));
        } else if (c < 0x10000) {
            *o++ = (uint8_t)(0xE0 | (c >> 12));
            *o++ = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
            *o++ = (uint8_t)(0x80 | (c & 0x3F));
        } else {
            *o++ = (uint8_t)(0xF0 | (c >> 18));
            *o++ = (uint8_t)(0x80 | ((c >> 12) & 0x3F));
            *o++ = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
            *o++ = (uint8_t)(0x80 | (c & 0x3F));
        }
    }
    buf->len = (size_t)(o - buf->p);
    return 0;
}

static inline uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xC2B2AE3D27D4EB4Full);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    return h;
}

/* ---- byte-string hash map (chunk cache and chunk counter share it) ---------------------- */

/* Entries are dense (one per key, in insertion order); the open-addressing index holds
 * entry number + 1 (0: empty), 4 bytes a slot, so a map of a million chunks stays small. */
typedef struct {
    uint64_t hash;
    size_t key_off; /* into keys */
    uint32_t key_len;
    uint32_t val_len; /* cache: number of ids; counter: unused */
    size_t val;       /* cache: offset into vals; counter: the count */
} Slot;

typedef struct {
    uint32_t *index;
    size_t mask;
    Slot *entries;
    size_t count, cap;
    ByteBuf keys;
    IdBuf vals;
} StrMap;

static int strmap_init(StrMap *m, size_t cap) {
    memset(m, 0, sizeof(*m));
    m->index = calloc(cap, sizeof(uint32_t));
    if (!m->index) return -1;
    m->mask = cap - 1;
    return 0;
}

static void strmap_free(StrMap *m) {
    free(m->index);
    free(m->entries);
    free(m->keys.p);
    free(m->vals.p);
    memset(m, 0, sizeof(*m));
}

static void strmap_clear(StrMap *m) {
    memset(m->index, 0, (m->mask + 1) * sizeof(uint32_t));
    m->count = 0;
    m->keys.len = 0;
    m->vals.len = 0;
}

/* The entry of key, or NULL; *pos is its index slot (or the empty slot where it would go). */
static inline Slot *strmap_find(
    const StrMap *m, const uint8_t *key, size_t len, uint64_t h, size_t *pos) {
    size_t i = (size_t)h & m->mask;
    for (;;) {
        uint32_t e = m->index[i];
        if (e == 0) {
            *pos = i;
            return NULL;
        }
        Slot *s = &m->entries[e - 1];
        if (s->hash == h && s->key_len == len && memcmp(m->keys.p + s->key_off, key, len) == 0) {
            *pos = i;
            return s;
        }
        i = (i + 1) & m->mask;
    }
}

static int strmap_grow_index(StrMap *m) {
    size_t cap = (m->mask + 1) * 2;
    uint32_t *index = calloc(cap, sizeof(uint32_t));
    if (!index) return -1;
    for (size_t e = 0; e < m->count; e++) {
        size_t k = (size_t)m->entries[e].hash & (cap - 1);
        while (index[k]) k = (k + 1) & (cap - 1);
        index[k] = (uint32_t)(e + 1);
    }
    free(m->index);
    m->index = index;
    m->mask = cap - 1;
    return 0;
}

/* Add key at the empty index slot pos (from strmap_find); the caller fills val/val_len.
 * The pointer is valid until the next insert. NULL on allocation failure (map unchanged). */
static Slot *strmap_insert(StrMap *m, size_t pos, const uint8_t *key, size_t len, uint64_t h) {
    if (len > UINT32_MAX || m->count >= UINT32_MAX - 1 || bytebuf_reserve(&m->keys, len))
        return NULL;
    if (m->count == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 1024;
        Slot *entries = realloc(m->entries, cap * sizeof(Slot));
        if (!entries) return NULL;
        m->entries = entries;
        m->cap = cap;
    }
    Slot *s = &m->entries[m->count];
    s->hash = h;
    s->key_off = m->keys.len;
    s->key_len = (uint32_t)len;
    s->val_len = 0;
    s->val = 0;
    memcpy(m->keys.p + m->keys.len, key, len);
    m->keys.len += len;
    m->index[pos] = (uint32_t)(++m->count);
    if (m->count * 2 > m->mask + 1 && strmap_grow_index(m)) {
        m->index[pos] = 0; /* undo: the map stays as it was */
        m->count--;
        m->keys.len -= len;
        return NULL;
    }
    return s;
}

/* ---- merges: (left id, right id) -> (rank, merged id) ----------------------------------- */

typedef struct {
    uint64_t key; /* left << 32 | right; EMPTY_KEY when free */
    uint32_t rank, merged;
} MergeSlot;

#define EMPTY_KEY UINT64_MAX
#define NO_RANK UINT32_MAX

typedef struct {
    MergeSlot *slots;
    size_t mask;
    uint32_t byte_ids[256];
    int pattern;
} Merges;

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    return x;
}

static inline const MergeSlot *merge_of(const Merges *m, uint32_t a, uint32_t b) {
    uint64_t key = (uint64_t)a << 32 | b;
    size_t i = (size_t)mix64(key) & m->mask;
    for (;;) {
        const MergeSlot *s = &m->slots[i];
        if (s->key == key) return s;
        if (s->key == EMPTY_KEY) return NULL;
        i = (i + 1) & m->mask;
    }
}

static inline uint32_t rank_of(const Merges *m, uint32_t a, uint32_t b) {
    const MergeSlot *s = merge_of(m, a, b);
    return s ? s->rank : NO_RANK;
}

/* ---- BPE of one chunk ------------------------------------------------------------------- */

#define HEAP_MIN_BYTES 64 /* as tokenizer/bpe.py: longer chunks use the heap */

typedef struct {
    uint32_t *ids, *ranks, *nxt, *prv;
    uint64_t *heap;
    size_t cap;
} Scratch;

/* Room for a chunk of n bytes: n ids (and ranks / links), and a heap of 3n entries. */
static int scratch_reserve(Scratch *s, size_t n) {
    if (n <= s->cap) return 0;
    size_t cap = s->cap ? s->cap : 256;
    while (cap < n) cap *= 2;
    uint32_t *ids = realloc(s->ids, cap * 4);
    if (ids) s->ids = ids;
    uint32_t *ranks = realloc(s->ranks, cap * 4);
    if (ranks) s->ranks = ranks;
    uint32_t *nxt = realloc(s->nxt, cap * 4);
    if (nxt) s->nxt = nxt;
    uint32_t *prv = realloc(s->prv, cap * 4);
    if (prv) s->prv = prv;
    uint64_t *heap = realloc(s->heap, cap * 3 * 8);
    if (heap) s->heap = heap;
    if (!ids || !ranks || !nxt || !prv || !heap) return -1;
    s->cap = cap;
    return 0;
}

static void scratch_free(Scratch *s) {
    free(s->ids);
    free(s->ranks);
    free(s->nxt);
    free(s->prv);
    free(s->heap);
    memset(s, 0, sizeof(*s));
}

/* Heap of (rank << 32 | position): lowest rank first, then the leftmost position. */
static inline void heap_push(uint64_t *h, size_t *n, uint64_t v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static inline uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0], v = h[--(*n)];
    size_t i = 0, len = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= len) break;
        if (c + 1 < len && h[c + 1] < h[c]) c++;
        if (v <= h[c]) break;
        h[i] = h[c];
        i = c;
    }
    if (len) h[i] = v;
    return top;
}

static void heapify(uint64_t *h, size_t n) {
    for (size_t k = n / 2; k-- > 0;) {
        uint64_t v = h[k];
        size_t i = k;
        for (;;) {
            size_t c = 2 * i + 1;
            if (c >= n) break;
            if (c + 1 < n && h[c + 1] < h[c]) c++;
            if (v <= h[c]) break;
            h[i] = h[c];
            i = c;
        }
        h[i] = v;
    }
}

/* Merge s->ids[0..n) in place; returns the number of ids left. */
static size_t bpe_list(const Merges *m, Scratch *s, size_t n) {
    uint32_t *ids = s->ids, *ranks = s->ranks;
    for (size_t i = 0; i + 1 < n; i++) ranks[i] = rank_of(m, ids[i], ids[i + 1]);
    while (n > 1) {
        size_t best = 0;
        for (size_t i = 1; i + 1 < n; i++)
            if (ranks[i] < ranks[best]) best = i;
        if (ranks[best] == NO_RANK) break;
        ids[best] = merge_of(m, ids[best], ids[best + 1])->merged;
        memmove(ids + best + 1, ids + best + 2, (n - best - 2) * 4);
        memmove(ranks + best, ranks + best + 1, (n - best - 2) * 4);
        n--;
        if (best > 0) ranks[best - 1] = rank_of(m, ids[best - 1], ids[best]);
        if (best + 1 < n) ranks[best] = rank_of(m, ids[best], ids[best + 1]);
    }
    return n;
}

#define DEAD UINT32_MAX

static size_t bpe_heap(const Merges *m, Scratch *s, size_t n) {
    uint32_t *ids = s->ids, *nxt = s->nxt, *prv = s->prv;
    uint64_t *heap = s->heap;
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        nxt[i] = i + 1 < n ? (uint32_t)(i + 1) : DEAD;
        prv[i] = i > 0 ? (uint32_t)(i - 1) : DEAD;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        uint32_t r = rank_of(m, ids[i], ids[i + 1]);
        if (r != NO_RANK) heap[hn++] = (uint64_t)r << 32 | i;
    }
    heapify(heap, hn);
    /* Each merge pushes at most two entries and kills one of n symbols: hn stays below 3n. */
    while (hn) {
        uint64_t top = heap_pop(heap, &hn);
        uint32_t rank = (uint32_t)(top >> 32), i = (uint32_t)top;
        uint32_t j = nxt[i];
        if (ids[i] == DEAD || j == DEAD) continue;
        const MergeSlot *ms = merge_of(m, ids[i], ids[j]);
        if (!ms || ms->rank != rank) continue; /* stale entry */
        ids[i] = ms->merged;
        ids[j] = DEAD;
        uint32_t k = nxt[j];
        nxt[i] = k;
        if (k != DEAD) {
            prv[k] = i;
            uint32_t r = rank_of(m, ids[i], ids[k]);
            if (r != NO_RANK) heap_push(heap, &hn, (uint64_t)r << 32 | i);
        }
        uint32_t p = prv[i];
        if (p != DEAD) {
            uint32_t r = rank_of(m, ids[p], ids[i]);
            if (r != NO_RANK) heap_push(heap, &hn, (uint64_t)r << 32 | p);
        }
    }
    size_t out = 0;
    for (size_t i = 0; i < n; i++)
        if (ids[i] != DEAD) ids[out++] = ids[i];
    return out;
}

/* BPE of the UTF-8 bytes; the ids are left in s->ids. Returns their count, or -1 (no memory,
 * or a chunk too long for 32-bit positions). */
static Py_ssize_t bpe_chunk(const Merges *m, Scratch *s, const uint8_t *bytes, size_t n) {
    if (n >= DEAD / 3 || scratch_reserve(s, n + 1)) return -1;
    for (size_t i = 0; i < n; i++) s->ids[i] = m->byte_ids[bytes[i]];
    if (n < 2) return (Py_ssize_t)n;
    return (Py_ssize_t)(n > HEAP_MIN_BYTES ? bpe_heap(m, s, n) : bpe_list(m, s, n));
}

/* ---- Python type: Merges ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Merges m;
} MergesObject;

static void MergesObject_dealloc(MergesObject *self) {
    free(self->m.slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Merges(pattern: int, byte_ids: bytes (256 uint32), merges: bytes (uint32 triples
 * left, right, merged, in rank order)) */
static int MergesObject_init(MergesObject *self, PyObject *args, PyObject *kwds) {
    int pattern;
    Py_buffer byte_ids, triples;
    static char *kwlist[] = {"pattern", "byte_ids", "merges", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iy*y*", kwlist, &pattern, &byte_ids, &triples))
        return -1;
    int rc = -1;
    if (g_table == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "set_tables() must be called first");
        goto done;
    }
    if ((pattern != PAT_GPT2 && pattern != PAT_GPT4) || byte_ids.len != 256 * 4 ||
        triples.len % 12 != 0 || self->m.slots != NULL) {
        PyErr_SetString(PyExc_ValueError, "bad Merges arguments");
        goto done;
    }
    size_t n = (size_t)triples.len / 12;
    size_t cap = 16;
    while (cap < 2 * n + 2) cap *= 2;
    self->m.slots = malloc(cap * sizeof(MergeSlot));
    if (!self->m.slots) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < cap; i++) self->m.slots[i].key = EMPTY_KEY;
    self->m.mask = cap - 1;
    self->m.pattern = pattern;
    memcpy(self->m.byte_ids, byte_ids.buf, 256 * 4);
    const uint32_t *t = triples.buf;
    for (size_t r = 0; r < n; r++) {
        uint64_t key = (uint64_t)t[3 * r] << 32 | t[3 * r + 1];
        size_t i = (size_t)mix64(key) & self->m.mask;
        while (self->m.slots[i].key != EMPTY_KEY && self->m.slots[i].key != key)
            i = (i + 1) & self->m.mask;
        if (self->m.slots[i].key == key) continue; /* a repeated merge keeps its first rank */
        self->m.slots[i].key = key;
        self->m.slots[i].rank = (uint32_t)r;
        self->m.slots[i].merged = t[3 * r + 2];
    }
    rc = 0;
done:
    PyBuffer_Release(&byte_ids);
    PyBuffer_Release(&triples);
    return rc;
}

static PyTypeObject MergesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tokenizer._encode_core.Merges",
    .tp_basicsize = sizeof(MergesObject),
    .tp_dealloc = (destructor)MergesObject_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The merge table of one tokenizer, shared read-only by its Encoders.",
    .tp_init = (initproc)MergesObject_init,
    .tp_new = PyType_GenericNew,
};

/* ---- Python type: Encoder (one per thread: owns its chunk cache) ------------------------ */

#define CACHE_MAX_ENTRIES (1 << 18) /* as tokenizer/bpe.py */
#define CACHE_MAX_CHUNK 256         /* longer chunks are rare and not cached */

typedef struct {
    PyObject_HEAD
    MergesObject *merges;
    StrMap cache;
    Scratch scratch;
    ByteBuf utf8;
    int busy;
} EncoderObject;

static void EncoderObject_dealloc(EncoderObject *self) {
    strmap_free(&self->cache);
    scratch_free(&self->scratch);
    free(self->utf8.p);
    Py_XDECREF(self->merges);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int EncoderObject_init(EncoderObject *self, PyObject *args, PyObject *kwds) {
    PyObject *merges;
    static char *kwlist[] = {"merges", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", kwlist, &MergesType, &merges)) return -1;
    if (self->merges != NULL || ((MergesObject *)merges)->m.slots == NULL) {
        PyErr_SetString(PyExc_ValueError, "bad Encoder arguments");
        return -1;
    }
    if (strmap_init(&self->cache, 1 << 12)) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(merges);
    self->merges = (MergesObject *)merges;
    return 0;
}

/* Ids of t appended to out; -1 on allocation failure. Runs without the GIL. */
static int encode_text(EncoderObject *self, const Text *t, IdBuf *out) {
    const Merges *m = &self->merges->m;
    StrMap *cache = &self->cache;
    Py_ssize_t i = 0;
    while (i < t->n) {
        Py_ssize_t j = chunk_end(m->pattern, t, i);
        const uint8_t *bytes;
        size_t len;
        if (t->kind == PyUnicode_1BYTE_KIND && j - i == 1 && cp_at(t, i) < 0x80) {
            if (idbuf_reserve(out, 1)) return -1; /* one ASCII character: one byte token */
            out->p[out->len++] = m->byte_ids[cp_at(t, i)];
            i = j;
            continue;
        }
        if (t->ascii) {
            bytes = (const uint8_t *)t->data + i;
            len = (size_t)(j - i);
        } else {
            if (utf8_of(t, i, j, &self->utf8)) return -1;
            bytes = self->utf8.p;
            len = self->utf8.len;
        }
        i = j;
        uint64_t h = 0;
        size_t pos = 0;
        int cacheable = len <= CACHE_MAX_CHUNK;
        if (cacheable) {
            h = hash_bytes(bytes, len);
            Slot *slot = strmap_find(cache, bytes, len, h, &pos);
            if (slot != NULL) {
                if (idbuf_reserve(out, slot->val_len)) return -1;
                memcpy(out->p + out->len, cache->vals.p + slot->val, slot->val_len * 4);
                out->len += slot->val_len;
                continue;
            }
        }
        Py_ssize_t k = bpe_chunk(m, &self->scratch, bytes, len);
        if (k < 0 || idbuf_reserve(out, (size_t)k)) return -1;
        memcpy(out->p + out->len, self->scratch.ids, (size_t)k * 4);
        out->len += (size_t)k;
        if (cacheable) {
            if (cache->count >= CACHE_MAX_ENTRIES) {
                strmap_clear(cache);
                strmap_find(cache, bytes, len, h, &pos);
            }
            if (idbuf_reserve(&cache->vals, (size_t)k)) return -1;
            Slot *slot = strmap_insert(cache, pos, bytes, len, h);
            if (slot == NULL) return -1;
            slot->val = cache->vals.len;
            slot->val_len = (uint32_t)k;
            memcpy(cache->vals.p + cache->vals.len, self->scratch.ids, (size_t)k * 4);
            cache->vals.len += (size_t)k;
        }
    }
    return 0;
}

static int claim(int *busy) {
    if (*busy) {
        PyErr_SetString(PyExc_RuntimeError, "this object is in use by another thread");
        return -1;
    }
    *busy = 1;
    return 0;
}

/* encode(text: str) -> bytes of native uint32 ids, or None if text holds surrogates. */
static PyObject *Encoder_encode(EncoderObject *self, PyObject *arg) {
    Text t;
    if (self->merges == NULL) {
        PyErr_SetString(PyExc_ValueError, "uninitialised Encoder");
        return NULL;
    }
    if (text_of(arg, &t) < 0 || claim(&self->busy) < 0) return NULL;
    IdBuf out = {0};
    int surrogates, failed = 0;
    Py_INCREF(arg); /* the str's data must outlive the unlocked section */
    Py_BEGIN_ALLOW_THREADS
    surrogates = has_surrogates(&t);
    if (!surrogates) failed = encode_text(self, &t, &out);
    Py_END_ALLOW_THREADS
    Py_DECREF(arg);
    self->busy = 0;
    if (failed) {
        free(out.p);
        if (self->cache.count) strmap_clear(&self->cache); /* keep it consistent */
        return PyErr_NoMemory();
    }
    if (surrogates) {
        free(out.p);
        Py_RETURN_NONE;
    }
    PyObject *res = PyBytes_FromStringAndSize((const char *)out.p, (Py_ssize_t)(out.len * 4));
    free(out.p);
    return res;
}

static PyObject *Encoder_cache_size(EncoderObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSize_t(self->cache.count);
}

static PyMethodDef Encoder_methods[] = {
    {"encode", (PyCFunction)Encoder_encode, METH_O,
     "encode(text) -> bytes of native uint32 ids (None if text holds surrogates)."},
    {"cache_size", (PyCFunction)Encoder_cache_size, METH_NOARGS, "Chunks in the cache."},
    {NULL},
};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tokenizer._encode_core.Encoder",
    .tp_basicsize = sizeof(EncoderObject),
    .tp_dealloc = (destructor)EncoderObject_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Encoder(merges): ordinary text -> ids, with its own chunk cache (one thread).",
    .tp_methods = Encoder_methods,
    .tp_init = (initproc)EncoderObject_init,
    .tp_new = PyType_GenericNew,
};

/* ---- Python type: ChunkCounter (training: chunk -> count) ------------------------------- */

typedef struct {
    PyObject_HEAD
    int pattern;
    StrMap map;
    ByteBuf utf8;
    int busy, ready;
} CounterObject;

static void CounterObject_dealloc(CounterObject *self) {
    strmap_free(&self->map);
    free(self->utf8.p);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int CounterObject_init(CounterObject *self, PyObject *args, PyObject *kwds) {
    int pattern;
    static char *kwlist[] = {"pattern", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &pattern)) return -1;
    if (g_table == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "set_tables() must be called first");
        return -1;
    }
    if ((pattern != PAT_GPT2 && pattern != PAT_GPT4) || self->ready) {
        PyErr_SetString(PyExc_ValueError, "bad ChunkCounter arguments");
        return -1;
    }
    if (strmap_init(&self->map, 1 << 12)) {
        PyErr_NoMemory();
        return -1;
    }
    self->pattern = pattern;
    self->ready = 1;
    return 0;
}

static int count_add(StrMap *map, const uint8_t *key, size_t len, size_t count) {
    uint64_t h = hash_bytes(key, len);
    size_t pos;
    Slot *s = strmap_find(map, key, len, h, &pos);
    if (s == NULL) {
        s = strmap_insert(map, pos, key, len, h);
        if (s == NULL) return -1;
    }
    s->val += count;
    return 0;
}

static int count_text(CounterObject *self, const Text *t) {
    Py_ssize_t i = 0;
    while (i < t->n) {
        Py_ssize_t j = chunk_end(self->pattern, t, i);
        if (t->ascii) {
            if (count_add(&self->map, (const uint8_t *)t->data + i, (size_t)(j - i), 1)) return -1;
        } else {
            if (utf8_of(t, i, j, &self->utf8)) return -1;
            if (count_add(&self->map, self->utf8.p, self->utf8.len, 1)) return -1;
        }
        i = j;
    }
    return 0;
}

/* add(text) -> True, or False (nothing counted) if text holds surrogates. */
static PyObject *Counter_add(CounterObject *self, PyObject *arg) {
    Text t;
    if (!self->ready) {
        PyErr_SetString(PyExc_ValueError, "uninitialised ChunkCounter");
        return NULL;
    }
    if (text_of(arg, &t) < 0 || claim(&self->busy) < 0) return NULL;
    int surrogates, failed = 0;
    Py_INCREF(arg);
    Py_BEGIN_ALLOW_THREADS
    surrogates = has_surrogates(&t);
    if (!surrogates) failed = count_text(self, &t);
    Py_END_ALLOW_THREADS
    Py_DECREF(arg);
    self->busy = 0;
    if (failed) return PyErr_NoMemory();
    return PyBool_FromLong(!surrogates);
}

/* merge(other): add other's counts to this one. */
static PyObject *Counter_merge(CounterObject *self, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, Py_TYPE(self)) || arg == (PyObject *)self || !self->ready ||
        !((CounterObject *)arg)->ready) {
        PyErr_SetString(PyExc_TypeError, "merge() needs another initialised ChunkCounter");
        return NULL;
    }
    CounterObject *other = (CounterObject *)arg;
    if (claim(&self->busy) < 0) return NULL;
    if (claim(&other->busy) < 0) {
        self->busy = 0;
        return NULL;
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t e = 0; e < other->map.count && !failed; e++) {
        Slot *s = &other->map.entries[e];
        failed = count_add(&self->map, other->map.keys.p + s->key_off, s->key_len, s->val);
    }
    Py_END_ALLOW_THREADS
    self->busy = other->busy = 0;
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* to_dict(target=None) -> {chunk: count}: into `target` (a dict, e.g. a Counter) if given,
 * so that a caller's Counter is filled without a second copy of a large dict. */
static PyObject *Counter_to_dict(CounterObject *self, PyObject *args) {
    PyObject *target = NULL;
    if (!PyArg_ParseTuple(args, "|O!", &PyDict_Type, &target)) return NULL;
    if (!self->ready || claim(&self->busy) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "uninitialised ChunkCounter");
        return NULL;
    }
    PyObject *d = target ? Py_NewRef(target) : PyDict_New();
    for (size_t e = 0; d && e < self->map.count; e++) {
        Slot *s = &self->map.entries[e];
        PyObject *k = PyUnicode_DecodeUTF8(
            (const char *)self->map.keys.p + s->key_off, s->key_len, "strict");
        PyObject *v = PyLong_FromSize_t(s->val);
        if (!k || !v || PyDict_SetItem(d, k, v) < 0) Py_CLEAR(d);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    self->busy = 0;
    return d;
}

static Py_ssize_t Counter_len(CounterObject *self) { return (Py_ssize_t)self->map.count; }

static PyMethodDef Counter_methods[] = {
    {"add", (PyCFunction)Counter_add, METH_O,
     "add(text) -> True; False (nothing counted) if text holds surrogates."},
    {"merge", (PyCFunction)Counter_merge, METH_O, "merge(other): add other's counts."},
    {"to_dict", (PyCFunction)Counter_to_dict, METH_VARARGS,
     "to_dict(target=None) -> {chunk: count} (filled into target if given)."},
    {NULL},
};

static PySequenceMethods Counter_as_sequence = {.sq_length = (lenfunc)Counter_len};

static PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tokenizer._encode_core.ChunkCounter",
    .tp_basicsize = sizeof(CounterObject),
    .tp_dealloc = (destructor)CounterObject_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ChunkCounter(pattern): counts pre-tokenized chunks (one thread at a time).",
    .tp_methods = Counter_methods,
    .tp_as_sequence = &Counter_as_sequence,
    .tp_init = (initproc)CounterObject_init,
    .tp_new = PyType_GenericNew,
};

/* ---- module functions ------------------------------------------------------------------- */

/* set_tables(table: bytes of 0x110000 class bytes). Once per process; later calls must agree. */
static PyObject *set_tables(PyObject *mod, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    if (b.len != N_CODEPOINTS) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "the table must hold 0x110000 bytes");
        return NULL;
    }
    if (g_table == NULL) {
        uint8_t *t = malloc(N_CODEPOINTS);
        if (!t) {
            PyBuffer_Release(&b);
            return PyErr_NoMemory();
        }
        memcpy(t, b.buf, N_CODEPOINTS);
        g_table = t;
    } else if (memcmp(g_table, b.buf, N_CODEPOINTS) != 0) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "the tables are already set, differently");
        return NULL;
    }
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* split(pattern: int, text: str) -> list of chunks, or None if text holds surrogates. */
static PyObject *split(PyObject *mod, PyObject *args) {
    int pattern;
    PyObject *text;
    Text t;
    if (!PyArg_ParseTuple(args, "iU", &pattern, &text) || text_of(text, &t) < 0) return NULL;
    if (g_table == NULL || (pattern != PAT_GPT2 && pattern != PAT_GPT4)) {
        PyErr_SetString(PyExc_ValueError, "set_tables() first; pattern 0 (gpt2) or 1 (gpt4)");
        return NULL;
    }
    if (has_surrogates(&t)) Py_RETURN_NONE;
    PyObject *out = PyList_New(0);
    Py_ssize_t i = 0;
    while (out && i < t.n) {
        Py_ssize_t j = chunk_end(pattern, &t, i);
        PyObject *s = PyUnicode_Substring(text, i, j);
        if (!s || PyList_Append(out, s) < 0) Py_CLEAR(out);
        Py_XDECREF(s);
        i = j;
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"set_tables", set_tables, METH_O, "set_tables(table): the character classes, once."},
    {"split", split, METH_VARARGS, "split(pattern, text) -> chunks (None on surrogates)."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_encode_core",
    "Compiled pre-tokenization, BPE and chunk counting (see tokenizer/c_core.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__encode_core(void) {
    if (PyType_Ready(&MergesType) < 0 || PyType_Ready(&EncoderType) < 0 ||
        PyType_Ready(&CounterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "PATTERN_GPT2", PAT_GPT2) < 0 ||
        PyModule_AddIntConstant(m, "PATTERN_GPT4", PAT_GPT4) < 0 ||
        PyModule_AddIntConstant(m, "C_L", C_L) < 0 || PyModule_AddIntConstant(m, "C_N", C_N) < 0 ||
        PyModule_AddIntConstant(m, "C_S", C_S) < 0 ||
        PyModule_AddIntConstant(m, "F_SDMT", F_SDMT) < 0 ||
        PyModule_AddIntConstant(m, "F_L", F_L) < 0 || PyModule_AddIntConstant(m, "F_V", F_V) < 0 ||
        PyModule_AddIntConstant(m, "F_E", F_E) < 0 || PyModule_AddIntConstant(m, "F_R", F_R) < 0 ||
        PyModule_AddIntConstant(m, "HEAP_MIN_BYTES", HEAP_MIN_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&MergesType);
    Py_INCREF(&EncoderType);
    Py_INCREF(&CounterType);
    if (PyModule_AddObject(m, "Merges", (PyObject *)&MergesType) < 0 ||
        PyModule_AddObject(m, "Encoder", (PyObject *)&EncoderType) < 0 ||
        PyModule_AddObject(m, "ChunkCounter", (PyObject *)&CounterType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
