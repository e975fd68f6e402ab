/*
 * kvstore.native._ring: the request ring's server work in native code (gateway/transfer_ring.py drives it).
 *
 * A ring request of a few blocks spent ~120 us in the Python server thread (the request's
 * parse and checks, py-lmdb gets, the copy, the answer), against ~16 us of checksum and copy.
 * Here, with the GIL released:
 *   wait   spins briefly on the ring's state word, then sleeps on its futex (_ring_words.h);
 *   take   readied with a txn, the region table and a plan while no request is there: spins for
 *          the next request and runs `serve`'s first half on it (the thread's usual step);
 *   serve  copies the request out of the ring once, parses it strictly, checks it as Submit
 *          does (the session's region, the block length, whole hashes, every span inside its
 *          region), finds the records in the read txn's snapshot (kvstore/native/_lmdb_search.h),
 *          verifies each block against its checksum and then copies it, and writes the
 *          answer (the caller counts the read, then `publish`es it: the client wakes); or,
 *          given a plan, stops once every block is verified, and the caller counts the read
 *          and calls `finish`, which copies, writes the answer and wakes the client;
 *   ask    the client's side (_ring_ask.h): writes a request (or, `ask_slots`, a template's
 *          head, a list of hashes and its tail) and its header words, wakes the server unless it
 *          spins, and spins for the answer, telling one that is exactly the expected all-DONE one.
 * `serve` answers only the plain case: one group, every descriptor good, every block found,
 * intact and not due a retention refresh. Anything else (a request the strict parser does not
 * take, a bad descriptor, a miss, a corrupt block, a block due a refresh, a page that does not
 * parse, a snapshot whose root cannot be told) is handed back with the request's bytes as
 * read, and the Python server answers it from those bytes: the ring's contents are read once.
 * A corrupt block is never copied (its checksum is checked before its copy).
 *
 * Layout and protocol: kvstore/transfer_ring.py. Built against the stable ABI (3.11+).
 */
#define _GNU_SOURCE /* sched_getcpu */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_lmdb_search.h"
#include "_ring_ask.h"
#include "_ring_wire.h"
#include "_ring_words.h"
#include "_xxh3.h"

/* kvstore.native.records.META_STRUCT, "<32sIIQdd". */
enum { META_BYTES = 64, META_SIZE = 36, META_CHECKSUM = 40, META_LAST_ACCESS = 56 };
/* What serve answers: the answer is written (publish it), or the request is handed back (with its bytes). */
enum { READY = 0, HANDED_BACK = 1, PLANNED = 2 };
/* What `take` answers besides those: no request came within its spin; a request whose header words or
 * lease the caller must judge (a length past the request area, a lease ended); a request the caller's
 * txn is too old for (a write committed since it began); a request of more than PLAN_MOST descriptors
 * (parsed, nothing read: the caller charges it, then `serve`s it). */
enum { IDLE = 3, CHECK = 4, STALE = 5, LARGE = 6 };
/* The most descriptors a request is planned for: a few blocks stay in cache between their check and
 * their copy; the 3.6 MB of 64 did not (their fetch took 610 us planned against 490 us checked and
 * copied block by block), so larger requests are copied in `serve` (READY) even given a plan. */
enum { PLAN_MOST = 16 };
/* A plan's entry: where one verified block goes, and where it is read from. */
typedef struct {
    uint64_t dest, src;
} Step;
_Static_assert(32 + MAX_DESCRIPTORS < ANSWER_BYTES, "a plain answer always fits the answer area");


/* One descriptor's block, found in the snapshot. */
typedef struct {
    const unsigned char *data;
    uint64_t checksum;
    char *dest;
} Block;

