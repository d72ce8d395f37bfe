/* perfsleuth.agent._wsgi: the WSGI request path of agent.frameworks.wsgi in C.
 *
 * Optional, like _speedups (PERFSLEUTH_SPEEDUPS=0 leaves it out): frameworks/wsgi.py is the
 * reference, and this is the same code path for path, case for case: record_wsgi (begin, the
 * environ's identity and size, the app called with a start_response that reads the status and
 * Flask's URL rule), and the response iterable (the request put back in the thread's context
 * around each step, bytes counted, the request ended exactly once: exhausted, closed, failed or
 * dropped). In Python these were ~8 Python calls a request (record_wsgi, start_response, wrap,
 * __iter__, __next__ twice, close, _finish and __del__), the largest part of what an in-process
 * burst of short requests paid for the agent.
 *
 * The rare cases call back into wsgi.py: a request not recorded here (nested, or the agent
 * off) with a Flask app (_unrecorded), identity or load headers or a request size to read
 * (common.read_environ), the capture's input tap and decision (capture.tap_wsgi_input,
 * capture.finish_wsgi), a URL rule not named before (_name_from_flask), the legacy write()
 * callable (_counted_write) and the size of a wsgi.file_wrapper response (_declared_length).
 * Module globals (recorder.begin/end, capture.on, wsgi._flask_request, ...) are read from the
 * modules' dicts at each request, so that what Python sees (a test's monkeypatch, a late
 * connect_flask) this sees too. Nothing here raises into the application: internal failures
 * are counted (recorder.internal_error); the application's and the server's exceptions pass.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include "_agent_c.h"

#if PY_VERSION_HEX >= 0x030D0000
#define _PyObject_LookupAttr PyObject_GetOptionalAttr
#endif

static PyObject *recorder_dict; /* perfsleuth.agent.recorder.__dict__ */
static PyObject *capture_dict;  /* perfsleuth.agent.capture.__dict__ */
static PyObject *common_dict;   /* perfsleuth.agent.frameworks.common.__dict__ */
static PyObject *wsgi_dict;     /* perfsleuth.agent.frameworks.wsgi.__dict__ */
static PyObject *current_var;   /* recorder._current */

static PyObject *s_web, *s_empty, *s_slash, *s_get, *s_close, *s_request, *s_url_rule, *s_rule;
static PyObject *s_begin, *s_end, *s_on, *s_internal_error, *s_flask_request, *s_endpoints;
static PyObject *s_name_from_flask, *s_counted_write, *s_declared_length, *s_unrecorded;
static PyObject *s_read_environ, *s_identity, *s_user_env, *s_tenant_env, *s_load_env;
static PyObject *s_tap_wsgi_input, *s_finish_wsgi, *s_request_method, *s_path_info;
static PyObject *s_content_length, *s_transfer_encoding, *s_file_wrapper, *s_cpu_kw;
static PyObject *s_fault, *s_slow_ns, *s_countdown;
static PyObject *s_started_connected, *s_wsgi_app, *s_name_on_request_started;
static PyObject *zero;

/* ------------------------------------------------------------------ request fields
 * An ActiveRequest has __slots__: the fields used here are read and set through their member
 * descriptors' offsets, looked up once per class (any other object: by name). */

