// The torch process group's compiled part (anyccl/torch_core.py builds it against the installed
// torch the first time a group needs it): what each operation of the group does around anyccl's
// own call, in two calls instead of a dozen Python ones.
//
//   previous = side.enter()          # the side stream waits for the caller's stream, then is
//                                    # the current one (and the device the current device)
//   ... anyccl's call, queued on the current stream ...
//   work = side.leave(previous, used, result)
//                                    # the tensors marked as used by the side stream, a torch
//                                    # Work whose CUDA future records the side stream and holds
//                                    # `result`, the caller's stream and device back
//   side.restore(previous)           # instead of leave when the call failed
//   work = completed(result)         # a Work whose CPU future holds `result` (host tensors)
//   tensor_key                       # a capsule: the C function that reads a tensor's plan key
//                                    # for the compiled replay (anyccl/_cudacore.c)
//   install_allreduce(group, ...)    # the group's all_reduce as a C++ backend of torch's, for
//                                    # CPU and CUDA: a replayed CUDA one whole in C++, without
//                                    # the group's Python; every other one back in its Python
//
// The future holds the tensors as a typed IValue (a Tensor, a list of them, or a list of lists):
// a future completed from Python holds a Python object, and torch then pickles it, on completion
// and again in DDP's reducer, to find its tensors.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <optional>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// A future's value and its type.
using Typed = std::pair<c10::IValue, c10::TypePtr>;

// `result` (None, a tensor, a list of tensors or a list of lists of tensors) as a typed IValue,
// with its type; TypeError for anything else.
Typed typed(const py::handle& result) {
  if (result.is_none()) {
    return {c10::IValue(), c10::NoneType::get()};
  }
  if (THPVariable_Check(result.ptr())) {
    return {c10::IValue(THPVariable_Unpack(result.ptr())), c10::TensorType::get()};
  }
  if (!py::isinstance<py::list>(result)) {
    throw py::type_error("a torch Work's result must be None, a tensor, a list of tensors or "
                         "a list of lists of tensors");
  }
  auto items = result.cast<py::list>();
  if (items.size() > 0 && py::isinstance<py::list>(items[0])) {
    c10::List<c10::List<at::Tensor>> outer;
    outer.reserve(items.size());
    for (const auto& inner : items) {
      outer.push_back(c10::List<at::Tensor>(inner.cast<std::vector<at::Tensor>>()));
    }
    return {c10::IValue(std::move(outer)), c10::ListType::create(c10::ListType::ofTensors())};
  }
  return {c10::IValue(c10::List<at::Tensor>(result.cast<std::vector<at::Tensor>>())),
          c10::ListType::ofTensors()};
}

c10::intrusive_ptr<c10d::Work> completed(const py::handle& result) {
  auto [value, type] = typed(result);
  auto future = c10::make_intrusive<c10::ivalue::Future>(std::move(type));
  future->markCompleted(std::move(value));
  return c10d::Work::create_from_future(future);
}

