/* perfsleuth.agent._speedups: the sqlite3 cursor wrappers of agent.instrument.dbapi, in C.
 *
 * Optional. The agent works without it (the Python wrappers in dbapi.py are the reference:
 * same behaviour, same recorded values); with it, recording a statement costs no Python frame
 * of its own. sqlite statements take a few microseconds, so their wrappers are the hottest code
 * the agent runs, and in CPython a Python wrapper around a C method costs more than the
 * bookkeeping it does.
 *
 * What a wrapper does, as in dbapi.py: outside a request, forward; in a request, look the call
 * site up in the request's sites (recorder.ActiveRequest.record_call's fast path: same
 * statement, same frame, same instruction, parameters in a tuple), append the call's row
 * (slot, start, end, rows, params hash) to the request's rows, call the C method, stamp the
 * end and count the rows; anything else (a site's first call in the request, odd arguments)
 * goes through record_call in Python. Nothing here raises into the application: an internal
 * failure is counted (recorder.internal_error) and the statement runs unrecorded, and the
 * driver's own exceptions pass through untouched.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>
#include <time.h>

/* Set by configure() (recorder.configure): */
static PyObject *current_var;   /* recorder._current, the request of the running context */
static PyObject *sql_text;      /* dbapi.sql_text: the statement of a non-str argument */
static PyObject *internal_error;/* recorder.internal_error */
static PyObject *perf_counter;  /* time.perf_counter_ns, when CLOCK_MONOTONIC is not its clock */
static Py_ssize_t max_rows = (Py_ssize_t)20000 * 5;

static PyObject *s_sites, *s_calls, *s_rows_attr, *s_description, *s_rowcount;
static PyObject *s_record_call, *s_fail_call, *s_dropped, *s_db, *s_sqlite;
static PyObject *null_value;    /* recorder.NULL: -(1 << 63) */
static PyObject *zero, *one, *up_one, *empty_tuple;

enum { ROW = 5, END = 2, ROWS = 3 };
enum { EXECUTE, FETCHONE, FETCHMANY, FETCHALL, NEXT };

static PyObject *
now_ns(void)
{
    if (perf_counter != NULL)
        return PyObject_CallNoArgs(perf_counter);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
}

/* Count an internal failure and clear it: the application never sees it. */
static void
failed(void)
{
    PyErr_Clear();
    if (internal_error != NULL) {
        PyObject *r = PyObject_CallNoArgs(internal_error);
        Py_XDECREF(r);
        PyErr_Clear();
    }
}

static void
set_counting(PyObject *cursor, PyObject *value)
{
    if (PyObject_SetAttr(cursor, s_rows_attr, value) < 0)
        failed();
}

/* The fast path of record_call: the row offset, -1 when the call is not on it (no error set),
 * -2 when the request holds PERFSLEUTH_MAX_CALLS calls (the call was counted as dropped). */