enum {
    F_METHOD, F_ENDPOINT, F_STATUS, F_ERROR, F_REQ_BYTES, F_RESP_BYTES, F_CPU_START, F_THREAD,
    F_TOKEN, F_KEEP, F_START, F_END, N_FIELDS
};
static const char *field_names[N_FIELDS] = {
    "method", "endpoint", "status", "error", "req_bytes", "resp_bytes", "cpu_start", "thread",
    "token", "keep", "start", "end",
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

/* Count an internal failure and clear it: the application never sees it. */
static void
failed(void)
{
    PyErr_Clear();
    PyObject *f = recorder_dict ? PyDict_GetItemWithError(recorder_dict, s_internal_error) : NULL;
    if (f != NULL) {
        PyObject *r = PyObject_CallNoArgs(f);
        Py_XDECREF(r);
    }
    PyErr_Clear();
}

/* A module global (borrowed; NULL with no error when absent). */
static inline PyObject *
global(PyObject *dict, PyObject *name)
{
    return PyDict_GetItemWithError(dict, name);
}

/* environ.get(key) as a new reference (NULL with no error when absent; NULL with an error). */
static PyObject *
env_get(PyObject *environ, PyObject *key)
{
    if (PyDict_CheckExact(environ)) {
        PyObject *v = PyDict_GetItemWithError(environ, key);
        return Py_XNewRef(v);
    }
    PyObject *v = PyObject_CallMethodOneArg(environ, s_get, key);
    if (v == Py_None)
        Py_CLEAR(v);
    return v;
}

/* Restore the context: reset(token), or clear ours when a generator switched contexts. */
static void
reset(PyObject *token)
{
    if (PyContextVar_Reset(current_var, token) < 0) {
        PyErr_Clear();
        PyObject *t = PyContextVar_Set(current_var, Py_None);
        Py_XDECREF(t);
        PyErr_Clear();
    }
}

/* ------------------------------------------------------------------ the response iterable */

typedef struct {
    PyObject_HEAD
    PyObject *req; /* NULL once the request ended */
    PyObject *environ, *tap, *start_response, *headers, *iterable, *it;
    unsigned long tid; /* the thread that began the request */
    Py_ssize_t sent;
} BodyObject;

static PyTypeObject BodyType;

/* Read by wsgi.py's helpers (_counted_write, _declared_length) and tests. */
static PyMemberDef body_members[] = {
    {"_sent", T_PYSSIZET, offsetof(BodyObject, sent), 0, "bytes of the body counted"},
    {"_headers", T_OBJECT, offsetof(BodyObject, headers), READONLY, "the response headers"},
    {"_req", T_OBJECT, offsetof(BodyObject, req), READONLY, "the request, until it ends"},
    {"_iterable", T_OBJECT, offsetof(BodyObject, iterable), READONLY, "the app's response"},
    {NULL},
};

/* capture.finish_wsgi's common case, decided here: a request of no capture (capture.reason
 * None: not flagged, not failed, not slow, not the random sample's turn) and no input tap.
 * 1: done (the sample's countdown counted down, as reason does); 0: capture.finish_wsgi
 * decides (nothing was changed). */
static int
not_kept(BodyObject *b, PyObject *req)
{
    if (b->tap != NULL)
        return 0;
    PyObject *fault = global(capture_dict, s_fault);
    PyObject *slow = global(capture_dict, s_slow_ns);
    PyObject *countdown = global(capture_dict, s_countdown);
    if (fault != Py_False || slow == NULL || !PyLong_CheckExact(slow) || countdown == NULL ||
        !PyLong_CheckExact(countdown))
        goto python;
    PyObject *keep = get(req, F_KEEP), *status = get(req, F_STATUS);
    PyObject *start = get(req, F_START), *end = get(req, F_END);
    int simple = keep == Py_None && (status == Py_None || PyLong_CheckExact(status)) &&
                 start != NULL && PyLong_CheckExact(start) && end != NULL &&
                 PyLong_CheckExact(end);
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

/* wsgi.py's _Body._finish: the request ends (once). Never raises. */
static void
finish(BodyObject *b)
{
    PyObject *req = b->req;
    if (req == NULL)
        return;
    b->req = NULL;
    if (set(req, F_RESP_BYTES, PyLong_FromSsize_t(b->sent)) < 0 ||
        (PyThread_get_thread_ident() != b->tid &&
         set(req, F_CPU_START, Py_NewRef(Py_None)) < 0)) /* thread CPU time across threads */
        failed();
    PyObject *end = global(recorder_dict, s_end);
    PyObject *r = end ? PyObject_CallOneArg(end, req) : NULL;
    if (r == NULL)
        failed();
    Py_XDECREF(r);
    PyObject *on = global(capture_dict, s_on);
    int capturing = on ? PyObject_IsTrue(on) : 0;
    if (capturing > 0 && !not_kept(b, req)) {
        PyObject *fw = global(capture_dict, s_finish_wsgi);
        PyObject *args[3] = {req, b->environ ? b->environ : Py_None, b->tap ? b->tap : Py_None};
        r = fw ? PyObject_Vectorcall(fw, args, 3, NULL) : NULL;
        if (r == NULL)
            failed();
        Py_XDECREF(r);
    }
    else if (capturing < 0 || PyErr_Occurred())
        failed();
    Py_CLEAR(b->environ);
    Py_CLEAR(b->tap);
    Py_DECREF(req);
}

/* wsgi.py's _Body.fail: the request ends as a 500 with the exception's class (an exception is
 * set on entry; it is left set). */
static void
fail(BodyObject *b)
{
    if (b->req == NULL)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *name = type ? PyObject_GetAttrString(type, "__name__") : NULL;
    if (set(b->req, F_STATUS, PyLong_FromLong(500)) < 0) { /* name not taken: drop it */
        Py_XDECREF(name);
        PyErr_Clear();
    }
    else if (set(b->req, F_ERROR, name) < 0)
        PyErr_Clear();
    finish(b);
    PyErr_Restore(type, value, tb);
}

static PyObject *
body_iter(PyObject *self)
{
    return Py_NewRef(self);
}

static PyObject *
body_next(BodyObject *b)
{
    PyObject *req = b->req;
    if (req == NULL) { /* ended (a failure, or iterated again after the end) */
        if (b->it == NULL) {
            if (b->iterable == NULL) {
                PyErr_SetString(PyExc_TypeError, "not a response");
                return NULL;
            }
            b->it = PyObject_GetIter(b->iterable);
            if (b->it == NULL)
                return NULL;
        }
        /* guarded as below: a body iterating itself recurses (RecursionError, as wsgi.py) */
        if (Py_EnterRecursiveCall(" in a WSGI response"))
            return NULL;
        PyObject *it = b->it;
        PyObject *chunk = Py_TYPE(it)->tp_iternext(it);
        Py_LeaveRecursiveCall();
        return chunk;
    }
    PyObject *token = PyContextVar_Set(current_var, req);
    if (token == NULL)
        return NULL;
    Py_INCREF(req); /* finish() drops the body's reference */
    PyObject *chunk = NULL;
    if (b->it == NULL) {
        if (b->iterable != NULL)
            b->it = PyObject_GetIter(b->iterable);
        else /* iterated before the app returned it (start_response.__self__): as iter(None) */
            PyErr_SetString(PyExc_TypeError, "'NoneType' object is not iterable");
    }
    /* The app's own response can be this body (start_response.__self__ returned): iterating it
     * recurses here; the guard makes that a RecursionError, as wsgi.py's next(it) does, not a
     * C stack overflow. */
    if (b->it != NULL && !Py_EnterRecursiveCall(" in a WSGI response")) {
        chunk = PyIter_Next(b->it); /* NULL and no error at the end */
        Py_LeaveRecursiveCall();
    }
    if (chunk == NULL && PyErr_Occurred()) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        reset(token);
        PyErr_Restore(type, value, tb);
        fail(b);
        Py_DECREF(token);
        Py_DECREF(req);
        return NULL;
    }
    reset(token);
    Py_DECREF(token);
    Py_DECREF(req);
    if (chunk == NULL) {
        finish(b);
        return NULL; /* StopIteration */
    }
    Py_ssize_t n = PyObject_Size(chunk);
    if (n < 0)
        PyErr_Clear();
    else
        b->sent += n;
    return chunk;
}

static PyObject *
body_close(BodyObject *b, PyObject *unused)
{
    PyObject *close = NULL;
    if (b->iterable != NULL && _PyObject_LookupAttr(b->iterable, s_close, &close) < 0)
        return NULL;
    if (close == NULL || b->req == NULL) { /* nothing to run, or the request ended */
        if (close != NULL) {
            PyObject *r = PyObject_CallNoArgs(close);
            Py_DECREF(close);
            if (r == NULL)
                return NULL;
            Py_DECREF(r);
        }
        finish(b);
        Py_RETURN_NONE;
    }
    PyObject *token = PyContextVar_Set(current_var, b->req);
    if (token == NULL) {
        Py_DECREF(close);
        return NULL;
    }
    PyObject *r = PyObject_CallNoArgs(close);
    Py_DECREF(close);
    if (r == NULL)
        fail(b);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    reset(token);
    Py_DECREF(token);
    finish(b);
    PyErr_Restore(type, value, tb);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

/* The body's start_response (a bound method of the body): start_response(status, headers,
 * exc_info=None). */
static PyObject *
body_start_response(BodyObject *b, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *values[3] = {NULL, NULL, NULL};
    static const char *const names[] = {"status", "headers", "exc_info"};
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "start_response() takes at most 3 arguments");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < nargs; k++)
        values[k] = args[k];
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int found = 0;
        for (int j = 0; j < 3; j++)
            if (PyUnicode_CompareWithASCIIString(name, names[j]) == 0 && values[j] == NULL) {
                values[j] = args[nargs + k];
                found = 1;
            }
        if (!found) {
            PyErr_Format(PyExc_TypeError, "start_response() got an unexpected keyword %R", name);
            return NULL;
        }
    }
    if (values[0] == NULL || values[1] == NULL) {
        PyErr_SetString(PyExc_TypeError, "start_response() needs status and headers");
        return NULL;
    }
    PyObject *status = values[0], *headers = values[1], *exc_info = values[2];
    if (exc_info == Py_None)
        exc_info = NULL;
    PyObject *req = b->req;
    if (req != NULL) {
        Py_INCREF(req);
        /* req.status = int(str(status)[:3]): read here when the status is a str starting
         * with three ASCII digits (every status line; the general parse was ~700
         * instructions a request), else by int() itself */
        PyObject *code = NULL;
        if (PyUnicode_CheckExact(status) && PyUnicode_KIND(status) == PyUnicode_1BYTE_KIND &&
            PyUnicode_GET_LENGTH(status) >= 3) {
            const Py_UCS1 *c = PyUnicode_1BYTE_DATA(status);
            if (c[0] >= '0' && c[0] <= '9' && c[1] >= '0' && c[1] <= '9' && c[2] >= '0' &&
                c[2] <= '9')
                code = PyLong_FromLong((c[0] - '0') * 100 + (c[1] - '0') * 10 + (c[2] - '0'));
        }
        if (code == NULL && !PyErr_Occurred()) {
            PyObject *text = PyObject_Str(status);
            PyObject *head = text ? PyUnicode_Substring(text, 0, 3) : NULL;
            Py_XDECREF(text);
            code = head ? PyLong_FromUnicodeObject(head, 10) : NULL;
            Py_XDECREF(head);
        }
        if (set(req, F_STATUS, code) < 0)
            failed();
        else {
            Py_XSETREF(b->headers, Py_NewRef(headers));
            /* Flask calls start_response inside its request context: its matched URL rule
             * names the endpoint (wsgi.py's start_response says why here). */
            PyObject *var = global(wsgi_dict, s_flask_request);
            PyObject *endpoint = var && var != Py_None ? get(req, F_ENDPOINT) : NULL;
            int named = endpoint ? PyObject_IsTrue(endpoint) : 1;
            Py_XDECREF(endpoint);
            PyObject *ctx = NULL;
            if (named == 0) {
                if (PyContextVar_CheckExact(var)) {
                    if (PyContextVar_Get(var, Py_None, &ctx) < 0)
                        ctx = NULL;
                }
                else
                    ctx = PyObject_CallMethodOneArg(var, s_get, Py_None);
            }
            if (ctx != NULL && ctx != Py_None) {
                /* the name of a (method, URL rule) seen before; else _name_from_flask */
                PyObject *request = PyObject_GetAttr(ctx, s_request);
                PyObject *rule = request ? PyObject_GetAttr(request, s_url_rule) : NULL;
                Py_XDECREF(request);
                if (rule != NULL && rule != Py_None) {
                    PyObject *template = PyObject_GetAttr(rule, s_rule);
                    PyObject *method = template ? get(req, F_METHOD) : NULL;
                    PyObject *key = method ? PyTuple_Pack(2, method, template) : NULL;
                    Py_XDECREF(method);
                    Py_XDECREF(template);
                    PyObject *names_ = global(wsgi_dict, s_endpoints);
                    PyObject *name = key && names_ && PyDict_CheckExact(names_)
                                         ? PyDict_GetItemWithError(names_, key)
                                         : NULL;
                    Py_XDECREF(key);
                    if (name != NULL)
                        set(req, F_ENDPOINT, Py_NewRef(name));
                    else if (!PyErr_Occurred()) {
                        PyObject *f = global(wsgi_dict, s_name_from_flask);
                        PyObject *r = f ? PyObject_CallFunctionObjArgs(f, req, ctx, NULL) : NULL;
                        Py_XDECREF(r);
                    }
                }
                Py_XDECREF(rule);
            }
            Py_XDECREF(ctx);
            if (PyErr_Occurred())
                failed();
        }
        Py_DECREF(req);
    }
    PyObject *call[3] = {status, headers, exc_info};
    PyObject *write = PyObject_Vectorcall(b->start_response, call, exc_info ? 3 : 2, NULL);
    if (write == NULL || write == Py_None)
        return write;
    PyObject *f = global(wsgi_dict, s_counted_write);
    if (f == NULL) { /* wsgi.py without it: the write callable uncounted */
        PyErr_Clear();
        return write;
    }
    PyObject *counted = PyObject_CallFunctionObjArgs(f, (PyObject *)b, write, NULL);
    Py_DECREF(write);
    return counted;
}

