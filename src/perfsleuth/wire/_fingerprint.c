/* The tokenizer pass of wire.fingerprint.normalize_sql, in one pass over the text.
 *
 * tokens(sql) returns what wire.fingerprint._tokens returns: comments and whitespace folded to
 * single spaces (and stripped at both ends), strings, dollar-quoted bodies, numbers and
 * placeholders replaced by "?", identifiers, quoted identifiers and punctuation kept as written.
 * The Python implementation (the regular expression _SQL_TOKEN, tried alternative by
 * alternative at each position) is the reference: this follows its alternatives in the same
 * order, with the same character classes as Python's re for str patterns (\w: alphanumeric or
 * "_", \d: decimal, \s: Py_UNICODE_ISSPACE), and tests compare both on a corpus of odd inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <time.h>

#include "_scan_api.h"

typedef struct {
    int kind;
    const void *data;
    Py_ssize_t n;
} Text;

#define HOT static inline __attribute__((always_inline))

HOT Py_UCS4 at(const Text *t, Py_ssize_t i) {
    return i < t->n ? PyUnicode_READ(t->kind, t->data, i) : 0;
}

/* ASCII answered from a table (most statements are ASCII throughout); the rest by Python's
 * Unicode database, as re does. */
enum { W = 1, D = 2, S = 4, P = 8 };
/* P (plain: emitted as it is, starting no token of its own; set at import): whitespace and
 * the punctuation that opens nothing, i.e. not alphanumeric, "_" nor one of PLAIN_NOT. */
