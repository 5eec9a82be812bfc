// hemiola/updater.h: the landing graph of the priority and decoupled
// schedules and the optimizer steps that land their updates.
//
// The graph is small: at most in_flight iterations are pending (one for
// priority), oldest first, and per parameter each is either applied (landed)
// or waiting for its buckets; a parameter lands its iterations in order.
// Which buckets a parameter waits for comes from the reducer's plan; which
// parameters a lander needs comes from the caller. Everything here runs on the caller's thread; on a GPU every
// kernel, copy and wait is enqueued on the stream of the call in progress.
#include "hemiola/updater.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <string>
#include <utility>

#include "device.h"
#include "engine/reducer_impl.h"
#include "engine/timeline.h"
#include "hemiola/engine.h"
#include "hemiola/optimizer.h"
#include "hemiola/reducer.h"
#include "hemiola/status.h"
#include "optim/global_scale.h"
#include "optim/grad_norm.h"

namespace hemiola {

namespace {

// Host memory of one tensor's size.
using HostBuffer = std::vector<std::max_align_t>;

void* allocate(HostBuffer& buffer, size_t bytes) {
  buffer.resize((bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t));
  return buffer.data();
}

// Memory of the updater's own for one tensor (a shadow parameter, a gathered
// result), on the parameters' device.
class Buffer {
 public:
  // At least `bytes` of memory on `device` (its contents are kept only when
  // no reallocation is needed).
  void* reserve(const Device& device, size_t bytes) {
    if (device.type == DeviceType::kCPU) {
      data_ = allocate(host_, bytes);
    } else {
      if (!device_ || device_->size() < bytes) {
        device_ = std::make_unique<cuda::DeviceBuffer>(device.index, std::max<size_t>(bytes, 1));
        // Its zero-fill runs on the legacy default stream, which the user's
        // and the engine's non-blocking streams do not wait for: let it end
        // before either writes here (allocations happen in the first
        // iterations only).
        cuda::synchronize(nullptr);
      }
      data_ = device_->data();
    }
    return data_;
  }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;  // into host_ or device_
  HostBuffer host_;
  std::unique_ptr<cuda::DeviceBuffer> device_;
};

// An iteration whose update is not applied to every parameter yet.
struct Pending {
  uint64_t iteration = 0;
  StepOptions options;
  // Its results were written to the updater's own buffers and waited for
  // (the first iteration, whose buckets are rebuilt before it lands).
  bool gathered = false;
  std::vector<int> usage;      // how many ranks used each parameter (has_unused)
  bool scale_known = false;    // coef / skip below are computed
  double coef = 1.0;           // clip_grad_norm_'s coefficient
  bool skip = false;           // some averaged gradient is not finite (GradScaler)
  std::vector<uint8_t> applied;    // per parameter
  std::vector<size_t> remaining;   // the parameters not applied yet, ascending
  std::vector<uint8_t> bucket_arrived;  // per bucket, once seen reduced
  // decoupled:
  std::vector<uint8_t> stepped;          // per parameter: took the local step
  std::vector<Buffer> local;             // in_flight > 1: the local gradients, to re-step
  // decoupled with a preview (ReducerOptions::preview):
  std::vector<uint8_t> previewed;        // per parameter: live = shadow stepped with the preview
  std::vector<uint8_t> bucket_previewed; // per bucket, once seen previewed

  bool needs_whole() const {
    return options.has_unused || options.clip_max_norm >= 0.0 || options.skip_if_not_finite;
  }
  // A preview can land: clipping scales it by StepOptions::preview_scale;
  // unused parameters and a GradScaler's skip are known only once the whole
  // iteration is reduced.
  bool preview_allowed() const { return !options.has_unused && !options.skip_if_not_finite; }
};

// Scratch of re-taken local steps (decoupled, in_flight > 1): a parameter
// and its optimizer state stepped through several pending iterations. One
// set, grown to the largest tensor, serves every parameter in turn (on a GPU
// the steps are ordered on one stream).
struct Restep {
  Buffer param, momentum, exp_avg, exp_avg_sq, max_exp_avg_sq;
  float step = 0.0f;
};

}  // namespace

class UpdaterImpl {
 public:
  UpdaterImpl(Engine& engine, Reducer& reducer, std::vector<ParameterSlot> params,
              const UpdaterOptions& options, StreamRef stream)
      : engine_(engine), reducer_(ReducerAccess::impl(reducer)), options_(options),
        device_(reducer.options().device), in_flight_(reducer.options().in_flight),
        timeline_(engine.options().timeline), rebuilt_(!options.rebuild_buckets),
        gathered_(in_flight_ + 1) {
    HEMIOLA_CHECK(options.priority_front_fraction >= 0.0 && options.priority_front_fraction <= 1.0,
                  "updater: priority_front_fraction must be in [0, 1], got ",
                  options.priority_front_fraction);
    // The reducer's in_flight is the schedule's: iteration t's results stay
    // readable until t + in_flight + 1 starts marking, so at most in_flight
    // iterations are pending while the next one marks. priority lands
    // everything before the next step, hence one.
    HEMIOLA_CHECK(in_flight_ >= 1, "updater: the reducer must be made with "
                  "ReducerOptions::in_flight >= 1");
    HEMIOLA_CHECK(in_flight_ == 1 || options.schedule == UpdateSchedule::kDecoupled,
                  "updater: schedule priority needs ReducerOptions::in_flight = 1 (the reducer "
                  "has ", in_flight_, ")");
    HEMIOLA_CHECK(in_flight_ == 1 || !reducer.options().preview,
                  "updater: a reducer with a preview needs ReducerOptions::in_flight = 1 (it "
                  "has ", in_flight_, ")");
    // The first iteration's rebuild needs the order.
    HEMIOLA_CHECK(!options.rebuild_buckets || reducer.options().record_order,
                  "updater: rebuild_buckets needs ReducerOptions::record_order");
    HEMIOLA_CHECK(!reducer.options().preview || options.schedule == UpdateSchedule::kDecoupled,
                  "updater: a reducer with a preview serves schedule decoupled only");
    stream_ = stream;
    adopt(std::move(params));
    landers_ = {all_};
    refresh_buckets();
  }