static PyMethodDef body_start_response_def = {
    "start_response", (PyCFunction)(void (*)(void))body_start_response,
    METH_FASTCALL | METH_KEYWORDS, "the start_response the application is given"};

static PyMethodDef body_methods[] = {
    {"close", (PyCFunction)body_close, METH_NOARGS, "PEP 3333: the server closes the response"},
    {NULL},
};

/* A server that drops the response without closing or exhausting it (not PEP 3333 compliant,
 * but it happens: test clients, aborted connections) still ends the request. */
static void
body_finalize(BodyObject *b)
{
    if (b->req == NULL)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    finish(b);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

static int
body_traverse(BodyObject *b, visitproc visit, void *arg)
{
    Py_VISIT(b->req);
    Py_VISIT(b->environ);
    Py_VISIT(b->tap);
    Py_VISIT(b->start_response);
    Py_VISIT(b->headers);
    Py_VISIT(b->iterable);
    Py_VISIT(b->it);
    return 0;
}

static int
body_clear(BodyObject *b)
{
    Py_CLEAR(b->req);
    Py_CLEAR(b->environ);
    Py_CLEAR(b->tap);
    Py_CLEAR(b->start_response);
    Py_CLEAR(b->headers);
    Py_CLEAR(b->iterable);
    Py_CLEAR(b->it);
    return 0;
}

static void
body_dealloc(BodyObject *b)
{
    if (PyObject_CallFinalizerFromDealloc((PyObject *)b) < 0)
        return; /* resurrected */
    PyObject_GC_UnTrack(b);
    body_clear(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyTypeObject BodyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._wsgi.Body",
    .tp_doc = "The response iterable of one request, counting bytes and ending it once.",
    .tp_basicsize = sizeof(BodyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)body_dealloc,
    .tp_finalize = (destructor)body_finalize,
    .tp_traverse = (traverseproc)body_traverse,
    .tp_clear = (inquiry)body_clear,
    .tp_iter = body_iter,
    .tp_iternext = (iternextfunc)body_next,
    .tp_methods = body_methods,
    .tp_members = body_members,
};

/* ------------------------------------------------------------------ record_wsgi */

/* req = recorder.begin("web", environ.get("REQUEST_METHOD") or "", environ.get("PATH_INFO") or
 * "/", cpu=True); None when not recorded (or begin failed). */
static PyObject *
begin(PyObject *environ)
{
    PyObject *method = env_get(environ, s_request_method);
    PyObject *path = method || !PyErr_Occurred() ? env_get(environ, s_path_info) : NULL;
    PyObject *req = NULL;
    if (!PyErr_Occurred()) {
        int t;
        if (method == NULL || (t = PyObject_IsTrue(method)) == 0)
            Py_XSETREF(method, Py_NewRef(s_empty));
        else if (t < 0)
            goto done;
        if (path == NULL || (t = PyObject_IsTrue(path)) == 0)
            Py_XSETREF(path, Py_NewRef(s_slash));
        else if (t < 0)
            goto done;
        PyObject *f = global(recorder_dict, s_begin);
        PyObject *args[4] = {s_web, method, path, Py_True};
        req = f ? PyObject_Vectorcall(f, args, 3, s_cpu_kw) : NULL;
    }
done:
    Py_XDECREF(method);
    Py_XDECREF(path);
    if (req == NULL) {
        PyErr_Clear();
        return Py_NewRef(Py_None);
    }
    return req;
}

/* common.read_environ(req, environ) for the common request (no identity or load header, no
 * body); else common.read_environ itself. 1: the request has a body, 0: not, -1: error. */
static int
read_environ(PyObject *req, PyObject *environ)
{
    if (!PyDict_CheckExact(environ))
        goto python;
    PyObject *ident = global(common_dict, s_identity);
    if (ident == NULL)
        goto python;
    PyObject *keys[3] = {NULL, NULL, s_load_env};
    keys[0] = PyObject_GetAttr(ident, s_user_env);
    keys[1] = keys[0] ? PyObject_GetAttr(ident, s_tenant_env) : NULL;
    int other = keys[1] == NULL;
    for (int k = 0; k < 3 && !other; k++)
        if (keys[k] != Py_None && PyDict_GetItemWithError(environ, keys[k]) != NULL)
            other = 1;
    Py_XDECREF(keys[0]);
    Py_XDECREF(keys[1]);
    if (other || PyErr_Occurred())
        goto python;
    PyObject *size = PyDict_GetItemWithError(environ, s_content_length);
    if (size != NULL && !(PyUnicode_CheckExact(size) &&
                          (PyUnicode_GET_LENGTH(size) == 0 ||
                           PyUnicode_CompareWithASCIIString(size, "0") == 0)))
        goto python;
    if (PyErr_Occurred() || set(req, F_REQ_BYTES, Py_NewRef(zero)) < 0)
        goto python;
    return PyDict_Contains(environ, s_transfer_encoding);
python:
    PyErr_Clear();
    PyObject *f = global(wsgi_dict, s_read_environ); /* wsgi.py's name for it */
    PyObject *r = f ? PyObject_CallFunctionObjArgs(f, req, environ, NULL) : NULL;
    if (r == NULL)
        return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* What wsgi.py's _Body.wrap does once the application returned: the response as the server
 * gets it (new reference). Never fails. */
static PyObject *
wrap(BodyObject *b, PyObject *result)
{
    PyObject *req = b->req;
    if (req == NULL) /* ended already (the app closed or iterated its start_response's body) */
        return Py_NewRef(result);
    /* Leave the thread's context clean: it is restored around each iteration step. */
    PyObject *token = get(req, F_TOKEN);
    if (token == NULL || set(req, F_TOKEN, Py_NewRef(Py_None)) < 0)
        goto error;
    if (token != Py_None)
        reset(token);
    Py_CLEAR(token);
    if (PyList_CheckExact(result) || PyTuple_CheckExact(result)) { /* nothing to wait for */
        PyObject *seq = result;
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq); k++) {
            Py_ssize_t n = PyObject_Size(PySequence_Fast_GET_ITEM(seq, k));
            if (n < 0)
                goto error;
            b->sent += n;
        }
        finish(b);
        return Py_NewRef(result);
    }
    PyObject *fw = env_get(b->environ, s_file_wrapper);
    if (fw != NULL && PyType_Check(fw)) {
        int is = PyObject_IsInstance(result, fw);
        Py_CLEAR(fw);
        if (is < 0)
            goto error;
        if (is) { /* keep the server's sendfile() path: the size is the declared length */
            PyObject *f = global(wsgi_dict, s_declared_length);
            PyObject *n = f ? PyObject_CallOneArg(f, b->headers ? b->headers : Py_None) : NULL;
            if (n == NULL)
                goto error;
            Py_ssize_t sent = n == Py_None ? 0 : PyLong_AsSsize_t(n);
            Py_DECREF(n);
            if (sent == -1 && PyErr_Occurred())
                goto error;
            b->sent = sent;
            finish(b);
            return Py_NewRef(result);
        }
    }
    Py_XDECREF(fw);
    if (PyErr_Occurred())
        goto error;
    b->iterable = Py_NewRef(result);
    return Py_NewRef((PyObject *)b);
error:
    Py_XDECREF(token);
    failed();
    finish(b);
    return Py_NewRef(result);
}

/* app(environ, start_response), or app(self, environ, start_response) when self is given (the
 * Flask patch calls Flask.__call__ without making a bound method). */
static inline PyObject *
call_app(PyObject *app, PyObject *self, PyObject *environ, PyObject *start_response)
{
    PyObject *call[3] = {self, environ, start_response};
    if (self != NULL)
        return PyObject_Vectorcall(app, call, 3, NULL);
    return PyObject_Vectorcall(app, call + 1, 2, NULL);
}

/* wsgi.py's python_record_wsgi: app(environ, start_response) as one recorded request. */
static PyObject *
record(PyObject *app, PyObject *self, PyObject *environ, PyObject *start_response)
{
    if (recorder_dict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "perfsleuth.agent._wsgi is not configured");
        return NULL;
    }
    PyObject *req = begin(environ);
    if (req == Py_None) {
        Py_DECREF(req);
        PyObject *var = global(wsgi_dict, s_flask_request);
        PyObject *f = var && var != Py_None ? global(wsgi_dict, s_unrecorded) : NULL;
        PyErr_Clear();
        if (f == NULL)
            return call_app(app, self, environ, start_response);
        /* a Flask app inside a recorded request may name it */
        PyObject *bound = self ? PyMethod_New(app, self) : Py_NewRef(app);
        if (bound == NULL)
            return NULL;
        PyObject *args[3] = {bound, environ, start_response};
        PyObject *r = PyObject_Vectorcall(f, args, 3, NULL);
        Py_DECREF(bound);
        return r;
    }
    BodyObject *b = PyObject_GC_New(BodyObject, &BodyType);
    if (b == NULL) {
        /* begun but no body: end it as it is and run the app unrecorded */
        failed();
        PyObject *end = global(recorder_dict, s_end);
        PyObject *r = end ? PyObject_CallOneArg(end, req) : NULL;
        Py_XDECREF(r);
        Py_DECREF(req);
        PyErr_Clear();
        return call_app(app, self, environ, start_response);
    }
    b->req = req;
    b->environ = Py_NewRef(environ); /* for a possible capture (agent.capture) */
    b->tap = NULL;
    b->start_response = Py_NewRef(start_response);
    b->headers = b->iterable = b->it = NULL;
    b->sent = 0;
    b->tid = PyThread_get_thread_ident();
    PyObject_GC_Track(b);
    int body = read_environ(req, environ);
    if (body < 0)
        failed(); /* identity and size are lost, not the request */
    else if (body) {
        PyObject *on = global(capture_dict, s_on);
        int capturing = on ? PyObject_IsTrue(on) : 0;
        if (capturing > 0) {
            PyObject *f = global(capture_dict, s_tap_wsgi_input);
            PyObject *tap = f ? PyObject_CallOneArg(f, environ) : NULL;
            if (tap == NULL)
                failed();
            else if (tap == Py_None)
                Py_DECREF(tap);
            else
                b->tap = tap;
        }
        else if (capturing < 0)
            failed();
    }
    PyObject *bound = PyCFunction_New(&body_start_response_def, (PyObject *)b);
    if (bound == NULL) {
        Py_DECREF(b); /* ends the request (finalizer) */
        return NULL;
    }
    PyObject *result = call_app(app, self, environ, bound);
    Py_DECREF(bound);
    if (result == NULL) {
        fail(b);
        Py_DECREF(b);
        return NULL;
    }
    PyObject *out = wrap(b, result);
    Py_DECREF(result);
    Py_DECREF(b);
    return out;
}

