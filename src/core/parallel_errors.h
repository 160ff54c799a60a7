// Exceptions out of parallel regions, and out of memory. An exception may not leave an OpenMP
// parallel region, nor a std::thread's function: the runtime calls
// std::terminate and the process dies with SIGABRT (exit 134) before anything
// is reported. Every parallel loop whose items can throw (allocate, above all:
// std::bad_alloc) runs each item under ParallelErrors::run and calls
// rethrow() after the region, on the thread that opened it, so an error in
// any thread reaches the caller as the same exception type it was thrown as.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
#include <new>
#include <string>

namespace moev {

class ParallelErrors {
 public:
  /// fn() for item `item`, its exception kept (of several, the lowest
  /// item's). Once an item failed the others are skipped: their results
  /// would be thrown away, and after an allocation failed they would only
  /// ask for more.
  template <class Fn>
  void run(int64_t item, Fn&& fn) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      fn();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!first_ || item < first_item_) {
        first_ = std::current_exception();
        first_item_ = item;
      }
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  /// After the region: rethrows the kept exception, if any.
  void rethrow() {
    if (!first_) return;
    std::exception_ptr e = first_;
    first_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    std::rethrow_exception(e);
  }

 private:
  std::mutex mutex_;
  std::exception_ptr first_;
  int64_t first_item_ = 0;
  std::atomic<bool> failed_{false};
};

/// An allocation that failed. Thrown in place of std::bad_alloc where the
/// size is known (Tensor::alloc), and completed on its way out with the case
/// and the stage that asked (the runner, rethrow_out_of_memory); main prints
/// message() as one line and exits 3. A std::bad_alloc from elsewhere (a
/// std::vector) becomes one with bytes 0, "not known".
struct OutOfMemory : std::bad_alloc {
  uint64_t bytes = 0;
  std::string case_name, stage;
  explicit OutOfMemory(uint64_t asked = 0) : bytes(asked) {}
  const char* what() const noexcept override { return "out of memory"; }
  std::string message() const {
    std::string m = "out of memory";
    if (!case_name.empty()) m += " in case '" + case_name + "'";
    if (!stage.empty()) m += ", stage " + stage;
    if (bytes > 0) {
      char gib[32];
      std::snprintf(gib, sizeof gib, "%.2f", double(bytes) / double(uint64_t(1) << 30));
      m += ": an allocation of " + std::to_string(bytes) + " bytes (" + gib + " GiB) failed";
    } else {
      m += ": an allocation failed (its size is not known)";
    }
    return m + "; valid: a smaller case, or more memory for this process (ulimit -v, the cgroup's memory.max, "
               "other jobs); --max-memory refuses a case by its estimate before it runs";
  }
};

/// Inside a handler of std::bad_alloc: rethrows it as OutOfMemory with the
/// case and the stage filled in where they are still empty (the innermost
/// caller that knows them names them).
[[noreturn]] inline void rethrow_out_of_memory(const std::string& case_name, const std::string& stage) {
  OutOfMemory oom;
  try {
    throw;
  } catch (const OutOfMemory& e) {
    oom = e;
  } catch (const std::bad_alloc&) {
  }
  if (oom.case_name.empty()) oom.case_name = case_name;
  if (oom.stage.empty()) oom.stage = stage;
  throw oom;
}

}  // namespace moev
