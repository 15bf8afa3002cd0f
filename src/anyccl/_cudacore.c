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

/* ---- a cached plan's blocking replay, whole (gpu_dispatch.py's `compiled_replay`) ---------- */
static PyObject *s_is_neg, *s_is_contiguous, *s_data_ptr, *s_numel, *s_dtype, *s_one_call,
    *s_queue, *s_enqueue, *s_device, *s_name, *s_args, *s_nbytes, *s_failure, *s_alarm,
    *s_lock, *s_acquire, *s_release, *s_events, *s_next_event, *s_last_stream, *s_last_event,
    *s_queued, *s_followed, *s_retire_every, *s_append, *s_replayed, *s_issued_at,
    *s_timeout_s, *s_function, *s_blocks, *s_threads, *s_params, *s_state, *s_started,
    *s_started_at, *s_rank;

static int long_attr(PyObject *o, PyObject *name, long *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

enum { CTX_PLANS, CTX_TENSOR, CTX_OP, CTX_KERNEL, CTX_NCCL, CTX_STREAM, CTX_NUMBER, CTX_RECORD,
       CTX_RECORDER_ADD, CTX_DISPATCH, CTX_ERROR, CTX_SIZE };

/* Hand `item` to the queue's watchdog as GpuQueue._follow does: append it to `_queued`, then
 * `_followed(was_empty)` where the queue was empty or its length is a multiple of
 * `retire_every`. 0, or -1 on an error to raise. */
static int follow_op(PyObject *queue, PyObject *item) {
    PyObject *queued = PyObject_GetAttr(queue, s_queued), *r = NULL;
    long every;
    if (queued == NULL) return -1;
    Py_ssize_t before = PyObject_Length(queued);
    int ok = before >= 0 && long_attr(queue, s_retire_every, &every) == 0 && every > 0 &&
             (r = PyObject_CallMethodOneArg(queued, s_append, item)) != NULL;
    Py_XDECREF(r);
    Py_DECREF(queued);
    if (!ok) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "retire_every must be > 0");
        return -1;
    }
    if (before == 0 || (before + 1) % every == 0) {
        r = PyObject_CallMethodOneArg(queue, s_followed, before == 0 ? Py_True : Py_False);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
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
    PyObject *names[3] = {s_data_ptr, s_numel, NULL};
    int neg = -1, contiguous = -1;
    PyObject *r = PyObject_CallMethodNoArgs(tensor, s_is_neg);
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
    PyObject *plan = PyDict_GetItemWithError(PyTuple_GET_ITEM(ctx, CTX_PLANS), key);
    Py_DECREF(key);
    if (plan == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(plan);
    return plan;
miss:   /* sparse and other layouts without a data pointer raise RuntimeError: no plan */
    Py_DECREF(key);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) return NULL;
        PyErr_Clear();
    }
    Py_RETURN_NONE;
}

