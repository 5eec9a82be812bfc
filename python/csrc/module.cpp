// The hemiola._C extension module.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "hemiola/hemiola.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "hemiola native engine (framework-agnostic; see hemiola/*.h)";

  // Error codes become Python exceptions: HemiolaError (a RuntimeError) and,
  // for timeouts, HemiolaTimeoutError (also a TimeoutError).
  static py::exception<hemiola::Error> base(m, "HemiolaError", PyExc_RuntimeError);
  static PyObject* timeout_type = PyErr_NewException(
      "hemiola._C.HemiolaTimeoutError",
      py::make_tuple(base, py::handle(PyExc_TimeoutError)).ptr(), nullptr);
  m.attr("HemiolaTimeoutError") = py::handle(timeout_type);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hemiola::Error& e) {
      if (e.code() == hemiola::ErrorCode::kTimeout) {
        PyErr_SetString(timeout_type, e.what());
      } else if (e.code() == hemiola::ErrorCode::kInvalidArgument) {
        PyErr_SetString(PyExc_ValueError, e.what());
      } else if (e.code() == hemiola::ErrorCode::kNotFinite) {
        PyErr_SetString(PyExc_FloatingPointError, e.what());
      } else {
        PyErr_SetString(base.ptr(), e.what());
      }
    }
  });

  m.def("build_info", &hemiola::build_info, "What this build compiled in, and why not.");
  m.def("interface_reaching", &hemiola::interface_reaching, py::arg("host"),
        "The local interface whose address routes to host ('' when none).");
  m.attr("cuda_compiled") = py::bool_(HEMIOLA_CUDA_ENABLED != 0);
  m.attr("__version__") = HEMIOLA_VERSION;
  hemiola::python::bind_engine(m);
  hemiola::python::bind_cluster(m);
  hemiola::python::bind_optim(m);  // _C.optim.Hyper, which the ps and Updater calls take
  hemiola::python::bind_ps(m);
  hemiola::python::bind_updater(m);
  hemiola::python::bind_streamer(m);
#if HEMIOLA_CUDA_ENABLED
  hemiola::python::bind_cuda(m);
#endif
}
