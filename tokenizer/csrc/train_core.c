/* The BPE training merge loop of tokenizer/bpe_train.py, compiled.
 *
 * Same algorithm as the Python reference (_train_merges_python), same output:
 * - every unique chunk is a linked list of symbols in flat int32 arrays (sym, nxt, prv); a merge
 *   rewrites two links and kills the right symbol;
 * - per pair: its weighted count and a growable int32 array of the positions where it starts.
 *   Positions are removed lazily: an entry is live while sym[p] == a and sym[nxt[p]] == b. The
 *   pair at a position only ever changes to pairs holding newer token ids, so a stale entry never
 *   becomes live again; lists are compacted when most of their entries are stale;
 * - the best pair comes from a max-heap with lazy deletion: highest count, then the
 *   lexicographically greater (bytes_a, bytes_b), then the smaller (id_a, id_b) (two tokens can
 *   have the same bytes), exactly the Python heap's order;
 * - occurrences of a pair are merged left to right within a chunk, so "aaa" -> "aa" "a".
 *
 * train_merges(chunk_counts: dict[str, int], num_merges: int, progress=None)
 *     -> list[tuple[bytes, bytes]] | None
 * None means "not an input this loop takes" (a key that is not a str or not encodable as
 * UTF-8, a count that is not an int or too large for int64 sums, num_merges not an int, or
 * subclasses of str and int, whose methods the Python loop would call): the
 * caller then runs the Python loop, which gives the answer or the error. progress, when given,
 * is called with the number of merges done since the last call (every PROGRESS_EVERY merges
 * and at the end). The GIL is released during the merge loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PROGRESS_EVERY 256
#define INLINE_CAP 2 /* positions held in the pair itself: most pairs occur once or twice */
#define COUNT_LIMIT (INT64_MAX / 4)

typedef struct {
    int64_t count; /* weighted number of live occurrences */
    union {
        int32_t *buf;
        int32_t inline_pos[INLINE_CAP];
    } pos;
    int32_t a, b;  /* token ids */
    int32_t len;   /* entries in the position list, live or stale */
    int32_t cap;   /* capacity of the position list (INLINE_CAP: inline) */
    int32_t live;  /* live entries (each position is listed at most once per pair) */
} Pair;

typedef struct {
    int64_t count;
    int32_t pair;
} HeapEntry;

typedef struct {
    /* symbols: flat linked lists, one per chunk */
    int32_t *sym, *nxt, *prv, *owner;
    int64_t *weight; /* per chunk */
    int64_t n_pos;
    /* tokens: id -> bytes in one arena */
    unsigned char *arena;
    int64_t arena_len, arena_cap;
    int64_t *tok_off;
    int32_t *tok_len;
    int32_t n_tok, tok_cap;
    /* pairs and the pair -> index map (open addressing, linear probing, int32 slots) */
    Pair *pairs;
    int32_t n_pairs, pairs_cap;
    int32_t *table;
    uint64_t table_mask;
    /* max-heap with lazy deletion */
    HeapEntry *heap;
    int64_t heap_len, heap_cap;
    /* learned merges as token id pairs */
    int32_t *merge_a, *merge_b;
    int64_t n_merges, merges_cap;
} Trainer;

/* ---------------------------------------------------------------- small helpers */

static void *grow_array(void *ptr, int64_t *cap, int64_t need, size_t item) {
    /* Make room for `need` items, doubling; NULL (ptr untouched) when memory runs out. */
    if (need <= *cap) return ptr;
    int64_t new_cap = *cap > 0 ? *cap : 16;
    while (new_cap < need) new_cap *= 2;
    void *p = realloc(ptr, (size_t)new_cap * item);
    if (p == NULL) return NULL;
    *cap = new_cap;
    return p;
}

