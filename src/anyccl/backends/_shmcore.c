/* The shm transport's per-call core, compiled: what every small operation does on every call,
 * done without the interpreter (see shm.py, which falls back to NumPy where this module is
 * missing or does not cover a dtype or reduction).
 *
 *   ring(bell)                       wake a doorbell (sem_post on its address)
 *   arrive(word, value, bells[, sig, agree])
 *                                    publish a counter (a release store), then ring each bell;
 *                                    with `sig`: first store the collective's signature there,
 *                                    which the counter then publishes: agree = (w0, w1, ...),
 *                                    stored as (w0 | (value & 0xFFFF) << 40, w1)
 *   reached(words, value, spin_ns[, sigs, agree])
 *                                    spin, without the GIL, until every counter is >= value;
 *                                    False once spin_ns passed (the caller sleeps and retries);
 *                                    with `sigs`, once reached: -1 if a peer's signature there
 *                                    differs from this rank's (as arrive stores it)
 *   stage(dst, src)                  copy the buffer `src` to the address `dst`
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
 *   one_shot(x, lane, epoch, ...)    a small all_reduce, reduce or broadcast whole: stage,
 *                                    arrive with the signature, spin until every peer arrived,
 *                                    compare, reduce or copy; one call where the above take four
 *
 * Addresses are Python ints (of shared mappings the caller keeps alive); buffers are objects
 * with the buffer protocol (NumPy arrays). Counters are aligned 8-byte words with one writer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

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

static PyObject *arrive(PyObject *self, PyObject *args) {
    PyObject *word, *bells, *sig = NULL, *agree = NULL;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "OKO!|OO!", &word, &value, &PyTuple_Type, &bells, &sig,
                          &PyTuple_Type, &agree))
        return NULL;
    void *addr;
    if (address(word, &addr) < 0) return NULL;
    if (sig != NULL) {
        void *at;
        uint64_t w[2];
        if (address(sig, &at) < 0 || signature(agree, value, w) < 0) return NULL;
        ((uint64_t *)at)[0] = w[0];  /* published by the release store of the counter below */
        ((uint64_t *)at)[1] = w[1];
    }
    __atomic_store_n((uint64_t *)addr, (uint64_t)value, __ATOMIC_RELEASE);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(bells); i++) {
        void *bell;
        if (address(PyTuple_GET_ITEM(bells, i), &bell) < 0) return NULL;
        sem_post((sem_t *)bell);
    }
    Py_RETURN_NONE;
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
        if ((iter & 63) == 0) {
            uint64_t t = now_ns();
            if (end == 0) end = t + spin_ns;
            else if (t >= end) return 0;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
}

static PyObject *reached(PyObject *self, PyObject *args) {
    PyObject *words, *sigs = NULL, *agree = NULL;
    unsigned long long value, spin_ns;
    if (!PyArg_ParseTuple(args, "O!KK|O!O!", &PyTuple_Type, &words, &value, &spin_ns,
                          &PyTuple_Type, &sigs, &PyTuple_Type, &agree))
        return NULL;
    uint64_t w[2] = {0, 0};
    if (sigs != NULL && signature(agree, value, w) < 0) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(words);
    if (n > MAX_WORDS || (sigs != NULL && PyTuple_GET_SIZE(sigs) != n)) {
        PyErr_SetString(PyExc_ValueError, "reached: too many counters, or signatures not one "
                                          "per counter");
        return NULL;
    }
    const uint64_t *addr[MAX_WORDS];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (address(PyTuple_GET_ITEM(words, i), (void **)&addr[i]) < 0) return NULL;
    }
    int done;
    Py_BEGIN_ALLOW_THREADS
    done = spin_until(addr, n, value, spin_ns);
    Py_END_ALLOW_THREADS
    if (done && sigs != NULL) {  /* the counters' acquire loads made the signatures visible */
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint64_t *sig;
            if (address(PyTuple_GET_ITEM(sigs, i), (void **)&sig) < 0) return NULL;
            if (sig[0] != w[0] || sig[1] != w[1]) return PyLong_FromLong(-1);
        }
    }
    return PyBool_FromLong(done);
}

static PyObject *stage(PyObject *self, PyObject *args) {
    PyObject *dst;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "Oy*", &dst, &src)) return NULL;
    void *addr;
    if (address(dst, &addr) < 0) { PyBuffer_Release(&src); return NULL; }
    memcpy(addr, src.buf, (size_t)src.len);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
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
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            state = message_state(&m, total);
            if ((iter & 63) == 0 && now_ns() >= end) break;
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

/* one_shot(x, lane, epoch, agree, dtype, op, divisor, reduce_here, source) -> 1, 0 or -1: a
 * small collective's whole schedule in one call (a message that fits one staging half).
 * `lane` holds what does not change from call to call, for one staging half and one barrier
 * parity: (halves, rank, arrive_word, bells, sig, words, sigs, spin_ns).
 * source < 0 (all_reduce, reduce): stage x at halves[rank], arrive as `arrive` does (with the
 * signature `agree` at sig, unless agree is None), spin as `reached` does, then, if every rank
 * arrived with the same signature and reduce_here, reduce the staged halves in rank order into
 * x as `reduce` does. source >= 0 (broadcast from that rank): only the source stages x; once
 * every rank arrived with the same signature, the others copy its half into x.
 * 1: done; -1: every rank arrived and a signature differs (x untouched); 0: arrived, but the
 * peers had not within spin_ns (the caller waits, compares, then reduces or copies). */
