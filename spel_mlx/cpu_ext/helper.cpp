// A second thread that shares a primitive body's independent items (the key chunks of
// attention over a long cache) when the machine has a core to spare.  Items are
// claimed one at a time, so a helper the OS does not schedule costs the caller only
// the wake-up: the caller then takes every item itself.  Which thread runs an item
// changes no arithmetic, so the bits do not depend on the split.
#if defined(__linux__)
#include <sched.h>
#endif
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "common.h"

namespace spel {
namespace {

std::atomic<bool> helper_allowed{true};
std::atomic<int64_t> helper_items{0};   // items the helper thread has run
// After a prewake the helper waits this long awake for the job (a sleeping thread
// takes tens of microseconds to wake); then it sleeps again.
constexpr auto AWAKE = std::chrono::microseconds(300);
// After a job it stays awake this long for the next one (a pass's next product).
constexpr auto AWAKE_AFTER = std::chrono::microseconds(100);

inline void pause() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// The job number and its next item share one word (job << 32 | item), so a helper
// that wakes after its job ended can never claim an item of the next one.
class Helper {
 public:
  Helper() : thread_([this] { loop(); }) { thread_.detach(); }

  void prewake() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++calls_;
    }
    wake_.notify_one();
  }

  // false: another caller is using the helper (run the items yourself)
  bool run(int64_t n, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> one_caller(run_mu_, std::try_to_lock);
    if (!one_caller.owns_lock()) return false;
    uint64_t job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job = ++job_;
      ++calls_;
      fn_ = &fn;
      n_ = n;
      word_.store(job << 32);
    }
    wake_.notify_one();
    for (int64_t i; (i = claim(job, n)) >= 0;) fn(i);
    while (busy_.load()) pause();   // an item the helper took is still running
    return true;
  }

 private:
  // the next item of job `job`, or -1 when none is left (or the job has ended)
  int64_t claim(uint64_t job, int64_t n) {
    uint64_t w = word_.load();
    while ((w >> 32) == job && static_cast<int64_t>(w & 0xFFFFFFFFu) < n)
      if (word_.compare_exchange_weak(w, w + 1)) return static_cast<int64_t>(w & 0xFFFFFFFFu);
    return -1;
  }

  void loop() {
    uint64_t seen = 0, calls = 0;
    for (;;) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return calls_ != calls; });
      calls = calls_;
      if (job_ == seen) {   // a prewake: wait for the job awake, a while
        lock.unlock();
        const auto until = std::chrono::steady_clock::now() + AWAKE;
        while ((word_.load() >> 32) == seen && std::chrono::steady_clock::now() < until)
          for (int i = 0; i < 64; i++) pause();
        lock.lock();
        calls = calls_;
        if (job_ == seen) continue;
      }
      seen = job_;
      const std::function<void(int64_t)>* fn = fn_;
      const int64_t n = n_;
      busy_.store(true);   // before the first claim: the caller waits for it
      lock.unlock();
      for (int64_t i; (i = claim(seen, n)) >= 0;) {
        (*fn)(i);
        helper_items.fetch_add(1, std::memory_order_relaxed);
      }
      busy_.store(false);
      // the products of one pass come as a burst of jobs: stay awake a while for the next
      const auto until = std::chrono::steady_clock::now() + AWAKE_AFTER;
      while ((word_.load() >> 32) == seen && std::chrono::steady_clock::now() < until)
        for (int i = 0; i < 64; i++) pause();
    }
  }

  std::mutex run_mu_;                                  // one caller at a time
  std::mutex mu_;
  std::condition_variable wake_;
  uint64_t job_ = 0, calls_ = 0;                       // under mu_
  const std::function<void(int64_t)>* fn_ = nullptr;   // under mu_
  int64_t n_ = 0;                                      // under mu_
  std::atomic<uint64_t> word_{0};
  std::atomic<bool> busy_{false};
  std::thread thread_;
};

// CPUs this process may run on (its affinity mask), read once
unsigned usable_cpus() {
  static const unsigned n = [] {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<unsigned>(CPU_COUNT(&set));
#endif
    return std::thread::hardware_concurrency();   // no affinity mask to read (macOS)
  }();
  return n;
}

// The process's helper, or null when there is no second core or it is switched off.
// Never destroyed (a detached thread waits in it); a forked child, which has no copy
// of the thread, starts its own.
Helper* helper() {
  if (usable_cpus() < 2 || !helper_allowed.load(std::memory_order_relaxed)) return nullptr;
  static std::mutex mu;
  static Helper* one = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (one == nullptr || owner != getpid()) {
    one = new Helper();
    owner = getpid();
  }
  return one;
}

}  // namespace

void share_items(int64_t n, const std::function<void(int64_t)>& fn) {
  Helper* h = n >= 2 ? helper() : nullptr;
  if (h != nullptr && h->run(n, fn)) return;
  for (int64_t i = 0; i < n; i++) fn(i);
}

void prewake_helper() {
  if (Helper* h = helper()) h->prewake();
}

bool set_helper(bool enable) { return helper_allowed.exchange(enable); }

int64_t helper_items_run() { return helper_items.load(); }

std::string helper_state() {
  if (!helper_allowed.load()) return "off";
  return usable_cpus() < 2 ? "off (one usable CPU)" : "on";
}

}  // namespace spel
