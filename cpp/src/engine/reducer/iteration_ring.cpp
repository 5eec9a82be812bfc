// The iteration ring: flights taken and released, gradients marked into
// their buckets, and each packed bucket published to the lanes.
#include "engine/reducer/iteration_ring.h"

#include <algorithm>
#include <sstream>

#include "hemiola/status.h"

namespace hemiola {

namespace {
enum SlotState : uint8_t { kPending = 0, kReady = 1, kUnused = 2 };
}  // namespace

IterationRing::IterationRing(const ReducerPlan& plan, size_t in_flight, bool record_order)
    : plan_(plan), ring_size_(in_flight + 1), recording_(record_order) {
  observed_.assign(plan_.specs.size(), 0);
}

void IterationRing::add_lane(RingListener& lane) {
  lanes_.push_back(&lane);
  lane.rebuild(flights_.size());
}

void IterationRing::build(const MakeStorage& make_storage) {
  const size_t buckets = plan_.buckets.size();
  const size_t tensors = plan_.specs.size();
  flights_.clear();
  for (size_t f = 0; f < ring_size_; ++f) {
    auto flight = std::make_unique<InFlightIteration>();
    flight->slot = f;
    // No iteration yet: the waits and queries treat it as long completed.
    flight->iteration = kNoIteration;
    flight->storage = make_storage();
    flight->pending.reset(new std::atomic<int64_t>[buckets]());
    flight->state.reset(new std::atomic<uint8_t>[tensors]);
    flight->out.assign(tensors, nullptr);
    flight->usage.assign(tensors, 0.0f);
    flights_.push_back(std::move(flight));
  }
  for (RingListener* lane : lanes_) lane->rebuild(flights_.size());
}

void IterationRing::replace_storage(const MakeStorage& make_storage) {
  for (auto& flight : flights_) flight->storage = make_storage();
}

InFlightIteration& IterationRing::begin_iteration() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (InFlightIteration* current = marking_.load(std::memory_order_acquire)) return *current;
  const uint64_t iteration = started_.load();
  InFlightIteration& flight = *flights_[iteration % flights_.size()];
  // The in-flight bound: every lane must be done with the iteration that
  // used this flight last before its buffers are reused.
  for (const RingListener* lane : lanes_) lane->release(flight, iteration);
  for (size_t b = 0; b < plan_.buckets.size(); ++b) {
    flight.pending[b].store(static_cast<int64_t>(plan_.buckets[b].tensors.size()),
                            std::memory_order_relaxed);
  }
  for (size_t i = 0; i < plan_.specs.size(); ++i) {
    flight.state[i].store(kPending, std::memory_order_relaxed);
    flight.out[i] = nullptr;
  }
  flight.storage->begin_iteration();
  flight.iteration = iteration;
  // In the order the lanes were added: a lane's work may wait on the
  // handles of the lanes before it.
  for (RingListener* lane : lanes_) lane->begin(flight);
  started_.store(iteration + 1, std::memory_order_release);
  marking_.store(&flight, std::memory_order_release);
  return flight;
}

void IterationRing::observe(MarkObserver& observer) {
  // The marking threads read the observers without a lock.
  HEMIOLA_CHECK(!marking(), "a mark observer (an Updater) is added while gradients are being "
                "marked; add it between iterations");
  observers_.push_back(&observer);
}

void IterationRing::forget(MarkObserver& observer) {
  observers_.erase(std::remove(observers_.begin(), observers_.end(), &observer),
                   observers_.end());
}

