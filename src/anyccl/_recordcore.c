/* An operation's record (trace.py's OpRecord), compiled: every operation makes one, and a
 * Python class's construction (twelve attribute stores and a clock read) cost three times what
 * this type's does. trace.py uses it when this module loads and its own class otherwise; the
 * two behave alike (tests/test_records.py):
 *
 *   OpRecord(name, seq, args="", nbytes=0)
 *       name, seq, nbytes, _args as given; issued_at = the monotonic clock now (time.monotonic's
 *       clock); agree = None; deadline = inf; state = "queued"; started_at = ended_at =
 *       error = None; replayed = False. Attributes are writable; no others can be added.
 *   .args     the argument text: `_args` itself, or, where `_args` is a tuple (function,
 *             *arguments), the function's result, made once, when first read
 *   str()     "name(args) #seq"; repr(): "OpRecord(name(args) #seq)"
 *
 * Records hold plain values only (a record keeps no array alive: trace.about), so they are
 * never part of a reference cycle, and this type is not tracked by the cyclic GC.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

#if PY_VERSION_HEX < 0x030A0000
static inline PyObject *Py_NewRef(PyObject *o) { Py_INCREF(o); return o; }
#endif

typedef struct {
    PyObject_HEAD
    PyObject *name, *seq, *nbytes, *args, *agree, *state, *started_at, *ended_at, *error;
    PyObject *issued_at, *deadline;   /* floats, kept as objects: read far more than written */
    char replayed;
} Record;

static PyTypeObject RecordType;

static PyObject *queued_str, *empty_str, *zero, *never, *monotonic;

/* time.monotonic(): on Linux its clock read directly; elsewhere the function itself (-1: error) */
static double mono(void) {
#ifdef __linux__
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
#else
    PyObject *now = PyObject_CallNoArgs(monotonic);
    if (now == NULL) return -1.0;
    double t = PyFloat_AsDouble(now);
    Py_DECREF(now);
    return t;
#endif
}

static PyObject *record_make(PyTypeObject *type, PyObject *const *a, Py_ssize_t n) {
    if (n < 2 || n > 4) {
        PyErr_SetString(PyExc_TypeError, "OpRecord(name, seq, args='', nbytes=0)");
        return NULL;
    }
    double now = mono();
    if (now < 0 && PyErr_Occurred()) return NULL;
    PyObject *issued_at = PyFloat_FromDouble(now);
    if (issued_at == NULL) return NULL;
    Record *r = (Record *)type->tp_alloc(type, 0);
    if (r == NULL) {
        Py_DECREF(issued_at);
        return NULL;
    }
    r->name = Py_NewRef(a[0]);
    r->seq = Py_NewRef(a[1]);
    r->args = Py_NewRef(n > 2 ? a[2] : empty_str);
    r->nbytes = Py_NewRef(n > 3 ? a[3] : zero);
    r->issued_at = issued_at;   /* the reference made above */
    r->agree = Py_NewRef(Py_None);
    r->deadline = Py_NewRef(never);
    r->state = Py_NewRef(queued_str);
    r->started_at = Py_NewRef(Py_None);
    r->ended_at = Py_NewRef(Py_None);
    r->error = Py_NewRef(Py_None);
    r->replayed = 0;
    return (PyObject *)r;
}

static PyObject *record_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) {
        PyErr_SetString(PyExc_TypeError, "OpRecord takes positional arguments");
        return NULL;
    }
    return record_make((PyTypeObject *)type, args, PyVectorcall_NARGS(nargsf));
}

static PyObject *record_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "OpRecord takes positional arguments");
        return NULL;
    }
    return record_make(type, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args));
}

/* Not tracked by the cyclic GC: a record holds plain values only (names, numbers, argument
 * text or the function and values that make it, never an array), so it is never in a cycle */
static void record_dealloc(Record *r) {
    Py_XDECREF(r->name); Py_XDECREF(r->seq); Py_XDECREF(r->nbytes); Py_XDECREF(r->args);
    Py_XDECREF(r->agree); Py_XDECREF(r->state); Py_XDECREF(r->started_at);
    Py_XDECREF(r->ended_at); Py_XDECREF(r->error); Py_XDECREF(r->issued_at);
    Py_XDECREF(r->deadline);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *or_none(PyObject *o) { return o != NULL ? o : Py_None; }

static PyObject *record_get_args(Record *r, void *closure) {
    if (r->args == NULL) return Py_NewRef(Py_None);   /* deleted */
    if (PyTuple_Check(r->args) && PyTuple_GET_SIZE(r->args) > 0) {
        PyObject *rest = PyTuple_GetSlice(r->args, 1, PyTuple_GET_SIZE(r->args));
        if (rest == NULL) return NULL;
        PyObject *text = PyObject_Call(PyTuple_GET_ITEM(r->args, 0), rest, NULL);
        Py_DECREF(rest);
        if (text == NULL) return NULL;
        Py_SETREF(r->args, text);
    }
    return Py_NewRef(r->args);
}

static PyObject *record_str(Record *r) {
    PyObject *args = record_get_args(r, NULL);
    if (args == NULL) return NULL;
    PyObject *s = PyUnicode_FromFormat("%S(%S) #%S", or_none(r->name), args, or_none(r->seq));
    Py_DECREF(args);
    return s;
}

static PyObject *record_repr(Record *r) {
    PyObject *s = record_str(r);
    if (s == NULL) return NULL;
    PyObject *out = PyUnicode_FromFormat("OpRecord(%U)", s);
    Py_DECREF(s);
    return out;
}

#define OBJ(field, doc) {#field, T_OBJECT, offsetof(Record, field), 0, doc}
static PyMemberDef record_members[] = {
    OBJ(name, "the operation's name"), OBJ(seq, "its sequence number"),
    OBJ(nbytes, "its bytes"), {"_args", T_OBJECT, offsetof(Record, args), 0, "args as given"},
    OBJ(agree, "a host collective's signature"), OBJ(state, "queued/started/done/failed"),
    OBJ(started_at, "monotonic"), OBJ(ended_at, "monotonic"), OBJ(error, "the error text"),
    OBJ(issued_at, "monotonic"), OBJ(deadline, "monotonic (inf: none)"),
    {"replayed", T_BOOL, offsetof(Record, replayed), 0, "replayed a plan"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef record_getset[] = {
    {"args", (getter)record_get_args, NULL, "the argument text", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "anyccl._recordcore.OpRecord",
    .tp_basicsize = sizeof(Record),
    .tp_doc = "OpRecord(name, seq, args='', nbytes=0): one operation issued, and its states",
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = record_new,
    .tp_vectorcall = record_vectorcall,
    .tp_dealloc = (destructor)record_dealloc,
    .tp_str = (reprfunc)record_str,
    .tp_repr = (reprfunc)record_repr,
    .tp_members = record_members,
    .tp_getset = record_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_recordcore", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__recordcore(void) {
    queued_str = PyUnicode_InternFromString("queued");
    empty_str = PyUnicode_InternFromString("");
    zero = PyLong_FromLong(0);
    never = PyFloat_FromDouble(Py_HUGE_VAL);
    PyObject *time = PyImport_ImportModule("time");
    if (time == NULL) return NULL;
    monotonic = PyObject_GetAttrString(time, "monotonic");
    Py_DECREF(time);
    if (queued_str == NULL || empty_str == NULL || zero == NULL || never == NULL
        || monotonic == NULL)
        return NULL;
    if (PyType_Ready(&RecordType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RecordType);
    if (PyModule_AddObject(m, "OpRecord", (PyObject *)&RecordType) < 0) {
        Py_DECREF(&RecordType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
