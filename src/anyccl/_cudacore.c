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
#include <limits.h>
#include <stdint.h>
#include <time.h>

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

/* queue_kernel's driver calls: its status (see the module's comment). */
static long kernel_steps(Handle stream, Handle function, unsigned blocks, unsigned threads,
                         Handle params, Handle event, Handle after, Handle device) {
    long started = start_replay(stream, after, device);
    if (started) return started;
    CUresult rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cu_launch(function, blocks, 1, 1, threads, 1, 1, 0, stream, (void **)params, NULL);
    Py_END_ALLOW_THREADS
    if (rc) return -((long)rc * 4 + 2);
    if ((rc = cu_record(event, stream))) return -((long)rc * 4 + 3);
    return 0;
}

static PyObject *queue_kernel(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[8];
    if (handles(args, nargs, 8, "queue_kernel", h) < 0) return NULL;
    return PyLong_FromLong(kernel_steps(h[0], h[1], (unsigned)(uintptr_t)h[2],
                                        (unsigned)(uintptr_t)h[3], h[4], h[5], h[6], h[7]));
}

/* NCCL's collectives, by the shape of their arguments: ncclAllReduce, ncclReduceScatter and
 * ncclBroadcast take an op (or the root) before the communicator; ncclAllGather does not. */
typedef int (*NcclWithOp)(const void *, void *, size_t, int, int, Handle, Handle);
typedef int (*NcclWithoutOp)(const void *, void *, size_t, int, Handle, Handle);

/* queue_nccl's calls, h as its arguments: its status. */
static long nccl_steps(Handle *h) {
    Handle stream = h[0], function = h[1], send = h[3], recv = h[4], comm = h[8];
    Handle event = h[9], after = h[10];
    int with_op = h[2] != NULL, dtype = (int)(intptr_t)h[6], op = (int)(intptr_t)h[7];
    size_t count = (size_t)(uintptr_t)h[5];
    long started = start_replay(stream, after, h[11]);
    if (started) return started;
    int status;
    Py_BEGIN_ALLOW_THREADS
    if (with_op)
        status = ((NcclWithOp)function)(send, recv, count, dtype, op, comm, stream);
    else
        status = ((NcclWithoutOp)function)(send, recv, count, dtype, comm, stream);
    Py_END_ALLOW_THREADS
    if (status) return -((long)status * 4 + 2);
    CUresult rc = cu_record(event, stream);
    if (rc) return -((long)rc * 4 + 3);
    return 0;
}

static PyObject *queue_nccl(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Handle h[12];
    if (handles(args, nargs, 12, "queue_nccl", h) < 0) return NULL;
    return PyLong_FromLong(nccl_steps(h));
}

/* ---- a cached plan's blocking replay, whole (gpu_dispatch.py's `compiled_replay`) ----------
 * What it reads of Python objects, each in one tuple made once: the context (plans.py's
 * `Plans.compiled`: CTX_*), a plan's `compiled` (PLAN_*: the call's packed arguments, from
 * gpu.KernelLaunch or gpu.NcclCall, its device, name, argument text, size and queue) and its
 * queue's `replay_state` (gpu_queue.py: STATE_*), whose ordering state is a list (ORDER_*);
 * per call it reads only the queue's `failure` and the owner's `timeout_s` by name. */
static PyObject *s_is_neg, *s_is_contiguous, *s_data_ptr, *s_numel, *s_dtype, *s_compiled,
    *s_replay_state, *s_failure, *s_acquire, *s_release, *s_followed, *s_append, *s_popleft,
    *s_replayed, *s_issued_at, *s_timeout_s, *s_state, *s_started, *s_started_at, *s_ended_at,
    *s_done, *s_rank;

enum { CTX_PLANS, CTX_TENSOR, CTX_OP, CTX_STREAM, CTX_NUMBER, CTX_RECORD, CTX_RECORDER_ADD,
       CTX_DISPATCH, CTX_ERROR, CTX_KEY, CTX_SIZE };
/* CTX_KEY: None, or the torch group's compiled part's capsule of this function (_torchcore.cpp):
 * a new reference to (data_ptr, numel, dtype), None (no plan), or NULL on an error */