static PyObject *
record_wsgi(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "record_wsgi(app, environ, start_response)");
        return NULL;
    }
    return record(args[0], NULL, args[1], args[2]);
}

/* ------------------------------------------------------------------ the Flask patch
 * FlaskCall(original, python): what patch_flask puts on Flask.__call__, wsgi.py's __call__ in
 * patch_flask in C: records the request around the original Flask.__call__ (a method
 * descriptor: called through the class with the app first, no bound method made). Called any
 * other way than (app, environ, start_response), it calls ``python`` (the Python version).
 * Other attributes (__name__, __doc__, ...) are the original's. */

typedef struct {
    PyObject_HEAD
    PyObject *original, *python, *dict;
    vectorcallfunc vectorcall;
} FlaskCallObject;

static PyObject *
flask_call_vectorcall(FlaskCallObject *fc, PyObject *const *args, size_t nargsf,
                      PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 3 || kwnames != NULL || wsgi_dict == NULL)
        return PyObject_Vectorcall(fc->python, args, nargsf, kwnames);
    PyObject *app = args[0];
    /* not connected to request_started yet: an app with a middleware on app.wsgi_app
     * connects it (_name_on_request_started) */
    PyObject *connected = global(wsgi_dict, s_started_connected);
    if (connected != Py_True) {
        PyObject **dictptr = _PyObject_GetDictPtr(app);
        PyObject *d = dictptr ? *dictptr : NULL;
        int has = d && PyDict_CheckExact(d) ? PyDict_Contains(d, s_wsgi_app) : 1;
        PyObject *f = has ? global(wsgi_dict, s_name_on_request_started) : NULL;
        PyObject *r = f ? PyObject_CallOneArg(f, app) : NULL;
        Py_XDECREF(r);
        PyErr_Clear(); /* it never raises */
    }
    return record(fc->original, app, args[1], args[2]);
}

