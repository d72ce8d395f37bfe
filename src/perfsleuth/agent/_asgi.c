/* perfsleuth.agent._asgi: the ASGI request path of agent.frameworks.asgi in C.
 *
 * Optional, like _speedups and _wsgi (PERFSLEUTH_SPEEDUPS=0 leaves it out): frameworks/asgi.py
 * is the reference, and this is the same code path for path: _recording(inner)'s __call__ (a
 * Recording: a method descriptor whose call returns a Call, an awaitable without a Python
 * frame), _finish, _route_name's cache hit and capture.reason's common "nothing to keep". In
 * Python these were a coroutine resumed at every step of the request plus _finish, _route_name
 * and the capture decision: ~330 bytecodes a FastAPI request on the event loop's thread.
 *
 * A Call does what the coroutine did, when the coroutine did it: nothing until its first step
 * (then begin, the send tap, the task, the app called and, for a request in the CPU sample,
 * driven through the CpuMeter); each step forwarded to the app's awaitable; the request ended
 * exactly once when that returns, raises (a 500 unless the response completed, the exception's
 * class name), is closed or is dropped. cr_frame and cr_await are the app's awaitable's (as
 * the CpuMeter's), so the sampler's and the watchdog's walks down a task's await chain see the
 * app where the coroutine's own frame was. The rare cases call back into asgi.py (_new_loop,
 * _route_name on a cache miss, _under_mount, SendTap.declared_length, capture.finish_asgi).
 * Module globals (asgi._begin, _end, _CpuMeter, _loop_of, capture.on, ...) are read from the
 * modules' dicts at each request, so that what Python sees (a test's monkeypatch) this sees
 * too; the functions done here in C (asgi._finish, asgi._route_name, capture.reason,
 * capture.finish_asgi) are done here only while each is still the one configure saw, else the
 * Python function now bound is called. Nothing here raises into the application: internal
 * failures (Exception) are counted (recorder.internal_error); the application's and the
 * server's exceptions pass, and so does a BaseException that is not an Exception
 * (KeyboardInterrupt, SystemExit) raised in the agent's Python code, as in the reference: the
 * request ends and it comes out of the step (send, throw, close) it was raised in. A scope that
 * is not http (lifespan, websocket) gets a Call too, unrecorded: the app is called at its
 * first step, as the reference coroutine calls it at its first await.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include "_agent_c.h"

static PyObject *recorder_dict; /* perfsleuth.agent.recorder.__dict__ */
static PyObject *capture_dict;  /* perfsleuth.agent.capture.__dict__ */
static PyObject *asgi_dict;     /* perfsleuth.agent.frameworks.asgi.__dict__ */
static PyObject *cpu_sampled_fn; /* recorder.cpu_sampled as configured (decided here) */
/* asgi._finish, asgi._route_name, capture.reason and capture.finish_asgi as configured: done
 * here while each is still bound */
static PyObject *finish_fn, *route_name_fn, *reason_fn, *finish_asgi_fn;

static PyObject *s_web, *s_empty, *s_slash, *s_http, *s_type, *s_method, *s_path, *s_headers;
static PyObject *s_route, *s_fastapi, *s_ctx, *s_router, *s_app, *s_get;
static PyObject *s_begin, *s_end, *s_on, *s_internal_error, *s_cls_kw, *s_asgi_request;
static PyObject *s_cpu_sampled, *s_cpu_threshold, *s_send_tap, *s_cpu_meter, *s_loop_of;
static PyObject *s_running_tasks, *s_new_loop, *s_receive, *s_status, *s_sent, *s_pathsend;
static PyObject *s_complete, *s_names, *s_route_name, *s_under_mount, *s_unmatched;
static PyObject *s_py_send_tap, *s_declared_length, *s_finish_asgi, *s_fault, *s_slow_ns;
static PyObject *s_countdown, *s_throw, *s_close, *s_cr_frame, *s_cr_await, *s_finish, *s_reason;
static PyObject *s_qualname, *s_call_name;
static PyObject *zero;

/* ------------------------------------------------------------------ request fields
 * _AsgiRequest has __slots__: the fields used here are read and set through their member
 * descriptors' offsets, looked up once per class (any other object: by name). */

enum {
    F_METHOD, F_ENDPOINT, F_STATUS, F_ERROR, F_REQ_BYTES, F_RESP_BYTES, F_CPU_NS, F_THREAD,
    F_KEEP, F_START, F_END, F_TRACE_ID, F_HEADERS, F_TASK, F_RECEIVE, F_OUT, F_RECEIVED, F_TAP,
    N_FIELDS
};
static const char *field_names[N_FIELDS] = {
    "method", "endpoint", "status", "error", "req_bytes", "resp_bytes", "cpu_ns", "thread",
    "keep", "start", "end", "trace_id", "headers", "task", "_receive", "out", "received", "tap",
};
static PyObject *field_strs[N_FIELDS];

static PyTypeObject *layout_cls; /* strong reference: the class last laid out */
static Py_ssize_t layout[N_FIELDS];

static int
laid_out(PyTypeObject *cls)
{
    if (cls == layout_cls)
        return 1;
    Py_ssize_t offsets[N_FIELDS];
    for (int k = 0; k < N_FIELDS; k++) {
        PyObject *descr = PyObject_GetAttr((PyObject *)cls, field_strs[k]);
        int ok = descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                 PyType_IsSubtype(cls, PyDescr_TYPE(descr)) &&
                 ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        if (ok)
            offsets[k] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_XDECREF(descr);
        if (!ok) {
            PyErr_Clear();
            return 0;
        }
    }
    memcpy(layout, offsets, sizeof(offsets));
    Py_XSETREF(layout_cls, (PyTypeObject *)Py_NewRef(cls));
    return 1;
}

/* A new reference to req's field (NULL with AttributeError when unset). */
static PyObject *
get(PyObject *req, int field)
{
    if (laid_out(Py_TYPE(req))) {
        PyObject *v = *(PyObject **)((char *)req + layout[field]);
        if (v == NULL) {
            PyErr_SetObject(PyExc_AttributeError, field_strs[field]);
            return NULL;
        }
        return Py_NewRef(v);
    }
    return PyObject_GetAttr(req, field_strs[field]);
}

/* Set req's field (steals value; NULL value: an error is set already). -1 on error. */
static int
set(PyObject *req, int field, PyObject *value)
{
    if (value == NULL)
        return -1;
    if (laid_out(Py_TYPE(req))) {
        PyObject **slot = (PyObject **)((char *)req + layout[field]);
        Py_XSETREF(*slot, value);
        return 0;
    }
    int r = PyObject_SetAttr(req, field_strs[field], value);
    Py_DECREF(value);
    return r;
}

/* ------------------------------------------------------------------ helpers */

/* Whether the exception set is an Exception (what the reference's ``except Exception``
 * catches); none set: 1. */
static inline int
is_exception(void)
{
    return !PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_Exception);
}

/* Count an internal failure (an Exception) and clear it: the application never sees it; 0.
 * Any other BaseException (KeyboardInterrupt, SystemExit) is not the agent's: it stays set
 * (-1), for the caller to let through. */