static Py_ssize_t
record_fast(PyObject *req, PyObject *sql, PyObject *params)
{
    PyFrameObject *frame = PyEval_GetFrame(); /* borrowed: the application's frame */
    if (frame == NULL || !PyUnicode_CheckExact(sql) || !PyTuple_CheckExact(params))
        return -1;
    PyObject *sites = PyObject_GetAttr(req, s_sites);
    if (sites == NULL || !PyDict_CheckExact(sites)) {
        Py_XDECREF(sites);
        PyErr_Clear();
        return -1;
    }
    PyCodeObject *code = PyFrame_GetCode(frame);
    PyObject *where = PyLong_FromVoidPtr(code); /* id(code), as recorder keys it */
    PyObject *lasti = PyLong_FromLong(PyFrame_GetLasti(frame));
    Py_DECREF(code);
    PyObject *key = (where && lasti) ? PyTuple_Pack(3, sql, where, lasti) : NULL;
    Py_XDECREF(where);
    Py_XDECREF(lasti);
    PyObject *slot = key ? PyDict_GetItemWithError(sites, key) : NULL; /* borrowed */
    Py_XINCREF(slot);
    Py_XDECREF(key);
    Py_DECREF(sites);
    if (slot == NULL) {
        PyErr_Clear();
        return -1;
    }
    PyObject *ph;
    if (PyTuple_GET_SIZE(params) == 0) {
        ph = Py_NewRef(null_value);
    }
    else {
        Py_hash_t h = PyObject_Hash(params);
        if (h == -1) { /* unhashable values: the slow path copes */
            Py_DECREF(slot);
            PyErr_Clear();
            return -1;
        }
        ph = PyLong_FromSsize_t(h);
    }
    PyObject *calls = PyObject_GetAttr(req, s_calls);
    PyObject *start = now_ns();
    Py_ssize_t i = -1;
    if (calls != NULL && PyList_CheckExact(calls) && ph != NULL && start != NULL) {
        i = PyList_GET_SIZE(calls);
        PyObject *row[ROW] = {slot, start, zero, null_value, ph};
        for (int k = 0; k < ROW; k++) {
            if (PyList_Append(calls, row[k]) < 0) {
                PyList_SetSlice(calls, i, PyList_GET_SIZE(calls), NULL);
                i = -1;
                break;
            }
        }
        if (i >= max_rows) { /* over the limit: counted, not kept */
            PyList_SetSlice(calls, i, PyList_GET_SIZE(calls), NULL);
            PyObject *r = PyObject_CallMethodNoArgs(req, s_dropped);
            Py_XDECREF(r);
            i = -2;
        }
    }
    Py_XDECREF(calls);
    Py_XDECREF(start);
    Py_XDECREF(ph);
    Py_DECREF(slot);
    if (PyErr_Occurred()) {
        failed();
        return -1;
    }
    return i;
}

/* record_call(..., up=1) in Python: the frame above record_call is the application's (this
 * C function has none). Returns the row offset, or -1. */
static Py_ssize_t
record_slow(PyObject *req, PyObject *sql, PyObject *params)
{
    PyObject *text = PyUnicode_CheckExact(sql) ? Py_NewRef(sql)
                                               : PyObject_CallOneArg(sql_text, sql);
    if (text == NULL) {
        failed();
        return -1;
    }
    PyObject *r = PyObject_CallMethodObjArgs(req, s_record_call, s_db, s_sqlite, text, params,
                                             up_one, NULL);
    Py_DECREF(text);
    Py_ssize_t i = r ? PyLong_AsSsize_t(r) : -1;
    Py_XDECREF(r);
    if (PyErr_Occurred()) {
        failed();
        return -1;
    }
    return i;
}

typedef struct {
    PyObject_HEAD
    PyObject *method; /* the C method it wraps, e.g. sqlite3.Cursor.execute */
    int kind;
    vectorcallfunc vectorcall;
} WrapperObject;

static PyObject *
forward(WrapperObject *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return PyObject_Vectorcall(w->method, args, nargsf, kwnames);
}

