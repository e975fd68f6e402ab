/*
 * The client's side of a ring request in native code (kvstore/native/_ring.c includes it once): `ask` writes
 * a request's bytes, `ask_slots` a consecutive-slots read from a template's head and tail and the
 * caller's list of hashes; both then store REQUEST, wake the server unless it spins, and spin for the
 * answer without the GIL (tiers/ring.py, kvstore/client/transfer_ring.py).
 */
#ifndef KVSTORE_RING_ASK_H
#define KVSTORE_RING_ASK_H

#include "_ring_wire.h"
#include "_ring_words.h"

/* The client's side once its request's bytes are in the ring's request area (`length` of them), without
 * the GIL: the header words, REQUEST, the wake, and the spin for answer `seq` (see `ask`). */
static int ask_written(unsigned char *base, uint32_t length, uint32_t seq, double hot_s, double spin_s,
                       const Py_buffer *expected) {
    Header *header = (Header *)(base + HEADER_AT);
    uint32_t cpu = (uint32_t)(sched_getcpu() + 1);
    header->seq = seq;
    header->length = length;
    header->client_cpu = cpu;
    if (__atomic_load_n(&header->server_cpu, __ATOMIC_RELAXED) == cpu) hot_s = 0;
    __atomic_store_n(&header->client_awake, 1, __ATOMIC_RELAXED); /* before REQUEST: the answer needs no wake */
    store_and_wake(&header->state, ST_REQUEST, &header->server_awake); /* after the request's bytes */
    double start = seconds(), t = start;
    for (;;) {
        uint32_t state = __atomic_load_n(&header->state, __ATOMIC_ACQUIRE);
        if (state != ST_ANSWERED && t - start >= spin_s)
            state = going_to_sleep(&header->client_awake, &header->state); /* the caller sleeps next */
        if (state == ST_ANSWERED && __atomic_load_n(&header->answer_seq, __ATOMIC_RELAXED) == seq) {
            __atomic_store_n(&header->client_awake, 0, __ATOMIC_RELAXED);
            if (header->code == 0 && header->answer_length == (uint32_t)expected->len &&
                memcmp(base + ANSWER_AT, expected->buf, (size_t)expected->len) == 0)
                return 2;
            return 1;
        }
        if (t - start >= spin_s) {
            __atomic_store_n(&header->client_awake, 0, __ATOMIC_RELAXED);
            return 0;
        }
        spin_turn(t - start, hot_s);
        t = seconds();
    }
}

/*
 * ask(ring, request, seq, hot_s, spin_s, expected) -> int: the client's side of one request.
 *
 * Copies `request` into the ring's request area, writes the header words (seq, length, the
 * client's CPU), stores state = REQUEST after them and wakes the futex; then spins for the
 * answer, first without yielding for `hot_s` (none when the server last answered on this
 * CPU: it would only keep the server off), then yielding the core until `spin_s`. All of it
 * without the GIL. Returns 0 when no answer came within the spin (the caller sleeps on the
 * futex and watches the session), 1 when answer `seq` is there (the caller reads it), 2 when
 * it is there and is exactly `expected` with code 0 (the all-DONE answer: nothing to parse).
 * The caller keeps the ring mapped and holds the ring's one slot.
 */
static PyObject *ask(PyObject *self, PyObject *args) {
    unsigned long long ring;
    unsigned int seq;
    double hot_s, spin_s;
    Py_buffer request, expected;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ky*Iddy*", &ring, &request, &seq, &hot_s, &spin_s, &expected)) return NULL;
    PyObject *result = NULL;
    if (ring == 0 || ring % 64 || request.len > REQUEST_BYTES || expected.len > ANSWER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "ask: an aligned ring, a request within the request area");
        goto done;
    }
    unsigned char *base = (unsigned char *)(uintptr_t)ring;
    int got;
    Py_BEGIN_ALLOW_THREADS
    memcpy(base + REQUEST_AT, request.buf, (size_t)request.len);
    got = ask_written(base, (uint32_t)request.len, seq, hot_s, spin_s, &expected);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(got);
done:
    PyBuffer_Release(&request);
    PyBuffer_Release(&expected);
    return result;
}

/*
 * ask_slots(ring, head, hashes, tail, seq, hot_s, spin_s, expected) -> int: `ask` of the request
 * head + b"".join(hashes) + tail, written straight into the ring: -1 (nothing written) unless
 * `hashes` is a list of `bytes` objects (exactly bytes) of HASH_BYTES each and the request fits the
 * request area, else as `ask`. The client's lean fetch (a template's head and tail, the caller's
 * list of hashes) costs no join, no type and length passes over the list, and no request object.
 */
static PyObject *ask_slots(PyObject *self, PyObject *args) {
    unsigned long long ring;
    unsigned int seq;
    double hot_s, spin_s;
    PyObject *hashes;
    Py_buffer head, tail, expected;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ky*Oy*Iddy*", &ring, &head, &hashes, &tail, &seq, &hot_s, &spin_s, &expected))
        return NULL;
    PyObject *result = NULL;
    if (ring == 0 || ring % 64 || expected.len > ANSWER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "ask_slots: an aligned ring, an answer within the answer area");
        goto done;
    }
    if (!PyList_Check(hashes)) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    Py_ssize_t n = PyList_Size(hashes);
    if (n < 0 || (uint64_t)head.len + (uint64_t)n * HASH_BYTES + (uint64_t)tail.len > REQUEST_BYTES) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    unsigned char *base = (unsigned char *)(uintptr_t)ring, *at = base + REQUEST_AT;
    /* Checked while written (the list cannot change under the GIL); the state word is stored only after. */
    memcpy(at, head.buf, (size_t)head.len);
    at += head.len;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GetItem(hashes, i); /* borrowed */
        if (h == NULL || !PyBytes_CheckExact(h) || PyBytes_Size(h) != HASH_BYTES) {
            result = PyLong_FromLong(-1);
            goto done;
        }
        memcpy(at, PyBytes_AsString(h), HASH_BYTES);
        at += HASH_BYTES;
    }
    memcpy(at, tail.buf, (size_t)tail.len);
    uint32_t length = (uint32_t)(head.len + n * HASH_BYTES + tail.len);
    int got;
    Py_BEGIN_ALLOW_THREADS
    got = ask_written(base, length, seq, hot_s, spin_s, &expected);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(got);
done:
    PyBuffer_Release(&head);
    PyBuffer_Release(&tail);
    PyBuffer_Release(&expected);
    return result;
}

#endif