static inline uint64_t hash_pair(int32_t a, int32_t b) {
    /* splitmix64's finalizer: every bit of (a, b) reaches the low bits the table uses */
    uint64_t x = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline int32_t *pair_positions(Pair *p) {
    return p->cap > INLINE_CAP ? p->pos.buf : p->pos.inline_pos;
}

static void pair_free_positions(Pair *p) {
    if (p->cap > INLINE_CAP) free(p->pos.buf);
    p->cap = INLINE_CAP;
    p->len = 0;
}

/* ---------------------------------------------------------------- tokens */

static int init_byte_tokens(Trainer *t) {
    int64_t cap = 0;
    t->tok_off = grow_array(NULL, &cap, 512, sizeof(int64_t));
    t->tok_len = malloc((size_t)cap * sizeof(int32_t));
    t->arena = malloc(1024);
    if (t->tok_off == NULL || t->tok_len == NULL || t->arena == NULL) return -1;
    t->tok_cap = (int32_t)cap;
    t->arena_cap = 1024;
    for (int b = 0; b < 256; b++) {
        t->arena[b] = (unsigned char)b;
        t->tok_off[b] = b;
        t->tok_len[b] = 1;
    }
    t->arena_len = 256;
    t->n_tok = 256;
    return 0;
}

/* Append token a + b (the bytes of two existing tokens). 0 or -1 (out of memory). */
static int add_token(Trainer *t, int32_t a, int32_t b) {
    if (t->n_tok >= t->tok_cap) {
        if (t->n_tok >= INT32_MAX / 2) return -1;
        int64_t c1 = t->tok_cap, c2 = t->tok_cap;
        int64_t *off = grow_array(t->tok_off, &c1, t->n_tok + 1, sizeof(int64_t));
        if (off == NULL) return -1;
        t->tok_off = off;
        int32_t *len = grow_array(t->tok_len, &c2, t->n_tok + 1, sizeof(int32_t));
        if (len == NULL) return -1;
        t->tok_len = len;
        t->tok_cap = (int32_t)c1;
    }
    int64_t la = t->tok_len[a], lb = t->tok_len[b];
    if (la + lb > INT32_MAX) return -1;
    unsigned char *arena = grow_array(t->arena, &t->arena_cap, t->arena_len + la + lb, 1);
    if (arena == NULL) return -1;
    t->arena = arena;
    memcpy(arena + t->arena_len, arena + t->tok_off[a], (size_t)la);
    memcpy(arena + t->arena_len + la, arena + t->tok_off[b], (size_t)lb);
    t->tok_off[t->n_tok] = t->arena_len;
    t->tok_len[t->n_tok] = (int32_t)(la + lb);
    t->arena_len += la + lb;
    t->n_tok++;
    return 0;
}

static inline int cmp_bytes(const Trainer *t, int32_t x, int32_t y) {
    /* Lexicographic order of token bytes, as Python compares bytes. */
    if (x == y) return 0;
    int32_t lx = t->tok_len[x], ly = t->tok_len[y];
    int c = memcmp(t->arena + t->tok_off[x], t->arena + t->tok_off[y],
                   (size_t)(lx < ly ? lx : ly));
    if (c != 0) return c;
    return (lx > ly) - (lx < ly);
}

/* ---------------------------------------------------------------- pairs */

static int table_resize(Trainer *t, uint64_t new_size) {
    int32_t *table = malloc(new_size * sizeof(int32_t));
    if (table == NULL) return -1;
    memset(table, 0xff, new_size * sizeof(int32_t)); /* -1: empty */
    uint64_t mask = new_size - 1;
    for (int32_t k = 0; k < t->n_pairs; k++) {
        uint64_t h = hash_pair(t->pairs[k].a, t->pairs[k].b) & mask;
        while (table[h] >= 0) h = (h + 1) & mask;
        table[h] = k;
    }
    free(t->table);
    t->table = table;
    t->table_mask = mask;
    return 0;
}

/* Index of pair (a, b); created (count 0, no positions) when absent and `create` is set.
 * Returns -1 when absent and not created, -2 when memory ran out. */
static int32_t find_pair(Trainer *t, int32_t a, int32_t b, int create) {
    uint64_t h = hash_pair(a, b) & t->table_mask;
    for (;;) {
        int32_t k = t->table[h];
        if (k < 0) break;
        if (t->pairs[k].a == a && t->pairs[k].b == b) return k;
        h = (h + 1) & t->table_mask;
    }
    if (!create) return -1;
    if (t->n_pairs >= INT32_MAX - 1) return -2;
    if ((uint64_t)(t->n_pairs + 1) * 2 > t->table_mask + 1) {
        if (table_resize(t, (t->table_mask + 1) * 2) < 0) return -2;
        h = hash_pair(a, b) & t->table_mask;
        while (t->table[h] >= 0) h = (h + 1) & t->table_mask;
    }
    if (t->n_pairs + 1 > t->pairs_cap) {
        int64_t cap = t->pairs_cap;
        Pair *pairs = grow_array(t->pairs, &cap, t->n_pairs + 1, sizeof(Pair));
        if (pairs == NULL) return -2;
        t->pairs = pairs;
        t->pairs_cap = (int32_t)(cap < INT32_MAX ? cap : INT32_MAX);
    }
    int32_t k = t->n_pairs++;
    Pair *p = &t->pairs[k];
    memset(p, 0, sizeof(Pair));
    p->a = a;
    p->b = b;
    p->cap = INLINE_CAP;
    t->table[h] = k;
    return k;
}

static inline int is_live(const Trainer *t, const Pair *p, int32_t i) {
    if (t->sym[i] != p->a) return 0;
    int32_t j = t->nxt[i];
    return j >= 0 && t->sym[j] == p->b;
}

static int pair_append(Pair *p, int32_t pos) {
    if (p->len == p->cap) {
        int64_t new_cap = (int64_t)p->cap * 2;
        if (new_cap > INT32_MAX) return -1;
        int32_t *buf;
        if (p->cap == INLINE_CAP) {
            buf = malloc((size_t)new_cap * sizeof(int32_t));
            if (buf == NULL) return -1;
            memcpy(buf, p->pos.inline_pos, sizeof(p->pos.inline_pos));
        } else {
            buf = realloc(p->pos.buf, (size_t)new_cap * sizeof(int32_t));
            if (buf == NULL) return -1;
        }
        p->pos.buf = buf;
        p->cap = (int32_t)new_cap;
    }
    pair_positions(p)[p->len++] = pos;
    p->live++;
    return 0;
}

/* One live occurrence of pair k went away (Python's where[old].discard(p)). */
static void pair_lose(Trainer *t, int32_t k, int64_t w) {
    Pair *p = &t->pairs[k];
    p->count -= w;
    p->live--;
    if (p->live <= 0) {
        pair_free_positions(p);
        p->live = 0;
        return;
    }
    /* Most entries stale: drop them, so lists stay within ~2x their live positions. Safe at
     * any time a decrement happens: only pairs holding the token being created change. */
    if (p->cap > INLINE_CAP && p->len > 2 * p->live + 8) {
        int32_t *pos = p->pos.buf;
        int32_t n = 0;
        for (int32_t e = 0; e < p->len; e++)
            if (is_live(t, p, pos[e])) pos[n++] = pos[e];
        p->len = n;
        if (p->cap > 4 * n + 16) {
            int32_t *smaller = realloc(pos, (size_t)(2 * n + 8) * sizeof(int32_t));
            if (smaller != NULL) {
                p->pos.buf = smaller;
                p->cap = 2 * n + 8;
            }
        }
    }
}

/* ---------------------------------------------------------------- heap */

/* 1 when entry x comes out of the heap before entry y. */
static inline int heap_before(const Trainer *t, const HeapEntry *x, const HeapEntry *y) {
    if (x->count != y->count) return x->count > y->count;
    const Pair *px = &t->pairs[x->pair], *py = &t->pairs[y->pair];
    int c = cmp_bytes(t, px->a, py->a);
    if (c != 0) return c > 0;
    c = cmp_bytes(t, px->b, py->b);
    if (c != 0) return c > 0;
    if (px->a != py->a) return px->a < py->a;
    return px->b < py->b;
}

static void sift_down(Trainer *t, int64_t i) {
    HeapEntry *h = t->heap;
    int64_t n = t->heap_len;
    HeapEntry item = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_before(t, &h[c + 1], &h[c])) c++;
        if (!heap_before(t, &h[c], &item)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = item;
}

static int heap_push(Trainer *t, int64_t count, int32_t pair) {
    HeapEntry *h = grow_array(t->heap, &t->heap_cap, t->heap_len + 1, sizeof(HeapEntry));
    if (h == NULL) return -1;
    t->heap = h;
    HeapEntry item = {count, pair};
    int64_t i = t->heap_len++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!heap_before(t, &item, &h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = item;
    return 0;
}

static void heap_pop(Trainer *t) {
    t->heap[0] = t->heap[--t->heap_len];
    if (t->heap_len > 0) sift_down(t, 0);
}

/* ---------------------------------------------------------------- cleanup */

static void trainer_free(Trainer *t) {
    free(t->sym);
    free(t->nxt);
    free(t->prv);
    free(t->owner);
    free(t->weight);
    free(t->arena);
    free(t->tok_off);
    free(t->tok_len);
    if (t->pairs != NULL)
        for (int32_t k = 0; k < t->n_pairs; k++) pair_free_positions(&t->pairs[k]);
    free(t->pairs);
    free(t->table);
    free(t->heap);
    free(t->merge_a);
    free(t->merge_b);
    memset(t, 0, sizeof(*t));
}

/* ---------------------------------------------------------------- reading the chunks */

/* UTF-8 length of a str, or -1 when it holds a lone surrogate (not encodable). */
static int64_t utf8_length(PyObject *s) {
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    if (PyUnicode_IS_ASCII(s)) return n;
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c < 0x80) total += 1;
        else if (c < 0x800) total += 2;
        else if (c >= 0xD800 && c <= 0xDFFF) return -1;
        else if (c < 0x10000) total += 3;
        else total += 4;
    }
    return total;
}