/* Find the n blocks' records; 1 when every one is there, intact in size, and not due a refresh. */
static int find_all(const Map *m, uint64_t root, const Request *r, const unsigned char *prefix, size_t plen,
                    uint64_t block_bytes, double due_before, Block *blocks, unsigned char *key) {
    size_t klen = plen + HASH_BYTES + 1;
    memcpy(key, prefix, plen);
    for (uint32_t i = 0; i < r->n; i++) {
        const unsigned char *value, *meta, *leaf, *k;
        uint64_t vsize, msize;
        unsigned slot;
        size_t ks;
        memcpy(key + plen, r->hashes + (size_t)i * HASH_BYTES, HASH_BYTES);
        key[klen - 1] = 'd';
        if (search(m, root, key, klen, &value, &vsize, &leaf, &slot) != 1) return 0;
        key[klen - 1] = 'm'; /* most often the data's neighbour in the same leaf (see resolve) */
        unsigned nkeys = (unsigned)(u16(leaf + 12) - PAGE_HEADER) / 2;
        const unsigned char *node = node_at(m, leaf, slot + 1, nkeys, &k, &ks);
        int found = node != NULL && key_cmp(k, ks, key, klen) == 0
                        ? leaf_value(m, leaf, node, k + ks, &meta, &msize)
                        : search(m, root, key, klen, &meta, &msize, &leaf, &slot);
        if (found != 1 || msize != META_BYTES || vsize != block_bytes) return 0;
        uint32_t size;
        double last_access;
        memcpy(&size, meta + META_SIZE, 4);
        memcpy(&last_access, meta + META_LAST_ACCESS, 8);
        if (size != vsize || !(last_access >= due_before)) return 0; /* NaN is due, as in Python */
        blocks[i].data = value;
        memcpy(&blocks[i].checksum, meta + META_CHECKSUM, 8);
    }
    return 1;
}

/* The plain case, from the request's parse to the copy; 1 answered (every block copied), 0 not. */
static int run(const Request *r, const uint64_t *regions, Py_ssize_t nregions, uint64_t block_bytes,
               uint32_t limit, const unsigned char *prefix, size_t plen, const Map *map, uint64_t txn_id,
               double due_before, Block *blocks, unsigned char *key, int copy) {
    if (r->n == 0 || r->n > limit || r->length_bytes != block_bytes) return 0;
    const uint64_t *region = NULL;
    for (Py_ssize_t i = 0; i < nregions; i++)
        if (regions[3 * i] == r->region_id) region = regions + 3 * i;
    if (region == NULL || region[2] < block_bytes) return 0;
    for (uint32_t i = 0; i < r->n; i++) {
        uint64_t offset = r->offsets[i];
        if (offset > region[2] - block_bytes) return 0;
        blocks[i].dest = (char *)(uintptr_t)(region[1] + offset);
    }
    uint64_t root, length;
    Map snap = *map;
    if (!snapshot_root(map, txn_id, (const unsigned char *)"records", 7, &root, &length)) return 0;
    snap.length = length;
    if (!find_all(&snap, root, r, prefix, plen, block_bytes, due_before, blocks, key)) return 0;
    if (!copy) { /* planned: every block checked now, copied by `finish` once the caller counted the read */
        for (uint32_t i = 0; i < r->n; i++)
            if (xxh3(blocks[i].data, block_bytes) != blocks[i].checksum) return 0;
        return 1;
    }
    for (uint32_t i = 0; i < r->n; i++) {
        /* Checked before its copy (the block is in cache by then): a corrupt block never lands. */
        if (xxh3(blocks[i].data, block_bytes) != blocks[i].checksum) return 0;
        memcpy(blocks[i].dest, blocks[i].data, block_bytes);
    }
    return 1;
}

/* The per-request arguments `serve` and `take` share, parsed from the Python call. */
typedef struct {
    unsigned long long ring, map_base, map_length, psize, txn_id, block_bytes;
    unsigned int limit;
    Py_buffer regions, prefix, plan;
    double due_before;
} Served;

static int served_ok(const Served *a, unsigned length) {
    if (a->ring == 0 || a->ring % 64 || a->map_base == 0 || length > REQUEST_BYTES || a->regions.len % 24 ||
        a->psize < 512 || a->psize > (1u << 16) || a->block_bytes == 0 || a->limit == 0 ||
        a->limit > MAX_DESCRIPTORS || a->prefix.len > 256 ||
        (a->plan.obj != NULL && (size_t)a->plan.len < sizeof(Step) * a->limit)) {
        PyErr_SetString(PyExc_ValueError, "serve: a bad ring, map, length, region table, limit or prefix");
        return 0;
    }
    return 1;
}

static void served_release(Served *a) {
    PyBuffer_Release(&a->regions);
    PyBuffer_Release(&a->prefix);
    if (a->plan.obj != NULL) PyBuffer_Release(&a->plan);
}

/* Scratch for one request: the ring thread's own (one request at a time per thread), kept between its
 * requests (a 60 KB malloc and free per request cost more than the request's parse). */
typedef struct {
    unsigned char *copy, *key;
    Block *blocks;
} Scratch;