static int
failed(void)
{
    if (!is_exception())
        return -1;
    PyErr_Clear();
    PyObject *f = recorder_dict ? PyDict_GetItemWithError(recorder_dict, s_internal_error) : NULL;
    if (f != NULL) {
        PyObject *r = PyObject_CallNoArgs(f);
        Py_XDECREF(r);
    }
    if (!is_exception())
        return -1;
    PyErr_Clear();
    return 0;
}

/* The exception set now replaces (type, value, tb), fetched before, which becomes its
 * __context__ (as an exception raised in a finally block); the references are consumed. */
static void
replaced(PyObject *type, PyObject *value, PyObject *tb)
{
    if (type == NULL)
        return;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (v2 != NULL && value != NULL && v2 != value)
        PyException_SetContext(v2, Py_NewRef(value));
    PyErr_Restore(t2, v2, tb2);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* A module global (borrowed; NULL with no error when absent). */
static inline PyObject *
global(PyObject *dict, PyObject *name)
{
    return PyDict_GetItemWithError(dict, name);
}

/* The globals of asgi.py and recorder.py read at every request, remembered (borrowed) while
 * their module's dict is unchanged (its version tag, which every change of the dict moves:
 * a rebinding, a monkeypatch, a deletion): a lookup in a module's dict costs ~100-200
 * instructions, ~20 of them a request, where Python's LOAD_GLOBAL has its cache. Python 3.14
 * has no version tag: there every read is a lookup. */
enum {
    G_BEGIN, G_END, G_CLS, G_CPU_SAMPLED, G_SEND_TAP, G_CPU_METER, G_LOOP_OF, G_RUNNING_TASKS,
    G_NAMES, G_FINISH, G_ROUTE_NAME, N_ASGI_GLOBALS
};
static PyObject **asgi_names[N_ASGI_GLOBALS] = {
    &s_begin, &s_end, &s_asgi_request, &s_cpu_sampled, &s_send_tap, &s_cpu_meter, &s_loop_of,
    &s_running_tasks, &s_names, &s_finish, &s_route_name,
};
static PyObject *asgi_values[N_ASGI_GLOBALS];
static PyObject *cpu_threshold_value;

#if PY_VERSION_HEX < 0x030E0000
#define DICT_VERSIONS 1
static uint64_t asgi_version, recorder_version; /* 0: not read yet */

static inline uint64_t
version_of(PyObject *dict)
{
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
    return ((PyDictObject *)dict)->ma_version_tag;
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
}
#endif

/* asgi.py's global k (borrowed; NULL with no error when absent). */
static PyObject *
asgi_global(int k)
{
#ifdef DICT_VERSIONS
    uint64_t v = version_of(asgi_dict);
    if (v != asgi_version) {
        int ok = 1;
        for (int j = 0; j < N_ASGI_GLOBALS; j++) {
            asgi_values[j] = PyDict_GetItemWithError(asgi_dict, *asgi_names[j]);
            if (asgi_values[j] == NULL && PyErr_Occurred()) {
                PyErr_Clear();
                ok = 0;
            }
        }
        asgi_version = ok ? v : 0;
    }
    return asgi_values[k];
#else
    PyObject *r = PyDict_GetItemWithError(asgi_dict, *asgi_names[k]);
    if (r == NULL)
        PyErr_Clear();
    return r;
#endif
}

/* recorder._cpu_threshold (borrowed; NULL with no error when absent). */
static PyObject *
cpu_threshold(void)
{
#ifdef DICT_VERSIONS
    uint64_t v = version_of(recorder_dict);
    if (v != recorder_version) {
        cpu_threshold_value = PyDict_GetItemWithError(recorder_dict, s_cpu_threshold);
        recorder_version = cpu_threshold_value || !PyErr_Occurred() ? v : 0;
        PyErr_Clear();
    }
    return cpu_threshold_value;
#else
    PyObject *r = PyDict_GetItemWithError(recorder_dict, s_cpu_threshold);
    if (r == NULL)
        PyErr_Clear();
    return r;
#endif
}

/* scope.get(key) of a dict scope (borrowed; NULL when absent, also on error: cleared). */
static inline PyObject *
sget(PyObject *scope, PyObject *key)
{
    PyObject *v = PyDict_GetItemWithError(scope, key);
    if (v == NULL)
        PyErr_Clear();
    return v;
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

/* What ``await aw`` iterates: aw itself for a coroutine or generator, else aw.__await__()
 * (new reference; NULL with the TypeError await raises). */
static PyObject *
await_iter(PyObject *aw)
{
    if (PyCoro_CheckExact(aw) || PyGen_CheckExact(aw))
        return Py_NewRef(aw);
    unaryfunc am_await = Py_TYPE(aw)->tp_as_async ? Py_TYPE(aw)->tp_as_async->am_await : NULL;
    if (am_await == NULL) {
        PyErr_Format(PyExc_TypeError, "object %.100s can't be used in 'await' expression",
                     Py_TYPE(aw)->tp_name);
        return NULL;
    }
    PyObject *it = am_await(aw);
    if (it != NULL && !PyIter_Check(it)) {
        PyErr_Format(PyExc_TypeError, "__await__() returned non-iterator of type '%.100s'",
                     Py_TYPE(it)->tp_name);
        Py_CLEAR(it);
    }
    return it;
}

/* ------------------------------------------------------------------ the send tap's fields
 * The send tap is _speedups.SendTap (or asgi.SendTap without it): its status, sent, pathsend
 * and complete are read through their member descriptors' offsets and types (C ints and
 * bools), looked up once per class; any other object (the Python SendTap): by name. */

enum { T_STATUS, T_SENT, T_PATHSEND, T_COMPLETE, N_TAP_FIELDS };
static PyObject **tap_field_strs[N_TAP_FIELDS] = {&s_status, &s_sent, &s_pathsend, &s_complete};
static PyTypeObject *tap_cls; /* strong reference: the class last laid out */
static Py_ssize_t tap_offsets[N_TAP_FIELDS];
static int tap_types[N_TAP_FIELDS];

static int
tap_laid_out(PyTypeObject *cls)
{
    if (cls == tap_cls)
        return 1;
    Py_ssize_t offsets[N_TAP_FIELDS];
    int types[N_TAP_FIELDS];
    for (int k = 0; k < N_TAP_FIELDS; k++) {
        PyObject *descr = PyObject_GetAttr((PyObject *)cls, *tap_field_strs[k]);
        int ok = descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                 PyType_IsSubtype(cls, PyDescr_TYPE(descr));
        if (ok) {
            PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
            ok = m->type == T_INT || m->type == T_LONGLONG || m->type == T_BOOL;
            offsets[k] = m->offset;
            types[k] = m->type;
        }
        Py_XDECREF(descr);
        if (!ok) {
            PyErr_Clear();
            return 0;
        }
    }
    memcpy(tap_offsets, offsets, sizeof(offsets));
    memcpy(tap_types, types, sizeof(types));
    Py_XSETREF(tap_cls, (PyTypeObject *)Py_NewRef(cls));
    return 1;
}

/* The tap's field k as a C integer (*value); -1 on error. */
static int
tap_get(PyObject *out, int k, long long *value)
{
    if (tap_laid_out(Py_TYPE(out))) {
        char *at = (char *)out + tap_offsets[k];
        switch (tap_types[k]) {
        case T_INT:
            *value = *(int *)at;
            break;
        case T_LONGLONG:
            *value = *(long long *)at;
            break;
        default: /* T_BOOL */
            *value = *(char *)at != 0;
        }
        return 0;
    }
    PyObject *v = PyObject_GetAttr(out, *tap_field_strs[k]);
    if (v == NULL)
        return -1;
    int overflow = 0;
    *value = PyLong_AsLongLongAndOverflow(v, &overflow); /* a bool is an int */
    Py_DECREF(v);
    if (overflow)
        PyErr_SetString(PyExc_OverflowError, "a send tap's field out of range");
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

/* ------------------------------------------------------------------ the awaitable */

enum { START, RUNNING, DONE };

typedef struct {
    PyObject_HEAD
    PyObject *inner;  /* how the app is called: see call_app */
    PyObject *python; /* the Recording's Python version (its name, for a warning) */
    PyObject *self, *scope, *receive, *send; /* the call's arguments (scope: until done) */
    PyObject *req;                            /* the request, while it is recorded */
    PyObject *aw, *it; /* the app's awaitable (or its CpuMeter), and what awaiting it iterates */
    char how, state, running, http; /* http: a request to record (else only the app's call) */
} CallObject;

enum { HOW_CALL, HOW_APP, HOW_DIRECT };

static PyTypeObject CallType;

/* The app's awaitable: inner(self, scope, receive, send), self.app(scope, receive, send) or
 * self(scope, receive, send). */
static PyObject *
call_app(int how, PyObject *inner, PyObject *self, PyObject *scope, PyObject *receive,
         PyObject *send)
{
    PyObject *args[4] = {self, scope, receive, send};
    if (how == HOW_CALL)
        return PyObject_Vectorcall(inner, args, 4, NULL);
    if (how == HOW_DIRECT)
        return PyObject_Vectorcall(self, args + 1, 3, NULL);
    PyObject *app = PyObject_GetAttr(self, s_app);
    if (app == NULL)
        return NULL;
    PyObject *r = PyObject_Vectorcall(app, args + 1, 3, NULL);
    Py_DECREF(app);
    return r;
}

/* capture.reason's common case, decided here: nothing to keep (not flagged, not failed, not
 * slow, not the random sample's turn) and no body tap. 1: done (the sample's countdown
 * counted down, as reason does); 0: capture.finish_asgi decides (nothing was changed). */
static int
not_kept(PyObject *req)
{
    if (global(capture_dict, s_reason) != reason_fn ||
        global(capture_dict, s_finish_asgi) != finish_asgi_fn)
        goto python; /* replaced: the Python functions decide */
    PyObject *tap = get(req, F_TAP);
    int no_tap = tap == Py_None;
    Py_XDECREF(tap);
    if (!no_tap)
        goto python;
    PyObject *fault = global(capture_dict, s_fault);
    PyObject *slow = global(capture_dict, s_slow_ns);
    PyObject *countdown = global(capture_dict, s_countdown);
    if (fault != Py_False || slow == NULL || !PyLong_CheckExact(slow) || countdown == NULL ||
        !PyLong_CheckExact(countdown))
        goto python;
    PyObject *keep = get(req, F_KEEP), *status = get(req, F_STATUS);
    PyObject *start = get(req, F_START), *end = get(req, F_END);
    int simple = keep == Py_None && status != NULL &&
                 (status == Py_None || PyLong_CheckExact(status)) && start != NULL &&
                 PyLong_CheckExact(start) && end != NULL && PyLong_CheckExact(end);
    long long st = simple && status != Py_None ? as_ll(status) : 0;
    long long wall = simple ? as_ll(end) - as_ll(start) : 0;
    long long slow_ns = as_ll(slow), n = as_ll(countdown);
    Py_XDECREF(keep);
    Py_XDECREF(status);
    Py_XDECREF(start);
    Py_XDECREF(end);
    if (!simple || PyErr_Occurred() || st >= 500 || wall >= slow_ns || n - 1 <= 0)
        goto python;
    PyObject *less = PyLong_FromLongLong(n - 1);
    if (less == NULL || PyDict_SetItem(capture_dict, s_countdown, less) < 0) {
        Py_XDECREF(less);
        goto python;
    }
    Py_DECREF(less);
    return 1;
python:
    PyErr_Clear();
    return 0;
}

#ifdef DICT_VERSIONS
/* The last _names hits, by the objects of their key: a hit stands while the _names dict is
 * the same dict at the same version (unchanged since: the same entry would be found there);
 * its key's tuple of ids made and looked up cost ~1,200 instructions a request. */
#define ROUTE_SLOTS 64
typedef struct {
    PyObject *route, *ctx, *router, *method, *name; /* strong references */
    PyObject *names;                                /* compared only */
    uint64_t version;
} RouteSlot;
static RouteSlot route_slots[ROUTE_SLOTS];

static inline RouteSlot *
route_slot(PyObject *route, PyObject *ctx, PyObject *router)
{
    uintptr_t h = ((uintptr_t)route >> 4) ^ ((uintptr_t)ctx >> 6) ^ ((uintptr_t)router >> 8);
    return &route_slots[(h ^ (h >> 7)) % ROUTE_SLOTS];
}
#endif

/* asgi._route_name(scope, method, status): the _names hit here, else asgi.py's (new ref). */
static PyObject *
route_name(PyObject *scope, PyObject *method, PyObject *status)
{
    PyObject *names = asgi_global(G_NAMES);
    if (asgi_global(G_ROUTE_NAME) == route_name_fn && names != NULL && PyDict_CheckExact(names) &&
        PyUnicode_CheckExact(method)) {
        PyObject *route = sget(scope, s_route), *ctx = NULL, *router = sget(scope, s_router);
        PyObject *fastapi = sget(scope, s_fastapi);
        if (fastapi != NULL && PyDict_CheckExact(fastapi))
            ctx = sget(fastapi, s_ctx);
        route = route ? route : Py_None;
        ctx = ctx ? ctx : Py_None;
        router = router ? router : Py_None;
#ifdef DICT_VERSIONS
        RouteSlot *slot = route_slot(route, ctx, router);
        if (slot->name != NULL && slot->names == names && slot->version == version_of(names) &&
            slot->route == route && slot->ctx == ctx && slot->router == router &&
            (slot->method == method || PyUnicode_Compare(slot->method, method) == 0))
            return Py_NewRef(slot->name);
#endif
        PyObject *key = PyTuple_New(4);
        if (key == NULL)
            return NULL;
        PyObject *ids[3] = {route, ctx, router};
        for (int k = 0; k < 3; k++) {
            PyObject *id = PyLong_FromVoidPtr(ids[k]);
            if (id == NULL) {
                Py_DECREF(key);
                return NULL;
            }
            PyTuple_SET_ITEM(key, k, id);
        }
        PyTuple_SET_ITEM(key, 3, Py_NewRef(method));
        PyObject *hit = PyDict_GetItemWithError(names, key); /* borrowed */
        Py_DECREF(key);
        if (hit != NULL && PyTuple_CheckExact(hit) && PyTuple_GET_SIZE(hit) == 4 &&
            PyTuple_GET_ITEM(hit, 0) == route && PyTuple_GET_ITEM(hit, 1) == ctx &&
            PyTuple_GET_ITEM(hit, 2) == router) {
            PyObject *name = PyTuple_GET_ITEM(hit, 3);
#ifdef DICT_VERSIONS
            /* the slot is whole before the objects it held go (their deallocation can run
             * code) */
            PyObject *old[5] = {slot->route, slot->ctx, slot->router, slot->method, slot->name};
            slot->route = Py_NewRef(route);
            slot->ctx = Py_NewRef(ctx);
            slot->router = Py_NewRef(router);
            slot->method = Py_NewRef(method);
            slot->name = Py_NewRef(name);
            slot->names = names;
            slot->version = version_of(names);
            for (int k = 0; k < 5; k++)
                Py_XDECREF(old[k]);
#endif
            return Py_NewRef(name);
        }
        if (PyErr_Occurred())
            return NULL;
    }
    PyObject *f = asgi_global(G_ROUTE_NAME);
    if (f == NULL)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_NameError, "_route_name");
    PyObject *args[3] = {scope, method, status};
    return PyObject_Vectorcall(f, args, 3, NULL);
}

/* The bytes, status and endpoint of an ended exchange (asgi._finish's try block). -1: error. */
static int
finish_fields(PyObject *req, PyObject *scope)
{
    int rc = -1;
    PyObject *received = NULL, *out = NULL, *status = NULL, *v = NULL, *endpoint = NULL;
    PyObject *method = NULL, *name = NULL;
    if ((received = get(req, F_RECEIVED)) == NULL)
        goto done;
    int t = PyObject_IsTrue(received);
    if (t < 0 || (t && set(req, F_REQ_BYTES, Py_NewRef(received)) < 0))
        goto done;
    if ((out = get(req, F_OUT)) == NULL || (status = get(req, F_STATUS)) == NULL)
        goto done;
    long long code, pathsend, sent;
    if (status == Py_None) { /* not set to 500 by an exception */
        if (tap_get(out, T_STATUS, &code) < 0)
            goto done;
        if (code) {
            Py_SETREF(status, PyLong_FromLongLong(code));
            if (status == NULL)
                goto done;
        }
        if (set(req, F_STATUS, Py_NewRef(status)) < 0)
            goto done;
    }
    if (tap_get(out, T_PATHSEND, &pathsend) < 0 || tap_get(out, T_SENT, &sent) < 0 ||
        (v = PyLong_FromLongLong(sent)) == NULL)
        goto done;
    if (pathsend) { /* sent by the server from a file: what was sent plus the declared length */
        PyObject *cls = global(asgi_dict, s_py_send_tap);
        PyObject *f = cls ? PyObject_GetAttr(cls, s_declared_length) : NULL;
        PyObject *n = f ? PyObject_CallOneArg(f, out) : NULL;
        Py_XDECREF(f);
        if (n == NULL)
            goto done;
        if (n != Py_None && PyObject_IsTrue(n)) {
            PyObject *sum = PyNumber_Add(v, n);
            Py_DECREF(n);
            if (sum == NULL)
                goto done;
            Py_SETREF(v, sum);
        }
        else
            Py_DECREF(n);
    }
    if (set(req, F_RESP_BYTES, v) < 0) {
        v = NULL;
        goto done;
    }
    v = NULL;
    if ((endpoint = get(req, F_ENDPOINT)) == NULL || (t = PyObject_IsTrue(endpoint)) < 0)
        goto done;
    if (!t) {
        if ((method = get(req, F_METHOD)) == NULL)
            goto done;
        name = route_name(scope, method, status);
    }
    else { /* named by a framework mounted inside (Flask via a2wsgi, Django): add the mount */
        PyObject *f = global(asgi_dict, s_under_mount);
        PyObject *args[2] = {scope, endpoint};
        name = f ? PyObject_Vectorcall(f, args, 2, NULL) : NULL;
    }
    if (name == NULL || set(req, F_ENDPOINT, name) < 0) {
        name = NULL;
        goto done;
    }
    rc = 0;
done:
    if (rc < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "asgi: a global is missing");
    Py_XDECREF(received);
    Py_XDECREF(out);
    Py_XDECREF(status);
    Py_XDECREF(v);
    Py_XDECREF(endpoint);
    Py_XDECREF(method);
    return rc;
}

/* asgi._finish(req, scope): the request ends (once). An exception set on entry is kept; 0.
 * -1: a BaseException that is not an Exception came out of the agent's Python code (or
 * asgi._finish, when replaced, raised): it is set, in place of the one set on entry (its
 * __context__), and nothing more of the end was done, as in the reference. */
static int
finish(CallObject *c)
{
    PyObject *req = c->req;
    if (req == NULL)
        return 0;
    c->req = NULL;
    PyObject *type, *value, *tb, *r;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *scope = c->scope ? c->scope : Py_None;
    PyObject *py_finish = asgi_global(G_FINISH);
    if (py_finish != finish_fn) { /* replaced: the Python function now bound */
        PyObject *args[2] = {req, scope};
        r = py_finish ? PyObject_Vectorcall(py_finish, args, 2, NULL) : NULL;
        if (r == NULL && py_finish == NULL)
            PyErr_SetString(PyExc_NameError, "name '_finish' is not defined");
        if (r == NULL)
            goto raised;
        Py_DECREF(r);
        goto done;
    }
    if (finish_fields(req, scope) < 0) {
        if (failed() < 0)
            goto raised;
        PyObject *endpoint = get(req, F_ENDPOINT);
        int t = endpoint ? PyObject_IsTrue(endpoint) : 0;
        Py_XDECREF(endpoint);
        if (t <= 0) {
            PyErr_Clear();
            PyObject *f = global(asgi_dict, s_unmatched);
            PyObject *method = f ? get(req, F_METHOD) : NULL;
            PyObject *name = method ? PyObject_CallOneArg(f, method) : NULL;
            Py_XDECREF(method);
            if (set(req, F_ENDPOINT, name) < 0 && failed() < 0)
                goto raised;
        }
    }
    /* the writer needs neither */
    if ((set(req, F_RECEIVE, Py_NewRef(Py_None)) < 0 || set(req, F_OUT, Py_NewRef(Py_None)) < 0) &&
        failed() < 0)
        goto raised;
    PyObject *end = asgi_global(G_END);
    r = end ? PyObject_CallOneArg(end, req) : NULL;
    if (r == NULL && failed() < 0)
        goto raised;
    Py_XDECREF(r);
    PyObject *on = global(capture_dict, s_on);
    int capturing = on ? PyObject_IsTrue(on) : 0;
    if (capturing > 0 && !not_kept(req)) {
        PyObject *fa = global(capture_dict, s_finish_asgi);
        PyObject *tap = fa ? get(req, F_TAP) : NULL;
        PyObject *args[3] = {req, scope, tap};
        r = tap ? PyObject_Vectorcall(fa, args, 3, NULL) : NULL;
        Py_XDECREF(tap);
        if (r == NULL && failed() < 0)
            goto raised;
        Py_XDECREF(r);
    }
    else if ((capturing < 0 || PyErr_Occurred()) && failed() < 0)
        goto raised;
done:
    Py_DECREF(req);
    PyErr_Restore(type, value, tb);
    return 0;
raised:
    Py_DECREF(req);
    replaced(type, value, tb);
    return -1;
}

/* The app raised (an exception is set, and stays set): a 500 unless the response completed,
 * the exception's class name, and the request ends. */
static void
finish_failed(CallObject *c)
{
    PyObject *req = c->req;
    if (req != NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *out = get(req, F_OUT);
        long long done = 0, code = 0;
        int started = out && tap_get(out, T_COMPLETE, &done) == 0 &&
                              tap_get(out, T_STATUS, &code) == 0
                          ? code != 0
                          : -1;
        Py_XDECREF(out);
        if (started >= 0 && !(done && started) && set(req, F_STATUS, PyLong_FromLong(500)) < 0)
            started = -1;
        PyObject *name = started >= 0 && type != NULL
                             ? PyType_GetName((PyTypeObject *)type)
                             : NULL;
        if (name != NULL)
            set(req, F_ERROR, name);
        PyErr_Clear(); /* as the reference's try/except: pass */
        PyErr_Restore(type, value, tb);
        finish(c); /* what is set after it is what comes out */
    }
    c->state = DONE;
    Py_CLEAR(c->aw);
    Py_CLEAR(c->it);
    Py_CLEAR(c->scope);
}

/* The app's awaitable returned: the request ends. -1: a BaseException from the agent's
 * Python code is set (see finish). */
static int
finish_ok(CallObject *c)
{
    int r = finish(c);
    c->state = DONE;
    Py_CLEAR(c->aw);
    Py_CLEAR(c->it);
    Py_CLEAR(c->scope);
    return r;
}

/* Whether req is in the CPU sample: recorder.cpu_sampled, decided here when asgi's
 * _cpu_sampled is it (1, 0; -1 on error). */
static int
sampled(PyObject *req)
{
    PyObject *f = asgi_global(G_CPU_SAMPLED);
    if (f == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (f == cpu_sampled_fn) {
        PyObject *threshold = cpu_threshold();
        PyObject *trace_id = get(req, F_TRACE_ID);
        if (threshold != NULL && PyLong_CheckExact(threshold) && trace_id != NULL &&
            PyLong_CheckExact(trace_id)) {
            unsigned long long low = PyLong_AsUnsignedLongLongMask(trace_id) & 0xFFFFFFFFULL;
            long long limit = as_ll(threshold);
            Py_DECREF(trace_id);
            if (PyErr_Occurred())
                return -1;
            return (long long)low < limit;
        }
        Py_XDECREF(trace_id);
        PyErr_Clear();
    }
    PyObject *r = PyObject_CallOneArg(f, req);
    if (r == NULL)
        return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* req.headers and req.task (the request's task, for the sampler and the loop watchdog);
 * -1 on error. */
static int
note_task(PyObject *req, PyObject *scope)
{
    PyObject *headers = sget(scope, s_headers);
    if (set(req, F_HEADERS, Py_NewRef(headers ? headers : Py_None)) < 0)
        return -1;
    PyObject *thread = get(req, F_THREAD);
    if (thread == NULL)
        return -1;
    PyObject *loop_of = asgi_global(G_LOOP_OF);
    PyObject *loop = NULL, *task = NULL;
    if (loop_of == NULL)
        goto error;
    if (PyDict_CheckExact(loop_of))
        loop = Py_XNewRef(PyDict_GetItemWithError(loop_of, thread));
    else {
        loop = PyObject_CallMethodOneArg(loop_of, s_get, thread);
        if (loop == Py_None)
            Py_CLEAR(loop);
    }
    if (PyErr_Occurred())
        goto error;
    PyObject *tasks = asgi_global(G_RUNNING_TASKS);
    if (loop != NULL && tasks != NULL && tasks != Py_None) {
        if (PyDict_CheckExact(tasks))
            task = Py_XNewRef(PyDict_GetItemWithError(tasks, loop));
        else
            task = PyObject_CallMethodOneArg(tasks, s_get, loop);
        if (PyErr_Occurred())
            goto error;
    }
    if (task == NULL || task == Py_None) {
        Py_XDECREF(task);
        PyObject *f = global(asgi_dict, s_new_loop);
        task = f ? PyObject_CallOneArg(f, thread) : NULL;
        if (task == NULL)
            goto error;
    }
    Py_DECREF(thread);
    Py_XDECREF(loop);
    return set(req, F_TASK, task);
error:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "asgi: a global is missing");
    Py_DECREF(thread);
    Py_XDECREF(loop);
    return -1;
}

/* The first step: what the coroutine did before its first await. 0: c->it is what to step
 * next; -1: an exception is set (the app's call raised; the request ended) and c is done. */
static int
start(CallObject *c)
{
    PyObject *scope = c->scope, *receive = c->receive, *send = c->send, *self = c->self;
    PyObject *req = NULL, *recv = NULL, *out = NULL, *app = NULL;
    c->receive = c->send = c->self = NULL; /* references now held here */
    c->state = RUNNING;
    if (!c->http)
        goto plain;
    PyObject *begin = asgi_global(G_BEGIN);
    PyObject *cls = begin ? asgi_global(G_CLS) : NULL;
    if (cls != NULL) {
        PyObject *method = sget(scope, s_method), *path = sget(scope, s_path);
        int t;
        if (method == NULL || (t = PyObject_IsTrue(method)) == 0)
            method = s_empty;
        else if (t < 0)
            goto unrecorded;
        if (path == NULL || (t = PyObject_IsTrue(path)) == 0)
            path = s_slash;
        else if (t < 0)
            goto unrecorded;
        PyObject *args[4] = {s_web, method, path, cls};
        req = PyObject_Vectorcall(begin, args, 3, s_cls_kw);
    }
unrecorded:
    if (req == NULL) {
        if (!is_exception()) /* KeyboardInterrupt, SystemExit: out of the first step */
            goto raised;
        PyErr_Clear(); /* as the reference: not recorded, not counted */
    }
    else if (req == Py_None)
        Py_CLEAR(req);
    if (req != NULL) {
        int metered = -1;
        if (set(req, F_RECEIVE, Py_NewRef(receive)) < 0 ||
            set(req, F_RECEIVED, Py_NewRef(zero)) < 0 || set(req, F_TAP, Py_NewRef(Py_None)) < 0 ||
            (metered = sampled(req)) < 0 ||
            set(req, F_CPU_NS, Py_NewRef(metered ? zero : Py_None)) < 0)
            goto lost;
        PyObject *tap = asgi_global(G_SEND_TAP);
        out = tap ? PyObject_CallOneArg(tap, send) : NULL;
        if (out == NULL || set(req, F_OUT, Py_NewRef(out)) < 0)
            goto lost;
        /* the user, tenant or samples are lost, not the request */
        if (note_task(req, scope) < 0 && failed() < 0)
            goto lost;
        if ((recv = PyObject_GetAttr(req, s_receive)) == NULL)
            goto lost;
        c->req = req; /* the request ends with c from here */
        req = NULL;
        app = call_app(c->how, c->inner, self, scope, recv, out);
        if (app != NULL && metered) {
            PyObject *meter = asgi_global(G_CPU_METER);
            PyObject *args[2] = {c->req, app};
            PyObject *m = meter ? PyObject_Vectorcall(meter, args, 2, NULL) : NULL;
            if (m == NULL && !PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "asgi: _CpuMeter is missing");
            Py_SETREF(app, m);
        }
    }
    else {
    plain:
        app = call_app(c->how, c->inner, self, scope, receive, send);
    }
    if (app != NULL) {
        c->it = await_iter(app);
        c->aw = app;
        app = NULL;
    }
    Py_XDECREF(recv);
    Py_XDECREF(out);
    Py_XDECREF(self);
    Py_XDECREF(receive);
    Py_XDECREF(send);
    if (c->it == NULL) {
        finish_failed(c);
        return -1;
    }
    return 0;
lost:
    /* the exchange could not be tapped: the request ends as it is, the app runs unrecorded;
     * a KeyboardInterrupt or SystemExit: the request ends and it comes out of the first step */
    {
        PyObject *type = NULL, *value = NULL, *tb = NULL;
        int interrupted = failed() < 0;
        if (interrupted)
            PyErr_Fetch(&type, &value, &tb);
        PyObject *end = asgi_global(G_END);
        PyObject *r = end ? PyObject_CallOneArg(end, req) : NULL;
        Py_XDECREF(r);
        if (interrupted) {
            if (PyErr_Occurred())
                replaced(type, value, tb);
            else
                PyErr_Restore(type, value, tb);
        }
        else if (r == NULL && !is_exception())
            interrupted = 1;
        else
            PyErr_Clear();
        Py_CLEAR(req);
        Py_CLEAR(out);
        if (!interrupted)
            goto plain;
    }
raised:
    c->state = DONE;
    Py_CLEAR(c->scope);
    Py_XDECREF(self);
    Py_XDECREF(receive);
    Py_XDECREF(send);
    return -1;
}

/* One step forwarded (send(arg)); the request ends when the app's awaitable returns or
 * raises. */
static PySendResult
call_am_send(CallObject *c, PyObject *arg, PyObject **result)
{
    *result = NULL;
    if (c->running) {
        PyErr_SetString(PyExc_ValueError, "coroutine already executing");
        return PYGEN_ERROR;
    }
    if (c->state == DONE) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return PYGEN_ERROR;
    }
    c->running = 1;
    if (c->state == START) {
        if (arg != Py_None) {
            c->running = 0;
            PyErr_SetString(PyExc_TypeError,
                            "can't send non-None value to a just-started coroutine");
            return PYGEN_ERROR;
        }
        if (start(c) < 0) {
            c->running = 0;
            return PYGEN_ERROR;
        }
    }
    PySendResult r = PyIter_Send(c->it, arg, result);
    c->running = 0;
    if (r == PYGEN_NEXT)
        return r;
    if (r == PYGEN_RETURN) { /* the coroutine returned None, whatever the app returned */
        Py_SETREF(*result, Py_NewRef(Py_None));
        if (finish_ok(c) < 0) {
            Py_CLEAR(*result);
            return PYGEN_ERROR;
        }
        return r;
    }
    finish_failed(c);
    return r;
}

static PyObject *
call_step(CallObject *c, PyObject *arg)
{
    PyObject *result;
    PySendResult r = call_am_send(c, arg, &result);
    if (r == PYGEN_NEXT)
        return result;
    if (r == PYGEN_RETURN) {
        Py_DECREF(result);
        PyErr_SetNone(PyExc_StopIteration);
    }
    return NULL;
}

static PyObject *
call_iternext(CallObject *c)
{
    PyObject *result;
    PySendResult r = call_am_send(c, Py_None, &result);
    if (r == PYGEN_NEXT)
        return result;
    if (r == PYGEN_RETURN)
        Py_DECREF(result); /* NULL without an error: StopIteration */
    return NULL;
}

static PyObject *
call_send(CallObject *c, PyObject *arg)
{
    return call_step(c, arg);
}

/* Raise exc (an exception instance or class) here. */
static void
raise_exc(PyObject *exc)
{
    if (PyExceptionClass_Check(exc))
        PyErr_SetNone(exc);
    else if (PyExceptionInstance_Check(exc))
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    else
        PyErr_SetString(PyExc_TypeError,
                        "exceptions must be classes or instances deriving from BaseException");
}

static void
clear_args(CallObject *c)
{
    Py_CLEAR(c->self);
    Py_CLEAR(c->receive);
    Py_CLEAR(c->send);
    Py_CLEAR(c->scope);
}

static PyObject *throw_exc(CallObject *c, PyObject *exc);

static PyObject *
call_throw(CallObject *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
        return NULL;
    }
    if (c->running) {
        PyErr_SetString(PyExc_ValueError, "coroutine already executing");
        return NULL;
    }
    /* the exception itself, thrown with the one-argument form (the three-argument form is
     * deprecated from 3.12) */
    PyObject *exc = args[0];
    PyObject *made = NULL;
#if PY_VERSION_HEX >= 0x030C0000
    if (nargs >= 2 && PyErr_WarnEx(PyExc_DeprecationWarning,
                                   "the (type, exc, tb) signature of throw() is deprecated, "
                                   "use the single-arg signature instead.",
                                   1) < 0)
        return NULL;
#endif
    if (nargs >= 2 && ((made = thrown(args[0], args[1], nargs == 3 ? args[2] : Py_None)) == NULL))
        return NULL;
    if (made != NULL)
        exc = made;
    PyObject *result = throw_exc(c, exc);
    Py_XDECREF(made);
    return result;
}

/* call_throw's throw of exc (an exception instance or class). */
static PyObject *
throw_exc(CallObject *c, PyObject *exc)
{
    if (c->state != RUNNING) { /* raised where the coroutine starts (or ended): nothing ran */
        c->state = DONE;
        clear_args(c);
        raise_exc(exc);
        return NULL;
    }
    c->running = 1;
    PyObject *throw = PyObject_GetAttr(c->it, s_throw);
    PyObject *result = NULL;
    if (throw != NULL) {
        result = PyObject_CallOneArg(throw, exc);
        Py_DECREF(throw);
    }
    else if (PyErr_ExceptionMatches(PyExc_AttributeError)) { /* raised at the await */
        PyErr_Clear();
        raise_exc(exc);
    }
    c->running = 0;
    if (result != NULL)
        return result;
    if (PyErr_ExceptionMatches(PyExc_StopIteration)) { /* the app's awaitable returned */
        PyErr_Clear();
        if (finish_ok(c) == 0)
            PyErr_SetNone(PyExc_StopIteration);
        return NULL;
    }
    finish_failed(c);
    return NULL;
}

/* close(): the app's awaitable closed, and GeneratorExit at the await (the request ends as
 * a 500 unless its response completed, error "GeneratorExit"), as a coroutine's close. */
static PyObject *
call_close(CallObject *c, PyObject *unused)
{
    if (c->running) {
        PyErr_SetString(PyExc_ValueError, "coroutine already executing");
        return NULL;
    }
    if (c->state != RUNNING) {
        c->state = DONE;
        clear_args(c);
        Py_RETURN_NONE;
    }
    c->running = 1;
    PyObject *close = optional_attr(c->it, s_close);
    PyObject *r = close == NULL ? NULL : close == Py_None ? Py_NewRef(Py_None)
                                                          : PyObject_CallNoArgs(close);
    Py_XDECREF(close);
    c->running = 0;
    if (r == NULL) {
        finish_failed(c);
        return NULL;
    }
    Py_DECREF(r);
    PyErr_SetNone(PyExc_GeneratorExit);
    finish_failed(c);
    if (!PyErr_ExceptionMatches(PyExc_GeneratorExit))
        return NULL; /* raised in the agent's Python code (KeyboardInterrupt) */
    PyErr_Clear();
    Py_RETURN_NONE;
}

/* Dropped while running (a coroutine's finalizer closes it): the request still ends. */
/* Dropped before its first step: CPython's warning for a coroutine never awaited. */
static void
call_finalize(CallObject *c)
{
    if (c->state == DONE)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (c->state == START) {
        PyObject *name = c->python ? PyObject_GetAttr(c->python, s_qualname) : NULL;
        if (name == NULL) {
            PyErr_Clear();
            name = Py_NewRef(s_call_name);
        }
        if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "coroutine '%S' was never awaited",
                             name) < 0)
            PyErr_WriteUnraisable((PyObject *)c);
        Py_DECREF(name);
    }
    else {
        PyObject *r = call_close(c, NULL);
        if (r == NULL)
            PyErr_WriteUnraisable((PyObject *)c);
        Py_XDECREF(r);
    }
    PyErr_Restore(type, value, tb);
}

