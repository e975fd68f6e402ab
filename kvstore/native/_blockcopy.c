/*
 * kvstore.native._blockcopy: the verify-and-copy loop of `kvstore.native.blockcopy`, without the GIL (and the SWA
 * paths' checksums: kvstore/native/_swa_digest.h).
 *
 * The transfer path copies hundreds of megabytes per request from LMDB's map
 * into client regions, checking each block's xxh3 checksum first. In Python
 * both the checksum and the copy hold the GIL, so one thread does all of it.
 * Here the buffers are taken with the GIL held, then the whole batch is
 * checked and copied with it released, so several executor threads copy at
 * once while another does its LMDB lookups.
 *
 * Built against the stable ABI (3.11+): one binary serves every later Python.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_xxh3.h"
#include "_lmdb_search.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Result codes: the values of tiers.lmdb_tier.ReadStatus, plus two of our own. */
enum { NOT_REACHED = 0, FOUND = 1, MISSING = 2, CORRUPT = 3, WRONG_SIZE = 4 };

/* kvstore.native.records.META_STRUCT, "<32sIIQdd": the offsets of the fields read here.
 * The fields are little-endian and read in place, so a big-endian build stops
 * here (the install goes on, and the Python loop stands in). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvstore.native._blockcopy reads little-endian records in place"
#endif
enum { META_BYTES = 64, META_SIZE = 36, META_CHECKSUM = 40, META_LAST_ACCESS = 56 };

typedef struct {
    Py_buffer meta, data, dest;
    char has_meta, has_data, has_dest;
} Item;

static void release(Item *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i].has_meta) PyBuffer_Release(&items[i].meta);
        if (items[i].has_data) PyBuffer_Release(&items[i].data);
        if (items[i].has_dest) PyBuffer_Release(&items[i].dest);
    }
    PyMem_Free(items);
}

/* Take item i's buffers; -1 with an exception set if one is not a buffer. */
static int acquire(Item *item, PyObject *meta, PyObject *data, PyObject *dest) {
    if (dest == Py_None) return 0;
    if (PyObject_GetBuffer(dest, &item->dest, PyBUF_WRITABLE) < 0) return -1;
    item->has_dest = 1;
    if (meta != Py_None) {
        if (PyObject_GetBuffer(meta, &item->meta, PyBUF_SIMPLE) < 0) return -1;
        item->has_meta = 1;
    }
    if (data != Py_None) {
        if (PyObject_GetBuffer(data, &item->data, PyBUF_SIMPLE) < 0) return -1;
        item->has_data = 1;
    }
    return 0;
}

/*
 * memcpy with non-temporal stores where the CPU has them. A block is copied
 * once into memory this process does not read again (the client or the GPU
 * does), so bringing the destination into cache first (as memcpy's stores do
 * at this size) only adds a read of it: a third more memory traffic.
 */
