/* perfsleuth.agent._speedups: the agent's per-call and per-request hot paths in C: the sqlite3
 * cursor wrappers of agent.instrument.dbapi, recorder.begin/end, the ASGI send tap and CPU
 * meter, the thread-pool hand-off of agent.instrument.threads, and the writer's request row.
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
 * end and count the rows. A site's first call in the request is handled here too (record_site:
 * the call site, the stack captured or the cached one reused), except the first call of a site
 * under a template line, whose stack has template frames that only Python's capture makes;
 * that, and anything else (odd arguments), goes through record_call in Python. Nothing here
 * raises into the application: an internal failure is counted (recorder.internal_error) and
 * the statement runs unrecorded, and the driver's own exceptions pass through untouched.
 *
 * One file: a CPython extension module is one compilation unit whose types and module state are
 * shared by every part above; each part is a section headed by what it does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
/* CPython 3.11's interpreter frames, read in place (same_stack, record_fast, the hand-off):
 * no frame object made for a frame only looked at */
#define Py_BUILD_CORE
#include "internal/pycore_frame.h"
#include "internal/pycore_context.h"
#undef Py_BUILD_CORE
#define IFRAMES 1
#else
#define IFRAMES 0
#endif

#include <structmember.h>
#if IFRAMES
#define AGENT_C_INT_IN_PLACE
#endif
#include "_agent_c.h"
#include "../wire/_scan_api.h"
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <sched.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#if IFRAMES
/* The frame that called f's code (PyFrame_GetBack's, without its frame object), or NULL. */
static inline _PyInterpreterFrame *
iframe_back(_PyInterpreterFrame *f)
{
    f = f->previous;
    while (f != NULL && _PyFrame_IsIncomplete(f))
        f = f->previous;
    return f;
}

/* PyFrame_GetLasti of an interpreter frame. */
static inline long
iframe_lasti(_PyInterpreterFrame *f)
{
    int lasti = _PyInterpreterFrame_LASTI(f);
    return lasti < 0 ? -1 : (long)lasti * (long)sizeof(_Py_CODEUNIT);
}

/* The running Python frame (PyEval_GetFrame's, without making its frame object), or NULL. */
static inline _PyInterpreterFrame *
iframe_current(void)
{
    return PyThreadState_GET()->cframe->current_frame;
}
#endif

/* Set by configure() (recorder.configure): */
static PyObject *current_var;   /* recorder._current, the request of the running context */
static PyObject *sql_text;      /* dbapi.sql_text: the statement of a non-str argument */
static PyObject *internal_error;/* recorder.internal_error */
static PyObject *perf_counter;  /* time.perf_counter_ns, when CLOCK_MONOTONIC is not its clock */
static Py_ssize_t max_rows = (Py_ssize_t)20000 * 5;
static PyObject *code_kinds;    /* stacks._kind: id(code) -> (code, kind) */
static PyObject *classify_code; /* stacks.classify */
static PyObject *site_cache;    /* recorder._site_cache */
static PyObject *stack_cache;   /* recorder._stack_cache: (id(code), lasti) -> stack */
static Py_ssize_t max_depth = 64, max_sites = 20000;
static int one_stack_per_site = 1; /* PERFSLEUTH_STACKS_PER_SITE is 1: else Python does it */
/* Set once a template engine is loaded (recorder hands them over when stacks.templates_on is
 * set); NULL before: */
static PyObject *template_key;  /* stacks.template_key */
static PyObject *engines;       /* templates._engine: id(code) -> (code, engine) */
static PyObject *engine_of;     /* templates.engine_of */
static PyObject *sink;          /* recorder._sink (None: the agent is off) */
static PyObject *inflight;      /* recorder.inflight */
static PyObject *stats;         /* recorder.stats */
static PyObject *no_sites;      /* recorder._NO_SITES */
static PyObject *default_class; /* recorder.ActiveRequest */

static PyObject *s_rows_attr, *s_description, *s_rowcount;
static PyObject *s_record_call, *s_fail_call, *s_dropped, *s_db, *s_sqlite, *s_params;
static PyObject *null_value;    /* recorder.NULL: -(1 << 63) */
static PyObject *s_empty;       /* "" */
static PyObject *zero, *one, *up_one, *empty_tuple;

/* A call's row in ActiveRequest.calls (a bytearray): five native int64s, these at offsets */
enum { ROW = 40, SLOT = 0, START = 8, END = 16, ROWS = 24, PH = 32 };
#define NULL_LL (-9223372036854775807LL - 1)
enum { EXECUTE, FETCHONE, FETCHMANY, FETCHALL, NEXT, CONN_CURSOR, CONN_EXECUTE };

/* ------------------------------------------------------------------ request objects
 * An ActiveRequest has __slots__: its fields are read and set through their member
 * descriptors' offsets, looked up once per class. */

enum {
    F_TRACE_ID, F_START_WALL, F_START, F_END, F_CPU_START, F_CPU_NS, F_KIND, F_METHOD, F_PATH,
    F_ENDPOINT, F_STATUS, F_ERROR, F_REQ_BYTES, F_RESP_BYTES, F_USER, F_TENANT, F_ATTRS, F_TAGS,
    F_HEADERS, F_CALLS, F_SITES, F_SITE_LIST, F_MORE, F_CALLS_DROPPED, F_TOKEN, F_THREAD, F_TASK,
    F_WORKER, F_GC_NS, F_GC_COUNT, F_KEEP, N_FIELDS
};
static const char *field_names[N_FIELDS] = {
    "trace_id", "start_wall", "start", "end", "cpu_start", "cpu_ns", "kind", "method", "path",
    "endpoint", "status", "error", "req_bytes", "resp_bytes", "user", "tenant", "attrs", "tags",
    "headers", "calls", "sites", "site_list", "more", "calls_dropped", "token", "thread", "task",
    "worker", "gc_ns", "gc_count", "keep",
};

#define MAX_SLOTS 64
typedef struct {
    PyTypeObject *cls; /* borrowed: the class is kept alive by the layouts dict */
    Py_ssize_t offset[N_FIELDS];
    /* every object slot of the class (its own and its bases'), for untrack_ended; -1: the
     * class has more, or an instance __dict__, so its instances are never untracked */
    int n_slots;
    Py_ssize_t slot_offset[MAX_SLOTS];
} Layout;

static PyObject *layouts; /* {class: capsule of its Layout} */
static PyObject *s_requests_recorded;

static void
free_layout(PyObject *capsule)
{
    PyMem_Free(PyCapsule_GetPointer(capsule, "perfsleuth.layout"));
}

/* The slot offsets of an ActiveRequest class (NULL with an error set if it has not them). */
static Layout *last_layout;
static Layout *layout_lookup(PyTypeObject *cls);

/* Inline: every recorded call asks for the same class's layout (the last one found). */
static inline Layout *
layout_of(PyTypeObject *cls)
{
    Layout *last = last_layout;
    if (last != NULL && last->cls == cls)
        return last;
    return layout_lookup(cls);
}

static Layout *
layout_lookup(PyTypeObject *cls)
{
    PyObject *capsule = PyDict_GetItemWithError(layouts, (PyObject *)cls); /* borrowed */
    if (capsule != NULL)
        return last_layout = PyCapsule_GetPointer(capsule, "perfsleuth.layout");
    if (PyErr_Occurred())
        return NULL;
    Layout *layout = PyMem_New(Layout, 1);
    if (layout == NULL)
        return (Layout *)PyErr_NoMemory();
    layout->cls = cls;
    for (int k = 0; k < N_FIELDS; k++) {
        PyObject *descr = PyObject_GetAttrString((PyObject *)cls, field_names[k]);
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX) {
            Py_XDECREF(descr);
            PyMem_Free(layout);
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "%s has no slot %s", cls->tp_name, field_names[k]);
            return NULL;
        }
        layout->offset[k] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
    }
    layout->n_slots = cls->tp_dictoffset != 0 ? -1 : 0;
    PyObject *mro = cls->tp_mro;
    for (Py_ssize_t k = 0; layout->n_slots >= 0 && mro && k < PyTuple_GET_SIZE(mro); k++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, k);
        for (PyMemberDef *m = base->tp_members; m != NULL && m->name != NULL; m++) {
            if (m->type != T_OBJECT_EX && m->type != T_OBJECT)
                continue;
            if (layout->n_slots == MAX_SLOTS) {
                layout->n_slots = -1;
                break;
            }
            layout->slot_offset[layout->n_slots++] = m->offset;
        }
    }
    capsule = PyCapsule_New(layout, "perfsleuth.layout", free_layout);
    if (capsule == NULL || PyDict_SetItem(layouts, (PyObject *)cls, capsule) < 0) {
        if (capsule == NULL)
            PyMem_Free(layout);
        Py_XDECREF(capsule);
        return NULL;
    }
    Py_DECREF(capsule);
    return last_layout = layout;
}

/* Set a slot (steals value; NULL value: an error is set, the slot left alone). */
static inline int
set_field(PyObject *obj, Layout *layout, int field, PyObject *value)
{
    if (value == NULL)
        return -1;
    PyObject **slot = (PyObject **)((char *)obj + layout->offset[field]);
    Py_XSETREF(*slot, value);
    return 0;
}

static inline PyObject *
get_field(PyObject *obj, Layout *layout, int field) /* borrowed, may be NULL (unset) */
{
    return *(PyObject **)((char *)obj + layout->offset[field]);
}

/* CLOCK_MONOTONIC in ns: never fails, runs no Python code. */
static inline long long
wall_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* perf_counter_ns() as a C integer (-1 with an error set when the Python one fails). */
static inline long long
perf_ns(void)
{
    if (perf_counter != NULL) {
        PyObject *t = PyObject_CallNoArgs(perf_counter);
        long long v = t ? as_ll(t) : -1;
        Py_XDECREF(t);
        return v;
    }
    return wall_ns();
}

static PyObject *
now_ns(void)
{
    long long t = perf_ns();
    return t == -1 && PyErr_Occurred() ? NULL : PyLong_FromLongLong(t);
}

static inline void
put(PyObject *calls, Py_ssize_t offset, long long value)
{
    memcpy(PyByteArray_AS_STRING(calls) + offset, &value, sizeof(value));
}

static inline long long
get(PyObject *calls, Py_ssize_t offset)
{
    long long value;
    memcpy(&value, PyByteArray_AS_STRING(calls) + offset, sizeof(value));
    return value;
}

/* Grow the request's rows (an exact bytearray, grown only) to n bytes: 0, or -1 with an error
 * set. bytearray's own resize grows a buffer to the exact size asked whenever that is more
 * than an eighth larger, so every row of a request with fewer than ~40 rows reallocated it (a
 * new block, a copy and a free for each statement); here the buffer is grown by half again
 * (at least GROW_MIN_ROWS rows) and rows are then added in place until it is full. The slack
 * is at most a third of the rows, or 3 rows of a 1-row request (the queue's byte count takes
 * the allocation; the writer reads the length). */
#define GROW_MIN_ROWS 4
static int
grow_calls(PyObject *calls, Py_ssize_t n)
{
    PyByteArrayObject *b = (PyByteArrayObject *)calls;
    Py_ssize_t size = Py_SIZE(b);
    if (n <= size || b->ob_exports > 0) /* not a growth, or a buffer exported: as bytearray */
        return PyByteArray_Resize(calls, n);
    if (b->ob_bytes == NULL || (b->ob_start - b->ob_bytes) + n + 1 > b->ob_alloc) {
        Py_ssize_t want = n + (n >> 1);
        if (want < GROW_MIN_ROWS * ROW)
            want = GROW_MIN_ROWS * ROW;
        if (PyByteArray_Resize(calls, want) < 0)
            return -1;
    }
    Py_SET_SIZE(b, n);
    b->ob_start[n] = '\0'; /* bytearray keeps a trailing NUL */
    return 0;
}

/* Append a row to the request's rows (a bytearray): its offset, or -1 with an error set. */
static Py_ssize_t
append_row(PyObject *calls, PyObject *slot, long long ph)
{
    long long row[5];
    row[0] = as_ll(slot);
    if (row[0] == -1 && PyErr_Occurred())
        return -1;
    row[1] = perf_ns();
    if (row[1] == -1 && PyErr_Occurred())
        return -1;
    row[2] = 0;
    row[3] = NULL_LL;
    row[4] = ph;
    Py_ssize_t i = PyByteArray_GET_SIZE(calls);
    if (grow_calls(calls, i + ROW) < 0)
        return -1;
    memcpy(PyByteArray_AS_STRING(calls) + i, row, ROW);
    return i;
}

/* hash(t) of an exact tuple (-1 with an error set when an item is unhashable). CPython
 * 3.11 on 64 bits: tuplehash's own steps (the same in 3.12 and 3.13), an item that is an
 * exact int of at most one digit or an exact str whose hash is cached hashed in place (what
 * long_hash and unicode_hash give), others by PyObject_Hash: a statement's parameters are
 * mostly such, and the generic calls were most of the cost. */
static inline Py_hash_t
tuple_hash(PyObject *t)
{
#if IFRAMES && SIZEOF_PY_UHASH_T > 4
    const Py_uhash_t p1 = 11400714785074694791ULL, p2 = 14029467366897019727ULL,
                     p5 = 2870177450012600261ULL;
    Py_ssize_t len = PyTuple_GET_SIZE(t);
    Py_uhash_t acc = p5;
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *item = PyTuple_GET_ITEM(t, i);
        Py_uhash_t lane;
        if (PyLong_CheckExact(item) && Py_SIZE(item) >= -1 && Py_SIZE(item) <= 1) {
            Py_hash_t x = Py_SIZE(item) * (Py_hash_t)((PyLongObject *)item)->ob_digit[0];
            lane = (Py_uhash_t)(x == -1 ? -2 : x);
        }
        else if (PyUnicode_CheckExact(item) && ((PyASCIIObject *)item)->hash != -1) {
            lane = (Py_uhash_t)((PyASCIIObject *)item)->hash;
        }
        else {
            lane = (Py_uhash_t)PyObject_Hash(item);
            if (lane == (Py_uhash_t)-1)
                return -1;
        }
        acc += lane * p2;
        acc = (acc << 31) | (acc >> 33);
        acc *= p1;
    }
    acc += (Py_uhash_t)len ^ (p5 ^ 3527539UL);
    return acc == (Py_uhash_t)-1 ? 1546275796 : (Py_hash_t)acc;
#else
    return PyObject_Hash(t);
#endif
}

/* The hash of a statement's parameters as recorded: NULL for none, NULL and no error for
 * unhashable ones (the values are never kept). */
static long long
params_hash(PyObject *params)
{
    if (PyTuple_GET_SIZE(params) == 0)
        return NULL_LL;
    Py_hash_t h = tuple_hash(params);
    if (h == -1) {
        PyErr_Clear();
        return NULL_LL;
    }
    return (long long)h;
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

typedef struct {
    PyObject_HEAD
    PyObject *method; /* the C method it wraps, e.g. sqlite3.Cursor.execute */
    int kind;
    vectorcallfunc vectorcall;
    /* CONN_CURSOR, CONN_EXECUTE: the instrumented cursor class, the Python method for other
     * arguments (a cursor factory), and the EXECUTE wrapper of the cursor class */
    PyObject *cursor_class, *fallback, *execute;
    /* Cursor kinds given cursor_class: where a cursor of exactly that class keeps its
     * _perfsleuth_rows slot and sqlite3's description and rowcount, read and written in place
     * (by name, each is a lookup through the class and more work than the rest of the
     * wrapper). NULL: by name (the class is not laid out as expected). */
    PyMemberDef *m_rows, *m_description, *m_rowcount;
    /* method as its C function when it is a method descriptor of a calling convention forward
     * knows (cfunc_flags: METH_FASTCALL, with METH_KEYWORDS, METH_NOARGS or METH_O), called
     * directly for a self of exactly its class (cfunc_type, borrowed: method holds it) or of
     * the one subclass of it it was first called with (cfunc_subtype, held; cursor_class
     * from the start for the cursor kinds): what the descriptor's own call does after its
     * type check, without the generic call's layers (~100 instructions a call). NULL:
     * through PyObject_Vectorcall. */
    PyCFunction cfunc;
    int cfunc_flags;
    PyTypeObject *cfunc_type, *cfunc_subtype;
} WrapperObject;

/* The cursor's fields are at the offsets of w's members: it is of the class they came from
 * (a subclass could override description with a property). */
static inline int
in_place(WrapperObject *w, PyObject *cursor)
{
    return w->m_rows != NULL && (PyObject *)Py_TYPE(cursor) == w->cursor_class;
}

#define FIELD(obj, m, type) (*(type *)((char *)(obj) + (m)->offset))

/* Set the (calls, ROWS offset) the cursor counts fetched rows into; NULL: none. */
static void
set_counting(WrapperObject *w, PyObject *cursor, PyObject *value)
{
    if (in_place(w, cursor)) {
        Py_XSETREF(FIELD(cursor, w->m_rows, PyObject *), Py_XNewRef(value));
        return;
    }
    if (PyObject_SetAttr(cursor, s_rows_attr, value ? value : Py_None) < 0)
        failed();
}

/* The cursor's counting target (a new reference), or NULL (not counting, or an error: failed()
 * was called). */
static PyObject *
get_counting(WrapperObject *w, PyObject *cursor)
{
    if (in_place(w, cursor))
        return Py_XNewRef(FIELD(cursor, w->m_rows, PyObject *));
    PyObject *counting = PyObject_GetAttr(cursor, s_rows_attr);
    if (counting == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError))
            PyErr_Clear(); /* a slot never set: not counting */
        else
            failed();
    }
    return counting;
}

/* The member of a class named ``name`` if it is a plain member of ``type`` (T_OBJECT...). */
static PyMemberDef *
member_of(PyObject *cls, const char *name, int type, int other_type)
{
    PyObject *d = PyObject_GetAttrString(cls, name);
    PyMemberDef *m = NULL;
    if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        m = ((PyMemberDescrObject *)d)->d_member; /* lives as long as the class */
        if (m->type != type && m->type != other_type)
            m = NULL;
    }
    Py_XDECREF(d);
    PyErr_Clear();
    return m;
}

/* What kind_of and is_engine_frame last read from their dicts (stacks._kind, templates._engine:
 * id(code) -> (code, answer)), by the code's address: a walk up a stack of 20 library frames
 * per statement (an ORM's) otherwise makes an int of each address and looks it up twice.
 * An entry holds the dict's version tag when it was read and is used only while the dict's
 * tag is the same: any insert, pop or clear since changes the tag, so the dict still maps the
 * code to the same answer and still holds the code (its address cannot have been reused). No
 * reference is held. CPython 3.11 (3.12 deprecates the tag): later versions look up the dict. */
#if PY_VERSION_HEX < 0x030C0000
#define MEMO_SIZE 1024 /* a power of two */
typedef struct {
    const void *code;
    uint64_t version;
    int answer;
} MemoEntry;
static MemoEntry kind_memo[MEMO_SIZE], engine_memo[MEMO_SIZE];

static inline MemoEntry *
memo_slot(MemoEntry *memo, const void *code)
{
    return &memo[((uintptr_t)code >> 4) & (MEMO_SIZE - 1)];
}

static inline int
memo_get(MemoEntry *memo, PyObject *dict, const void *code, int *answer)
{
    MemoEntry *e = memo_slot(memo, code);
    if (e->code == code && e->version == ((PyDictObject *)dict)->ma_version_tag) {
        *answer = e->answer;
        return 1;
    }
    return 0;
}