/* cr_frame, cr_await: read by the sampler's thread too, while the loop's thread can clear
 * c->aw (the request ending): the awaitable is held for the read. */
static PyObject *
call_aw_attr(CallObject *c, void *name)
{
    PyObject *aw = Py_XNewRef(c->aw);
    if (aw == NULL)
        Py_RETURN_NONE;
    PyObject *r = optional_attr(aw, *(PyObject **)name);
    Py_DECREF(aw);
    return r;
}

static PyObject *
call_self(PyObject *c)
{
    return Py_NewRef(c);
}

static int
call_traverse(CallObject *c, visitproc visit, void *arg)
{
    Py_VISIT(c->inner);
    Py_VISIT(c->python);
    Py_VISIT(c->self);
    Py_VISIT(c->scope);
    Py_VISIT(c->receive);
    Py_VISIT(c->send);
    Py_VISIT(c->req);
    Py_VISIT(c->aw);
    Py_VISIT(c->it);
    return 0;
}

static int
call_clear(CallObject *c)
{
    Py_CLEAR(c->inner);
    Py_CLEAR(c->python);
    clear_args(c);
    Py_CLEAR(c->req);
    Py_CLEAR(c->aw);
    Py_CLEAR(c->it);
    return 0;
}

static void
call_dealloc(CallObject *c)
{
    if (PyObject_CallFinalizerFromDealloc((PyObject *)c) < 0)
        return; /* resurrected */
    PyObject_GC_UnTrack(c);
    call_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef call_methods[] = {
    {"send", (PyCFunction)call_send, METH_O, "forward one step"},
    {"throw", (PyCFunction)(void (*)(void))call_throw, METH_FASTCALL,
     "throw an exception into the app's awaitable"},
    {"close", (PyCFunction)call_close, METH_NOARGS, "close the app's awaitable"},
    {NULL},
};

static PyGetSetDef call_getset[] = {
    {"cr_frame", (getter)call_aw_attr, NULL, "the app's awaitable's frame", &s_cr_frame},
    {"cr_await", (getter)call_aw_attr, NULL, "what the app's awaitable awaits", &s_cr_await},
    {NULL},
};

static PyAsyncMethods call_as_async = {
    .am_await = (unaryfunc)call_self,
    .am_send = (sendfunc)call_am_send,
};

static PyTypeObject CallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._asgi.Call",
    .tp_doc = "One ASGI call of a Recording: awaits the app, recording an http request.",
    .tp_basicsize = sizeof(CallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)call_dealloc,
    .tp_finalize = (destructor)call_finalize,
    .tp_traverse = (traverseproc)call_traverse,
    .tp_clear = (inquiry)call_clear,
    .tp_as_async = &call_as_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)call_iternext,
    .tp_methods = call_methods,
    .tp_getset = call_getset,
};