static __thread unsigned char scratch_copy[REQUEST_BYTES];
static __thread unsigned char scratch_key[256 + HASH_BYTES + 1];
static __thread Block scratch_blocks[MAX_DESCRIPTORS];

static int scratch_get(Scratch *w, const Served *a) {
    (void)a; /* served_ok bounds the prefix (256) and the limit (MAX_DESCRIPTORS) */
    w->copy = scratch_copy;
    w->key = scratch_key;
    w->blocks = scratch_blocks;
    return 1;
}

static void scratch_free(Scratch *w) { (void)w; }

/* Serve request `seq` (`length` bytes, within the request area) without the GIL: READY (answered,
 * not published), PLANNED (the plan filled), LARGE (more than PLAN_MOST descriptors and `large`
 * not to be served: nothing read), or HANDED_BACK (`w->copy` holds the request as read); `*n` the
 * descriptors when answered or planned. */
static int serve_request(const Served *a, Scratch *w, uint32_t seq, uint32_t length, int large, uint32_t *n) {
    unsigned char *base = (unsigned char *)(uintptr_t)a->ring;
    Header *header = (Header *)(base + HEADER_AT);
    Map map = {(const unsigned char *)(uintptr_t)a->map_base, a->map_length, a->psize};
    int planned = a->plan.obj != NULL;
    Request r;
    memcpy(w->copy, base + REQUEST_AT, length); /* once: the client cannot change it under the checks */
    if (!parse_request(w->copy, length, a->limit, &r)) return HANDED_BACK;
    if (r.n > PLAN_MOST) {
        if (!large) return LARGE;
        planned = 0;
    }
    if (!run(&r, a->regions.buf, a->regions.len / 24, a->block_bytes, a->limit, a->prefix.buf,
             (size_t)a->prefix.len, &map, a->txn_id, a->due_before, w->blocks, w->key, !planned))
        return HANDED_BACK;
    *n = r.n;
    if (planned) {
        Step *steps = a->plan.buf;
        for (uint32_t i = 0; i < r.n; i++)
            steps[i] = (Step){(uint64_t)(uintptr_t)w->blocks[i].dest, (uint64_t)(uintptr_t)w->blocks[i].data};
        return PLANNED;
    }
    size_t len = write_state(base + ANSWER_AT, ANSWER_BYTES, r.n, (uint64_t)r.n * a->block_bytes);
    header->answer_seq = seq;
    header->code = 0;
    header->answer_length = (uint32_t)len;
    header->server_cpu = (uint32_t)(sched_getcpu() + 1);
    return READY;
}

/*
 * serve(ring, seq, length, regions, block_bytes, limit, prefix, map_base, map_length, psize,
 *       txn_id, due_before[, plan]) -> (READY | PLANNED, n) | (HANDED_BACK, request bytes)
 *
 * ring: the ring's address; seq, length: the header's words as the caller read them (length
 * checked against the request area); regions: the session's regions as uint64 triples
 * (region id, address, length); prefix: the tenant's key prefix; map_base, map_length, psize:
 * the tier's mapping of data.mdb; txn_id: the read txn the caller holds open for the call;
 * due_before: a block last accessed before this is due a refresh (handed back).
 */
static PyObject *serve(PyObject *self, PyObject *args) {
    Served a = {0};
    unsigned int seq, length;
    (void)self;
    if (!PyArg_ParseTuple(args, "KIIy*KIy*KKKKd|w*", &a.ring, &seq, &length, &a.regions, &a.block_bytes, &a.limit,
                          &a.prefix, &a.map_base, &a.map_length, &a.psize, &a.txn_id, &a.due_before, &a.plan))
        return NULL;
    PyObject *result = NULL;
    Scratch w = {0};
    if (served_ok(&a, length) && scratch_get(&w, &a)) {
        int kind;
        uint32_t n = 0;
        Py_BEGIN_ALLOW_THREADS
        kind = serve_request(&a, &w, seq, length, 1, &n);
        Py_END_ALLOW_THREADS
        result = kind == HANDED_BACK ? Py_BuildValue("(iy#)", kind, (const char *)w.copy, (Py_ssize_t)length)
                                     : Py_BuildValue("(iI)", kind, n);
    }
    scratch_free(&w);
    served_release(&a);
    return result;
}

/* Whether the snapshot of read txn `txn_id` is the newest committed one (no meta page names a later
 * txn): then a txn begun now would read the same, and reusing it answers as a new one would. */