static inline void
memo_put(MemoEntry *memo, PyObject *dict, const void *code, int answer)
{
    MemoEntry *e = memo_slot(memo, code);
    e->code = code;
    e->version = ((PyDictObject *)dict)->ma_version_tag;
    e->answer = answer;
}
#else
#define memo_get(memo, dict, code, answer) 0
#define memo_put(memo, dict, code, answer) ((void)0)
#endif

/* stacks.classify of a code object: 1 application, 0 library, -1 the agent's, -2 error.
 * Consumes a reference to code. */
static int kind_of_code(PyCodeObject *code);

/* stacks.classify of a frame's code: 1 application, 0 library, -1 the agent's, -2 error. */
static int
kind_of(PyFrameObject *frame)
{
    return kind_of_code(PyFrame_GetCode(frame));
}

static int
kind_of_code(PyCodeObject *code)
{
    int known;
    if (PyDict_CheckExact(code_kinds) && memo_get(kind_memo, code_kinds, code, &known)) {
        Py_DECREF(code);
        return known;
    }
    PyObject *id = PyLong_FromVoidPtr(code);
    PyObject *hit = id ? PyDict_GetItemWithError(code_kinds, id) : NULL; /* borrowed */
    Py_XDECREF(id);
    PyObject *k;
    if (hit != NULL && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2 &&
        PyTuple_GET_ITEM(hit, 0) == (PyObject *)code) {
        k = PyTuple_GET_ITEM(hit, 1);
        int r = k == Py_None ? -1 : (k == Py_True ? 1 : 0);
        if (PyDict_CheckExact(code_kinds))
            memo_put(kind_memo, code_kinds, code, r);
        Py_DECREF(code);
        return r;
    }
    if (hit != NULL && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2) {
        k = Py_NewRef(PyTuple_GET_ITEM(hit, 1));
    }
    else if (PyErr_Occurred()) {
        k = NULL;
    }
    else {
        k = PyObject_CallOneArg(classify_code, (PyObject *)code);
    }
    Py_DECREF(code);
    if (k == NULL)
        return -2;
    int r = k == Py_None ? -1 : (k == Py_True ? 1 : 0);
    Py_DECREF(k);
    return r;
}

/* The next frame up (a new reference, or NULL at the root); drops the reference to f. */
static PyFrameObject *
up(PyFrameObject *f)
{
    PyFrameObject *back = PyFrame_GetBack(f);
    Py_DECREF(f);
    return back;
}

/* f, or the first frame above it that is not the agent's (a new reference or NULL). */
static PyFrameObject *
past_agent(PyFrameObject *f, int *error)
{
    Py_XINCREF(f);
    while (f != NULL) {
        int k = kind_of(f);
        if (k == -2) {
            *error = 1;
            Py_DECREF(f);
            return NULL;
        }
        if (k != -1)
            break;
        f = up(f);
    }
    return f;
}

/* stacks.capture(frame): (code, ~f_lasti, ...) from frame up to the request's entry. */
static PyObject *
capture(PyFrameObject *frame)
{
    int error = 0;
    PyFrameObject *f = past_agent(frame, &error);
    PyObject *out = error ? NULL : PyList_New(0);
    Py_ssize_t n = 0;
    while (out != NULL && f != NULL && n < max_depth) {
        int k = kind_of(f);
        if (k == -2) {
            Py_CLEAR(out);
            break;
        }
        if (k == -1)
            break;
        PyCodeObject *code = PyFrame_GetCode(f);
        PyObject *where = PyLong_FromLong(~PyFrame_GetLasti(f));
        if (where == NULL || PyList_Append(out, (PyObject *)code) < 0 ||
            PyList_Append(out, where) < 0)
            Py_CLEAR(out);
        Py_DECREF(code);
        Py_XDECREF(where);
        f = up(f);
        n++;
    }
    Py_XDECREF(f);
    if (out == NULL)
        return NULL;
    PyObject *flat = PyList_AsTuple(out);
    Py_DECREF(out);
    return flat;
}

#if IFRAMES
/* same_stack of an interpreter frame (f: a running frame's record, and flat a tuple). CPython
 * 3.11: the frames read in place, the interpreter's own records of the running calls (f and
 * those it was called from): PyFrame_GetBack would make a frame object for each frame above
 * (an allocation, and a deallocation when its call returns; ~200 instructions a frame). The
 * callers' records stay as they are while this runs (kind_of_code may run Python code:
 * stacks.classify, in frames above them). */
static int
same_stack_at(_PyInterpreterFrame *f, PyObject *flat)
{
    while (f != NULL) { /* past the agent's frames */
        int k = kind_of_code((PyCodeObject *)Py_NewRef(f->f_code));
        if (k == -2)
            return -1;
        if (k != -1)
            break;
        f = iframe_back(f);
    }
    Py_ssize_t n = PyTuple_GET_SIZE(flat), i = 0;
    int same = 1;
    while (f != NULL && i + 1 < n) {
        long long where = as_ll(PyTuple_GET_ITEM(flat, i + 1));
        if ((PyObject *)f->f_code != PyTuple_GET_ITEM(flat, i) || where != ~iframe_lasti(f)) {
            same = 0;
            break;
        }
        f = iframe_back(f);
        i += 2;
    }
    if (same && i != n)
        same = 0;
    if (same && f != NULL && n < 2 * max_depth) { /* capture would go on: not the same */
        int k = kind_of_code((PyCodeObject *)Py_NewRef(f->f_code));
        if (k == -2)
            same = -1;
        else if (k != -1)
            same = 0;
    }
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return same;
}
#endif

/* stacks.same(frame, flat): 1 when capture(frame) would give flat, 0 if not, -1 error. */
static int
same_stack(PyFrameObject *frame, PyObject *flat)
{
    if (!PyTuple_Check(flat))
        return 0;
#if IFRAMES
    return same_stack_at(frame->f_frame, flat);
#else
    int error = 0;
    PyFrameObject *f = past_agent(frame, &error);
    if (error)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(flat), i = 0;
    int same = 1;
    while (f != NULL && i + 1 < n) {
        PyCodeObject *code = PyFrame_GetCode(f);
        long where = PyLong_AsLong(PyTuple_GET_ITEM(flat, i + 1));
        int match = (PyObject *)code == PyTuple_GET_ITEM(flat, i) &&
                    where == ~(long)PyFrame_GetLasti(f);
        Py_DECREF(code);
        if (!match) {
            same = 0;
            break;
        }
        f = up(f);
        i += 2;
    }
    if (same && i != n)
        same = 0;
    if (same && f != NULL && n < 2 * max_depth) { /* capture would go on: not the same */
        int k = kind_of(f);
        if (k == -2)
            same = -1;
        else if (k != -1)
            same = 0;
    }
    Py_XDECREF(f);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return same;
#endif
}

/* Whether f is a template engine's rendering frame (templates.engine_of): 1 yes, 0 no, -1 error. */
static int
is_engine_frame(PyFrameObject *f)
{
    PyCodeObject *code = PyFrame_GetCode(f);
    int known;
    if (PyDict_CheckExact(engines) && memo_get(engine_memo, engines, code, &known)) {
        Py_DECREF(code);
        return known;
    }
    PyObject *id = PyLong_FromVoidPtr(code);
    PyObject *hit = id ? PyDict_GetItemWithError(engines, id) : NULL; /* borrowed */
    Py_XDECREF(id);
    PyObject *e;
    if (hit != NULL && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2 &&
        PyTuple_GET_ITEM(hit, 0) == (PyObject *)code) {
        int r = PyObject_IsTrue(PyTuple_GET_ITEM(hit, 1));
        if (r >= 0 && PyDict_CheckExact(engines))
            memo_put(engine_memo, engines, code, r);
        Py_DECREF(code);
        return r;
    }
    Py_DECREF(code);
    if (hit != NULL && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2)
        e = Py_NewRef(PyTuple_GET_ITEM(hit, 1));
    else if (PyErr_Occurred())
        return -1;
    else
        e = PyObject_CallOneArg(engine_of, (PyObject *)f);
    if (e == NULL)
        return -1;
    int r = PyObject_IsTrue(e);
    Py_DECREF(e);
    return r;
}

/* The stack of a new site (key: (statement, id(code), lasti[, template line])): the one last
 * captured at the same place (recorder._stack_cache, keyed by the key without its statement)
 * when the frames are the same, else a new capture, cached there. A new reference or NULL. */
static PyObject *
stack_at(PyFrameObject *frame, PyObject *key)
{
    if (stack_cache == NULL)
        return capture(frame);
    PyObject *place = PyTuple_GetSlice(key, 1, PyTuple_GET_SIZE(key));
    if (place == NULL)
        return NULL;
    /* held: same_stack may run Python code (stacks.classify), which may clear the cache */
    PyObject *flat = Py_XNewRef(PyDict_GetItemWithError(stack_cache, place));
    if (flat != NULL) {
        int same = same_stack(frame, flat);
        if (same == 1) {
            Py_DECREF(place);
            return flat;
        }
        Py_DECREF(flat);
        if (same < 0) {
            Py_DECREF(place);
            return NULL;
        }
    }
    else if (PyErr_Occurred()) {
        Py_DECREF(place);
        return NULL;
    }
    flat = capture(frame);
    if (flat != NULL) {
        if (PyDict_GET_SIZE(stack_cache) >= max_sites)
            PyDict_Clear(stack_cache);
        if (PyDict_SetItem(stack_cache, place, flat) < 0)
            Py_CLEAR(flat);
    }
    Py_DECREF(place);
    return flat;
}

/* The call site of a statement made from frame (a borrowed reference): the first application
 * frame (else the first frame that is not the agent's), as recorder's Python path finds it,
 * walking at most max_depth frames; *templated: whether a template engine's frame is among the
 * frames stacks.capture(frame) walks (only looked for while engines are known), found in the
 * same walk; *depth: how many frames above frame the site is when it is an application frame,
 * else -1. Returns 0 with *site a new reference (NULL: no frame), -1 on error. */
static int
find_site(PyFrameObject *frame, PyFrameObject **site, int *templated, Py_ssize_t *depth)
{
    PyFrameObject *f = (PyFrameObject *)Py_XNewRef(frame), *leaf = NULL;
    int found = 0, site_done = 0, tpl_done = engines == NULL, started = 0;
    Py_ssize_t site_depth = 0, tpl_depth = 0;
    *site = NULL;
    *templated = 0;
    *depth = -1;
    while (f != NULL && !(site_done && tpl_done)) {
        int k = kind_of(f);
        if (k == -2)
            goto error;
        if (!site_done) {
            if (site_depth >= max_depth) {
                site_done = 1;
            }
            else if (k == 1) {
                *site = (PyFrameObject *)Py_NewRef(f);
                *depth = site_depth;
                found = site_done = 1;
            }
            else if (k == 0 && leaf == NULL) {
                leaf = (PyFrameObject *)Py_NewRef(f);
            }
            site_depth++;
        }
        if (!tpl_done) {
            if (k != -1)
                started = 1; /* capture skips the agent's innermost frames, then stops at one */
            else if (started)
                tpl_done = 1;
            if (started && !tpl_done) {
                if (tpl_depth >= max_depth) {
                    tpl_done = 1;
                }
                else {
                    int e = is_engine_frame(f);
                    if (e < 0)
                        goto error;
                    if (e) {
                        *templated = 1;
                        tpl_done = 1;
                    }
                    tpl_depth++;
                }
            }
        }
        if (site_done && tpl_done)
            break;
        f = up(f);
    }
    Py_XDECREF(f);
    if (!found)
        *site = leaf;
    else
        Py_XDECREF(leaf);
    return 0;
error:
    Py_XDECREF(f);
    Py_XDECREF(leaf);
    Py_CLEAR(*site);
    return -1;
}

/* Note a call's parameters that are not a tuple (a dict, a list) on its row, for the writer
 * to hash: req.more[i]["params"] (recorder.ActiveRequest._note). 0, or -1 with an error. */
static int
note_params(PyObject *req, Layout *layout, Py_ssize_t i, PyObject *params)
{
    PyObject *more = get_field(req, layout, F_MORE);
    if (more == NULL || more == Py_None) {
        more = PyDict_New();
        if (set_field(req, layout, F_MORE, more) < 0)
            return -1;
    }
    if (!PyDict_CheckExact(more)) {
        PyErr_SetString(PyExc_TypeError, "more is not a dict");
        return -1;
    }
    PyObject *index = PyLong_FromSsize_t(i);
    if (index == NULL)
        return -1;
    PyObject *entry = PyDict_GetItemWithError(more, index); /* borrowed */
    int r;
    if (entry != NULL && PyDict_CheckExact(entry)) {
        r = PyDict_SetItem(entry, s_params, params);
    }
    else if (PyErr_Occurred()) {
        r = -1;
    }
    else {
        PyObject *fresh = PyDict_New();
        r = fresh == NULL || PyDict_SetItem(fresh, s_params, params) < 0 ||
                    PyDict_SetItem(more, index, fresh) < 0
                ? -1
                : 0;
        Py_XDECREF(fresh);
    }
    Py_DECREF(index);
    return r;
}

/* What record_site found for a statement made from a frame (its code and instruction): the
 * site entry it used (the one in site_cache under the entry's key). A request's first call at
 * the same place, with the same frames above it (same_stack against the entry's stack, the
 * check record_site makes before reusing an entry anyway), then skips the walk for the call
 * site and the template frames, whose answers depend on the frames' code only: the site is the
 * same frame of the same stack, and no template frame is among them. Kept only for a site that
 * is an application frame within the stack and no template frame; used only while site_cache
 * still maps the key to that entry (forget_sites or a full cache clear it) and while the code
 * kinds and the template engines' dicts are as they were (their version tags, as kind_of's memo:
 * a code classified anew moves the site). Direct-mapped, by the statement's, the code's and the
 * instruction's address; holds the statement and the entry (which holds the frame's code, the
 * stack's first); emptied by configure and forget_memo. CPython 3.11 only (the version tags). */
#define SITE_MEMO_SIZE 64 /* a power of two */
typedef struct {
    PyObject *sql;
    const void *code;
    int lasti;
    int at_frame; /* the site is the calling frame itself (site_depth 0) */
    uint64_t kinds_version, engines_version;
    PyObject *entry;
    /* the hash of the entry's key (a tuple's is computed anew each time), and site_cache's
     * version tag when it was last seen to map the key to the entry (a lookup saved while
     * no site is added or dropped) */
    Py_hash_t key_hash;
    uint64_t cache_version;
} SiteMemo;
static SiteMemo site_memo[SITE_MEMO_SIZE];

#if PY_VERSION_HEX < 0x030C0000
#define SITE_MEMO 1
static inline uint64_t
dict_version(PyObject *dict) /* 0: no dict */
{
    return dict != NULL && PyDict_CheckExact(dict) ? ((PyDictObject *)dict)->ma_version_tag : 0;
}
#else
#define SITE_MEMO 0
#define dict_version(dict) 0
#endif

static inline SiteMemo *
site_memo_slot(PyObject *sql, const void *code, int lasti)
{
    uintptr_t h = ((uintptr_t)sql >> 4) ^ ((uintptr_t)code >> 6) ^ (uintptr_t)(unsigned)lasti;
    return &site_memo[(h ^ (h >> 7)) & (SITE_MEMO_SIZE - 1)];
}

/* A request's sites dict read and written with a memo's key hash (CPython 3.11's known-hash
 * calls; later versions have no memo and never get here). */
#if SITE_MEMO
#define site_get(d, key, hash) _PyDict_GetItem_KnownHash((d), (key), (hash))
#define site_set(d, key, hash, value) _PyDict_SetItem_KnownHash((d), (key), (value), (hash))
#else
#define site_get(d, key, hash) PyDict_GetItemWithError((d), (key))
#define site_set(d, key, hash, value) PyDict_SetItem((d), (key), (value))
#endif

/* Whether site_cache still maps the memo's key to its entry (0 also on an error, set). */
static inline int
site_cached(SiteMemo *memo)
{
    uint64_t version = dict_version(site_cache);
    if (SITE_MEMO && version != 0 && version == memo->cache_version)
        return 1; /* site_cache unchanged since it mapped the key to the entry */
    PyObject *key = PyTuple_GET_ITEM(memo->entry, 4);
    if (site_get(site_cache, key, memo->key_hash) != memo->entry)
        return 0;
    memo->cache_version = version;
    return 1;
}

static void
clear_site_memo(void)
{
    for (int i = 0; i < SITE_MEMO_SIZE; i++) {
        SiteMemo *m = &site_memo[i];
        PyObject *sql = m->sql, *entry = m->entry;
        m->sql = m->entry = NULL;
        m->code = NULL;
        m->lasti = -1;
        Py_XDECREF(sql);
        Py_XDECREF(entry);
    }
}

/* One statement object a shape: statements made with their literals written into the text (an
 * f-string's, a sqlcommenter comment's trace id) are a new str each time, which the site entry
 * and the queue would keep until the writer has encoded the request and the site cache has let
 * it go: thousands of texts, each a fresh allocation. Kept that long they made the app itself
 * slower (an in-process app with 20 distinct 1.5 KB statements a request: +15-20 % CPU a
 * request with only 20,000 such texts held, no agent at all). So a statement is recorded as
 * the first one made with the same tokens (wire/_fingerprint.c's pass, through its SCAN
 * capsule: literals and placeholders -> ?, comments out, whitespace folded: what the writer
 * fingerprints first), and the app's own text is freed when the app lets it go. Equal tokens,
 * equal fingerprint: the writer fingerprints the shared text to what it would have made of
 * each. The tokens are written into a static buffer (the lock is held: nothing else writes
 * it) and looked up by a 64-bit FNV-1a hash, then compared whole: no str is made for them and
 * no SipHash runs over them (a third of the work before). A statement longer than
 * SHARE_MAX_CHARS is recorded as made (its scan is the writer's, without the interpreter
 * lock), and so is one whose tokens' hash another shape holds (not shared, never mixed up).
 * scan_api (configure's statement_scan) is NULL without the C tokenizer. */
#define SHARE_MAX_CHARS 8192
#define SHARE_MEMO_SIZE 64 /* a power of two */
#define SHARE_ENTRY_BYTES 250 /* a shape beside its texts: two dict slots, its key, its tuple */
static ScanAPI *scan_api;      /* wire._fingerprint's, or NULL */
static PyObject *scan_capsule;  /* holds scan_api's module */
static PyObject *shapes;        /* hash of the tokens -> (tokens as bytes, the first statement) */
/* those first statements -> themselves: a text made anew each time but always the same (an
 * ORM's, with placeholders) is found by its text (hashed once, for this and the site key),
 * without a scan */
static PyObject *firsts;
static Py_ssize_t shapes_bytes, shapes_limit = 1 << 20;
static char share_scratch[SHARE_MAX_CHARS * 4];
/* the statement objects seen last (a constant is the same object at every call), held */
static struct {
    PyObject *made, *shared;
} share_memo[SHARE_MEMO_SIZE];

static void
clear_shapes(void)
{
    for (int i = 0; i < SHARE_MEMO_SIZE; i++) {
        Py_CLEAR(share_memo[i].made);
        Py_CLEAR(share_memo[i].shared);
    }
    if (shapes != NULL)
        PyDict_Clear(shapes);
    if (firsts != NULL)
        PyDict_Clear(firsts);
    shapes_bytes = 0;
}

static inline Py_ssize_t
text_bytes(PyObject *s)
{
    return PyUnicode_GET_LENGTH(s) * (Py_ssize_t)PyUnicode_KIND(s);
}

/* The first statement made with sql's tokens (a new reference): sql itself when it is the first,
 * or when its tokens' hash belongs to another shape; NULL with an error set. */