static void stream_copy(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

#include "_swa_digest.h" /* after stream_copy, which its stream_into uses */

/* Check and copy one block; its result code. Runs without the GIL. */
static char copy_one(const Item *item, double due_before, char *due) {
    if (!item->has_meta) return MISSING;
    if (item->meta.len != META_BYTES || !item->has_data) return CORRUPT;
    const char *meta = (const char *)item->meta.buf;
    uint32_t size;
    uint64_t checksum;
    double last_access;
    memcpy(&size, meta + META_SIZE, sizeof size);
    memcpy(&checksum, meta + META_CHECKSUM, sizeof checksum);
    memcpy(&last_access, meta + META_LAST_ACCESS, sizeof last_access);
    if ((uint64_t)item->data.len != size) return CORRUPT;
    if (xxh3(item->data.buf, (size_t)item->data.len) != checksum) return CORRUPT;
    /* Checked before the copy (the block is in cache by now), so a corrupt block never reaches dest. */
    if (item->dest.len != item->data.len) return WRONG_SIZE;
    stream_copy(item->dest.buf, item->data.buf, (size_t)item->data.len);
    *due = last_access < due_before;
    return FOUND;
}

static PyObject *verify_copy(PyObject *self, PyObject *args) {
    PyObject *metas, *datas, *dests;
    double due_before;
    int stop_at_missing;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!dp", &PyList_Type, &metas, &PyList_Type, &datas, &PyList_Type, &dests,
                          &due_before, &stop_at_missing))
        return NULL;
    Py_ssize_t n = PyList_Size(dests);
    if (n < 0) return NULL;
    if (PyList_Size(metas) != n || PyList_Size(datas) != n) {
        PyErr_SetString(PyExc_ValueError, "metas, datas and dests must be lists of the same length");
        return NULL;
    }
    Item *items = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Item));
    PyObject *codes = PyBytes_FromStringAndSize(NULL, n);
    char *due = PyMem_Calloc(n ? (size_t)n : 1, 1);
    if (items == NULL || codes == NULL || due == NULL) {
        PyMem_Free(items);
        Py_XDECREF(codes);
        PyMem_Free(due);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (acquire(&items[i], PyList_GetItem(metas, i), PyList_GetItem(datas, i), PyList_GetItem(dests, i)) < 0) {
            release(items, i + 1);
            Py_DECREF(codes);
            PyMem_Free(due);
            return NULL;
        }
    }
    char *out = PyBytes_AsString(codes);
    memset(out, NOT_REACHED, (size_t)n);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!items[i].has_dest) continue;
        out[i] = copy_one(&items[i], due_before, &due[i]);
        if (out[i] == WRONG_SIZE || (stop_at_missing && out[i] != FOUND)) break;
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed stores are visible before the caller reports the blocks done */
#endif
    Py_END_ALLOW_THREADS
    release(items, n);
    PyObject *due_list = PyList_New(0);
    for (Py_ssize_t i = 0; due_list != NULL && i < n; i++) {
        if (!due[i]) continue;
        PyObject *index = PyLong_FromSsize_t(i);
        if (index == NULL || PyList_Append(due_list, index) < 0) Py_CLEAR(due_list);
        Py_XDECREF(index);
    }
    PyMem_Free(due);
    if (due_list == NULL) {
        Py_DECREF(codes);
        return NULL;
    }
    PyObject *result = Py_BuildValue("(NN)", codes, due_list);
    return result;
}

/*
 * verify(datas, checksums) -> bytes: 1 where xxh3-64 of datas[i] equals checksums[i], else 0
 * (0 also for a None data). The same-host reader (kvstore.client.colocated) checks the blocks
 * it reads straight from its own mapping of the store this way, the hashing done without the
 * GIL so several threads (each given a slice of the batch) hash at once.
 */
static PyObject *verify(PyObject *self, PyObject *args) {
    PyObject *datas, *checksums;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &datas, &PyList_Type, &checksums)) return NULL;
    Py_ssize_t n = PyList_Size(datas);
    if (n < 0) return NULL;
    if (PyList_Size(checksums) != n) {
        PyErr_SetString(PyExc_ValueError, "datas and checksums must be lists of the same length");
        return NULL;
    }
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    uint64_t *expected = PyMem_Calloc(n ? (size_t)n : 1, sizeof(uint64_t));
    char *has = PyMem_Calloc(n ? (size_t)n : 1, 1);
    PyObject *result = PyBytes_FromStringAndSize(NULL, n);
    Py_ssize_t taken = 0;
    if (views == NULL || expected == NULL || has == NULL || result == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (; taken < n; taken++) {
        PyObject *data = PyList_GetItem(datas, taken);
        expected[taken] = PyLong_AsUnsignedLongLong(PyList_GetItem(checksums, taken));
        if (expected[taken] == (uint64_t)-1 && PyErr_Occurred()) goto fail;
        if (data == Py_None) continue;
        if (PyObject_GetBuffer(data, &views[taken], PyBUF_SIMPLE) < 0) goto fail;
        has[taken] = 1;
    }
    char *out = PyBytes_AsString(result);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = has[i] && xxh3(views[i].buf, (size_t)views[i].len) == expected[i];
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (has[i]) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(expected);
    PyMem_Free(has);
    return result;
fail:
    for (Py_ssize_t i = 0; views != NULL && has != NULL && i < taken; i++)
        if (has[i]) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(expected);
    PyMem_Free(has);
    Py_XDECREF(result);
    return NULL;
}