  // The reducer writes results into gathered_ (on a GPU, its stream does):
  // an iteration in flight must end, on the device too, before they are
  // freed, and one still being marked can never end normally: it is aborted.
  ~UpdaterImpl() { reducer_.drain(/*abort_marking=*/true); }

  void set_landers(std::vector<std::vector<size_t>> landers) {
    HEMIOLA_CHECK(!landers.empty() && landers[0] == all_,
                  "updater: lander 0 must be every parameter");
    for (const auto& lander : landers) {
      for (size_t i : lander) {
        HEMIOLA_CHECK(i < params_.size(), "updater: lander names parameter ", i, " of ",
                      params_.size());
      }
    }
    landers_ = std::move(landers);
  }

  void mark(size_t index, const void* source, void* local_grad, StreamRef stream) {
    check_index(index);
    use_stream(stream);
    if (options_.schedule == UpdateSchedule::kPriority && !pending_.empty() &&
        !pending_.front().applied[index]) {
      const std::string message = detail::concat(
          "schedule='priority': parameter '", params_[index].name,
          "' was read in this forward before its update from the previous iteration was "
          "applied, so its gradient would be wrong. Its update is applied where the first "
          "training forward read it first; this forward read it earlier. Use "
          "schedule='wfbp' for models whose order of parameter reads changes between "
          "iterations.");
      reducer_.abort(message);
      HEMIOLA_THROW(ErrorCode::kAborted, message);
    }
    local_grads_[index] = local_grad;
    reducer_.mark(index, source, result_target(index), /*used=*/true, stream_.handle);
  }

  void set_local_grad(size_t index, void* local_grad) {
    check_index(index);
    local_grads_[index] = local_grad;
  }

  void step(uint64_t iteration, const StepOptions& options, StreamRef stream) {
    check_hyper(options);
    use_stream(stream);
    std::fill(read_.begin(), read_.end(), 0);  // backward is done: nothing read is needed
    if (options_.schedule == UpdateSchedule::kPriority) {
      step_priority(iteration, options);
    } else {
      step_decoupled(iteration, options);
    }
    std::fill(local_grads_.begin(), local_grads_.end(), nullptr);
  }

  void step_local(const std::vector<void*>& grads, const StepOptions& options,
                  StreamRef stream) {
    HEMIOLA_CHECK(grads.size() == params_.size(), "updater: step_local got ", grads.size(),
                  " gradients for ", params_.size(), " parameters");
    check_hyper(options);
    synchronize(stream);
    const int64_t start = engine_.timeline_now_us();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (grads[i]) optimizer_step(i, grads[i], options.hyper, 1.0, /*commit=*/true);
    }
    record("step", start, "local step (no reduction)");
  }

  void land(size_t lander, bool training, StreamRef stream) {
    HEMIOLA_CHECK(lander < landers_.size(), "updater: lander ", lander, " of ", landers_.size());
    use_stream(stream);
    const std::vector<size_t>& needed = landers_[lander];
    if (!pending_.empty()) {
      if (options_.schedule == UpdateSchedule::kPriority) {
        update_priority(needed, /*wait=*/true);
      } else if (options_.correct_on_arrival) {
        Pending& newest = pending_.back();  // with a preview the only one (in_flight 1)
        if (!newest.previewed.empty() && newest.preview_allowed()) {
          wait_previews(newest, needed);
        }
        land_arrived();
      }
    }
    if (training && options_.schedule == UpdateSchedule::kDecoupled) {
      for (size_t i : needed) {
        const uint64_t numel = params_[i].param.numel;
        reads_ += numel;
        if (!pending_.empty() && !pending_.back().applied[i]) {  // parameters land in order
          approximate_reads_ += numel;
          const Pending& newest = pending_.back();
          if (!newest.previewed.empty() && newest.previewed[i]) previewed_reads_ += numel;
        }
      }
    }
    for (size_t i : needed) read_[i] = 1;
  }

  void synchronize(StreamRef stream) {
    use_stream(stream);
    land_all();
  }