/* ------------------------------------------------------------------ Recording
 * Recording(inner, python, how): asgi._recording(inner) in C: an ASGI __call__(self, scope,
 * receive, send) (a method descriptor: a class's __call__ is called with the instance first,
 * no bound method made) returning a Call. how: 0 inner(self, scope, receive, send), 1
 * self.app(scope, receive, send), 2 self(scope, receive, send) (record_asgi). Called any other
 * way, or with a scope that is not a dict, it calls ``python`` (the Python version). Other
 * attributes (__name__, ...) are the python version's. */

typedef struct {
    PyObject_HEAD
    PyObject *inner, *python, *dict;
    int how;
    vectorcallfunc vectorcall;
} RecordingObject;

static PyObject *
recording_vectorcall(RecordingObject *rc, PyObject *const *args, size_t nargsf,
                     PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 4 || kwnames != NULL || asgi_dict == NULL || !PyDict_CheckExact(args[1]))
        return PyObject_Vectorcall(rc->python, args, nargsf, kwnames);
    PyObject *self = args[0], *scope = args[1], *receive = args[2], *send = args[3];
    /* lifespan, websocket: the app is called at the first step, unrecorded */
    PyObject *type = PyDict_GetItemWithError(scope, s_type);
    int http = type != NULL && (type == s_http || (PyUnicode_Check(type) &&
                                                   PyUnicode_Compare(type, s_http) == 0));
    if (!http)
        PyErr_Clear();
    CallObject *c = PyObject_GC_New(CallObject, &CallType);
    if (c == NULL)
        return NULL;
    c->inner = Py_NewRef(rc->inner);
    c->python = Py_NewRef(rc->python);
    c->http = (char)http;
    c->self = Py_NewRef(self);
    c->scope = Py_NewRef(scope);
    c->receive = Py_NewRef(receive);
    c->send = Py_NewRef(send);
    c->req = c->aw = c->it = NULL;
    c->how = (char)rc->how;
    c->state = START;
    c->running = 0;
    PyObject_GC_Track(c);
    return (PyObject *)c;
}