void IterationRing::mark(size_t index, const void* source, const void* local, void* out,
                         bool used, void* stream) {
  HEMIOLA_CHECK(index < plan_.specs.size(), "gradient index ", index, " is out of range (",
                plan_.specs.size(), " gradients)");
  const GradSpec& spec = plan_.specs[index];
  HEMIOLA_CHECK(!used || source != nullptr || spec.numel == 0, "gradient '", spec.name,
                "' has a null data pointer");
  check_usable();
  InFlightIteration* current = marking_.load(std::memory_order_acquire);
  InFlightIteration& flight = current ? *current : begin_iteration();
  uint8_t expected = kPending;
  if (!flight.state[index].compare_exchange_strong(expected, used ? kReady : kUnused,
                                                    std::memory_order_acq_rel)) {
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, "gradient '", spec.name,
                  "' was marked ready twice in one iteration. Each parameter must produce one "
                  "gradient per backward pass (reentrant checkpointing, or a second backward "
                  "without finishing the first, can cause this)");
  }
  if (used && !observers_.empty()) {
    Mark mark{index, flight.iteration, source, local, out, stream};
    try {
      for (MarkObserver* observer : observers_) observer->on_mark(mark);
    } catch (const std::exception& e) {
      abort(e.what());
      throw;
    }
    out = mark.out;
  }
  if (used) flight.out[index] = out;
  flight.usage[index] = used ? 1.0f : 0.0f;
  if (recording_.load(std::memory_order_relaxed)) {
    observed_[observed_count_.fetch_add(1, std::memory_order_relaxed)] = index;
  }
  flight.storage->copy_in(index, source, used, stream);
  for (const Placement& piece : plan_.placement[index]) {
    // The last piece of a bucket publishes it. acq_rel: the lanes, which
    // read the buffer after popping, must see every producer's copy.
    if (flight.pending[piece.bucket].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      for (RingListener* lane : lanes_) lane->packed(flight, piece.bucket);
    }
  }
}

std::vector<size_t> IterationRing::unmarked() const {
  const InFlightIteration* flight = marking_.load(std::memory_order_acquire);
  std::vector<size_t> out;
  for (size_t i = 0; i < plan_.specs.size(); ++i) {
    if (!flight || flight->state[i].load(std::memory_order_acquire) == kPending) out.push_back(i);
  }
  return out;
}

int64_t IterationRing::finish_marking() {
  check_usable();
  std::lock_guard<std::mutex> lock(mutex_);
  InFlightIteration* flight = marking_.load(std::memory_order_acquire);
  if (!flight) return -1;
  std::vector<size_t> missing;
  for (size_t i = 0; i < plan_.specs.size(); ++i) {
    if (flight->state[i].load(std::memory_order_acquire) == kPending) missing.push_back(i);
  }
  HEMIOLA_CHECK(missing.empty(), "iteration ", flight->iteration, " finished without gradients ",
                "for ", missing.size(), " tensor(s): ", names(missing),
                " (mark them ready or unused first)");
  if (recording_.load()) recording_.store(false);  // the first iteration is recorded
  marking_.store(nullptr, std::memory_order_release);
  return static_cast<int64_t>(flight->iteration);
}

std::vector<size_t> IterationRing::observed_order() const {
  const size_t count = std::min(observed_count_.load(), plan_.specs.size());
  return std::vector<size_t>(observed_.begin(), observed_.begin() + static_cast<long>(count));
}

void IterationRing::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (!aborted_.load()) abort_reason_ = reason;
    aborted_.store(true, std::memory_order_release);
  }
  for (RingListener* lane : lanes_) lane->wake();
}

std::string IterationRing::abort_reason() const {
  std::lock_guard<std::mutex> lock(abort_mutex_);
  return abort_reason_;
}

void IterationRing::check_usable() const {
  if (aborted_.load(std::memory_order_acquire)) {
    HEMIOLA_THROW(ErrorCode::kAborted, "this reducer was aborted earlier (", abort_reason(),
                  "); re-create the wrapped model to continue");
  }
}

std::string IterationRing::names(const std::vector<size_t>& indices, size_t limit) const {
  std::vector<size_t> unique;
  for (size_t i : indices) {
    if (unique.empty() || unique.back() != i) unique.push_back(i);  // pieces of one tensor
  }
  std::ostringstream out;
  for (size_t i = 0; i < unique.size() && i < limit; ++i) {
    out << (i ? ", " : "") << plan_.specs[unique[i]].name;
  }
  if (unique.size() > limit) out << ", ... (" << unique.size() - limit << " more)";
  return out.str();
}

}  // namespace hemiola
