/*
 * The ring's two messages in native code (kvstore/native/_ring.c): a strict parse of a read's
 * `SubmitRequest` and the write of a plain `TransferState` (proto/kvstore/v1/transfer.proto).
 *
 * The parser takes only the shape the client writes: each field at most once, the
 * expected wire types, one group with packed offsets, op READ, prefix_only 0 or 1, no
 * field it does not know. On anything else it answers 0 and the Python server parses the
 * same bytes with protobuf itself (so what it accepts, it reads as protobuf would).
 */
#ifndef KVSTORE_RING_WIRE_H
#define KVSTORE_RING_WIRE_H

#include <stdint.h>
#include <string.h>

enum { HASH_BYTES = 32, MAX_DESCRIPTORS = 128, WT_VARINT = 0, WT_LEN = 2, OP_READ = 1 };

typedef struct {
    uint64_t region_id, length_bytes;
    const unsigned char *hashes;
    uint32_t n; /* the descriptors (offsets); the hashes were checked to be n * HASH_BYTES */
    int prefix_only;
    uint64_t offsets[MAX_DESCRIPTORS];
} Request;

typedef struct {
    const unsigned char *p, *end;
} Reader;

/* A varint of at most 10 bytes whose value fits 64 bits; 0 at the end or past it. */
static int varint(Reader *r, uint64_t *value) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->p >= r->end) return 0;
        uint8_t b = *r->p++;
        if (shift == 63 && b > 1) return 0;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *value = v;
            return 1;
        }
    }
    return 0;
}

/* A length-delimited field's bytes; 0 when they run past the end. */
static int bytes_field(Reader *r, const unsigned char **at, uint64_t *len) {
    if (!varint(r, len) || *len > (uint64_t)(r->end - r->p)) return 0;
    *at = r->p;
    r->p += *len;
    return 1;
}

/* DescriptorGroup: region_id 1, length_bytes 2, block_hashes 3, offsets_bytes 4 (packed). */
static int parse_group(const unsigned char *at, uint64_t len, uint32_t limit, Request *out) {
    Reader r = {at, at + len};
    unsigned seen = 0;
    uint64_t hlen = 0;
    out->hashes = NULL;
    out->n = 0;
    out->region_id = out->length_bytes = 0;
    while (r.p < r.end) {
        uint64_t key, v;
        const unsigned char *field;
        if (!varint(&r, &key) || key >> 3 > 4 || (seen & (1u << (key >> 3)))) return 0;
        seen |= 1u << (key >> 3);
        switch (key) {
        case 1 << 3 | WT_VARINT: if (!varint(&r, &out->region_id)) return 0; break;
        case 2 << 3 | WT_VARINT: if (!varint(&r, &out->length_bytes)) return 0; break;
        case 3 << 3 | WT_LEN: if (!bytes_field(&r, &out->hashes, &hlen)) return 0; break;
        case 4 << 3 | WT_LEN: {
            uint64_t flen;
            if (!bytes_field(&r, &field, &flen)) return 0;
            Reader o = {field, field + flen};
            while (o.p < o.end) {
                if (out->n >= limit || !varint(&o, &v)) return 0;
                out->offsets[out->n++] = v;
            }
            break;
        }
        default: return 0;
        }
    }
    return out->hashes != NULL && hlen == (uint64_t)out->n * HASH_BYTES;
}

/* SubmitRequest: session_id 1 (not read), op 2, prefix_only 4, wait 5 (not read), groups 9. */
static int parse_request(const unsigned char *at, size_t len, uint32_t limit, Request *out) {
    Reader r = {at, at + len};
    unsigned seen = 0;
    uint64_t op = 0, flag = 0, glen = 0, v;
    const unsigned char *group = NULL, *skip;
    if (limit > MAX_DESCRIPTORS) return 0;
    while (r.p < r.end) {
        uint64_t key;
        if (!varint(&r, &key) || key >> 3 > 9 || (seen & (1u << (key >> 3)))) return 0;
        seen |= 1u << (key >> 3);
        switch (key) {
        case 1 << 3 | WT_LEN: if (!bytes_field(&r, &skip, &v)) return 0; break;
        case 2 << 3 | WT_VARINT: if (!varint(&r, &op)) return 0; break;
        case 4 << 3 | WT_VARINT: if (!varint(&r, &flag) || flag > 1) return 0; break;
        case 5 << 3 | WT_VARINT: if (!varint(&r, &v)) return 0; break;
        case 9 << 3 | WT_LEN: if (!bytes_field(&r, &group, &glen)) return 0; break;
        default: return 0;
        }
    }
    out->prefix_only = (int)flag;
    return op == OP_READ && group != NULL && parse_group(group, glen, limit, out);
}

static size_t put_varint(unsigned char *p, uint64_t v) {
    size_t n = 0;
    for (; v >= 0x80; v >>= 7) p[n++] = (unsigned char)(v | 0x80);
    p[n++] = (unsigned char)v;
    return n;
}

/* TransferState{done: true, bytes_moved, statuses: n x DONE (1)} as protobuf serializes it
 * (fields in number order); its length. `room` must hold 32 + n bytes. */
static size_t write_state(unsigned char *p, size_t room, uint32_t n, uint64_t bytes_moved) {
    size_t at = 0;
    if (room < 32 + (size_t)n) return 0;
    p[at++] = 2 << 3 | WT_VARINT, p[at++] = 1;
    if (bytes_moved) {
        p[at++] = 4 << 3 | WT_VARINT;
        at += put_varint(p + at, bytes_moved);
    }
    if (n) {
        p[at++] = 5 << 3 | WT_LEN;
        at += put_varint(p + at, n);
        memset(p + at, 1, n);
        at += n;
    }
    return at;
}

#endif
