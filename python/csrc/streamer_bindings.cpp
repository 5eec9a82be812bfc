// hemiola._C.Streamer: the streaming schedule (hemiola/streamer.h). Parameters
// arrive as (name, data pointer, dtype code, element count); state comes back
// as writable memoryviews over the engine's buffers (no copy).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "hemiola/hemiola.h"

namespace py = pybind11;

namespace hemiola::python {

namespace {

py::object view_of(const TensorRef& ref) {
  if (ref.data == nullptr) return py::none();
  return py::memoryview::from_memory(ref.data, static_cast<ssize_t>(ref.nbytes()));
}

}  // namespace

void bind_streamer(py::module_& m) {
  py::class_<Streamer>(m, "Streamer", "The streaming schedule; see hemiola/streamer.h.")
      .def("after_inner_step", &Streamer::after_inner_step,
           py::call_guard<py::gil_scoped_release>(),
           "After each inner optimizer step: lands the fragment whose overlap ends and sends "
           "the fragments due.")
      .def("finish_step", &Streamer::finish_step, py::call_guard<py::gil_scoped_release>(),
           "The rest of an inner step whose after_inner_step() raised (elastic membership).")
      .def("rejoin", &Streamer::rejoin, py::arg("across"), py::arg("redo"),
           py::call_guard<py::gil_scoped_release>(),
           "Moves the averages to engine `across` (a rendezvous); `redo`: average the failed "
           "fragment in flight again there, else keep its average. The caller keeps `across` "
           "alive as long as the streamer uses it.")
      .def("adopt", &Streamer::adopt, py::arg("inner_steps"), py::arg("syncs"),
           py::arg("momentum_started"),
           "A joining group takes the run's counts; its live values become the shared copy.")
      .def_property_readonly("in_flight_averaged", &Streamer::in_flight_averaged)
      .def_property_readonly("in_flight_round", &Streamer::in_flight_round)
      .def("offer", &Streamer::offer, py::arg("epoch"))
      .def_property_readonly("agreed_offer", &Streamer::agreed_offer)
      .def("next_step_fragments", &Streamer::next_step_fragments,
           "The fragments the next after_inner_step() reads or writes the live values of.")
      .def_property_readonly("inner_steps", &Streamer::inner_steps)
      .def("wait_in_flight", &Streamer::wait_in_flight, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("waited_ms", &Streamer::waited_ms)
      .def_property_readonly("host_ms", &Streamer::host_ms)
      .def_property_readonly("syncs", &Streamer::syncs)
      .def("fragments", &Streamer::fragments)
      .def(
          "options",
          [](const Streamer& s) {
            const StreamerOptions& o = s.options();
            py::dict out;
            out["sync_every"] = o.sync_every;
            out["fragments"] = o.fragments;
            out["overlap"] = o.overlap;
            return out;
          },
          "sync_every, fragments and overlap, as made.")
      .def("shared_view", [](Streamer& s, size_t f) { return view_of(s.shared(f)); },
           py::arg("fragment"), "Fragment `fragment`'s shared copy (writable, no copy).")
      .def("outer_momentum_view", [](Streamer& s, size_t f) { return view_of(s.outer_momentum(f)); },
           py::arg("fragment"))
      .def(
          "residual_view",
          [](Streamer& s, size_t index) {
            TensorRef ref;
            {
              py::gil_scoped_release release;  // waits for the fragment in flight
              ref = s.residual(index);
            }
            return view_of(ref);
          },
          py::arg("index"))
      .def_property_readonly("in_flight_fragment", &Streamer::in_flight_fragment)
      .def_property_readonly("in_flight_step", &Streamer::in_flight_step)
      .def(
          "in_flight_average_view",
          [](Streamer& s) {
            TensorRef ref;
            {
              py::gil_scoped_release release;
              ref = s.in_flight_average();
            }
            return view_of(ref);
          })
      .def("in_flight_base_view", [](Streamer& s) { return view_of(s.in_flight_base()); })
      .def("momentum_started", &Streamer::momentum_started)
      .def("restore", &Streamer::restore, py::arg("inner_steps"), py::arg("momentum_started"),
           py::arg("in_flight_fragment"), py::arg("in_flight_step"),
           py::call_guard<py::gil_scoped_release>());

  m.def(
      "make_streamer",
      [](py::handle engine, const std::vector<py::tuple>& params, size_t sync_every,
         size_t fragments,
         size_t overlap, double outer_lr, double outer_momentum, bool outer_nesterov,
         int compression, double mix, bool check_finite, py::handle group, bool confirm) {
        std::vector<StreamedParameter> refs;
        for (const py::tuple& p : params) {
          HEMIOLA_CHECK(p.size() == 4, "a streamed parameter is (name, data_ptr, dtype, numel)");
          TensorRef ref;
          ref.data = reinterpret_cast<void*>(p[1].cast<uintptr_t>());
          ref.dtype = static_cast<DType>(p[2].cast<int>());
          ref.numel = p[3].cast<size_t>();
          refs.push_back({p[0].cast<std::string>(), ref});
        }
        StreamerOptions options;
        options.sync_every = sync_every;
        options.fragments = fragments;
        options.overlap = overlap;
        options.outer.lr = outer_lr;
        options.outer.momentum = outer_momentum;
        options.outer.nesterov = outer_nesterov;
        options.compression = compression_of(compression);
        options.mix = mix;
        options.check_finite = check_finite;
        options.confirm = confirm;
        Engine& e = engine.cast<Engine&>();
        Engine* g = group.is_none() ? nullptr : &group.cast<Engine&>();
        std::unique_ptr<Streamer> streamer;
        {
          py::gil_scoped_release release;  // connects the outer wires (a rendezvous)
          streamer = e.make_streamer(std::move(refs), options, g);
        }
        // The streamer uses the engines: both live as long as it does.
        py::object out = keeping_alive(std::move(streamer), engine);
        if (g != nullptr) py::detail::keep_alive_impl(out, group);
        return out;
      },
      py::arg("engine"), py::arg("params"), py::arg("sync_every"), py::arg("fragments") = 1,
      py::arg("overlap") = 0, py::arg("outer_lr") = 0.7, py::arg("outer_momentum") = 0.9,
      py::arg("outer_nesterov") = true, py::arg("compression") = 0, py::arg("mix") = -1.0,
      py::arg("check_finite") = false,
      py::arg("group") = py::none(), py::arg("confirm") = false,
      "The streaming schedule over `params` across `engine`'s ranks; `group`: the engine of "
      "this rank's replica group (ranks a per-step schedule keeps equal), or None.");
}

}  // namespace hemiola::python
