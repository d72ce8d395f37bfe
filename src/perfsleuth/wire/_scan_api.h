/* The C tokenizer's pass (wire/_fingerprint.c) for other extensions: agent/_speedups.c's
 * shared_statement scans each statement with literals written in, on the request's thread, and
 * through this it writes the tokens into its own buffer: no Python call, no str made for them.
 * wire._fingerprint.SCAN is a capsule named SCAN_CAPSULE holding a ScanAPI. */
#ifndef PERFSLEUTH_SCAN_API_H
#define PERFSLEUTH_SCAN_API_H

#include <Python.h>
#include <stddef.h>

#define SCAN_CAPSULE "perfsleuth.wire._fingerprint.SCAN"
#define SCAN_API_VERSION 1

typedef struct {
    int version; /* SCAN_API_VERSION */
    /* The tokens of s (a str of at most max characters; else -1) into buf, which has room for
     * max characters of four bytes: their length in characters, each *width bytes (1 for a
     * 1-byte str, else 4). Touches no Python object but s's data; never fails otherwise. */
    Py_ssize_t (*scan_into)(PyObject *s, void *buf, Py_ssize_t max, int *width);
    /* FNV-1a over size bytes, eight at a time (a table key: compare what it hashed whole) */
    unsigned long long (*hash)(const void *data, size_t size);
} ScanAPI;

#endif
