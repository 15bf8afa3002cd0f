/* The shm transport's per-call core, compiled: what every small operation does on every call,
 * done without the interpreter (see shm.py, which falls back to NumPy where this module is
 * missing or does not cover a dtype or reduction).
 *
 *   ring(bell)                       wake a doorbell (sem_post on its address)
 *   set_spin_yield(on)               spins give the core away at every turn (sched_yield)
 *   exit_after(seconds, code, say)   end the process with `code` that many seconds from now,
 *                                    first writing `say` (bytes) to stderr, from a thread of
 *                                    its own (a watchdog over a call at exit that may never
 *                                    return: the mpi backend's MPI_Finalize)
 *   send(lane, pos, tag, code, src) write a whole message (32-byte header, data) into a byte
 *                                    ring if it has room, publish the sent counter, ring the
 *                                    receiver's bell; the new position (0: no room)
 *   take(lane, pos, ..., spin_ns)    the same in reverse: the next message, if it is whole
 *                                    (spinning a while without the GIL until it is) and has
 *                                    the expected tag, dtype and size (else 0)
 *   reduce(out, srcs, count, dtype, op, divisor)
 *                                    out = srcs[0] (op) srcs[1] (op) ... in that order, in out's
 *                                    dtype, then / divisor for AVG; False if the dtype/op pair
 *                                    is not one this module covers (the caller uses NumPy)
 *   Staging(lanes, doing, half_bytes)
 *                                    one rank's staging halves and barrier epochs:
 *     .sync(agree)                   the next barrier: arrive (a release store of the epoch,
 *                                    with the collective's signature before it), ring the
 *                                    peers' doorbells, spin without the GIL until every peer
 *                                    arrived, compare their signatures
 *     .one_shot(x, doing, agree, ...)
 *                                    a small all_reduce, reduce or broadcast whole: the next
 *                                    staging half, stage, the barrier as sync, then reduce or
 *                                    copy, marking the rank in the operation and then idle
 *   hot(ctx, comm, kind, x, arg)     a blocking small all_reduce, broadcast or all_gather on
 *                                    NumPy arrays, whole: the communicator's and the engine's
 *                                    part of the call (checks, number, record) around one_shot
 *
 * Addresses are Python ints (of shared mappings the caller keeps alive); buffers are objects
 * with the buffer protocol (NumPy arrays). Counters are aligned 8-byte words with one writer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <limits.h>
#include <sched.h>
#include <time.h>
#include <pthread.h>
#include <unistd.h>

/* Whether spins give the core away at every turn (sched_yield) instead of pausing: set when
 * this host runs more ranks than this process has cores (set_spin_yield), where a pausing spin
 * holds the core the peer it waits for needs. */
static int spin_yields = 0;

static inline void spin_turn(void) {
    if (spin_yields) {
        sched_yield();
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int address(PyObject *obj, void **out) {
    *out = PyLong_AsVoidPtr(obj);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *ring(PyObject *self, PyObject *bell) {
    void *addr;
    if (address(bell, &addr) < 0) return NULL;
    sem_post((sem_t *)addr);  /* EOVERFLOW only means the owner wakes anyway */
    Py_RETURN_NONE;
}

/* A collective's signature (agreement.py) as it is stored for the barrier of epoch `epoch`. */
static int signature(PyObject *agree, unsigned long long epoch, uint64_t w[2]) {
    if (agree == NULL || PyTuple_GET_SIZE(agree) < 2) {
        PyErr_SetString(PyExc_ValueError, "a signature is a tuple (word, count, ...)");
        return -1;
    }
    w[0] = (uint64_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(agree, 0));
    w[1] = (uint64_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(agree, 1));
    if (PyErr_Occurred()) return -1;
    w[0] |= (uint64_t)(epoch & 0xFFFF) << 40;
    return 0;
}

#define MAX_WORDS 1024

/* Spin (the caller has released the GIL) until every one of the n counters is >= value: 1; 0
 * once spin_ns passed first. */
static int spin_until(const uint64_t *const *words, Py_ssize_t n, unsigned long long value,
                      unsigned long long spin_ns) {
    uint64_t end = 0;
    for (unsigned iter = 0;; iter++) {
        Py_ssize_t i = 0;
        while (i < n && __atomic_load_n(words[i], __ATOMIC_ACQUIRE) >= value) i++;
        if (i == n) return 1;
        if ((iter & 63) == 0 || spin_yields) {
            uint64_t t = now_ns();
            if (end == 0) end = t + spin_ns;
            else if (t >= end) return 0;
        }
        spin_turn();
    }
}

static void ring_write(uint8_t *ring, Py_ssize_t cap, unsigned long long pos, const uint8_t *src,
                       Py_ssize_t n) {
    Py_ssize_t off = (Py_ssize_t)(pos % (unsigned long long)cap);
    Py_ssize_t first = n < cap - off ? n : cap - off;
    memcpy(ring + off, src, (size_t)first);
    if (first < n) memcpy(ring, src + first, (size_t)(n - first));
}

static void ring_read(uint8_t *dst, const uint8_t *ring, Py_ssize_t cap, unsigned long long pos,
                      Py_ssize_t n) {
    Py_ssize_t off = (Py_ssize_t)(pos % (unsigned long long)cap);
    Py_ssize_t first = n < cap - off ? n : cap - off;
    memcpy(dst, ring + off, (size_t)first);
    if (first < n) memcpy(dst + first, ring, (size_t)(n - first));
}

#define HEADER 32
#define PADDED(n) (((n) + HEADER - 1) / HEADER * HEADER)

/* The arguments of send and take: a lane (ring_address, ring_bytes, peer_word, own_word, bell):
 * the byte ring, the peer's counter (send: how far the receiver consumed; take: how far the
 * sender sent), the counter this rank publishes its new position in, and the peer's doorbell;
 * then the stream position, the message's tag and dtype code, and its data. */
typedef struct {
    uint8_t *ring;
    Py_ssize_t cap;
    Py_buffer data;
    unsigned long long pos;
    long long tag, code;
    const uint64_t *peer;
    void *word, *bell;
} Message;

static int parse_message(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int flags,
                         Message *m) {
    if (nargs != want || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 5) {
        PyErr_SetString(PyExc_TypeError, "send(lane, pos, tag, code, data) or take(lane, pos, "
                                         "tag, code, data, spin_ns): lane is a tuple of 5");
        return -1;
    }
    PyObject *lane = args[0];
    void *ring;
    if (address(PyTuple_GET_ITEM(lane, 0), &ring) < 0
        || address(PyTuple_GET_ITEM(lane, 2), (void **)&m->peer) < 0
        || address(PyTuple_GET_ITEM(lane, 3), &m->word) < 0
        || address(PyTuple_GET_ITEM(lane, 4), &m->bell) < 0)
        return -1;
    m->ring = ring;
    m->cap = PyLong_AsSsize_t(PyTuple_GET_ITEM(lane, 1));
    m->pos = PyLong_AsUnsignedLongLong(args[1]);
    m->tag = PyLong_AsLongLong(args[2]);
    m->code = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return -1;
    if (m->cap < HEADER || m->cap % HEADER != 0) {
        PyErr_SetString(PyExc_ValueError, "the ring's size is not a multiple of 32 bytes");
        return -1;
    }
    return PyObject_GetBuffer(args[4], &m->data, flags);
}

enum { PARTIAL, WHOLE, NOT_OURS };

/* Whether the message at m->pos is all there (its sender's counter has passed pos + total) and
 * is the one m expects (tag, size, dtype code). */
static int message_state(const Message *m, unsigned long long total) {
    unsigned long long available = __atomic_load_n(m->peer, __ATOMIC_ACQUIRE) - m->pos;
    if (available < HEADER) return PARTIAL;
    int64_t header[4];
    ring_read((uint8_t *)header, m->ring, m->cap, m->pos, HEADER);
    if (header[0] != m->tag || header[1] != (int64_t)m->data.len || header[2] != m->code)
        return NOT_OURS;
    return available >= total ? WHOLE : PARTIAL;
}

/* If `moved`: publish pos + total (release) and ring the peer. Release the data's buffer.
 * Returns the new position, or 0 when nothing moved (positions of moved messages are > 0). */
static PyObject *finish_message(Message *m, int moved, unsigned long long total) {
    if (moved) {
        __atomic_store_n((uint64_t *)m->word, m->pos + total, __ATOMIC_RELEASE);
        sem_post((sem_t *)m->bell);
    }
    PyBuffer_Release(&m->data);
    return PyLong_FromUnsignedLongLong(moved ? m->pos + total : 0);
}

/* send(lane, pos, tag, code, src) -> new position or 0: write a whole message (header and data)
 * at stream position pos of the byte ring, publish pos + its length in the lane's own counter
 * (release) and ring the receiver's bell; 0, writing nothing, when it needs more than the ring
 * has free (the receiver's counter says how much it has read): the caller queues it and
 * streams it in pieces. */
static PyObject *send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Message m;
    if (parse_message(args, nargs, 5, PyBUF_C_CONTIGUOUS, &m) < 0) return NULL;
    unsigned long long total = HEADER + PADDED((unsigned long long)m.data.len);
    unsigned long long used = m.pos - __atomic_load_n(m.peer, __ATOMIC_ACQUIRE);
    int fits = total + used <= (unsigned long long)m.cap;
    if (fits) {
        int64_t header[4] = {m.tag, (int64_t)m.data.len, m.code, 0};
        ring_write(m.ring, m.cap, m.pos, (const uint8_t *)header, HEADER);
        ring_write(m.ring, m.cap, m.pos + HEADER, m.data.buf, m.data.len);
    }
    return finish_message(&m, fits, total);
}

/* take(lane, pos, tag, code, dst, spin_ns) -> new position or 0: if the message at stream
 * position pos of the byte ring is whole (the sender's counter has passed it) and has this tag,
 * dtype code and dst's size, copy its data into dst, publish pos + its length in the lane's own
 * counter (release) and ring the sender's bell. While it is not all there, spin up to spin_ns
 * without the GIL (0: look once). Else (another tag, a mismatch, still not there, larger than
 * the ring) change nothing and return 0: the caller reads it the general way. */
static PyObject *take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Message m;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "take(lane, pos, tag, code, dst, spin_ns)");
        return NULL;
    }
    unsigned long long spin_ns = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred() || parse_message(args, 5, 5, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS,
                                          &m) < 0)
        return NULL;
    unsigned long long total = HEADER + PADDED((unsigned long long)m.data.len);
    int state = total <= (unsigned long long)m.cap ? message_state(&m, total) : NOT_OURS;
    if (state == PARTIAL && spin_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        uint64_t end = now_ns() + spin_ns;
        for (unsigned iter = 1; state == PARTIAL; iter++) {
            spin_turn();
            state = message_state(&m, total);
            if (((iter & 63) == 0 || spin_yields) && now_ns() >= end) break;
        }
        Py_END_ALLOW_THREADS
    }
    if (state == WHOLE) ring_read(m.data.buf, m.ring, m.cap, m.pos + HEADER, m.data.len);
    return finish_message(&m, state == WHOLE, total);
}

/* ---- reductions ------------------------------------------------------------------------- */
enum { SUM, PROD, MIN, MAX, AVG, BAND, BOR, BXOR, N_OPS };
enum { F32, F64, I8, I16, I32, I64, U8, U16, U32, U64, N_DTYPES };

/* NumPy's minimum/maximum: a NaN in either operand gives that NaN (the first if both are);
 * between equal values (0.0 and -0.0) the second operand */
#define FMIN(a, b) (((a) != (a) || (a) < (b)) ? (a) : (b))
#define FMAX(a, b) (((a) != (a) || (a) > (b)) ? (a) : (b))
#define IMIN(a, b) ((a) <= (b) ? (a) : (b))
#define IMAX(a, b) ((a) >= (b) ? (a) : (b))

#define LOOP(T, EXPR)                                                               \
    for (Py_ssize_t j = 1; j < nsrc; j++) {                                         \
        const T *b = (const T *)srcs[j];                                            \
        const T *a = j == 1 ? (const T *)srcs[0] : (const T *)out;                  \
        T *o = (T *)out;                                                            \
        for (Py_ssize_t i = 0; i < count; i++) o[i] = (T)(EXPR);                     \
    }

#define FLOAT_CASES(T)                                                              \
    switch (op) {                                                                   \
    case SUM: case AVG: LOOP(T, a[i] + b[i]) break;                                 \
    case PROD: LOOP(T, a[i] * b[i]) break;                                          \
    case MIN: LOOP(T, FMIN(a[i], b[i])) break;                                      \
    case MAX: LOOP(T, FMAX(a[i], b[i])) break;                                      \
    default: return 0;                                                              \
    }                                                                               \
    if (op == AVG) {                                                                \
        T *o = (T *)out;                                                            \
        for (Py_ssize_t i = 0; i < count; i++) o[i] = o[i] / (T)divisor;            \
    }                                                                               \
    return 1;

