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
 *   follow(stream, event, after)            work queued on `stream` from now on waits for the
 *                                           work queued on stream `after` so far: cuEventRecord
 *                                           of `event` on `after`, then cuStreamWaitEvent; 0 on
 *                                           success, else minus (CUresult * 2 + the failed step:
 *                                           0 record, 1 wait)
 *   query(event)                            cuEventQuery
 *   capturing(stream)                       cuStreamIsCapturing: the capture status (0: none),
 *                                           or minus the error code
 *   context()                               cuCtxGetCurrent: the current context's address
 *                                           (0: none), or minus the error code
 *   device()                                cuCtxGetDevice: the current context's device, or
 *                                           minus the error code (no current context: 201)
 *   queue_kernel(stream, function, blocks, threads, params, event, after, device)
 *                                           a replayed operation's driver calls in one: unless
 *                                           the thread has no current context, or `stream` is
 *                                           a null stream and `device` not the current one
 *                                           (then it queues nothing and returns 2), or `stream`
 *                                           is being captured (nothing queued, returns 1), the
 *                                           stream
 *                                           waits for event `after` (unless 0), the kernel is
 *                                           launched as by launch() and `event` recorded after
 *                                           it; 0 on success, else minus (CUresult * 4 + the
 *                                           failed step: 0 capture query, 1 wait, 2 launch,
 *                                           3 record)
 *   queue_nccl(stream, function, with_op, send, recv, count, dtype, op, comm, event, after,
 *              device)
 *                                           the same for one NCCL collective: `function` is
 *                                           NCCL's entry point (ncclAllReduce and its like),
 *                                           called with the arguments after it (`op`, the op
 *                                           or root, only where with_op); returns as
 *                                           queue_kernel, the failed step 2 with NCCL's
 *                                           ncclResult_t
 *
 * Every call but `follow`, `capturing`, `context`, `device`, `queue_kernel` and `queue_nccl`
 * returns the CUresult (0: success); the caller turns a failure into an error that names the
 * call. Handles and addresses are Python ints.
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

