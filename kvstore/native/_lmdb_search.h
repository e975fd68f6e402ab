/*
 * LMDB B-tree searches in a read-only view of data.mdb, shared by kvstore/native/_blockcopy.c (the
 * same-host reader's `resolve`) and kvstore/native/_ring.c (the request ring's native server).
 *
 * The page layout is mdb.c's (tiers/lmdb_pages.py describes it). Every page and node is
 * bounds-checked against the mapping's valid length; a page that does not parse answers -1,
 * and the callers then let py-lmdb's own reads say what it is. The caller holds a read txn of
 * the snapshot whose root it searches, so LMDB reuses none of its pages meanwhile.
 */
#ifndef KVSTORE_LMDB_SEARCH_H
#define KVSTORE_LMDB_SEARCH_H

#include <stdint.h>
#include <string.h>

enum { P_BRANCH = 0x01, P_LEAF = 0x02, P_OVERFLOW = 0x04, P_LEAF2 = 0x20, P_SUBP = 0x40, F_BIGDATA = 0x01 };
enum { PAGE_HEADER = 16, NODE_HEADER = 8, MAX_DEPTH = 32 };

typedef struct {
    const unsigned char *base;
    uint64_t length, psize;
} Map;

static uint16_t u16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint64_t u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* memcmp, then the shorter first: LMDB's default key order (mdb_cmp_memn). */
static int key_cmp(const unsigned char *a, size_t alen, const unsigned char *b, size_t blen) {
    int c = memcmp(a, b, alen < blen ? alen : blen);
    return c ? c : (alen < blen ? -1 : alen > blen);
}

/* Node i of a page: its address and key, or NULL when it does not fit the page. */
static const unsigned char *node_at(const Map *m, const unsigned char *page, unsigned i, unsigned nkeys,
                                    const unsigned char **key, size_t *ksize) {
    if (i >= nkeys) return NULL;
    uint16_t at = u16(page + PAGE_HEADER + 2 * i);
    if (at < PAGE_HEADER + 2 * nkeys || (uint64_t)at + NODE_HEADER > m->psize) return NULL;
    const unsigned char *node = page + at;
    *ksize = u16(node + 6);
    if ((uint64_t)at + NODE_HEADER + *ksize > m->psize) return NULL;
    *key = node + NODE_HEADER;
    return node;
}

/* The value of leaf node `node` on `page`, whose key ends at `kend`: 1 (value address and
 * size set), or -1 when it (or its overflow page) does not fit the mapping. */
static int leaf_value(const Map *m, const unsigned char *page, const unsigned char *node, const unsigned char *kend,
                      const unsigned char **value, uint64_t *vsize) {
    uint64_t size = (uint64_t)u16(node) | (uint64_t)u16(node + 2) << 16;
    uint64_t at = (uint64_t)(kend - m->base);
    if (u16(node + 4) & F_BIGDATA) {
        if (at + 8 > (uint64_t)(page - m->base) + m->psize) return -1;
        uint64_t opg = u64(m->base + at);
        if (opg < 2 || opg >= m->length / m->psize) return -1;
        const unsigned char *over = m->base + opg * m->psize;
        uint32_t pages;
        memcpy(&pages, over + 12, 4);
        if (u64(over) != opg || !(u16(over + 10) & P_OVERFLOW) ||
            (uint64_t)pages * m->psize < size + PAGE_HEADER ||
            opg * m->psize + PAGE_HEADER + size > m->length) return -1;
        *value = over + PAGE_HEADER;
    } else {
        if (at + size > (uint64_t)(page - m->base) + m->psize) return -1;
        *value = m->base + at;
    }
    *vsize = size;
    return 1;
}

/* 1 found (value address and size set; `*leaf` and `*slot` say where its node is), 0 absent,
 * -1 a page that does not parse. */