static PyObject *
execute(WrapperObject *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 2 || nargs > 3 || kwnames != NULL) /* not (self, sql[, params]): the driver says */
        return forward(w, args, nargsf, kwnames);
    PyObject *self = args[0], *sql = args[1];
    PyObject *params = nargs > 2 ? args[2] : empty_tuple;
    PyObject *req = NULL;
    if (current_var == NULL || sql_text == NULL)  /* not configured: nothing to record into */
        return forward(w, args, nargsf, kwnames);
    if (PyContextVar_Get(current_var, NULL, &req) < 0) {
        failed();
        req = NULL;
    }
    Py_ssize_t i = -1;
    if (req != NULL && req != Py_None) {
        i = record_fast(req, sql, params);
        if (i == -1)
            i = record_slow(req, sql, params);
    }
    if (i < 0) {
        Py_XDECREF(req);
        set_counting(self, Py_None);
        return forward(w, args, nargsf, NULL);
    }
    PyObject *result = forward(w, args, nargsf, NULL);
    if (result == NULL) { /* the driver's error: note it on the call, then pass it on */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        set_counting(self, Py_None);
        PyObject *index = PyLong_FromSsize_t(i);
        PyObject *r = index ? PyObject_CallMethodObjArgs(req, s_fail_call, index,
                                                         value ? value : Py_None, NULL)
                            : NULL;
        Py_XDECREF(r);
        Py_XDECREF(index);
        if (PyErr_Occurred())
            failed();
        Py_DECREF(req);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    PyObject *calls = PyObject_GetAttr(req, s_calls);
    Py_DECREF(req);
    PyObject *end = now_ns();
    if (calls == NULL || !PyList_CheckExact(calls) || end == NULL ||
        i + ROW > PyList_GET_SIZE(calls)) {
        Py_XDECREF(calls);
        Py_XDECREF(end);
        failed();
        return result;
    }
    PyList_SetItem(calls, i + END, end); /* steals end */
    PyObject *description = PyObject_GetAttr(self, s_description);
    if (description == Py_None) { /* not a SELECT: the driver knows the rows changed */
        set_counting(self, Py_None);
        PyObject *rc = PyObject_GetAttr(self, s_rowcount);
        if (rc != NULL && PyLong_Check(rc)) {
            long long n = PyLong_AsLongLong(rc);
            if (n >= 0)
                PyList_SetItem(calls, i + ROWS, Py_NewRef(rc));
        }
        Py_XDECREF(rc);
    }
    else if (description != NULL) { /* a SELECT: rows are counted as they are fetched */
        PyList_SetItem(calls, i + ROWS, Py_NewRef(zero));
        PyObject *index = PyLong_FromSsize_t(i + ROWS);
        PyObject *counting = index ? PyTuple_Pack(2, calls, index) : NULL;
        if (counting != NULL)
            set_counting(self, counting);
        Py_XDECREF(counting);
        Py_XDECREF(index);
    }
    Py_XDECREF(description);
    Py_DECREF(calls);
    if (PyErr_Occurred())
        failed();
    return result;
}

/* Add n to the row count the cursor is counting into (if any); stop counting when asked. */
static void
count_rows(PyObject *cursor, Py_ssize_t n, int stop)
{
    PyObject *counting = PyObject_GetAttr(cursor, s_rows_attr);
    if (counting == NULL) {
        failed();
        return;
    }
    if (PyTuple_CheckExact(counting) && PyTuple_GET_SIZE(counting) == 2) {
        if (stop)
            set_counting(cursor, Py_None);
        PyObject *calls = PyTuple_GET_ITEM(counting, 0);
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(counting, 1));
        if (n > 0 && PyList_CheckExact(calls) && at >= 0 && at < PyList_GET_SIZE(calls)) {
            PyObject *by = PyLong_FromSsize_t(n);
            PyObject *sum = by ? PyNumber_Add(PyList_GET_ITEM(calls, at), by) : NULL;
            Py_XDECREF(by);
            if (sum != NULL)
                PyList_SetItem(calls, at, sum);
        }
    }
    Py_DECREF(counting);
    if (PyErr_Occurred())
        failed();
}

static PyObject *
fetch(WrapperObject *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *result = forward(w, args, nargsf, kwnames);
    if (result == NULL || nargs < 1)
        return result;
    PyObject *cursor = args[0];
    switch (w->kind) {
    case FETCHONE:
        if (result == Py_None)
            set_counting(cursor, Py_None);
        else
            count_rows(cursor, 1, 0);
        break;
    case NEXT:
        count_rows(cursor, 1, 0);
        break;
    case FETCHMANY:
    case FETCHALL: {
        Py_ssize_t n = PyList_Check(result) ? PyList_GET_SIZE(result) : 0;
        count_rows(cursor, n, w->kind == FETCHALL);
        break;
    }
    }
    return result;
}

static PyObject *
wrapper_vectorcall(WrapperObject *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (w->kind == EXECUTE)
        return execute(w, args, nargsf, kwnames);
    return fetch(w, args, nargsf, kwnames);
}

static PyObject *
wrapper_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
wrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *method;
    int kind;
    if (!PyArg_ParseTuple(args, "Oi:CursorMethod", &method, &kind))
        return NULL;
    if (kind < EXECUTE || kind > NEXT || !PyCallable_Check(method)) {
        PyErr_SetString(PyExc_ValueError, "a callable and a known kind");
        return NULL;
    }
    WrapperObject *w = (WrapperObject *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->method = Py_NewRef(method);
    w->kind = kind;
    w->vectorcall = (vectorcallfunc)wrapper_vectorcall;
    return (PyObject *)w;
}