/*
 * digests(datas) -> list[int]: the xxh3-64 of each buffer in the list, taken without the GIL.
 * A Put's blocks are checksummed this way on the reader's thread, before the write transaction
 * (tiers/puts.py), in one call rather than a Python call per block.
 */
static PyObject *digests(PyObject *self, PyObject *args) {
    PyObject *datas;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &datas)) return NULL;
    Py_ssize_t n = PyList_Size(datas);
    if (n < 0) return NULL;
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    uint64_t *sums = PyMem_Calloc(n ? (size_t)n : 1, sizeof(uint64_t));
    PyObject *result = NULL;
    Py_ssize_t taken = 0;
    if (views == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; taken < n; taken++)
        if (PyObject_GetBuffer(PyList_GetItem(datas, taken), &views[taken], PyBUF_SIMPLE) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) sums[i] = xxh3(views[i].buf, (size_t)views[i].len);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(sums[i]);
        if (value == NULL) Py_CLEAR(result);
        else if (PyList_SetItem(result, i, value) < 0) Py_CLEAR(result);
    }
done:
    for (Py_ssize_t i = 0; views != NULL && i < taken; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(sums);
    return result;
}

/*
 * addresses(buffers) -> list[int]: the address of each buffer's first byte (0 for None). The
 * same-host reader turns LMDB's views of its mapping into offsets from the mapping's base this
 * way: numpy takes microseconds per view, 15,625 of them a restore of 1M tokens.
 */
static PyObject *addresses(PyObject *self, PyObject *args) {
    PyObject *buffers;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &buffers)) return NULL;
    Py_ssize_t n = PyList_Size(buffers);
    if (n < 0) return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *item = PyList_GetItem(buffers, i);
        uintptr_t address = 0;
        if (item != Py_None) {
            Py_buffer view;
            if (PyObject_GetBuffer(item, &view, PyBUF_SIMPLE) < 0) {
                Py_CLEAR(out);
                break;
            }
            address = (uintptr_t)view.buf;
            PyBuffer_Release(&view); /* the caller keeps the object (and so the memory) alive */
        }
        PyObject *value = PyLong_FromSize_t((size_t)address);
        if (value == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SetItem(out, i, value);
    }
    return out;
}

/*
 * resolve(base, length, psize, root, prefix, hashes)
 *     -> (found, damaged, data_offsets, data_sizes, meta_offsets, checksums)
 *
 * The same-host reader's record lookups, natively: for each hash in order, find the records
 * prefix + hash + "d" (data) and prefix + hash + "m" (meta, most often the data's neighbour in
 * the same leaf, so one descent finds both) in the LMDB B-tree rooted at page
 * `root` of a read-only mapping of data.mdb at address `base` (`length` bytes valid), the way
 * mdb.c searches (tiers/lmdb_pages.py describes the page layout). It stops at the first hash
 * whose records are not both there, or (`damaged` 1) whose meta record is not a meta
 * record's size or names another size than its data's. The offsets (from `base`) and sizes
 * come back as int64 arrays (bytes), the stored checksums as a uint64 array. py-lmdb takes ~1.3 us a get from Python; here a lookup is a few hundred
 * nanoseconds, without the GIL (kvstore.native.blockcopy.resolve_many runs slices of a long list on
 * several threads at once). The caller holds a read txn of the snapshot `root` belongs to,
 * so LMDB reuses none of these pages meanwhile. Every page and node is bounds-checked; a page
 * that does not parse raises ValueError (the caller then falls back to py-lmdb's gets).
 */