static int search(const Map *m, uint64_t root, const unsigned char *key, size_t klen,
                  const unsigned char **value, uint64_t *vsize, const unsigned char **leaf, unsigned *slot) {
    uint64_t pgno = root;
    for (int depth = 0; depth < MAX_DEPTH; depth++) {
        if (pgno < 2 || pgno >= m->length / m->psize) return -1;
        const unsigned char *page = m->base + pgno * m->psize;
        uint16_t flags = u16(page + 10), lower = u16(page + 12), upper = u16(page + 14);
        if (u64(page) != pgno || lower < PAGE_HEADER || lower > upper || upper > m->psize) return -1;
        unsigned nkeys = (unsigned)(lower - PAGE_HEADER) / 2;
        const unsigned char *k;
        size_t ks;
        if ((flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_LEAF2 | P_SUBP)) == P_BRANCH) {
            /* The largest node whose key is <= key; node 0's key stands for minus infinity. */
            if (nkeys == 0) return -1;
            unsigned lo = 1, hi = nkeys, pick = 0;
            while (lo < hi) {
                unsigned mid = lo + (hi - lo) / 2;
                if (node_at(m, page, mid, nkeys, &k, &ks) == NULL) return -1;
                if (key_cmp(k, ks, key, klen) <= 0) pick = mid, lo = mid + 1;
                else hi = mid;
            }
            const unsigned char *node = node_at(m, page, pick, nkeys, &k, &ks);
            if (node == NULL) return -1;
            pgno = (uint64_t)u16(node) | (uint64_t)u16(node + 2) << 16 | (uint64_t)u16(node + 4) << 32;
            continue;
        }
        if ((flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_LEAF2 | P_SUBP)) != P_LEAF) return -1;
        unsigned lo = 0, hi = nkeys;
        while (lo < hi) {
            unsigned mid = lo + (hi - lo) / 2;
            const unsigned char *node = node_at(m, page, mid, nkeys, &k, &ks);
            if (node == NULL) return -1;
            int c = key_cmp(k, ks, key, klen);
            if (c < 0) { lo = mid + 1; continue; }
            if (c > 0) { hi = mid; continue; }
            *leaf = page;
            *slot = mid;
            return leaf_value(m, page, node, k + ks, value, vsize);
        }
        return 0;
    }
    return -1;
}

/* MDB_meta after a meta page's 16-byte header ("<IIQQ48s48sQQ", kvstore/native/blockcopy.py's _MDB_META):
 * the magic, the main database's record (its flags at +4, its root at +40) and the last page
 * and transaction id of the snapshot it describes. */
enum { MDB_META_MAGIC = 0, MDB_META_MAIN_DB = 72, MDB_META_LAST_PG = 120, MDB_META_TXNID = 128, MDB_META_END = 136,
       DB_FLAGS = 4, DB_ROOT = 40, DB_BYTES = 48, F_SUBDATA = 0x02 };
#define MDB_MAGIC 0xBEEFC0DEu
#define P_INVALID (~(uint64_t)0)

/*
 * The root page of the plain named database `name` in snapshot `txn_id`, and that snapshot's
 * valid length of the mapping ((last page + 1) * psize, at most m->length), read from the meta
 * page of that snapshot (kvstore.native.blockcopy.named_root's rule): 1 found, 0 when it cannot be told
 * for sure (neither meta page is that snapshot's any more, the meta page changed while it was
 * read, or the database is not plain). `m->length` must cover the two meta pages.
 */
static inline int snapshot_root(const Map *m, uint64_t txn_id, const unsigned char *name, size_t nlen,
                         uint64_t *root, uint64_t *length) {
    if (m->length < 2 * m->psize || m->psize < PAGE_HEADER + MDB_META_END) return 0;
    for (int i = 0; i < 2; i++) {
        const unsigned char *meta = m->base + (uint64_t)i * m->psize + PAGE_HEADER;
        uint32_t magic;
        memcpy(&magic, meta + MDB_META_MAGIC, 4);
        if (magic != MDB_MAGIC || u64(meta + MDB_META_TXNID) != txn_id) continue;
        uint64_t last = u64(meta + MDB_META_LAST_PG), main_root = u64(meta + MDB_META_MAIN_DB + DB_ROOT);
        Map snap = *m;
        if (last < m->length / m->psize) snap.length = (last + 1) * m->psize;
        const unsigned char *value = NULL, *leaf = NULL, *k;
        uint64_t vsize = 0;
        unsigned slot = 0;
        size_t ks;
        int r = main_root == P_INVALID ? 0 : search(&snap, main_root, name, nlen, &value, &vsize, &leaf, &slot);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (u64(meta + MDB_META_TXNID) != txn_id || r != 1 || vsize != DB_BYTES) return 0;
        unsigned nkeys = (unsigned)(u16(leaf + 12) - PAGE_HEADER) / 2;
        const unsigned char *node = node_at(&snap, leaf, slot, nkeys, &k, &ks);
        if (node == NULL || !(u16(node + 4) & F_SUBDATA) || u16(value + DB_FLAGS) != 0) return 0;
        *root = u64(value + DB_ROOT);
        *length = snap.length;
        return *root != P_INVALID;
    }
    return 0;
}

#endif
