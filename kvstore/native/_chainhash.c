/* The chain hashes of a prompt's full blocks in one native call (kvstore.prefix.chain_hashes_of_bytes).
 *
 * Each block's hash is SHA-256(parent || head || the block's token bytes || tail), its parent the block
 * before's hash (docs/PREFIX_HASHING.md): the same bytes as the Python loop hashes, through OpenSSL's
 * one-shot SHA-256 context (no EVP fetch per block, which is most of hashlib's ~1.3 us per 300-byte
 * block: a next turn's 64 new blocks cost ~0.15 ms in Python, on the Lookup's critical path). A long run
 * (RELEASE_BLOCKS or more) is hashed without the GIL; a short one keeps it: dropping it there hands the GIL
 * to C7's compare worker mid-turn, and taking it back cost more than the hashing (in the next turn:
 * 0.14 ms median with the release against ~0.05 without). The hashes come back as a list of 32-byte bytes.
 */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <openssl/sha.h>
#include <stdlib.h>
#include <string.h>

#define RELEASE_BLOCKS 1024

#pragma GCC diagnostic ignored "-Wdeprecated-declarations" /* SHA256_Init & co: the fast one-shot path */

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer raw, parent, head, tail;
    Py_ssize_t step;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*ny*y*y*", &raw, &step, &parent, &head, &tail))
        return NULL;
    PyObject *out = NULL;
    unsigned char *digests = NULL;
    if (step <= 0 || parent.len != SHA256_DIGEST_LENGTH) {
        PyErr_SetString(PyExc_ValueError, "chain: step must be positive and parent 32 bytes");
        goto done;
    }
    Py_ssize_t n = raw.len / step;
    digests = malloc(n ? (size_t)n * SHA256_DIGEST_LENGTH : 1);
    if (digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyThreadState *released = n >= RELEASE_BLOCKS ? PyEval_SaveThread() : NULL;
    const unsigned char *last = parent.buf;
    const unsigned char *bytes = raw.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, last, SHA256_DIGEST_LENGTH);
        SHA256_Update(&ctx, head.buf, (size_t)head.len);
        SHA256_Update(&ctx, bytes + i * step, (size_t)step);
        SHA256_Update(&ctx, tail.buf, (size_t)tail.len);
        SHA256_Final(digests + i * SHA256_DIGEST_LENGTH, &ctx);
        last = digests + i * SHA256_DIGEST_LENGTH;
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyBytes_FromStringAndSize((const char *)digests + i * SHA256_DIGEST_LENGTH,
                                                SHA256_DIGEST_LENGTH);
        if (h == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SetItem(out, i, h); /* steals h */
    }
done:
    free(digests);
    PyBuffer_Release(&raw);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&head);
    PyBuffer_Release(&tail);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(raw, step, parent, head, tail) -> list[bytes]\n\n"
     "See kvstore.prefix.chain_hashes_of_bytes: SHA-256(parent + head + block + tail) of each whole `step`-byte\n"
     "block of `raw`, each block's parent the hash before (the first's `parent`); long runs without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.native._chainhash", "Native chain hashing of kvstore.prefix.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__chainhash(void) { return PyModule_Create(&module); }