// A communicator's own stream on one device and the event that orders it after a caller's.
class Side {
 public:
  Side(int64_t stream_id, int64_t device_index, int64_t device_type)
      : stream_(c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                                     static_cast<c10::DeviceType>(device_type))),
        event_(stream_.device_type()),
        impl_(c10::impl::getDeviceGuardImpl(stream_.device_type())),
        devices_{stream_.device()} {}

  // What enter() replaced: the caller's current stream on the side's device, and the device
  // to make current again (nullopt where it was the side's own).
  struct Caller {
    c10::Stream stream;
    std::optional<c10::Device> device;
  };

  // The side stream after the caller's current one, and current (its device too).
  Caller enter_caller() {
    const c10::Device device = stream_.device();
    const c10::Device was = impl_->getDevice();
    if (was != device) {
      impl_->setDevice(device);
    }
    event_.record(impl_->getStream(device));
    event_.block(stream_);
    return {impl_->exchangeStream(stream_),
            was == device ? std::nullopt : std::optional<c10::Device>(was)};
  }

  void restore_caller(const Caller& caller) {
    impl_->exchangeStream(caller.stream);
    if (caller.device) {
      impl_->setDevice(*caller.device);
    }
  }

  // leave() for one tensor, used and returned (a replayed all_reduce): the Work's CUDA future
  // holds [t] and records the side stream; the caller's stream and device back.
  c10::intrusive_ptr<c10d::Work> leave_one(const Caller& caller, const at::Tensor& t) {
    return finish(caller, [&] {
      t.record_stream(stream_);
      return Typed{c10::IValue(c10::List<at::Tensor>({t})), c10::ListType::ofTensors()};
    });
  }

  // The caller's stream and device as they were: (stream id, device index, device type, the
  // device to make current again or -1).
  py::tuple enter() {
    const Caller caller = enter_caller();
    const auto previous = caller.stream.pack3();
    return py::make_tuple(previous.stream_id, previous.device_index,
                          static_cast<int64_t>(previous.device_type),
                          caller.device ? static_cast<int64_t>(caller.device->index()) : -1);
  }

  c10::intrusive_ptr<c10d::Work> leave(const py::tuple& previous, const py::list& used,
                                       const py::handle& result) {
    return finish(unpacked(previous), [&] {
      for (const auto& item : used) {
        const at::Tensor& t = THPVariable_Unpack(item.ptr());
        if (t.device().type() == stream_.device_type()) {
          t.record_stream(stream_);
        }
      }
      return typed(result);
    });
  }

  void restore(const py::tuple& previous) { restore_caller(unpacked(previous)); }

 private:
  // enter()'s tuple back as the Caller it was made from.
  Caller unpacked(const py::tuple& previous) const {
    const auto device = previous[3].cast<int64_t>();
    return {c10::Stream::unpack3(previous[0].cast<int64_t>(),
                                 previous[1].cast<c10::DeviceIndex>(),
                                 static_cast<c10::DeviceType>(previous[2].cast<int64_t>())),
            device < 0 ? std::nullopt
                       : std::optional<c10::Device>(c10::Device(
                             stream_.device_type(), static_cast<c10::DeviceIndex>(device)))};
  }

  // The Work whose CUDA future holds what `mark` returns (after it has marked the tensors it
  // used as used by the side stream); the future's events record the side stream. The
  // caller's stream and device are current again afterwards, also when `mark` raises.
  template <typename Mark>
  c10::intrusive_ptr<c10d::Work> finish(const Caller& caller, Mark mark) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      auto [value, type] = mark();
      future = c10::make_intrusive<c10::ivalue::Future>(std::move(type), devices_);
      future->markCompleted(std::move(value));
    } catch (...) {
      restore_caller(caller);
      throw;
    }
    restore_caller(caller);
    return c10d::Work::create_from_future(future);
  }

  c10::Stream stream_;
  c10::Event event_;
  const c10::impl::DeviceGuardImplInterface* impl_;
  std::vector<c10::Device> devices_;
};

// Whether the interpreter is shutting down (no other thread may take the GIL then).
inline bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// A Python object kept by C++ code that torch may drop on any thread, with or without the GIL:
// released under the GIL, and left alone once the interpreter is gone or going.
class Held {
 public:
  explicit Held(py::handle h) : ptr_(h.inc_ref().ptr()) {}
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  ~Held() {
    if (ptr_ != nullptr && Py_IsInitialized() && !finalizing()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(ptr_);
    }
  }
  py::handle get() const { return ptr_; }

 private:
  PyObject* ptr_;
};

