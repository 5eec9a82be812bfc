// hemiola/updater.h: the Updater's calls, checked and handed to the landing
// graph (engine/updater/landing_graph.h) and the schedule's policy
// (engine/updater/update_policy.h), chosen once here.
#include "hemiola/updater.h"

#include <memory>
#include <utility>

#include "engine/updater/landing_graph.h"
#include "engine/updater/update_policy.h"
#include "hemiola/reducer.h"
#include "hemiola/status.h"

namespace hemiola {

class UpdaterImpl {
 public:
  UpdaterImpl(Engine& engine, Reducer& reducer, std::vector<ParameterSlot> params,
              const UpdaterOptions& options, StreamRef stream)
      : graph_(engine, reducer, options, stream) {
    const size_t in_flight = reducer.options().in_flight;
    HEMIOLA_CHECK(options.priority_front_fraction >= 0.0 && options.priority_front_fraction <= 1.0,
                  "updater: priority_front_fraction must be in [0, 1], got ",
                  options.priority_front_fraction);
    // The reducer's in_flight is the schedule's: iteration t's results stay
    // readable until t + in_flight + 1 starts marking, so at most in_flight
    // iterations are pending while the next one marks. priority lands
    // everything before the next step, hence one.
    HEMIOLA_CHECK(in_flight >= 1, "updater: the reducer must be made with "
                  "ReducerOptions::in_flight >= 1");
    HEMIOLA_CHECK(in_flight == 1 || options.schedule == UpdateSchedule::kDecoupled,
                  "updater: schedule priority needs ReducerOptions::in_flight = 1 (the reducer "
                  "has ", in_flight, ")");
    HEMIOLA_CHECK(in_flight == 1 || !reducer.options().preview,
                  "updater: a reducer with a preview needs ReducerOptions::in_flight = 1 (it "
                  "has ", in_flight, ")");
    // The first iteration's rebuild needs the order.
    HEMIOLA_CHECK(!options.rebuild_buckets || reducer.options().record_order,
                  "updater: rebuild_buckets needs ReducerOptions::record_order");
    HEMIOLA_CHECK(!reducer.options().preview || options.schedule == UpdateSchedule::kDecoupled,
                  "updater: a reducer with a preview serves schedule decoupled only");
    policy_ = options.schedule == UpdateSchedule::kPriority
                  ? make_priority_policy(graph_, options)
                  : make_decoupled_policy(graph_, options);
    adopt(std::move(params));
    graph_.refresh_buckets();
    // The marks come straight to the reducer; the policy hears of each
    // first (priority may refuse it), then the graph (where it lands).
    reducer.observe_marks(*policy_);
    reducer.observe_marks(graph_);
  }

  // The reducer writes results into the graph's buffers (on a GPU, its
  // stream does): an iteration in flight must end, on the device too, before
  // they are freed, and one still being marked can never end normally: it is
  // aborted. Then nothing is marked, and the observers can go.
  ~UpdaterImpl() {
    graph_.reducer().drain(/*abort_marking=*/true);
    graph_.reducer().forget_marks(graph_);
    graph_.reducer().forget_marks(*policy_);
  }

  void set_gates(std::vector<std::vector<size_t>> gates) {
    graph_.set_gates(std::move(gates));
  }

  void set_local_grad(size_t index, void* local_grad) {
    graph_.check_index(index);
    graph_.set_local_grad(index, local_grad);
  }

  void step(uint64_t iteration, const StepOptions& options, StreamRef stream) {
    graph_.check_hyper(options);
    graph_.use_stream(stream);
    graph_.clear_reads();  // backward is done: nothing read is needed
    policy_->step(iteration, options);
    graph_.clear_local_grads();
  }