  // Lands everything pending (waits), on the current stream.
  void land_all() {
    if (options_.schedule == UpdateSchedule::kPriority) {
      if (!pending_.empty()) update_priority(all_, /*wait=*/true);
    } else {
      while (!pending_.empty()) land_oldest();
    }
  }

  void replace_parameters(std::vector<ParameterSlot> params, StreamRef stream) {
    use_stream(stream);
    HEMIOLA_CHECK(params.size() == params_.size(), "updater: ", params.size(),
                  " parameters replace ", params_.size());
    pending_.clear();
    adopt(std::move(params));
  }

  std::vector<bool> momentum_initialised() const {
    std::vector<bool> out(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) out[i] = params_[i].momentum_initialised;
    return out;
  }

  double approximate_read_fraction() const {
    return reads_ == 0 ? 0.0 : static_cast<double>(approximate_reads_) / reads_;
  }

  double preview_read_fraction() const {
    return reads_ == 0 ? 0.0 : static_cast<double>(previewed_reads_) / reads_;
  }

  std::optional<double> clip_norm(uint64_t iteration) const {
    for (const auto& [it, norm] : clip_norms_) {
      if (it == iteration) return norm;
    }
    return std::nullopt;
  }

  Device device() const { return device_; }

 private:
  // ---- setup -----------------------------------------------------------------

  void adopt(std::vector<ParameterSlot> params) {
    for (const auto& p : params) {
      HEMIOLA_CHECK(p.param.device.type == device_.type &&
                        (device_.type == DeviceType::kCPU || p.param.device.index == device_.index),
                    "updater: parameter '", p.name, "' is not on the reducer's device");
      if (device_.type == DeviceType::kCUDA && p.param.numel > 0) {
        HEMIOLA_CHECK(cuda::device_of(p.param.data) == device_.index, "updater: parameter '",
                      p.name, "' does not point to memory of CUDA device ", device_.index);
      }
      HEMIOLA_CHECK(is_floating(p.param.dtype), "updater: parameter '", p.name,
                    "' has dtype ", dtype_name(p.param.dtype), ", not a floating dtype");
      HEMIOLA_CHECK(p.param.numel == 0 || p.param.data, "updater: parameter '", p.name,
                    "' has no data");
      if (options_.optimizer != OptimizerKind::kSgd) {
        HEMIOLA_CHECK(p.param.numel == 0 || (p.exp_avg && p.exp_avg_sq && p.step),
                      "updater: Adam parameter '", p.name, "' lacks exp_avg, exp_avg_sq or step");
      }
    }
    params_ = std::move(params);
    const size_t n = params_.size();
    groups_ = 0;
    for (const auto& p : params_) groups_ = std::max(groups_, p.group + 1);
    all_.resize(n);
    for (size_t i = 0; i < n; ++i) all_[i] = i;
    if (!landers_.empty()) landers_[0] = all_;
    local_grads_.assign(n, nullptr);
    read_.assign(n, 0);
    selected_.assign(n, 0);
    if (options_.schedule == UpdateSchedule::kDecoupled) {
      shadow_.resize(n);
      for (size_t i = 0; i < n; ++i) {
        const auto& p = params_[i].param;
        copy(shadow_[i].reserve(device_, p.nbytes()), p.data, p.nbytes());
      }
    }
  }

  void refresh_buckets() {
    const auto buckets = reducer_.buckets();
    buckets_of_.assign(params_.size(), {});
    for (size_t b = 0; b < buckets.size(); ++b) {
      for (size_t i : buckets[b]) {
        HEMIOLA_CHECK(i < params_.size(), "updater: the reducer has more gradients (", i + 1,
                      ") than parameters (", params_.size(), ")");
        buckets_of_[i].push_back(b);
      }
    }
    partitioned_.assign(params_.size(), 0);
    for (size_t i = 0; i < params_.size(); ++i) partitioned_[i] = reducer_.pieces(i) > 1;
    bucket_bytes_.assign(buckets.size(), 0.0);
    for (size_t b = 0; b < buckets.size(); ++b) {
      for (size_t i : buckets[b]) {
        bucket_bytes_[b] += static_cast<double>(params_[i].param.nbytes()) / buckets_of_[i].size();
      }
    }
  }

  void check_index(size_t index) const {
    HEMIOLA_CHECK(index < params_.size(), "updater: parameter ", index, " of ", params_.size());
  }

  void check_hyper(const StepOptions& options) const {
    HEMIOLA_CHECK(groups_ <= options.hyper.size(), "updater: the parameters are in ", groups_,
                  " groups but the step has hyper-parameters for ", options.hyper.size());
  }

  // A partitioned gradient lives in several buckets; results that must
  // outlive a rebuild are kept too. Both go to the updater's own buffers.
  bool gathers(size_t index) const {
    return partitioned_[index] ||
           (!rebuilt_ && options_.schedule == UpdateSchedule::kDecoupled);
  }

  void* result_target(size_t index) {
    if (!gathers(index)) return nullptr;
    // The iteration being marked (the reducer starts one at its first mark).
    const uint64_t started = reducer_.iterations_started();
    const uint64_t slot = (reducer_.marking() ? started - 1 : started) % gathered_.size();
    auto& buffer = gathered_[slot];
    if (buffer.size() != params_.size()) buffer.resize(params_.size());
    return buffer[index].reserve(device_, params_[index].param.nbytes());
  }