static PyObject *
flask_call_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *original, *python;
    if (!PyArg_ParseTuple(args, "OO:FlaskCall", &original, &python))
        return NULL;
    FlaskCallObject *fc = (FlaskCallObject *)type->tp_alloc(type, 0);
    if (fc == NULL)
        return NULL;
    fc->original = Py_NewRef(original);
    fc->python = Py_NewRef(python);
    fc->vectorcall = (vectorcallfunc)flask_call_vectorcall;
    return (PyObject *)fc;
}

static PyObject *
flask_call_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
flask_call_getattro(FlaskCallObject *fc, PyObject *name)
{
    PyObject *v = PyObject_GenericGetAttr((PyObject *)fc, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        v = PyObject_GetAttr(fc->original, name);
    }
    return v;
}

static int
flask_call_traverse(FlaskCallObject *fc, visitproc visit, void *arg)
{
    Py_VISIT(fc->original);
    Py_VISIT(fc->python);
    Py_VISIT(fc->dict);
    return 0;
}

static int
flask_call_clear(FlaskCallObject *fc)
{
    Py_CLEAR(fc->original);
    Py_CLEAR(fc->python);
    Py_CLEAR(fc->dict);
    return 0;
}

static void
flask_call_dealloc(FlaskCallObject *fc)
{
    PyObject_GC_UnTrack(fc);
    flask_call_clear(fc);
    Py_TYPE(fc)->tp_free((PyObject *)fc);
}

