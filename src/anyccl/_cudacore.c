/* The CUDA driver calls every queued GPU operation makes, compiled: each is one C call on
 * Python ints, without the argument wrapping of NVIDIA's Python bindings (about a microsecond
 * per call) or of ctypes (see gpu.py, which uses this module when it loads and falls back to
 * the bindings otherwise).
 *
 *   load()                                  open the driver library; False if it is missing
 *   launch(function, blocks, threads, stream, params)
 *                                           cuLaunchKernel of a 1-D grid, no shared memory;
 *                                           `params` is the address of its void* array (the
 *                                           GIL is released: a full launch queue blocks)
 *   record(event, stream)                   cuEventRecord
 *   stream_wait(stream, event)              cuStreamWaitEvent
 *   query(event)                            cuEventQuery
 *   capturing(stream)                       cuStreamIsCapturing: the capture status (0: none),
 *                                           or minus the error code
 *   context()                               cuCtxGetCurrent: the current context's address
 *                                           (0: none), or minus the error code
 *   device()                                cuCtxGetDevice: the current context's device, or
 *                                           minus the error code (no current context: 201)
 *
 * Every call but `capturing`, `context` and `device` returns the CUresult (0: success); the caller turns
 * a failure into an error that names the call. Handles and addresses are Python ints.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

typedef int CUresult;
typedef void *Handle;

static CUresult (*cu_launch)(Handle, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, Handle, void **, void **);
static CUresult (*cu_record)(Handle, Handle);
static CUresult (*cu_wait)(Handle, Handle, unsigned);
static CUresult (*cu_query)(Handle);
static CUresult (*cu_capturing)(Handle, int *);
static CUresult (*cu_context)(Handle *);
static CUresult (*cu_device)(int *);

static PyObject *load(PyObject *self, PyObject *unused) {
    if (cu_launch != NULL) Py_RETURN_TRUE;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) Py_RETURN_FALSE;
    void *launch = dlsym(lib, "cuLaunchKernel"), *record = dlsym(lib, "cuEventRecord"),
         *wait = dlsym(lib, "cuStreamWaitEvent"), *query = dlsym(lib, "cuEventQuery"),
         *capturing = dlsym(lib, "cuStreamIsCapturing"), *context = dlsym(lib, "cuCtxGetCurrent"),
         *device = dlsym(lib, "cuCtxGetDevice");
    if (!launch || !record || !wait || !query || !capturing || !context || !device)
        Py_RETURN_FALSE;
    *(void **)&cu_record = record;
    *(void **)&cu_wait = wait;
    *(void **)&cu_query = query;
    *(void **)&cu_capturing = capturing;
    *(void **)&cu_context = context;
    *(void **)&cu_device = device;
    *(void **)&cu_launch = launch;  /* last: it marks the module loaded */
    Py_RETURN_TRUE;
}

static int handles(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *name,
                   Handle *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    if (cu_launch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "anyccl._cudacore: load() has not succeeded");
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsVoidPtr(args[i]);
        if (out[i] == NULL && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[5];
    if (handles(args, nargs, 5, "launch", h) < 0) return NULL;
    unsigned blocks = (unsigned)(uintptr_t)h[1], threads = (unsigned)(uintptr_t)h[2];
    CUresult status;
    Py_BEGIN_ALLOW_THREADS
    status = cu_launch(h[0], blocks, 1, 1, threads, 1, 1, 0, h[3], (void **)h[4], NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

static PyObject *record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[2];
    if (handles(args, nargs, 2, "record", h) < 0) return NULL;
    return PyLong_FromLong(cu_record(h[0], h[1]));
}

static PyObject *stream_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[2];
    if (handles(args, nargs, 2, "stream_wait", h) < 0) return NULL;
    return PyLong_FromLong(cu_wait(h[0], h[1], 0));
}

static PyObject *query(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[1];
    if (handles(args, nargs, 1, "query", h) < 0) return NULL;
    return PyLong_FromLong(cu_query(h[0]));
}

static PyObject *capturing(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[1];
    if (handles(args, nargs, 1, "capturing", h) < 0) return NULL;
    int status = 0;
    CUresult rc = cu_capturing(h[0], &status);
    return PyLong_FromLong(rc ? -(long)rc : (long)status);
}

static PyObject *context(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[1];
    if (handles(args, nargs, 0, "context", h) < 0) return NULL;
    Handle ctx = NULL;
    CUresult rc = cu_context(&ctx);
    return rc ? PyLong_FromLong(-(long)rc) : PyLong_FromVoidPtr(ctx);
}

static PyObject *device(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[1];
    if (handles(args, nargs, 0, "device", h) < 0) return NULL;
    int ordinal = -1;
    CUresult rc = cu_device(&ordinal);
    return PyLong_FromLong(rc ? -(long)rc : (long)ordinal);
}

static PyMethodDef methods[] = {
    {"load", load, METH_NOARGS, "Open the CUDA driver library; False if it is missing."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(function, blocks, threads, stream, params) -> CUresult"},
    {"record", (PyCFunction)(void (*)(void))record, METH_FASTCALL,
     "record(event, stream) -> CUresult"},
    {"stream_wait", (PyCFunction)(void (*)(void))stream_wait, METH_FASTCALL,
     "stream_wait(stream, event) -> CUresult"},
    {"query", (PyCFunction)(void (*)(void))query, METH_FASTCALL, "query(event) -> CUresult"},
    {"capturing", (PyCFunction)(void (*)(void))capturing, METH_FASTCALL,
     "capturing(stream) -> capture status, or minus the CUresult"},
    {"context", (PyCFunction)(void (*)(void))context, METH_FASTCALL,
     "context() -> the current context's address (0: none), or minus the CUresult"},
    {"device", (PyCFunction)(void (*)(void))device, METH_FASTCALL,
     "device() -> the current context's device ordinal, or minus the CUresult"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cudacore", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cudacore(void) { return PyModule_Create(&module); }
