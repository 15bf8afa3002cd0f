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
//
// The future holds the tensors as a typed IValue (a Tensor, a list of them, or a list of lists):
// a future completed from Python holds a Python object, and torch then pickles it, on completion
// and again in DDP's reducer, to find its tensors.
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// `result` (None, a tensor, a list of tensors or a list of lists of tensors) as a typed IValue,
// with its type; TypeError for anything else.
std::pair<c10::IValue, c10::TypePtr> typed(const py::handle& result) {
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

  // The caller's stream and device as they were: (stream id, device index, device type, the
  // device to make current again or -1).
  py::tuple enter() {
    const c10::Device device = stream_.device();
    const c10::Device was = impl_->getDevice();
    if (was != device) {
      impl_->setDevice(device);
    }
    event_.record(impl_->getStream(device));
    event_.block(stream_);
    const auto previous = impl_->exchangeStream(stream_).pack3();
    return py::make_tuple(previous.stream_id, previous.device_index,
                          static_cast<int64_t>(previous.device_type),
                          was == device ? -1 : static_cast<int64_t>(was.index()));
  }

  c10::intrusive_ptr<c10d::Work> leave(const py::tuple& previous, const py::list& used,
                                       const py::handle& result) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      for (const auto& item : used) {
        const at::Tensor& t = THPVariable_Unpack(item.ptr());
        if (t.device().type() == stream_.device_type()) {
          t.record_stream(stream_);
        }
      }
      auto [value, type] = typed(result);
      future = c10::make_intrusive<c10::ivalue::Future>(std::move(type), devices_);
      future->markCompleted(std::move(value));   // its events record the side stream
    } catch (...) {
      restore(previous);
      throw;
    }
    restore(previous);
    return c10d::Work::create_from_future(future);
  }

  void restore(const py::tuple& previous) {
    impl_->exchangeStream(c10::Stream::unpack3(
        previous[0].cast<int64_t>(), previous[1].cast<c10::DeviceIndex>(),
        static_cast<c10::DeviceType>(previous[2].cast<int64_t>())));
    const auto device = previous[3].cast<int64_t>();
    if (device >= 0) {
      impl_->setDevice(c10::Device(stream_.device_type(), static_cast<c10::DeviceIndex>(device)));
    }
  }

 private:
  c10::Stream stream_;
  c10::Event event_;
  const c10::impl::DeviceGuardImplInterface* impl_;
  std::vector<c10::Device> devices_;
};

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
  m.attr("tensor_key") = py::capsule(reinterpret_cast<void*>(&anyccl_tensor_key),
                                     "anyccl._torchcore.tensor_key");
}