static PyObject *follow(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[3];
    if (handles(args, nargs, 3, "follow", h) < 0) return NULL;
    CUresult rc = cu_record(h[1], h[2]);
    if (rc) return PyLong_FromLong(-((long)rc * 2 + 0));
    if ((rc = cu_wait(h[0], h[1], 0))) return PyLong_FromLong(-((long)rc * 2 + 1));
    return PyLong_FromLong(0);
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

/* What every replayed operation does first on `stream`: 2 where the thread has no current
 * context, or where `stream` is a null stream (0, 1, 2: the current device's) and the current
 * device is not `device`; 1 where the stream is being captured (nothing queued either way),
 * minus (CUresult * 4 + step) on a failure, else 0 once the stream waits for event `after`
 * (unless 0). */
static long start_replay(Handle stream, Handle after, Handle device) {
    Handle context = NULL;
    if (cu_context(&context) || context == NULL) return 2;
    if ((uintptr_t)stream <= 2) {
        int ordinal = -1;
        if (cu_device(&ordinal) || ordinal != (int)(intptr_t)device) return 2;
    }
    int capture = 0;
    CUresult rc = cu_capturing(stream, &capture);
    if (rc) return -((long)rc * 4 + 0);
    if (capture) return 1;
    if (after != NULL && (rc = cu_wait(stream, after, 0))) return -((long)rc * 4 + 1);
    return 0;
}

static PyObject *queue_kernel(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[8];
    if (handles(args, nargs, 8, "queue_kernel", h) < 0) return NULL;
    Handle stream = h[0], function = h[1], params = h[4], event = h[5], after = h[6];
    unsigned blocks = (unsigned)(uintptr_t)h[2], threads = (unsigned)(uintptr_t)h[3];
    long started = start_replay(stream, after, h[7]);
    if (started) return PyLong_FromLong(started);
    CUresult rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cu_launch(function, blocks, 1, 1, threads, 1, 1, 0, stream, (void **)params, NULL);
    Py_END_ALLOW_THREADS
    if (rc) return PyLong_FromLong(-((long)rc * 4 + 2));
    if ((rc = cu_record(event, stream))) return PyLong_FromLong(-((long)rc * 4 + 3));
    return PyLong_FromLong(0);
}

/* NCCL's collectives, by the shape of their arguments: ncclAllReduce, ncclReduceScatter and
 * ncclBroadcast take an op (or the root) before the communicator; ncclAllGather does not. */
typedef int (*NcclWithOp)(const void *, void *, size_t, int, int, Handle, Handle);
typedef int (*NcclWithoutOp)(const void *, void *, size_t, int, Handle, Handle);

static PyObject *queue_nccl(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[12];
    if (handles(args, nargs, 12, "queue_nccl", h) < 0) return NULL;
    Handle stream = h[0], function = h[1], send = h[3], recv = h[4], comm = h[8];
    Handle event = h[9], after = h[10];
    int with_op = h[2] != NULL, dtype = (int)(intptr_t)h[6], op = (int)(intptr_t)h[7];
    size_t count = (size_t)(uintptr_t)h[5];
    long started = start_replay(stream, after, h[11]);
    if (started) return PyLong_FromLong(started);
    int status;
    Py_BEGIN_ALLOW_THREADS
    if (with_op)
        status = ((NcclWithOp)function)(send, recv, count, dtype, op, comm, stream);
    else
        status = ((NcclWithoutOp)function)(send, recv, count, dtype, comm, stream);
    Py_END_ALLOW_THREADS
    if (status) return PyLong_FromLong(-((long)status * 4 + 2));
    CUresult rc = cu_record(event, stream);
    if (rc) return PyLong_FromLong(-((long)rc * 4 + 3));
    return PyLong_FromLong(0);
}

static PyMethodDef methods[] = {
    {"load", load, METH_NOARGS, "Open the CUDA driver library; False if it is missing."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(function, blocks, threads, stream, params) -> CUresult"},
    {"record", (PyCFunction)(void (*)(void))record, METH_FASTCALL,
     "record(event, stream) -> CUresult"},
    {"stream_wait", (PyCFunction)(void (*)(void))stream_wait, METH_FASTCALL,
     "stream_wait(stream, event) -> CUresult"},
    {"follow", (PyCFunction)(void (*)(void))follow, METH_FASTCALL,
     "follow(stream, event, after) -> 0, or minus (CUresult * 2 + failed step)"},
    {"query", (PyCFunction)(void (*)(void))query, METH_FASTCALL, "query(event) -> CUresult"},
    {"capturing", (PyCFunction)(void (*)(void))capturing, METH_FASTCALL,
     "capturing(stream) -> capture status, or minus the CUresult"},
    {"context", (PyCFunction)(void (*)(void))context, METH_FASTCALL,
     "context() -> the current context's address (0: none), or minus the CUresult"},
    {"device", (PyCFunction)(void (*)(void))device, METH_FASTCALL,
     "device() -> the current context's device ordinal, or minus the CUresult"},
    {"queue_kernel", (PyCFunction)(void (*)(void))queue_kernel, METH_FASTCALL,
     "queue_kernel(stream, function, blocks, threads, params, event, after, device) -> 0, 1 (the "
     "stream is being captured: nothing queued), 2 (no current context, or a null stream of "
     "another device: nothing queued), or "
     "minus (CUresult * 4 + failed step)"},
    {"queue_nccl", (PyCFunction)(void (*)(void))queue_nccl, METH_FASTCALL,
     "queue_nccl(stream, function, with_op, send, recv, count, dtype, op, comm, event, after, "
     "device) "
     "-> as queue_kernel (step 2: the ncclResult_t)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cudacore", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cudacore(void) { return PyModule_Create(&module); }