static PyMemberDef flask_call_members[] = {
    {"_perfsleuth_original", T_OBJECT, offsetof(FlaskCallObject, original), READONLY,
     "Flask.__call__ before the patch"},
    {"__wrapped__", T_OBJECT, offsetof(FlaskCallObject, original), READONLY, NULL},
    {"python", T_OBJECT, offsetof(FlaskCallObject, python), READONLY,
     "the same in Python (wsgi.py)"},
    {NULL},
};

static PyTypeObject FlaskCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsleuth.agent._wsgi.FlaskCall",
    .tp_doc = "Flask.__call__ recording each request (wsgi.patch_flask).",
    .tp_basicsize = sizeof(FlaskCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = flask_call_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FlaskCallObject, vectorcall),
    .tp_descr_get = flask_call_get,
    .tp_getattro = (getattrofunc)flask_call_getattro,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_dictoffset = offsetof(FlaskCallObject, dict),
    .tp_dealloc = (destructor)flask_call_dealloc,
    .tp_traverse = (traverseproc)flask_call_traverse,
    .tp_clear = (inquiry)flask_call_clear,
    .tp_members = flask_call_members,
};

/* ------------------------------------------------------------------ the module */

static PyObject *
configure(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"recorder", "capture", "common", "wsgi", NULL};
    PyObject *mods[4];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO", names, &mods[0], &mods[1], &mods[2],
                                     &mods[3]))
        return NULL;
    PyObject *dicts[4];
    for (int k = 0; k < 4; k++) {
        dicts[k] = PyModule_GetDict(mods[k]); /* borrowed */
        if (dicts[k] == NULL)
            return NULL;
    }
    PyObject *key = PyUnicode_InternFromString("_current");
    if (key == NULL)
        return NULL;
    PyObject *var = PyDict_GetItemWithError(dicts[0], key); /* borrowed */
    Py_DECREF(key);
    if (var == NULL || !PyContextVar_CheckExact(var)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "recorder._current is not a ContextVar");
        return NULL;
    }
    Py_XSETREF(current_var, Py_NewRef(var));
    Py_XSETREF(recorder_dict, Py_NewRef(dicts[0]));
    Py_XSETREF(capture_dict, Py_NewRef(dicts[1]));
    Py_XSETREF(common_dict, Py_NewRef(dicts[2]));
    Py_XSETREF(wsgi_dict, Py_NewRef(dicts[3]));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"record_wsgi", (PyCFunction)(void (*)(void))record_wsgi, METH_FASTCALL,
     "record_wsgi(app, environ, start_response): wsgi.record_wsgi in C"},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(recorder=, capture=, common=, wsgi=): the modules whose globals it reads"},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "perfsleuth.agent._wsgi",
    "The WSGI request path of agent.frameworks.wsgi in C (wsgi.py is the reference).", -1,
    module_methods,
};