typedef PyObject *(*TensorKey)(PyObject *);
#define TENSOR_KEY_CAPSULE "anyccl._torchcore.tensor_key"
enum { PLAN_CALL, PLAN_DEVICE, PLAN_NAME, PLAN_ARGS, PLAN_NBYTES, PLAN_QUEUE, PLAN_SIZE };
enum { STATE_LOCK, STATE_EVENTS, STATE_ORDER, STATE_QUEUED, STATE_RETIRING, STATE_ALARM,
       STATE_EVERY, STATE_QUEUE, STATE_SIZE };
enum { ORDER_NEXT, ORDER_LAST_STREAM, ORDER_LAST_EVENT, ORDER_SIZE };
enum { QUEUED_EVENT = 1, QUEUED_ENTRIES = 4, QUEUED_SIZE = 5 };   /* gpu_queue.py's Queued */
#define CUDA_ERROR_NOT_READY 600

static int handle_of(PyObject *v, Handle *out) {
    *out = PyLong_AsVoidPtr(v);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

static double monotonic(void) {   /* time.monotonic's clock */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + now.tv_nsec * 1e-9;
}

/* Call `lock.acquire(False)`: 1 if it is now held, 0 if another thread holds it, -1 on an
 * error to raise. */
static int try_lock(PyObject *lock) {
    PyObject *r = PyObject_CallMethodOneArg(lock, s_acquire, Py_False);
    if (r == NULL) return -1;
    int got = r == Py_True;
    Py_DECREF(r);
    return got;
}

/* `lock.release()`, keeping an error already set; -1 if the release itself failed. */
static int unlock(PyObject *lock) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    int rc = r == NULL ? -1 : 0;
    Py_XDECREF(r);
    if (type != NULL) {
        if (rc < 0) PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    return rc;
}

/* Whether queued operation `i` of `queued` finished: 1, 0 (not yet), -1 on an error to raise,
 * -2 where the driver's query failed (left to the watchdog, whose own query raises it). */
static int finished(PyObject *queued, Py_ssize_t i) {
    PyObject *item = PySequence_GetItem(queued, i);
    if (item == NULL) return -1;
    Handle event;
    int rc = !PyTuple_Check(item) || PyTuple_GET_SIZE(item) != QUEUED_SIZE ? -2 :
             handle_of(PyTuple_GET_ITEM(item, QUEUED_EVENT), &event);
    Py_DECREF(item);
    if (rc) return rc;
    CUresult q = cu_query(event);
    return q == 0 ? 1 : q == CUDA_ERROR_NOT_READY ? 0 : -2;
}

/* GpuQueue._retire, under the queue's retiring lock where it is free: the finished operations
 * popped (they finish in issue order: the newest asked first, then a bisection), their
 * flight-recorder entries ended as FlightRecorder.ended says it. 0, or -1 on an error. */
static int retire(PyObject *state) {
    PyObject *retiring = PyTuple_GET_ITEM(state, STATE_RETIRING);
    PyObject *queued = PyTuple_GET_ITEM(state, STATE_QUEUED);
    int got = try_lock(retiring);
    if (got <= 0) return got;   /* another thread retires them now */
    int rc = 0;
    Py_ssize_t count = PyObject_Length(queued), done = 0;
    if (count < 0) rc = -1;
    else if (count > 0) {
        int last = finished(queued, count - 1);
        if (last == 1) done = count;
        else if (last == 0) {   /* [0, done) finished, `high` not */
            Py_ssize_t high = count - 1;
            while (done < high) {
                Py_ssize_t middle = (done + high) / 2;
                int f = finished(queued, middle);
                if (f == 1) done = middle + 1;
                else if (f == 0) high = middle;
                else { rc = f == -1 ? -1 : 0; break; }
            }
        } else rc = last == -1 ? -1 : 0;
    }
    PyObject *when = done > 0 && rc == 0 ? PyFloat_FromDouble(monotonic()) : NULL;
    if (done > 0 && when == NULL) rc = -1;
    for (Py_ssize_t i = 0; rc == 0 && i < done; i++) {
        PyObject *item = PyObject_CallMethodNoArgs(queued, s_popleft);
        if (item == NULL) { rc = -1; break; }
        PyObject *entries = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == QUEUED_SIZE ?
                            PyTuple_GET_ITEM(item, QUEUED_ENTRIES) : NULL;
        Py_ssize_t n = entries != NULL && PyTuple_Check(entries) ? PyTuple_GET_SIZE(entries) : 0;
        for (Py_ssize_t k = 0; rc == 0 && k < n; k++) {
            PyObject *entry = PyTuple_GET_ITEM(entries, k);
            if (PyObject_SetAttr(entry, s_ended_at, when) < 0 ||
                PyObject_SetAttr(entry, s_state, s_done) < 0) rc = -1;
        }
        Py_DECREF(item);
    }
    Py_XDECREF(when);
    if (unlock(retiring) < 0) rc = -1;
    return rc;
}

/* Hand `item` to the queue's watchdog as GpuQueue._follow does: append it to the queued
 * operations, then wake the watchdog (`_followed(True)`) where there were none, or retire the
 * finished ones where their number is a multiple of `retire_every`. 0, or -1 on an error. */
static int follow_op(PyObject *state, PyObject *item) {
    PyObject *queued = PyTuple_GET_ITEM(state, STATE_QUEUED);
    long every = PyLong_AsLong(PyTuple_GET_ITEM(state, STATE_EVERY));
    if (every <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "retire_every must be > 0");
        return -1;
    }
    Py_ssize_t before = PyObject_Length(queued);
    if (before < 0) return -1;
    PyObject *r = PyObject_CallMethodOneArg(queued, s_append, item);
    if (r == NULL) return -1;
    Py_DECREF(r);
    if (before == 0) {
        r = PyObject_CallMethodOneArg(PyTuple_GET_ITEM(state, STATE_QUEUE), s_followed, Py_True);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
    return (before + 1) % every == 0 ? retire(state) : 0;
}

/* The plan of `tag` on `tensor` (a new reference), Py_None where there is none (the call takes
 * the Python way, which finds the same answer, and says why), NULL on an error to raise. */
static PyObject *find_plan(PyObject *ctx, PyObject *tag, PyObject *tensor) {
    if (!PyObject_TypeCheck(tensor, (PyTypeObject *)PyTuple_GET_ITEM(ctx, CTX_TENSOR)))
        Py_RETURN_NONE;
    Py_ssize_t n = PyTuple_GET_SIZE(tag);
    PyTypeObject *op_type = (PyTypeObject *)PyTuple_GET_ITEM(ctx, CTX_OP);
    for (Py_ssize_t i = 0; i < n; i++) {   /* plans.py's _TAG_TYPES, exactly */
        PyObject *v = PyTuple_GET_ITEM(tag, i);
        if (!PyLong_CheckExact(v) && !PyUnicode_CheckExact(v) && Py_TYPE(v) != op_type)
            Py_RETURN_NONE;
    }
    PyObject *key = PyTuple_New(n + 3);
    if (key == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(PyTuple_GET_ITEM(tag, i));
        PyTuple_SET_ITEM(key, i, PyTuple_GET_ITEM(tag, i));
    }
    PyObject *r, *capsule = PyTuple_GET_ITEM(ctx, CTX_KEY);
    if (PyCapsule_CheckExact(capsule)) {   /* one C call of the torch core */
        TensorKey read = (TensorKey)PyCapsule_GetPointer(capsule, TENSOR_KEY_CAPSULE);
        PyObject *part = read == NULL ? NULL : read(tensor);
        if (part == NULL || !PyTuple_Check(part) || PyTuple_GET_SIZE(part) != 3) {
            Py_XDECREF(part);
            goto miss;
        }
        for (int i = 0; i < 3; i++) {
            Py_INCREF(PyTuple_GET_ITEM(part, i));
            PyTuple_SET_ITEM(key, n + i, PyTuple_GET_ITEM(part, i));
        }
        Py_DECREF(part);
    } else {   /* the tensor's methods, as plans.py calls them */
        PyObject *names[3] = {s_data_ptr, s_numel, NULL};
        int neg = -1, contiguous = -1;
        r = PyObject_CallMethodNoArgs(tensor, s_is_neg);
        if (r != NULL) { neg = PyObject_IsTrue(r); Py_DECREF(r); }
        if (neg == 0 && (r = PyObject_CallMethodNoArgs(tensor, s_is_contiguous)) != NULL) {
            contiguous = PyObject_IsTrue(r);
            Py_DECREF(r);
        }
        if (neg != 0 || contiguous != 1) goto miss;
        for (int i = 0; names[i] != NULL; i++) {
            if ((r = PyObject_CallMethodNoArgs(tensor, names[i])) == NULL) goto miss;
            PyTuple_SET_ITEM(key, n + i, r);
        }
        if ((r = PyObject_GetAttr(tensor, s_dtype)) == NULL) goto miss;
        PyTuple_SET_ITEM(key, n + 2, r);
    }
    PyObject *plan = PyDict_GetItemWithError(PyTuple_GET_ITEM(ctx, CTX_PLANS), key);
    Py_DECREF(key);
    if (plan == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(plan);
    return plan;
miss:   /* None from the key function, or a RuntimeError from the methods (sparse and other
         * layouts without a data pointer): no plan */
    Py_DECREF(key);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) return NULL;
        PyErr_Clear();
    }
    Py_RETURN_NONE;
}