  const void* reduced(const Pending& pending, size_t index) const {
    if (pending.gathered || partitioned_[index]) {
      return gathered_[pending.iteration % gathered_.size()][index].data();
    }
    return reducer_.result(pending.iteration, index).data;
  }

  // ---- priority ----------------------------------------------------------------

  void step_priority(uint64_t iteration, const StepOptions& options) {
    land_all();  // whatever the previous iteration left (rare)
    start_pending(iteration, options);
    if (!rebuilt_) {
      // The first iteration runs synchronously; then the buckets are rebuilt
      // in the observed order and the issue order is derived from them.
      land_all();
      drain();
      reducer_.rebuild_from_observed_order();
      refresh_buckets();
      reducer_.set_issue_order(priority_order());
      rebuilt_ = true;
      return;
    }
    if (!pending_.back().needs_whole()) update_priority(all_, /*wait=*/false);
  }

  // Plan order (backward order), except that the buckets holding the front
  // layers' first priority_front_fraction of the bytes go last, front-most
  // first: the same permutation on every rank, no negotiation.
  std::vector<size_t> priority_order() const {
    const size_t n = bucket_bytes_.size();
    double total = 0.0;
    for (double b : bucket_bytes_) total += b;
    const double budget = options_.priority_front_fraction * total;
    std::vector<size_t> tail;  // the last buckets hold the front layers
    double covered = 0.0;
    for (size_t b = n; b-- > 0;) {
      if (covered >= budget || tail.size() + 1 >= n) break;
      tail.push_back(b);
      covered += bucket_bytes_[b];
    }
    std::vector<size_t> order;
    for (size_t b = 0; b < n - tail.size(); ++b) order.push_back(b);
    order.insert(order.end(), tail.begin(), tail.end());
    return order;
  }

  // Applies the update of `wanted` (waiting for their buckets if `wait`, else
  // only those already reduced) and of every other parameter not read since
  // step() whose buckets are reduced: one pass of optimizer steps. The work
  // is over the parameters still pending, not all of them.
  void update_priority(const std::vector<size_t>& wanted, bool wait) {
    Pending& pending = pending_.front();  // the only one
    std::vector<size_t> todo;
    for (size_t i : wanted) {
      if (!pending.applied[i]) todo.push_back(i);
    }
    if (wait && !todo.empty()) wait_for(pending, todo);
    if (wait) {
      for (size_t i : todo) selected_[i] = 1;
    }
    std::vector<size_t> chosen;
    for (size_t i : pending.remaining) {
      if (selected_[i] || (!read_[i] && arrived(pending, i))) chosen.push_back(i);
    }
    for (size_t i : todo) selected_[i] = 0;
    if (!chosen.empty()) {
      const int64_t start = engine_.timeline_now_us();
      apply(pending, chosen);
      record("step", start, "update ", chosen.size(), " parameters (", pending.iteration, ")");
    }
    if (pending.remaining.empty()) pending_.pop_front();
  }

  // ---- decoupled -----------------------------------------------------------------

  void step_decoupled(uint64_t iteration, const StepOptions& options) {
    std::vector<int> usage;
    bool gathered = false;
    if (!rebuilt_) {
      // The first iteration takes the same steps as every other (the local
      // one now, the exact one later), so that a run resumed from a
      // checkpoint repeats the run that saved it; only its timing differs:
      // the reduction is waited for so that the buckets can be rebuilt, and
      // its results were written to the updater's own buffers.
      reducer_.wait(iteration, stream_.handle);
      if (options.has_unused) usage = reducer_.usage(iteration);
      drain();
      reducer_.rebuild_from_observed_order();
      refresh_buckets();
      rebuilt_ = true;
      gathered = true;
    }
    // With this one, at most in_flight iterations stay pending: the oldest
    // land now (waiting); the others land what has arrived.
    while (pending_.size() >= in_flight_) land_oldest();
    if (options_.correct_on_arrival && !pending_.empty()) land_arrived();
    start_pending(iteration, options);
    Pending& pending = pending_.back();
    pending.gathered = gathered;
    pending.usage = std::move(usage);
    pending.stepped.assign(params_.size(), 0);
    for (size_t i = 0; i < params_.size(); ++i) {
      pending.stepped[i] = !options.local_overflow && local_grads_[i] != nullptr;
    }
    if (in_flight_ > 1) {
      // The gradients' memory is the caller's until the next backward; a
      // local step is re-taken after an older iteration lands.
      pending.local.resize(params_.size());
      for (size_t i = 0; i < params_.size(); ++i) {
        if (!pending.stepped[i]) continue;
        const size_t bytes = params_[i].param.nbytes();
        copy(pending.local[i].reserve(device_, bytes), local_grads_[i], bytes);
      }
    }
    if (!options.local_overflow) {
      // The approximate step: the exact values stepped with this rank's own
      // gradient (after the local steps of older pending iterations), into
      // the live parameters only.
      const int64_t start = engine_.timeline_now_us();
      for (size_t i = 0; i < params_.size(); ++i) {
        if (pending.stepped[i]) restep(i);
      }
      record("step", start, "local step ", iteration);
    }
    if (previews()) {
      pending.previewed.assign(params_.size(), 0);
      pending.bucket_previewed.assign(bucket_bytes_.size(), 0);
    }
  }