static int snapshot_newest(const Map *m, uint64_t txn_id) {
    if (m->length < 2 * m->psize || m->psize < PAGE_HEADER + MDB_META_END) return 0;
    for (int i = 0; i < 2; i++) {
        const unsigned char *meta = m->base + (uint64_t)i * m->psize + PAGE_HEADER;
        uint32_t magic;
        memcpy(&magic, meta + MDB_META_MAGIC, 4);
        if (magic == MDB_MAGIC && __atomic_load_n((const uint64_t *)(meta + MDB_META_TXNID), __ATOMIC_ACQUIRE) > txn_id)
            return 0;
    }
    return 1;
}

/*
 * take(ring, expected, hot_s, spin_s, expires, regions, block_bytes, limit, prefix, map_base,
 *      map_length, psize, txn_id, due_before, plan) -> (kind, seq, length, value)
 *
 * The ring thread's wait and the first half of the request in one call, without the GIL: the
 * caller readied the request's txn, region table, plan and due_before while no request was there
 * (they are the same for every request until the session's regions change). Spins while the state
 * word holds `expected` (`hot_s` without yielding, unless the client last ran on this CPU, then
 * yielding until `spin_s`; never the futex); once it holds REQUEST, stores BUSY and reads the
 * header's seq and length once, then:
 *   (IDLE, 0, 0, state)               no request within the spin (the word's value now): sleep;
 *   (CHECK, seq, length, 0)           a length past the request area, or the lease past `expires`
 *                                     (CLOCK_MONOTONIC seconds, Python's time.monotonic): the caller
 *                                     answers as without `take`;
 *   (STALE, seq, length, 0)           a write was committed since the txn began: serve with a new one;
 *   (LARGE, seq, length, 0)           more than PLAN_MOST descriptors: charge it, then `serve` it;
 *   (PLANNED, seq, length, n)         every block found and verified (the plan filled): count, `finish`;
 *   (HANDED_BACK, seq, length, bytes) anything else, as read once from the ring.
 */
static PyObject *take(PyObject *self, PyObject *args) {
    Served a = {0};
    unsigned int expected;
    double hot_s, spin_s, expires;
    (void)self;
    if (!PyArg_ParseTuple(args, "KIdddy*KIy*KKKKdw*", &a.ring, &expected, &hot_s, &spin_s, &expires, &a.regions,
                          &a.block_bytes, &a.limit, &a.prefix, &a.map_base, &a.map_length, &a.psize, &a.txn_id,
                          &a.due_before, &a.plan))
        return NULL;
    PyObject *result = NULL;
    Scratch w = {0};
    if (!(served_ok(&a, 0) && hot_s >= 0 && spin_s >= 0 && expected != ST_REQUEST)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "take: non-negative times, a state but REQUEST");
        goto done;
    }
    if (!scratch_get(&w, &a)) goto done;
    unsigned char *base = (unsigned char *)(uintptr_t)a.ring;
    Header *header = (Header *)(base + HEADER_AT);
    Map map = {(const unsigned char *)(uintptr_t)a.map_base, a.map_length, a.psize};
    int kind = IDLE;
    uint32_t seq = 0, length = 0, n = 0, now;
    Py_BEGIN_ALLOW_THREADS
    if (__atomic_load_n(&header->client_cpu, __ATOMIC_RELAXED) == (uint32_t)(sched_getcpu() + 1))
        hot_s = 0; /* the client last ran on this CPU: a spin that does not yield would only keep it off */
    __atomic_store_n(&header->server_awake, 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* before the first look: a request after it needs no wake */
    double start = seconds(), t = start;
    while ((now = __atomic_load_n(&header->state, __ATOMIC_ACQUIRE)) == expected && t - start <= spin_s) {
        spin_turn(t - start, hot_s);
        t = seconds();
    }
    /* Awake no more on any return (the caller may sleep next): a request stored before this is seen here. */
    if (now == expected) now = going_to_sleep(&header->server_awake, &header->state);
    else __atomic_store_n(&header->server_awake, 0, __ATOMIC_RELAXED);
    if (now == ST_REQUEST) {
        __atomic_store_n(&header->state, ST_BUSY, __ATOMIC_RELAXED);
        seq = __atomic_load_n(&header->seq, __ATOMIC_RELAXED);
        length = __atomic_load_n(&header->length, __ATOMIC_RELAXED);
        if (length > REQUEST_BYTES || seconds() > expires) kind = CHECK;
        else if (!snapshot_newest(&map, a.txn_id)) kind = STALE;
        else kind = serve_request(&a, &w, seq, length, 0, &n);
    }
    Py_END_ALLOW_THREADS
    if (kind == HANDED_BACK)
        result = Py_BuildValue("(iIIy#)", kind, seq, length, (const char *)w.copy, (Py_ssize_t)length);
    else
        result = Py_BuildValue("(iIII)", kind, seq, length, kind == IDLE ? now : n);
done:
    scratch_free(&w);
    served_release(&a);
    return result;
}