static PyObject *
first_of_shape(PyObject *sql)
{
    int width = 1;
    Py_ssize_t len = scan_api->scan_into(sql, share_scratch, SHARE_MAX_CHARS, &width);
    if (len < 0)
        return Py_NewRef(sql);
    size_t size = (size_t)len * (size_t)width;
    PyObject *key = PyLong_FromUnsignedLongLong(scan_api->hash(share_scratch, size) ^ (unsigned)width);
    if (key == NULL)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(shapes, key); /* borrowed */
    if (entry != NULL) {
        Py_DECREF(key);
        PyObject *held = PyTuple_GET_ITEM(entry, 0);
        int same = (size_t)PyBytes_GET_SIZE(held) == size &&
                   memcmp(PyBytes_AS_STRING(held), share_scratch, size) == 0;
        return Py_NewRef(same ? PyTuple_GET_ITEM(entry, 1) : sql);
    }
    PyObject *held = PyErr_Occurred() ? NULL : PyBytes_FromStringAndSize(share_scratch, (Py_ssize_t)size);
    entry = held ? PyTuple_Pack(2, held, sql) : NULL;
    Py_XDECREF(held);
    if (entry == NULL || PyDict_SetItem(shapes, key, entry) < 0 ||
        PyDict_SetItem(firsts, sql, sql) < 0) {
        Py_XDECREF(entry);
        Py_DECREF(key);
        return NULL;
    }
    Py_DECREF(entry);
    Py_DECREF(key);
    shapes_bytes += SHARE_ENTRY_BYTES + (Py_ssize_t)size + text_bytes(sql);
    if (shapes_bytes > shapes_limit) /* loses sharing only: entries hold theirs */
        clear_shapes();
    return Py_NewRef(sql);
}

/* The statement to record for sql (an exact str): a new reference, or NULL with an error set. */
static PyObject *
shared_statement(PyObject *sql)
{
    if (scan_api == NULL || shapes == NULL || firsts == NULL ||
        PyUnicode_GET_LENGTH(sql) > SHARE_MAX_CHARS)
        return Py_NewRef(sql);
    uintptr_t h = (uintptr_t)sql >> 4;
    int slot = (int)((h ^ (h >> 7)) & (SHARE_MEMO_SIZE - 1));
    if (share_memo[slot].made == sql)
        return Py_NewRef(share_memo[slot].shared);
    /* Remembered by its object only when it was hashed before (a constant, a str used again):
     * a text made for this call is never seen again, and the memo would keep it. */
    int reused = ((PyASCIIObject *)sql)->hash != -1;
    PyObject *shared = PyDict_GetItemWithError(firsts, sql); /* borrowed */
    if (shared != NULL)
        Py_INCREF(shared);
    else if (PyErr_Occurred() || (shared = first_of_shape(sql)) == NULL)
        return NULL;
    if (reused) {
        PyObject *old_made = share_memo[slot].made, *old_shared = share_memo[slot].shared;
        share_memo[slot].made = Py_NewRef(sql);
        share_memo[slot].shared = Py_NewRef(shared);
        Py_XDECREF(old_made);
        Py_XDECREF(old_shared);
    }
    return shared;
}

/* The fast path of record_call: the row offset, -1 when the call is not on it (no error set),
 * -2 when the request holds PERFSLEUTH_MAX_CALLS calls (the call was counted as dropped). */
/* The last fast-path lookup (statement, frame code, instruction, request) and its slot: in an
 * N+1 loop the next call is the same, and the dict lookup (a key tuple to build and hash) is
 * most of the fast path's work. Holds the request and the statement so that their addresses
 * cannot be reused while remembered. */
static PyObject *last_req, *last_sql;
static PyCodeObject *last_code;
static int last_lasti = -1;
static PyObject *last_slot;

static Py_ssize_t
record_fast(PyObject *req, PyObject *sql, PyObject *params)
{
#if IFRAMES
    _PyInterpreterFrame *frame = iframe_current(); /* the application's frame, read in place */
#else
    PyFrameObject *frame = PyEval_GetFrame(); /* borrowed: the application's frame */
#endif
    if (frame == NULL || !PyUnicode_CheckExact(sql) || !PyTuple_CheckExact(params))
        return -1;
    Layout *layout = layout_of(Py_TYPE(req));
    if (layout == NULL) {
        PyErr_Clear();
        return -1;
    }
    PyObject *sites = get_field(req, layout, F_SITES);
    PyObject *calls = get_field(req, layout, F_CALLS);
    if (sites == NULL || !PyDict_CheckExact(sites) || calls == NULL ||
        !PyByteArray_CheckExact(calls))
        return -1;
#if IFRAMES
    PyCodeObject *code = (PyCodeObject *)Py_NewRef(frame->f_code);
    int lasti = (int)iframe_lasti(frame);
#else
    PyCodeObject *code = PyFrame_GetCode(frame);
    int lasti = PyFrame_GetLasti(frame);
#endif
    PyObject *slot;
    if (req == last_req && sql == last_sql && code == last_code && lasti == last_lasti) {
        slot = Py_NewRef(last_slot);
    }
    else {
        /* record_site's memo of the place, when its site is this frame, holds the key this
         * would build (same statement, id(code), lasti), with its hash */
        SiteMemo *memo = site_memo_slot(sql, code, lasti);
        if (SITE_MEMO && memo->sql == sql && memo->code == code && memo->lasti == lasti &&
            memo->at_frame) {
            slot = site_get(sites, PyTuple_GET_ITEM(memo->entry, 4), memo->key_hash);
        }
        else {
            PyObject *where = PyLong_FromVoidPtr(code); /* id(code), as recorder keys it */
            PyObject *at = PyLong_FromLong(lasti);
            PyObject *key = (where && at) ? PyTuple_Pack(3, sql, where, at) : NULL;
            Py_XDECREF(where);
            Py_XDECREF(at);
            slot = key ? PyDict_GetItemWithError(sites, key) : NULL; /* borrowed */
            Py_XDECREF(key);
        }
        Py_XINCREF(slot);
        if (slot != NULL) {
            Py_XSETREF(last_req, Py_NewRef(req));
            Py_XSETREF(last_sql, Py_NewRef(sql));
            Py_XSETREF(last_slot, Py_NewRef(slot));
            last_code = code; /* kept alive by the site entry the slot names */
            last_lasti = lasti;
        }
    }
    Py_DECREF(code);
    if (slot == NULL) {
        PyErr_Clear();
        return -1;
    }
    long long ph = NULL_LL;
    if (PyTuple_GET_SIZE(params) > 0) {
        Py_hash_t h = tuple_hash(params);
        if (h == -1) { /* unhashable values: the slow path copes */
            Py_DECREF(slot);
            PyErr_Clear();
            return -1;
        }
        ph = (long long)h;
    }
    Py_ssize_t i;
    if (PyByteArray_GET_SIZE(calls) >= max_rows) { /* over the limit: counted, not kept */
        PyObject *r = PyObject_CallMethodNoArgs(req, s_dropped);
        Py_XDECREF(r);
        i = -2;
    }
    else {
        i = append_row(calls, slot, ph);
    }
    Py_DECREF(slot);
    if (PyErr_Occurred()) {
        failed();
        return -1;
    }
    return i;
}

/* Forget the last request of record_fast (end): it is no longer recorded into. */
static void
forget_last(PyObject *req)
{
    if (req == last_req) {
        Py_CLEAR(last_req);
        Py_CLEAR(last_sql);
        Py_CLEAR(last_slot);
        last_code = NULL;
        last_lasti = -1;
    }
}

/* Append entry to the request's site list and map key to its index in the request's sites:
 * the index (borrowed: the dict holds it), or NULL with an exception set. */
static PyObject *
add_site(PyObject *site_list, PyObject *sites, PyObject *key, Py_hash_t hash, PyObject *entry)
{
    if (PyList_Append(site_list, entry) < 0)
        return NULL;
    PyObject *index = PyLong_FromSsize_t(PyList_GET_SIZE(site_list) - 1);
    if (index == NULL || (hash != -1 ? site_set(sites, key, hash, index)
                                     : PyDict_SetItem(sites, key, index)) < 0) {
        Py_XDECREF(index);
        return NULL;
    }
    Py_DECREF(index);
    return index;
}

/* record_call's slow path (recorder.ActiveRequest._record_call) for a statement (an exact
 * str) made from frame (borrowed: the wrapper's caller), its parameters a tuple, None (none)
 * or anything else (a dict, a list: noted on the row for the writer to hash): the call site,
 * the request's site entry (the shared one when the frames are the same, else the stack last
 * captured at the same place when its frames are the same, else a new capture), the row.
 * Returns the row offset; -1 when it cannot (the caller then asks Python), -2 when the request
 * is full (counted). */
static Py_ssize_t
record_site(PyObject *req, PyObject *kind, PyObject *system, PyObject *sql, PyObject *params,
            PyFrameObject *frame, int running)
{
#if IFRAMES
    _PyInterpreterFrame *cur = running ? iframe_current() : NULL;
    if (running && cur == NULL)
        return -1;
#else
    assert(!running);
#endif
    if ((frame == NULL && !running) || !one_stack_per_site || code_kinds == NULL ||
        site_cache == NULL || !PyUnicode_CheckExact(sql))
        return -1;
    Py_ssize_t result = -1;
    Layout *layout = layout_of(Py_TYPE(req));
    PyObject *calls = layout ? Py_XNewRef(get_field(req, layout, F_CALLS)) : NULL;
    PyObject *sites = calls ? Py_XNewRef(get_field(req, layout, F_SITES)) : NULL;
    PyObject *site_list = sites ? Py_XNewRef(get_field(req, layout, F_SITE_LIST)) : NULL;
    PyObject *key = NULL, *entry = NULL;
    PyFrameObject *f = NULL;
    if (site_list == NULL)
        goto done;
    PyObject *ended = get_field(req, layout, F_END);
    if (ended == NULL || !PyLong_CheckExact(ended))
        goto done;
#if IFRAMES
    int is_ended = Py_SIZE(ended) != 0; /* an exact int, not 0 (3.11's layout) */
#else
    int is_ended = PyObject_IsTrue(ended);
#endif
    if (is_ended) { /* a call after the request ended: not its (recorder) */
        result = -2;
        goto done;
    }
    if (calls == Py_None || site_list == Py_None) { /* the request's first call */
        Py_SETREF(calls, PyByteArray_FromStringAndSize(NULL, 0));
        Py_SETREF(sites, PyDict_New());
        Py_SETREF(site_list, PyList_New(0));
        if (calls == NULL || sites == NULL || site_list == NULL)
            goto done;
        set_field(req, layout, F_CALLS, Py_NewRef(calls));
        set_field(req, layout, F_SITE_LIST, Py_NewRef(site_list));
        set_field(req, layout, F_SITES, Py_NewRef(sites));
    }
    if (!PyByteArray_CheckExact(calls) || !PyDict_CheckExact(sites) ||
        !PyList_CheckExact(site_list))
        goto done;
    if (PyByteArray_GET_SIZE(calls) >= max_rows) {
        PyObject *r = PyObject_CallMethodNoArgs(req, s_dropped);
        Py_XDECREF(r);
        result = -2;
        goto done;
    }
    long long ph = NULL_LL;
    if (PyTuple_CheckExact(params)) {
        ph = params_hash(params);
    }
    else if (params == Py_None) {
        params = NULL;
    }
    int templated = 0;
    Py_ssize_t site_depth = -1;
    Py_hash_t key_hash = -1; /* the key's hash when known (a memo's) */
    PyCodeObject *fcode;
    int flasti;
#if IFRAMES
    if (running) {
        fcode = cur->f_code; /* the frame holds it */
        flasti = (int)iframe_lasti(cur);
    }
    else
#endif
    {
        fcode = PyFrame_GetCode(frame);
        flasti = PyFrame_GetLasti(frame);
        Py_DECREF(fcode); /* the frame holds it */
    }
    SiteMemo *memo = site_memo_slot(sql, fcode, flasti);
    if (SITE_MEMO && memo->sql == sql && memo->code == fcode && memo->lasti == flasti &&
        memo->kinds_version == dict_version(code_kinds) &&
        memo->engines_version == dict_version(engines)) {
        PyObject *known = memo->entry;
        if (PyTuple_GET_ITEM(known, 0) == kind && PyTuple_GET_ITEM(known, 1) == system &&
            site_cached(memo)) {
            entry = Py_NewRef(known); /* held: same_stack may run Python code */
            /* read now: that code may rewrite the slot (another statement's key and hash) */
            int at_frame = memo->at_frame;
            Py_hash_t known_hash = memo->key_hash;
            PyObject *flat = PyTuple_GET_ITEM(entry, 3);
#if IFRAMES
            int same = !PyTuple_Check(flat) ? 0
                       : running            ? same_stack_at(cur, flat)
                                            : same_stack(frame, flat);
#else
            int same = same_stack(frame, flat);
#endif
            if (same < 0)
                goto done;
            if (same) {
                key = Py_NewRef(PyTuple_GET_ITEM(entry, 4));
                key_hash = known_hash;
                site_depth = at_frame ? 0 : -1;
                goto have_entry;
            }
            Py_CLEAR(entry);
        }
        else if (PyErr_Occurred()) {
            goto done;
        }
    }
    if (running && (frame = PyEval_GetFrame()) == NULL) /* borrowed; made now, when needed */
        goto done;
    if (find_site(frame, &f, &templated, &site_depth) < 0)
        goto done;
    PyObject *where, *lasti;
    if (f != NULL) {
        PyCodeObject *code = PyFrame_GetCode(f);
        where = PyLong_FromVoidPtr(code); /* id(code), as recorder keys it */
        Py_DECREF(code);
        lasti = PyLong_FromLong(PyFrame_GetLasti(f));
    }
    else {
        where = PyLong_FromLong(0);
        lasti = PyLong_FromLong(0);
    }
    key = (where && lasti) ? PyTuple_Pack(3, sql, where, lasti) : NULL;
    if (key != NULL && templated) {
        /* A call under a template line is a site of its own, keyed by that line too
         * (stacks.template_key, as recorder's Python path keys it): its row goes here when
         * the request has the site, its first call to Python, whose capture has the
         * template frames. A call under no template stays here, whole. */
        PyObject *tkey = PyObject_CallOneArg(template_key, (PyObject *)frame);
        if (tkey != NULL && tkey != Py_None)
            Py_SETREF(key, PyTuple_Pack(4, sql, where, lasti, tkey));
        else
            Py_CLEAR(key); /* an error, or an engine's frame without a template line */
        Py_XDECREF(tkey);
        if (key != NULL) {
            PyObject *known = PyDict_GetItemWithError(sites, key); /* borrowed */
            if (known == NULL)
                Py_CLEAR(key); /* the site's first call in the request */
        }
    }
    Py_XDECREF(where);
    Py_XDECREF(lasti);
    if (key == NULL)
        goto done;
have_entry:;
    PyObject *slot = key_hash != -1 ? site_get(sites, key, key_hash)
                                    : PyDict_GetItemWithError(sites, key); /* borrowed */
    if (slot == NULL && entry != NULL) { /* a memo's entry, its stack compared: reused */
        if (PyErr_Occurred())
            goto done;
        slot = add_site(site_list, sites, key, key_hash, entry);
        if (slot == NULL)
            goto done;
    }
    else if (slot == NULL) {
        if (PyErr_Occurred())
            goto done;
        entry = PyDict_GetItemWithError(site_cache, key); /* borrowed */
        Py_XINCREF(entry);
        if (entry == NULL && PyErr_Occurred())
            goto done;
        int reuse = 0;
        if (entry != NULL && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 5) {
            int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, 0), kind, Py_EQ);
            if (same == 1)
                same = PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, 1), system, Py_EQ);
            if (same < 0)
                goto done;
            if (same == 1) {
                reuse = same_stack(frame, PyTuple_GET_ITEM(entry, 3));
                if (reuse < 0)
                    goto done;
            }
        }
        if (!reuse) {
            PyObject *flat = stack_at(frame, key);
            if (flat == NULL)
                goto done;
            Py_XSETREF(entry, PyTuple_Pack(5, kind, system, sql, flat, key));
            Py_DECREF(flat);
            if (entry == NULL)
                goto done;
            if (PyDict_GET_SIZE(site_cache) >= max_sites)
                PyDict_Clear(site_cache);
            if (PyDict_SetItem(site_cache, key, entry) < 0)
                goto done;
        }
        PyObject *flat = PyTuple_GET_ITEM(entry, 3);
        Py_hash_t hash = -1;
        if (SITE_MEMO && !templated && site_depth >= 0 && PyTuple_GET_SIZE(key) == 3 &&
            PyTuple_CheckExact(flat) && 2 * site_depth < PyTuple_GET_SIZE(flat) &&
            PyTuple_GET_ITEM(flat, 0) == (PyObject *)fcode &&
            (hash = PyObject_Hash(key)) != -1) {
            /* the stack starts at frame (not the agent's) and holds the site */
            PyObject *old_sql = memo->sql, *old_entry = memo->entry;
            memo->sql = Py_NewRef(sql);
            memo->code = fcode;
            memo->lasti = flasti;
            memo->kinds_version = dict_version(code_kinds);
            memo->engines_version = dict_version(engines);
            memo->at_frame = site_depth == 0;
            memo->entry = Py_NewRef(entry);
            memo->key_hash = hash;
            /* site_cache's tag only while it maps the key to the entry: Python code run since
             * it was read (same_stack, stack_at: stacks.classify) may have emptied it */
            PyObject *cached = site_get(site_cache, key, hash);
            memo->cache_version = cached == entry ? dict_version(site_cache) : 0;
            if (cached == NULL)
                PyErr_Clear();
            Py_XDECREF(old_sql);
            Py_XDECREF(old_entry);
        }
        else if (hash == -1 && PyErr_Occurred()) {
            goto done;
        }
        slot = add_site(site_list, sites, key, hash, entry);
        if (slot == NULL)
            goto done;
    }
    if (site_depth == 0 && !templated && PyTuple_GET_SIZE(key) == 3) {
        /* the site is the calling frame: record_fast's key is the site's, so its next call
         * there in this request takes the slot without looking the key up */
        Py_XSETREF(last_req, Py_NewRef(req));
        Py_XSETREF(last_sql, Py_NewRef(sql));
        Py_XSETREF(last_slot, Py_NewRef(slot));
        last_code = fcode; /* kept alive by the site entry the slot names (its stack's first) */
        last_lasti = flasti;
    }
    Py_ssize_t i = append_row(calls, slot, ph);
    if (i < 0)
        goto done;
    /* the row is the call's from here: a failure to note its parameters is counted, and the
     * row returned (the caller must not take Python's path, which would append another) */
    if (params != NULL && !PyTuple_CheckExact(params) && note_params(req, layout, i, params) < 0)
        failed();
    result = i;
done:
    Py_XDECREF(f);
    Py_XDECREF(key);
    Py_XDECREF(entry);
    Py_XDECREF(calls);
    Py_XDECREF(sites);
    Py_XDECREF(site_list);
    if (PyErr_Occurred()) {
        failed();
        return -1;
    }
    return result;
}

/* recorder.ActiveRequest.record_call for a statement, in C: record_call(req, kind, system,
 * statement, params, up), up counted from the Python function calling it (0: that function's
 * own frame). The row offset, -1 when Python's path must do it (not a str statement, a
 * template site's first call, an internal error: counted), -2 when the request is full
 * (counted). */