/* integers wrap on overflow as NumPy's do: sums and products in the unsigned type U */
#define INT_CASES(T, U)                                                             \
    switch (op) {                                                                   \
    case SUM: LOOP(T, (U)a[i] + (U)b[i]) break;                                     \
    case PROD: LOOP(T, (U)a[i] * (U)b[i]) break;                                    \
    case MIN: LOOP(T, IMIN(a[i], b[i])) break;                                      \
    case MAX: LOOP(T, IMAX(a[i], b[i])) break;                                      \
    case BAND: LOOP(T, a[i] & b[i]) break;                                          \
    case BOR: LOOP(T, a[i] | b[i]) break;                                           \
    case BXOR: LOOP(T, a[i] ^ b[i]) break;                                          \
    default: return 0;                                                              \
    }                                                                               \
    return 1;

static int reduce_into(void *out, void *const *srcs, Py_ssize_t nsrc, Py_ssize_t count,
                       int dtype, int op, long divisor) {
    switch (dtype) {
    case F32: { FLOAT_CASES(float) }
    case F64: { FLOAT_CASES(double) }
    case I8: { INT_CASES(int8_t, uint8_t) }
    case I16: { INT_CASES(int16_t, uint16_t) }
    case I32: { INT_CASES(int32_t, uint32_t) }
    case I64: { INT_CASES(int64_t, uint64_t) }
    case U8: { INT_CASES(uint8_t, uint8_t) }
    case U16: { INT_CASES(uint16_t, uint16_t) }
    case U32: { INT_CASES(uint32_t, uint32_t) }
    case U64: { INT_CASES(uint64_t, uint64_t) }
    }
    return 0;
}

/* ---- the mpi backend's agreement envelope (mpi.py: Envelope) ------------------------------
 * An MPI user function (MPI_User_function) over envelopes of ENVELOPE_BYTES: int64 words
 * (agreement word, count, code, status), then data. Where the two envelopes' word, count or code
 * differ, or either's status is set, the result's status is 1 (the ranks disagree) and its data
 * is left; else, where code >= 0, the result's data = both data reduced (code: dtype * N_OPS +
 * op, `count` elements that fit the data area; anything else is a disagreement too). Commutative,
 * and associative as the reduction is: a status once set stays set. */
#define ENVELOPE_BYTES 96
#define ENVELOPE_WORDS 4
#define ENVELOPE_ROOM (ENVELOPE_BYTES - 8 * ENVELOPE_WORDS)   /* the data's bytes at most */
static const Py_ssize_t envelope_item[N_DTYPES] = {4, 8, 1, 2, 4, 8, 1, 2, 4, 8};

void anyccl_envelope_op(void *in, void *inout, int *len, void *datatype) {
    (void)datatype;
    for (int i = 0; i < *len; i++) {
        const int64_t *a = (const int64_t *)((const char *)in + (size_t)i * ENVELOPE_BYTES);
        int64_t *b = (int64_t *)((char *)inout + (size_t)i * ENVELOPE_BYTES);
        if (a[0] != b[0] || a[1] != b[1] || a[2] != b[2] || a[3] || b[3]) {
            b[3] = 1;
            continue;
        }
        if (b[2] < 0) continue;   /* a signature alone */
        int64_t dtype = b[2] / N_OPS, op = b[2] % N_OPS, count = b[1];
        if (dtype >= N_DTYPES || op == AVG || count < 0
            || count * envelope_item[dtype] > ENVELOPE_ROOM) {
            b[3] = 1;
            continue;
        }
        void *srcs[2] = {b + ENVELOPE_WORDS, (void *)(a + ENVELOPE_WORDS)};
        if (!reduce_into(b + ENVELOPE_WORDS, srcs, 2, (Py_ssize_t)count, (int)dtype, (int)op, 1))
            b[3] = 1;
    }
}

static PyObject *reduce(PyObject *self, PyObject *args) {
    Py_buffer out;
    PyObject *srcs;
    Py_ssize_t count;
    int dtype, op;
    long divisor;
    if (!PyArg_ParseTuple(args, "w*O!niil", &out, &PyTuple_Type, &srcs, &count, &dtype, &op,
                          &divisor))
        return NULL;
    Py_ssize_t nsrc = PyTuple_GET_SIZE(srcs);
    void *addr[MAX_WORDS];
    int ok = 0;
    if (nsrc < 2 || nsrc > MAX_WORDS || dtype < 0 || dtype >= N_DTYPES || op < 0 || op >= N_OPS
        || divisor < 1) {
        PyErr_SetString(PyExc_ValueError, "reduce: bad arguments");
    } else {
        Py_ssize_t i = 0;
        for (; i < nsrc; i++)
            if (address(PyTuple_GET_ITEM(srcs, i), &addr[i]) < 0) break;
        if (i == nsrc) ok = reduce_into(out.buf, addr, nsrc, count, dtype, op, divisor);
    }
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(ok);
}

/* Staging(lanes, doing, half_bytes): one rank's staging halves and barrier epochs, and the
 * one-shot step over them. `lanes` are the four (halves, rank, arrive_word, bells, sig, words,
 * sigs, spin_ns) of staging half h and barrier parity p at 2 * h + p, read once here; `doing` is
 * the address of this rank's "what it does" word. `epoch` and `half` (the last barrier's count,
 * the last staging half used) are the one copy of these counters, which shm.py reads and writes
 * for its other schedules. close() forgets every address: a later call raises. */
typedef struct {
    PyObject_HEAD
    unsigned long long epoch;
    int half;
    int closed;
    Py_ssize_t rank, size, half_bytes;
    unsigned long long spin_ns;
    uint64_t *arrive, *doing;
    uint64_t *sig[2];
    void **at[2];                 /* at[h][j]: rank j's staging half h */
    sem_t **bells;                /* the peers' doorbells */
    const uint64_t **peer;        /* the peers' arrival counters */
    const uint64_t **peer_sig[2]; /* the peers' signature slots, per barrier parity */
    void *block;                  /* the one allocation behind the arrays above */
} Staging;

static int lane_address(PyObject *lane, Py_ssize_t item, void **out) {
    return address(PyTuple_GET_ITEM(lane, item), out);
}

static int tuple_addresses(PyObject *t, Py_ssize_t n, void **out) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n) {
        PyErr_SetString(PyExc_ValueError, "Staging: a lane's tuple has the wrong length");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (address(PyTuple_GET_ITEM(t, i), &out[i]) < 0) return -1;
    return 0;
}

static int staging_init(Staging *self, PyObject *args, PyObject *kwds) {
    PyObject *lanes, *doing;
    Py_ssize_t half_bytes;
    if (!PyArg_ParseTuple(args, "O!On", &PyTuple_Type, &lanes, &doing, &half_bytes)) return -1;
    if (self->block != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Staging: already initialised");
        return -1;
    }
    if (PyTuple_GET_SIZE(lanes) != 4) {
        PyErr_SetString(PyExc_ValueError, "Staging: four lanes (2 * half + parity)");
        return -1;
    }
    for (int k = 0; k < 4; k++) {
        PyObject *lane = PyTuple_GET_ITEM(lanes, k);
        if (!PyTuple_Check(lane) || PyTuple_GET_SIZE(lane) != 8
            || !PyTuple_Check(PyTuple_GET_ITEM(lane, 0))) {
            PyErr_SetString(PyExc_ValueError, "Staging: a lane is a tuple of 8");
            return -1;
        }
    }
    PyObject *first = PyTuple_GET_ITEM(lanes, 0);
    Py_ssize_t size = PyTuple_GET_SIZE(PyTuple_GET_ITEM(first, 0)), n = size - 1;
    Py_ssize_t rank = PyLong_AsSsize_t(PyTuple_GET_ITEM(first, 1));
    unsigned long long spin_ns = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(first, 7));
    if (PyErr_Occurred()) return -1;
    if (size < 2 || size > MAX_WORDS || rank < 0 || rank >= size || half_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "Staging: bad rank, size or half_bytes");
        return -1;
    }
    void **block = PyMem_Calloc((size_t)(2 * size + 4 * n), sizeof(void *));
    if (block == NULL) { PyErr_NoMemory(); return -1; }
    self->block = block;
    self->at[0] = block;
    self->at[1] = block + size;
    self->bells = (sem_t **)(block + 2 * size);
    self->peer = (const uint64_t **)(block + 2 * size + n);
    self->peer_sig[0] = (const uint64_t **)(block + 2 * size + 2 * n);
    self->peer_sig[1] = (const uint64_t **)(block + 2 * size + 3 * n);
    for (int h = 0; h < 2; h++) {
        PyObject *lane = PyTuple_GET_ITEM(lanes, 2 * h);
        if (tuple_addresses(PyTuple_GET_ITEM(lane, 0), size, self->at[h]) < 0) return -1;
    }
    for (int p = 0; p < 2; p++) {
        PyObject *lane = PyTuple_GET_ITEM(lanes, p);
        if (lane_address(lane, 4, (void **)&self->sig[p]) < 0
            || tuple_addresses(PyTuple_GET_ITEM(lane, 6), n, (void **)self->peer_sig[p]) < 0)
            return -1;
    }
    if (lane_address(first, 2, (void **)&self->arrive) < 0
        || tuple_addresses(PyTuple_GET_ITEM(first, 3), n, (void **)self->bells) < 0
        || tuple_addresses(PyTuple_GET_ITEM(first, 5), n, (void **)self->peer) < 0
        || address(doing, (void **)&self->doing) < 0)
        return -1;
    self->rank = rank;
    self->size = size;
    self->half_bytes = half_bytes;
    self->spin_ns = spin_ns;
    self->epoch = 0;
    self->half = 1;
    return 0;
}

static void staging_dealloc(Staging *self) {
    PyMem_Free(self->block);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *staging_close(Staging *self, PyObject *unused) {
    self->closed = 1;
    Py_RETURN_NONE;
}

/* one_shot(x, doing, agree, dtype, op, reduce_here, source) -> 1, 0 or -1: a small collective's
 * whole schedule in one call (a message of at most half_bytes). Takes the next staging half and
 * epoch; stores `doing` as what this rank does; source < 0 (all_reduce, reduce): stages x in
 * this rank's half, arrives (with the signature `agree`, unless it is None, in the slot of the
 * epoch's parity), spins as `reached` does, then, if every rank arrived with the same signature
 * and reduce_here, reduces the staged halves in rank order into x as `reduce` does. source >= 0
 * (broadcast from that rank): only the source stages x; once every rank arrived with the same
 * signature, the others copy its half into x.
 * 1: done, and `doing` is stored again as finished (its low bit cleared); -1: every rank arrived
 * and a signature differs (x untouched); 0: arrived, but the peers had not within spin_ns (the
 * caller waits, compares, then reduces or copies, from half `half` of barrier `epoch`). */
/* Arrive at barrier `epoch` (with the signature `w` in the slot of its parity, unless w is
 * NULL) and ring every peer's doorbell, then spin without the GIL until every peer arrived:
 * 1; -1 if then a peer's signature differs; 0 if they had not within spin_ns. */
static long arrive_and_spin(Staging *self, unsigned long long epoch, const uint64_t *w) {
    int parity = (int)(epoch & 1);
    Py_ssize_t n = self->size - 1;
    if (w != NULL) {   /* published by the release store of the counter below */
        self->sig[parity][0] = w[0];
        self->sig[parity][1] = w[1];
    }
    __atomic_store_n(self->arrive, (uint64_t)epoch, __ATOMIC_RELEASE);
    for (Py_ssize_t i = 0; i < n; i++) sem_post(self->bells[i]);
    int done;
    unsigned long long spin_ns = self->spin_ns;
    const uint64_t **peer = self->peer;
    Py_BEGIN_ALLOW_THREADS
    done = spin_until(peer, n, epoch, spin_ns);
    Py_END_ALLOW_THREADS
    if (done && w != NULL)   /* the counters' acquire loads made the signatures visible */
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint64_t *s = self->peer_sig[parity][i];
            if (s[0] != w[0] || s[1] != w[1]) return -1;
        }
    return done;
}

static int staging_open(Staging *self, const char *what) {
    if (self->closed || self->block == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: the staging memory is closed", what);
        return -1;
    }
    return 0;
}

/* sync(agree) -> 1, 0 or -1: the next barrier: arrive (with the signature `agree`, unless it is
 * None), spin, compare, as one_shot does without data. */
static PyObject *staging_sync(Staging *self, PyObject *agree) {
    if (staging_open(self, "sync") < 0) return NULL;
    uint64_t w[2];
    unsigned long long epoch = self->epoch + 1;
    if (agree != Py_None) {
        if (!PyTuple_Check(agree)) {
            PyErr_SetString(PyExc_ValueError, "sync: a signature is a tuple or None");
            return NULL;
        }
        if (signature(agree, epoch, w) < 0) return NULL;
    }
    self->epoch = epoch;
    return PyLong_FromLong(arrive_and_spin(self, epoch, agree == Py_None ? NULL : w));
}

