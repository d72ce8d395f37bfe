/* perfsleuth.agent's C extensions (_speedups.c, _asgi.c, _wsgi.c): the helpers they share.
 * Each extension is its own compilation unit; this header gives each its own copy. */
#ifndef PERFSLEUTH_AGENT_C_H
#define PERFSLEUTH_AGENT_C_H

#include <Python.h>

/* PyLong_AsLongLong without its slow path for multi-digit ints: PyLong_AsLongLong reads an int
 * of more than one digit (a nanosecond clock reading) through a byte array, ~200 instructions;
 * this reads the digits (PyLong_AsLongLongAndOverflow), ~30. With AGENT_C_INT_IN_PLACE (3.11,
 * where _speedups.c reads CPython's internals anyway) an int of at most one digit (a site
 * index, a row offset, a stack's ~lasti) is read in place. */
static inline long long
as_ll(PyObject *v)
{
#ifdef AGENT_C_INT_IN_PLACE
    if (PyLong_CheckExact(v) && Py_SIZE(v) >= -1 && Py_SIZE(v) <= 1) /* 0, or one digit */
        return Py_SIZE(v) * (long long)((PyLongObject *)v)->ob_digit[0];
#endif
    int overflow = 0;
    long long r = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "Python int too large to convert to C long long");
        return -1;
    }
    return r;
}

/* The exception throw(type, value, tb) raises, as a generator's throw makes it: a value that
 * is an instance of type is it, else type is called with it (None: no arguments, a tuple: its
 * items); an instance for type takes no value; tb, when not None, is its traceback. A new
 * reference; NULL with the TypeError throw raises. (frameworks.asgi._thrown in Python.) */
static inline PyObject *
thrown(PyObject *type, PyObject *value, PyObject *tb)
{
    if (tb != Py_None && !PyTraceBack_Check(tb)) {
        PyErr_SetString(PyExc_TypeError, "throw() third argument must be a traceback object");
        return NULL;
    }
    PyObject *exc;
    if (PyExceptionClass_Check(type)) {
        int is = value != Py_None && PyExceptionInstance_Check(value)
                     ? PyObject_IsInstance(value, type)
                     : 0;
        if (is < 0)
            return NULL;
        if (is)
            exc = Py_NewRef(value);
        else if (value == Py_None)
            exc = PyObject_CallNoArgs(type);
        else if (PyTuple_Check(value))
            exc = PyObject_Call(type, value, NULL);
        else
            exc = PyObject_CallOneArg(type, value);
        if (exc != NULL && !PyExceptionInstance_Check(exc)) {
            PyErr_Format(PyExc_TypeError,
                         "calling %R should have returned an instance of BaseException, not %s",
                         type, Py_TYPE(exc)->tp_name);
            Py_CLEAR(exc);
        }
    }
    else if (PyExceptionInstance_Check(type)) {
        if (value != Py_None) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return NULL;
        }
        exc = Py_NewRef(type);
    }
    else {
        PyErr_Format(PyExc_TypeError,
                     "exceptions must be classes or instances deriving from BaseException, not %s",
                     Py_TYPE(type)->tp_name);
        return NULL;
    }
    if (exc != NULL && tb != Py_None && PyException_SetTraceback(exc, tb) < 0)
        Py_CLEAR(exc);
    return exc;
}

#endif