static PyObject *
py_record_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "record_call(req, kind, system, target, params, up)");
        return NULL;
    }
    PyObject *req = args[0], *sql = args[3];
    Py_ssize_t up_n = PyLong_AsSsize_t(args[5]);
    if (up_n == -1 && PyErr_Occurred())
        return NULL;
    if (!PyUnicode_CheckExact(sql) || !PyUnicode_CheckExact(args[1]) ||
        !PyUnicode_CheckExact(args[2]))
        return PyLong_FromLong(-1);
    PyFrameObject *f = (PyFrameObject *)Py_XNewRef(PyEval_GetFrame());
    for (Py_ssize_t k = 0; f != NULL && k < up_n; k++)
        f = up(f);
    if (f == NULL)
        return PyLong_FromLong(-1);
    PyObject *statement = shared_statement(sql);
    if (statement == NULL) {
        Py_DECREF(f);
        return NULL;
    }
    Py_ssize_t i = record_site(req, args[1], args[2], statement, args[4], f, 0);
    Py_DECREF(statement);
    Py_DECREF(f);
    return PyLong_FromSsize_t(i);
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

/* A C function returned a result with an exception set (a defect of the function): the
 * SystemError the generic call raises then (_Py_CheckFunctionResult), caused by that
 * exception. */
static void
result_with_error(PyObject *callable)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyErr_Format(PyExc_SystemError, "%R returned a result with an exception set", callable);
    PyObject *type2, *value2, *tb2;
    PyErr_Fetch(&type2, &value2, &tb2);
    PyErr_NormalizeException(&type2, &value2, &tb2);
    if (value != NULL && value2 != NULL) {
        PyException_SetCause(value2, Py_NewRef(value));
        PyException_SetContext(value2, Py_NewRef(value));
    }
    PyErr_Restore(type2, value2, tb2);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static Py_ALWAYS_INLINE inline PyObject *
forward(WrapperObject *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyCFunction f = w->cfunc;
    if (f == NULL || nargs < 1 || kwnames != NULL)
        return PyObject_Vectorcall(w->method, args, nargsf, kwnames);
    PyTypeObject *type = Py_TYPE(args[0]);
    if (type != w->cfunc_type && type != w->cfunc_subtype) {
        if (w->cfunc_subtype != NULL || !PyType_IsSubtype(type, w->cfunc_type))
            return PyObject_Vectorcall(w->method, args, nargsf, kwnames);
        w->cfunc_subtype = (PyTypeObject *)Py_NewRef(type); /* the first subclass seen */
    }
    /* No recursion check, as the interpreter's own call of such a method (CPython 3.11's
     * specialized instruction): Python code it runs (an adapter, a SQL function) checks. */
    PyObject *result;
    switch (w->cfunc_flags) {
    case METH_FASTCALL:
        result = ((_PyCFunctionFast)(void (*)(void))f)(args[0], args + 1, nargs - 1);
        break;
    case METH_FASTCALL | METH_KEYWORDS:
        result = ((_PyCFunctionFastWithKeywords)(void (*)(void))f)(args[0], args + 1, nargs - 1,
                                                                    NULL);
        break;
    case METH_NOARGS:
        if (nargs != 1)
            return PyObject_Vectorcall(w->method, args, nargsf, kwnames); /* its TypeError */
        result = f(args[0], NULL);
        break;
    default: /* METH_O */
        if (nargs != 2)
            return PyObject_Vectorcall(w->method, args, nargsf, kwnames); /* its TypeError */
        result = f(args[0], args[1]);
        break;
    }
    /* as the generic call checks a C result (_Py_CheckFunctionResult) */
    if (result == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_SystemError, "a C method returned NULL without an exception");
    }
    else if (PyErr_Occurred()) {
        Py_DECREF(result);
        result_with_error(w->method);
        return NULL;
    }
    return result;
}

/* CPython 3.11: set an int that only its one holder can see (a reference count of 1, one
 * digit, over the cached small ints) to v in place: 1, or 0 (left alone) when it is not
 * such an int or v does not fit. What a new int would be, without allocating one and freeing
 * the old (ints cache no hash). */
static inline int
int_in_place(PyObject *o, Py_ssize_t v)
{
#if IFRAMES
    if (PyLong_CheckExact(o) && Py_REFCNT(o) == 1 && Py_SIZE(o) == 1 &&
        ((PyLongObject *)o)->ob_digit[0] > 256 && v > 256 && v <= (Py_ssize_t)PyLong_MASK) {
        ((PyLongObject *)o)->ob_digit[0] = (digit)v;
        return 1;
    }
#endif
    return 0;
}

/* PyContextVar_Get(current_var, NULL, &req): 0, or -1 with an error set. CPython 3.11: the
 * value the variable cached for this thread and context, read in place when it holds (what
 * PyContextVar_Get checks first, without the call); else PyContextVar_Get. */
static inline int
current_request(PyObject **req)
{
#if IFRAMES
    PyContextVar *var = (PyContextVar *)current_var;
    PyThreadState *ts = PyThreadState_GET();
    if (PyContextVar_CheckExact(current_var) && ts->context != NULL &&
        var->var_cached != NULL && var->var_cached_tsid == ts->id &&
        var->var_cached_tsver == ts->context_ver) {
        *req = Py_NewRef(var->var_cached);
        return 0;
    }
#endif
    return PyContextVar_Get(current_var, NULL, req);
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
    if (current_request(&req) < 0) {
        failed();
        req = NULL;
    }
    Py_ssize_t i = -1;
    if (req != NULL && req != Py_None) {
        /* the statement recorded (one object a shape); the driver gets the application's */
        PyObject *statement = PyUnicode_CheckExact(sql) ? shared_statement(sql) : Py_NewRef(sql);
        if (statement == NULL) {
            failed();
            statement = Py_NewRef(sql);
        }
        i = record_fast(req, statement, params);
        if (i == -1)
#if IFRAMES /* the running frame, its frame object made only when needed */
            i = record_site(req, s_db, s_sqlite, statement, params, NULL, 1);
#else
            i = record_site(req, s_db, s_sqlite, statement, params, PyEval_GetFrame(), 0);
#endif
        if (i == -1)
            i = record_slow(req, statement, params);
        Py_DECREF(statement);
    }
    if (i < 0) {
        Py_XDECREF(req);
        set_counting(w, self, NULL);
        return forward(w, args, nargsf, NULL);
    }
    PyObject *result = forward(w, args, nargsf, NULL);
    if (result == NULL) { /* the driver's error: note it on the call, then pass it on */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        set_counting(w, self, NULL);
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
    Layout *layout = layout_of(Py_TYPE(req));
    PyObject *calls = layout ? Py_XNewRef(get_field(req, layout, F_CALLS)) : NULL;
    Py_DECREF(req);
    long long end = perf_ns();
    if (calls == NULL || !PyByteArray_CheckExact(calls) || PyErr_Occurred() ||
        i + ROW > PyByteArray_GET_SIZE(calls)) {
        Py_XDECREF(calls);
        failed();
        return result;
    }
    put(calls, i + END, end);
    int fast = in_place(w, self);
    PyObject *description;
    if (fast) {
        description = FIELD(self, w->m_description, PyObject *);
        description = Py_NewRef(description ? description : Py_None);
    }
    else {
        description = PyObject_GetAttr(self, s_description);
    }
    if (description == Py_None) { /* not a SELECT: the driver knows the rows changed */
        set_counting(w, self, NULL);
        if (fast) {
            long n = FIELD(self, w->m_rowcount, long);
            if (n >= 0)
                put(calls, i + ROWS, n);
        }
        else {
            PyObject *rc = PyObject_GetAttr(self, s_rowcount);
            if (rc != NULL && PyLong_Check(rc)) {
                long long n = as_ll(rc);
                if (n >= 0)
                    put(calls, i + ROWS, n);
            }
            Py_XDECREF(rc);
        }
    }
    else if (description != NULL) { /* a SELECT: rows are counted as they are fetched */
        put(calls, i + ROWS, 0);
        PyObject *held = fast ? FIELD(self, w->m_rows, PyObject *) : NULL;
        int mine = held != NULL && PyTuple_CheckExact(held) && Py_REFCNT(held) == 1 &&
                   PyTuple_GET_SIZE(held) == 2 && PyTuple_GET_ITEM(held, 0) == calls;
        if (mine && int_in_place(PyTuple_GET_ITEM(held, 1), i + ROWS)) {
            /* the cursor's statement before this one was the same request's (an N+1 loop on
             * one cursor) and only the cursor holds its (calls, offset), whose int only that
             * tuple holds: the offset is set in place, nothing made or freed */
        }
        else if (mine) {
            /* the same, the int a cached small one or shared: an int for an int in the
             * tuple, no tuple made and freed a statement (no one else can see it; nothing
             * the collector looks at changes) */
            PyObject *index = PyLong_FromSsize_t(i + ROWS);
            if (index != NULL) {
                PyObject *old = PyTuple_GET_ITEM(held, 1);
                PyTuple_SET_ITEM(held, 1, index);
                Py_DECREF(old);
            }
        }
        else {
            PyObject *index = PyLong_FromSsize_t(i + ROWS);
            PyObject *counting = index ? PyTuple_Pack(2, calls, index) : NULL;
            if (counting != NULL)
                set_counting(w, self, counting);
            Py_XDECREF(counting);
            Py_XDECREF(index);
        }
    }
    Py_XDECREF(description);
    Py_DECREF(calls);
    if (PyErr_Occurred())
        failed();
    return result;
}

/* Add n to the row count the cursor is counting into (if any); stop counting when asked. */
static void
count_rows(WrapperObject *w, PyObject *cursor, Py_ssize_t n, int stop)
{
    PyObject *counting = get_counting(w, cursor);
    if (counting == NULL)
        return;
    if (PyTuple_CheckExact(counting) && PyTuple_GET_SIZE(counting) == 2) {
        if (stop)
            set_counting(w, cursor, NULL);
        PyObject *calls = PyTuple_GET_ITEM(counting, 0);
        long long at = as_ll(PyTuple_GET_ITEM(counting, 1));
        if (n > 0 && PyByteArray_CheckExact(calls) && at >= 0 &&
            at + 8 <= PyByteArray_GET_SIZE(calls))
            put(calls, at, get(calls, at) + n);
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
            set_counting(w, cursor, NULL);
        else
            count_rows(w, cursor, 1, 0);
        break;
    case NEXT:
        count_rows(w, cursor, 1, 0);
        break;
    case FETCHMANY:
    case FETCHALL: {
        Py_ssize_t n = PyList_Check(result) ? PyList_GET_SIZE(result) : 0;
        count_rows(w, cursor, n, w->kind == FETCHALL);
        break;
    }
    }
    return result;
}

/* Connection.cursor() and Connection.execute(): the instrumented cursor class without a
 * Python frame; anything else (a factory, keywords) goes to the Python method. */
static PyObject *
connection(WrapperObject *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int plain = kwnames == NULL && w->cursor_class != NULL &&
                (w->kind == CONN_CURSOR ? nargs == 1
                                        : (nargs == 2 || nargs == 3) && w->execute != NULL);
    if (!plain)
        return PyObject_Vectorcall(w->fallback, args, nargsf, kwnames);
    PyObject *cursor_args[2] = {args[0], w->cursor_class};
    PyObject *cursor = forward(w, cursor_args, 2, NULL);
    if (cursor == NULL || w->kind == CONN_CURSOR)
        return cursor;
    PyObject *execute_args[3] = {cursor, args[1], nargs == 3 ? args[2] : empty_tuple};
    PyObject *result = execute((WrapperObject *)w->execute, execute_args, 3, NULL);
    Py_DECREF(cursor);
    return result;
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
    static char *names[] = {"method", "kind", "cursor_class", "fallback", "execute", NULL};
    PyObject *method, *cursor_class = NULL, *fallback = NULL, *execute_wrapper = NULL;
    int kind;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi|OOO:CursorMethod", names, &method, &kind,
                                     &cursor_class, &fallback, &execute_wrapper))
        return NULL;
    if (kind < EXECUTE || kind > CONN_EXECUTE || !PyCallable_Check(method)) {
        PyErr_SetString(PyExc_ValueError, "a callable and a known kind");
        return NULL;
    }
    if ((kind == CONN_CURSOR || kind == CONN_EXECUTE) &&
        (cursor_class == NULL || fallback == NULL ||
         (kind == CONN_EXECUTE &&
          (execute_wrapper == NULL || !Py_IS_TYPE(execute_wrapper, type))))) {
        PyErr_SetString(PyExc_ValueError, "a connection method needs cursor_class, fallback "
                                          "(and execute: the cursor's EXECUTE wrapper)");
        return NULL;
    }
    WrapperObject *w = (WrapperObject *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->method = Py_NewRef(method);
    w->kind = kind;
    /* each kind's function called directly: no dispatch, and the small fetch wrappers do not
     * pay for execute's registers */
    w->vectorcall = kind == EXECUTE ? (vectorcallfunc)execute
                    : kind == CONN_CURSOR || kind == CONN_EXECUTE ? (vectorcallfunc)connection
                                                                  : (vectorcallfunc)fetch;
    w->cursor_class = Py_XNewRef(cursor_class);
    w->fallback = Py_XNewRef(fallback);
    w->execute = Py_XNewRef(execute_wrapper);
    w->m_rows = w->m_description = w->m_rowcount = NULL;
    w->cfunc = NULL;
    w->cfunc_flags = 0;
    w->cfunc_type = w->cfunc_subtype = NULL;
    if (Py_IS_TYPE(method, &PyMethodDescr_Type)) {
        PyMethodDef *def = ((PyMethodDescrObject *)method)->d_method;
        int flags = def->ml_flags & ~METH_COEXIST;
        if (flags == METH_FASTCALL || flags == (METH_FASTCALL | METH_KEYWORDS) ||
            flags == METH_NOARGS || flags == METH_O) {
            w->cfunc = def->ml_meth;
            w->cfunc_flags = flags;
            w->cfunc_type = PyDescr_TYPE(method);
            if (kind < CONN_CURSOR && cursor_class != NULL && PyType_Check(cursor_class) &&
                PyType_IsSubtype((PyTypeObject *)cursor_class, w->cfunc_type))
                w->cfunc_subtype = (PyTypeObject *)Py_NewRef(cursor_class);
        }
    }
    if (kind < CONN_CURSOR && cursor_class != NULL && PyType_Check(cursor_class)) {
        w->m_rows = member_of(cursor_class, "_perfsleuth_rows", T_OBJECT_EX, T_OBJECT_EX);
        w->m_description = member_of(cursor_class, "description", T_OBJECT, T_OBJECT_EX);
        w->m_rowcount = member_of(cursor_class, "rowcount", T_LONG, T_LONG);
        if (w->m_description == NULL || w->m_rowcount == NULL)
            w->m_rows = NULL;
    }
    return (PyObject *)w;
}

static int
wrapper_traverse(WrapperObject *w, visitproc visit, void *arg)
{
    Py_VISIT(w->method);
    Py_VISIT(w->cursor_class);
    Py_VISIT(w->fallback);
    Py_VISIT(w->execute);
    Py_VISIT(w->cfunc_subtype);
    return 0;
}

static void
wrapper_dealloc(WrapperObject *w)
{
    PyObject_GC_UnTrack(w);
    Py_CLEAR(w->method);
    Py_CLEAR(w->cursor_class);
    Py_CLEAR(w->fallback);
    Py_CLEAR(w->execute);
    Py_CLEAR(w->cfunc_subtype);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *
wrapper_wrapped(WrapperObject *w, void *closure)
{
    return Py_NewRef(w->method);
}

static PyObject *
wrapper_in_place(WrapperObject *w, void *closure)
{
    return PyBool_FromLong(w->m_rows != NULL);
}

static PyGetSetDef wrapper_getset[] = {
    {"__wrapped__", (getter)wrapper_wrapped, NULL, "the C method wrapped", NULL},
    {"in_place", (getter)wrapper_in_place, NULL,
     "whether the cursor's fields are read in place (cursor kinds given a cursor_class)", NULL},
    {NULL},
};

static PyTypeObject WrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._speedups.CursorMethod",
    .tp_doc = "CursorMethod(method, kind, cursor_class=None, fallback=None, execute=None): a "
              "recording sqlite3 cursor method (kinds: EXECUTE, FETCHONE, FETCHMANY, FETCHALL, "
              "NEXT; cursor_class: the instrumented cursor class, whose fields are then read in "
              "place) or connection method (CONN_CURSOR, CONN_EXECUTE: method is "
              "Connection.cursor).",
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

/* ------------------------------------------------------------------ requests: begin, end
 * recorder.begin and recorder.end in C (same behaviour: the Python ones are the reference). */

/* A request's CPU clock at its start and its CPU time at its end (see request_cpu_start, in
 * "CPU time of a request" below): mostly one system call a request, not two. */
static PyObject *request_cpu_start(void);
static PyObject *request_cpu_ns(long long cpu0, PyObject *start, PyObject *end);

/* The requests whose CPU time is measured: those whose trace id's low 32 bits are under this
 * (recorder.cpu_sampled and its CPU_SAMPLE_BITS say why; configure(cpu_threshold=) sets it:
 * 0 none, 1 << 32 all). */
static long long cpu_threshold = 1LL << 32;

static PyObject *
ns_of(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
}

/* The trace ids of begin: 64 random bits a request, never 0 (as recorder.begin's
 * ``getrandbits(64) or 1``), from splitmix64 (a Python call to random.getrandbits and its int
 * argument were a sixth of begin). Seeded from os.urandom at the first request and again at
 * the first request in a forked child (pthread_atfork), so parent and child never share ids;
 * the GIL orders the draws. */
static uint64_t rng_state;
static int rng_seeded; /* 0: seed at the next draw (never seeded, or a forked child) */

static void
rng_after_fork(void)
{
    rng_seeded = 0;
}

static void
rng_seed(void)
{
    uint64_t seed = 0;
    PyObject *os = PyImport_ImportModule("os");
    PyObject *b = os ? PyObject_CallMethod(os, "urandom", "i", (int)sizeof(seed)) : NULL;
    if (b != NULL && PyBytes_Check(b) && PyBytes_GET_SIZE(b) == sizeof(seed))
        memcpy(&seed, PyBytes_AS_STRING(b), sizeof(seed));
    else
        PyErr_Clear();
    Py_XDECREF(b);
    Py_XDECREF(os);
    struct timespec ts; /* mixed in, in case urandom failed */
    clock_gettime(CLOCK_REALTIME, &ts);
    seed ^= (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ULL ^ (uint64_t)ts.tv_sec ^
            ((uint64_t)getpid() << 32);
    rng_state = seed;
    rng_seeded = 1;
}

static uint64_t
trace_bits(void)
{
    if (!rng_seeded)
        rng_seed();
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z ? z : 1;
}

static PyObject *begin_keywords[5]; /* interned "kind", "method", "path", "cpu", "cls" */

static PyObject *
begin(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    /* begin(kind, method="", path="", *, cpu=False, cls=None) */
    static const char *const keywords[] = {"kind", "method", "path", "cpu", "cls", NULL};
    PyObject *values[5] = {NULL, NULL, NULL, NULL, NULL};
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "begin() takes at most 3 positional arguments");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < nargs; k++)
        values[k] = args[k];
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int found = 0;
        /* the caller's keywords are interned constants: the same objects as ours */
        for (int j = 0; j < 5 && !found; j++) {
            if (name == begin_keywords[j]) {
                values[j] = args[nargs + k];
                found = 1;
            }
        }
        for (int j = 0; j < 5 && !found; j++) {
            if (PyUnicode_CompareWithASCIIString(name, keywords[j]) == 0) {
                values[j] = args[nargs + k];
                found = 1;
            }
        }
        if (!found) {
            PyErr_Format(PyExc_TypeError, "begin() got an unexpected keyword %R", name);
            return NULL;
        }
    }
    if (values[0] == NULL) {
        PyErr_SetString(PyExc_TypeError, "begin() needs kind");
        return NULL;
    }
    if (sink == NULL || sink == Py_None || current_var == NULL)
        Py_RETURN_NONE;
    PyObject *running = NULL;
    if (PyContextVar_Get(current_var, NULL, &running) < 0) {
        failed();
        Py_RETURN_NONE;
    }
    if (running != NULL && running != Py_None) {
        /* nested: the outer framework records. Unless that request has ended: a stale read
         * (CPython 3.11's variable cache, left holding the value a reset removed when code
         * read the variable during the reset's own allocation: a collection's callback, a
         * finaliser); clear it and record this one. */
        Layout *held = layout_of(Py_TYPE(running));
        PyObject *ended = held ? get_field(running, held, F_END) : NULL;
        int stale = ended != NULL && PyLong_CheckExact(ended) && ended != zero &&
                    PyObject_IsTrue(ended) == 1;
        if (held == NULL)
            PyErr_Clear();
        Py_DECREF(running);
        if (!stale)
            Py_RETURN_NONE;
        PyObject *t = PyContextVar_Set(current_var, Py_None);
        if (t == NULL) {
            failed();
            Py_RETURN_NONE;
        }
        Py_DECREF(t);
        running = NULL;
    }
    Py_XDECREF(running);
    PyTypeObject *cls = (PyTypeObject *)(values[4] && values[4] != Py_None ? values[4]
                                                                             : default_class);
    if (cls == NULL || !PyType_Check(cls)) {
        failed();
        Py_RETURN_NONE;
    }
    Layout *layout = layout_of(cls);
    PyObject *req = layout ? cls->tp_alloc(cls, 0) : NULL;
    if (req == NULL) {
        failed();
        Py_RETURN_NONE;
    }
    int bad = 0;
    uint64_t draw = trace_bits();
    PyObject *tid = PyLong_FromUnsignedLongLong(draw);
    bad |= set_field(req, layout, F_TRACE_ID, tid);
    bad |= set_field(req, layout, F_START_WALL, ns_of(CLOCK_REALTIME));
    int zeros[] = {F_END, F_CALLS_DROPPED, F_GC_NS, F_GC_COUNT};
    for (size_t k = 0; k < sizeof(zeros) / sizeof(zeros[0]); k++)
        set_field(req, layout, zeros[k], Py_NewRef(zero));
    set_field(req, layout, F_KIND, Py_NewRef(values[0]));
    set_field(req, layout, F_METHOD, Py_NewRef(values[1] ? values[1] : s_empty));
    set_field(req, layout, F_PATH, Py_NewRef(values[2] ? values[2] : s_empty));
    set_field(req, layout, F_ENDPOINT, Py_NewRef(s_empty));
    int nones[] = {F_CPU_START, F_CPU_NS, F_STATUS, F_ERROR, F_REQ_BYTES, F_RESP_BYTES, F_USER,
                   F_TENANT, F_ATTRS, F_TAGS, F_HEADERS, F_CALLS, F_SITE_LIST, F_MORE,
                   F_TASK, F_WORKER, F_KEEP};
    for (size_t k = 0; k < sizeof(nones) / sizeof(nones[0]); k++)
        set_field(req, layout, nones[k], Py_NewRef(Py_None));
    set_field(req, layout, F_SITES, Py_NewRef(no_sites));
    bad |= set_field(req, layout, F_THREAD, PyLong_FromUnsignedLong(PyThread_get_thread_ident()));
    if (tid != NULL && values[3] != NULL && PyObject_IsTrue(values[3]) == 1 &&
        (long long)(draw & 0xFFFFFFFFULL) < cpu_threshold)
        bad |= set_field(req, layout, F_CPU_START, request_cpu_start());
    PyObject *id = PyLong_FromVoidPtr(req);
    if (bad || id == NULL || PyDict_SetItem(inflight, id, req) < 0) {
        Py_XDECREF(id);
        Py_DECREF(req);
        failed();
        Py_RETURN_NONE;
    }
    PyObject *token = PyContextVar_Set(current_var, req);
    if (token == NULL) {
        PyDict_DelItem(inflight, id);
        Py_DECREF(id);
        Py_DECREF(req);
        failed();
        Py_RETURN_NONE;
    }
    Py_DECREF(id);
    set_field(req, layout, F_TOKEN, token);
    set_field(req, layout, F_START, now_ns());
    if (PyErr_Occurred()) { /* the start time is lost: the request is not */
        failed();
        set_field(req, layout, F_START, PyLong_FromLong(0));
    }
    return req;
}