  // decoupled lands previews: the reducer takes them, and they land on
  // arrival as corrections do (both depend on timing).
  bool previews() const {
    return reducer_.options().preview && options_.correct_on_arrival;
  }

  // Lands the oldest pending iteration's exact step of every parameter
  // (waiting for it).
  void land_oldest() {
    Pending& pending = pending_.front();
    const std::vector<size_t> chosen = pending.remaining;
    if (!chosen.empty()) {
      wait_for(pending, chosen);
      correct(pending, chosen);
    }
    pending_.pop_front();
  }

  // Lands the exact steps that have arrived, of parameters no forward read
  // since step() and whose older iterations have landed; with a preview,
  // lands the previews that have arrived instead.
  //
  // With the preview on, exact steps land only when waited for (in step()),
  // never on arrival: a forward then reads the preview's estimate for every
  // layer, not exact back layers beside approximate front ones. That mix
  // measured worse on the LM with AdamW (+1.85% held-out loss from wfbp
  // against +0.95% with every read on the estimate, 12 seeds; see
  // docs/schedules.md), and the model reproduces it.
  void land_arrived() {
    for (size_t k = 0; k < pending_.size(); ++k) {
      Pending& pending = pending_[k];
      if (!pending.previewed.empty()) {
        if (pending.preview_allowed()) land_previews(pending);
        continue;
      }
      if (pending.needs_whole()) continue;
      std::vector<size_t> chosen;
      for (size_t i : pending.remaining) {
        if (!read_[i] && landed_before(k, i) && arrived(pending, i)) chosen.push_back(i);
      }
      if (!chosen.empty()) correct(pending, chosen);
    }
    while (!pending_.empty() && pending_.front().remaining.empty()) pending_.pop_front();
  }

  // The iterations pending before pending_[k] have landed parameter i.
  bool landed_before(size_t k, size_t i) const {
    for (size_t j = 0; j < k; ++j) {
      if (!pending_[j].applied[i]) return false;
    }
    return true;
  }

  void correct(Pending& pending, const std::vector<size_t>& chosen) {
    const int64_t start = engine_.timeline_now_us();
    apply(pending, chosen);
    record("correction", start, "exact step (", chosen.size(), " parameters)");
  }

  // The approximate step again, from the preview's estimate of the average
  // instead of the rank's own gradient, for every parameter whose preview
  // has arrived, whose exact step has not, and that no forward read since
  // step(). With clipping the preview is scaled by the local gradient's
  // clipping coefficient (StepOptions::preview_scale): the averaged
  // gradient's own needs all of it, and the exact step that follows uses that.
  // (Not with a GradScaler or unused parameters, whose updates need the whole
  // averaged gradient; not for partitioned tensors.)
  void land_previews(Pending& pending) {
    std::vector<size_t> chosen;
    for (size_t i : pending.remaining) {
      if (awaits_preview(pending, i) && previewed(pending, i)) chosen.push_back(i);
    }
    if (chosen.empty()) return;
    const int64_t start = engine_.timeline_now_us();
    for (size_t i : chosen) {
      optimizer_step(i, reducer_.preview(pending.iteration, i).data, pending.options.hyper,
                     pending.options.preview_scale, /*commit=*/false);
      pending.previewed[i] = 1;
    }
    record("preview", start, "preview step (", chosen.size(), " parameters)");
  }

  // Waits for the previews of `needed` that can still land (see
  // land_previews): a forward never reads the rank's own-gradient step where
  // a preview is coming. The wait is short: the preview lane carries only
  // this iteration's previews, a quarter of the bytes.
  void wait_previews(Pending& pending, const std::vector<size_t>& needed) {
    const int64_t start = engine_.timeline_now_us();
    bool waited = false;
    for (size_t i : needed) {
      if (!awaits_preview(pending, i)) continue;
      for (size_t b : buckets_of_[i]) {
        if (pending.bucket_previewed[b]) continue;
        reducer_.wait_preview(pending.iteration, b);
        waited = true;
      }
    }
    if (waited) record("wait", start, "wait previews (", pending.iteration, ")");
  }

  // Parameter i's live value may still become its preview step: its exact
  // step has not landed, no forward read it since step(), it took the local
  // step and not yet the preview's, and it is whole (not partitioned).
  bool awaits_preview(const Pending& pending, size_t i) const {
    return !pending.applied[i] && !read_[i] && !pending.previewed[i] && pending.stepped[i] &&
           !partitioned_[i];
  }

  bool previewed(Pending& pending, size_t index) const {
    for (size_t b : buckets_of_[index]) {
      if (!pending.bucket_previewed[b]) {
        if (!reducer_.preview_done(pending.iteration, b)) return false;
        pending.bucket_previewed[b] = 1;
      }
    }
    return true;
  }

  // ---- common ----------------------------------------------------------------