static int handle_of(PyObject *v, Handle *out) {
    *out = PyLong_AsVoidPtr(v);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

/* Queue `plan`'s one compiled call on the current stream under its queue's lock, the queue's
 * ordering state updated as GpuQueue._queue_one_call does: 1 once queued (*event_out: its
 * event, a new reference), 0 where the Python way must do it (the queue failed or its alarm is
 * up, its lock is held, the stream is being captured, a thread or device without its context,
 * a launch or NCCL call that failed: nothing of this call is left queued but maybe a wait,
 * which orders nothing new), -1 on an error to raise (among them an event that could not be
 * recorded after the operation was queued: the context's error type, gpu.CudaError). */
static int queue_plan(PyObject *ctx, PyObject *plan, PyObject *queue, PyObject **event_out) {
    int done = -1, locked = 0;
    PyObject *enqueue = NULL, *failure = NULL, *alarm = NULL, *lock = NULL, *device = NULL,
             *stream = NULL, *events = NULL, *event = NULL, *last = NULL, *last_event = NULL,
             *r = NULL;
    if ((failure = PyObject_GetAttr(queue, s_failure)) == NULL ||
        (alarm = PyObject_GetAttr(queue, s_alarm)) == NULL ||
        (enqueue = PyObject_GetAttr(plan, s_enqueue)) == NULL) goto out;
    done = 0;
    if (failure != Py_None) goto out;
    if (alarm != Py_None) {   /* (words, index): a kernel that ended its operation early */
        if (!PyTuple_Check(alarm) || PyTuple_GET_SIZE(alarm) != 2) goto out;
        PyObject *word = PyObject_GetItem(PyTuple_GET_ITEM(alarm, 0), PyTuple_GET_ITEM(alarm, 1));
        if (word == NULL) { done = -1; goto out; }
        int up = PyObject_IsTrue(word);
        Py_DECREF(word);
        if (up != 0) { done = up < 0 ? -1 : 0; goto out; }
    }
    done = -1;
    if ((lock = PyObject_GetAttr(queue, s_lock)) == NULL ||
        (r = PyObject_CallMethodOneArg(lock, s_acquire, Py_False)) == NULL) goto out;
    locked = r == Py_True;
    Py_CLEAR(r);
    done = 0;
    if (!locked) goto out;   /* another thread queues or aborts: the Python way waits */
    done = -1;
    long next, ring;
    Handle h[12];
    if ((device = PyObject_GetAttr(plan, s_device)) == NULL ||
        (stream = PyObject_CallOneArg(PyTuple_GET_ITEM(ctx, CTX_STREAM), device)) == NULL ||
        (events = PyObject_GetAttr(queue, s_events)) == NULL ||
        long_attr(queue, s_next_event, &next) < 0 ||
        (ring = PyObject_Length(events)) < 0 ||
        (event = PySequence_GetItem(events, next)) == NULL ||
        (last = PyObject_GetAttr(queue, s_last_stream)) == NULL ||
        (last_event = PyObject_GetAttr(queue, s_last_event)) == NULL) goto out;
    Handle stream_h, event_h, after_h = NULL, device_h, last_h = NULL;
    if (handle_of(stream, &stream_h) < 0 || handle_of(event, &event_h) < 0 ||
        handle_of(device, &device_h) < 0 ||
        (last != Py_None && handle_of(last, &last_h) < 0)) goto out;
    if (last != Py_None && last_h != stream_h && handle_of(last_event, &after_h) < 0) goto out;
    long status;
    if (Py_TYPE(enqueue) == (PyTypeObject *)PyTuple_GET_ITEM(ctx, CTX_KERNEL)) {
        long blocks, threads;
        PyObject *function = NULL, *params = NULL;
        Handle function_h = NULL, params_h = NULL;
        int bad = (function = PyObject_GetAttr(enqueue, s_function)) == NULL ||
                  (params = PyObject_GetAttr(enqueue, s_params)) == NULL ||
                  handle_of(function, &function_h) < 0 || handle_of(params, &params_h) < 0 ||
                  long_attr(enqueue, s_blocks, &blocks) < 0 ||
                  long_attr(enqueue, s_threads, &threads) < 0;
        Py_XDECREF(function);
        Py_XDECREF(params);
        if (bad) goto out;
        status = kernel_steps(stream_h, function_h, (unsigned)blocks, (unsigned)threads,
                              params_h, event_h, after_h, device_h);
    } else if (Py_TYPE(enqueue) == (PyTypeObject *)PyTuple_GET_ITEM(ctx, CTX_NCCL)) {
        PyObject *function = PyObject_GetAttr(enqueue, s_function), *args = NULL;
        int bad = function == NULL || (args = PyObject_GetAttr(enqueue, s_args)) == NULL ||
                  !PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 7 ||
                  handle_of(function, &h[1]) < 0;
        for (int i = 0; !bad && i < 7; i++)
            bad = handle_of(PyTuple_GET_ITEM(args, i), &h[2 + i]) < 0;
        Py_XDECREF(function);
        Py_XDECREF(args);
        if (bad) { if (!PyErr_Occurred()) done = 0; goto out; }
        h[0] = stream_h, h[9] = event_h, h[10] = after_h, h[11] = device_h;
        status = nccl_steps(h);
    } else {
        done = 0;
        goto out;
    }
    if (status < 0 && -status % 4 == 3) {   /* queued, its event not recorded: never again */
        PyObject *rank = PyObject_GetAttr(queue, s_rank), *name = PyObject_GetAttr(plan, s_name);
        if (rank != NULL && name != NULL)
            PyErr_Format(PyTuple_GET_ITEM(ctx, CTX_ERROR), "rank %S: %S: cuEventRecord failed "
                         "with CUresult %ld after the operation was queued on stream %p",
                         rank, name, -status / 4, stream_h);
        Py_XDECREF(rank);
        Py_XDECREF(name);
        goto out;
    }
    done = 0;
    if (status) goto out;   /* nothing launched: the Python way queues it, or raises why not */
    done = -1;
    PyObject *following = PyLong_FromLong((next + 1) % ring);
    if (following == NULL) goto out;
    int bad = PyObject_SetAttr(queue, s_next_event, following) < 0 ||
              PyObject_SetAttr(queue, s_last_stream, stream) < 0 ||
              PyObject_SetAttr(queue, s_last_event, event) < 0;
    Py_DECREF(following);
    if (bad) goto out;
    *event_out = event;
    event = NULL;
    done = 1;
out:
    if (locked) {
        PyObject *err_type, *err_value, *err_tb;
        PyErr_Fetch(&err_type, &err_value, &err_tb);
        PyObject *released = PyObject_CallMethodNoArgs(lock, s_release);
        if (released == NULL) done = -1; else Py_DECREF(released);
        if (err_type != NULL) PyErr_Restore(err_type, err_value, err_tb);
    }
    Py_XDECREF(enqueue); Py_XDECREF(failure); Py_XDECREF(alarm); Py_XDECREF(lock);
    Py_XDECREF(device); Py_XDECREF(stream); Py_XDECREF(events); Py_XDECREF(event);
    Py_XDECREF(last); Py_XDECREF(last_event);
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
    PyObject *plan = find_plan(ctx, tag, tensor), *one_call = NULL, *queue = NULL,
             *event = NULL, *result = NULL;
    if (plan == NULL) return NULL;
    if (plan == Py_None) { Py_DECREF(plan); Py_RETURN_FALSE; }
    if ((one_call = PyObject_GetAttr(plan, s_one_call)) == NULL ||
        (queue = PyObject_GetAttr(plan, s_queue)) == NULL) goto out;
    int queued = 0;
    if (one_call != Py_None && queue != Py_None &&
        (queued = queue_plan(ctx, plan, queue, &event)) < 0) goto out;
    if (!queued) { result = Py_False; Py_INCREF(result); goto out; }
    /* queued: its record, numbered, in the flight recorder, started, followed by the watchdog */
    PyObject *seq = NULL, *name = NULL, *text = NULL, *nbytes = NULL, *record = NULL,
             *issued = NULL, *timeout = NULL, *entries = NULL, *item = NULL, *r = NULL;
    int ok = (seq = PyObject_CallNoArgs(PyTuple_GET_ITEM(ctx, CTX_NUMBER))) != NULL &&
             (name = PyObject_GetAttr(plan, s_name)) != NULL &&
             (text = PyObject_GetAttr(plan, s_args)) != NULL &&
             (nbytes = PyObject_GetAttr(plan, s_nbytes)) != NULL &&
             (record = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(ctx, CTX_RECORD), name, seq,
                                                    text, nbytes, NULL)) != NULL &&
             PyObject_SetAttr(record, s_replayed, Py_True) == 0 &&
             (r = PyObject_CallOneArg(PyTuple_GET_ITEM(ctx, CTX_RECORDER_ADD), record)) != NULL;
    Py_XDECREF(r);
    if (ok) {   /* started, as FlightRecorder.started says it (time.monotonic's clock) */
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        PyObject *when = PyFloat_FromDouble((double)now.tv_sec + now.tv_nsec * 1e-9);
        ok = when != NULL && PyObject_SetAttr(record, s_state, s_started) == 0 &&
             PyObject_SetAttr(record, s_started_at, when) == 0;
        Py_XDECREF(when);
    }
    ok = ok && (issued = PyObject_GetAttr(record, s_issued_at)) != NULL &&
         (timeout = PyObject_GetAttr(PyTuple_GET_ITEM(ctx, CTX_DISPATCH), s_timeout_s)) != NULL &&
         (entries = PyTuple_Pack(1, record)) != NULL;
    if (ok) {
        double deadline = PyFloat_AsDouble(issued) + PyFloat_AsDouble(timeout);
        PyObject *when = PyErr_Occurred() ? NULL : PyFloat_FromDouble(deadline);
        ok = when != NULL &&
             (item = PyTuple_Pack(5, record, event, when, Py_None, entries)) != NULL &&
             follow_op(queue, item) == 0;
        Py_XDECREF(when);
    }
    Py_XDECREF(seq); Py_XDECREF(name); Py_XDECREF(text); Py_XDECREF(nbytes);
    Py_XDECREF(record); Py_XDECREF(issued); Py_XDECREF(timeout); Py_XDECREF(entries);
    Py_XDECREF(item);
    if (ok) { result = Py_True; Py_INCREF(result); }
out:
    Py_XDECREF(plan); Py_XDECREF(one_call); Py_XDECREF(queue); Py_XDECREF(event);
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
        {&s_numel, "numel"}, {&s_dtype, "dtype"}, {&s_one_call, "one_call"},
        {&s_queue, "queue"}, {&s_enqueue, "enqueue"}, {&s_device, "device"},
        {&s_name, "name"}, {&s_args, "args"}, {&s_nbytes, "nbytes"},
        {&s_failure, "failure"}, {&s_alarm, "_alarm"}, {&s_lock, "lock"},
        {&s_acquire, "acquire"}, {&s_release, "release"}, {&s_events, "_events"},
        {&s_next_event, "_next_event"}, {&s_last_stream, "_last_stream"},
        {&s_last_event, "_last_event"}, {&s_queued, "_queued"}, {&s_followed, "_followed"},
        {&s_retire_every, "retire_every"}, {&s_append, "append"}, {&s_replayed, "replayed"},
        {&s_state, "state"}, {&s_started, "started"}, {&s_started_at, "started_at"},
        {&s_rank, "rank"},
        {&s_issued_at, "issued_at"}, {&s_timeout_s, "timeout_s"}, {&s_function, "function"},
        {&s_blocks, "blocks"}, {&s_threads, "threads"}, {&s_params, "params"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) return NULL;
    return PyModule_Create(&module);
}