static PyObject *staging_one_shot(Staging *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "one_shot(x, doing, agree, dtype, op, reduce_here, "
                                         "source[, gathered])");
        return NULL;
    }
    PyObject *gathered = nargs == 8 && args[7] != Py_None ? args[7] : NULL;
    if (staging_open(self, "one_shot") < 0) return NULL;
    PyObject *agree = args[2] == Py_None ? NULL : args[2];
    unsigned long long doing = PyLong_AsUnsignedLongLong(args[1]);
    int dtype = (int)PyLong_AsLong(args[3]), op = (int)PyLong_AsLong(args[4]);
    int reduce_here = PyObject_IsTrue(args[5]);
    Py_ssize_t source = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t rank = self->rank, size = self->size;
    if (source >= size || (agree != NULL && !PyTuple_Check(agree))) {
        PyErr_SetString(PyExc_ValueError, "one_shot: bad source or signature");
        return NULL;
    }
    uint64_t w[2] = {0, 0};
    unsigned long long epoch = self->epoch + 1;
    if (agree != NULL && signature(agree, epoch, w) < 0) return NULL;
    Py_buffer x;
    if (PyObject_GetBuffer(args[0], &x, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (x.len > self->half_bytes) {
        PyBuffer_Release(&x);
        PyErr_SetString(PyExc_ValueError, "one_shot: the array is larger than a staging half");
        return NULL;
    }
    Py_buffer g = {0};
    if (gathered != NULL) {
        if (PyObject_GetBuffer(gathered, &g, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&x);
            return NULL;
        }
        if (g.len != x.len * size) {
            PyBuffer_Release(&g);
            PyBuffer_Release(&x);
            PyErr_SetString(PyExc_ValueError, "one_shot: gathered must hold size x the array");
            return NULL;
        }
    }
    int half = self->half ^ 1;
    self->half = half;
    self->epoch = epoch;
    void **at = self->at[half];
    __atomic_store_n(self->doing, (uint64_t)doing, __ATOMIC_RELAXED);
    if (source < 0 || source == rank) memcpy(at[rank], x.buf, (size_t)x.len);
    long status = arrive_and_spin(self, epoch, agree == NULL ? NULL : w);
    if (status == 1 && gathered != NULL) {   /* every rank's piece, in rank order */
        for (Py_ssize_t j = 0; j < size; j++) {
            char *to = (char *)g.buf + j * x.len;
            if (to != (char *)x.buf) memcpy(to, at[j], (size_t)x.len);
        }
    } else if (status == 1 && source >= 0) {
        if (source != rank) memcpy(x.buf, at[source], (size_t)x.len);
    } else if (status == 1 && reduce_here
               && !reduce_into(x.buf, at, size, x.len / (x.itemsize ? x.itemsize : 1), dtype, op,
                               (long)size)) {
        PyErr_SetString(PyExc_ValueError, "one_shot: a dtype and op the core does not reduce");
    }
    PyBuffer_Release(&x);
    if (gathered != NULL) PyBuffer_Release(&g);
    if (PyErr_Occurred()) return NULL;
    if (status == 1) __atomic_store_n(self->doing, (uint64_t)(doing & ~1ull), __ATOMIC_RELAXED);
    return PyLong_FromLong(status);
}

static PyMethodDef staging_methods[] = {
    {"one_shot", (PyCFunction)(void (*)(void))staging_one_shot, METH_FASTCALL,
     "one_shot(x, doing, agree, dtype, op, reduce_here, source[, gathered]) -> 1 done, 0 peers "
     "not there yet, -1 signatures differ. gathered: a buffer of size x the array that "
     "receives every rank's piece in rank order (all_gather) once done."},
    {"sync", (PyCFunction)staging_sync, METH_O,
     "sync(agree) -> 1 every rank arrived, 0 not within the spin, -1 signatures differ."},
    {"close", (PyCFunction)staging_close, METH_NOARGS,
     "close(): forget the addresses (the mappings are going); a later one_shot raises."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef staging_members[] = {
    {"epoch", T_ULONGLONG, offsetof(Staging, epoch), 0, "the last barrier's count"},
    {"half", T_INT, offsetof(Staging, half), 0, "the staging half used last (0 or 1)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject StagingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "anyccl.backends._shmcore.Staging",
    .tp_basicsize = sizeof(Staging),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Staging(lanes, doing, half_bytes): staging halves, barrier epochs, one-shot step",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)staging_init,
    .tp_dealloc = (destructor)staging_dealloc,
    .tp_methods = staging_methods,
    .tp_members = staging_members,
};

/* ---- MpiStep: the mpi backend's small all_reduce inside its agreement's envelope ------------
 * MpiStep(start, test, handle, out, into, rank, size, spin_ns, yields): the addresses of the
 * MPI library's MPI_Start and MPI_Test, the persistent request's handle (the bytes of an
 * MPI_Request), the envelope sent and the one received (ENVELOPE_BYTES each, writable buffers
 * this object keeps), this rank and the number of ranks, how long a wait spins, whether each
 * turn yields the core. `hot` runs it in place of the shm core's step where ctx's staging is
 * one: it fills the envelope (the signature's words, the data: an all_reduce's array; a
 * broadcast's at the root, zeros elsewhere; an all_gather's at this rank's place, zeros
 * elsewhere, the last two reduced by bitwise OR over bytes, as the backend's `_carry_bytes`),
 * starts the request and tests it for spin_ns.
 * Status: 1 done (the result in x or out, AVG divided), 2 the signatures differed (nothing
 * written), 0
 * started but not done within the spin (the caller's Python completes it), 3 an MPI call
 * failed (not started, or no longer known). The MPI library's own threads and error handler
 * are not touched: the request is the one the backend's Python also starts and tests.
 *
 * With `calls` (the addresses of MPI_Iallreduce, MPI_Ibcast and MPI_Iallgather, the handles of
 * the communicator and of MPI_BYTE, and the largest x it takes, data_max), a collective too
 * large for the envelope runs here too: the envelope carries its signature alone (code -1, as
 * the backend's start_agreement fills it), and once every rank agreed, the data call is started
 * on the data request and tested for the spin. Its buffers never alias and nothing is copied
 * aside: an all_reduce runs in place on x (MPI_IN_PLACE, whose address the caller passes last
 * in `calls`: it differs between MPI libraries); an all_gather whose x lies in out moves it to
 * its own piece first (if it is not there) and runs in place. Status 4: the data call started, not done within the spin (the caller's Python
 * completes the request `data_request` names); 0 then means the envelope was not back, the
 * data call not started. Handles are passed as the integers mpi4py gives (an int in MPICH's
 * ABI, a pointer in Open MPI's: both travel in one integer register or stack word). */
enum { HOT_ALL_REDUCE, HOT_BROADCAST, HOT_ALL_GATHER };   /* Backend.HOT_KINDS, in order */

#define MPI_TAG_CODES 16   /* mpi.py's _CODES: the low 4 bits of an MPI tag name the dtype */

typedef int (*mpi_start_fn)(void *request);
typedef int (*mpi_test_fn)(void *request, int *flag, void *status);
typedef int (*mpi_iallreduce_fn)(const void *send, void *recv, int count, uintptr_t datatype,
                                 uintptr_t op, uintptr_t comm, void *request);
typedef int (*mpi_ibcast_fn)(void *buffer, int count, uintptr_t datatype, int root,
                             uintptr_t comm, void *request);
typedef int (*mpi_iallgather_fn)(const void *send, int send_count, uintptr_t send_type,
                                 void *recv, int recv_count, uintptr_t recv_type, uintptr_t comm,
                                 void *request);
typedef int (*mpi_isend_fn)(const void *buf, int count, uintptr_t datatype, int dest, int tag,
                            uintptr_t comm, void *request);
typedef int (*mpi_irecv_fn)(void *buf, int count, uintptr_t datatype, int source, int tag,
                            uintptr_t comm, void *request);
typedef int (*mpi_cancel_fn)(void *request);
typedef int (*mpi_wait_fn)(void *request, void *status);
typedef int (*mpi_test_cancelled_fn)(const void *status, int *flag);
typedef int (*mpi_get_count_fn)(const void *status, uintptr_t datatype, int *count);

typedef struct {
    PyObject_HEAD
    mpi_start_fn start;
    mpi_test_fn test;
    unsigned char request[16];       /* the MPI_Request (4 or 8 bytes, the rest zero) */
    unsigned char status[512];       /* an MPI_Status, written by MPI_Test, never read */
    int64_t *out, *into;             /* the envelopes (8-byte aligned: NumPy's allocations) */
    PyObject *keep;                  /* (out, into) */
    Py_ssize_t rank, size;
    long long bytes_code;            /* the envelope's code of bitwise OR over bytes */
    unsigned long long spin_ns, starts;
    int yields;
    /* the data calls (NULL: only what fits the envelope runs here) */
    mpi_iallreduce_fn iallreduce;
    mpi_ibcast_fn ibcast;
    mpi_iallgather_fn iallgather;
    uintptr_t comm, byte;
    Py_ssize_t data_max, request_len;
    void *in_place;                  /* the MPI library's MPI_IN_PLACE */
    unsigned char data_request[16];  /* the data call's MPI_Request */
    unsigned long long data_starts;
    /* a sendrecv's messages (NULL: sendrecv takes the Python path) */
    mpi_isend_fn isend;
    mpi_irecv_fn irecv;
    mpi_cancel_fn cancel;
    mpi_wait_fn wait;
    mpi_test_cancelled_fn test_cancelled;
    mpi_get_count_fn get_count;
    unsigned char send_request[16], recv_request[16];
    unsigned char recv_status[512];
    unsigned long long exchanges;
    Py_ssize_t exchange_max;         /* the largest message a sendrecv posts here */
    long long tag_limit;             /* the backend's tags are below this (MPI's TAG_UB) */
    PyObject *sendbuf;               /* a bytearray: the copy a sendrecv's send leaves from,
                                        reused while no send handed over to Python holds it */
} MpiStep;

static int mpi_step_init(MpiStep *self, PyObject *args, PyObject *kwds) {
    unsigned long long start, test, spin_ns;
    Py_buffer handle, out, into;
    Py_ssize_t rank, size;
    int yields;
    PyObject *calls = Py_None, *messages = Py_None;
    unsigned long long iallreduce = 0, ibcast = 0, iallgather = 0, comm = 0, byte = 0;
    unsigned long long in_place = 0;
    unsigned long long isend = 0, irecv = 0, cancel = 0, wait = 0, test_cancelled = 0,
                       get_count = 0;
    Py_ssize_t exchange_max = 0, data_max = 0;
    long long tag_limit = 0;
    (void)kwds;
    if (!PyArg_ParseTuple(args, "KKy*w*w*nnKp|OO", &start, &test, &handle, &out, &into, &rank,
                          &size, &spin_ns, &yields, &calls, &messages))
        return -1;
    if (messages != Py_None
        && (!PyTuple_Check(messages)
            || !PyArg_ParseTuple(messages, "KKKKKKnL", &isend, &irecv, &cancel, &wait,
                                 &test_cancelled, &get_count, &exchange_max, &tag_limit)
            || exchange_max < 0 || exchange_max > INT_MAX || tag_limit < 0
            || tag_limit > ((long long)INT_MAX + 1) / MPI_TAG_CODES   /* tag * 16 + 15 fits */
            || !isend || !irecv || !cancel || !wait || !test_cancelled || !get_count)) {
        PyErr_Clear();
        data_max = -1;   /* reported as bad arguments below */
    }
    if (data_max >= 0 && calls != Py_None
        && (!PyTuple_Check(calls)
            || !PyArg_ParseTuple(calls, "KKKKKnK", &iallreduce, &ibcast, &iallgather, &comm,
                                 &byte, &data_max, &in_place)
            || iallreduce == 0 || ibcast == 0 || iallgather == 0 || data_max < 1
            || data_max > INT_MAX)) {
        PyErr_Clear();
        data_max = -1;   /* reported as bad arguments below */
    }
    int bad = handle.len < 1 || handle.len > (Py_ssize_t)sizeof(self->request)
              || out.len != ENVELOPE_BYTES || into.len != ENVELOPE_BYTES || size < 2
              || rank < 0 || rank >= size
              || start == 0 || test == 0 || ((uintptr_t)out.buf | (uintptr_t)into.buf) % 8
              || data_max < 0;
    if (!bad) {
        self->in_place = (void *)(uintptr_t)in_place;
        self->iallreduce = (mpi_iallreduce_fn)(uintptr_t)iallreduce;
        self->ibcast = (mpi_ibcast_fn)(uintptr_t)ibcast;
        self->iallgather = (mpi_iallgather_fn)(uintptr_t)iallgather;
        self->comm = (uintptr_t)comm;
        self->byte = (uintptr_t)byte;
        self->data_max = data_max;
        self->request_len = handle.len;
        self->data_starts = 0;
        memset(self->data_request, 0, sizeof(self->data_request));
        self->isend = (mpi_isend_fn)(uintptr_t)isend;
        self->irecv = (mpi_irecv_fn)(uintptr_t)irecv;
        self->cancel = (mpi_cancel_fn)(uintptr_t)cancel;
        self->wait = (mpi_wait_fn)(uintptr_t)wait;
        self->test_cancelled = (mpi_test_cancelled_fn)(uintptr_t)test_cancelled;
        self->get_count = (mpi_get_count_fn)(uintptr_t)get_count;
        self->exchanges = 0;
        self->exchange_max = exchange_max;
        self->tag_limit = tag_limit;
        Py_CLEAR(self->sendbuf);
        memset(self->request, 0, sizeof(self->request));
        memcpy(self->request, handle.buf, (size_t)handle.len);
        self->start = (mpi_start_fn)(uintptr_t)start;
        self->test = (mpi_test_fn)(uintptr_t)test;
        self->out = (int64_t *)out.buf;
        self->into = (int64_t *)into.buf;
        self->rank = rank;
        self->size = size;
        self->bytes_code = (long long)U8 * N_OPS + BOR;
        self->spin_ns = spin_ns;
        self->yields = yields;
        self->starts = 0;
        Py_XSETREF(self->keep, PyTuple_Pack(2, out.obj, into.obj));
    }
    PyBuffer_Release(&handle);
    PyBuffer_Release(&out);
    PyBuffer_Release(&into);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "MpiStep: bad arguments");
        return -1;
    }
    return self->keep == NULL ? -1 : 0;
}

static void mpi_step_dealloc(MpiStep *self) {
    Py_XDECREF(self->sendbuf);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef mpi_step_members[] = {
    {"starts", T_ULONGLONG, offsetof(MpiStep, starts), READONLY,
     "envelopes started here (the step's own count)"},
    {"data_starts", T_ULONGLONG, offsetof(MpiStep, data_starts), READONLY,
     "data calls started here, after an envelope that carried the signature alone"},
    {"exchanges", T_ULONGLONG, offsetof(MpiStep, exchanges), READONLY,
     "sendrecvs whose messages were posted here"},
    {"data_max", T_PYSSIZET, offsetof(MpiStep, data_max), READONLY,
     "the largest x whose data call runs here (0: none, only what fits the envelope)"},
    {NULL, 0, 0, 0, NULL},
};

/* The handle in `bytes` (an MPI_Request as the MPI library wrote it) as an integer. */
static PyObject *request_handle(MpiStep *self, const unsigned char *bytes) {
    uint64_t wide = 0;
    uint32_t narrow = 0;
    if (self->request_len == 4) {
        memcpy(&narrow, bytes, 4);
        wide = narrow;
    } else {
        memcpy(&wide, bytes, sizeof(wide));
    }
    return PyLong_FromUnsignedLongLong(wide);
}

static PyObject *mpi_step_data_request(MpiStep *self, PyObject *unused) {
    (void)unused;
    return request_handle(self, self->data_request);
}

static PyMethodDef mpi_step_methods[] = {
    {"data_request", (PyCFunction)mpi_step_data_request, METH_NOARGS,
     "the handle of the data call's request (status 4: started, not done), as an integer"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MpiStepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "anyccl.backends._shmcore.MpiStep",
    .tp_basicsize = sizeof(MpiStep),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "MpiStep(start, test, handle, out, into, rank, size, spin_ns, yields): the mpi "
              "backend's small collectives in its agreement's envelope, for hot()",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mpi_step_init,
    .tp_dealloc = (destructor)mpi_step_dealloc,
    .tp_members = mpi_step_members,
    .tp_methods = mpi_step_methods,
};

/* Test `request` until done or spin_ns passed: 1 done, 0 not yet, 3 MPI_Test failed. */
static long mpi_step_wait(MpiStep *m, void *request) {
    int flag = 0;
    uint64_t until = now_ns() + m->spin_ns;
    while (1) {
        if (m->test(request, &flag, m->status) != 0) return 3;
        if (flag) return 1;
        if (now_ns() >= until) return 0;
        if (m->yields) sched_yield();
    }
}

/* The data call of a collective whose data did not fit the envelope, once every rank agreed:
 * started on the data request, then tested for the spin (1 done, 4 not yet, 3 MPI failed). */
static long mpi_step_data(MpiStep *m, int kind, char *x, char *whole, Py_ssize_t nbytes,
                          Py_ssize_t count, uintptr_t datatype, uintptr_t op, long root) {
    int rc;
    void *request = m->data_request;
    if (kind == HOT_ALL_REDUCE) {
        rc = m->iallreduce(m->in_place, x, (int)count, datatype, op, m->comm, request);
    } else if (kind == HOT_BROADCAST) {
        rc = m->ibcast(x, (int)nbytes, m->byte, (int)root, m->comm, request);
    } else {
        const void *send = x;
        Py_ssize_t span = nbytes * m->size;
        if (x + nbytes > whole && whole + span > x) {   /* x lies in out: its own piece */
            if (x != whole + m->rank * nbytes) memmove(whole + m->rank * nbytes, x, (size_t)nbytes);
            send = m->in_place;
        }
        rc = m->iallgather(send, (int)nbytes, m->byte, whole, (int)nbytes, m->byte, m->comm,
                           request);
    }
    if (rc != 0) return 3;
    m->data_starts++;
    long st = mpi_step_wait(m, request);
    return st == 0 ? 4 : st;
}

/* One collective of `kind`: x (nbytes); an all_reduce with signature (word, count) and the
 * core's (dtype, op) codes, `divide` an AVG of floats, divided by the ranks after, and the
 * MPI datatype and op its data call takes; a broadcast from `root`; an all_gather into `out`
 * (size * nbytes). In the envelope where it fits; else the envelope with its signature, then
 * the data call (the caller has checked that it is at most data_max). */
static long mpi_step_run(MpiStep *m, int kind, PyObject *x, PyObject *out, Py_ssize_t nbytes,
                         long long word, Py_ssize_t count, long long dtype, long long op,
                         int divide, long root, uintptr_t mpi_type, uintptr_t mpi_op) {
    const Py_ssize_t head = 8 * ENVELOPE_WORDS;
    Py_ssize_t span = kind == HOT_ALL_GATHER ? nbytes * m->size : nbytes;
    int carried = span <= ENVELOPE_ROOM;
    if ((!carried && nbytes > m->data_max)   /* data_max 0: no data calls here */
        || (kind == HOT_ALL_REDUCE && (dtype < 0 || dtype >= N_DTYPES)))
        return 3;
    Py_buffer view, whole;
    if (PyObject_GetBuffer(x, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (kind == HOT_ALL_GATHER
        && PyObject_GetBuffer(out, &whole, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&view);
        return -1;
    }
    char *data = (char *)m->out + head;
    m->out[0] = word;
    if (!carried) {   /* the signature alone: word, count, code -1 (start_agreement's) */
        m->out[1] = count;
        m->out[2] = -1;
    } else if (kind == HOT_ALL_REDUCE) {
        m->out[1] = count;
        m->out[2] = dtype * N_OPS + op;
        memcpy(data, view.buf, (size_t)nbytes);
    } else {   /* the bytes' places: zero but this rank's */
        m->out[1] = span;
        m->out[2] = m->bytes_code;
        memset(data, 0, (size_t)span);
        if (kind == HOT_ALL_GATHER)
            memcpy(data + m->rank * nbytes, view.buf, (size_t)nbytes);
        else if (root == m->rank)
            memcpy(data, view.buf, (size_t)nbytes);
    }
    m->out[3] = 0;
    long status = 3;
    if (m->start(m->request) == 0) {
        m->starts++;
        status = mpi_step_wait(m, m->request);
        if (status == 1 && m->into[3]) status = 2;
    }
    if (status == 1 && !carried) {
        status = mpi_step_data(m, kind, (char *)view.buf,
                               kind == HOT_ALL_GATHER ? (char *)whole.buf : NULL, nbytes, count,
                               mpi_type, mpi_op, root);
    } else if (status == 1) {
        const char *got = (const char *)m->into + head;
        if (kind == HOT_ALL_GATHER) {
            memcpy(whole.buf, got, (size_t)span);
        } else if (kind == HOT_BROADCAST) {
            if (root != m->rank) memcpy(view.buf, got, (size_t)nbytes);
        } else {
            memcpy(view.buf, got, (size_t)nbytes);
        }
    }
    if (status == 1 && kind == HOT_ALL_REDUCE && divide) {
        if (dtype == F32) {
            float *o = (float *)view.buf;
            for (Py_ssize_t i = 0; i < count; i++) o[i] = o[i] / (float)m->size;
        } else if (dtype == F64) {
            double *o = (double *)view.buf;
            for (Py_ssize_t i = 0; i < count; i++) o[i] = o[i] / (double)m->size;
        }
    }
    if (kind == HOT_ALL_GATHER) PyBuffer_Release(&whole);
    PyBuffer_Release(&view);
    return status;
}

/* ---- hot(ctx, comm, kind, x, arg): a blocking small collective on a NumPy array, whole ------
 * What Communicator.all_reduce / .broadcast / .all_gather, HostEngine.collective and _run,
 * and ShmBackend's hot path (_core_step) do for the common call, in one call: the checks that
 * select it, the sequence number, the op record (logged, its signature, started, done), the
 * backend's marks and the core's one-shot step (all_gather: into one output array). Returns x when done; None when the call is not that common
 * case (nothing was done: the caller takes the full path); raises what the operation raised,
 * after the engine's failure handling (ctx's `failed`). ctx: shm.ShmBackend.hot_context, or
 * mpi.MpiBackend.hot_context, whose staging is an MpiStep: the envelope in place of the
 * core's step. */
enum {
    HOT_ENGINE, HOT_BACKEND, HOT_STAGING, HOT_LOG, HOT_RECORD, HOT_ABOUT, HOT_DTYPE_BITS,
    HOT_REDUCTIONS, HOT_NDARRAY, HOT_REDUCEOP, HOT_TIMEOUT, HOT_MAX_BYTES, HOT_KINDS, HOT_REST,
    HOT_FAILED, HOT_SIZE
};
enum { KIND_NAME, KIND_BITS, KIND_DOING, KIND_MORE, KIND_DIRECT_MIN, KIND_SIZE };

static PyObject *h_closed, *h_debug, *h_check, *h_staged, *h_seq, *h_gpu_side, *h_plans,
    *h_outstanding, *h_failure, *h_closing, *h_drive, *h_acquire, *h_release, *h_dtype,
    *h_agree, *h_state, *h_started_at, *h_deadline, *h_ended_at, *h_issued_at, *h_record,
    *h_agree_b, *h_doing, *h_started, *h_done, *h_agree_bits, *h_backend, *h_deadline_b,
    *h_late_error;

static int hot_names(void) {
    static int ready = 0;
    if (ready) return 0;
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(h_closed, "_closed") NAME(h_debug, "debug") NAME(h_check, "_check")
    NAME(h_staged, "staged") NAME(h_seq, "_seq") NAME(h_gpu_side, "_gpu_side")
    NAME(h_plans, "plans") NAME(h_outstanding, "_outstanding") NAME(h_failure, "failure")
    NAME(h_closing, "_closing") NAME(h_drive, "_drive") NAME(h_acquire, "acquire")
    NAME(h_release, "release") NAME(h_dtype, "dtype") NAME(h_agree, "agree")
    NAME(h_state, "state") NAME(h_started_at, "started_at") NAME(h_deadline, "deadline")
    NAME(h_ended_at, "ended_at") NAME(h_issued_at, "issued_at") NAME(h_record, "_record")
    NAME(h_agree_b, "_agree") NAME(h_doing, "_doing") NAME(h_started, "started")
    NAME(h_done, "done") NAME(h_agree_bits, "agree_bits") NAME(h_backend, "backend")
    NAME(h_deadline_b, "_deadline") NAME(h_late_error, "_late_error")
#undef NAME
    ready = 1;
    return 0;
}

/* 1 if attribute `name` of `obj` is true (is not None, with none_only), 0 if not, -1 on an
 * error. */
static int attr_set(PyObject *obj, PyObject *name, int none_only) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int r = none_only ? v != Py_None : PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* Whether nothing on the communicator stands in the way of the common case: open, not in
 * debug mode, nothing staged, no GPU plans. 1 yes, 0 no, -1 on an error. */
static int hot_clear(PyObject *comm) {
    int r;
    if ((r = attr_set(comm, h_closed, 0)) != 0 || (r = attr_set(comm, h_debug, 0)) != 0)
        return r < 0 ? -1 : 0;
    PyObject *check = PyObject_GetAttr(comm, h_check);
    if (check == NULL) return -1;
    r = attr_set(check, h_staged, 0);
    Py_DECREF(check);
    if (r != 0) return r < 0 ? -1 : 0;
    PyObject *gpu = PyObject_GetAttr(comm, h_gpu_side);
    if (gpu == NULL) return -1;
    r = attr_set(gpu, h_plans, 1);
    Py_DECREF(gpu);
    return r != 0 ? (r < 0 ? -1 : 0) : 1;
}

/* With the engine's drive lock held: nothing in its attribute `busy` (a collective: nothing
 * outstanding; a message: nothing queued), no failure, not closing, and still on the backend
 * the context was made for. 1 clear, 0 not, -1 on an error. */
static int engine_clear(PyObject *engine, PyObject *backend, PyObject *busy) {
    int r;
    PyObject *now = PyObject_GetAttr(engine, h_backend);
    if (now == NULL) return -1;
    Py_DECREF(now);
    if (now != backend) return 0;
    if ((r = attr_set(engine, busy, 0)) != 0 || (r = attr_set(engine, h_failure, 1)) != 0
        || (r = attr_set(engine, h_closing, 0)) != 0)
        return r < 0 ? -1 : 0;
    return 1;
}

/* The engine's drive lock, taken without waiting where `clear` (1: the caller's own checks
 * passed) and `engine_clear` agree (HostEngine._may_drive). Returns the lock (a new
 * reference; the caller releases it with `end_locked`), or NULL: with an error set, or
 * without one where another thread drives the engine or the call is not the common case. */
static PyObject *take_drive(PyObject *engine, PyObject *backend, int clear, PyObject *busy) {
    PyObject *drive = clear == 1 ? PyObject_GetAttr(engine, h_drive) : NULL;
    PyObject *got = drive == NULL ? NULL : PyObject_CallMethodOneArg(drive, h_acquire, Py_False);
    if (got == Py_True && (clear = engine_clear(engine, backend, busy)) != 1) {
        PyObject *released = PyObject_CallMethodNoArgs(drive, h_release);
        if (released == NULL) clear = -1;
        Py_XDECREF(released);
        Py_CLEAR(got);
    }
    if (got != Py_True) {
        Py_XDECREF(got);
        Py_XDECREF(drive);
        if (clear < 0 && !PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the engine's state could not be read");
        return NULL;
    }
    Py_DECREF(got);
    return drive;
}

/* The end of a compiled call that holds the drive lock: where `failing` (its run raised),
 * the engine's failure handling runs first, `failed(record, exc)` (`failed(exc)` where record
 * is NULL), its own error replacing the operation's, as in Python; then the lock is released
 * (and its reference dropped). Returns `result` (a new reference), or NULL with the error. */
static PyObject *end_locked(PyObject *drive, int failing, PyObject *failed, PyObject *record,
                            PyObject *result) {
    PyObject *type, *value, *tb;
    if (failing) {
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL) PyException_SetTraceback(value, tb);
        PyObject *fargs[2] = {record, value};
        PyObject *r = record != NULL ? PyObject_Vectorcall(failed, fargs, 2, NULL)
                                     : PyObject_CallOneArg(failed, value);
        if (r == NULL) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        } else {
            Py_DECREF(r);
            PyErr_Restore(type, value, tb);
        }
    }
    PyErr_Fetch(&type, &value, &tb);
    PyObject *released = PyObject_CallMethodNoArgs(drive, h_release);
    Py_DECREF(drive);
    if (released == NULL) {
        if (type != NULL) {
            PyErr_Clear();
            PyErr_Restore(type, value, tb);
        }
        return NULL;
    }
    Py_DECREF(released);
    if (type != NULL) {
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_INCREF(result);
    return result;
}

static int set_double(PyObject *obj, PyObject *name, double v) {
    PyObject *f = PyFloat_FromDouble(v);
    if (f == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, f);
    Py_DECREF(f);
    return r;
}

static double monotonic_s(void) { return (double)now_ns() * 1e-9; }

/* The operation itself, the drive lock held: returns 0 done, -1 on an error to raise (the
 * record then exists when *record_out is set). */
static int hot_run(PyObject **ctx, PyObject *comm, Py_ssize_t kind, PyObject *kindinfo,
                   PyObject *x, PyObject *arg, PyObject *dtype, long dbits, PyObject *codes,
                   Py_ssize_t count, Py_ssize_t nbytes, long root, PyObject **record_out) {
    int gather = kind == HOT_ALL_GATHER;
    PyObject *seq_obj = PyObject_GetAttr(comm, h_seq);
    if (seq_obj == NULL) return -1;
    long long seq = PyLong_AsLongLong(seq_obj) + 1;
    Py_DECREF(seq_obj);
    if (PyErr_Occurred()) return -1;
    PyObject *next = PyLong_FromLongLong(seq);
    if (next == NULL || PyObject_SetAttr(comm, h_seq, next) < 0) {
        Py_XDECREF(next);
        return -1;
    }
    /* OpRecord(name, seq, about(x, more, arg), nbytes), logged (never holding an array) */
    PyObject *text = gather ? Py_BuildValue("(OOnO())", ctx[HOT_ABOUT], dtype, count,
                                            PyTuple_GET_ITEM(kindinfo, KIND_MORE))
                            : Py_BuildValue("(OOnO(O))", ctx[HOT_ABOUT], dtype, count,
                                            PyTuple_GET_ITEM(kindinfo, KIND_MORE), arg);
    Py_ssize_t world = Py_TYPE(ctx[HOT_STAGING]) == &MpiStepType
                       ? ((MpiStep *)ctx[HOT_STAGING])->size
                       : ((Staging *)ctx[HOT_STAGING])->size;
    PyObject *nb = PyLong_FromSsize_t(gather ? nbytes * world : nbytes);
    PyObject *record = NULL;
    if (text != NULL && nb != NULL) {
        PyObject *cargs[4] = {PyTuple_GET_ITEM(kindinfo, KIND_NAME), next, text, nb};
        record = PyObject_Vectorcall(ctx[HOT_RECORD], cargs, 4, NULL);
    }
    Py_XDECREF(text);
    Py_XDECREF(nb);
    Py_DECREF(next);
    if (record == NULL) return -1;
    *record_out = record;
    PyObject *logged = PyObject_CallOneArg(ctx[HOT_LOG], record);
    if (logged == NULL) return -1;
    Py_DECREF(logged);
    /* its signature (HostEngine.collective's agreement word) */
    long bits = PyLong_AsLong(PyTuple_GET_ITEM(kindinfo, KIND_BITS)) | dbits | (root + 1) << 15;
    if (kind == HOT_ALL_REDUCE) {
        PyObject *ob = PyObject_GetAttr(arg, h_agree_bits);
        if (ob == NULL) return -1;
        bits |= PyLong_AsLong(ob);
        Py_DECREF(ob);
    }
    if (PyErr_Occurred()) return -1;
    PyObject *agree = Py_BuildValue("(ln)", bits, count);
    if (agree == NULL) return -1;
    int bad = PyObject_SetAttr(record, h_agree, agree) < 0;
    /* started when issued (`_run`), its deadline the communicator's timeout after that */
    PyObject *issued = bad ? NULL : PyObject_GetAttr(record, h_issued_at);
    double at = issued == NULL ? 0 : PyFloat_AsDouble(issued);
    bad = bad || issued == NULL || PyErr_Occurred()
          || PyObject_SetAttr(record, h_state, h_started) < 0
          || PyObject_SetAttr(record, h_started_at, issued) < 0
          || set_double(record, h_deadline, at + PyFloat_AsDouble(ctx[HOT_TIMEOUT])) < 0;
    Py_XDECREF(issued);
    PyObject *backend = ctx[HOT_BACKEND];
    if (Py_TYPE(ctx[HOT_STAGING]) == &MpiStepType) {   /* the mpi backend's envelope */
        PyObject *deadline = bad ? NULL : PyObject_GetAttr(record, h_deadline);
        bad = bad || deadline == NULL || PyObject_SetAttr(backend, h_record, record) < 0
              || PyObject_SetAttr(backend, h_deadline_b, deadline) < 0;
        Py_XDECREF(deadline);
        Py_DECREF(agree);
        if (bad) return -1;
        long long dt = -1, op = -1;
        uintptr_t mpi_type = 0, mpi_op = 0;   /* (dt, op, divide[, MPI datatype, MPI op]) */
        int divide = 0;
        if (kind == HOT_ALL_REDUCE) {
            dt = PyLong_AsLongLong(PyTuple_GET_ITEM(codes, 0));
            op = PyLong_AsLongLong(PyTuple_GET_ITEM(codes, 1));
            divide = PyTuple_GET_SIZE(codes) > 2 && PyObject_IsTrue(PyTuple_GET_ITEM(codes, 2));
            if (PyTuple_GET_SIZE(codes) > 4) {
                mpi_type = (uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(codes, 3));
                mpi_op = (uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(codes, 4));
            }
        }
        if (PyErr_Occurred()) return -1;
        long st = mpi_step_run((MpiStep *)ctx[HOT_STAGING], (int)kind, x, arg, nbytes, bits,
                               count, dt, op, divide, root, mpi_type, mpi_op);
        if (st < 0) return -1;
        if (st != 1) {   /* not done within the spin, the signatures differed, MPI failed */
            PyObject *code = PyLong_FromLong(st);
            if (code == NULL) return -1;
            PyObject *rargs[4] = {x, record, arg, code};
            PyObject *rest = PyObject_Vectorcall(ctx[HOT_REST], rargs, 4, NULL);
            Py_DECREF(code);
            if (rest == NULL) return -1;
            Py_DECREF(rest);
        }
        if (PyObject_SetAttr(record, h_state, h_done) < 0
            || set_double(record, h_ended_at, monotonic_s()) < 0)
            return -1;
        return 0;
    }
    /* the backend's marks (_core_step), then the core's step */
    unsigned long long doing = (unsigned long long)seq << 24
                               | PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(kindinfo, KIND_DOING));
    PyObject *doing_obj = bad || PyErr_Occurred() ? NULL : PyLong_FromUnsignedLongLong(doing);
    bad = bad || doing_obj == NULL || PyObject_SetAttr(backend, h_record, record) < 0
          || PyObject_SetAttr(backend, h_agree_b, Py_None) < 0
          || PyObject_SetAttr(backend, h_doing, doing_obj) < 0;
    PyObject *status = NULL;
    if (!bad) {
        PyObject *zero = PyLong_FromLong(0), *src = PyLong_FromLong(root);
        if (zero != NULL && src != NULL) {
            PyObject *stepargs[8] = {
                x, doing_obj, agree,
                codes != NULL ? PyTuple_GET_ITEM(codes, 0) : zero,
                codes != NULL ? PyTuple_GET_ITEM(codes, 1) : zero,
                kind == HOT_ALL_REDUCE ? Py_True : Py_False, src, arg};
            status = staging_one_shot((Staging *)ctx[HOT_STAGING], stepargs, gather ? 8 : 7);
        }
        Py_XDECREF(zero);
        Py_XDECREF(src);
    }
    Py_XDECREF(doing_obj);
    Py_DECREF(agree);
    if (status == NULL) return -1;
    long st = PyLong_AsLong(status);
    if (st != 1) {   /* the peers were not there within the spin: the rest in Python */
        PyObject *rargs[4] = {x, record, arg, status};
        PyObject *rest = PyObject_Vectorcall(ctx[HOT_REST], rargs, 4, NULL);
        if (rest == NULL) {
            Py_DECREF(status);
            return -1;
        }
        Py_DECREF(rest);
    }
    Py_DECREF(status);
    if (PyObject_SetAttr(record, h_state, h_done) < 0
        || set_double(record, h_ended_at, monotonic_s()) < 0)
        return -1;
    return 0;
}

static PyObject *hot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != HOT_SIZE) {
        PyErr_SetString(PyExc_TypeError, "hot(ctx, comm, kind, x, arg)");
        return NULL;
    }
    if (hot_names() < 0) return NULL;
    PyObject **ctx = &PyTuple_GET_ITEM(args[0], 0);
    PyObject *comm = args[1], *x = args[3], *arg = args[4];
    if (Py_TYPE(x) != (PyTypeObject *)ctx[HOT_NDARRAY]) Py_RETURN_NONE;
    Py_ssize_t kind = PyLong_AsSsize_t(args[2]);
    PyObject *kinds = ctx[HOT_KINDS];
    if (kind < 0 || kind >= PyTuple_GET_SIZE(kinds)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "hot: unknown kind");
        return NULL;
    }
    PyObject *kindinfo = PyTuple_GET_ITEM(kinds, kind);
    if (!PyTuple_Check(kindinfo) || PyTuple_GET_SIZE(kindinfo) != KIND_SIZE) {
        PyErr_SetString(PyExc_TypeError, "hot: a kind is (name, bits, doing, more, direct_min)");
        return NULL;
    }
    int mpi = Py_TYPE(ctx[HOT_STAGING]) == &MpiStepType;
    Py_ssize_t world = mpi ? ((MpiStep *)ctx[HOT_STAGING])->size
                           : ((Staging *)ctx[HOT_STAGING])->size;
    Py_ssize_t me = mpi ? ((MpiStep *)ctx[HOT_STAGING])->rank
                        : ((Staging *)ctx[HOT_STAGING])->rank;
    long root = -1;   /* all_reduce: arg is the op; broadcast: the source rank; all_gather: out */
    if (kind == HOT_ALL_REDUCE) {
        if (!PyObject_TypeCheck(arg, (PyTypeObject *)ctx[HOT_REDUCEOP])) Py_RETURN_NONE;
    } else if (kind == HOT_BROADCAST) {
        if (!PyLong_CheckExact(arg)) Py_RETURN_NONE;
        root = PyLong_AsLong(arg);
        if (root < 0 || root >= world) {
            PyErr_Clear();
            Py_RETURN_NONE;   /* the full path says what is wrong with it */
        }
    } else if (Py_TYPE(arg) != (PyTypeObject *)ctx[HOT_NDARRAY]) {
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(x, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t nbytes = view.len, itemsize = view.itemsize ? view.itemsize : 1;
    const char *xb = (const char *)view.buf;
    PyBuffer_Release(&view);
    if (kind == HOT_ALL_GATHER) {   /* out: size pieces like x; x apart from it, or its own piece */
        Py_buffer o;
        if (PyObject_GetBuffer(arg, &o, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        const char *ob = (const char *)o.buf;
        int fits = o.len == nbytes * world && o.itemsize == itemsize
                   && (xb + nbytes <= ob || ob + o.len <= xb || xb == ob + me * nbytes);
        PyBuffer_Release(&o);
        if (!fits) Py_RETURN_NONE;
        PyObject *xd = PyObject_GetAttr(x, h_dtype), *od = PyObject_GetAttr(arg, h_dtype);
        int same = xd == NULL || od == NULL ? -1 : PyObject_RichCompareBool(xd, od, Py_EQ);
        Py_XDECREF(xd);
        Py_XDECREF(od);
        if (same < 0) return NULL;
        if (!same) Py_RETURN_NONE;
    }
    long long direct_min = PyLong_AsLongLong(PyTuple_GET_ITEM(kindinfo, KIND_DIRECT_MIN));
    if (nbytes > PyLong_AsSsize_t(ctx[HOT_MAX_BYTES]) || nbytes >= direct_min) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *dtype = PyObject_GetAttr(x, h_dtype);
    if (dtype == NULL) return NULL;
    PyObject *codes = NULL, *dbits_obj = PyDict_GetItemWithError(ctx[HOT_DTYPE_BITS], dtype);
    if (dbits_obj != NULL && kind == HOT_ALL_REDUCE) {
        PyObject *key = PyTuple_Pack(2, dtype, arg);
        if (key == NULL) {
            Py_DECREF(dtype);
            return NULL;
        }
        codes = PyDict_GetItemWithError(ctx[HOT_REDUCTIONS], key);
        Py_DECREF(key);
    }
    /* an mpi all_reduce past the envelope's room needs its data call's MPI datatype and op */
    if (dbits_obj == NULL || (kind == HOT_ALL_REDUCE && codes == NULL)
        || (mpi && kind == HOT_ALL_REDUCE && nbytes > ENVELOPE_ROOM
            && (!PyTuple_Check(codes) || PyTuple_GET_SIZE(codes) < 5))) {
        Py_DECREF(dtype);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    long dbits = PyLong_AsLong(dbits_obj);
    int late = mpi ? attr_set(ctx[HOT_BACKEND], h_late_error, 1) : 0;
    if (late != 0) {   /* a failed send's error to raise first: the full path raises it */
        Py_DECREF(dtype);
        if (late < 0) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *drive = take_drive(ctx[HOT_ENGINE], ctx[HOT_BACKEND], hot_clear(comm),
                                 h_outstanding);
    if (drive == NULL) {   /* another thread drives the engine, or not the common case */
        Py_DECREF(dtype);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *record = NULL;
    int rc = hot_run(ctx, comm, kind, kindinfo, x, arg, dtype, dbits, codes, nbytes / itemsize,
                     nbytes, root, &record);
    Py_DECREF(dtype);
    /* the engine's failure handling (`_run`) where the record exists, then raise */
    PyObject *result = end_locked(drive, rc < 0 && record != NULL, ctx[HOT_FAILED], record, x);
    Py_XDECREF(record);
    return result;
}

/* ---- exchange(ctx, comm, x, dst, y, src, tag): a blocking sendrecv of NumPy arrays, whole ---
 * What Communicator.sendrecv, MessageCalls.sendrecv, HostEngine.sendrecv and ShmBackend's
 * send_now and receive_now do for the common call, in one call: the checks that select it
 * (C-contiguous NumPy arrays apart in memory, of dtypes the core moves, other ranks, a tag in
 * range; nothing queued, posted or held that the messages must order behind), the record
 * (numbered, logged, started, done), the send into dst's ring and the take from src's.
 * Returns src when done; None when the call is not that common case (nothing was done);
 * what the core did not finish (a full ring, a message not there within the spin, another
 * one first) goes on in Python (ctx's `rest`, the drive lock held). Raises what the operation
 * raised, after the engine's failure handling. ctx: shm.ShmBackend.exchange_context, or
 * mpi.MpiBackend.exchange_context, whose step (X_STEP) posts the messages to MPI instead
 * (mpi_exchange_core). */
enum {
    X_ENGINE, X_BACKEND, X_LOG, X_RECORD, X_TEXT, X_SEQS, X_CODES, X_NDARRAY, X_REST,
    X_FAILED, X_NAME, X_RANK, X_SIZE_OF, X_STEP, X_SIZE
};
/* X_STEP: None (shm: the core's rings), or the mpi backend's MpiStep: the messages are MPI's */

static PyObject *x_held, *x_queue, *x_batched, *x_sendq, *x_send_lanes, *x_sent, *x_posted,
    *x_posted_any, *x_unexpected, *x_incoming, *x_take_lanes, *x_consumed, *x_arrivals,
    *x_spin_ns, *x_pending, *x_outcome;

static int exchange_names(void) {
    static int ready = 0;
    if (ready) return 0;
    if (hot_names() < 0) return -1;
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(x_held, "_held") NAME(x_queue, "_queue") NAME(x_batched, "batched")
    NAME(x_sendq, "_sendq") NAME(x_send_lanes, "_send_lanes") NAME(x_sent, "_sent")
    NAME(x_posted, "_posted") NAME(x_posted_any, "_posted_any")
    NAME(x_unexpected, "_unexpected") NAME(x_incoming, "_incoming")
    NAME(x_take_lanes, "_take_lanes") NAME(x_consumed, "_consumed")
    NAME(x_arrivals, "_arrivals") NAME(x_spin_ns, "_spin_ns") NAME(x_pending, "_pending")
    NAME(x_outcome, "_exchange_outcome")
#undef NAME
    ready = 1;
    return 0;
}

/* Item i of list attribute `name` of `obj` (a new reference), or NULL on an error. */
static PyObject *list_item(PyObject *obj, PyObject *name, Py_ssize_t i) {
    PyObject *list = PyObject_GetAttr(obj, name);
    if (list == NULL) return NULL;
    PyObject *item = PySequence_GetItem(list, i);
    Py_DECREF(list);
    return item;
}

/* Sets item i of list attribute `name` of `obj` to `value`: 0, or -1 on an error. */
static int set_list_item(PyObject *obj, PyObject *name, Py_ssize_t i, PyObject *value) {
    PyObject *list = PyObject_GetAttr(obj, name);
    if (list == NULL) return -1;
    int r = PySequence_SetItem(list, i, value);
    Py_DECREF(list);
    return r;
}

/* 1 if item i of list attribute `name` of `obj` is empty (or None, with none_ok), 0 if not,
 * -1 on an error. */
static int item_empty(PyObject *obj, PyObject *name, Py_ssize_t i, int none_ok) {
    PyObject *item = list_item(obj, name, i);
    if (item == NULL) return -1;
    int r = none_ok && item == Py_None ? 1 : !PyObject_IsTrue(item);
    Py_DECREF(item);
    return PyErr_Occurred() ? -1 : r;
}

/* Whether nothing of the backend's messages stands before this exchange's receive from src:
 * no send queued to anyone, no receive posted from src or from any rank, nothing arrived
 * from src unclaimed or half read. 1 clear, 0 not, -1 on an error. */
static int receive_clear(PyObject *backend, Py_ssize_t src, Py_ssize_t size) {
    int r;
    if ((r = item_empty(backend, x_posted, src, 0)) != 1
        || (r = attr_set(backend, x_posted_any, 0)) != 0
        || (r = item_empty(backend, x_unexpected, src, 0)) != 1
        || (r = item_empty(backend, x_incoming, src, 1)) != 1)
        return r < 0 ? -1 : 0;
    for (Py_ssize_t j = 0; j < size; j++)
        if ((r = item_empty(backend, x_sendq, j, 0)) != 1) return r < 0 ? -1 : 0;
    return 1;
}

/* The core's send into dst's ring, then take from src's (as send_now, receive_now): 1 both
 * done, 0 the send not done, 2 the send done and the take not; -1 on an error. */
static int exchange_core(PyObject *backend, PyObject *x, Py_ssize_t dst, PyObject *y,
                         Py_ssize_t src, PyObject *tag, PyObject *code_x, PyObject *code_y,
                         Py_ssize_t size) {
    int r = item_empty(backend, x_sendq, dst, 0);
    if (r != 1) return r;
    PyObject *lane = list_item(backend, x_send_lanes, dst);
    PyObject *pos = lane == NULL ? NULL : list_item(backend, x_sent, dst);
    PyObject *got = NULL;
    if (pos != NULL) {
        PyObject *sargs[5] = {lane, pos, tag, code_x, x};
        got = send(NULL, sargs, 5);
    }
    Py_XDECREF(lane);
    Py_XDECREF(pos);
    if (got == NULL) return -1;
    r = PyObject_IsTrue(got);
    if (r == 1) r = set_list_item(backend, x_sent, dst, got) < 0 ? -1 : 1;
    Py_DECREF(got);
    if (r != 1) return r;
    if ((r = receive_clear(backend, src, size)) != 1) return r < 0 ? -1 : 2;
    lane = list_item(backend, x_take_lanes, src);
    pos = lane == NULL ? NULL : list_item(backend, x_consumed, src);
    PyObject *spin = pos == NULL ? NULL : PyObject_GetAttr(backend, x_spin_ns);
    got = NULL;
    if (spin != NULL) {
        PyObject *targs[6] = {lane, pos, tag, code_y, y, spin};
        got = take(NULL, targs, 6);
    }
    Py_XDECREF(lane);
    Py_XDECREF(pos);
    Py_XDECREF(spin);
    if (got == NULL) return -1;
    r = PyObject_IsTrue(got);
    if (r == 1 && set_list_item(backend, x_consumed, src, got) < 0) r = -1;
    Py_DECREF(got);
    if (r != 1) return r < 0 ? -1 : 2;
    PyObject *arrivals = PyObject_GetAttr(backend, x_arrivals);
    if (arrivals == NULL) return -1;
    PyObject *one = PyLong_FromLong(1);
    PyObject *more = one == NULL ? NULL : PyNumber_Add(arrivals, one);
    Py_DECREF(arrivals);
    Py_XDECREF(one);
    r = more == NULL || PyObject_SetAttr(backend, x_arrivals, more) < 0 ? -1 : 1;
    Py_XDECREF(more);
    return r;
}

/* The mpi backend's sendrecv (ctx's step an MpiStep), as its post_send and post_recv would
 * post it: where nothing of the backend's is pending (no earlier message to order behind, no
 * failed send to report), the tag fits and both messages are at most exchange_max bytes
 * (mpi.exchange_max), the send leaves from a copy of x (the step's bytearray, buffered as
 * post_send's) with MPI_Isend, the receive into y with MPI_Irecv, both under the
 * tag that also names the dtype (tag * MPI_TAG_CODES + its code), and both are tested for the
 * spin. 1: both done, the message of y's size. 0: nothing posted (the general way, both). 2: the
 * receive not there within the spin, taken back with MPI_Cancel (the general way, the
 * receive, which also reports a message of another dtype). Other outcomes (the send not done
 * yet, a message of another size) go to the backend's `_exchange_outcome`, which hands the send
 * over to its pending messages and raises the receive's error: 1 when it returns True, else 2.
 * -1 on an error to raise. */

/* Take the posted receive back (MPI_Cancel, then MPI_Wait): 1 cancelled, 0 its message came
 * first (recv_status holds it), -1 an MPI call failed. */
static int take_back_receive(MpiStep *m) {
    int cancelled = 0;
    if (m->cancel(m->recv_request) != 0 || m->wait(m->recv_request, m->recv_status) != 0
        || m->test_cancelled(m->recv_status, &cancelled) != 0)
        return -1;
    return cancelled != 0;
}

static int mpi_exchange_core(MpiStep *m, PyObject *backend, PyObject *record, PyObject *x,
                             Py_ssize_t dst, PyObject *y, Py_ssize_t src, PyObject *tag,
                             PyObject *code_x, PyObject *code_y) {
    int r;
    if (m->isend == NULL) return 0;
    if ((r = attr_set(backend, h_late_error, 1)) != 0 || (r = attr_set(backend, x_pending, 0)) != 0)
        return r < 0 ? -1 : 0;
    long long t = PyLong_AsLongLong(tag), cx = PyLong_AsLongLong(code_x),
              cy = PyLong_AsLongLong(code_y);
    if (PyErr_Occurred()) return -1;
    if (t >= m->tag_limit) return 0;   /* the general way says what is wrong with it */
    Py_buffer xv, yv;
    if (PyObject_GetBuffer(x, &xv, PyBUF_C_CONTIGUOUS) < 0) return -1;
    Py_ssize_t sent_len = xv.len;
    if (sent_len > m->exchange_max) {
        PyBuffer_Release(&xv);
        return 0;
    }
    if (m->sendbuf == NULL || PyByteArray_GET_SIZE(m->sendbuf) < sent_len) {
        Py_XSETREF(m->sendbuf, PyByteArray_FromStringAndSize(
                                   NULL, sent_len > 4096 ? sent_len : 4096));
        if (m->sendbuf == NULL) {
            PyBuffer_Release(&xv);
            return -1;
        }
    }
    memcpy(PyByteArray_AS_STRING(m->sendbuf), xv.buf, (size_t)sent_len);
    PyBuffer_Release(&xv);
    PyObject *copy = Py_NewRef(m->sendbuf);
    if (PyObject_GetBuffer(y, &yv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(copy);
        return -1;
    }
    Py_ssize_t want = yv.len;
    /* the receive first, as MPI_Sendrecv posts them: the peer's message then finds it */
    if (want > m->exchange_max
        || m->irecv(yv.buf, (int)want, m->byte, (int)src, (int)(t * MPI_TAG_CODES + cy),
                    m->comm, m->recv_request) != 0) {
        PyBuffer_Release(&yv);
        Py_DECREF(copy);
        return 0;   /* nothing posted: the general way says what is wrong */
    }
    /* received: 0 not yet, 1 done, -1 taken back; sent: 0 not yet, 1 done, 2 its test failed */
    int sent = 0, received = 0;
    if (m->isend(PyByteArray_AS_STRING(copy), (int)sent_len, m->byte, (int)dst,
                 (int)(t * MPI_TAG_CODES + cx), m->comm, m->send_request) != 0) {
        int back = take_back_receive(m);   /* then nothing of this exchange is left posted */
        PyBuffer_Release(&yv);
        Py_DECREF(copy);
        if (back == 1) return 0;
        PyErr_SetString(PyExc_RuntimeError, "sendrecv: MPI_Isend failed and its receive could "
                        "not be taken back (mpi backend)");
        return -1;
    }
    m->exchanges++;
    int recv_error = 0, flag = 0;
    uint64_t until = now_ns() + m->spin_ns;
    while (1) {
        if (!sent) {   /* 2: its test failed (reported where it is handed over, pending) */
            if (m->test(m->send_request, &flag, m->status) != 0)
                sent = 2;
            else if (flag)
                sent = 1;
        }
        if (received == 0) {
            if (m->test(m->recv_request, &flag, m->recv_status) != 0)
                received = recv_error = 1;   /* a longer message (MPI_ERR_TRUNCATE) */
            else if (flag)
                received = 1;
        }
        if ((sent || now_ns() >= until) && (received || now_ns() >= until)) break;
        if (m->yields) sched_yield();
    }
    if (received == 0) {   /* not there within the spin: taken back (or it came meanwhile) */
        int back = take_back_receive(m);
        received = back == 1 ? -1 : 1;
        recv_error = back < 0;
    }
    int count = -1;
    if (received == 1 && !recv_error && m->get_count(m->recv_status, m->byte, &count) != 0)
        count = -1;
    PyBuffer_Release(&yv);
    if (sent == 1 && received == 1 && !recv_error && count == want) {
        Py_DECREF(copy);
        return 1;
    }
    if (sent == 1 && received == -1) {
        Py_DECREF(copy);
        return 2;
    }
    if (sent != 1) Py_CLEAR(m->sendbuf);   /* the pending send keeps it (`copy`): a new one next */
    PyObject *handle = sent == 1 ? Py_NewRef(Py_None) : request_handle(m, m->send_request);
    PyObject *got = received != 1 ? Py_NewRef(Py_None)
                    : recv_error || count < 0 ? PyLong_FromLong(-1) : PyLong_FromLong(count);
    PyObject *src_obj = PyLong_FromSsize_t(src);
    PyObject *done = NULL;
    if (handle != NULL && got != NULL && src_obj != NULL) {
        PyObject *oargs[8] = {backend, record, y, src_obj, tag, handle, copy, got};
        done = PyObject_VectorcallMethod(x_outcome, oargs, 8 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                         NULL);
    }
    Py_XDECREF(handle);
    Py_XDECREF(got);
    Py_XDECREF(src_obj);
    Py_DECREF(copy);
    if (done == NULL) return -1;
    r = PyObject_IsTrue(done);
    Py_DECREF(done);
    return r < 0 ? -1 : r == 1 ? 1 : 2;
}

/* The exchange itself, the drive lock held: 0 done, -1 on an error to raise (the record then
 * exists when *record_out is set). */
static int exchange_run(PyObject **ctx, PyObject *x, PyObject *dst, PyObject *y, PyObject *src,
                        PyObject *tag, PyObject *code_x, PyObject *code_y, Py_ssize_t nbytes,
                        PyObject **record_out) {
    PyObject *key = PyTuple_Pack(3, ctx[X_NAME], dst, src);
    PyObject *counter = key == NULL ? NULL : PyObject_GetItem(ctx[X_SEQS], key);
    Py_XDECREF(key);
    PyObject *seq = counter == NULL ? NULL : PyIter_Next(counter);
    Py_XDECREF(counter);
    if (seq == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "exchange: no number");
        return -1;
    }
    PyObject *nb = PyLong_FromSsize_t(nbytes);
    PyObject *text = nb == NULL ? NULL : PyTuple_Pack(6, ctx[X_TEXT], ctx[X_NAME], dst, tag, nb,
                                                      src);
    PyObject *record = NULL;
    if (text != NULL) {
        PyObject *rargs[4] = {ctx[X_NAME], seq, text, nb};
        record = PyObject_Vectorcall(ctx[X_RECORD], rargs, 4, NULL);
    }
    Py_DECREF(seq);
    Py_XDECREF(nb);
    Py_XDECREF(text);
    if (record == NULL) return -1;
    *record_out = record;
    PyObject *logged = PyObject_CallOneArg(ctx[X_LOG], record);
    if (logged == NULL) return -1;
    Py_DECREF(logged);
    PyObject *issued = PyObject_GetAttr(record, h_issued_at);   /* started as issued */
    int bad = issued == NULL || PyObject_SetAttr(record, h_state, h_started) < 0
              || PyObject_SetAttr(record, h_started_at, issued) < 0;
    Py_XDECREF(issued);
    if (bad) return -1;
    Py_ssize_t d = PyLong_AsSsize_t(dst), s = PyLong_AsSsize_t(src);
    int r = ctx[X_STEP] != Py_None
            ? mpi_exchange_core((MpiStep *)ctx[X_STEP], ctx[X_BACKEND], record, x, d, y, s, tag,
                                code_x, code_y)
            : exchange_core(ctx[X_BACKEND], x, d, y, s, tag, code_x, code_y,
                            PyLong_AsSsize_t(ctx[X_SIZE_OF]));
    if (r < 0) return -1;
    if (r != 1) {   /* the rest the general way (HostEngine.exchange_rest) */
        PyObject *rargs[7] = {record, x, dst, y, src, tag, r == 2 ? Py_True : Py_False};
        PyObject *rest = PyObject_Vectorcall(ctx[X_REST], rargs, 7, NULL);
        if (rest == NULL) return -1;
        Py_DECREF(rest);
        return 0;   /* (the rest marks the record done) */
    }
    if (PyObject_SetAttr(record, h_state, h_done) < 0
        || set_double(record, h_ended_at, monotonic_s()) < 0)
        return -1;
    return 0;
}

static PyObject *exchange(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != X_SIZE
        || (PyTuple_GET_ITEM(args[0], X_STEP) != Py_None
            && Py_TYPE(PyTuple_GET_ITEM(args[0], X_STEP)) != &MpiStepType)) {
        PyErr_SetString(PyExc_TypeError, "exchange(ctx, comm, x, dst, y, src, tag)");
        return NULL;
    }
    if (exchange_names() < 0) return NULL;
    PyObject **ctx = &PyTuple_GET_ITEM(args[0], 0);
    PyObject *comm = args[1], *x = args[2], *dst = args[3], *y = args[4], *src = args[5],
             *tag = args[6];
    PyTypeObject *ndarray = (PyTypeObject *)ctx[X_NDARRAY];
    if (Py_TYPE(x) != ndarray || Py_TYPE(y) != ndarray || !PyLong_CheckExact(dst)
        || !PyLong_CheckExact(src) || !PyLong_CheckExact(tag))
        Py_RETURN_NONE;
    long rank = PyLong_AsLong(ctx[X_RANK]), size = PyLong_AsLong(ctx[X_SIZE_OF]);
    long d = PyLong_AsLong(dst), s = PyLong_AsLong(src);
    long long t = PyLong_AsLongLong(tag);
    if (PyErr_Occurred()) {   /* out of range of C's integers: the full path says what */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (d < 0 || d >= size || d == rank || s < 0 || s >= size || s == rank || t < 0)
        Py_RETURN_NONE;
    Py_buffer xv, yv;
    if (PyObject_GetBuffer(x, &xv, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (PyObject_GetBuffer(y, &yv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&xv);
        Py_RETURN_NONE;
    }
    const char *xb = (const char *)xv.buf, *yb = (const char *)yv.buf;
    Py_ssize_t nbytes = xv.len;
    int apart = xv.len == 0 || yv.len == 0 || xb + xv.len <= yb || yb + yv.len <= xb;
    PyBuffer_Release(&xv);
    PyBuffer_Release(&yv);
    if (!apart) Py_RETURN_NONE;
    PyObject *xd = PyObject_GetAttr(x, h_dtype), *yd = PyObject_GetAttr(y, h_dtype);
    PyObject *code_x = xd == NULL ? NULL : PyDict_GetItemWithError(ctx[X_CODES], xd);
    PyObject *code_y = code_x == NULL || yd == NULL ? NULL
                                                    : PyDict_GetItemWithError(ctx[X_CODES], yd);
    Py_XDECREF(xd);
    Py_XDECREF(yd);
    if (code_y == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    int clear = hot_clear(comm);
    if (clear == 1) {   /* not inside a batch of GPU messages, nothing held by the engine */
        PyObject *gpu = PyObject_GetAttr(comm, h_gpu_side);
        clear = gpu == NULL ? -1 : attr_set(gpu, x_batched, 1) == 0;
        if (gpu != NULL && PyErr_Occurred()) clear = -1;
        Py_XDECREF(gpu);
        int r;
        if (clear == 1 && (r = attr_set(ctx[X_ENGINE], x_held, 0)) != 0) clear = r < 0 ? -1 : 0;
    }
    /* HostEngine._may_drive(after_posted=True) */
    PyObject *drive = take_drive(ctx[X_ENGINE], ctx[X_BACKEND], clear, x_queue);
    if (drive == NULL) {   /* another thread drives the engine, or not the common case */
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *record = NULL;
    int rc = exchange_run(ctx, x, dst, y, src, tag, code_x, code_y, nbytes, &record);
    /* the engine's failure handling (HostEngine.sendrecv), then raise */
    PyObject *result = end_locked(drive, rc < 0, ctx[X_FAILED], NULL, src);
    Py_XDECREF(record);
    return result;
}

typedef struct { double seconds; int code; size_t length; char say[512]; } ExitLater;

static void *exit_later(void *arg) {
    ExitLater *when = arg;
    struct timespec ts = {(time_t)when->seconds,
                          (long)((when->seconds - (double)(time_t)when->seconds) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {}
    fflush(NULL);
    if (when->length && write(2, when->say, when->length) < 0) {}
    _exit(when->code);
    return NULL;
}

static PyObject *exit_after(PyObject *self, PyObject *args) {
    double seconds;
    int code;
    const char *say = "";
    Py_ssize_t length = 0;
    if (!PyArg_ParseTuple(args, "di|y#", &seconds, &code, &say, &length)) return NULL;
    if (seconds < 0) {
        PyErr_SetString(PyExc_ValueError, "exit_after: seconds must be >= 0");
        return NULL;
    }
    ExitLater *when = malloc(sizeof *when);
    if (when == NULL) return PyErr_NoMemory();
    when->seconds = seconds;
    when->code = code;
    when->length = (size_t)(length < (Py_ssize_t)sizeof when->say ? length
                                                                   : (Py_ssize_t)sizeof when->say);
    memcpy(when->say, say, when->length);
    pthread_t thread;
    if (pthread_create(&thread, NULL, exit_later, when) != 0) {
        free(when);
        PyErr_SetString(PyExc_OSError, "exit_after: no thread could be started");
        return NULL;
    }
    pthread_detach(thread);
    Py_RETURN_NONE;
}

static PyObject *set_spin_yield(PyObject *self, PyObject *flag) {
    int on = PyObject_IsTrue(flag);
    if (on < 0) return NULL;
    spin_yields = on;
    Py_RETURN_NONE;
}

/* ---- mpi_ring: the mpi backend's rings between hosts, whole, without the GIL ----------------
 * mpi_ring(calls, x, dtype, op, rank, size, tag, spin_ns, deadline_ns, stop, scratch, kind,
 *          root, segment) -> (status, step, waiting)
 * One operation on a ring of `size` ranks, over MPI point-to-point messages: bytes (MPI_BYTE)
 * under `tag` on the communicator `calls` names (MPI_Isend, MPI_Irecv, MPI_Test, MPI_Cancel
 * addresses, the communicator's and MPI_BYTE's handles). x is cut into `size` pieces (piece i:
 * elements i*count/size up to (i+1)*count/size).
 *   kind 0, all_reduce (as mpi.py's _Ring): n - 1 steps in which each rank sends a piece to the
 *     next rank and adds the piece that arrives from the previous one into its own, then n - 1
 *     steps passing the reduced pieces on; every rank ends with the same bits.
 *   kind 1, reduce_scatter: the first n - 1 steps alone, one piece further on, so that rank r
 *     ends with piece r reduced (the other pieces of x are left partly reduced).
 *   kind 2, broadcast from `root`: x in segments of `segment` bytes down the chain root, root
 *     + 1, ...; each rank forwards segment j while segment j + 1 arrives, so that every link
 *     carries x once (dtype and op unused).
 * `dtype` is a core dtype code, `op` a core op code other than AVG; `scratch` holds the largest
 * piece (kinds 0 and 1). Runs with the GIL released, so that a thread of the backend's can
 * move the ring while the caller's thread works (MPI moves data only inside its calls). Each
 * wait tests its request, yielding the core, for spin_ns, then every 20 us; it ends at
 * deadline_ns (CLOCK_MONOTONIC, as Python's time.monotonic) or when stop[0] is set (by another
 * thread). status: 0 done, 1 the deadline passed, 2 stopped, 3 an MPI call failed; step: the
 * step (kind 2: the segment) it was in, 0-based; waiting: 0 for what the left rank sends, 1
 * for the right rank to take what this one sends. */
static int ring_wait(mpi_test_fn test, void *request, unsigned char *status,
                     unsigned long long spin_ns, uint64_t deadline_ns,
                     volatile int64_t *stop) {
    int flag = 0;
    uint64_t started = now_ns();
    for (;;) {
        if (test(request, &flag, status) != 0) return 3;
        if (flag) return 0;
        uint64_t t = now_ns();
        if (t >= deadline_ns) return 1;
        if (*stop) return 2;
        if (t - started < spin_ns) {
            sched_yield();
        } else {
            struct timespec pause = {0, 20000};
            nanosleep(&pause, NULL);
        }
    }
}

/* kind 2 of mpi_ring: x down the chain in segments; `position` counts from the root (0). */
static long chain_broadcast(mpi_isend_fn isend, mpi_irecv_fn irecv, mpi_test_fn test,
                            mpi_cancel_fn cancel, uintptr_t comm, uintptr_t byte, char *data,
                            Py_ssize_t len, Py_ssize_t segment, long position, long n,
                            long left, long right, int tag, unsigned long long spin_ns,
                            uint64_t deadline_ns, volatile int64_t *stopped, long *step,
                            long *waiting) {
    unsigned char recv_req[2][16], send_req[16], st[512];
    long segments = (long)((len + segment - 1) / segment), status = 0;
    int first = position == 0, last = position == n - 1, sending = 0;
    memset(recv_req, 0, sizeof(recv_req));
    memset(send_req, 0, sizeof(send_req));
#define SEG_AT(j) (data + (Py_ssize_t)(j) * segment)
#define SEG_LEN(j) ((int)((Py_ssize_t)(j) * segment + segment <= len ? segment \
                                                                       : len - (Py_ssize_t)(j) * segment))
    if (!first && segments > 0 &&
        irecv(SEG_AT(0), SEG_LEN(0), byte, (int)left, tag, comm, recv_req[0]) != 0)
        return 3;
    for (long j = 0; j < segments; j++) {
        *step = j;
        if (!first) {
            *waiting = 0;
            status = ring_wait(test, recv_req[j % 2], st, spin_ns, deadline_ns, stopped);
            if (status != 0) {
                cancel(recv_req[j % 2]);
                return status;
            }
            if (j + 1 < segments && irecv(SEG_AT(j + 1), SEG_LEN(j + 1), byte, (int)left, tag,
                                          comm, recv_req[(j + 1) % 2]) != 0)
                return 3;
        }
        if (!last) {
            *waiting = 1;
            if (sending && (status = ring_wait(test, send_req, st, spin_ns, deadline_ns,
                                               stopped)) != 0) {
                if (!first && j + 1 < segments) cancel(recv_req[(j + 1) % 2]);
                return status;
            }
            if (isend(SEG_AT(j), SEG_LEN(j), byte, (int)right, tag, comm, send_req) != 0) {
                if (!first && j + 1 < segments) cancel(recv_req[(j + 1) % 2]);
                return 3;
            }
            sending = 1;
        }
    }
#undef SEG_AT
#undef SEG_LEN
    *waiting = 1;
    return sending ? ring_wait(test, send_req, st, spin_ns, deadline_ns, stopped) : 0;
}

static PyObject *mpi_ring(PyObject *self, PyObject *args) {
    unsigned long long isend_a, irecv_a, test_a, cancel_a, comm, byte, spin_ns, deadline_ns;
    Py_buffer x, stop, scratch;
    int dtype, op, kind;
    Py_ssize_t rank, size, root, segment;
    int tag;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKKKKK)w*iinniKKw*w*inn", &isend_a, &irecv_a, &test_a,
                          &cancel_a, &comm, &byte, &x, &dtype, &op, &rank, &size, &tag,
                          &spin_ns, &deadline_ns, &stop, &scratch, &kind, &root, &segment))
        return NULL;
    const char *bad = NULL;
    int chain = kind == 2;
    Py_ssize_t item = chain ? 1 : dtype >= 0 && dtype < N_DTYPES ? envelope_item[dtype] : 0;
    if (!isend_a || !irecv_a || !test_a || !cancel_a) bad = "an MPI call's address is 0";
    else if (kind < 0 || kind > 2) bad = "kind: 0 all_reduce, 1 reduce_scatter, 2 broadcast";
    else if (!item || (!chain && (op < 0 || op >= N_OPS || op == AVG)))
        bad = "dtype or op not the core's";
    else if (size < 2 || rank < 0 || rank >= size) bad = "rank or size";
    else if (chain && (root < 0 || root >= size)) bad = "root";
    else if (chain && (segment < 1 || segment > INT_MAX)) bad = "segment: 1 to INT_MAX bytes";
    else if (x.len % item) bad = "x is not whole elements";
    else if (stop.len < 8 || (uintptr_t)stop.buf % 8) bad = "stop: one aligned int64";
    Py_ssize_t count = item ? x.len / item : 0;
    Py_ssize_t largest = chain ? 0 : (count + size - 1) / size * item;
    if (!bad && (scratch.len < largest || largest > INT_MAX))
        bad = "scratch smaller than the largest piece, or a piece over INT_MAX bytes";
    if (bad) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&stop);
        PyBuffer_Release(&scratch);
        PyErr_Format(PyExc_ValueError, "mpi_ring: %s", bad);
        return NULL;
    }
    mpi_isend_fn isend = (mpi_isend_fn)(uintptr_t)isend_a;
    mpi_irecv_fn irecv = (mpi_irecv_fn)(uintptr_t)irecv_a;
    mpi_test_fn test = (mpi_test_fn)(uintptr_t)test_a;
    mpi_cancel_fn cancel = (mpi_cancel_fn)(uintptr_t)cancel_a;
    char *data = (char *)x.buf, *arrived = (char *)scratch.buf;
    volatile int64_t *stopped = (volatile int64_t *)stop.buf;
    long n = (long)size, r = (long)rank, right = (r + 1) % n, left = (r + n - 1) % n;
    long steps = kind == 0 ? 2 * (n - 1) : n - 1, shift = kind == 1, step = 0, status = 0;
    long waiting = 0;
    unsigned char recv_req[16], send_req[16], st[512];
    if (chain) {
        Py_BEGIN_ALLOW_THREADS
        status = chain_broadcast(isend, irecv, test, cancel, (uintptr_t)comm, (uintptr_t)byte,
                                 (char *)x.buf, x.len, segment, (r - root + n) % n, n, left,
                                 right, tag, spin_ns, deadline_ns, stopped, &step, &waiting);
        Py_END_ALLOW_THREADS
        steps = 0;   /* the loop below is the rings' */
    }
    Py_BEGIN_ALLOW_THREADS
    for (; step < steps; step++) {
        long sending, receiving;   /* piece numbers */
        if (step < n - 1) {
            sending = ((r - step - shift) % n + n) % n;
            receiving = ((r - step - 1 - shift) % n + n) % n;
        } else {
            long k = step - (n - 1);
            sending = ((r + 1 - k) % n + n) % n;
            receiving = ((r - k) % n + n) % n;
        }
        Py_ssize_t s0 = (Py_ssize_t)((long long)sending * count / n);
        Py_ssize_t s1 = (Py_ssize_t)((long long)(sending + 1) * count / n);
        Py_ssize_t r0 = (Py_ssize_t)((long long)receiving * count / n);
        Py_ssize_t r1 = (Py_ssize_t)((long long)(receiving + 1) * count / n);
        char *into = step < n - 1 ? arrived : data + r0 * item;
        memset(recv_req, 0, sizeof(recv_req));
        memset(send_req, 0, sizeof(send_req));
        if (irecv(into, (int)((r1 - r0) * item), (uintptr_t)byte, (int)left, tag,
                  (uintptr_t)comm, recv_req) != 0) {
            status = 3;
            break;
        }
        if (isend(data + s0 * item, (int)((s1 - s0) * item), (uintptr_t)byte, (int)right, tag,
                  (uintptr_t)comm, send_req) != 0) {
            cancel(recv_req);
            status = 3;
            break;
        }
        waiting = 0;
        status = ring_wait(test, recv_req, st, spin_ns, deadline_ns, stopped);
        if (status != 0) {
            cancel(recv_req);
            break;
        }
        if (step < n - 1) {
            void *srcs[2] = {data + r0 * item, arrived};
            reduce_into(data + r0 * item, srcs, 2, r1 - r0, dtype, op, 1);
        }
        waiting = 1;
        status = ring_wait(test, send_req, st, spin_ns, deadline_ns, stopped);
        if (status != 0) break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    PyBuffer_Release(&stop);
    PyBuffer_Release(&scratch);
    return Py_BuildValue("(lll)", status, step, waiting);
}

static PyMethodDef methods[] = {
    {"ring", ring, METH_O, "ring(bell): wake the doorbell at address `bell`."},
    {"set_spin_yield", set_spin_yield, METH_O,
     "set_spin_yield(on): spins yield the core at every turn (more ranks than cores)."},
    {"exit_after", exit_after, METH_VARARGS,
     "exit_after(seconds, code, say=b''): end the process with `code` that many seconds from "
     "now, first writing `say` to stderr, from a thread of its own (a watchdog over a call at "
     "exit that may never return)."},
    {"send", (PyCFunction)(void (*)(void))send, METH_FASTCALL,
     "send(lane, pos, tag, code, src) -> new position, or 0: a whole message."},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "take(lane, pos, tag, code, dst, spin_ns) -> new position, or 0: a whole one."},
    {"hot", (PyCFunction)(void (*)(void))hot, METH_FASTCALL,
     "hot(ctx, comm, kind, x, arg) -> x once a blocking small collective on a NumPy array ran "
     "whole (kind 0 all_reduce, arg its ReduceOp; 1 broadcast, arg the source rank; 2 "
     "all_gather, arg the output array), or None where the call is not that common case and "
     "nothing was done."},
    {"exchange", (PyCFunction)(void (*)(void))exchange, METH_FASTCALL,
     "exchange(ctx, comm, x, dst, y, src, tag) -> src once a blocking sendrecv of NumPy arrays "
     "ran (the core's send and take, or the rest in Python), or None where the call is not "
     "that common case and nothing was done."},
    {"reduce", reduce, METH_VARARGS,
     "reduce(out, srcs, count, dtype, op, divisor) -> bool: reduce srcs in order into out."},
    {"mpi_ring", mpi_ring, METH_VARARGS,
     "mpi_ring(calls, x, dtype, op, rank, size, tag, spin_ns, deadline_ns, stop, scratch, kind, "
     "root, segment) -> (status, step, waiting): one all_reduce (kind 0), reduce_scatter (1) or "
     "broadcast (2) of x on a ring over MPI point-to-point messages, without the GIL (0 done, "
     "1 deadline, 2 stopped, 3 MPI failed)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shmcore", NULL, -1, methods};

PyMODINIT_FUNC PyInit__shmcore(void) {
    if (PyType_Ready(&StagingType) < 0 || PyType_Ready(&MpiStepType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ENVELOPE_BYTES", ENVELOPE_BYTES) < 0
        || PyModule_AddIntConstant(m, "MPI_TAG_CODES", MPI_TAG_CODES) < 0
        || PyModule_AddIntConstant(m, "N_OPS", N_OPS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&StagingType);
    if (PyModule_AddObject(m, "Staging", (PyObject *)&StagingType) < 0) {
        Py_DECREF(&StagingType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&MpiStepType);
    if (PyModule_AddObject(m, "MpiStep", (PyObject *)&MpiStepType) < 0) {
        Py_DECREF(&MpiStepType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