#define INTERN(var, text)                                                                     \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                    \
        return NULL;

PyMODINIT_FUNC
PyInit__wsgi(void)
{
    INTERN(s_web, "web");
    INTERN(s_empty, "");
    INTERN(s_slash, "/");
    INTERN(s_get, "get");
    INTERN(s_close, "close");
    INTERN(s_request, "request");
    INTERN(s_url_rule, "url_rule");
    INTERN(s_rule, "rule");
    INTERN(s_begin, "begin");
    INTERN(s_end, "end");
    INTERN(s_on, "on");
    INTERN(s_internal_error, "internal_error");
    INTERN(s_flask_request, "_flask_request");
    INTERN(s_endpoints, "_endpoints");
    INTERN(s_name_from_flask, "_name_from_flask");
    INTERN(s_counted_write, "_counted_write");
    INTERN(s_declared_length, "_declared_length");
    INTERN(s_unrecorded, "_unrecorded");
    INTERN(s_read_environ, "read_environ");
    INTERN(s_identity, "_identity");
    INTERN(s_user_env, "user_env");
    INTERN(s_tenant_env, "tenant_env");
    INTERN(s_load_env, "HTTP_X_PERFSLEUTH_LOAD");
    INTERN(s_tap_wsgi_input, "tap_wsgi_input");
    INTERN(s_finish_wsgi, "finish_wsgi");
    INTERN(s_fault, "_fault");
    INTERN(s_started_connected, "_flask_started_connected");
    INTERN(s_wsgi_app, "wsgi_app");
    INTERN(s_name_on_request_started, "_name_on_request_started");
    INTERN(s_slow_ns, "_slow_ns");
    INTERN(s_countdown, "_countdown");
    INTERN(s_request_method, "REQUEST_METHOD");
    INTERN(s_path_info, "PATH_INFO");
    INTERN(s_content_length, "CONTENT_LENGTH");
    INTERN(s_transfer_encoding, "HTTP_TRANSFER_ENCODING");
    INTERN(s_file_wrapper, "wsgi.file_wrapper");
    for (int k = 0; k < N_FIELDS; k++)
        INTERN(field_strs[k], field_names[k]);
    if ((s_cpu_kw = Py_BuildValue("(s)", "cpu")) == NULL || (zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    if (PyType_Ready(&BodyType) < 0 || PyType_Ready(&FlaskCallType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Body", (PyObject *)&BodyType) < 0 ||
        PyModule_AddObjectRef(m, "FlaskCall", (PyObject *)&FlaskCallType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