static const char PLAIN_NOT[] = "-/$'\"`[%?:.";
static unsigned char ascii_class[128] = {
    ['\t'] = S, ['\n'] = S, ['\v'] = S, ['\f'] = S, ['\r'] = S, [0x1c] = S, [0x1d] = S,
    [0x1e] = S, [0x1f] = S, [' '] = S,
    ['0'] = W | D, ['1'] = W | D, ['2'] = W | D, ['3'] = W | D, ['4'] = W | D,
    ['5'] = W | D, ['6'] = W | D, ['7'] = W | D, ['8'] = W | D, ['9'] = W | D,
    ['_'] = W,
    ['A'] = W, ['B'] = W, ['C'] = W, ['D'] = W, ['E'] = W, ['F'] = W, ['G'] = W, ['H'] = W,
    ['I'] = W, ['J'] = W, ['K'] = W, ['L'] = W, ['M'] = W, ['N'] = W, ['O'] = W, ['P'] = W,
    ['Q'] = W, ['R'] = W, ['S'] = W, ['T'] = W, ['U'] = W, ['V'] = W, ['W'] = W, ['X'] = W,
    ['Y'] = W, ['Z'] = W,
    ['a'] = W, ['b'] = W, ['c'] = W, ['d'] = W, ['e'] = W, ['f'] = W, ['g'] = W, ['h'] = W,
    ['i'] = W, ['j'] = W, ['k'] = W, ['l'] = W, ['m'] = W, ['n'] = W, ['o'] = W, ['p'] = W,
    ['q'] = W, ['r'] = W, ['s'] = W, ['t'] = W, ['u'] = W, ['v'] = W, ['w'] = W, ['x'] = W,
    ['y'] = W, ['z'] = W,
};
static inline int is_word(Py_UCS4 c) {
    return c < 128 ? ascii_class[c] & W : Py_UNICODE_ISALNUM(c);
}
static inline int is_digit(Py_UCS4 c) {
    return c < 128 ? ascii_class[c] & D : Py_UNICODE_ISDECIMAL(c);
}
static inline int is_space(Py_UCS4 c) {
    return c < 128 ? ascii_class[c] & S : Py_UNICODE_ISSPACE(c);
}
static inline int is_alpha_ascii(Py_UCS4 c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
}
static inline int is_hex(Py_UCS4 c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* The output, with whitespace folded as " ".join(text.split()) would. Its characters are the
 * text's, " " and "?": one byte each for a 1-byte text, else four (out_width). */
typedef struct {
    void *buf;
    Py_ssize_t len;
    int pending_space;
    int kind; /* the text's */
} Out;

static size_t out_width(int kind) {
    return kind == PyUnicode_1BYTE_KIND ? 1 : sizeof(Py_UCS4);
}

/* ``kind``: o->kind, passed by the scan inlined for it, so the width is known at compile time */
HOT void put(Out *o, int kind, Py_UCS4 c) {
    if (kind == PyUnicode_1BYTE_KIND)
        ((Py_UCS1 *)o->buf)[o->len++] = (Py_UCS1)c;
    else
        ((Py_UCS4 *)o->buf)[o->len++] = c;
}

HOT void emit(Out *o, int kind, Py_UCS4 c) {
    if (is_space(c)) {
        if (o->len)
            o->pending_space = 1;
        return;
    }
    if (o->pending_space) {
        put(o, kind, ' ');
        o->pending_space = 0;
    }
    put(o, kind, c);
}

HOT void emit_range(Out *o, const Text *t, Py_ssize_t lo, Py_ssize_t hi) {
    for (Py_ssize_t i = lo; i < hi; i++)
        emit(o, t->kind, PyUnicode_READ(t->kind, t->data, i));
}

/* A run of characters none of which is whitespace (an identifier), as emit would. */
HOT void emit_word(Out *o, const Text *t, Py_ssize_t lo, Py_ssize_t hi) {
    if (o->pending_space) {
        put(o, t->kind, ' ');
        o->pending_space = 0;
    }
    for (Py_ssize_t i = lo; i < hi; i++) /* mostly a few characters: no memcpy call */
        put(o, t->kind, PyUnicode_READ(t->kind, t->data, i));
}

/* End of a dollar-quoted string starting at pos, or -1 when pos does not open one. */
HOT Py_ssize_t dollar_end(const Text *t, Py_ssize_t pos) {
    Py_ssize_t n = t->n, tag = pos + 1, tag_len = 0, body;
    if (is_alpha_ascii(at(t, tag))) {
        Py_ssize_t k = tag + 1;
        while (k < n && is_word(at(t, k)))
            k++;
        if (at(t, k) == '$') {
            tag_len = k - tag;
            body = k + 1;
        } else if (at(t, pos + 1) == '$') {
            body = pos + 2;
        } else {
            return -1;
        }
    } else if (at(t, pos + 1) == '$') {
        body = pos + 2;
    } else {
        return -1;
    }
    for (Py_ssize_t p = body; p < n; p++) {
        if (at(t, p) != '$')
            continue;
        if (tag_len && p + 1 + tag_len < n && at(t, p + 1 + tag_len) == '$') {
            Py_ssize_t j = 0;
            while (j < tag_len && at(t, p + 1 + j) == at(t, tag + j))
                j++;
            if (j == tag_len)
                return p + 2 + tag_len;
        }
        if (at(t, p + 1) == '$' && p + 1 < n)
            return p + 2;
    }
    return n;
}

/* End of a quoted run opened at pos by q, where a doubled q is an escaped one. */
HOT Py_ssize_t quoted_end(const Text *t, Py_ssize_t pos, Py_UCS4 q) {
    Py_ssize_t i = pos + 1, n = t->n;
    if (t->kind == PyUnicode_1BYTE_KIND) { /* memchr to the next quote */
        const Py_UCS1 *d = t->data;
        while (i < n) {
            const Py_UCS1 *p = memchr(d + i, (int)q, (size_t)(n - i));
            if (p == NULL)
                return n;
            i = p - d;
            if (i + 1 < n && d[i + 1] == q) {
                i += 2;
                continue;
            }
            return i + 1;
        }
        return n;
    }
    while (i < n) {
        if (at(t, i) == q) {
            if (i + 1 < n && at(t, i + 1) == q) {
                i += 2;
                continue;
            }
            return i + 1;
        }
        i++;
    }
    return n;
}

HOT Py_ssize_t digits(const Text *t, Py_ssize_t i) {
    while (i < t->n && is_digit(at(t, i)))
        i++;
    return i;
}

/* End of a number at pos, or -1. */
HOT Py_ssize_t number_end(const Text *t, Py_ssize_t pos) {
    Py_UCS4 c = at(t, pos);
    Py_ssize_t i;
    if (c == '0' && (at(t, pos + 1) == 'x' || at(t, pos + 1) == 'X') && pos + 2 < t->n &&
        is_hex(at(t, pos + 2))) {
        i = pos + 3;
        while (i < t->n && is_hex(at(t, i)))
            i++;
        return i;
    }
    if (pos < t->n && is_digit(c)) {
        i = digits(t, pos + 1);
        if (at(t, i) == '.' && i < t->n)
            i = digits(t, i + 1);
    } else if (c == '.' && pos + 1 < t->n && is_digit(at(t, pos + 1))) {
        i = digits(t, pos + 2);
    } else {
        return -1;
    }
    Py_UCS4 e = at(t, i);
    if ((e == 'e' || e == 'E') && i < t->n) {
        Py_ssize_t j = i + 1;
        if ((at(t, j) == '+' || at(t, j) == '-') && j < t->n)
            j++;
        if (j < t->n && is_digit(at(t, j)))
            i = digits(t, j + 1);
    }
    return i;
}

/* End of a placeholder at pos, or -1 (the "$" + digits form is tried by the caller). */
HOT Py_ssize_t param_end(const Text *t, Py_ssize_t pos) {
    Py_UCS4 c = at(t, pos), next = at(t, pos + 1);
    Py_ssize_t n = t->n;
    if (c == '%') {
        if (next == '(' && pos + 1 < n) {
            Py_ssize_t k = pos + 2;
            while (k < n && at(t, k) != ')')
                k++;
            if (k < n && k + 1 < n && at(t, k + 1) == 's')
                return k + 2;
            return -1;
        }
        return next == 's' && pos + 1 < n ? pos + 2 : -1;
    }
    if (c == '$' && pos + 1 < n && is_digit(next))
        return digits(t, pos + 2);
    if (c == '?')
        return pos + 1;
    if (c == ':' && pos + 1 < n && is_alpha_ascii(next)) {
        if (pos > 0) {
            Py_UCS4 prev = at(t, pos - 1);
            if (prev == ':' || is_word(prev))
                return -1;
        }
        Py_ssize_t k = pos + 2;
        while (k < n && is_word(at(t, k)))
            k++;
        return k;
    }
    return -1;
}

/* 1 for a character that continues an identifier ([\w$]), for each character of a 1-byte
 * str (set at import from the classes above and Python's Unicode database). */
static unsigned char ident_1[256];

/* End of the identifier whose first character is at pos - 1. */
HOT Py_ssize_t ident_end(const Text *t, Py_ssize_t pos) {
    Py_ssize_t n = t->n;
    if (t->kind == PyUnicode_1BYTE_KIND) {
        const Py_UCS1 *d = t->data;
        while (pos < n && ident_1[d[pos]])
            pos++;
        return pos;
    }
    while (pos < n && (is_word(at(t, pos)) || at(t, pos) == '$'))
        pos++;
    return pos;
}

/* End of a "--" comment whose text starts at pos: the next newline (kept) or the end. */
HOT Py_ssize_t line_comment_end(const Text *t, Py_ssize_t pos) {
    Py_ssize_t n = t->n;
    if (t->kind == PyUnicode_1BYTE_KIND) {
        const Py_UCS1 *d = t->data;
        const Py_UCS1 *p = pos < n ? memchr(d + pos, '\n', (size_t)(n - pos)) : NULL;
        return p == NULL ? n : p - d;
    }
    while (pos < n && at(t, pos) != '\n')
        pos++;
    return pos;
}

/* Where the "*\/" closing a block comment whose text starts at pos is, or n. */
HOT Py_ssize_t block_comment_close(const Text *t, Py_ssize_t pos) {
    Py_ssize_t n = t->n;
    if (t->kind == PyUnicode_1BYTE_KIND) {
        const Py_UCS1 *d = t->data;
        while (pos < n) {
            const Py_UCS1 *p = memchr(d + pos, '*', (size_t)(n - pos));
            if (p == NULL)
                return n;
            pos = p - d;
            if (pos + 1 < n && d[pos + 1] == '/')
                return pos;
            pos++;
        }
        return n;
    }
    while (pos < n && !(at(t, pos) == '*' && pos + 1 < n && at(t, pos + 1) == '/'))
        pos++;
    return pos;
}

/* The tokenizer pass over the text into o->buf (room for t->n characters of o's width). Touches no Python
 * object (the str's data is immutable and kept alive by the caller), so it can run without the
 * interpreter lock. Inlined once per character width, so that reading a character costs no
 * switch on the width. */
HOT void scan(const Text *tp, Out *out) {
    const Text t = *tp;
    /* The output's state in a local: stores through o->buf (a char pointer, which may alias
     * anything whose address is known) would otherwise reload o->len after every character. */
    Out local = *out, *o = &local;
    Py_ssize_t n = t.n, pos = 0;
    while (pos < n) {
        Py_UCS4 c = at(&t, pos), next;
        Py_ssize_t end;
        if (c < 128) {
            unsigned char cls = ascii_class[c];
            if (cls & P) { /* what the alternatives below all pass by */
                emit(o, t.kind, c);
                pos++;
                continue;
            }
            /* An ASCII letter or "_" starts an identifier, or a string with a prefix letter:
             * no other alternative starts with one. */
            if (is_alpha_ascii(c)) {
                if (at(&t, pos + 1) == '\'' && pos + 1 < n &&
                    (c == 'E' || c == 'e' || c == 'B' || c == 'b' || c == 'X' || c == 'x' ||
                     c == 'N' || c == 'n')) {
                    emit(o, t.kind, '?');
                    pos = quoted_end(&t, pos + 1, '\'');
                    continue;
                }
                if (t.kind == PyUnicode_1BYTE_KIND) { /* scanned and copied in one pass */
                    const Py_UCS1 *d = t.data;
                    Py_UCS1 *w = (Py_UCS1 *)o->buf + o->len;
                    if (o->pending_space) {
                        *w++ = ' ';
                        o->pending_space = 0;
                    }
                    *w++ = (Py_UCS1)c;
                    for (pos++; pos < n && ident_1[d[pos]]; pos++)
                        *w++ = d[pos];
                    o->len = w - (Py_UCS1 *)o->buf;
                    continue;
                }
                end = ident_end(&t, pos + 1);
                emit_word(o, &t, pos, end);
                pos = end;
                continue;
            }
            /* an ASCII digit starts a number, and nothing before it in the order */
            if (cls & D) {
                emit(o, t.kind, '?');
                pos = number_end(&t, pos);
                continue;
            }
            /* a quote starts a string, and nothing before it in the order (below) */
            if (c == '\'') {
                emit(o, t.kind, '?');
                pos = quoted_end(&t, pos, '\'');
                continue;
            }
        }
        next = at(&t, pos + 1);
        int has_next = pos + 1 < n;
        /* comment */
        if (c == '-' && next == '-' && has_next) {
            end = line_comment_end(&t, pos + 2);
            emit(o, t.kind, ' ');
            pos = end;
            continue;
        }
        if (c == '/' && next == '*' && has_next) {
            end = block_comment_close(&t, pos + 2);
            pos = end < n ? end + 2 : n;
            emit(o, t.kind, ' ');
            continue;
        }
        /* dollar-quoted string */
        if (c == '$' && (end = dollar_end(&t, pos)) >= 0) {
            emit(o, t.kind, '?');
            pos = end;
            continue;
        }
        /* string, with an optional prefix letter */
        if (c == '\'') {
            emit(o, t.kind, '?');
            pos = quoted_end(&t, pos, '\'');
            continue;
        }
        if (next == '\'' && has_next &&
            (c == 'E' || c == 'e' || c == 'B' || c == 'b' || c == 'X' || c == 'x' || c == 'N' ||
             c == 'n')) {
            emit(o, t.kind, '?');
            pos = quoted_end(&t, pos + 1, '\'');
            continue;
        }
        /* quoted identifier: kept */
        if (c == '"') {
            end = quoted_end(&t, pos, '"');
            emit_range(o, &t, pos, end);
            pos = end;
            continue;
        }
        if (c == '`') {
            end = pos + 1;
            while (end < n && at(&t, end) != '`')
                end++;
            end = end < n ? end + 1 : n;
            emit_range(o, &t, pos, end);
            pos = end;
            continue;
        }
        if (c == '[') {
            end = pos + 1;
            while (end < n && at(&t, end) != ']' && !is_space(at(&t, end)))
                end++;
            if (end < n && at(&t, end) == ']') {
                emit_range(o, &t, pos, end + 1);
                pos = end + 1;
                continue;
            }
        }
        /* placeholder */
        if ((end = param_end(&t, pos)) >= 0) {
            emit(o, t.kind, '?');
            pos = end;
            continue;
        }
        /* identifier: kept */
        if (is_alpha_ascii(c)) {
            end = ident_end(&t, pos + 1);
            emit_word(o, &t, pos, end);
            pos = end;
            continue;
        }
        if ((end = number_end(&t, pos)) >= 0) {
            emit(o, t.kind, '?');
            pos = end;
            continue;
        }
        /* whitespace, operators and punctuation: emit folds the whitespace */
        emit(o, t.kind, c);
        pos++;
    }
    *out = local;
}

static void scan_1(const void *data, Py_ssize_t n, Out *o) {
    const Text t = {PyUnicode_1BYTE_KIND, data, n};
    scan(&t, o);
}
static void scan_2(const void *data, Py_ssize_t n, Out *o) {
    const Text t = {PyUnicode_2BYTE_KIND, data, n};
    scan(&t, o);
}
static void scan_4(const void *data, Py_ssize_t n, Out *o) {
    const Text t = {PyUnicode_4BYTE_KIND, data, n};
    scan(&t, o);
}

static void scan_any(int kind, const void *data, Py_ssize_t n, Out *o) {
    if (kind == PyUnicode_1BYTE_KIND)
        scan_1(data, n, o);
    else if (kind == PyUnicode_2BYTE_KIND)
        scan_2(data, n, o);
    else
        scan_4(data, n, o);
}

/* The str of what scan left in o (every character of it is one of the text's, or a space or
 * "?": an ASCII text gives an ASCII result). */
static PyObject *result_of(const Out *o, int ascii) {
    if (!ascii)
        return PyUnicode_FromKindAndData(
            o->kind == PyUnicode_1BYTE_KIND ? PyUnicode_1BYTE_KIND : PyUnicode_4BYTE_KIND, o->buf,
            o->len);
    PyObject *r = PyUnicode_New(o->len, 127);
    if (r == NULL)
        return NULL;
    memcpy(PyUnicode_1BYTE_DATA(r), o->buf, (size_t)o->len); /* an ASCII text: 1-byte output */
    return r;
}

/* Scratch output for a text of n characters of this kind (o->buf NULL: no memory). */
static Out out_for(int kind, Py_ssize_t n) {
    Out o = {PyMem_RawMalloc(out_width(kind) * (size_t)(n ? n : 1)), 0, 0, kind};
    return o;
}

static PyObject *tokens(PyObject *self, PyObject *arg) {
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "tokens() takes a str");
        return NULL;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(arg);
    Out o = out_for(PyUnicode_KIND(arg), n);
    if (o.buf == NULL)
        return PyErr_NoMemory();
    scan_any(PyUnicode_KIND(arg), PyUnicode_DATA(arg), n, &o);
    PyObject *result = result_of(&o, PyUnicode_IS_ASCII(arg));
    PyMem_RawFree(o.buf);
    return result;
}