static PyObject *resolve(PyObject *self, PyObject *args) {
    unsigned long long base, length, psize, root;
    Py_buffer prefix;
    PyObject *hashes;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKy*O!", &base, &length, &psize, &root, &prefix, &PyList_Type, &hashes))
        return NULL;
    Py_ssize_t n = PyList_Size(hashes), hlen = 0;
    unsigned char *keys = NULL;
    PyObject *offs = NULL, *sizes = NULL, *metas = NULL, *sums = NULL;
    if (psize < 512 || psize > (1u << 16) || base == 0) {
        PyErr_SetString(PyExc_ValueError, "resolve: a bad map or page size");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GetItem(hashes, i);
        if (!PyBytes_Check(h) || (i && PyBytes_Size(h) != hlen)) {
            PyErr_SetString(PyExc_ValueError, "resolve: hashes must be bytes of one length");
            goto fail;
        }
        hlen = PyBytes_Size(h);
    }
    size_t klen = (size_t)prefix.len + (size_t)hlen + 1;
    keys = PyMem_Malloc(n ? (size_t)n * klen : 1);
    offs = PyBytes_FromStringAndSize(NULL, n * 8);
    sizes = PyBytes_FromStringAndSize(NULL, n * 8);
    metas = PyBytes_FromStringAndSize(NULL, n * 8);
    sums = PyBytes_FromStringAndSize(NULL, n * 8);
    if (keys == NULL || offs == NULL || sizes == NULL || metas == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(keys + i * klen, prefix.buf, (size_t)prefix.len);
        memcpy(keys + i * klen + prefix.len, PyBytes_AsString(PyList_GetItem(hashes, i)), (size_t)hlen);
    }
    Map m = {(const unsigned char *)(uintptr_t)base, length, psize};
    int64_t *out_off = (int64_t *)PyBytes_AsString(offs), *out_size = (int64_t *)PyBytes_AsString(sizes);
    int64_t *out_meta = (int64_t *)PyBytes_AsString(metas);
    uint64_t *out_sum = (uint64_t *)PyBytes_AsString(sums);
    Py_ssize_t found = 0;
    int bad = 0, damaged = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; found < n; found++) {
        unsigned char *key = keys + found * klen;
        const unsigned char *value, *meta;
        uint64_t vsize, msize;
        const unsigned char *leaf, *k;
        unsigned slot;
        size_t ks;
        key[klen - 1] = 'd';
        int r = search(&m, root, key, klen, &value, &vsize, &leaf, &slot);
        if (r == 1) {
            /* The meta record's key sorts right after the data's ("d" < "m", no tag between):
             * most often the next node of the same leaf, which spares a second descent. */
            key[klen - 1] = 'm';
            unsigned nkeys = (unsigned)(u16(leaf + 12) - PAGE_HEADER) / 2;
            const unsigned char *node = node_at(&m, leaf, slot + 1, nkeys, &k, &ks);
            if (node != NULL && key_cmp(k, ks, key, klen) == 0)
                r = leaf_value(&m, leaf, node, k + ks, &meta, &msize);
            else
                r = search(&m, root, key, klen, &meta, &msize, &leaf, &slot);
        }
        if (r < 0) bad = 1;
        if (r != 1) break;
        uint32_t stored;
        if (msize == META_BYTES) memcpy(&stored, meta + META_SIZE, 4);
        if (msize != META_BYTES || stored != vsize) {
            damaged = 1;
            break;
        }
        out_off[found] = (int64_t)(value - m.base);
        out_size[found] = (int64_t)vsize;
        out_meta[found] = (int64_t)(meta - m.base);
        memcpy(&out_sum[found], meta + META_CHECKSUM, 8);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(keys);
    keys = NULL;
    if (bad) {
        PyErr_Format(PyExc_ValueError, "resolve: a page on the way to record %zd does not parse", found);
        goto fail;
    }
    PyBuffer_Release(&prefix);
    return Py_BuildValue("(niNNNN)", found, damaged, offs, sizes, metas, sums);
fail:
    PyBuffer_Release(&prefix);
    PyMem_Free(keys);
    Py_XDECREF(offs);
    Py_XDECREF(sizes);
    Py_XDECREF(metas);
    Py_XDECREF(sums);
    return NULL;
}

/*
 * verify_spans(base, length, offsets, sizes, checksums) -> bytes: `verify` for blocks given as
 * int64 offsets and sizes from the address `base` (a mapping `length` bytes long) with uint64
 * checksums, all as buffers: the same-host reader checks a natively resolved read this way
 * without a Python object per block. A span outside the mapping is 0 (not intact).
 */