/*
 * finish(ring, seq, plan, n, block_bytes): the rest of a request `serve` planned (every block
 * found and verified under the caller's read txn, still open): copies the n blocks, writes the
 * all-DONE answer and its header words, stores state = ANSWERED after them and wakes the client,
 * all without the GIL. The caller holds the ring's `busy` lock (the regions stay mapped) and
 * passes the plan `serve` just filled, untouched.
 */
static PyObject *finish(PyObject *self, PyObject *args) {
    unsigned long long ring, block_bytes;
    unsigned int seq, n;
    Py_buffer plan;
    (void)self;
    if (!PyArg_ParseTuple(args, "KIy*IK", &ring, &seq, &plan, &n, &block_bytes)) return NULL;
    if (ring == 0 || ring % 64 || n == 0 || n > MAX_DESCRIPTORS || (size_t)plan.len < sizeof(Step) * n ||
        block_bytes == 0 || (uint64_t)n * block_bytes > ((uint64_t)1 << 40)) {
        PyBuffer_Release(&plan);
        PyErr_SetString(PyExc_ValueError, "finish: a bad ring, plan or count");
        return NULL;
    }
    unsigned char *base = (unsigned char *)(uintptr_t)ring;
    Header *header = (Header *)(base + HEADER_AT);
    const Step *steps = plan.buf;
    Py_BEGIN_ALLOW_THREADS
    for (uint32_t i = 0; i < n; i++)
        memcpy((char *)(uintptr_t)steps[i].dest, (const char *)(uintptr_t)steps[i].src, block_bytes);
    size_t len = write_state(base + ANSWER_AT, ANSWER_BYTES, n, (uint64_t)n * block_bytes);
    header->answer_seq = seq;
    header->code = 0;
    header->answer_length = (uint32_t)len;
    header->server_cpu = (uint32_t)(sched_getcpu() + 1);
    store_and_wake(&header->state, ST_ANSWERED, &header->client_awake);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&plan);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"publish", publish, METH_VARARGS,
     "publish(address, value)\n\nStore value in the futex word at address and wake its waiters."},
    {"finish", finish, METH_VARARGS,
     "finish(ring, seq, plan, n, block_bytes)\n\n"
     "Copy a planned request's verified blocks, write its answer and publish it (see tiers.ring)."},
    {"ask", ask, METH_VARARGS,
     "ask(ring, request, seq, hot_s, spin_s, expected) -> int\n\n"
     "Write a request into the ring, wake the server and spin for its answer: 0 none yet, 1 there, "
     "2 there and equal to expected."},
    {"ask_slots", ask_slots, METH_VARARGS,
     "ask_slots(ring, head, hashes, tail, seq, hot_s, spin_s, expected) -> int\n\n"
     "ask of head + b''.join(hashes) + tail, written straight into the ring; -1 (nothing sent) unless hashes "
     "is a list of 32-byte bytes."},
    {"wait", wait, METH_VARARGS,
     "wait(address, expected, hot_s, spin_s, timeout_s, peer_cpu) -> int\n\n"
     "Spin, then sleep on the futex at address while it holds expected; its value after."},
    {"take", take, METH_VARARGS,
     "take(ring, expected, hot_s, spin_s, expires, regions, block_bytes, limit, prefix, map_base, map_length, "
     "psize, txn_id, due_before, plan) -> (kind, seq, length, value)\n\n"
     "Spin for the next request, then plan it as serve does, in one call (see tiers.ring)."},
    {"serve", serve, METH_VARARGS,
     "serve(ring, seq, length, regions, block_bytes, limit, prefix, map_base, map_length, psize, txn_id, "
     "due_before) -> (0, n) | (1, request)\n\n"
     "Copy and write the answer of one ring request natively, or hand its bytes back (see tiers.ring)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.native._ring", "The request ring's server work, without the GIL (see tiers.ring).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ring(void) {
    const char *kernel = xxh3_pick();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "HASH_KERNEL", kernel) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