static Py_ssize_t scan_into(PyObject *s, void *buf, Py_ssize_t max, int *width) {
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    if (n > max)
        return -1;
    int kind = PyUnicode_KIND(s);
    Out o = {buf, 0, 0, kind};
    scan_any(kind, PyUnicode_DATA(s), n, &o);
    *width = (int)out_width(kind);
    return o.len;
}

/* tokens_many(list of str) -> (list of their tokens, thread CPU ns spent scanning): the
 * statements scanned with the interpreter lock released, so that on another core the
 * application's threads run meanwhile. One release for the list (a thread taking the lock
 * back waits for the running one to give it up, up to the switch interval): the caller sizes
 * the list (each statement needs up to four bytes a character of scratch while scanned). An item
 * that is not a str gives None. */
#define RELEASE_AT 16384 /* characters in a tokens_many call for the lock to be released */

typedef struct {
    int kind, ascii;
    const void *data;
    Py_ssize_t n;
    Out o;
    unsigned long long h; /* FNV-1a of the tokens: equal tokens share one str (see below) */
    PyObject *r;          /* the result (borrowed from the list) */
} Job;

static unsigned long long fnv_bytes(const void *data, size_t size) {
    unsigned long long h = 1469598103934665603ULL, word;
    const unsigned char *b = data;
    size_t i = 0;
    for (; i + 8 <= size; i += 8) { /* eight bytes a step: a table key, checked by memcmp */
        memcpy(&word, b + i, 8);
        h = (h ^ word) * 1099511628211ULL;
    }
    for (; i < size; i++)
        h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

static unsigned long long fnv(const Out *o) {
    return fnv_bytes(o->buf, out_width(o->kind) * (size_t)o->len);
}

static ScanAPI scan_api = {SCAN_API_VERSION, scan_into, fnv_bytes};

static PyObject *tokens_many(PyObject *self, PyObject *arg) {
    PyObject *held = PySequence_Tuple(arg); /* keeps every str alive while the lock is off */
    if (held == NULL)
        return NULL;
    Py_ssize_t m = PyTuple_GET_SIZE(held);
    Job *jobs = PyMem_RawCalloc((size_t)(m ? m : 1), sizeof(Job));
    PyObject *out = NULL, *list = NULL;
    long long ns = 0;
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *item = PyTuple_GET_ITEM(held, i);
        Job *j = &jobs[i];
        j->n = -1;
        if (!PyUnicode_Check(item) || PyUnicode_READY(item) < 0) {
            PyErr_Clear();
            continue;
        }
        Py_ssize_t n = PyUnicode_GET_LENGTH(item);
        j->o = out_for(PyUnicode_KIND(item), n);
        if (j->o.buf == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        j->kind = PyUnicode_KIND(item);
        j->ascii = PyUnicode_IS_ASCII(item);
        j->data = PyUnicode_DATA(item);
        j->n = n;
    }
    /* Released for work worth a wait for the lock afterwards (up to the switch interval
     * when another thread runs Python meanwhile): a few short statements are scanned with
     * the lock held, in less time than the hand-over would take. */
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < m; i++)
        total += jobs[i].n > 0 ? jobs[i].n : 0;
    PyThreadState *released = total >= RELEASE_AT ? PyEval_SaveThread() : NULL;
    struct timespec t0, t1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    for (Py_ssize_t i = 0; i < m; i++)
        if (jobs[i].n >= 0) {
            scan_any(jobs[i].kind, jobs[i].data, jobs[i].n, &jobs[i].o);
            jobs[i].h = fnv(&jobs[i].o);
        }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    ns = (long long)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
    if (released != NULL)
        PyEval_RestoreThread(released);
    list = PyList_New(m);
    if (list == NULL)
        goto done;
    /* Statements differing only in literals mostly have equal tokens: one str for each
     * distinct tokens (made once, hashed once by whoever looks it up). An open-addressing
     * table of job indexes by hash; without memory for it, a str each. */
    size_t cap = 1;
    while (cap < 2 * (size_t)m)
        cap <<= 1;
    Py_ssize_t *slots = PyMem_RawMalloc(cap * sizeof(Py_ssize_t));
    if (slots != NULL)
        for (size_t k = 0; k < cap; k++)
            slots[k] = -1;
    for (Py_ssize_t i = 0; i < m; i++) {
        Job *j = &jobs[i];
        PyObject *r = NULL;
        size_t k = 0;
        if (j->n < 0) {
            r = Py_None;
            Py_INCREF(r);
            PyList_SET_ITEM(list, i, r);
            continue;
        }
        if (slots != NULL) {
            for (k = (size_t)j->h & (cap - 1); slots[k] >= 0; k = (k + 1) & (cap - 1)) {
                Job *p = &jobs[slots[k]];
                if (p->h == j->h && p->o.len == j->o.len &&
                    p->o.kind == j->o.kind &&
                    memcmp(p->o.buf, j->o.buf, out_width(j->o.kind) * (size_t)j->o.len) == 0) {
                    r = p->r;
                    Py_INCREF(r);
                    break;
                }
            }
        }
        if (r == NULL) {
            if ((r = result_of(&j->o, j->ascii)) == NULL) {
                PyMem_RawFree(slots);
                goto done;
            }
            if (slots != NULL)
                slots[k] = i;
        }
        j->r = r;
        PyList_SET_ITEM(list, i, r);
    }
    PyMem_RawFree(slots);
    out = Py_BuildValue("(OL)", list, ns);
done:
    Py_XDECREF(list);
    if (jobs != NULL) {
        for (Py_ssize_t i = 0; i < m; i++)
            PyMem_RawFree(jobs[i].o.buf);
        PyMem_RawFree(jobs);
    }
    Py_DECREF(held);
    return out;
}

static PyMethodDef methods[] = {
    {"tokens", tokens, METH_O,
     "tokens(sql) -> the statement with literals as ?, comments removed, whitespace folded"},
    {"tokens_many", tokens_many, METH_O,
     "tokens_many(statements) -> (their tokens, None for a non-str; thread CPU ns spent), "
     "scanned with the interpreter lock released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "perfsleuth.wire._fingerprint",
    "C tokenizer pass of perfsleuth.wire.fingerprint.normalize_sql", -1, methods,
};

PyMODINIT_FUNC PyInit__fingerprint(void) {
    for (int c = 0; c < 128; c++)
        if (!(ascii_class[c] & W) && strchr(PLAIN_NOT, c) == NULL)
            ascii_class[c] |= P;
    for (int c = 0; c < 256; c++)
        ident_1[c] = is_word((Py_UCS4)c) || c == '$';
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *capsule = PyCapsule_New(&scan_api, SCAN_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(m, "SCAN", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
