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

typedef struct {
    int kind;
    const void *data;
    Py_ssize_t n;
} Text;

static inline Py_UCS4 at(const Text *t, Py_ssize_t i) {
    return i < t->n ? PyUnicode_READ(t->kind, t->data, i) : 0;
}

static inline int is_word(Py_UCS4 c) { return c == '_' || Py_UNICODE_ISALNUM(c); }
static inline int is_digit(Py_UCS4 c) { return Py_UNICODE_ISDECIMAL(c); }
static inline int is_space(Py_UCS4 c) { return Py_UNICODE_ISSPACE(c); }
static inline int is_alpha_ascii(Py_UCS4 c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
}
static inline int is_hex(Py_UCS4 c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* The output, with whitespace folded as " ".join(text.split()) would. */
typedef struct {
    Py_UCS4 *buf;
    Py_ssize_t len;
    int pending_space;
} Out;

static inline void emit(Out *o, Py_UCS4 c) {
    if (is_space(c)) {
        if (o->len)
            o->pending_space = 1;
        return;
    }
    if (o->pending_space) {
        o->buf[o->len++] = ' ';
        o->pending_space = 0;
    }
    o->buf[o->len++] = c;
}

static inline void emit_range(Out *o, const Text *t, Py_ssize_t lo, Py_ssize_t hi) {
    for (Py_ssize_t i = lo; i < hi; i++)
        emit(o, PyUnicode_READ(t->kind, t->data, i));
}

/* End of a dollar-quoted string starting at pos, or -1 when pos does not open one. */
static Py_ssize_t dollar_end(const Text *t, Py_ssize_t pos) {
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
static Py_ssize_t quoted_end(const Text *t, Py_ssize_t pos, Py_UCS4 q) {
    Py_ssize_t i = pos + 1, n = t->n;
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

static Py_ssize_t digits(const Text *t, Py_ssize_t i) {
    while (i < t->n && is_digit(at(t, i)))
        i++;
    return i;
}

/* End of a number at pos, or -1. */
static Py_ssize_t number_end(const Text *t, Py_ssize_t pos) {
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
static Py_ssize_t param_end(const Text *t, Py_ssize_t pos) {
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

static PyObject *tokens(PyObject *self, PyObject *arg) {
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "tokens() takes a str");
        return NULL;
    }
    Text t = {PyUnicode_KIND(arg), PyUnicode_DATA(arg), PyUnicode_GET_LENGTH(arg)};
    Py_ssize_t n = t.n, pos = 0;
    Out o = {PyMem_Malloc(sizeof(Py_UCS4) * (size_t)(n ? n : 1)), 0, 0};
    if (o.buf == NULL)
        return PyErr_NoMemory();
    while (pos < n) {
        Py_UCS4 c = at(&t, pos), next = at(&t, pos + 1);
        int has_next = pos + 1 < n;
        Py_ssize_t end;
        /* comment */
        if (c == '-' && next == '-' && has_next) {
            end = pos + 2;
            while (end < n && at(&t, end) != '\n')
                end++;
            emit(&o, ' ');
            pos = end;
            continue;
        }
        if (c == '/' && next == '*' && has_next) {
            end = pos + 2;
            while (end < n && !(at(&t, end) == '*' && end + 1 < n && at(&t, end + 1) == '/'))
                end++;
            pos = end < n ? end + 2 : n;
            emit(&o, ' ');
            continue;
        }
        /* dollar-quoted string */
        if (c == '$' && (end = dollar_end(&t, pos)) >= 0) {
            emit(&o, '?');
            pos = end;
            continue;
        }
        /* string, with an optional prefix letter */
        if (c == '\'') {
            emit(&o, '?');
            pos = quoted_end(&t, pos, '\'');
            continue;
        }
        if (next == '\'' && has_next &&
            (c == 'E' || c == 'e' || c == 'B' || c == 'b' || c == 'X' || c == 'x' || c == 'N' ||
             c == 'n')) {
            emit(&o, '?');
            pos = quoted_end(&t, pos + 1, '\'');
            continue;
        }
        /* quoted identifier: kept */
        if (c == '"') {
            end = quoted_end(&t, pos, '"');
            emit_range(&o, &t, pos, end);
            pos = end;
            continue;
        }
        if (c == '`') {
            end = pos + 1;
            while (end < n && at(&t, end) != '`')
                end++;
            end = end < n ? end + 1 : n;
            emit_range(&o, &t, pos, end);
            pos = end;
            continue;
        }
        if (c == '[') {
            end = pos + 1;
            while (end < n && at(&t, end) != ']' && !is_space(at(&t, end)))
                end++;
            if (end < n && at(&t, end) == ']') {
                emit_range(&o, &t, pos, end + 1);
                pos = end + 1;
                continue;
            }
        }
        /* placeholder */
        if ((end = param_end(&t, pos)) >= 0) {
            emit(&o, '?');
            pos = end;
            continue;
        }
        /* identifier: kept */
        if (is_alpha_ascii(c)) {
            end = pos + 1;
            while (end < n && (is_word(at(&t, end)) || at(&t, end) == '$'))
                end++;
            emit_range(&o, &t, pos, end);
            pos = end;
            continue;
        }
        if ((end = number_end(&t, pos)) >= 0) {
            emit(&o, '?');
            pos = end;
            continue;
        }
        /* whitespace, operators and punctuation: emit folds the whitespace */
        emit(&o, c);
        pos++;
    }
    PyObject *result = PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, o.buf, o.len);
    PyMem_Free(o.buf);
    return result;
}

static PyMethodDef methods[] = {
    {"tokens", tokens, METH_O,
     "tokens(sql) -> the statement with literals as ?, comments removed, whitespace folded"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "perfsleuth.wire._fingerprint",
    "C tokenizer pass of perfsleuth.wire.fingerprint.normalize_sql", -1, methods,
};

PyMODINIT_FUNC PyInit__fingerprint(void) { return PyModule_Create(&module); }
