// A lane's walk over one iteration's buckets, and its per-bucket results.
#include "engine/reducer/lane.h"

#include <sstream>

#include "hemiola/status.h"

namespace hemiola {

bool wait_for_flag(std::mutex& mutex, std::condition_variable& cv, const std::atomic<bool>& done,
                   const Handle& handle) {
  std::unique_lock<std::mutex> lock(mutex);
  while (!done.load(std::memory_order_acquire)) {
    if (handle.done()) break;
    cv.wait_for(lock, std::chrono::milliseconds(50));
  }
  return done.load(std::memory_order_acquire);
}

void set_flag(std::mutex& mutex, std::condition_variable& cv, std::atomic<bool>& done) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    done.store(true, std::memory_order_release);
  }
  cv.notify_all();
}

// The scheduler's view of one iteration of one lane.
class Lane::Walk final : public Work {
 public:
  Walk(Lane& lane, InFlightIteration& flight) : lane_(lane), flight_(flight) {}
  void run(Communicator& comm, Timeline& timeline) override {
    lane_.run(flight_, comm, timeline, &position_);
  }
  std::string describe() const override {
    std::ostringstream out;
    out << lane_.what_ << " of iteration " << flight_.iteration;
    if (position_ != kNotStarted) out << lane_.where(flight_, position_);
    return out.str();
  }

 private:
  static constexpr size_t kNotStarted = static_cast<size_t>(-1);
  Lane& lane_;
  InFlightIteration& flight_;
  size_t position_ = kNotStarted;  // written and read on the lane's thread
};

Lane::Lane(std::string timeline_lane, std::string what, const IterationRing& ring,
           const ReducerPlan& plan, Scheduler& host, size_t wire)
    : ring_(ring), plan_(plan), host_(host), timeline_lane_(std::move(timeline_lane)),
      what_(std::move(what)), wire_(wire) {}

std::chrono::milliseconds Lane::timeout() const {
  return std::chrono::milliseconds(static_cast<int64_t>(host_.options().timeout_s * 1000.0));
}

void Lane::rebuild(size_t flights) {
  const size_t buckets = plan_.buckets.size();
  flights_.clear();
  for (size_t f = 0; f < flights; ++f) {
    auto state = std::make_unique<PerFlight>();
    state->queue = std::make_unique<ReadyQueue<uint32_t>>(buckets);
    state->done.reset(new std::atomic<bool>[buckets]());
    flights_.push_back(std::move(state));
  }
  on_rebuild(flights);
}

void Lane::begin(InFlightIteration& flight) {
  PerFlight& s = state(flight.slot);
  s.active = takes(flight);
  for (size_t b = 0; b < plan_.buckets.size(); ++b) {
    s.done[b].store(false, std::memory_order_relaxed);
  }
  on_begin(flight);
  if (s.active) s.handle = host_.submit(wire_, std::make_shared<Walk>(*this, flight));
}

void Lane::packed(const InFlightIteration& flight, size_t bucket) {
  PerFlight& s = state(flight.slot);
  if (s.active && !s.queue->push(static_cast<uint32_t>(bucket))) {
    HEMIOLA_THROW(ErrorCode::kInternal, "ready queue overflow");
  }
}

void Lane::release(const InFlightIteration& flight, uint64_t next) const {
  const Handle& handle = state(flight.slot).handle;
  if (handle.valid()) handle.wait();
}

void Lane::wake() {
  for (auto& s : flights_) s->queue->wake();
}

bool Lane::active(uint64_t iteration) const {
  const InFlightIteration& flight = ring_.flight_for(iteration);
  return flight.iteration == iteration && state(flight.slot).active;
}

void Lane::run(InFlightIteration& flight, Communicator& comm, Timeline& timeline,
               size_t* position) {
  PerFlight& s = state(flight.slot);
  const size_t count = plan_.buckets.size();
  std::vector<bool> ready(count, false);
  before(flight, comm, timeline);
  wait_gates(flight, timeline);
  for (size_t p = 0; p < count; ++p) {
    const size_t b = plan_.issue_order[p];
    *position = p;
    wait_packed(s, b, ready, timeline);
    step(flight, b, comm, timeline);
    for (const Observer& observer : observers_) observer(flight, b);
    set_flag(s.mutex, s.cv, s.done[b]);
  }
  *position = count;
  after(flight, comm, timeline);
}

void Lane::wait_gates(const InFlightIteration& flight, Timeline& timeline) const {
  for (const Lane* gate : gates_) {
    const int64_t start_us = timeline.now_us();
    for (size_t b = 0; b < plan_.buckets.size(); ++b) {
      if (!gate->await(flight.iteration, b)) {
        HEMIOLA_THROW(ErrorCode::kAborted, "the ", gate->what_, " of iteration ",
                      flight.iteration, " failed (see the error of its lane)");
      }
    }
    if (timeline.enabled() && timeline.now_us() - start_us > 1) {
      timeline.record(timeline_lane_, "wait " + gate->timeline_lane_ + "s", "wait", start_us,
                      timeline.now_us());
    }
  }
}