/* An ended request leaves the collector's lists.
 *
 * Queued for the writer, a request and its site list stay alive through several of the
 * application's young collections (the writer wakes every few hundred requests): tracked, each
 * young collection traverses them, they are promoted into the older generations, whose
 * collections traverse them again, and every object promoted into the oldest brings the next
 * full collection (a walk over the whole heap) nearer. The burst app (Flask, 3 sqlite
 * statements a request) counted ~1.1 such objects per request in every young collection.
 *
 * Untracking is safe when nothing the request references can lead back to it, now or later:
 * then it is in no reference cycle, and freeing it stays reference counting's job (the writer
 * drops the last reference). Later matters: the application may keep a list or dict it gave
 * the request (an attribute's value, a statement's parameters) and later put into it
 * something leading back to the request, a cycle the collector would never see. So a value
 * counts as safe only when it cannot change: an object of a non-GC type (str, int, bytes,
 * bytearray, None), an untracked tuple, or an exact tuple of safe values. An exact list or
 * dict counts only as one of the request's own containers, which only the agent writes to
 * while the request is in flight (attrs, tags, site_list, headers, more and more's per-call
 * dicts; recorder.attr and tag leave an ended request alone): its items must be safe. Looked
 * at at most CYCLE_FREE_DEPTH deep and CYCLE_FREE_BUDGET containers wide (a site list: a few
 * site entries, each a tuple of strings and a stack CPython untracked at its first
 * collection). Anything else (a user's list, dict or object anywhere, an ASGI request's body
 * tap, a class with an instance __dict__) leaves it tracked, as before. The look reads the class's object slots (Layout.slot_offset) and only reads: no
 * Python code runs, so nothing can change what it reads under it. Its site list is untracked with it (only
 * record_site appends to it, and only while the request is current). */
#define CYCLE_FREE_DEPTH 3
#define CYCLE_FREE_BUDGET 64

/* How a value is held: OWN_NONE, an application's value (only what cannot change is safe);
 * OWN_ITEMS, one of the request's own lists or dicts (its items are the application's);
 * OWN_ENTRIES, the request's more ({row: {name: value}}: its values are the agent's dicts). */
enum { OWN_NONE, OWN_ITEMS, OWN_ENTRIES };

static int
cycle_free(PyObject *op, int depth, int *budget, int owned)
{
    if (!PyType_IS_GC(Py_TYPE(op)))
        return 1;
    if (PyTuple_CheckExact(op) && !PyObject_GC_IsTracked(op))
        return 1;
    if (depth <= 0 || --*budget < 0)
        return 0;
    if (PyTuple_CheckExact(op)) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(op); k++)
            if (!cycle_free(PyTuple_GET_ITEM(op, k), depth - 1, budget, OWN_NONE))
                return 0;
        return 1;
    }
    if (owned != OWN_NONE && PyList_CheckExact(op)) {
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(op); k++)
            if (!cycle_free(PyList_GET_ITEM(op, k), depth - 1, budget, OWN_NONE))
                return 0;
        return 1;
    }
    if (owned != OWN_NONE && PyDict_CheckExact(op)) {
        int values = owned == OWN_ENTRIES ? OWN_ITEMS : OWN_NONE;
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(op, &pos, &key, &value))
            if (!cycle_free(key, depth - 1, budget, OWN_NONE) ||
                !cycle_free(value, depth - 1, budget, values))
                return 0;
        return 1;
    }
    return 0;
}

/* How the request holds the value in the slot at offset: its own containers by name, the
 * shared empty sites dict (never written to), else the application's. */
static int
owned_at(PyObject *value, Layout *layout, Py_ssize_t offset)
{
    if (offset == layout->offset[F_MORE])
        return OWN_ENTRIES;
    if (offset == layout->offset[F_ATTRS] || offset == layout->offset[F_TAGS] ||
        offset == layout->offset[F_SITE_LIST] || offset == layout->offset[F_HEADERS] ||
        (offset == layout->offset[F_SITES] && value == no_sites))
        return OWN_ITEMS;
    return OWN_NONE;
}

static void
untrack_ended(PyObject *req, Layout *layout)
{
    if (layout->n_slots < 0 || !PyObject_GC_IsTracked(req))
        return;
    int budget = CYCLE_FREE_BUDGET;
    for (int k = 0; k < layout->n_slots; k++) {
        Py_ssize_t offset = layout->slot_offset[k];
        PyObject *value = *(PyObject **)((char *)req + offset);
        if (value != NULL && PyType_IS_GC(Py_TYPE(value)) &&
            !cycle_free(value, CYCLE_FREE_DEPTH, &budget, owned_at(value, layout, offset)))
            return;
    }
    PyObject *site_list = get_field(req, layout, F_SITE_LIST);
    if (site_list != NULL && PyList_CheckExact(site_list))
        PyObject_GC_UnTrack(site_list);
    PyObject_GC_UnTrack(req);
}

static PyObject *
end(PyObject *module, PyObject *req)
{
    forget_last(req);
    Layout *layout = layout_of(Py_TYPE(req));
    if (layout == NULL) {
        failed();
        Py_RETURN_NONE;
    }
    set_field(req, layout, F_END, now_ns());
    PyObject *id = PyLong_FromVoidPtr(req);
    if (id == NULL || PyDict_DelItem(inflight, id) < 0)
        PyErr_Clear();
    Py_XDECREF(id);
    PyObject *cpu_start = get_field(req, layout, F_CPU_START);
    if (cpu_start != NULL && cpu_start != Py_None) {
        long long cpu0 = as_ll(cpu_start);
        set_field(req, layout, F_CPU_NS,
                  cpu0 == -1 && PyErr_Occurred()
                      ? NULL
                      : request_cpu_ns(cpu0, get_field(req, layout, F_START),
                                       get_field(req, layout, F_END)));
    }
    PyObject *token = get_field(req, layout, F_TOKEN);
    if (token != NULL && token != Py_None) {
        if (PyContextVar_Reset(current_var, token) < 0) { /* ended from another context */
            PyErr_Clear();
            PyObject *t = PyContextVar_Set(current_var, Py_None);
            Py_XDECREF(t);
        }
        set_field(req, layout, F_TOKEN, Py_NewRef(Py_None));
    }
    /* what the writer does not need goes now (recorder.end says why) */
    set_field(req, layout, F_TASK, Py_NewRef(Py_None));
    set_field(req, layout, F_SITES, Py_NewRef(no_sites));
    untrack_ended(req, layout);
    PyObject *count = PyDict_GetItemWithError(stats, s_requests_recorded); /* borrowed */
    if (count != NULL) {
        PyObject *more = PyNumber_Add(count, one);
        if (more == NULL || PyDict_SetItem(stats, s_requests_recorded, more) < 0)
            PyErr_Clear();
        Py_XDECREF(more);
    }
    if (PyErr_Occurred())
        failed();
    if (sink != NULL && sink != Py_None) {
        PyObject *r = PyObject_CallOneArg(sink, req);
        if (r == NULL)
            failed();
        Py_XDECREF(r);
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the writer: a request's row
 * agent.shipper's request values in C: row(req, user_header, tenant_header) gives the values
 * of wire.batch's string and integer columns, in order, as _Encoder._row_values does (the
 * reference); an ASGI request's user, tenant and declared body size are read from its raw
 * header list first (req.headers). NotImplemented: a request it cannot read, or one that
 * carries perfsleuth load's header (Python does). */


/* The value of an identity header as stored: latin-1 text, at most 256 characters. */
static PyObject *
identity_text(PyObject *raw)
{
    Py_ssize_t n = PyBytes_GET_SIZE(raw);
    if (n == 0)
        Py_RETURN_NONE;
    return PyUnicode_DecodeLatin1(PyBytes_AS_STRING(raw), n > 256 ? 256 : n, NULL);
}

static int
read_headers(PyObject *req, Layout *layout, PyObject *user_name, PyObject *tenant_name)
{
    PyObject *headers = get_field(req, layout, F_HEADERS);
    if (headers == NULL || headers == Py_None)
        return 0;
    if (!PyList_Check(headers))
        return -1;
    PyObject *user = NULL, *tenant = NULL, *length = NULL; /* borrowed; the last one wins */
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(headers); k++) {
        PyObject *h = PyList_GET_ITEM(headers, k);
        if (!PyTuple_Check(h) || PyTuple_GET_SIZE(h) != 2 ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(h, 0)) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(h, 1)))
            return -1;
        PyObject *name = PyTuple_GET_ITEM(h, 0), *value = PyTuple_GET_ITEM(h, 1);
        Py_ssize_t n = PyBytes_GET_SIZE(name);
        const char *text = PyBytes_AS_STRING(name);
        if (n == 14 && memcmp(text, "content-length", 14) == 0)
            length = value;
        else if (n == 17 && memcmp(text, "x-perfsleuth-load", 17) == 0)
            return -1; /* perfsleuth load's run and side: tags, which Python sets */
        else if (PyBytes_Check(user_name) && n == PyBytes_GET_SIZE(user_name) &&
                 memcmp(text, PyBytes_AS_STRING(user_name), n) == 0)
            user = value;
        else if (PyBytes_Check(tenant_name) && n == PyBytes_GET_SIZE(tenant_name) &&
                 memcmp(text, PyBytes_AS_STRING(tenant_name), n) == 0)
            tenant = value;
    }
    if (user != NULL && get_field(req, layout, F_USER) == Py_None &&
        set_field(req, layout, F_USER, identity_text(user)) < 0)
        return -2;
    if (tenant != NULL && get_field(req, layout, F_TENANT) == Py_None &&
        set_field(req, layout, F_TENANT, identity_text(tenant)) < 0)
        return -2;
    if (get_field(req, layout, F_REQ_BYTES) == Py_None) {
        PyObject *n = length != NULL ? PyNumber_Long(length) : NULL;
        if (n == NULL || as_ll(n) < 0) {
            PyErr_Clear();
            Py_XSETREF(n, PyLong_FromLong(0));
        }
        if (set_field(req, layout, F_REQ_BYTES, n) < 0)
            return -2;
    }
    set_field(req, layout, F_HEADERS, Py_NewRef(Py_None));
    return 0;
}

/* A column's integer: NULL for None or anything that is not a 64-bit int (what
 * wire.batch.pack_ints does; an IntEnum such as HTTPStatus counts, a bool does not). */
static long long
int_or_null(PyObject *v)
{
    if (v == NULL || !PyLong_Check(v) || PyBool_Check(v))
        return NULL_LL;
    int overflow = 0;
    long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || n == NULL_LL || (n == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return NULL_LL;
    }
    return n;
}

#define N_INTS 12 /* wire.batch.INT_COLUMNS */
#define N_ROW 8   /* wire.batch.STRING_COLUMNS, then the ints */

static PyObject *
row(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "row(req, user_header, tenant_header)");
        return NULL;
    }
    PyObject *req = args[0];
    Layout *layout = layout_of(Py_TYPE(req));
    if (layout == NULL) {
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }
    for (int k = 0; k < N_FIELDS; k++)
        if (get_field(req, layout, k) == NULL) /* an unset slot: not one begin made */
            Py_RETURN_NOTIMPLEMENTED;
    int headers = read_headers(req, layout, args[1], args[2]);
    if (headers == -1)
        Py_RETURN_NOTIMPLEMENTED;
    if (headers == -2)
        return NULL;
    PyObject *endpoint = get_field(req, layout, F_ENDPOINT);
    PyObject *method = get_field(req, layout, F_METHOD);
    PyObject *calls = get_field(req, layout, F_CALLS);
    PyObject *gc_count = get_field(req, layout, F_GC_COUNT);
    int gc = PyObject_IsTrue(gc_count) == 1;
    long long start = as_ll(get_field(req, layout, F_START));
    long long end = as_ll(get_field(req, layout, F_END));
    if (PyErr_Occurred())
        return NULL;
    /* the integer columns, as wire.batch.pack_ints packs them */
    long long ints[N_INTS] = {
        (long long)PyLong_AsUnsignedLongLongMask(get_field(req, layout, F_TRACE_ID)),
        int_or_null(get_field(req, layout, F_START_WALL)),
        end > start ? end - start : 0,
        int_or_null(get_field(req, layout, F_STATUS)),
        int_or_null(get_field(req, layout, F_CPU_NS)),
        int_or_null(get_field(req, layout, F_REQ_BYTES)),
        int_or_null(get_field(req, layout, F_RESP_BYTES)),
        int_or_null(get_field(req, layout, F_CALLS_DROPPED)),
        gc ? int_or_null(get_field(req, layout, F_GC_NS)) : NULL_LL,
        gc ? int_or_null(gc_count) : NULL_LL,
        start,
        PyByteArray_Check(calls) ? PyByteArray_GET_SIZE(calls) / ROW : 0,
    };
    if (ints[7] == 0) /* calls_dropped: none is NULL */
        ints[7] = NULL_LL;
    if (PyErr_Occurred())
        return NULL;
    unsigned char packed[N_INTS * 8];
    for (int k = 0; k < N_INTS; k++) /* little-endian, whatever the machine */
        for (int b = 0; b < 8; b++)
            packed[k * 8 + b] = (unsigned char)((unsigned long long)ints[k] >> (8 * b));
    PyObject *values[N_ROW] = {
        Py_NewRef(get_field(req, layout, F_KIND)),
        Py_NewRef(method),
        PyObject_IsTrue(endpoint) == 1 ? Py_NewRef(endpoint)
                                       : PyUnicode_FromFormat("%S <unmatched>", method),
        Py_NewRef(get_field(req, layout, F_PATH)),
        Py_NewRef(get_field(req, layout, F_USER)),
        Py_NewRef(get_field(req, layout, F_TENANT)),
        Py_NewRef(get_field(req, layout, F_ERROR)),
        PyBytes_FromStringAndSize((const char *)packed, sizeof(packed)),
    };
    PyObject *out = PyTuple_New(N_ROW);
    for (int k = 0; k < N_ROW; k++) {
        if (values[k] == NULL || out == NULL) {
            for (int j = k; j < N_ROW; j++)
                Py_XDECREF(values[j]);
            Py_XDECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, k, values[k]);
    }
    return out;
}

/* ------------------------------------------------------------------ ASGI: the send tap
 * agent.frameworks.asgi.SendTap in C: the send callable handed to the app, noting what the
 * response says on its way to the server, without a Python frame per message. */

typedef struct {
    PyObject_HEAD
    PyObject *send;
    PyObject *headers;
    long long sent;
    int status;
    char complete, pathsend;
    vectorcallfunc vectorcall;
} SendTapObject;

static PyObject *s_type, *s_body, *s_more_body, *s_status, *s_headers;
static PyObject *s_response_body, *s_response_start, *s_pathsend, *s_zerocopy;

static int
truthy(PyObject *message, PyObject *key) /* message.get(key) is true; -1 error */
{
    PyObject *v = PyDict_GetItemWithError(message, key);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return PyObject_IsTrue(v);
}