static PyObject *
recording_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *inner, *python;
    int how;
    if (!PyArg_ParseTuple(args, "OOi:Recording", &inner, &python, &how))
        return NULL;
    if (how < HOW_CALL || how > HOW_DIRECT) {
        PyErr_SetString(PyExc_ValueError, "how: 0, 1 or 2");
        return NULL;
    }
    RecordingObject *rc = (RecordingObject *)type->tp_alloc(type, 0);
    if (rc == NULL)
        return NULL;
    rc->inner = Py_NewRef(inner);
    rc->python = Py_NewRef(python);
    rc->how = how;
    rc->vectorcall = (vectorcallfunc)recording_vectorcall;
    return (PyObject *)rc;
}

static PyObject *
recording_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
recording_getattro(RecordingObject *rc, PyObject *name)
{
    PyObject *v = PyObject_GenericGetAttr((PyObject *)rc, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        v = PyObject_GetAttr(rc->python, name);
    }
    return v;
}

static int
recording_traverse(RecordingObject *rc, visitproc visit, void *arg)
{
    Py_VISIT(rc->inner);
    Py_VISIT(rc->python);
    Py_VISIT(rc->dict);
    return 0;
}

static int
recording_clear(RecordingObject *rc)
{
    Py_CLEAR(rc->inner);
    Py_CLEAR(rc->python);
    Py_CLEAR(rc->dict);
    return 0;
}