/* The packed call (gpu.KernelLaunch.packed or gpu.NcclCall.packed) queued on `stream` after
 * `after`, `event` recorded after it: kernel_steps' or nccl_steps' status; 1 (not queued: the
 * Python way takes it) for a packing it does not know; RAISE on an error to raise. */
#define RAISE LONG_MIN
static long queue_packed(PyObject *call, Handle stream, Handle event, Handle after,
                         Handle device) {
    if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) < 1) return 1;
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(call, 0));
    Py_ssize_t want = kind == 0 ? 5 : kind == 1 ? 9 : -1;
    if (PyErr_Occurred()) return RAISE;
    if (PyTuple_GET_SIZE(call) != want) return 1;
    Handle h[12];
    for (Py_ssize_t i = 1; i < want; i++)
        if (handle_of(PyTuple_GET_ITEM(call, i), &h[i]) < 0) return RAISE;
    if (kind == 0)
        return kernel_steps(stream, h[1], (unsigned)(uintptr_t)h[2], (unsigned)(uintptr_t)h[3],
                            h[4], event, after, device);
    /* nccl_steps' layout: stream, function, with_op .. comm, event, after, device */
    h[0] = stream, h[9] = event, h[10] = after, h[11] = device;
    return nccl_steps(h);
}

/* Queue the plan's one compiled call on torch's current stream under its queue's lock, the
 * queue's ordering state updated as GpuQueue._queue_one_call does: 1 once queued (*event_out:
 * its event, a new reference), 0 where the Python way must do it (the queue failed or its
 * alarm is up or cannot be read here, its lock is held, the stream is being captured, a thread
 * or device without its context, a launch or NCCL call that failed: nothing of this call is
 * left queued but maybe a wait, which orders nothing new), -1 on an error to raise (among them
 * an event that could not be recorded after the operation was queued: the context's error
 * type, gpu.CudaError). */
