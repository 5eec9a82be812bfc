// Bounded lock-free multi-producer / single-consumer queue (Vyukov's bounded
// queue, specialised to one consumer), plus a parking mechanism so the
// consumer can sleep when the queue is empty.
//
// Producers are autograd hooks on any thread: push() is lock-free (one CAS on
// the tail in the common case) and takes the mutex only when the consumer is
// parked, to wake it. The consumer is the engine's scheduler thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

#include "hemiola/status.h"

namespace hemiola {

template <typename T>
class ReadyQueue {
 public:
  // `capacity` is rounded up to a power of two. A push into a full queue
  // fails (returns false): callers size the queue so that cannot happen (one
  // slot per bucket: a bucket is enqueued at most once per iteration).
  explicit ReadyQueue(size_t capacity) {
    size_t cap = 2;
    while (cap < capacity) cap <<= 1;
    mask_ = cap - 1;
    cells_.reset(new Cell[cap]);
    for (size_t i = 0; i < cap; ++i) cells_[i].sequence.store(i, std::memory_order_relaxed);
  }

  bool push(const T& value) {
    size_t pos = tail_.load(std::memory_order_relaxed);
    Cell* cell;
    while (true) {
      cell = &cells_[pos & mask_];
      const size_t seq = cell->sequence.load(std::memory_order_acquire);
      const intptr_t diff = static_cast<intptr_t>(seq) - static_cast<intptr_t>(pos);
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) break;
      } else if (diff < 0) {
        return false;  // full
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
    cell->value = value;
    cell->sequence.store(pos + 1, std::memory_order_release);
    // Dekker-style handshake with pop_wait(): the consumer publishes
    // `parked_` then re-checks the queue; we publish the item then check
    // `parked_`. With both fences at least one side sees the other.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (parked_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(mutex_);
      cv_.notify_one();
    }
    return true;
  }

  // Consumer only.
  bool try_pop(T& out) {
    Cell* cell = &cells_[head_ & mask_];
    const size_t seq = cell->sequence.load(std::memory_order_acquire);
    if (static_cast<intptr_t>(seq) - static_cast<intptr_t>(head_ + 1) < 0) return false;
    out = cell->value;
    cell->sequence.store(head_ + mask_ + 1, std::memory_order_release);
    ++head_;
    return true;
  }

  // Consumer only: waits up to `timeout` for an item, or until wake() is
  // called. Returns false when nothing arrived.
  bool pop_wait(T& out, std::chrono::milliseconds timeout) {
    if (try_pop(out)) return true;
    // Spin briefly: a gradient usually arrives within microseconds in backward.
    for (int i = 0; i < 64; ++i) {
      if (try_pop(out)) return true;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock<std::mutex> lock(mutex_);
    parked_.store(true, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    bool got = try_pop(out);
    // Loop: a notification may come from a producer whose item sits behind
    // one that another producer has claimed but not yet published; that
    // producer notifies again when it publishes.
    while (!got && !woken_) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
        got = try_pop(out);
        break;
      }
      got = try_pop(out);
    }
    woken_ = false;
    parked_.store(false, std::memory_order_relaxed);
    return got;
  }

  // Wakes a parked consumer without an item (to notice an abort).
  void wake() {
    std::lock_guard<std::mutex> lock(mutex_);
    woken_ = true;
    cv_.notify_one();
  }

 private:
  struct Cell {
    std::atomic<size_t> sequence;
    T value;
  };
  std::unique_ptr<Cell[]> cells_;
  size_t mask_ = 0;
  alignas(64) std::atomic<size_t> tail_{0};
  alignas(64) size_t head_ = 0;  // consumer-owned
  alignas(64) std::atomic<bool> parked_{false};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool woken_ = false;  // guarded by mutex_
};

}  // namespace hemiola