static void
recording_dealloc(RecordingObject *rc)
{
    PyObject_GC_UnTrack(rc);
    recording_clear(rc);
    Py_TYPE(rc)->tp_free((PyObject *)rc);
}

static PyGetSetDef recording_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyMemberDef recording_members[] = {
    {"inner", T_OBJECT, offsetof(RecordingObject, inner), READONLY, "what it records"},
    {"python", T_OBJECT, offsetof(RecordingObject, python), READONLY,
     "the same in Python (asgi.py)"},
    {NULL},
};

static PyTypeObject RecordingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._asgi.Recording",
    .tp_doc = "Recording(inner, python, how): asgi._recording(inner) in C.",
    .tp_basicsize = sizeof(RecordingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = recording_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(RecordingObject, vectorcall),
    .tp_descr_get = recording_get,
    .tp_getattro = (getattrofunc)recording_getattro,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_dictoffset = offsetof(RecordingObject, dict),
    .tp_dealloc = (destructor)recording_dealloc,
    .tp_traverse = (traverseproc)recording_traverse,
    .tp_clear = (inquiry)recording_clear,
    .tp_members = recording_members,
    .tp_getset = recording_getset,
};

/* ------------------------------------------------------------------ the module */

static PyObject *
configure(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"recorder", "capture", "asgi", NULL};
    PyObject *mods[3];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO", names, &mods[0], &mods[1], &mods[2]))
        return NULL;
    PyObject *dicts[3];
    for (int k = 0; k < 3; k++) {
        dicts[k] = PyModule_GetDict(mods[k]); /* borrowed */
        if (dicts[k] == NULL)
            return NULL;
    }
    PyObject *key = PyUnicode_InternFromString("cpu_sampled");
    if (key == NULL)
        return NULL;
    PyObject *f = PyDict_GetItemWithError(dicts[0], key); /* borrowed */
    Py_DECREF(key);
    if (f == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "recorder.cpu_sampled is missing");
        return NULL;
    }
    /* the functions done here in C, as bound now (borrowed until set below) */
    PyObject *orig[4] = {
        PyDict_GetItemWithError(dicts[2], s_finish),
        PyDict_GetItemWithError(dicts[2], s_route_name),
        PyDict_GetItemWithError(dicts[1], s_reason),
        PyDict_GetItemWithError(dicts[1], s_finish_asgi),
    };
    for (int k = 0; k < 4; k++)
        if (orig[k] == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError,
                                "asgi._finish, asgi._route_name, capture.reason or "
                                "capture.finish_asgi is missing");
            return NULL;
        }
    Py_XSETREF(finish_fn, Py_NewRef(orig[0]));
    Py_XSETREF(route_name_fn, Py_NewRef(orig[1]));
    Py_XSETREF(reason_fn, Py_NewRef(orig[2]));
    Py_XSETREF(finish_asgi_fn, Py_NewRef(orig[3]));
    Py_XSETREF(cpu_sampled_fn, Py_NewRef(f));
    Py_XSETREF(recorder_dict, Py_NewRef(dicts[0]));
    Py_XSETREF(capture_dict, Py_NewRef(dicts[1]));
    Py_XSETREF(asgi_dict, Py_NewRef(dicts[2]));