static PyObject *verify_spans(PyObject *self, PyObject *args) {
    unsigned long long base, length;
    Py_buffer offs, sizes, sums;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKy*y*y*", &base, &length, &offs, &sizes, &sums)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = offs.len / 8;
    if (base == 0 || offs.len % 8 || sizes.len != offs.len || sums.len != offs.len) {
        PyErr_SetString(PyExc_ValueError, "verify_spans: offsets, sizes and checksums must be 8-byte arrays "
                                          "of one length, and base an address");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, n);
    if (result == NULL) goto done;
    char *out = PyBytes_AsString(result);
    const int64_t *o = offs.buf, *z = sizes.buf;
    const uint64_t *c = sums.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = o[i] >= 0 && z[i] >= 0 && (uint64_t)o[i] + (uint64_t)z[i] <= length;
        out[i] = ok && xxh3((const void *)(uintptr_t)(base + (uint64_t)o[i]), (size_t)z[i]) == c[i];
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&offs);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&sums);
    return result;
}

/*
 * blank_bytes(n) -> (bytes, memoryview): a new bytes object of n bytes, not yet filled, and a
 * writable view of its bytes. A gRPC reply must be bytes; writing the reply's blocks straight
 * into it saves the copy from a bytearray. The caller fills it through the view before the bytes
 * is hashed or shared, keeps the bytes alive while the view is used (the view does not hold it),
 * and releases the view before handing the bytes on. n >= 2: CPython shares its 0- and 1-byte
 * objects, which must never be written.
 */
static PyObject *blank_bytes(PyObject *self, PyObject *args) {
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "n", &n)) return NULL;
    if (n < 2) {
        PyErr_SetString(PyExc_ValueError, "blank_bytes: n must be at least 2");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) return NULL;
    PyObject *view = PyMemoryView_FromMemory(PyBytes_AsString(out), n, PyBUF_WRITE);
    if (view == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    PyObject *pair = PyTuple_Pack(2, out, view);
    Py_DECREF(out);
    Py_DECREF(view);
    return pair;
}

static PyMethodDef methods[] = {
    SWA_DIGEST_METHODS
    {"blank_bytes", blank_bytes, METH_VARARGS,
     "blank_bytes(n) -> (bytes, memoryview)\n\n"
     "See kvstore.native.blockcopy.blank_bytes: a new bytes object to fill through the view, then hand on."},
    {"verify_spans", verify_spans, METH_VARARGS,
     "verify_spans(base, length, offsets, sizes, checksums) -> bytes\n\n"
     "See kvstore.native.blockcopy.verify_spans: checksums of blocks in a mapping, without the GIL."},
    {"resolve", resolve, METH_VARARGS,
     "resolve(base, length, psize, root, prefix, hashes) -> (found, damaged, offsets, sizes, metas, sums)\n\n"
     "See kvstore.native.blockcopy.resolve: B-tree lookups of a read's records in a mapping of data.mdb."},
    {"addresses", addresses, METH_VARARGS,
     "addresses(buffers) -> list[int]\n\n"
     "See kvstore.native.blockcopy.addresses; this is its native form."},
    {"digests", digests, METH_VARARGS,
     "digests(datas) -> list[int]\n\n"
     "See kvstore.native.blockcopy.digests: xxh3-64 of each buffer, without the GIL."},
    {"verify", verify, METH_VARARGS,
     "verify(datas, checksums) -> bytes\n\n"
     "See kvstore.native.blockcopy.verify; this is its native form, run without the GIL."},
    {"verify_copy", verify_copy, METH_VARARGS,
     "verify_copy(metas, datas, dests, due_before, stop_at_missing) -> (codes, due)\n\n"
     "See kvstore.native.blockcopy.verify_copy; this is its native form, run without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.native._blockcopy", "Native verify-and-copy loop of kvstore.native.blockcopy.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__blockcopy(void) {
    const char *kernel = xxh3_pick();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddStringConstant(m, "HASH_KERNEL", kernel) < 0 || add_hasher(m) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
