/*
 * The request ring's words in native code (kvstore/native/_ring.c includes it once): the layout, the header,
 * the futex, the awake words that let a side skip a wake-up (kvstore/transfer_ring.py, "Wake-ups"),
 * and the two calls built on them alone: `wait` (the server's spin, then the futex) and `publish`.
 */
#ifndef KVSTORE_RING_WORDS_H
#define KVSTORE_RING_WORDS_H

#include <linux/futex.h>
#include <stdint.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* kvstore/transfer_ring.py's layout. */
enum { HEADER_AT = 64, REQUEST_AT = 4096, REQUEST_BYTES = 65536 - 4096, ANSWER_AT = 65536,
       ANSWER_BYTES = 131072 - 65536 };
enum { ST_REQUEST = 1, ST_BUSY = 2, ST_ANSWERED = 3 };
static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
    return syscall(SYS_futex, word, op, value, timeout, NULL, 0); /* shared: the word is in a shared mapping */
}

typedef struct {
    uint32_t state, seq, length, pad, answer_seq, code, answer_length, server_cpu, client_cpu, server_awake,
        client_awake;
} Header;

/* `*awake` = 0, then (a full fence: neither side's store may pass its load of the other's word) the
 * state word: a peer that stored the state and then saw `*awake` set skipped its wake, so this
 * side must see that state now (kvstore/transfer_ring.py, "Wake-ups"). */
static uint32_t going_to_sleep(uint32_t *awake, const uint32_t *state) {
    __atomic_store_n(awake, 0, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n(state, __ATOMIC_ACQUIRE);
}

/* Store `value` in the state word and wake its sleepers unless the peer said it is awake (spinning on
 * the word: it sees the store without a wake-up, a syscall that costs microseconds on a VM). */
static void store_and_wake(uint32_t *state, uint32_t value, const uint32_t *peer_awake) {
    __atomic_store_n(state, value, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!__atomic_load_n(peer_awake, __ATOMIC_RELAXED)) futex(state, FUTEX_WAKE, 0x7FFFFFFF, NULL);
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* One turn of a spin `elapsed` seconds in: a pause while it is hot (under `hot_s`), else the
 * core is yielded (the peer may be waiting for it: 2-core boxes, or a third process). */
static void spin_turn(double elapsed, double hot_s) {
    if (elapsed < hot_s) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    } else {
        sched_yield();
    }
}

/*
 * wait(address, expected, spin_s, timeout_s) -> int: the 32-bit word at `address` once it no
 * longer holds `expected`, or after `timeout_s`. Spins for up to `spin_s` first, yielding the
 * core each turn: a request that follows the last answer within it is taken without a futex
 * wake-up (~10-80 us on a loaded VM), and a client (or anything else) waiting for this core
 * gets it (a spin that did not yield made the client's next request wait for this one's time
 * slice on a busy 2-core box: 35 us or 190 us per request, by how they landed). The caller
 * keeps the mapping alive across the call.
 */
static PyObject *wait(PyObject *self, PyObject *args) {
    unsigned long long address, peer_cpu;
    unsigned int expected;
    double hot_s, spin_s, timeout_s;
    (void)self;
    if (!PyArg_ParseTuple(args, "KIdddK", &address, &expected, &hot_s, &spin_s, &timeout_s, &peer_cpu)) return NULL;
    if (address == 0 || address % 4 || peer_cpu % 4 || timeout_s < 0 || spin_s < 0 || hot_s < 0) {
        PyErr_SetString(PyExc_ValueError, "wait: an aligned address and non-negative times");
        return NULL;
    }
    uint32_t *word = (uint32_t *)(uintptr_t)address, now;
    Py_BEGIN_ALLOW_THREADS
    if (peer_cpu && __atomic_load_n((uint32_t *)(uintptr_t)peer_cpu, __ATOMIC_RELAXED) == (uint32_t)(sched_getcpu() + 1))
        hot_s = 0; /* the peer last ran on this CPU: a spin that does not yield would only keep it off */
    double start = seconds(), t = start;
    while ((now = __atomic_load_n(word, __ATOMIC_ACQUIRE)) == expected) {
        if (t - start < hot_s) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
            t = seconds();
            continue;
        }
        if (t - start > spin_s) {
            struct timespec ts = {(time_t)timeout_s, (long)((timeout_s - (double)(time_t)timeout_s) * 1e9)};
            futex(word, FUTEX_WAIT, expected, &ts);
            now = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            break;
        }
        sched_yield(); /* the client may be waiting for this core (2-core boxes, or a third process) */
        t = seconds();
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(now);
}

/*
 * publish(address, value): store `value` in the 32-bit word at `address` (after every store
 * before it: the answer's bytes) and wake every thread waiting on it, of either process.
 */
static PyObject *publish(PyObject *self, PyObject *args) {
    unsigned long long address;
    unsigned int value;
    (void)self;
    if (!PyArg_ParseTuple(args, "KI", &address, &value)) return NULL;
    if (address == 0 || address % 4) {
        PyErr_SetString(PyExc_ValueError, "publish: an aligned address");
        return NULL;
    }
    uint32_t *word = (uint32_t *)(uintptr_t)address;
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    futex(word, FUTEX_WAKE, 0x7FFFFFFF, NULL);
    Py_RETURN_NONE;
}

#endif