static PyObject *one_shot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 8) {
        PyErr_SetString(PyExc_TypeError, "one_shot(x, lane, epoch, agree, dtype, op, divisor, "
                                         "reduce_here, source): lane is a tuple of 8");
        return NULL;
    }
    PyObject *lane = args[1];
    PyObject *halves = PyTuple_GET_ITEM(lane, 0), *bells = PyTuple_GET_ITEM(lane, 3);
    PyObject *words = PyTuple_GET_ITEM(lane, 5), *sigs = PyTuple_GET_ITEM(lane, 6);
    PyObject *agree = args[3] == Py_None ? NULL : args[3];
    if (!PyTuple_Check(halves) || !PyTuple_Check(bells) || !PyTuple_Check(words)
        || !PyTuple_Check(sigs)) {
        PyErr_SetString(PyExc_TypeError, "one_shot: the lane's halves, bells, words and sigs "
                                         "are tuples");
        return NULL;
    }
    Py_ssize_t rank = PyLong_AsSsize_t(PyTuple_GET_ITEM(lane, 1));
    unsigned long long spin_ns = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(lane, 7));
    unsigned long long epoch = PyLong_AsUnsignedLongLong(args[2]);
    int dtype = (int)PyLong_AsLong(args[4]), op = (int)PyLong_AsLong(args[5]);
    long divisor = PyLong_AsLong(args[6]);
    int reduce_here = PyObject_IsTrue(args[7]);
    Py_ssize_t source = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t size = PyTuple_GET_SIZE(halves), n = PyTuple_GET_SIZE(words);
    if (size < 2 || size > MAX_WORDS || rank < 0 || rank >= size || n != size - 1
        || PyTuple_GET_SIZE(sigs) != n || divisor < 1 || source >= size) {
        PyErr_SetString(PyExc_ValueError, "one_shot: bad arguments");
        return NULL;
    }
    void *at[MAX_WORDS];
    for (Py_ssize_t i = 0; i < size; i++)
        if (address(PyTuple_GET_ITEM(halves, i), &at[i]) < 0) return NULL;
    void *arrive_word, *sig = NULL;
    uint64_t w[2] = {0, 0};
    if (address(PyTuple_GET_ITEM(lane, 2), &arrive_word) < 0) return NULL;
    if (agree != NULL) {
        if (!PyTuple_Check(agree) || address(PyTuple_GET_ITEM(lane, 4), &sig) < 0
            || signature(agree, epoch, w) < 0)
            return NULL;
    }
    const uint64_t *peer[MAX_WORDS];
    for (Py_ssize_t i = 0; i < n; i++)
        if (address(PyTuple_GET_ITEM(words, i), (void **)&peer[i]) < 0) return NULL;
    Py_buffer x;
    if (PyObject_GetBuffer(args[0], &x, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (source < 0 || source == rank) memcpy(at[rank], x.buf, (size_t)x.len);
    if (sig != NULL) {   /* published by the release store of the counter below */
        ((uint64_t *)sig)[0] = w[0];
        ((uint64_t *)sig)[1] = w[1];
    }
    __atomic_store_n((uint64_t *)arrive_word, (uint64_t)epoch, __ATOMIC_RELEASE);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(bells); i++) {
        void *bell;
        if (address(PyTuple_GET_ITEM(bells, i), &bell) < 0) { PyBuffer_Release(&x); return NULL; }
        sem_post((sem_t *)bell);
    }
    int done;
    Py_BEGIN_ALLOW_THREADS
    done = spin_until(peer, n, epoch, spin_ns);
    Py_END_ALLOW_THREADS
    long status = done;
    if (done && sig != NULL) {   /* the counters' acquire loads made the signatures visible */
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint64_t *s;
            if (address(PyTuple_GET_ITEM(sigs, i), (void **)&s) < 0) {
                PyBuffer_Release(&x);
                return NULL;
            }
            if (s[0] != w[0] || s[1] != w[1]) status = -1;
        }
    }
    if (status == 1 && source >= 0) {
        if (source != rank) memcpy(x.buf, at[source], (size_t)x.len);
    } else if (status == 1 && reduce_here
               && !reduce_into(x.buf, at, size, x.len / (x.itemsize ? x.itemsize : 1), dtype, op,
                               divisor)) {
        PyErr_SetString(PyExc_ValueError, "one_shot: a dtype and op the core does not reduce");
    }
    PyBuffer_Release(&x);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(status);
}

static PyMethodDef methods[] = {
    {"one_shot", (PyCFunction)(void (*)(void))one_shot, METH_FASTCALL,
     "one_shot(x, lane, epoch, agree, dtype, op, divisor, reduce_here, source) -> 1 done, 0 "
     "peers not there yet, -1 signatures differ."},
    {"ring", ring, METH_O, "ring(bell): wake the doorbell at address `bell`."},
    {"arrive", arrive, METH_VARARGS,
     "arrive(word, value, bells[, sig, agree]): store the signature `agree` at sig, then value "
     "at address word (release), ring each bell."},
    {"reached", reached, METH_VARARGS,
     "reached(words, value, spin_ns[, sigs, agree]) -> bool: every counter >= value, spinning "
     "up to spin_ns; -1 if then a signature at sigs differs from `agree`'s."},
    {"stage", stage, METH_VARARGS, "stage(dst, src): copy buffer src to address dst."},
    {"send", (PyCFunction)(void (*)(void))send, METH_FASTCALL,
     "send(lane, pos, tag, code, src) -> new position, or 0: a whole message."},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "take(lane, pos, tag, code, dst, spin_ns) -> new position, or 0: a whole one."},
    {"reduce", reduce, METH_VARARGS,
     "reduce(out, srcs, count, dtype, op, divisor) -> bool: reduce srcs in order into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shmcore", NULL, -1, methods};

PyMODINIT_FUNC PyInit__shmcore(void) { return PyModule_Create(&module); }
