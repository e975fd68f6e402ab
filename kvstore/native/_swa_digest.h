/*
 * The SWA paths' checksums and arena copy, without the GIL (included by kvstore/native/_blockcopy.c after
 * its stream_copy; Python side:
 * kvstore/native/swa_digest.py).
 *
 * An SWA record's header holds the xxh3-64 of its snapshot (kvstore.swa_snapshot.checksum).
 * python-xxhash computes it with its SSE2 kernel; these use the widest kernel this CPU has
 * (kvstore/native/_xxh3.h) and release the GIL for the whole pass, so a writer can checksum one
 * snapshot on a worker thread while its sending thread streams the next, and a reader can
 * copy and checksum in one pass:
 *
 *   digest(buffer) -> int                  xxh3-64 of the buffer
 *   copy_digest(src) -> (bytes, int)      a copy of src and the xxh3-64 of the bytes copied:
 *                                          each 32 KiB is hashed right after it is copied, from
 *                                          L1, so the pass costs about what a memcpy costs
 *   Hasher()                               streaming: update(buffer), intdigest()
 *   stream_into(dst, src)                  copy src into dst (one length) with non-temporal
 *                                          stores (stream_copy, kvstore/native/_blockcopy.c)
 *   copy_hashed(dst, src, hasher)          copy src into dst (one length), feeding hasher the
 *                                          bytes written: each 32 KiB is read once out of src
 *                                          and stored both into a private buffer in L1, hashed
 *                                          there, and into dst (non-temporal stores), so what is
 *                                          hashed is what dst holds, whatever src holds meanwhile
 *
 * Every form gives xxhash's value bit for bit (xxh3 is defined whatever the kernel).
 */
#ifndef KVSTORE_SWA_DIGEST_H
#define KVSTORE_SWA_DIGEST_H

/* Below this many bytes the GIL is kept: releasing it costs more than hashing. */
#define DIGEST_NOGIL_BYTES (64 << 10)
/* What copy_digest copies before hashing it (well inside L1d, which holds 32-48 KiB). */
#ifndef DIGEST_COPY_BLOCK
#define DIGEST_COPY_BLOCK (32 << 10)
#endif