static int queue_plan(PyObject *ctx, PyObject *plan, PyObject *state, PyObject **event_out) {
    PyObject *queue = PyTuple_GET_ITEM(state, STATE_QUEUE);
    PyObject *failure = PyObject_GetAttr(queue, s_failure);
    if (failure == NULL) return -1;
    int failed = failure != Py_None;
    Py_DECREF(failure);
    PyObject *alarm = PyTuple_GET_ITEM(state, STATE_ALARM);
    if (failed || alarm == Py_None) return 0;
    Handle word;   /* (a kernel that ended its operation early sets the host-mapped word) */
    if (handle_of(alarm, &word) < 0) return -1;
    if (word != NULL && *(volatile uint64_t *)word != 0) return 0;
    PyObject *events = PyTuple_GET_ITEM(state, STATE_EVENTS);
    PyObject *order = PyTuple_GET_ITEM(state, STATE_ORDER);
    if (!PyList_CheckExact(events) || !PyList_CheckExact(order) ||
        PyList_GET_SIZE(order) != ORDER_SIZE || PyList_GET_SIZE(events) == 0) return 0;
    PyObject *lock = PyTuple_GET_ITEM(state, STATE_LOCK);
    int locked = try_lock(lock);
    if (locked <= 0) return locked;   /* another thread queues or aborts: the Python way waits */
    int done = -1;
    PyObject *device = PyTuple_GET_ITEM(plan, PLAN_DEVICE);
    PyObject *stream = PyObject_CallOneArg(PyTuple_GET_ITEM(ctx, CTX_STREAM), device);
    Py_ssize_t ring = PyList_GET_SIZE(events);
    long next = PyLong_AsLong(PyList_GET_ITEM(order, ORDER_NEXT));
    Handle stream_h, event_h, device_h, last_h = NULL, after_h = NULL;
    if (stream == NULL || (next == -1 && PyErr_Occurred())) goto out;
    if (next < 0 || next >= ring) {
        PyErr_Format(PyExc_ValueError, "the queue's next event %ld is outside its ring of %zd",
                     next, ring);
        goto out;
    }
    PyObject *event = PyList_GET_ITEM(events, next);
    PyObject *last = PyList_GET_ITEM(order, ORDER_LAST_STREAM);
    if (handle_of(stream, &stream_h) < 0 || handle_of(event, &event_h) < 0 ||
        handle_of(device, &device_h) < 0 ||
        (last != Py_None && handle_of(last, &last_h) < 0)) goto out;
    if (last != Py_None && last_h != stream_h &&
        handle_of(PyList_GET_ITEM(order, ORDER_LAST_EVENT), &after_h) < 0) goto out;
    long status = queue_packed(PyTuple_GET_ITEM(plan, PLAN_CALL), stream_h, event_h, after_h,
                               device_h);
    if (status == RAISE) goto out;
    if (status < 0 && -status % 4 == 3) {   /* queued, its event not recorded: never again */
        PyObject *rank = PyObject_GetAttr(queue, s_rank);
        if (rank != NULL)
            PyErr_Format(PyTuple_GET_ITEM(ctx, CTX_ERROR), "rank %S: %S: cuEventRecord failed "
                         "with CUresult %ld after the operation was queued on stream %p",
                         rank, PyTuple_GET_ITEM(plan, PLAN_NAME), -status / 4, stream_h);
        Py_XDECREF(rank);
        goto out;
    }
    done = 0;
    if (status) goto out;   /* nothing launched: the Python way queues it, or raises why not */
    done = -1;
    PyObject *following = PyLong_FromLong((long)((next + 1) % ring));
    if (following == NULL) goto out;
    Py_INCREF(event);   /* the order's, and the caller's */
    Py_INCREF(event);
    PyList_SetItem(order, ORDER_NEXT, following);
    PyList_SetItem(order, ORDER_LAST_STREAM, stream);
    stream = NULL;
    PyList_SetItem(order, ORDER_LAST_EVENT, event);
    *event_out = event;
    done = 1;
out:
    Py_XDECREF(stream);
    if (unlock(lock) < 0) done = -1;
    return done;
}