static void utf8_write(PyObject *s, int32_t *out) {
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    int64_t o = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c < 0x80) {
            out[o++] = (int32_t)c;
        } else if (c < 0x800) {
            out[o++] = 0xC0 | (c >> 6);
            out[o++] = 0x80 | (c & 0x3F);
        } else if (c < 0x10000) {
            out[o++] = 0xE0 | (c >> 12);
            out[o++] = 0x80 | ((c >> 6) & 0x3F);
            out[o++] = 0x80 | (c & 0x3F);
        } else {
            out[o++] = 0xF0 | (c >> 18);
            out[o++] = 0x80 | ((c >> 12) & 0x3F);
            out[o++] = 0x80 | ((c >> 6) & 0x3F);
            out[o++] = 0x80 | (c & 0x3F);
        }
    }
}

/* Fill the symbol arrays from the dict. 1: done, 0: input this loop does not take, -1: error
 * set. A chunk of fewer than two bytes or with a count <= 0 takes part in no pair. */
static int read_chunks(Trainer *t, PyObject *dict) {
    Py_ssize_t it = 0;
    PyObject *key, *value;
    int64_t n_pos = 0, n_chunks = 0, total = 0;
    while (PyDict_Next(dict, &it, &key, &value)) {
        /* Exact types: a subclass could change encode() or arithmetic for the Python loop. */
        if (!PyUnicode_CheckExact(key) || !(PyLong_CheckExact(value) || PyBool_Check(value)))
            return 0;
        int overflow = 0;
        long long count = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (count == -1 && PyErr_Occurred()) return -1;
        if (overflow > 0) return 0;
        int64_t n = utf8_length(key);
        if (n < 0) return 0;
        if (overflow < 0 || count <= 0 || n < 2) continue;
        if (count > COUNT_LIMIT / (n - 1) || total > COUNT_LIMIT - count * (n - 1)) return 0;
        total += count * (n - 1);
        n_pos += n;
        n_chunks++;
        if (n_pos >= INT32_MAX || n_chunks >= INT32_MAX) return 0;
    }
    size_t np = (size_t)(n_pos > 0 ? n_pos : 1);
    t->sym = malloc(np * sizeof(int32_t));
    t->nxt = malloc(np * sizeof(int32_t));
    t->prv = malloc(np * sizeof(int32_t));
    t->owner = malloc(np * sizeof(int32_t));
    t->weight = malloc((size_t)(n_chunks > 0 ? n_chunks : 1) * sizeof(int64_t));
    if (!t->sym || !t->nxt || !t->prv || !t->owner || !t->weight) {
        PyErr_NoMemory();
        return -1;
    }
    it = 0;
    int64_t base = 0, chunk = 0;
    while (PyDict_Next(dict, &it, &key, &value)) {
        int overflow = 0;
        long long count = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow != 0 || count <= 0) continue;
        int64_t n = utf8_length(key);
        if (n < 2) continue;
        if (base + n > n_pos || chunk >= n_chunks) break; /* cannot happen: same dict */
        utf8_write(key, t->sym + base);
        for (int64_t i = 0; i < n; i++) {
            t->nxt[base + i] = i + 1 < n ? (int32_t)(base + i + 1) : -1;
            t->prv[base + i] = i > 0 ? (int32_t)(base + i - 1) : -1;
            t->owner[base + i] = (int32_t)chunk;
        }
        t->weight[chunk++] = count;
        base += n;
    }
    t->n_pos = base;
    return 1;
}