  void start_pending(uint64_t iteration, const StepOptions& options) {
    Pending& pending = pending_.emplace_back();
    pending.iteration = iteration;
    pending.options = options;
    pending.applied.assign(params_.size(), 0);
    pending.remaining = all_;
    pending.bucket_arrived.assign(bucket_bytes_.size(), 0);
  }

  bool arrived(Pending& pending, size_t index) const {
    if (pending.gathered) return true;
    for (size_t b : buckets_of_[index]) {
      if (!pending.bucket_arrived[b]) {
        if (!reducer_.bucket_done(pending.iteration, b)) return false;
        pending.bucket_arrived[b] = 1;
      }
    }
    return true;
  }

  // Waits until `indices`' averaged gradients can be applied: their buckets
  // in issue order, or the whole iteration if the update needs it.
  void wait_for(const Pending& pending, const std::vector<size_t>& indices) {
    if (pending.gathered) return;
    const int64_t start = engine_.timeline_now_us();
    if (pending.needs_whole()) {
      reducer_.wait(pending.iteration, stream_.handle);
      record("wait", start, "wait reduction ", pending.iteration);
      return;
    }
    reducer_.wait_for(pending.iteration, indices, stream_.handle);
    record("wait", start, "wait buckets (", pending.iteration, ")");
  }

  // The parameters `chosen` (all arrived) take the exact step of `pending`:
  // parameters no rank used are skipped, clipping scales the gradients by the
  // coefficient of the whole averaged gradient, and a non-finite one under a
  // GradScaler skips the update on every rank.
  void apply(Pending& pending, const std::vector<size_t>& chosen) {
    const StepOptions& o = pending.options;
    if (o.has_unused && pending.usage.empty()) pending.usage = reducer_.usage(pending.iteration);
    auto used = [&](size_t i) { return pending.usage.empty() || pending.usage[i] > 0; };
    if ((o.clip_max_norm >= 0.0 || o.skip_if_not_finite) && !pending.scale_known) {
      // needs_whole: every bucket has arrived.
      scale_of(pending, used);
    }
    if (options_.raise_if_not_finite && !o.skip_if_not_finite) {
      const std::vector<const void*> averages = readable(pending, chosen);
      for (size_t k = 0; k < chosen.size(); ++k) {
        const size_t i = chosen[k];
        if (used(i) && !optim::all_finite(averages[k], params_[i].param.numel,
                                          params_[i].param.dtype)) {
          // Nothing more of the iteration (nor of a later one) is applied,
          // and the live parameters are the exact ones (a local step may
          // have taken the NaN in).
          for (const Pending& q : pending_) {
            for (size_t j : q.remaining) restore(j);
          }
          const uint64_t iteration = pending.iteration;
          pending_.clear();  // (`pending` is gone from here on)
          HEMIOLA_THROW(
              ErrorCode::kNotFinite, "hemiola: the averaged gradient of parameter '",
              params_[i].name, "' holds NaN or infinity in iteration ", iteration,
              " (check_finite=True); it was not applied. Some rank's loss diverged or "
              "overflowed: lower the learning rate, check the inputs, or scale fp16 losses "
              "with a GradScaler (grad_scaler=...).");
        }
      }
    }
    for (size_t i : chosen) {
      if (pending.skip || !used(i)) {
        restore(i);  // decoupled: drop the approximate step
      } else {
        optimizer_step(i, reduced(pending, i), o.hyper, pending.coef, /*commit=*/true);
      }
      pending.applied[i] = 1;
      // decoupled, in_flight > 1: the later iterations' local steps again.
      if (&pending != &pending_.back() && steps_pending(i)) restep(i);
    }
    auto& remaining = pending.remaining;
    remaining.erase(std::remove_if(remaining.begin(), remaining.end(),
                                   [&](size_t i) { return pending.applied[i] != 0; }),
                    remaining.end());
  }

  // decoupled: an iteration whose local step of parameter i is in the live
  // value has not landed it.
  bool steps_pending(size_t i) const {
    for (const Pending& p : pending_) {
      if (!p.applied[i] && !p.stepped.empty() && p.stepped[i]) return true;
    }
    return false;
  }

  // decoupled: live parameter i <- the shadow stepped with the local
  // gradient of every pending iteration that has not landed it (the
  // invariant), in order. More than one such step goes through scratch
  // copies of the shadow and the optimizer state, so that each step reads
  // the state the previous one left, and none is committed.
  void restep(size_t i) {
    std::vector<const Pending*> steps;
    for (const Pending& p : pending_) {
      if (!p.applied[i] && p.stepped[i]) steps.push_back(&p);
    }
    if (steps.empty()) return restore(i);
    if (steps.size() == 1) {
      return optimizer_step(i, local_grad(*steps[0], i), steps[0]->options.hyper, 1.0,
                            /*commit=*/false);
    }
    ParameterSlot slot = params_[i];
    const size_t bytes = slot.param.nbytes();
    void* live = slot.param.data;
    void* value = restep_.param.reserve(device_, bytes);
    copy(value, shadow_[i].data(), bytes);
    auto scratch = [&](Buffer& buffer, void*& state) {
      if (!state) return;
      void* copied = buffer.reserve(device_, bytes);
      copy(copied, state, bytes);
      state = copied;
    };
    scratch(restep_.momentum, slot.momentum_buffer);
    scratch(restep_.exp_avg, slot.exp_avg);
    scratch(restep_.exp_avg_sq, slot.exp_avg_sq);
    scratch(restep_.max_exp_avg_sq, slot.max_exp_avg_sq);
    if (slot.step) {
      restep_.step = *slot.step;
      slot.step = &restep_.step;
    }
    for (size_t k = 0; k < steps.size(); ++k) {
      const bool last = k + 1 == steps.size();
      // Committing into the scratch (live and shadow the same memory), and
      // the last step from it into the live parameter.
      slot.param.data = last ? live : value;
      step_slot(slot, value, local_grad(*steps[k], i), steps[k]->options.hyper, 1.0,
                /*commit=*/!last);
    }
  }