#ifdef HAVE_XXH3_DISPATCH
XXH_TARGET_AVX2 static void xxh3_update_avx2(XXH3_state_t *s, const void *p, size_t n) {
    XXH3_update(s, (const xxh_u8 *)p, n, XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
}

XXH_TARGET_AVX512 static void xxh3_update_avx512(XXH3_state_t *s, const void *p, size_t n) {
    XXH3_update(s, (const xxh_u8 *)p, n, XXH3_accumulate_avx512, XXH3_scrambleAcc_avx512);
}
#endif

/* The streaming update of the kernel `xxh3` is (set by xxh3_pick at import). */
static void xxh3_update_best(XXH3_state_t *s, const void *p, size_t n) {
#ifdef HAVE_XXH3_DISPATCH
    if (xxh3 == xxh3_avx512) {
        xxh3_update_avx512(s, p, n);
        return;
    }
    if (xxh3 == xxh3_avx2) {
        xxh3_update_avx2(s, p, n);
        return;
    }
#endif
    XXH3_64bits_update(s, p, n);
}

static PyObject *digest(PyObject *self, PyObject *arg) {
    Py_buffer view;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    XXH64_hash_t h;
    if (view.len >= DIGEST_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        h = xxh3(view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        h = xxh3(view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *copy_digest(PyObject *self, PyObject *arg) {
    Py_buffer src;
    (void)self;
    if (PyObject_GetBuffer(arg, &src, PyBUF_SIMPLE) < 0) return NULL;
    /* A bytes object left uninitialised: bytearray(n) would write every byte twice (zeroes first). */
    PyObject *copy = PyBytes_FromStringAndSize(NULL, src.len);
    XXH3_state_t *state = copy != NULL ? XXH3_createState() : NULL;
    if (state == NULL) {
        Py_XDECREF(copy);
        PyBuffer_Release(&src);
        return copy == NULL ? NULL : PyErr_NoMemory();
    }
    XXH3_64bits_reset(state);
    XXH64_hash_t h;
    char *to = PyBytes_AsString(copy);
    const char *from = src.buf;
    size_t n = (size_t)src.len;
    Py_BEGIN_ALLOW_THREADS
    for (size_t at = 0; at < n; at += DIGEST_COPY_BLOCK) {
        size_t k = n - at < DIGEST_COPY_BLOCK ? n - at : DIGEST_COPY_BLOCK;
        memcpy(to + at, from + at, k);
        xxh3_update_best(state, to + at, k); /* what was copied, from L1 (src may change under us) */
    }
    h = XXH3_64bits_digest(state);
    Py_END_ALLOW_THREADS
    XXH3_freeState(state);
    PyBuffer_Release(&src);
    return Py_BuildValue("(NK)", copy, (unsigned long long)h);
}

/* Hasher: a streaming xxh3-64 (the state is 64-byte aligned: XXH3_createState allocates it). */
typedef struct {
    PyObject_HEAD
    XXH3_state_t *state;
    /* Set (under the GIL) while copy_hashed feeds the state without the GIL: any other use of the
     * Hasher meanwhile is refused rather than racing it. */
    char busy;
} Hasher;

/* The Hasher type (set by add_hasher at import): copy_hashed takes only its instances. */
static PyObject *hasher_type = NULL;

/* 0, or -1 with RuntimeError when copy_hashed is feeding this Hasher on another thread. */
static int hasher_idle(Hasher *self) {
    if (!self->busy) return 0;
    PyErr_SetString(PyExc_RuntimeError, "this Hasher is being fed by copy_hashed on another thread");
    return -1;
}

static PyObject *hasher_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (!PyArg_ParseTuple(args, ":Hasher") || (kwargs != NULL && PyObject_Length(kwargs) > 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Hasher() takes no arguments");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    Hasher *self = (Hasher *)alloc(type, 0);
    if (self == NULL) return NULL;
    self->state = XXH3_createState();
    if (self->state == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    XXH3_64bits_reset(self->state);
    return (PyObject *)self;
}

static void hasher_dealloc(PyObject *obj) {
    PyTypeObject *type = Py_TYPE(obj);
    XXH3_freeState(((Hasher *)obj)->state);
    freefunc free_ = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_(obj);
    Py_DECREF(type);
}

static PyObject *hasher_update(PyObject *obj, PyObject *arg) {
    Hasher *self = (Hasher *)obj;
    Py_buffer view;
    if (hasher_idle(self) < 0 || PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    /* The GIL is kept: one Hasher is fed by one thread, and another thread's update of the same
     * state meanwhile would race it (python-xxhash locks; we do not need to). */
    xxh3_update_best(self->state, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *hasher_intdigest(PyObject *obj, PyObject *unused) {
    (void)unused;
    if (hasher_idle((Hasher *)obj) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(XXH3_64bits_digest(((Hasher *)obj)->state));
}

static PyMethodDef hasher_methods[] = {
    {"update", hasher_update, METH_O, "update(buffer): hash these bytes next."},
    {"intdigest", hasher_intdigest, METH_NOARGS, "intdigest() -> int: xxh3-64 of everything so far."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot hasher_slots[] = {
    {Py_tp_new, hasher_new},
    {Py_tp_dealloc, hasher_dealloc},
    {Py_tp_methods, hasher_methods},
    {Py_tp_doc, "Hasher(): a streaming xxh3-64 with this CPU's widest kernel (kvstore.native.swa_digest.Hasher)."},
    {0, NULL},
};

static PyType_Spec hasher_spec = {"kvstore.native._blockcopy.Hasher", sizeof(Hasher), 0, Py_TPFLAGS_DEFAULT, hasher_slots};

/* Add Hasher to the module; -1 on failure. */
static int add_hasher(PyObject *module) {
    PyObject *type = PyType_FromSpec(&hasher_spec);
    if (type == NULL) return -1;
    Py_INCREF(type); /* hasher_type's own reference: the module's may go */
    if (PyModule_AddObject(module, "Hasher", type) < 0) {
        Py_DECREF(type);
        Py_DECREF(type);
        return -1;
    }
    Py_XDECREF(hasher_type);
    hasher_type = type;
    return 0;
}

/*
 * stream_into(dst, src): copy src into dst (of one length) with non-temporal stores, without the
 * GIL. An SWA shared-memory put copies each snapshot into its tenant's arena this way: the client
 * never reads it again, and the server that checksums it then reads it from memory, not out of
 * the other core's cache (kvstore.native.swa_digest.stream_into).
 */
static PyObject *stream_into(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src)) return NULL;
    if (dst.len != src.len) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "stream_into: dst and src must be of one length");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy(dst.buf, src.buf, (size_t)src.len);
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed stores are visible before the caller says they are written */
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/*
 * Copy n bytes of src into both `out` (a private buffer) and dst from one read of src: dst is given,
 * with non-temporal stores, the very registers `out` is given, so the two hold the same bytes whatever
 * src holds meanwhile. Runs without the GIL.
 */
static void stream_copy_twice(char *dst, char *out, const char *src, size_t n) {
#if defined(__SSE2__)
    size_t i = (16 - ((uintptr_t)dst & 15)) & 15;
    if (i > n) i = n;
    memcpy(out, src, i);
    memcpy(dst, out, i);
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_storeu_si128((__m128i *)(out + i), a);
        _mm_storeu_si128((__m128i *)(out + i + 16), b);
        _mm_storeu_si128((__m128i *)(out + i + 32), c);
        _mm_storeu_si128((__m128i *)(out + i + 48), d);
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(out + i, src + i, n - i);
    memcpy(dst + i, out + i, n - i);
#else
    memcpy(out, src, n);
    memcpy(dst, out, n);
#endif
}

/*
 * copy_hashed(dst, src, hasher): copy src into dst (of one length) and feed `hasher` (a Hasher) the
 * bytes copied, in one pass without the GIL. The SWA pool copies each snapshot out of a writer's
 * staging arena into the tenant's sealed arena this way (kvstore.native.swa_digest.copy_hashed), so the
 * server's event loop and its other connections run meanwhile.
 *
 * Each 32 KiB of src is read once, into registers that are stored both into a buffer of this call's
 * own and, with non-temporal stores, into dst (stream_copy_twice); the buffer is then hashed from L1.
 * The bytes hashed are the bytes dst was given: a writer changing src meanwhile changes both or
 * neither, and nothing but this process can write dst (the arena is sealed), so the checksum is of
 * what readers map. Non-temporal stores skip reading each line of dst before it is overwritten (a
 * third of the memory traffic of a plain copy) and leave the bytes in memory, where readers on other
 * cores take them from at full speed. (On the dev box this ran at 7.4 GB/s where a 256 KiB memcpy
 * into dst and a hash of dst ran at 5.9 and a plain memcpy at 7.1.)
 */
static PyObject *copy_hashed(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    PyObject *obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*O", &dst, &src, &obj)) return NULL;
    Hasher *h = (Hasher *)obj;
    char *block = NULL;
    if (hasher_type == NULL || !PyObject_TypeCheck(obj, (PyTypeObject *)hasher_type))
        PyErr_SetString(PyExc_TypeError, "copy_hashed: hasher must be a kvstore.native._blockcopy.Hasher");
    else if (dst.len != src.len)
        PyErr_SetString(PyExc_ValueError, "copy_hashed: dst and src must be of one length");
    else if (hasher_idle(h) == 0 && (block = PyMem_Malloc(DIGEST_COPY_BLOCK)) == NULL)
        PyErr_NoMemory();
    if (block == NULL) { /* an exception is set */
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    h->busy = 1;
    char *to = dst.buf;
    const char *from = src.buf;
    size_t n = (size_t)src.len;
    Py_BEGIN_ALLOW_THREADS
    for (size_t at = 0; at < n; at += DIGEST_COPY_BLOCK) {
        size_t k = n - at < DIGEST_COPY_BLOCK ? n - at : DIGEST_COPY_BLOCK;
        stream_copy_twice(to + at, block, from + at, k); /* src read once; dst and block alike */
        xxh3_update_best(h->state, block, k);            /* so the hash is of what dst holds */
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed stores are visible before the caller seals the record */
#endif
    Py_END_ALLOW_THREADS
    h->busy = 0;
    PyMem_Free(block);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

#define SWA_DIGEST_METHODS                                                                                     \
    {"digest", digest, METH_O, "digest(buffer) -> int\n\nSee kvstore.native.swa_digest.digest: xxh3-64 without the GIL."}, \
    {"copy_digest", copy_digest, METH_O,                                                                        \
     "copy_digest(src) -> (bytes, int)\n\nSee kvstore.native.swa_digest.copy_digest: copy and xxh3-64 in one pass."},  \
    {"stream_into", stream_into, METH_VARARGS,                                                                  \
     "stream_into(dst, src)\n\nSee kvstore.native.swa_digest.stream_into: a copy with non-temporal stores."},          \
    {"copy_hashed", copy_hashed, METH_VARARGS,                                                                  \
     "copy_hashed(dst, src, hasher)\n\nSee kvstore.native.swa_digest.copy_hashed: a copy that hashes what it writes."},

#endif