static void
tap_message(SendTapObject *t, PyObject *message)
{
    if (!PyDict_Check(message))
        return;
    PyObject *type = PyDict_GetItemWithError(message, s_type); /* borrowed */
    if (type == NULL || !PyUnicode_Check(type))
        return;
    if (PyUnicode_Compare(type, s_response_body) == 0) {
        PyObject *body = PyDict_GetItemWithError(message, s_body);
        if (body != NULL && body != Py_None) {
            Py_ssize_t n = PyObject_Length(body);
            if (n > 0)
                t->sent += n;
        }
        int more = truthy(message, s_more_body);
        if (more == 0)
            t->complete = 1;
    }
    else if (PyUnicode_Compare(type, s_response_start) == 0) {
        PyObject *status = PyDict_GetItemWithError(message, s_status);
        if (status != NULL) {
            PyObject *n = PyNumber_Long(status);
            if (n != NULL)
                t->status = (int)PyLong_AsLong(n);
            Py_XDECREF(n);
        }
        PyObject *headers = PyDict_GetItemWithError(message, s_headers);
        Py_XSETREF(t->headers, Py_XNewRef(headers));
    }
    else if (PyUnicode_Compare(type, s_pathsend) == 0) {
        t->pathsend = t->complete = 1;
    }
    else if (PyUnicode_Compare(type, s_zerocopy) == 0) {
        t->pathsend = 1;
        if (truthy(message, s_more_body) == 0)
            t->complete = 1;
    }
}

static PyObject *
tap_vectorcall(SendTapObject *t, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) == 1 && kwnames == NULL) {
        tap_message(t, args[0]);
        if (PyErr_Occurred())
            failed();
    }
    return PyObject_Vectorcall(t->send, args, nargsf, kwnames);
}

static PyObject *
tap_make(PyTypeObject *type, PyObject *send)
{
    SendTapObject *t = (SendTapObject *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->send = Py_NewRef(send);
    t->vectorcall = (vectorcallfunc)tap_vectorcall;
    return (PyObject *)t;
}

static PyObject *
tap_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"send", NULL};
    PyObject *send;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:SendTap", names, &send))
        return NULL;
    return tap_make(type, send);
}

/* type(*args, **kwargs) through the type's call (tp_new's parsing, tp_init): a constructor's
 * vectorcall for the calls it does not take itself (keywords, a wrong count), so that they
 * are accepted and refused as tp_new parses them. */
static PyObject *
call_type(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *tuple = PyTuple_New(nargs);
    if (tuple == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < nargs; k++)
        PyTuple_SET_ITEM(tuple, k, Py_NewRef(args[k]));
    PyObject *kwargs = NULL;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        kwargs = PyDict_New();
        for (Py_ssize_t k = 0; kwargs != NULL && k < PyTuple_GET_SIZE(kwnames); k++) {
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, k), args[nargs + k]) < 0)
                Py_CLEAR(kwargs);
        }
        if (kwargs == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
    }
    PyObject *r = PyType_Type.tp_call(type, tuple, kwargs);
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return r;
}

/* SendTap(send): made without an argument tuple to parse (once a request) */
static PyObject *
tap_type_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) == 1 && kwnames == NULL)
        return tap_make((PyTypeObject *)type, args[0]);
    return call_type(type, args, nargsf, kwnames);
}

static int
tap_traverse(SendTapObject *t, visitproc visit, void *arg)
{
    Py_VISIT(t->send);
    Py_VISIT(t->headers);
    return 0;
}

static int
tap_clear(SendTapObject *t)
{
    Py_CLEAR(t->send);
    Py_CLEAR(t->headers);
    return 0;
}

static void
tap_dealloc(SendTapObject *t)
{
    PyObject_GC_UnTrack(t);
    tap_clear(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMemberDef tap_members[] = {
    {"send", T_OBJECT, offsetof(SendTapObject, send), READONLY, "the server's send"},
    {"headers", T_OBJECT, offsetof(SendTapObject, headers), READONLY, "response headers"},
    {"sent", T_LONGLONG, offsetof(SendTapObject, sent), READONLY, "body bytes sent"},
    {"status", T_INT, offsetof(SendTapObject, status), READONLY, "0: not started"},
    {"complete", T_BOOL, offsetof(SendTapObject, complete), READONLY, "the last body went"},
    {"pathsend", T_BOOL, offsetof(SendTapObject, pathsend), READONLY, "sent from a file"},
    {NULL},
};

static PyTypeObject SendTapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._speedups.SendTap",
    .tp_doc = "SendTap(send): agent.frameworks.asgi.SendTap in C.",
    .tp_basicsize = sizeof(SendTapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = tap_new,
    .tp_vectorcall = tap_type_vectorcall,
    .tp_dealloc = (destructor)tap_dealloc,
    .tp_traverse = (traverseproc)tap_traverse,
    .tp_clear = (inquiry)tap_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(SendTapObject, vectorcall),
    .tp_members = tap_members,
};

/* ------------------------------------------------------------------ CPU time of a request
 * What agent.instrument.threads and frameworks.asgi.CpuMeter add to req.cpu_ns: the calling
 * thread's CPU clock across a function run in a worker, or across a step of a task. */

static unsigned long long cpu_reads; /* thread_cpu_ns calls (GIL held), for tests */

static inline long long
thread_cpu_ns(void)
{
    cpu_reads++;
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The thread's CPU clock is a system call (0.4-1.3 us on the machines measured), the wall
 * clock is not (vDSO, ~40 ns), and a FastAPI request is ~7 steps on the loop and a run in a
 * worker. So a run reads the wall clock at both ends, and its CPU time is:
 * - its wall time when shorter than SHORT_RUN_NS: too short to have waited for the CPU or
 *   blocked in a way that matters (a preemption or a blocking call makes it longer than that);
 * - else the CPU clock at its end less the CPU clock at its start (run_cpu_at and step_cpu_at
 *   below say which reading that is), clamped to [0, wall time]. */
#define SHORT_RUN_NS 50000LL
static _Thread_local long long last_cpu, last_wall = -1;

static inline long long
cpu_used(long long cpu0, long long wall0)
{
    long long wall1 = wall_ns();
    long long used = wall1 - wall0;
    if (used < SHORT_RUN_NS)
        return used;
    long long cpu1 = thread_cpu_ns();
    last_cpu = cpu1;
    last_wall = wall1;
    long long cpu = cpu1 - cpu0;
    return cpu < 0 ? 0 : cpu < used ? cpu : used;
}

/* A run's start in a pool worker (Marked): the thread's last reading as it is when under
 * RUN_GAP_NS old, else a reading of its own. A thread's last reading is the end of its
 * previous long run or step (cpu_used). A pool worker has mostly waited for work since: its
 * clock moved only by the pool's own bookkeeping (handing the result back, taking the next
 * work item: a few microseconds, counted to this run, and never more than the gap: a thread's
 * clock runs no faster than the wall clock). Not step_cpu_at's estimate (the last reading plus
 * the wall time since), which would take the whole wait out of the run. Within the gap, a run
 * costs at most one CPU clock reading (a system call), at its end and only when it lasted
 * SHORT_RUN_NS or more: FastAPI's next hand-off comes ~0.1-0.3 ms after the last reading. */
#define RUN_GAP_NS 1000000LL

static inline long long
run_cpu_at(long long wall)
{
    if (wall - last_wall < RUN_GAP_NS && last_wall > 0)
        return last_cpu;
    last_cpu = thread_cpu_ns();
    last_wall = wall;
    return last_cpu;
}

/* A step's start (a step of a metered task on the loop, CpuMeter): the thread's last reading
 * plus the wall time since when that reading is under STEP_GAP_NS old, else a reading of its
 * own. Not run_cpu_at's (the last reading as it is, within 1 ms): between two steps of a task
 * the loop runs other tasks' steps and the server's code, and that would count to the step
 * (up to its wall time: a step blocking 0.4 ms after another task's 0.8 ms of CPU counted
 * ~0.4 ms too much). This estimate is never earlier than the clock's true value (a thread's
 * clock runs no faster than the wall clock), so a step counts at most STEP_GAP_NS too little,
 * never too much. */
#define STEP_GAP_NS 100000LL

static inline long long
step_cpu_at(long long wall)
{
    if (wall - last_wall < STEP_GAP_NS && last_wall > 0)
        return last_cpu + (wall - last_wall);
    last_cpu = thread_cpu_ns();
    last_wall = wall;
    return last_cpu;
}

/* A request's CPU clock at its start: the thread's last reading plus the wall time since when
 * that reading is under REQUEST_GAP_NS old (a loop calling the app, or a server whose next
 * request was already read: 9-15 us after the previous request's end), else a reading of its
 * own. Not step_cpu_at's bound (STEP_GAP_NS): the gap between two requests is mostly time off
 * the CPU in a server (recv, the interpreter lock), and the estimate counts it as CPU, so a
 * request counts at most REQUEST_GAP_NS too little. recorder.begin does the same. */
#define REQUEST_GAP_NS 20000LL

static PyObject *
request_cpu_start(void)
{
    long long wall = wall_ns();
    if (wall - last_wall < REQUEST_GAP_NS)
        return PyLong_FromLongLong(last_cpu + (wall - last_wall));
    last_cpu = thread_cpu_ns();
    last_wall = wall;
    return PyLong_FromLongLong(last_cpu);
}

/* A request's CPU time from cpu0 (request_cpu_start's) and its start and end (perf_counter_ns
 * ints): its wall time when shorter than SHORT_RUN_NS, else the CPU clock now less cpu0,
 * clamped to [0, wall time]. recorder.end does the same. A new reference, or NULL with an
 * error set. */
static PyObject *
request_cpu_ns(long long cpu0, PyObject *start, PyObject *end)
{
    long long used = -1;
    if (start != NULL && end != NULL && PyLong_CheckExact(start) && PyLong_CheckExact(end)) {
        long long t0 = as_ll(start), t1 = as_ll(end);
        if (PyErr_Occurred())
            PyErr_Clear();
        else if (t0 > 0 && t1 >= t0)
            used = t1 - t0;
    }
    if (used >= 0 && used < SHORT_RUN_NS)
        return PyLong_FromLongLong(used);
    long long wall1 = wall_ns(), cpu1 = thread_cpu_ns();
    last_cpu = cpu1;
    last_wall = wall1;
    long long cpu = cpu1 - cpu0;
    if (cpu < 0)
        cpu = 0;
    if (used >= 0 && cpu > used)
        cpu = used;
    return PyLong_FromLongLong(cpu);
}

/* req.cpu_ns += used, when the request counts CPU that way (an int, not None); keeps the
 * exception being raised, if any; never raises. The GIL is held throughout: no other
 * thread's update comes in between the read and the store. */
static void
add_cpu(PyObject *req, Layout *layout, long long used)
{
    PyObject *cpu = get_field(req, layout, F_CPU_NS);
    if (cpu == NULL || !PyLong_CheckExact(cpu))
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *delta = PyLong_FromLongLong(used);
    PyObject *sum = delta ? PyNumber_Add(cpu, delta) : NULL;
    Py_XDECREF(delta);
    if (sum == NULL)
        failed();
    else
        set_field(req, layout, F_CPU_NS, sum);
    PyErr_Restore(type, value, tb);
}

/* CpuMeter(req, awaitable): frameworks.asgi.CpuMeter (the reference): awaits the awaitable,
 * adding the thread's CPU time of every step it forwards to req.cpu_ns. */
typedef struct {
    PyObject_HEAD
    PyObject *req;
    PyObject *aw; /* the awaitable */
    PyObject *it; /* what it awaits: the coroutine itself, or aw.__await__() */
    long long used; /* CPU time of the steps so far, added to req.cpu_ns when the last ends */
} MeterObject;

static PyObject *s_send, *s_throw, *s_close, *s_cr_frame, *s_cr_await;

static PyObject *
meter_make(PyTypeObject *type, PyObject *req, PyObject *aw)
{
    PyObject *it;
    if (PyCoro_CheckExact(aw) || PyGen_CheckExact(aw)) {
        it = Py_NewRef(aw);
    } else {
        unaryfunc am_await = Py_TYPE(aw)->tp_as_async ? Py_TYPE(aw)->tp_as_async->am_await : NULL;
        if (am_await == NULL) {
            PyErr_Format(PyExc_TypeError, "object %.100s can't be used in 'await' expression",
                         Py_TYPE(aw)->tp_name);
            return NULL;
        }
        it = am_await(aw);
        if (it == NULL)
            return NULL;
    }
    MeterObject *m = (MeterObject *)type->tp_alloc(type, 0);
    if (m == NULL) {
        Py_DECREF(it);
        return NULL;
    }
    m->req = Py_NewRef(req);
    m->aw = Py_NewRef(aw);
    m->it = it;
    m->used = 0;
    return (PyObject *)m;
}

static PyObject *
meter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"req", "aw", NULL};
    PyObject *req, *aw;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:CpuMeter", names, &req, &aw))
        return NULL;
    return meter_make(type, req, aw);
}

/* CpuMeter(req, aw): made without an argument tuple to parse (once a metered request) */
static PyObject *
meter_type_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) == 2 && kwnames == NULL)
        return meter_make((PyTypeObject *)type, args[0], args[1]);
    return call_type(type, args, nargsf, kwnames);
}

/* Add the steps' CPU time to req.cpu_ns (once, when the awaitable is done: no int made and
 * added at every step; nothing reads a request's cpu_ns before it ends). */
static void
meter_flush(MeterObject *m)
{
    long long used = m->used;
    m->used = 0;
    if (used == 0 || m->req == NULL)
        return;
    Layout *layout = layout_of(Py_TYPE(m->req));
    if (layout == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_Clear();
        failed();
        PyErr_Restore(type, value, tb);
        return;
    }
    add_cpu(m->req, layout, used);
}

static PySendResult
meter_am_send(MeterObject *m, PyObject *arg, PyObject **result)
{
    long long wall0 = wall_ns(), cpu0 = step_cpu_at(wall0);
    PySendResult r = PyIter_Send(m->it, arg, result);
    m->used += cpu_used(cpu0, wall0);
    if (r != PYGEN_NEXT) /* returned or raised: the last step */
        meter_flush(m);
    return r;
}

/* A step's result as send() and __next__ give it: the value yielded, or StopIteration with
 * the value returned, or the error. */
static PyObject *
meter_step(MeterObject *m, PyObject *arg)
{
    PyObject *result = NULL;
    PySendResult r = meter_am_send(m, arg, &result);
    if (r == PYGEN_NEXT)
        return result;
    if (r == PYGEN_RETURN) {
        if (result == Py_None) {
            PyErr_SetNone(PyExc_StopIteration);
        } else { /* StopIteration(result), whatever result is (a tuple is not unpacked) */
            PyObject *stop = PyObject_CallOneArg(PyExc_StopIteration, result);
            if (stop != NULL) {
                PyErr_SetObject(PyExc_StopIteration, stop);
                Py_DECREF(stop);
            }
        }
        Py_DECREF(result);
    }
    return NULL;
}

static PyObject *
meter_iternext(MeterObject *m)
{
    return meter_step(m, Py_None);
}

static PyObject *
meter_send(MeterObject *m, PyObject *arg)
{
    return meter_step(m, arg);
}

static PyObject *
meter_throw(MeterObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
        return NULL;
    }
    /* the exception itself, thrown with the one-argument form (the three-argument form is
     * deprecated from 3.12) */
    PyObject *made = nargs >= 2 ? thrown(args[0], args[1], nargs == 3 ? args[2] : Py_None) : NULL;
    if (nargs >= 2 && made == NULL)
        return NULL;
    PyObject *exc = made != NULL ? made : args[0];
    long long wall0 = wall_ns(), cpu0 = step_cpu_at(wall0);
    PyObject *result = PyObject_CallMethodOneArg(m->it, s_throw, exc);
    m->used += cpu_used(cpu0, wall0);
    Py_XDECREF(made);
    if (result == NULL) /* returned (StopIteration) or raised: the last step */
        meter_flush(m);
    return result;
}

/* getattr(obj, name, None) as a new reference (NULL with an error set on other errors) */
static PyObject *
optional_attr(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return Py_NewRef(Py_None);
    }
    return v;
}

static PyObject *
meter_close(MeterObject *m, PyObject *unused)
{
    PyObject *close = optional_attr(m->it, s_close);
    if (close == NULL)
        return NULL;
    if (close == Py_None)
        return close;
    PyObject *r = PyObject_CallNoArgs(close);
    Py_DECREF(close);
    return r;
}

static PyObject *
meter_self(PyObject *m)
{
    return Py_NewRef(m);
}

static PyObject *
meter_aw_attr(MeterObject *m, void *name)
{
    return optional_attr(m->aw, *(PyObject **)name);
}

static int
meter_traverse(MeterObject *m, visitproc visit, void *arg)
{
    Py_VISIT(m->req);
    Py_VISIT(m->aw);
    Py_VISIT(m->it);
    return 0;
}

static int
meter_clear(MeterObject *m)
{
    Py_CLEAR(m->req);
    Py_CLEAR(m->aw);
    Py_CLEAR(m->it);
    return 0;
}