void Lane::wait_packed(PerFlight& s, size_t bucket, std::vector<bool>& ready,
                       Timeline& timeline) const {
  const auto limit = timeout();
  const auto wait_start = std::chrono::steady_clock::now();
  const int64_t wait_us = timeline.now_us();
  while (!ready[bucket]) {
    uint32_t id;
    if (s.queue->pop_wait(id, std::chrono::milliseconds(100))) {
      ready[id] = true;
      continue;
    }
    if (ring_.aborted()) {
      HEMIOLA_THROW(ErrorCode::kAborted, "aborted: ", ring_.abort_reason());
    }
    if (std::chrono::steady_clock::now() - wait_start > limit) {
      HEMIOLA_THROW(ErrorCode::kTimeout, "on this rank, bucket ", bucket,
                    " never became ready within ", host_.options().timeout_s,
                    " s: its gradients were never produced");
    }
  }
  if (timeline.enabled() && timeline.now_us() - wait_us > 1) {
    timeline.record(timeline_lane_, "wait bucket " + std::to_string(bucket), "wait", wait_us,
                    timeline.now_us());
  }
}

bool Lane::await(uint64_t iteration, size_t bucket) const {
  const InFlightIteration& flight = ring_.flight_for(iteration);
  // Reused since (in_flight = 0 reuses a flight at once): that iteration is done.
  if (flight.iteration != iteration) return true;
  const PerFlight& s = state(flight.slot);
  if (!s.active) return true;
  return wait_for_flag(s.mutex, s.cv, s.done[bucket], s.handle);
}

const Placement& Lane::whole(size_t index, const char* remedy) const {
  HEMIOLA_CHECK(index < plan_.specs.size(), "gradient index ", index, " is out of range");
  HEMIOLA_CHECK(plan_.placement[index].size() == 1, "gradient '", plan_.specs[index].name,
                "' is partitioned across ", plan_.placement[index].size(), " buckets", remedy);
  return plan_.placement[index].front();
}

bool Lane::done(uint64_t iteration, size_t bucket) const {
  HEMIOLA_CHECK(bucket < plan_.buckets.size(), "bucket ", bucket, " is out of range (",
                plan_.buckets.size(), " buckets)");
  if (iteration >= ring_.started()) return false;
  const InFlightIteration& flight = ring_.flight_for(iteration);
  if (flight.iteration != iteration) return true;  // reused: it completed long ago
  const PerFlight& s = state(flight.slot);
  return s.active && s.done[bucket].load(std::memory_order_acquire) &&
         complete_on_device(flight, bucket);
}

void Lane::wait(uint64_t iteration, size_t bucket, void* stream) {
  HEMIOLA_CHECK(bucket < plan_.buckets.size(), "bucket ", bucket, " is out of range (",
                plan_.buckets.size(), " buckets)");
  InFlightIteration* flight;
  Handle handle;
  {
    std::lock_guard<std::mutex> lock(ring_.mutex());
    HEMIOLA_CHECK(iteration < ring_.started(), "iteration ", iteration, " has not started");
    flight = const_cast<InFlightIteration*>(&ring_.flight_for(iteration));
    if (flight->iteration != iteration || !state(flight->slot).active) return;
    handle = state(flight->slot).handle;
  }
  PerFlight& s = state(flight->slot);
  // Wake up for the bucket, or for the end of the whole iteration (which is
  // also how a failure arrives); the handle then rethrows it.
  if (!wait_for_flag(s.mutex, s.cv, s.done[bucket], handle)) handle.wait();
  wait_on_device(*flight, bucket, stream);
}

void Lane::wait_for(uint64_t iteration, const std::vector<size_t>& indices, void* stream) {
  std::vector<size_t> order;
  {
    std::lock_guard<std::mutex> lock(ring_.mutex());
    HEMIOLA_CHECK(iteration < ring_.started(), "iteration ", iteration, " has not started");
    const InFlightIteration& flight = ring_.flight_for(iteration);
    HEMIOLA_CHECK(flight.iteration != iteration || ring_.marking_flight() != &flight,
                  "wait_for(", iteration, ", ...) while its gradients are still being marked; "
                  "call finish_marking() first");
    order = plan_.issue_order;
  }
  std::vector<bool> needed(plan_.buckets.size(), false);
  for (size_t i : indices) {
    HEMIOLA_CHECK(i < plan_.specs.size(), "gradient index ", i, " is out of range (",
                  plan_.specs.size(), " gradients)");
    for (const Placement& piece : plan_.placement[i]) needed[piece.bucket] = true;
  }
  for (size_t b : order) {
    if (needed[b]) wait(iteration, b, stream);
  }
}

void Lane::wait_iteration(uint64_t iteration, void* stream) {
  Handle handle;
  const InFlightIteration* flight = nullptr;
  {
    std::lock_guard<std::mutex> lock(ring_.mutex());
    HEMIOLA_CHECK(iteration < ring_.started(), "iteration ", iteration, " has not started");
    flight = &ring_.flight_for(iteration);
    if (flight->iteration != iteration) return;  // reused: it completed long ago
    HEMIOLA_CHECK(ring_.marking_flight() != flight, "wait(", iteration,
                  ") while its gradients are still being marked; call finish_marking() first");
    if (!state(flight->slot).active) return;
    handle = state(flight->slot).handle;
  }
  handle.wait();
  wait_iteration_on_device(*flight, stream);
}

}  // namespace hemiola