/* ---------------------------------------------------------------- the loop */

/* Count every adjacent pair and fill the heap. 0 or -1 (out of memory).
 * The first pairs are byte pairs: tallied in a direct 64K table, so that each position list
 * is allocated at its exact size (no growth slack at the peak of memory). */
static int count_pairs(Trainer *t) {
    int64_t *tally = calloc(65536, sizeof(int64_t));
    int32_t *index = malloc(65536 * sizeof(int32_t));
    int status = -1;
    if (tally == NULL || index == NULL || table_resize(t, 1024) < 0) goto done;
    for (int64_t i = 0; i < t->n_pos; i++)
        if (t->nxt[i] >= 0) tally[t->sym[i] << 8 | t->sym[t->nxt[i]]]++;
    for (int32_t code = 0; code < 65536; code++) {
        index[code] = -1;
        if (tally[code] == 0) continue;
        int32_t k = find_pair(t, code >> 8, code & 255, 1);
        if (k < 0) goto done;
        index[code] = k;
        Pair *p = &t->pairs[k];
        if (tally[code] > INLINE_CAP) {
            p->pos.buf = malloc((size_t)tally[code] * sizeof(int32_t));
            if (p->pos.buf == NULL) goto done;
            p->cap = (int32_t)tally[code];
        }
    }
    for (int64_t i = 0; i < t->n_pos; i++) {
        if (t->nxt[i] < 0) continue;
        Pair *p = &t->pairs[index[t->sym[i] << 8 | t->sym[t->nxt[i]]]];
        p->count += t->weight[t->owner[i]];
        pair_positions(p)[p->len++] = (int32_t)i;
        p->live++;
    }
    int64_t cap = t->heap_cap;
    HeapEntry *heap = grow_array(t->heap, &cap, t->n_pairs > 0 ? t->n_pairs : 1,
                                 sizeof(HeapEntry));
    if (heap == NULL) goto done;
    t->heap = heap;
    t->heap_cap = cap;
    for (int32_t k = 0; k < t->n_pairs; k++) {
        t->heap[k].count = t->pairs[k].count;
        t->heap[k].pair = k;
    }
    t->heap_len = t->n_pairs;
    for (int64_t i = t->heap_len / 2 - 1; i >= 0; i--) sift_down(t, i);
    status = 0;
done:
    free(tally);
    free(index);
    return status;
}