  // The local gradient `pending` stepped parameter i with: the caller's
  // during its step(), a copy of it afterwards (in_flight > 1).
  const void* local_grad(const Pending& pending, size_t i) const {
    return pending.local.empty() ? local_grads_[i] : pending.local[i].data();
  }

  // The GradScaler skip (any averaged gradient not finite) and the clipping
  // coefficient of `pending` (optim/global_scale.h).
  template <typename Used>
  void scale_of(Pending& pending, const Used& used) {
    const StepOptions& o = pending.options;
    std::vector<size_t> counted;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (used(i)) counted.push_back(i);
    }
    const std::vector<const void*> averages = readable(pending, counted);
    std::vector<optim::HostGrad> grads(counted.size());
    for (size_t k = 0; k < counted.size(); ++k) {
      const TensorRef& t = params_[counted[k]].param;
      grads[k] = {averages[k], static_cast<std::int64_t>(t.numel), t.dtype};
    }
    const optim::GlobalScale scale =
        optim::global_scale(grads, o.clip_max_norm, o.clip_norm_type, o.skip_if_not_finite);
    pending.skip = scale.skip;
    if (o.clip_max_norm >= 0.0) {
      pending.coef = scale.coef;
      clip_norms_.emplace_back(pending.iteration, scale.total_norm);
      if (clip_norms_.size() > 16) clip_norms_.pop_front();
    }
    pending.scale_known = true;
  }

  // decoupled: the live parameter <- the exact one.
  void restore(size_t i) {
    if (options_.schedule != UpdateSchedule::kDecoupled) return;
    const auto& p = params_[i].param;
    copy(p.data, shadow_[i].data(), p.nbytes());
  }

  // The stream of the call that begins. On a GPU everything the updater
  // enqueues stays in one order, whatever streams the calls come on: a new
  // stream first waits for the work enqueued on the previous one (so a
  // kernel never reads a reducer buffer that a later iteration's copy-in,
  // ordered after the marks' stream, may overwrite).
  void use_stream(StreamRef stream) {
    if (device_.type == DeviceType::kCUDA && stream.handle != stream_.handle) {
      if (!switched_) switched_ = std::make_unique<cuda::Event>(device_.index);
      switched_->record(stream_.handle);
      switched_->block(stream.handle);
    }
    stream_ = stream;
  }

  // On a GPU: before the reducer frees and reallocates its buffers (a
  // rebuild), the kernels enqueued on them must be done.
  void drain() {
    if (device_.type == DeviceType::kCUDA) cuda::synchronize(stream_.handle);
  }

  // A copy on the parameters' device (on a GPU: enqueued on the stream).
  void copy(void* dst, const void* src, size_t bytes) const {
    if (bytes == 0) return;
    if (device_.type == DeviceType::kCPU) {
      std::memcpy(dst, src, bytes);
    } else {
      cuda::copy_async(dst, src, bytes, stream_.handle);
    }
  }

  // The averaged gradients of `indices` where the host can read them: on the
  // CPU the reduced values themselves; on a GPU copies in host memory, made
  // after the stream's waits for them (one synchronisation for all).
  std::vector<const void*> readable(const Pending& pending, const std::vector<size_t>& indices) {
    std::vector<const void*> out;
    out.reserve(indices.size());
    if (device_.type == DeviceType::kCPU) {
      for (size_t i : indices) out.push_back(reduced(pending, i));
      return out;
    }
    if (staging_.size() < indices.size()) staging_.resize(indices.size());
    for (size_t k = 0; k < indices.size(); ++k) {
      const size_t bytes = params_[indices[k]].param.nbytes();
      void* host = allocate(staging_[k], bytes);
      if (bytes > 0) cuda::copy_async(host, reduced(pending, indices[k]), bytes, stream_.handle);
      out.push_back(host);
    }
    cuda::synchronize(stream_.handle);
    return out;
  }

  // One optimizer step of parameter i from its exact value (the shadow, or
  // the parameter itself under priority) into the live parameter; committing
  // also advances the exact value and the state.
  void optimizer_step(size_t i, const void* grad, const std::vector<GroupHyper>& groups,
                      double grad_scale, bool commit) {
    void* exact = options_.schedule == UpdateSchedule::kDecoupled ? shadow_[i].data()
                                                                    : params_[i].param.data;
    step_slot(params_[i], exact, grad, groups, grad_scale, commit);
  }

  // One optimizer step of `p` from `exact` into p.param (see above).
  void step_slot(ParameterSlot& p, void* exact, const void* grad,
                 const std::vector<GroupHyper>& groups, double grad_scale, bool commit) {
    const GroupHyper& h = groups[p.group];
    const auto numel = static_cast<std::int64_t>(p.param.numel);
    if (options_.optimizer == OptimizerKind::kSgd) {
      SgdHyper s;
      s.lr = h.lr;
      s.momentum = h.momentum;
      s.dampening = h.dampening;
      s.weight_decay = h.weight_decay;
      s.nesterov = h.nesterov;
      s.maximize = h.maximize;
      s.first_step = h.momentum != 0.0 && !p.momentum_initialised;
      s.grad_scale = grad_scale;
      HEMIOLA_CHECK(h.momentum == 0.0 || p.momentum_buffer || numel == 0,
                    "updater: parameter '", p.name, "' has momentum ", h.momentum,
                    " but no momentum buffer (set momentum before wrapping)");
      sgd_step(SgdTensors{p.param.data, exact, p.momentum_buffer, grad}, numel,
               p.param.dtype, device_, s, commit, stream_);
      if (commit && h.momentum != 0.0) p.momentum_initialised = true;
      return;
    }
    AdamHyper a;
    a.lr = h.lr;
    a.beta1 = h.beta1;
    a.beta2 = h.beta2;
    a.eps = h.eps;
    a.weight_decay = h.weight_decay;
    a.decoupled_weight_decay = options_.optimizer == OptimizerKind::kAdamW;
    a.maximize = h.maximize;
    a.amsgrad = h.amsgrad;
    a.step = static_cast<std::int64_t>(*p.step) + 1;
    a.grad_scale = grad_scale;
    a.sqrt = options_.sqrt;
    adam_step(AdamTensors{p.param.data, exact, p.exp_avg, p.exp_avg_sq, grad, p.max_exp_avg_sq},
              numel, p.param.dtype, device_, a, commit, stream_);
    if (commit) *p.step += 1.0f;
  }

  // A timeline event on the compute lane; the name is only built when the
  // timeline is recorded (this is on the per-lander path).
  template <typename... Parts>
  void record(const char* category, int64_t start, const Parts&... name) {
    if (!timeline_) return;
    engine_.timeline_record("compute", detail::concat(name...), category, start,
                            engine_.timeline_now_us());
  }

  Engine& engine_;
  ReducerImpl& reducer_;  // its per-bucket interface: the landing graph is in buckets
  UpdaterOptions options_;
  Device device_;      // the reducer's: every parameter, state and gradient lives there
  size_t in_flight_;   // the reducer's: decoupled keeps at most this many iterations pending
  StreamRef stream_;   // the stream of the call in progress (GPU: all work goes there)
  std::unique_ptr<cuda::Event> switched_;  // GPU: orders work across a change of stream
  bool timeline_;  // the engine records a timeline
  bool rebuilt_;
  std::vector<ParameterSlot> params_;
  size_t groups_ = 0;  // 1 + the largest group index of params_
  std::vector<size_t> all_;
  std::vector<std::vector<size_t>> landers_;
  std::vector<std::vector<size_t>> buckets_of_;  // per parameter: its buckets (pieces)
  std::vector<double> bucket_bytes_;
  std::vector<uint8_t> partitioned_;  // per parameter: cut into pieces (result() cannot hold it)
  std::vector<void*> local_grads_;   // this iteration's own gradients
  std::vector<uint8_t> read_;        // read by a forward since the last step()
  std::vector<uint8_t> selected_;    // scratch of update_priority (all zero between calls)
  std::vector<Buffer> shadow_;       // decoupled: the exact parameters
  std::vector<std::vector<Buffer>> gathered_;  // per iteration % (in_flight + 1): results kept here
  std::vector<HostBuffer> staging_;  // GPU: host copies of averaged gradients (readable())
  std::deque<Pending> pending_;  // oldest first
  // (iteration, total norm) of the last clipped iterations, oldest first.
  std::deque<std::pair<uint64_t, double>> clip_norms_;
  Restep restep_;                // in_flight > 1: scratch of re-taken local steps
  uint64_t reads_ = 0;
  uint64_t approximate_reads_ = 0;
  uint64_t previewed_reads_ = 0;  // approximate reads of a preview step
};

Updater::Updater(Engine& engine, Reducer& reducer, std::vector<ParameterSlot> params,
                 const UpdaterOptions& options, StreamRef stream)
    : impl_(std::make_unique<UpdaterImpl>(engine, reducer, std::move(params), options, stream)) {}
Updater::~Updater() = default;

void Updater::set_landers(std::vector<std::vector<size_t>> landers) {
  impl_->set_landers(std::move(landers));
}
void Updater::mark(size_t index, const void* source, void* local_grad, StreamRef stream) {
  impl_->mark(index, source, local_grad, stream);
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
void Updater::land(size_t lander, bool training, StreamRef stream) {
  impl_->land(lander, training, stream);
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
double Updater::preview_read_fraction() const { return impl_->preview_read_fraction(); }

}  // namespace hemiola