#ifdef DICT_VERSIONS
    asgi_version = recorder_version = 0; /* other dicts: read again */
#endif
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(recorder=, capture=, asgi=): the modules whose globals it reads"},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "perfsleuth.agent._asgi",
    "The ASGI request path of agent.frameworks.asgi in C (asgi.py is the reference).", -1,
    module_methods,
};

#define INTERN(var, text)                                                                     \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                    \
        return NULL;

PyMODINIT_FUNC
PyInit__asgi(void)
{
    INTERN(s_web, "web");
    INTERN(s_empty, "");
    INTERN(s_slash, "/");
    INTERN(s_http, "http");
    INTERN(s_type, "type");
    INTERN(s_method, "method");
    INTERN(s_path, "path");
    INTERN(s_headers, "headers");
    INTERN(s_route, "route");
    INTERN(s_fastapi, "fastapi");
    INTERN(s_ctx, "effective_route_context");
    INTERN(s_router, "router");
    INTERN(s_app, "app");
    INTERN(s_get, "get");
    INTERN(s_begin, "_begin");
    INTERN(s_end, "_end");
    INTERN(s_on, "on");
    INTERN(s_internal_error, "internal_error");
    INTERN(s_asgi_request, "_AsgiRequest");
    INTERN(s_cpu_sampled, "_cpu_sampled");
    INTERN(s_cpu_threshold, "_cpu_threshold");
    INTERN(s_send_tap, "_SendTap");
    INTERN(s_cpu_meter, "_CpuMeter");
    INTERN(s_loop_of, "_loop_of");
    INTERN(s_running_tasks, "_running_tasks");
    INTERN(s_new_loop, "_new_loop");
    INTERN(s_receive, "receive");
    INTERN(s_status, "status");
    INTERN(s_sent, "sent");
    INTERN(s_pathsend, "pathsend");
    INTERN(s_complete, "complete");
    INTERN(s_names, "_names");
    INTERN(s_route_name, "_route_name");
    INTERN(s_under_mount, "_under_mount");
    INTERN(s_unmatched, "unmatched");
    INTERN(s_py_send_tap, "SendTap");
    INTERN(s_declared_length, "declared_length");
    INTERN(s_finish_asgi, "finish_asgi");
    INTERN(s_fault, "_fault");
    INTERN(s_slow_ns, "_slow_ns");
    INTERN(s_countdown, "_countdown");
    INTERN(s_throw, "throw");
    INTERN(s_close, "close");
    INTERN(s_cr_frame, "cr_frame");
    INTERN(s_cr_await, "cr_await");
    INTERN(s_finish, "_finish");
    INTERN(s_reason, "reason");
    INTERN(s_qualname, "__qualname__");
    INTERN(s_call_name, "Call");
    for (int k = 0; k < N_FIELDS; k++)
        INTERN(field_strs[k], field_names[k]);
    if ((s_cls_kw = Py_BuildValue("(s)", "cls")) == NULL || (zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    if (PyType_Ready(&CallType) < 0 || PyType_Ready(&RecordingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Call", (PyObject *)&CallType) < 0 ||
        PyModule_AddObjectRef(m, "Recording", (PyObject *)&RecordingType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