static int cmp_int32(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

/* Merge every occurrence of pair `key` into token `new_id`, left to right within each chunk
 * (Python's _apply_merge). 0 or -1 (out of memory). */
static int apply_merge(Trainer *t, int32_t key, int32_t new_id) {
    Pair *merged = &t->pairs[key];
    int32_t a = merged->a, b = merged->b;
    merged->count = 0;
    /* Take the position list out of the pair: find_pair may move the pairs array. */
    int32_t n_list = merged->len;
    int32_t inline_copy[INLINE_CAP];
    int32_t *list;
    int32_t *owned = NULL;
    if (merged->cap > INLINE_CAP) {
        owned = list = merged->pos.buf;
    } else {
        memcpy(inline_copy, merged->pos.inline_pos, sizeof(inline_copy));
        list = inline_copy;
    }
    merged->cap = INLINE_CAP;
    merged->len = 0;
    merged->live = 0;
    /* Left to right (ascending positions), like Python's sorted(): overlapping occurrences
     * (a == b) depend on it. Lists are appended over many merges, so may be out of order. */
    int sorted = 1;
    for (int32_t e = 1; e < n_list && sorted; e++) sorted = list[e - 1] < list[e];
    if (!sorted) qsort(list, (size_t)n_list, sizeof(int32_t), cmp_int32);

    int32_t first_new_pair = t->n_pairs; /* pairs created from here on hold new_id */
    int status = 0;
    for (int32_t e = 0; e < n_list; e++) {
        int32_t i = list[e];
        if (t->sym[i] != a) continue; /* killed or rewritten by an overlapping occurrence */
        int32_t j = t->nxt[i];
        if (j < 0 || t->sym[j] != b) continue;
        int64_t w = t->weight[t->owner[i]];
        int32_t p = t->prv[i], n = t->nxt[j];
        int32_t left = p >= 0 ? t->sym[p] : -1, right = n >= 0 ? t->sym[n] : -1;
        /* The pairs (left, a) and (b, right) lose this occurrence, unless one is the pair being
         * merged. Both losses come before both gains: a loss may compact a list, which must
         * not see a position appended by this occurrence before its symbols are rewritten. */
        if (p >= 0 && !(left == a && a == b)) {
            int32_t old = find_pair(t, left, a, 0);
            if (old >= 0) pair_lose(t, old, w);
        }
        if (n >= 0 && !(b == right && a == b)) {
            int32_t old = find_pair(t, b, right, 0);
            if (old >= 0) pair_lose(t, old, w);
        }
        /* (left, new) and (new, right) gain it. */
        if (p >= 0) {
            int32_t grow = find_pair(t, left, new_id, 1);
            if (grow < 0 || pair_append(&t->pairs[grow], p) < 0) goto oom;
            t->pairs[grow].count += w;
        }
        if (n >= 0) {
            int32_t grow = find_pair(t, new_id, right, 1);
            if (grow < 0 || pair_append(&t->pairs[grow], i) < 0) goto oom;
            t->pairs[grow].count += w;
            t->prv[n] = i;
        }
        t->sym[i] = new_id;
        t->sym[j] = -1;
        t->nxt[i] = n;
    }
    for (int32_t k = first_new_pair; k < t->n_pairs; k++)
        if (t->pairs[k].count > 0 && heap_push(t, t->pairs[k].count, k) < 0) goto oom;
    goto done;
oom:
    status = -1;
done:
    free(owned);
    return status;
}

/* The main loop; runs without the GIL, takes it to report progress and check for signals.
 * 0, or -1 with a Python error set (GIL held again on return either way). */
static int run_merges(Trainer *t, int64_t num_merges, PyObject *progress) {
    int64_t reported = 0;
    int status = 0;
    PyThreadState *ts = PyEval_SaveThread();
    while (t->n_merges < num_merges && t->heap_len > 0) {
        HeapEntry top = t->heap[0];
        int64_t current = t->pairs[top.pair].count;
        if (current != top.count) {
            /* Stale (lazy deletion): re-push the true count if it went down; a pair whose
             * count went up already has a fresher entry. */
            heap_pop(t);
            if (0 < current && current < top.count && heap_push(t, current, top.pair) < 0)
                goto oom;
            continue;
        }
        heap_pop(t);
        Pair *pr = &t->pairs[top.pair];
        int32_t a = pr->a, b = pr->b;
        int32_t new_id = t->n_tok;
        if (add_token(t, a, b) < 0) goto oom;
        int64_t cap_a = t->merges_cap, cap_b = t->merges_cap;
        int32_t *ma = grow_array(t->merge_a, &cap_a, t->n_merges + 1, sizeof(int32_t));
        if (ma == NULL) goto oom;
        t->merge_a = ma;
        int32_t *mb = grow_array(t->merge_b, &cap_b, t->n_merges + 1, sizeof(int32_t));
        if (mb == NULL) goto oom;
        t->merge_b = mb;
        t->merges_cap = cap_a;
        t->merge_a[t->n_merges] = a;
        t->merge_b[t->n_merges] = b;
        t->n_merges++;
        if (apply_merge(t, top.pair, new_id) < 0) goto oom;
        if (t->n_merges % PROGRESS_EVERY == 0) {
            PyEval_RestoreThread(ts);
            if (PyErr_CheckSignals() < 0) return -1;
            if (progress != NULL) {
                PyObject *r = PyObject_CallFunction(progress, "L", (long long)(t->n_merges - reported));
                if (r == NULL) return -1;
                Py_DECREF(r);
                reported = t->n_merges;
            }
            ts = PyEval_SaveThread();
        }
    }
    PyEval_RestoreThread(ts);
    if (progress != NULL && t->n_merges > reported) {
        PyObject *r = PyObject_CallFunction(progress, "L", (long long)(t->n_merges - reported));
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return status;
oom:
    PyEval_RestoreThread(ts);
    PyErr_NoMemory();
    return -1;
}

static PyObject *merges_to_list(Trainer *t) {
    /* One bytes object per token, shared by the tuples, as in the Python loop. */
    PyObject **tok = calloc((size_t)t->n_tok, sizeof(PyObject *));
    if (tok == NULL) return PyErr_NoMemory();
    PyObject *out = PyList_New((Py_ssize_t)t->n_merges);
    if (out == NULL) goto fail;
    for (int64_t m = 0; m < t->n_merges; m++) {
        int32_t ids[2] = {t->merge_a[m], t->merge_b[m]};
        for (int s = 0; s < 2; s++) {
            int32_t id = ids[s];
            if (tok[id] == NULL) {
                tok[id] = PyBytes_FromStringAndSize((const char *)t->arena + t->tok_off[id],
                                                    t->tok_len[id]);
                if (tok[id] == NULL) goto fail;
            }
        }
        PyObject *pair = PyTuple_Pack(2, tok[ids[0]], tok[ids[1]]);
        if (pair == NULL) goto fail;
        PyList_SET_ITEM(out, (Py_ssize_t)m, pair);
    }
    for (int32_t k = 0; k < t->n_tok; k++) Py_XDECREF(tok[k]);
    free(tok);
    return out;
fail:
    Py_XDECREF(out);
    for (int32_t k = 0; k < t->n_tok; k++) Py_XDECREF(tok[k]);
    free(tok);
    return NULL;
}

static PyObject *train_merges(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"chunk_counts", "num_merges", "progress", NULL};
    PyObject *dict, *num_obj, *progress = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O|O:train_merges", kwlist, &PyDict_Type,
                                     &dict, &num_obj, &progress))
        return NULL;
    if (progress == Py_None) progress = NULL;
    else if (!PyCallable_Check(progress)) {
        PyErr_SetString(PyExc_TypeError, "progress must be callable or None");
        return NULL;
    }
    if (!(PyLong_CheckExact(num_obj) || PyBool_Check(num_obj))) Py_RETURN_NONE;
    int overflow = 0;
    long long num_merges = PyLong_AsLongLongAndOverflow(num_obj, &overflow);
    if (num_merges == -1 && PyErr_Occurred()) return NULL;
    if (overflow > 0) num_merges = LLONG_MAX;
    if (overflow < 0 || num_merges < 0) num_merges = 0;

    Trainer t;
    memset(&t, 0, sizeof(t));
    PyObject *result = NULL;
    int read = read_chunks(&t, dict);
    if (read < 0) goto done;
    if (read == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (init_byte_tokens(&t) < 0) goto oom;

    Py_BEGIN_ALLOW_THREADS;
    read = count_pairs(&t);
    Py_END_ALLOW_THREADS;
    if (read < 0) goto oom;
    if (run_merges(&t, num_merges, progress) < 0) goto done;
    result = merges_to_list(&t);
    goto done;
oom:
    PyErr_NoMemory();
done:
    trainer_free(&t);
    return result;
}

static PyMethodDef methods[] = {
    {"train_merges", (PyCFunction)(void (*)(void))train_merges, METH_VARARGS | METH_KEYWORDS,
     "train_merges(chunk_counts, num_merges, progress=None) -> list[tuple[bytes, bytes]] | None\n"
     "\n"
     "The BPE merge loop of tokenizer.bpe_train, compiled. None: an input it does not take\n"
     "(run the Python loop instead)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_train_core", "Compiled BPE training merge loop.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__train_core(void) { return PyModule_Create(&module); }