static PyObject *replay(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "replay() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *ctx = args[0], *tag = args[1], *tensor = args[2];
    if (!PyTuple_CheckExact(ctx) || PyTuple_GET_SIZE(ctx) != CTX_SIZE ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(ctx, CTX_PLANS)) || !PyTuple_CheckExact(tag)) {
        PyErr_SetString(PyExc_TypeError, "replay(context, tag, tensor): a context tuple as "
                                         "gpu_dispatch.py builds it and a tag tuple");
        return NULL;
    }
    if (cu_launch == NULL) Py_RETURN_FALSE;
    PyObject *found = find_plan(ctx, tag, tensor), *plan = NULL, *state = NULL, *event = NULL,
             *result = NULL;
    if (found == NULL) return NULL;
    if (found == Py_None) { Py_DECREF(found); Py_RETURN_FALSE; }
    if ((plan = PyObject_GetAttr(found, s_compiled)) == NULL) goto out;
    int queued = 0;
    if (PyTuple_CheckExact(plan) && PyTuple_GET_SIZE(plan) == PLAN_SIZE) {
        state = PyObject_GetAttr(PyTuple_GET_ITEM(plan, PLAN_QUEUE), s_replay_state);
        if (state == NULL) goto out;
        if (PyTuple_CheckExact(state) && PyTuple_GET_SIZE(state) == STATE_SIZE &&
            (queued = queue_plan(ctx, plan, state, &event)) < 0) goto out;
    }
    if (!queued) { result = Py_False; Py_INCREF(result); goto out; }
    /* queued: its record, numbered, in the flight recorder, started, followed by the watchdog */
    PyObject *seq = NULL, *record = NULL, *timeout = NULL, *issued = NULL, *entries = NULL,
             *item = NULL, *when = NULL, *r = NULL;
    int ok = (seq = PyObject_CallNoArgs(PyTuple_GET_ITEM(ctx, CTX_NUMBER))) != NULL &&
             (record = PyObject_CallFunctionObjArgs(
                  PyTuple_GET_ITEM(ctx, CTX_RECORD), PyTuple_GET_ITEM(plan, PLAN_NAME), seq,
                  PyTuple_GET_ITEM(plan, PLAN_ARGS), PyTuple_GET_ITEM(plan, PLAN_NBYTES),
                  NULL)) != NULL &&
             PyObject_SetAttr(record, s_replayed, Py_True) == 0 &&
             (r = PyObject_CallOneArg(PyTuple_GET_ITEM(ctx, CTX_RECORDER_ADD), record)) != NULL &&
             /* started, as FlightRecorder.started says it */
             (when = PyFloat_FromDouble(monotonic())) != NULL &&
             PyObject_SetAttr(record, s_state, s_started) == 0 &&
             PyObject_SetAttr(record, s_started_at, when) == 0 &&
             (issued = PyObject_GetAttr(record, s_issued_at)) != NULL &&
             (timeout = PyObject_GetAttr(PyTuple_GET_ITEM(ctx, CTX_DISPATCH),
                                         s_timeout_s)) != NULL &&
             (entries = PyTuple_Pack(1, record)) != NULL;
    Py_XDECREF(r);
    Py_XDECREF(when);
    when = NULL;
    if (ok) {
        double deadline = PyFloat_AsDouble(issued) + PyFloat_AsDouble(timeout);
        ok = !PyErr_Occurred() && (when = PyFloat_FromDouble(deadline)) != NULL &&
             (item = PyTuple_Pack(QUEUED_SIZE, record, event, when, Py_None, entries)) != NULL &&
             follow_op(state, item) == 0;
    }
    Py_XDECREF(seq); Py_XDECREF(record); Py_XDECREF(timeout); Py_XDECREF(issued);
    Py_XDECREF(entries); Py_XDECREF(item); Py_XDECREF(when);
    if (ok) { result = Py_True; Py_INCREF(result); }