// The group's all_reduce, registered with torch as the group's backend for CPU and CUDA tensors
// (install_allreduce): DDP's reducer, dist.all_reduce and the functional collectives reach it
// through torch's dispatcher, as they reach NCCL's, instead of through the Python group. A
// blocking all_reduce of one dense CUDA tensor that anyccl has a plan for runs here whole: the
// group's side stream after the caller's (Side::enter_caller), the communicator's compiled replay
// (the same call Communicator.all_reduce makes first, with its checks, numbering, flight
// record, deadline and watchdog), then the Work (Side::leave_one). Every other call -- host
// tensors, several tensors, a first call, a failed or busy queue, an op with no replay -- goes
// to the group's Python all_reduce (`_python_allreduce`), which keeps every other promise. Every
// other collective reaching this backend is refused by name, as torch's placeholder backend
// refuses it: the group's own methods serve them.
class Allreduce : public c10d::Backend {
 public:
  // group: a weak reference to the Python group; sides: its {device index: Side}; gpu: its
  // communicator's GPU side (whose `compiled_replay` is None until a plan exists); tags: {c10d
  // RedOpType: the replay's tag for that op}.
  Allreduce(int rank, int size, py::handle group, py::handle sides, py::handle gpu,
            py::handle tags)
      : c10d::Backend(rank, size), group_(group), sides_(sides), gpu_(gpu), tags_(tags) {}

  const std::string getBackendName() const override { return "anyccl"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const auto start = Clock::now();
    py::gil_scoped_acquire gil;
    Timed timed{*this, start};
    if (tensors.size() == 1 && tensors[0].is_cuda() && tensors[0].layout() == c10::kStrided &&
        !opts.sparseIndices.has_value()) {
      if (auto work = replayed(tensors[0], opts, start)) {
        ++replays_;
        return work;
      }
    }
    py::object group = group_.get()();
    if (group.is_none()) {
      throw std::runtime_error("anyccl: the process group of this all_reduce is gone");
    }
    return group.attr("_python_allreduce")(tensors, opts)
        .cast<c10::intrusive_ptr<c10d::Work>>();
  }

  // {"calls", "replayed" (of them, whole here), "seconds" (in all of them), "parts": seconds of
  // the replayed ones by part: "gil" (until it was held), "enter" (the side stream after the
  // caller's), "replay" (the communicator's compiled replay, with the tensor's Python object),
  // "leave" (the Work and its CUDA future)}: read under the GIL.
  py::dict stats() const {
    py::dict parts, out;
    for (size_t i = 0; i < kParts; ++i) parts[kPartNames[i]] = parts_[i];
    out["calls"] = calls_;
    out["replayed"] = replays_;
    out["seconds"] = nanoseconds_ * 1e-9;
    out["parts"] = parts;
    return out;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kParts = 4;
  static constexpr const char* kPartNames[kParts] = {"gil", "enter", "replay", "leave"};

  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  // The replayed all_reduce's Work, or null where the Python way must take the call (nothing
  // of it queued, the caller's stream and device as they were).
  c10::intrusive_ptr<c10d::Work> replayed(const at::Tensor& t,
                                          const c10d::AllreduceOptions& opts,
                                          Clock::time_point start) {
    const auto held = Clock::now();
    PyObject* tag = PyDict_GetItem(tags_.get().ptr(), py::int_(static_cast<int>(
                                                          opts.reduceOp.op_)).ptr());
    if (tag == nullptr) return {};
    py::object replay = gpu_.get().attr("compiled_replay");
    if (replay.is_none()) return {};
    PyObject* found = PyDict_GetItem(sides_.get().ptr(), py::int_(t.get_device()).ptr());
    if (found == nullptr) return {};
    Side& side = py::handle(found).cast<Side&>();
    const Side::Caller caller = side.enter_caller();
    const auto entered = Clock::now();
    bool done = false;
    try {
      py::object tensor = py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
      done = replay(py::handle(tag), tensor).cast<bool>();
    } catch (...) {
      side.restore_caller(caller);
      throw;
    }
    if (!done) {
      side.restore_caller(caller);
      return {};
    }
    const auto queued = Clock::now();
    auto work = side.leave_one(caller, t);
    const auto left = Clock::now();
    parts_[0] += seconds(start, held);
    parts_[1] += seconds(held, entered);
    parts_[2] += seconds(entered, queued);
    parts_[3] += seconds(queued, left);
    return work;
  }

  // Counts a call and its time on the way out (the GIL held: the counters need no lock).
  struct Timed {
    Allreduce& owner;
    Clock::time_point start;
    ~Timed() {
      ++owner.calls_;
      owner.nanoseconds_ += static_cast<double>(std::chrono::duration_cast<
          std::chrono::nanoseconds>(Clock::now() - start).count());
    }
  };

  Held group_, sides_, gpu_, tags_;
  int64_t calls_ = 0, replays_ = 0;
  double nanoseconds_ = 0, parts_[kParts] = {};
};

// The compiled all_reduce's counts and times for `group` (Allreduce::stats), None where it
// has none.
py::object allreduce_stats(py::handle group) {
  auto* pg = group.cast<c10d::ProcessGroup*>();
  c10::intrusive_ptr<c10d::Backend> found;
  try {
    found = pg->getBackend(c10::DeviceType::CUDA);
  } catch (const c10::Error&) {
    return py::none();
  }
  auto* backend = dynamic_cast<Allreduce*>(found.get());
  return backend == nullptr ? py::none() : py::object(backend->stats());
}

// Register the group's all_reduce backend (Allreduce) with torch's C++ ProcessGroup under
// `group`, for CPU and CUDA tensors, in the place torch looks for a backend per device.
void install_allreduce(py::handle group, py::handle ref, py::handle sides, py::handle gpu,
                       py::handle tags) {
  auto* pg = group.cast<c10d::ProcessGroup*>();
  auto backend = c10::make_intrusive<Allreduce>(pg->getRank(), pg->getSize(), ref, sides, gpu,
                                                tags);
  for (const auto device : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    pg->setBackend(device, c10d::ProcessGroup::BackendType::CUSTOM,
                   c10::intrusive_ptr<c10d::Backend>(backend));
  }
}

}  // namespace