  void step_local(const std::vector<void*>& grads, const StepOptions& options,
                  StreamRef stream) {
    HEMIOLA_CHECK(grads.size() == graph_.size(), "updater: step_local got ", grads.size(),
                  " gradients for ", graph_.size(), " parameters");
    graph_.check_hyper(options);
    synchronize(stream);
    const int64_t start = graph_.now_us();
    StepGroup group;
    group.options = &options;
    for (size_t i = 0; i < graph_.size(); ++i) {
      if (!grads[i]) continue;
      group.indices.push_back(i);
      group.grads.push_back(grads[i]);
    }
    graph_.commit(group);
    graph_.record("step", start, "local step (no reduction)");
  }

  void land(size_t gate, bool training, StreamRef stream) {
    const std::vector<size_t>& needed = graph_.gate(gate);
    graph_.use_stream(stream);
    policy_->land(needed, training);
    graph_.mark_read(needed);
  }

  // Lands everything pending (waits): the live parameters are exact for work
  // enqueued on `stream` from now on.
  void synchronize(StreamRef stream) {
    graph_.use_stream(stream);
    policy_->land_all();
  }

  void replace_parameters(std::vector<ParameterSlot> params, StreamRef stream) {
    graph_.use_stream(stream);
    HEMIOLA_CHECK(params.size() == graph_.size(), "updater: ", params.size(),
                  " parameters replace ", graph_.size());
    graph_.pending().clear();
    adopt(std::move(params));
  }

  std::vector<bool> momentum_initialised() const {
    std::vector<bool> out(graph_.size());
    for (size_t i = 0; i < graph_.size(); ++i) out[i] = graph_.params()[i].momentum_initialised;
    return out;
  }

  double approximate_read_fraction() const { return policy_->approximate_read_fraction(); }
  double preview_read_fraction() const { return policy_->preview_read_fraction(); }
  std::optional<double> clip_norm(uint64_t iteration) const {
    return graph_.clip_norm(iteration);
  }
  TensorRef averaged(uint64_t iteration, size_t index) const {
    return graph_.averaged(iteration, index);
  }
  Device device() const { return graph_.device(); }

 private:
  void adopt(std::vector<ParameterSlot> params) {
    graph_.adopt(std::move(params));
    policy_->adopt();
  }

  LandingGraph graph_;
  std::unique_ptr<UpdatePolicy> policy_;  // the schedule's; works on graph_
};

Updater::Updater(Engine& engine, Reducer& reducer, std::vector<ParameterSlot> params,
                 const UpdaterOptions& options, StreamRef stream)
    : impl_(std::make_unique<UpdaterImpl>(engine, reducer, std::move(params), options, stream)) {}
Updater::~Updater() = default;

void Updater::set_gates(std::vector<std::vector<size_t>> gates) {
  impl_->set_gates(std::move(gates));
}
void Updater::set_local_grad(size_t index, void* local_grad) {
  impl_->set_local_grad(index, local_grad);
}
void Updater::step(uint64_t iteration, const StepOptions& options, StreamRef stream) {
  impl_->step(iteration, options, stream);
}
void Updater::step_local(const std::vector<void*>& grads, const StepOptions& options,
                         StreamRef stream) {
  impl_->step_local(grads, options, stream);
}
void Updater::land(size_t gate, bool training, StreamRef stream) {
  impl_->land(gate, training, stream);
}
void Updater::synchronize(StreamRef stream) { impl_->synchronize(stream); }
void Updater::replace_parameters(std::vector<ParameterSlot> params, StreamRef stream) {
  impl_->replace_parameters(std::move(params), stream);
}
Device Updater::device() const { return impl_->device(); }
std::vector<bool> Updater::momentum_initialised() const { return impl_->momentum_initialised(); }
double Updater::approximate_read_fraction() const { return impl_->approximate_read_fraction(); }
std::optional<double> Updater::clip_norm(uint64_t iteration) const {
  return impl_->clip_norm(iteration);
}
TensorRef Updater::averaged(uint64_t iteration, size_t index) const {
  return impl_->averaged(iteration, index);
}
double Updater::preview_read_fraction() const { return impl_->preview_read_fraction(); }

}  // namespace hemiola