out:
    Py_XDECREF(found); Py_XDECREF(plan); Py_XDECREF(state); Py_XDECREF(event);
    return result;
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
    {"replay", (PyCFunction)(void (*)(void))replay, METH_FASTCALL,
     "replay(context, tag, tensor) -> True once a cached plan's blocking replay is queued, "
     "followed and recorded; False where the Python way must take the call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cudacore", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cudacore(void) {
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_is_neg, "is_neg"}, {&s_is_contiguous, "is_contiguous"}, {&s_data_ptr, "data_ptr"},
        {&s_numel, "numel"}, {&s_dtype, "dtype"}, {&s_compiled, "compiled"},
        {&s_replay_state, "replay_state"}, {&s_failure, "failure"}, {&s_acquire, "acquire"},
        {&s_release, "release"}, {&s_followed, "_followed"}, {&s_append, "append"},
        {&s_popleft, "popleft"}, {&s_replayed, "replayed"}, {&s_issued_at, "issued_at"},
        {&s_timeout_s, "timeout_s"}, {&s_state, "state"}, {&s_started, "started"},
        {&s_started_at, "started_at"}, {&s_ended_at, "ended_at"}, {&s_done, "done"},
        {&s_rank, "rank"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) return NULL;
    return PyModule_Create(&module);
}