static int
wrapper_traverse(WrapperObject *w, visitproc visit, void *arg)
{
    Py_VISIT(w->method);
    return 0;
}

static void
wrapper_dealloc(WrapperObject *w)
{
    PyObject_GC_UnTrack(w);
    Py_CLEAR(w->method);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *
wrapper_wrapped(WrapperObject *w, void *closure)
{
    return Py_NewRef(w->method);
}

static PyGetSetDef wrapper_getset[] = {
    {"__wrapped__", (getter)wrapper_wrapped, NULL, "the C method wrapped", NULL},
    {NULL},
};

static PyTypeObject WrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._speedups.CursorMethod",
    .tp_doc = "CursorMethod(method, kind): a recording sqlite3 cursor method (kinds: EXECUTE, "
              "FETCHONE, FETCHMANY, FETCHALL, NEXT).",
    .tp_basicsize = sizeof(WrapperObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = wrapper_new,
    .tp_dealloc = (destructor)wrapper_dealloc,
    .tp_traverse = (traverseproc)wrapper_traverse,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(WrapperObject, vectorcall),
    .tp_descr_get = wrapper_get,
    .tp_getset = wrapper_getset,
};

static PyObject *
configure(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"current", "sql_text", "internal_error", "max_rows", "perf_counter",
                            NULL};
    PyObject *current = NULL, *text = NULL, *error = NULL, *perf = NULL;
    Py_ssize_t rows = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOnO:configure", names, &current, &text,
                                     &error, &rows, &perf))
        return NULL;
    if (current != NULL)
        Py_XSETREF(current_var, Py_NewRef(current));
    if (text != NULL)
        Py_XSETREF(sql_text, Py_NewRef(text));
    if (error != NULL)
        Py_XSETREF(internal_error, Py_NewRef(error));
    if (perf != NULL)
        Py_XSETREF(perf_counter, perf == Py_None ? NULL : Py_NewRef(perf));
    if (rows >= 0)
        max_rows = rows;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(*, current, sql_text, internal_error, max_rows, perf_counter): what the "
     "wrappers use (each optional); perf_counter: time.perf_counter_ns when it is not "
     "CLOCK_MONOTONIC, else None."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "perfsleuth.agent._speedups",
    "The sqlite3 cursor wrappers of perfsleuth.agent.instrument.dbapi, in C (optional).", -1,
    module_methods,
};

#define INTERN(var, text)                                                                   \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                   \
        return NULL;

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (PyType_Ready(&WrapperType) < 0)
        return NULL;
    INTERN(s_sites, "sites");
    INTERN(s_calls, "calls");
    INTERN(s_rows_attr, "_perfsleuth_rows");
    INTERN(s_description, "description");
    INTERN(s_rowcount, "rowcount");
    INTERN(s_record_call, "record_call");
    INTERN(s_fail_call, "fail_call");
    INTERN(s_dropped, "_dropped");
    INTERN(s_db, "db");
    INTERN(s_sqlite, "sqlite");
    if ((null_value = PyLong_FromLongLong(-9223372036854775807LL - 1)) == NULL ||
        (zero = PyLong_FromLong(0)) == NULL || (one = PyLong_FromLong(1)) == NULL ||
        (up_one = PyLong_FromLong(1)) == NULL || (empty_tuple = PyTuple_New(0)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "CursorMethod", (PyObject *)&WrapperType) < 0 ||
        PyModule_AddIntConstant(m, "EXECUTE", EXECUTE) < 0 ||
        PyModule_AddIntConstant(m, "FETCHONE", FETCHONE) < 0 ||
        PyModule_AddIntConstant(m, "FETCHMANY", FETCHMANY) < 0 ||
        PyModule_AddIntConstant(m, "FETCHALL", FETCHALL) < 0 ||
        PyModule_AddIntConstant(m, "NEXT", NEXT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
