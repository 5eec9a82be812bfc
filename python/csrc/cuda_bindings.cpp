// hemiola._C.cuda: the CUDA kernels (cuda/kernels.h), compiled in only when
// the build has CUDA. Like the engine bindings, tensors cross as integers
// (device pointers, element counts, dtype codes) and streams as the integer
// handle torch gives (torch.cuda.current_stream().cuda_stream; 0 = legacy
// default stream). Every call only enqueues work; the GIL is released around
// it because the first CUDA call of a process may initialise a context.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings.h"
#include "kernels.h"

namespace py = pybind11;

namespace hemiola::python {

namespace {

template <typename T>
T* pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

DType dtype_of(int code) {
  const auto dtype = static_cast<DType>(code);
  (void)dtype_size(dtype);  // validates the code
  return dtype;
}

cuda::SgdHyper sgd_hyper(double lr, double momentum, double dampening, double weight_decay,
                         bool nesterov, bool maximize, bool first_step) {
  cuda::SgdHyper hyper;
  hyper.lr = lr;
  hyper.momentum = momentum;
  hyper.dampening = dampening;
  hyper.weight_decay = weight_decay;
  hyper.nesterov = nesterov;
  hyper.maximize = maximize;
  hyper.first_step = first_step;
  return hyper;
}

}  // namespace

void bind_cuda(py::module_& m) {
  py::module_ cuda = m.def_submodule("cuda", "CUDA kernels of the engine (raw pointers)");
  using Release = py::call_guard<py::gil_scoped_release>;

  cuda.attr("FUSION_SLOT_BYTES") = sizeof(cuda::FusionSlot);

  cuda.def(
      "pack",
      [](std::uintptr_t slots, std::int64_t slot_count, std::int64_t extent, int dtype,
         std::uintptr_t buffer, std::uintptr_t stream) {
        cuda::pack(pointer<const cuda::FusionSlot>(slots), slot_count, extent, dtype_of(dtype),
                   pointer<void>(buffer), pointer<void>(stream));
      },
      py::arg("slots"), py::arg("slot_count"), py::arg("extent"), py::arg("dtype"),
      py::arg("buffer"), py::arg("stream"), Release(),
      "Copies every slot's tensor into the fusion buffer in one launch. `slots` is a device "
      "array of (data pointer, offset, numel) int64 triples sorted by offset.");
  cuda.def(
      "unpack",
      [](std::uintptr_t slots, std::int64_t slot_count, std::int64_t extent, int dtype,
         std::uintptr_t buffer, double scale, std::uintptr_t stream) {
        cuda::unpack(pointer<const cuda::FusionSlot>(slots), slot_count, extent, dtype_of(dtype),
                     pointer<const void>(buffer), scale, pointer<void>(stream));
      },
      py::arg("slots"), py::arg("slot_count"), py::arg("extent"), py::arg("dtype"),
      py::arg("buffer"), py::arg("scale"), py::arg("stream"), Release(),
      "Copies the fusion buffer back into every slot's tensor, times `scale`, in one launch.");
  cuda.def(
      "cast",
      [](std::uintptr_t src, int src_dtype, std::uintptr_t dst, int dst_dtype,
         std::int64_t numel, std::uintptr_t stream) {
        cuda::cast(pointer<const void>(src), dtype_of(src_dtype), pointer<void>(dst),
                   dtype_of(dst_dtype), numel, pointer<void>(stream));
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"),
      py::arg("numel"), py::arg("stream"), Release(),
      "float32 <-> float16/bfloat16 conversion (round to nearest even).");
  cuda.def(
      "cast_divide",
      [](std::uintptr_t src, std::uintptr_t dst, int half, std::int64_t numel, float divisor,
         std::uintptr_t stream) {
        cuda::cast_divide(pointer<const float>(src), pointer<void>(dst), dtype_of(half), numel,
                          divisor, pointer<void>(stream));
      },
      py::arg("src"), py::arg("dst"), py::arg("half"), py::arg("numel"), py::arg("divisor"),
      py::arg("stream"), Release(),
      "float32 -> float16/bfloat16, then divided in that type: the wire format of DDP's "
      "fp16/bf16 hooks, buffer.to(half).div_(world_size).");
  cuda.def(
      "sgd_step",
      [](std::uintptr_t param, std::uintptr_t shadow, std::uintptr_t momentum_buffer,
         std::uintptr_t grad, std::int64_t numel, int dtype, double lr, double momentum,
         double dampening, double weight_decay, bool nesterov, bool maximize, bool first_step,
         bool commit, std::uintptr_t stream) {
        const cuda::SgdTensors tensors{pointer<void>(param), pointer<void>(shadow),
                                       pointer<void>(momentum_buffer), pointer<const void>(grad)};
        cuda::sgd_step(tensors, numel, dtype_of(dtype),
                       sgd_hyper(lr, momentum, dampening, weight_decay, nesterov, maximize,
                                 first_step),
                       commit, pointer<void>(stream));
      },
      py::arg("param"), py::arg("shadow"), py::arg("momentum_buffer"), py::arg("grad"),
      py::arg("numel"), py::arg("dtype"), py::kw_only(), py::arg("lr"), py::arg("momentum"),
      py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"), py::arg("maximize"),
      py::arg("first_step"), py::arg("commit"), py::arg("stream"), Release(),
      "One torch.optim.SGD step from the shadow parameters into param (and, when committing, "
      "into the shadow and the momentum buffer).");
  cuda.def(
      "adam_step",
      [](std::uintptr_t param, std::uintptr_t shadow, std::uintptr_t exp_avg,
         std::uintptr_t exp_avg_sq, std::uintptr_t grad, std::int64_t numel, int dtype,
         double lr, double beta1, double beta2, double eps, double weight_decay,
         bool decoupled_weight_decay, bool maximize, bool amsgrad, std::int64_t step,
         bool commit, std::uintptr_t stream) {
        const cuda::AdamTensors tensors{pointer<void>(param), pointer<void>(shadow),
                                        pointer<void>(exp_avg), pointer<void>(exp_avg_sq),
                                        pointer<const void>(grad)};
        cuda::AdamHyper hyper;
        hyper.lr = lr;
        hyper.beta1 = beta1;
        hyper.beta2 = beta2;
        hyper.eps = eps;
        hyper.weight_decay = weight_decay;
        hyper.decoupled_weight_decay = decoupled_weight_decay;
        hyper.maximize = maximize;
        hyper.amsgrad = amsgrad;
        hyper.step = step;
        cuda::adam_step(tensors, numel, dtype_of(dtype), hyper, commit, pointer<void>(stream));
      },
      py::arg("param"), py::arg("shadow"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("grad"), py::arg("numel"), py::arg("dtype"), py::kw_only(), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("decoupled_weight_decay"), py::arg("maximize"), py::arg("amsgrad"),
      py::arg("step"), py::arg("commit"), py::arg("stream"), Release(),
      "One torch.optim.Adam/AdamW step from the shadow state into param (and, when "
      "committing, into the shadow and the moments). amsgrad is refused.");
}

}  // namespace hemiola::python