static void
meter_dealloc(MeterObject *m)
{
    PyObject_GC_UnTrack(m);
    meter_flush(m); /* closed or dropped before its end: what its steps used still counts */
    meter_clear(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyMethodDef meter_methods[] = {
    {"send", (PyCFunction)meter_send, METH_O, "forward one step, counting its CPU time"},
    {"throw", (PyCFunction)(void (*)(void))meter_throw, METH_FASTCALL,
     "throw an exception into the awaitable, counting the CPU time of the step"},
    {"close", (PyCFunction)meter_close, METH_NOARGS, "close the awaitable"},
    {NULL},
};

static PyGetSetDef meter_getset[] = {
    {"cr_frame", (getter)meter_aw_attr, NULL, "the awaitable's frame", &s_cr_frame},
    {"cr_await", (getter)meter_aw_attr, NULL, "what the awaitable awaits", &s_cr_await},
    {NULL},
};

static PyAsyncMethods meter_as_async = {
    .am_await = (unaryfunc)meter_self,
    .am_send = (sendfunc)meter_am_send,
};

static PyTypeObject MeterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._speedups.CpuMeter",
    .tp_doc = "CpuMeter(req, awaitable): await it, adding each step's thread CPU time to "
              "req.cpu_ns.",
    .tp_basicsize = sizeof(MeterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = meter_new,
    .tp_vectorcall = meter_type_vectorcall,
    .tp_dealloc = (destructor)meter_dealloc,
    .tp_traverse = (traverseproc)meter_traverse,
    .tp_clear = (inquiry)meter_clear,
    .tp_as_async = &meter_as_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)meter_iternext,
    .tp_methods = meter_methods,
    .tp_getset = meter_getset,
};

/* ------------------------------------------------------------------ thread-pool hand-offs
 * agent.instrument.threads in C: HandOff(run_sync) replaces anyio.to_thread.run_sync and
 * asyncio.to_thread; when a request is being recorded, the function handed to the pool is
 * wrapped in a Marked(request, function), which notes the worker thread on the request while
 * the function runs there (for the stack sampler). */

typedef struct {
    PyObject_HEAD
    PyObject *req;
    PyObject *func;
    vectorcallfunc vectorcall;
} MarkedObject;

/* The frame that runs the pool's work (anyio's worker loop, concurrent.futures' work item) is
 * where the request enters the application in that thread: classified as the agent's, like
 * the Python _run_marked frame it stands for, so call stacks stop there (stacks.capture). */
static void
mark_entry(PyFrameObject *frame)
{
    if (frame == NULL || code_kinds == NULL)
        return;
    PyCodeObject *code = PyFrame_GetCode(frame);
    int known;
    if (PyDict_CheckExact(code_kinds) && memo_get(kind_memo, code_kinds, code, &known) &&
        known == -1) { /* kind_of_code's memo: the dict still maps it to (code, None) */
        Py_DECREF(code);
        return;
    }
    PyObject *id = PyLong_FromVoidPtr(code);
    PyObject *hit = id ? PyDict_GetItemWithError(code_kinds, id) : NULL; /* borrowed */
    if (id != NULL && !PyErr_Occurred() &&
        (hit == NULL || !PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 2 ||
         PyTuple_GET_ITEM(hit, 1) != Py_None)) {
        PyObject *entry = PyTuple_Pack(2, (PyObject *)code, Py_None);
        if (entry == NULL || PyDict_SetItem(code_kinds, id, entry) < 0)
            failed();
        else if (PyDict_CheckExact(code_kinds))
            memo_put(kind_memo, code_kinds, code, -1);
        Py_XDECREF(entry);
    }
    else if (hit != NULL && PyTuple_GET_ITEM(hit, 0) == (PyObject *)code &&
             PyDict_CheckExact(code_kinds)) {
        memo_put(kind_memo, code_kinds, code, -1);
    }
    Py_XDECREF(id);
    Py_DECREF(code);
    if (PyErr_Occurred())
        failed();
}

static PyObject *
marked_vectorcall(MarkedObject *m, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    mark_entry(PyEval_GetFrame());
    Layout *layout = layout_of(Py_TYPE(m->req));
    PyObject *prev = layout ? get_field(m->req, layout, F_WORKER) : NULL;
    if (prev != NULL) {
        Py_INCREF(prev);
        set_field(m->req, layout, F_WORKER,
                  PyLong_FromUnsignedLong(PyThread_get_thread_ident()));
    }
    if (PyErr_Occurred())
        failed();
    /* the worker's CPU time, when the request counts it that way (an int: an ASGI request in
     * the CPU sample); else no clock is read */
    PyObject *cpu = prev != NULL ? get_field(m->req, layout, F_CPU_NS) : NULL;
    int counted = cpu != NULL && PyLong_CheckExact(cpu);
    long long wall0 = 0, cpu0 = 0;
    if (counted) {
        wall0 = wall_ns();
        cpu0 = run_cpu_at(wall0);
    }
    PyObject *result = PyObject_Vectorcall(m->func, args, nargsf, kwnames);
    if (prev != NULL) {
        set_field(m->req, layout, F_WORKER, prev); /* steals prev back */
        if (counted)
            add_cpu(m->req, layout, cpu_used(cpu0, wall0));
    }
    return result;
}

static int
marked_traverse(MarkedObject *m, visitproc visit, void *arg)
{
    Py_VISIT(m->req);
    Py_VISIT(m->func);
    return 0;
}

static int
marked_clear(MarkedObject *m)
{
    Py_CLEAR(m->req);
    Py_CLEAR(m->func);
    return 0;
}

static void
marked_dealloc(MarkedObject *m)
{
    PyObject_GC_UnTrack(m);
    marked_clear(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyTypeObject MarkedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._speedups.Marked",
    .tp_doc = "A function handed to a thread pool by a recorded request.",
    .tp_basicsize = sizeof(MarkedObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_dealloc = (destructor)marked_dealloc,
    .tp_traverse = (traverseproc)marked_traverse,
    .tp_clear = (inquiry)marked_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(MarkedObject, vectorcall),
};

typedef struct {
    PyObject_HEAD
    PyObject *original;
    PyObject *stitch; /* handoff.stitched(req, frame, func), or NULL: marking only */
    vectorcallfunc vectorcall;
} HandOffObject;

/* agent.instrument.handoff._dispatch in C: whether the work is handed over from a framework's
 * own dispatch (the DISPATCH_DEPTH frames from frame up are all library code): 1 yes, 0 no,
 * -1 on an error. No Python frame of its own (the Python wrapper's call, its _getframe and its
 * walk were most of a hand-off's cost on the event loop). */
#define DISPATCH_DEPTH 3
#if !IFRAMES
static int
from_dispatch(PyFrameObject *frame)
{
    PyFrameObject *f = (PyFrameObject *)Py_XNewRef(frame);
    for (int k = 0; k < DISPATCH_DEPTH; k++) {
        if (f == NULL)
            return 1;
        int kind = kind_of(f);
        if (kind != 0) { /* the application's (1), the agent's (-1), or an error (-2) */
            Py_DECREF(f);
            return kind == -2 ? -1 : 0;
        }
        f = up(f);
    }
    Py_XDECREF(f);
    return 1;
}
#else
/* from_dispatch from an interpreter frame: the frames read in place, as same_stack does (no
 * frame object made for each) */
static int
from_dispatch_at(_PyInterpreterFrame *i)
{
    for (int k = 0; k < DISPATCH_DEPTH; k++) {
        if (i == NULL)
            return 1;
        int kind = kind_of_code((PyCodeObject *)Py_NewRef(i->f_code));
        if (kind != 0)
            return kind == -2 ? -1 : 0;
        i = iframe_back(i);
    }
    return 1;
}
#endif

static PyObject *
handoff_vectorcall(HandOffObject *h, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *req = NULL;
    if (nargs < 1 || current_var == NULL || PyContextVar_Get(current_var, NULL, &req) < 0) {
        PyErr_Clear();
        req = NULL;
    }
    if (req == NULL || req == Py_None) {
        Py_XDECREF(req);
        return PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    }
    MarkedObject *m = PyObject_GC_New(MarkedObject, &MarkedType);
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8];
    PyObject **call_args = total <= 8 ? small : PyMem_New(PyObject *, total);
    if (m == NULL || call_args == NULL) {
        if (m != NULL) {
            m->req = m->func = NULL;
            Py_DECREF(m);
        }
        Py_DECREF(req);
        failed();
        return PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    }
    m->req = req; /* the reference PyContextVar_Get gave */
    m->func = Py_NewRef(args[0]);
    if (h->stitch != NULL) {
        /* handoff.wrap's part: the caller's stack stitched on, unless a framework's dispatch
         * hands the work over (then nothing more is done) */
#if IFRAMES
        /* the caller's frame object is made only when its stack is stitched on */
        _PyInterpreterFrame *caller = iframe_current();
        int dispatch = caller == NULL || code_kinds == NULL ? 1 : from_dispatch_at(caller);
        PyFrameObject *frame = dispatch == 0 ? PyEval_GetFrame() : NULL; /* borrowed */
        if (frame == NULL && dispatch == 0)
            dispatch = 1;
#else
        PyFrameObject *frame = PyEval_GetFrame(); /* borrowed: the caller of run_sync */
        int dispatch = frame == NULL || code_kinds == NULL ? 1 : from_dispatch(frame);
#endif
        if (dispatch == 0) {
            PyObject *stitch_args[3] = {req, (PyObject *)frame, m->func};
            PyObject *func = PyObject_Vectorcall(h->stitch, stitch_args, 3, NULL);
            if (func != NULL)
                Py_SETREF(m->func, func);
        }
        if (PyErr_Occurred())
            failed();
    }
    m->vectorcall = (vectorcallfunc)marked_vectorcall;
    PyObject_GC_Track(m);
    call_args[0] = (PyObject *)m;
    for (Py_ssize_t k = 1; k < total; k++)
        call_args[k] = args[k];
    PyObject *result = PyObject_Vectorcall(h->original, call_args, nargs, kwnames);
    if (call_args != small)
        PyMem_Free(call_args);
    Py_DECREF(m);
    return result;
}

static PyObject *
handoff_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *original, *stitch = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:HandOff", &original, &stitch))
        return NULL;
    HandOffObject *h = (HandOffObject *)type->tp_alloc(type, 0);
    if (h == NULL)
        return NULL;
    h->original = Py_NewRef(original);
    h->stitch = stitch == Py_None ? NULL : Py_NewRef(stitch);
    h->vectorcall = (vectorcallfunc)handoff_vectorcall;
    return (PyObject *)h;
}

static int
handoff_traverse(HandOffObject *h, visitproc visit, void *arg)
{
    Py_VISIT(h->original);
    Py_VISIT(h->stitch);
    return 0;
}

static void
handoff_dealloc(HandOffObject *h)
{
    PyObject_GC_UnTrack(h);
    Py_CLEAR(h->original);
    Py_CLEAR(h->stitch);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyObject *
handoff_wrapped(HandOffObject *h, void *closure)
{
    return Py_NewRef(h->original);
}

static PyObject *
handoff_marker(HandOffObject *h, void *closure)
{
    Py_RETURN_TRUE;
}

static PyGetSetDef handoff_getset[] = {
    {"__wrapped__", (getter)handoff_wrapped, NULL, "the function wrapped", NULL},
    {"__perfsleuth__", (getter)handoff_marker, NULL, "instrumented (idempotence)", NULL},
    {NULL},
};

static PyTypeObject HandOffType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._speedups.HandOff",
    .tp_doc = "HandOff(run_sync, stitch=None): run_sync(func, ...) marking the worker that runs "
              "func for a recorded request; with stitch (handoff.stitched), also the caller's "
              "stack stitched on when the hand-off is not a framework's dispatch.",
    .tp_basicsize = sizeof(HandOffObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = handoff_new,
    .tp_dealloc = (destructor)handoff_dealloc,
    .tp_traverse = (traverseproc)handoff_traverse,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(HandOffObject, vectorcall),
    .tp_getset = handoff_getset,
};

static PyObject *
configure(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"current", "sql_text", "internal_error", "max_rows", "perf_counter",
                            "code_kinds", "classify", "site_cache", "stack_cache", "max_depth", "max_sites",
                            "stacks_per_site", "sink", "inflight", "stats", "no_sites",
                            "request_class", "template_key", "template_engines",
                            "engine_of", "cpu_threshold", "statement_scan",
                            "statement_bytes", NULL};
    PyObject *current = NULL, *text = NULL, *error = NULL, *perf = NULL, *kinds = NULL,
             *classify = NULL, *cache = NULL, *stacks_cache = NULL, *new_sink = NULL, *flying = NULL,
             *counters = NULL, *empty_sites = NULL, *req_class = NULL,
             *tpl_key = NULL, *tpl_engines = NULL, *tpl_engine_of = NULL, *tokens = NULL;
    Py_ssize_t rows = -1, depth = -1, sites = -1, per_site = -1, share_bytes = -1;
    long long threshold = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOnOOOOOnnnOOOOOOOOLOn:configure", names,
                                     &current, &text, &error, &rows, &perf, &kinds, &classify,
                                     &cache, &stacks_cache, &depth, &sites, &per_site, &new_sink, &flying,
                                     &counters, &empty_sites, &req_class,
                                     &tpl_key, &tpl_engines, &tpl_engine_of, &threshold, &tokens,
                                     &share_bytes))
        return NULL;
    if (tokens != NULL) { /* None: statements recorded as made */
        ScanAPI *api = NULL;
        if (tokens != Py_None) {
            api = PyCapsule_GetPointer(tokens, SCAN_CAPSULE);
            if (api == NULL)
                return NULL;
            if (api->version != SCAN_API_VERSION) {
                PyErr_SetString(PyExc_ValueError, "statement_scan: another version of the C API");
                return NULL;
            }
            if ((shapes == NULL && (shapes = PyDict_New()) == NULL) ||
                (firsts == NULL && (firsts = PyDict_New()) == NULL))
                return NULL;
        }
        clear_shapes();
        scan_api = api;
        Py_XSETREF(scan_capsule, api ? Py_NewRef(tokens) : NULL);
    }
    if (share_bytes >= 0) {
        shapes_limit = share_bytes;
        clear_shapes();
    }
    if ((tpl_key != NULL) != (tpl_engines != NULL) ||
        (tpl_key != NULL) != (tpl_engine_of != NULL) ||
        (tpl_key != NULL && tpl_key != Py_None && !PyDict_CheckExact(tpl_engines))) {
        PyErr_SetString(PyExc_TypeError,
                        "template_key, template_engines (a dict) and engine_of come together");
        return NULL;
    }
    if (tpl_key != NULL) { /* None: templates off again */
        int off = tpl_key == Py_None;
        Py_XSETREF(template_key, off ? NULL : Py_NewRef(tpl_key));
        Py_XSETREF(engines, off ? NULL : Py_NewRef(tpl_engines));
        Py_XSETREF(engine_of, off ? NULL : Py_NewRef(tpl_engine_of));
    }
    if ((flying != NULL && !PyDict_CheckExact(flying)) ||
        (counters != NULL && !PyDict_CheckExact(counters))) {
        PyErr_SetString(PyExc_TypeError, "inflight and stats are dicts");
        return NULL;
    }
    if (new_sink != NULL)
        Py_XSETREF(sink, Py_NewRef(new_sink));
    if (flying != NULL)
        Py_XSETREF(inflight, Py_NewRef(flying));
    if (counters != NULL)
        Py_XSETREF(stats, Py_NewRef(counters));
    if (empty_sites != NULL)
        Py_XSETREF(no_sites, Py_NewRef(empty_sites));
    if (req_class != NULL)
        Py_XSETREF(default_class, Py_NewRef(req_class));
    if ((kinds != NULL && !PyDict_CheckExact(kinds)) ||
        (cache != NULL && !PyDict_CheckExact(cache)) ||
        (stacks_cache != NULL && !PyDict_CheckExact(stacks_cache))) {
        PyErr_SetString(PyExc_TypeError, "code_kinds, site_cache and stack_cache are dicts");
        return NULL;
    }
    if (current != NULL)
        Py_XSETREF(current_var, Py_NewRef(current));
    if (text != NULL)
        Py_XSETREF(sql_text, Py_NewRef(text));
    if (error != NULL)
        Py_XSETREF(internal_error, Py_NewRef(error));
    if (perf != NULL)
        Py_XSETREF(perf_counter, perf == Py_None ? NULL : Py_NewRef(perf));
    if (kinds != NULL)
        Py_XSETREF(code_kinds, Py_NewRef(kinds));
    if (classify != NULL)
        Py_XSETREF(classify_code, Py_NewRef(classify));
    if (cache != NULL)
        Py_XSETREF(site_cache, Py_NewRef(cache));
    if (stacks_cache != NULL)
        Py_XSETREF(stack_cache, Py_NewRef(stacks_cache));
    if (rows >= 0)
        max_rows = rows;
    if (depth > 0)
        max_depth = depth;
    if (sites > 0)
        max_sites = sites;
    if (per_site > 0)
        one_stack_per_site = per_site == 1;
    if (threshold >= 0)
        cpu_threshold = threshold;
    clear_site_memo(); /* what it found may depend on what changed (template engines) */
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------- agent threads and the GIL
 * When an agent thread (the writer, the evidence thread) wants the interpreter lock back after
 * a wait or a system call, CPython gives it the lock only if it wins a race: an application
 * thread that releases the lock for a moment (every sqlite3 step, every socket read) and takes
 * it back wakes the waiter each time, but the waiter rarely gets there first, and its
 * 5 ms switch timeout restarts at every wake-up, so it never forces a switch. Measured on the
 * burst benchmark's app (2 cores): a thread that only sleeps 50 ms in a loop waited 14 ms
 * (median, up to 137 ms) for the lock after each sleep, woke ~7,000 times a second for
 * nothing, and made the app's requests 9 % slower; the agent's two threads, about 20 %.
 *
 * So the agent's threads wait here, and say when they want the lock back (gil_wanted); the
 * request path hands the lock over at a request's end when one does (hand_over: release,
 * yield until the agent thread has it, at most HAND_OVER_NS, take it back). The app pays one
 * hand-over instead of a thousand futile wake-ups, and the agent thread runs when a request
 * ends instead of tens of milliseconds later. */

static int gil_wanted;                       /* agent threads waiting for the lock (atomic) */
static unsigned long long hand_overs;        /* hand-overs made (stats) */
#define HAND_OVER_NS 200000LL                /* the longest a request's end waits for one */

/* Take the interpreter lock back for an agent thread, saying so while it waits. */
static void
agent_restore(PyThreadState *ts)
{
    __atomic_add_fetch(&gil_wanted, 1, __ATOMIC_SEQ_CST);
    PyEval_RestoreThread(ts);
    __atomic_sub_fetch(&gil_wanted, 1, __ATOMIC_SEQ_CST);
}

/* A forked child has none of its parent's agent threads: none of them waits for its lock. */
static void
gil_after_fork(void)
{
    __atomic_store_n(&gil_wanted, 0, __ATOMIC_SEQ_CST);
}

/* At a request's end, with the lock held: when an agent thread waits for the lock, let it
 * have it (see above). Never fails. */
static void
hand_over(void)
{
    if (__atomic_load_n(&gil_wanted, __ATOMIC_RELAXED) <= 0)
        return;
    long long start = wall_ns();
    PyThreadState *ts = PyEval_SaveThread();
    while (__atomic_load_n(&gil_wanted, __ATOMIC_SEQ_CST) > 0 && wall_ns() - start < HAND_OVER_NS)
        sched_yield();
    PyEval_RestoreThread(ts);
    hand_overs++;
}

static int
seconds_arg(PyObject *arg, double *out)
{
    double s = PyFloat_AsDouble(arg);
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    *out = s > 0 && s == s ? s : 0.0; /* negative or NaN: no wait */
    return 0;
}

static PyObject *
agent_sleep(PyObject *module, PyObject *arg)
{
    double s;
    if (seconds_arg(arg, &s) < 0)
        return NULL;
    if (s > 1e6)
        s = 1e6;
    struct timespec left = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    PyThreadState *ts = PyEval_SaveThread();
    while (nanosleep(&left, &left) != 0 && errno == EINTR)
        ;
    agent_restore(ts);
    Py_RETURN_NONE;
}

static PyObject *
agent_write(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "write(fd, data)");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[0]);
    if (fd < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    ssize_t n;
    int err;
    PyThreadState *ts = PyEval_SaveThread();
    do {
        n = write(fd, view.buf, (size_t)view.len);
    } while (n < 0 && errno == EINTR);
    err = errno;
    agent_restore(ts);
    PyBuffer_Release(&view);
    if (n < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(n);
}

static PyObject *
replace_file(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    /* data written to path + ".tmp", renamed over path: the lock let go once for all of it */
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "replace_file(path, data)");
        return NULL;
    }
    PyObject *path = NULL;
    if (!PyUnicode_FSConverter(args[0], &path))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(path);
        return NULL;
    }
    PyObject *tmp = PyBytes_FromFormat("%s.tmp", PyBytes_AS_STRING(path));
    if (tmp == NULL) {
        PyBuffer_Release(&view);
        Py_DECREF(path);
        return NULL;
    }
    const char *to = PyBytes_AS_STRING(path), *from = PyBytes_AS_STRING(tmp);
    const char *buf = view.buf;
    Py_ssize_t left = view.len;
    int err = 0;
    PyThreadState *ts = PyEval_SaveThread();
    int fd = open(from, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) {
        err = errno;
    }
    else {
        while (left > 0) {
            ssize_t n = write(fd, buf, (size_t)left);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0) {
                err = n < 0 ? errno : EIO;
                break;
            }
            buf += n;
            left -= n;
        }
        if (close(fd) != 0 && err == 0)
            err = errno;
        if (err == 0 && rename(from, to) != 0)
            err = errno;
        if (err != 0)
            unlink(from);
    }
    agent_restore(ts);
    PyObject *r = NULL;
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, from);
    }
    else {
        r = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    Py_DECREF(tmp);
    Py_DECREF(path);
    return r;
}