// The part of a plan's key that plans.py reads from a tensor (`Plans.find`): a new reference to
// (data_ptr, numel, dtype) for a dense, contiguous tensor without the negative bit; None for
// any other tensor (no plan: the Python way decides); NULL with TypeError for a non-tensor.
// Called by the compiled replay through the capsule `tensor_key`, with the GIL held.
extern "C" PyObject* anyccl_tensor_key(PyObject* obj) {
  if (!THPVariable_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "tensor_key: not a torch tensor");
    return nullptr;
  }
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided || t.is_neg() || !t.is_contiguous()) {
      Py_RETURN_NONE;
    }
    PyObject* ptr = PyLong_FromVoidPtr(const_cast<void*>(t.const_data_ptr()));
    if (ptr == nullptr) return nullptr;
    return Py_BuildValue("(NLO)", ptr, static_cast<long long>(t.numel()),
                         reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())));
  } catch (const std::exception&) {  // no storage (a wrapper subclass): no plan
    Py_RETURN_NONE;
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "the torch process group's compiled part (anyccl/torch_core.py)";
  m.def("completed", &completed, py::arg("result"),
        "A torch Work whose CPU future is complete with `result`.");
  py::class_<Side>(m, "Side")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("stream_id"),
           py::arg("device_index"), py::arg("device_type"))
      .def("enter", &Side::enter)
      .def("leave", &Side::leave, py::arg("previous"), py::arg("used"), py::arg("result"))
      .def("restore", &Side::restore, py::arg("previous"));
  m.def("install_allreduce", &install_allreduce, py::arg("group"), py::arg("ref"),
        py::arg("sides"), py::arg("gpu"), py::arg("tags"),
        "Serve `group`'s all_reduce from C++ (see Allreduce); `ref` a weak reference to it.");
  m.def("allreduce_stats", &allreduce_stats, py::arg("group"),
        "{calls, replayed, seconds, parts} of `group`'s compiled all_reduce (Allreduce::stats), "
        "or None.");
  m.attr("tensor_key") = py::capsule(reinterpret_cast<void*>(&anyccl_tensor_key),
                                     "anyccl._torchcore.tensor_key");
}