static PyObject *
file_id(PyObject *module, PyObject *arg)
{
    /* (st_dev, st_ino) of a path, as os.stat gives them */
    PyObject *path = NULL;
    if (!PyUnicode_FSConverter(arg, &path))
        return NULL;
    struct stat st;
    PyThreadState *ts = PyEval_SaveThread();
    int rc = stat(PyBytes_AS_STRING(path), &st);
    int err = errno;
    agent_restore(ts);
    PyObject *r = NULL;
    if (rc != 0) {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, arg);
    }
    else {
        r = Py_BuildValue("(KK)", (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
    }
    Py_DECREF(path);
    return r;
}

static PyObject *
read_held(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    /* pread(fd, n, 0) keeping the lock: for /proc files, which never block */
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_held(fd, n)");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[0]);
    Py_ssize_t size = fd < 0 ? -1 : PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred())
        return NULL;
    char buf[512];
    if (size < 0 || size > (Py_ssize_t)sizeof(buf)) {
        PyErr_SetString(PyExc_ValueError, "read_held reads at most 512 bytes");
        return NULL;
    }
    ssize_t n;
    do {
        n = pread(fd, buf, (size_t)size, 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyBytes_FromStringAndSize(buf, n);
}

static PyObject *
gil_stats(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("{sKsi}", "hand_overs", hand_overs, "waiting",
                         __atomic_load_n(&gil_wanted, __ATOMIC_RELAXED));
}

/* Waker: threading.Event's set, clear, is_set and wait for the writer's wake-up, with the
 * wait's end taken through agent_restore. A futex word: no lock whose state a fork could
 * copy half-taken. Linux only (elsewhere the writer keeps threading.Event). */
#ifdef __linux__
typedef struct {
    PyObject_HEAD
    uint32_t flag;
} WakerObject;

static PyObject *
waker_set(WakerObject *self, PyObject *unused)
{
    if (__atomic_exchange_n(&self->flag, 1, __ATOMIC_SEQ_CST) == 0)
        syscall(SYS_futex, &self->flag, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    Py_RETURN_NONE;
}

static PyObject *
waker_clear(WakerObject *self, PyObject *unused)
{
    __atomic_store_n(&self->flag, 0, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *
waker_is_set(WakerObject *self, PyObject *unused)
{
    return PyBool_FromLong(__atomic_load_n(&self->flag, __ATOMIC_SEQ_CST));
}

static PyObject *
waker_wait(WakerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double s = 1e9; /* wait(): until set */
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "wait(timeout=None)");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None && seconds_arg(args[0], &s) < 0)
        return NULL;
    if (__atomic_load_n(&self->flag, __ATOMIC_SEQ_CST))
        Py_RETURN_TRUE;
    long long deadline = wall_ns() + (long long)(s * 1e9);
    PyThreadState *ts = PyEval_SaveThread();
    for (;;) {
        if (__atomic_load_n(&self->flag, __ATOMIC_SEQ_CST))
            break;
        long long left = deadline - wall_ns();
        if (left <= 0)
            break;
        struct timespec t = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
        syscall(SYS_futex, &self->flag, FUTEX_WAIT_PRIVATE, 0, &t, NULL, 0);
    }
    agent_restore(ts);
    return PyBool_FromLong(__atomic_load_n(&self->flag, __ATOMIC_SEQ_CST));
}

static PyMethodDef waker_methods[] = {
    {"set", (PyCFunction)waker_set, METH_NOARGS, "set(): wake the thread waiting, if any."},
    {"clear", (PyCFunction)waker_clear, METH_NOARGS, "clear()"},
    {"is_set", (PyCFunction)waker_is_set, METH_NOARGS, "is_set()"},
    {"wait", (PyCFunction)(void (*)(void))waker_wait, METH_FASTCALL,
     "wait(timeout=None): until set or timeout seconds passed; whether it is set."},
    {NULL},
};

static PyTypeObject WakerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "perfsleuth.agent._speedups.Waker",
    .tp_basicsize = sizeof(WakerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Waker(): threading.Event for an agent thread's wait (see agent_restore).",
    .tp_methods = waker_methods,
    .tp_new = PyType_GenericNew,
};
#endif


/* spool.queue.enqueue's common case in C (the request fits: the queue is not full, the
 * recorder's site cache did not grow, the bytes fit the queue's share of the budget): the same
 * reads and writes of the queue module's globals, in the same order, without a Python frame.
 * Anything else (a drop, a site cache that grew, an odd value) is the Python enqueue's, which
 * then decides from the same globals; nothing is changed before handing over. */
static PyObject *queue_ns;       /* spool.queue's globals */
static PyObject *queue_fallback; /* spool.queue.python_enqueue */
static PyObject *s_queue_size, *s_queue, *s_sizes, *s_queue_bytes, *s_queue_limit,
    *s_site_cache, *s_sites_seen, *s_request_bytes, *s_wake_at, *s_wake, *s_append, *s_set;

/* The globals c_enqueue last read (and the queue's byte count it last wrote), valid while the
 * globals dict's version tag is the one noted: any write to the module's globals (the Python
 * enqueue, the writer's pops, a setting) changes the tag, and the next call reads them again.
 * q, sizes and cache are borrowed: the unchanged dict holds them. CPython 3.11 only (the tag;
 * later versions read the globals every time). Six lookups and int conversions a request. */
typedef struct {
    uint64_t version; /* 0: nothing noted */
    long long cap, size, queued_bytes, limit, wake_at, seen;
    PyObject *q, *sizes, *cache;
} QueueMemo;
static QueueMemo qm;
#define QUEUE_MEMO SITE_MEMO

static int
ns_ll(PyObject *name, long long *out) /* an exact int global: 1, else 0 (error cleared) */
{
    PyObject *v = PyDict_GetItemWithError(queue_ns, name); /* borrowed */
    if (v == NULL || !PyLong_CheckExact(v))
        return 0;
    *out = as_ll(v);
    return !(*out == -1 && PyErr_Occurred());
}

static PyObject *
c_enqueue(PyObject *module, PyObject *req)
{
    if (queue_ns == NULL || queue_fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure_queue first");
        return NULL;
    }
    Layout *layout = layout_of(Py_TYPE(req));
    long long cap, size, queued_bytes, limit, wake_at, seen = -1;
    PyObject *q, *sizes, *cache, *r;
    if (layout == NULL)
        goto python;
    uint64_t version = dict_version(queue_ns);
    if (QUEUE_MEMO && version != 0 && version == qm.version) {
        /* the globals as last read or written here: the dict is unchanged since */
        cap = qm.cap, size = qm.size, queued_bytes = qm.queued_bytes, limit = qm.limit;
        wake_at = qm.wake_at, seen = qm.seen, q = qm.q, sizes = qm.sizes, cache = qm.cache;
    }
    else {
        qm.version = 0;
        if (!ns_ll(s_queue_size, &cap) || !ns_ll(s_request_bytes, &size) ||
            !ns_ll(s_queue_bytes, &queued_bytes) || !ns_ll(s_queue_limit, &limit) ||
            !ns_ll(s_wake_at, &wake_at) ||
            (q = PyDict_GetItemWithError(queue_ns, s_queue)) == NULL ||
            (sizes = PyDict_GetItemWithError(queue_ns, s_sizes)) == NULL)
            goto python;
        cache = PyDict_GetItemWithError(queue_ns, s_site_cache);
        if (cache == NULL || !PyDict_CheckExact(cache) || !ns_ll(s_sites_seen, &seen)) {
            PyErr_Clear();
            cache = NULL;
            seen = -1;
        }
        if (QUEUE_MEMO && version != 0 && dict_version(queue_ns) == version) {
            qm = (QueueMemo){version, cap, size, queued_bytes, limit, wake_at, seen,
                             q, sizes, cache};
        }
    }
    Py_ssize_t n = PyObject_Size(q);
    if (n < 0 || n >= cap)
        goto python;
    PyObject *calls = get_field(req, layout, F_CALLS);
    if (calls != NULL && calls != Py_None) {
        if (!PyByteArray_CheckExact(calls) || cache == NULL || PyDict_GET_SIZE(cache) != seen)
            goto python;
        size += ((PyByteArrayObject *)calls)->ob_alloc; /* as allocated: grow_calls's slack */
    }
    PyObject *attrs = get_field(req, layout, F_ATTRS);
    if (attrs != NULL && attrs != Py_None) {
        /* a dict's size runs no Python code (which could rebind the queue read above) */
        if (!PyDict_CheckExact(attrs))
            goto python;
        size += 128 * (long long)PyDict_GET_SIZE(attrs);
    }
    if (queued_bytes + size > limit)
        goto python;
    q = Py_NewRef(q); /* held: the calls below may run Python code */
    sizes = Py_NewRef(sizes);
    PyObject *total = PyLong_FromLongLong(queued_bytes + size);
    PyObject *one_size = total ? PyLong_FromLongLong(size) : NULL;
    /* the memo stays valid through this write when nothing else changed the globals since
     * they were read (an allocation above may have run a collection's Python code) */
    int fresh = QUEUE_MEMO && qm.version != 0 && dict_version(queue_ns) == qm.version;
    int bad = one_size == NULL || PyDict_SetItem(queue_ns, s_queue_bytes, total) < 0;
    if (fresh && !bad) {
        qm.queued_bytes = queued_bytes + size;
        qm.version = dict_version(queue_ns);
    }
    else {
        qm.version = 0;
    }
    r = bad ? NULL : PyObject_CallMethodOneArg(sizes, s_append, one_size);
    bad |= r == NULL;
    Py_XDECREF(r);
    r = bad ? NULL : PyObject_CallMethodOneArg(q, s_append, req);
    bad |= r == NULL;
    Py_XDECREF(r);
    Py_XDECREF(total);
    Py_XDECREF(one_size);
    if (!bad && PyObject_Size(q) == wake_at) {
        PyObject *wake = PyDict_GetItemWithError(queue_ns, s_wake); /* borrowed */
        r = wake ? PyObject_CallMethodNoArgs(wake, s_set) : NULL;
        bad |= r == NULL;
        Py_XDECREF(r);
    }
    Py_DECREF(q);
    Py_DECREF(sizes);
    if (bad)
        return NULL;
    hand_over();
    Py_RETURN_NONE;
python:
    if (PyErr_Occurred())
        PyErr_Clear();
    r = PyObject_CallOneArg(queue_fallback, req);
    if (r != NULL)
        hand_over();
    return r;
}

static PyObject *
configure_queue(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_CheckExact(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "configure_queue(queue module globals, python_enqueue)");
        return NULL;
    }
    qm.version = 0;
    Py_XSETREF(queue_ns, Py_NewRef(args[0]));
    Py_XSETREF(queue_fallback, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyObject *
forget_memo(PyObject *module, PyObject *unused)
{
    clear_site_memo();
    clear_shapes();
    Py_RETURN_NONE;
}

static PyObject *
statement_shapes(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("(nn)", shapes != NULL ? PyDict_GET_SIZE(shapes) : 0, shapes_bytes);
}

static PyObject *
cpu_clock_reads(PyObject *module, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(cpu_reads);
}

/* For tests, the reading policy above with the times given rather than met (which a slow or
 * loaded machine stretches): a run ("run": run_cpu_at) or a step ("step": step_cpu_at) that
 * starts `since_ns` after this thread's last reading and lasts `ran_ns` (cpu_used: its end
 * read `ran_ns` plus the few ns of this call after its start). (clock reads at its start,
 * clock reads at its end). Leaves the thread's last reading fresh. */
static PyObject *
cpu_read_policy(PyObject *module, PyObject *args)
{
    const char *kind;
    long long since, ran;
    if (!PyArg_ParseTuple(args, "sLL", &kind, &since, &ran))
        return NULL;
    int step = strcmp(kind, "step") == 0;
    if (!step && strcmp(kind, "run") != 0) {
        PyErr_SetString(PyExc_ValueError, "kind: 'run' or 'step'");
        return NULL;
    }
    last_cpu = thread_cpu_ns();
    long long now = wall_ns();
    last_wall = now - since;
    unsigned long long r0 = cpu_reads;
    long long cpu0 = step ? step_cpu_at(now) : run_cpu_at(now);
    unsigned long long r1 = cpu_reads;
    cpu_used(cpu0, now - ran);
    return Py_BuildValue("(KK)", r1 - r0, cpu_reads - r1);
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(*, current, sql_text, internal_error, max_rows, perf_counter, code_kinds, "
     "classify, site_cache, stack_cache, max_depth, max_sites, stacks_per_site, sink, inflight, stats, "
     "no_sites, request_class, template_key, template_engines, engine_of, "
     "cpu_threshold, statement_scan, statement_bytes): what the wrappers use (each optional); cpu_threshold: begin measures the "
     "CPU time of a request whose trace id's low 32 bits are under it; perf_counter: time.perf_counter_ns when it is not "
     "CLOCK_MONOTONIC, else None; template_key (stacks.template_key, None: off), "
     "template_engines (templates._engine) and engine_of (templates.engine_of), given together "
     "once a template engine is loaded; statement_scan (wire._fingerprint.SCAN, None: "
     "off): statements are recorded as the first made with the same tokens, "
     "statement_bytes the memory for those at most."},
    {"record_call", (PyCFunction)(void (*)(void))py_record_call, METH_FASTCALL,
     "record_call(req, kind, system, statement, params, up): recorder.ActiveRequest."
     "record_call for a str statement, up counted from the calling Python function's frame; "
     "the row offset, -1 when Python's path must do it, -2 when the request is full"},
    {"begin", (PyCFunction)(void (*)(void))begin, METH_FASTCALL | METH_KEYWORDS,
     "begin(kind, method='', path='', *, cpu=False, cls=request_class): recorder.begin (cpu: "
     "in the CPU sample only)."},
    {"end", (PyCFunction)end, METH_O, "end(req): recorder.end."},
    {"enqueue", (PyCFunction)c_enqueue, METH_O,
     "enqueue(req): spool.queue.enqueue (its common case here, the rest through Python's)."},
    {"configure_queue", (PyCFunction)(void (*)(void))configure_queue, METH_FASTCALL,
     "configure_queue(globals, python_enqueue): the queue module enqueue works on."},
    {"forget_memo", (PyCFunction)forget_memo, METH_NOARGS,
     "forget_memo(): drop what record_site remembers of the places statements were made "
     "(recorder.forget_sites)."},
    {"statement_shapes", (PyCFunction)statement_shapes, METH_NOARGS,
     "statement_shapes(): (shapes, bytes) of the statements kept to share (shared_statement)."},
    {"cpu_clock_reads", (PyCFunction)cpu_clock_reads, METH_NOARGS,
     "cpu_clock_reads(): how many times the thread CPU clock was read (a system call each)."},
    {"cpu_read_policy", (PyCFunction)cpu_read_policy, METH_VARARGS,
     "cpu_read_policy(kind, since_ns, ran_ns): for tests, (reads at the start, reads at the end) "
     "of a 'run' or 'step' starting since_ns after the thread's last reading, lasting ran_ns."},
    {"sleep", (PyCFunction)agent_sleep, METH_O,
     "sleep(seconds): time.sleep for an agent thread (the lock taken back as agent_restore)."},
    {"write", (PyCFunction)(void (*)(void))agent_write, METH_FASTCALL,
     "write(fd, data): os.write for an agent thread (the lock taken back as agent_restore)."},
    {"replace_file", (PyCFunction)(void (*)(void))replace_file, METH_FASTCALL,
     "replace_file(path, data): data written to path + '.tmp' and renamed over path (OSError "
     "on failure, the .tmp removed), the lock taken back as agent_restore."},
    {"file_id", (PyCFunction)file_id, METH_O,
     "file_id(path): (st_dev, st_ino) as os.stat's, the lock taken back as agent_restore."},
    {"read_held", (PyCFunction)(void (*)(void))read_held, METH_FASTCALL,
     "read_held(fd, n): os.pread(fd, n, 0) without releasing the lock (/proc files; n <= 512)."},
    {"gil_stats", (PyCFunction)gil_stats, METH_NOARGS,
     "gil_stats(): {'hand_overs': made so far, 'waiting': agent threads waiting for the lock}."},
    {"row", (PyCFunction)(void (*)(void))row, METH_FASTCALL,
     "row(req, user_header, tenant_header): the request's column values (shipper)."},
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
    if (PyType_Ready(&WrapperType) < 0 || PyType_Ready(&MarkedType) < 0 ||
        PyType_Ready(&HandOffType) < 0 || PyType_Ready(&SendTapType) < 0 ||
        PyType_Ready(&MeterType) < 0)
        return NULL;
#ifdef __linux__
    if (PyType_Ready(&WakerType) < 0)
        return NULL;
#endif
    INTERN(s_rows_attr, "_perfsleuth_rows");
    INTERN(s_description, "description");
    INTERN(s_rowcount, "rowcount");
    INTERN(s_record_call, "record_call");
    INTERN(s_fail_call, "fail_call");
    INTERN(s_dropped, "_dropped");
    INTERN(s_db, "db");
    INTERN(s_sqlite, "sqlite");
    INTERN(s_params, "params");
    INTERN(s_requests_recorded, "requests_recorded");
    INTERN(s_type, "type");
    INTERN(s_body, "body");
    INTERN(s_more_body, "more_body");
    INTERN(s_status, "status");
    INTERN(s_headers, "headers");
    INTERN(s_response_body, "http.response.body");
    INTERN(s_response_start, "http.response.start");
    INTERN(s_pathsend, "http.response.pathsend");
    INTERN(s_zerocopy, "http.response.zerocopy");
    INTERN(s_empty, "");
    INTERN(s_queue_size, "queue_size");
    INTERN(s_queue, "_queue");
    INTERN(s_sizes, "_sizes");
    INTERN(s_queue_bytes, "_queue_bytes");
    INTERN(s_queue_limit, "queue_limit");
    INTERN(s_site_cache, "_site_cache");
    INTERN(s_sites_seen, "_sites_seen");
    INTERN(s_request_bytes, "REQUEST_BYTES");
    INTERN(s_wake_at, "WAKE_AT");
    INTERN(s_wake, "wake");
    INTERN(s_append, "append");
    INTERN(s_set, "set");
    INTERN(s_send, "send");
    INTERN(s_throw, "throw");
    INTERN(s_close, "close");
    INTERN(s_cr_frame, "cr_frame");
    INTERN(s_cr_await, "cr_await");
    INTERN(begin_keywords[0], "kind");
    INTERN(begin_keywords[1], "method");
    INTERN(begin_keywords[2], "path");
    INTERN(begin_keywords[3], "cpu");
    INTERN(begin_keywords[4], "cls");
    if (pthread_atfork(NULL, NULL, rng_after_fork) != 0 ||
        pthread_atfork(NULL, NULL, gil_after_fork) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    if ((layouts = PyDict_New()) == NULL)
        return NULL;
    if ((null_value = PyLong_FromLongLong(-9223372036854775807LL - 1)) == NULL ||
        (zero = PyLong_FromLong(0)) == NULL || (one = PyLong_FromLong(1)) == NULL ||
        (up_one = PyLong_FromLong(1)) == NULL || (empty_tuple = PyTuple_New(0)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "CursorMethod", (PyObject *)&WrapperType) < 0 ||
        PyModule_AddObjectRef(m, "HandOff", (PyObject *)&HandOffType) < 0 ||
        PyModule_AddObjectRef(m, "SendTap", (PyObject *)&SendTapType) < 0 ||
        PyModule_AddObjectRef(m, "CpuMeter", (PyObject *)&MeterType) < 0 ||
        PyModule_AddIntConstant(m, "EXECUTE", EXECUTE) < 0 ||
        PyModule_AddIntConstant(m, "FETCHONE", FETCHONE) < 0 ||
        PyModule_AddIntConstant(m, "FETCHMANY", FETCHMANY) < 0 ||
        PyModule_AddIntConstant(m, "FETCHALL", FETCHALL) < 0 ||
        PyModule_AddIntConstant(m, "NEXT", NEXT) < 0 ||
        PyModule_AddIntConstant(m, "CONN_CURSOR", CONN_CURSOR) < 0 ||
        PyModule_AddIntConstant(m, "CONN_EXECUTE", CONN_EXECUTE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef __linux__
    if (PyModule_AddObjectRef(m, "Waker", (PyObject *)&WakerType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
