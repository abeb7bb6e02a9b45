// runtime.h -- the scheduler under metal_emu.h: threadgroups of lanes as threads or
// fibers, simdgroups, barriers with a timeout, the pool that runs a launch's grid.
// Included by metal_emu.h (the Metal built-ins, the header kernels compile against).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <ucontext.h>

typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned short ushort;

struct uint3 {
  uint x, y, z;
};

namespace metal_emu {

class EmuError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline double barrier_timeout_s() {
  const char* s = std::getenv("METAL_EMU_TIMEOUT_S");
  double v = s ? std::atof(s) : 30.0;
  return v > 0 ? v : 30.0;
}

// A reusable barrier that can be poisoned: once any thread of a dispatch fails,
// every waiter (now or later) throws instead of blocking forever.  Every
// participant of one round passes the same `count` (threads of the group).
class Barrier {
 public:
  explicit Barrier(const char* what = "barrier") : what_(what) {}
  void wait(unsigned count) {
    std::unique_lock<std::mutex> lk(m_);
    if (poisoned_) throw EmuError("aborted");
    if (count <= 1) return;
    const uint64_t gen = gen_;
    if (++waiting_ == count) {
      waiting_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    const auto limit = std::chrono::duration<double>(barrier_timeout_s());
    if (!cv_.wait_for(lk, limit, [&] { return gen_ != gen || poisoned_; })) {
      poisoned_ = true;
      cv_.notify_all();
      throw EmuError(std::string(what_) +
                     " not reached by every thread (divergent control flow "
                     "or early return around a barrier / SIMD function)");
    }
    if (gen_ == gen) throw EmuError("aborted");
  }
  void poison() {
    std::lock_guard<std::mutex> lk(m_);
    poisoned_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  unsigned waiting_ = 0;
  uint64_t gen_ = 0;
  bool poisoned_ = false;
  const char* what_;
};

struct SimdGroup {
  Barrier bar{"SIMD-group operation"};
  // Two banks: lanes write bank b, meet at the barrier, read bank b; the next
  // call uses the other bank, so one barrier per call is enough (a lane can
  // only overwrite bank b again after every lane has passed the next barrier).
  alignas(16) unsigned char slot[2][32][16];
};

struct FiberSched;

struct ThreadCtx {
  bool threaded = false;
  FiberSched* fibers = nullptr;  // set when the lanes are fibers, not OS threads
  unsigned fiber_index = 0;
  unsigned lane = 0;
  unsigned bank = 0;
  unsigned sg_lanes = 32;   // active lanes of this thread's SIMD group
  unsigned tg_threads = 1;  // active threads of the running threadgroup
  SimdGroup* sg = nullptr;
  Barrier* tg_bar = nullptr;
};

inline thread_local ThreadCtx* tls_ctx = nullptr;

// Fiber mode (build.py lanes="fibers"): the threads of a threadgroup are
// ucontext fibers on the calling OS thread, switched only at barriers and SIMD
// functions.  Same barrier semantics as the OS-thread mode, ~100x cheaper per
// barrier, deterministic, and a barrier nobody can complete is reported at
// once (no timeout).
struct FiberSched {
  struct Wait {
    std::vector<unsigned> waiters;
  };
  struct Fiber {
    ucontext_t uc;
    ThreadCtx ctx;
    bool done = false, blocked = false;
  };
  ucontext_t main_uc;
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
  Wait tg;
  std::vector<Wait> sgs;
  std::function<void(unsigned)> job;
  unsigned current = 0;
  bool aborted = false;
  std::string error;
  static constexpr size_t kStack = 256 * 1024;

  static void entry() {
    FiberSched* s = tls_ctx->fibers;
    const unsigned i = s->current;
    try {
      s->job(i);
    } catch (const std::exception& e) {
      if (s->error.empty() && std::string(e.what()) != "aborted") s->error = e.what();
      s->aborted = true;
    }
    s->fibers[i].done = true;  // returning resumes main_uc (uc_link)
  }
  void barrier(Wait& w, unsigned count, const char* what) {
    if (aborted) throw EmuError("aborted");
    if (count <= 1) return;
    w.waiters.push_back(current);
    if (w.waiters.size() == count) {
      for (unsigned f : w.waiters) fibers[f].blocked = false;
      w.waiters.clear();
      return;
    }
    Fiber& me = fibers[current];
    me.blocked = true;
    swapcontext(&me.uc, &main_uc);
    if (aborted) throw EmuError("aborted");
    (void)what;
  }
  // Runs job(i) for i < n as fibers until all finish; false on error/deadlock.
  bool run(unsigned n, unsigned nsg, ThreadCtx proto) {
    while (stacks.size() < n) stacks.emplace_back(new char[kStack]);
    fibers.assign(n, Fiber());
    sgs.assign(nsg, Wait());
    tg = Wait();
    for (unsigned i = 0; i < n; ++i) {
      Fiber& f = fibers[i];
      f.ctx = proto;
      f.ctx.fibers = this;
      f.ctx.fiber_index = i;
      getcontext(&f.uc);
      f.uc.uc_stack.ss_sp = stacks[i].get();
      f.uc.uc_stack.ss_size = kStack;
      f.uc.uc_link = &main_uc;
      makecontext(&f.uc, &FiberSched::entry, 0);
    }
    ThreadCtx* saved = tls_ctx;
    unsigned finished = 0;
    while (finished < n && !aborted) {
      bool progress = false;
      for (unsigned i = 0; i < n && !aborted; ++i) {
        Fiber& f = fibers[i];
        if (f.done || f.blocked) continue;
        current = i;
        tls_ctx = &f.ctx;
        swapcontext(&main_uc, &f.uc);
        progress = true;
        if (f.done) ++finished;
      }
      if (!progress && finished < n && !aborted) {
        error = "barrier or SIMD function not reached by every thread (divergent control "
                "flow or early return around a barrier / SIMD function)";
        aborted = true;
      }
    }
    tls_ctx = saved;
    // Fibers still suspended at a barrier are abandoned (their stacks are reused).
    return !aborted;
  }
};

inline ThreadCtx& ctx_for(const char* fn) {
  ThreadCtx* c = tls_ctx;
  if (c == nullptr || !c->threaded)
    throw EmuError(std::string(fn) +
                   " used in a kernel launched without threads (build.py "
                   "decides from the source text; name the function literally)");
  return *c;
}

struct ThreadIds {
  uint3 thread_position_in_grid, thread_position_in_threadgroup,
      threadgroup_position_in_grid, threads_per_threadgroup,
      threadgroups_per_grid, threads_per_grid, grid_size,
      dispatch_threads_per_threadgroup, grid_origin;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup,
      simdgroup_index_in_threadgroup, simdgroups_per_threadgroup,
      threads_per_simdgroup, thread_execution_width,
      dispatch_simdgroups_per_threadgroup;
};

// Exchange one value per lane through the SIMD group's slots.
template <typename T>
inline void simd_gather(T x, T* vals, unsigned* lanes, unsigned* me) {
  static_assert(sizeof(T) <= 16 && std::is_trivially_copyable<T>::value,
                "SIMD value too large");
  ThreadCtx& c = ctx_for("SIMD function");
  SimdGroup& sg = *c.sg;
  const unsigned b = c.bank;
  c.bank ^= 1u;
  std::memcpy(sg.slot[b][c.lane], &x, sizeof(T));
  if (c.fibers)
    c.fibers->barrier(c.fibers->sgs[c.fiber_index / 32], c.sg_lanes, "SIMD-group operation");
  else
    sg.bar.wait(c.sg_lanes);
  for (unsigned i = 0; i < c.sg_lanes; ++i) std::memcpy(&vals[i], sg.slot[b][i], sizeof(T));
  *lanes = c.sg_lanes;
  *me = c.lane;
}

template <typename T, typename Op>
inline T simd_reduce(T x, T identity, Op op) {
  T v[32];
  unsigned lanes, me;
  simd_gather(x, v, &lanes, &me);
  for (unsigned i = lanes; i < 32; ++i) v[i] = identity;
  for (unsigned off = 16; off >= 1; off >>= 1)
    for (unsigned i = 0; i < off; ++i) v[i] = op(v[i], v[i + off]);
  return v[0];
}

template <typename T>
inline T simd_pick(T x, long src) {
  T v[32];
  unsigned lanes, me;
  simd_gather(x, v, &lanes, &me);
  return (src >= 0 && src < (long)lanes) ? v[src] : x;
}

inline unsigned my_lane() { return ctx_for("SIMD function").lane; }

// Worker threads kept for the life of the process (detached, never destroyed),
// so a dispatch costs barrier rounds, not thread creation.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // leaked on purpose: idle detached workers at exit
    return *pool;
  }
  // Runs fn(w) for w in [0, n) on n distinct threads; returns when all are done.
  void run(uint32_t n, const std::function<void(uint32_t)>& fn) {
    Job job{n, &fn, n};
    {
      std::lock_guard<std::mutex> lk(m_);
      while (size_ < n) {
        std::thread(&Pool::loop, this, size_, gen_).detach();
        ++size_;
      }
      job_ = &job;
      ++gen_;
    }
    cv_.notify_all();
    std::unique_lock<std::mutex> lk(job.m);
    job.cv.wait(lk, [&] { return job.remaining == 0; });
    std::lock_guard<std::mutex> lk2(m_);
    job_ = nullptr;
  }

 private:
  struct Job {
    uint32_t n;
    const std::function<void(uint32_t)>* fn;
    uint32_t remaining;
    std::mutex m;
    std::condition_variable cv;
  };
  void loop(uint32_t w, uint64_t seen) {
    for (;;) {
      Job* job;
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return gen_ != seen; });
        seen = gen_;
        job = job_;
      }
      if (job == nullptr || w >= job->n) continue;
      (*job->fn)(w);
      std::lock_guard<std::mutex> lk(job->m);
      if (--job->remaining == 0) job->cv.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  uint64_t gen_ = 0;
  uint32_t size_ = 0;
  Job* job_ = nullptr;
};

// Runs `body` for every thread of the grid.  launch = {grid x, y, z,
// threadgroup x, y, z, lanes (0: OS threads, 1: fibers)}.  Returns 0, or -1
// with a message in err.
inline int dispatch(const uint32_t* launch, bool threaded,
                    const std::function<void(const ThreadIds&)>& body, char* err,
                    int errlen) {
  static std::mutex one_launch_at_a_time;  // threadgroup memory is static
  std::lock_guard<std::mutex> guard(one_launch_at_a_time);
  auto fail = [&](const std::string& msg) {
    if (err && errlen > 0) std::snprintf(err, (size_t)errlen, "%s", msg.c_str());
    return -1;
  };
  const uint32_t g[3] = {launch[0], launch[1], launch[2]};
  uint32_t t[3] = {launch[3], launch[4], launch[5]};
  for (int a = 0; a < 3; ++a) {
    if (g[a] == 0 || t[a] == 0) return fail("grid and threadgroup sizes must be >= 1");
    t[a] = std::min(t[a], g[a]);  // as MLX does before dispatchThreads
  }
  const uint32_t nmax = t[0] * t[1] * t[2];
  if (nmax > 1024) return fail("threadgroup larger than 1024 threads");
  const uint32_t ng[3] = {(g[0] + t[0] - 1) / t[0], (g[1] + t[1] - 1) / t[1],
                          (g[2] + t[2] - 1) / t[2]};

  struct Group {
    uint3 pos, ext;
  } cur{};
  auto ids_in = [&](const Group& grp, uint32_t idx, ThreadIds& id) -> bool {
    const uint32_t ex = grp.ext.x, ey = grp.ext.y, ez = grp.ext.z;
    if (idx >= ex * ey * ez) return false;
    const uint3 l = {idx % ex, (idx / ex) % ey, idx / (ex * ey)};
    id.thread_position_in_threadgroup = l;
    id.threadgroup_position_in_grid = grp.pos;
    id.thread_position_in_grid = {grp.pos.x * t[0] + l.x, grp.pos.y * t[1] + l.y,
                                  grp.pos.z * t[2] + l.z};
    id.threads_per_threadgroup = grp.ext;
    id.dispatch_threads_per_threadgroup = {t[0], t[1], t[2]};
    id.threadgroups_per_grid = {ng[0], ng[1], ng[2]};
    id.threads_per_grid = {g[0], g[1], g[2]};
    id.grid_size = id.threads_per_grid;
    id.grid_origin = {0, 0, 0};
    id.thread_index_in_threadgroup = idx;
    id.thread_index_in_simdgroup = idx % 32;
    id.simdgroup_index_in_threadgroup = idx / 32;
    id.simdgroups_per_threadgroup = (ex * ey * ez + 31) / 32;
    id.dispatch_simdgroups_per_threadgroup = (nmax + 31) / 32;
    id.threads_per_simdgroup = 32;
    id.thread_execution_width = 32;
    return true;
  };
  auto next_group = [&](uint32_t gx, uint32_t gy, uint32_t gz) {
    cur.pos = {gx, gy, gz};
    cur.ext = {std::min(t[0], g[0] - gx * t[0]), std::min(t[1], g[1] - gy * t[1]),
               std::min(t[2], g[2] - gz * t[2])};
  };

  if (!threaded) {
    ThreadCtx c;
    tls_ctx = &c;
    try {
      ThreadIds id;
      for (uint32_t gz = 0; gz < ng[2]; ++gz)
        for (uint32_t gy = 0; gy < ng[1]; ++gy)
          for (uint32_t gx = 0; gx < ng[0]; ++gx) {
            next_group(gx, gy, gz);
            for (uint32_t i = 0; ids_in(cur, i, id); ++i) body(id);
          }
    } catch (const std::exception& e) {
      tls_ctx = nullptr;
      return fail(e.what());
    }
    tls_ctx = nullptr;
    return 0;
  }

  if (launch[6] == 1) {  // lanes as fibers (build.py: lanes="fibers")
    // One threadgroup at a time; its threads are fibers sharing one SIMD slot
    // area per SIMD group (sgs), exactly as the OS-thread mode.
    std::vector<std::unique_ptr<SimdGroup>> sgs;
    for (uint32_t s = 0; s < (nmax + 31) / 32; ++s) sgs.emplace_back(new SimdGroup());
    FiberSched sched;
    for (uint32_t gz = 0; gz < ng[2]; ++gz)
      for (uint32_t gy = 0; gy < ng[1]; ++gy)
        for (uint32_t gx = 0; gx < ng[0]; ++gx) {
          next_group(gx, gy, gz);
          const Group grp = cur;
          const uint32_t n = grp.ext.x * grp.ext.y * grp.ext.z;
          sched.job = [&](unsigned w) {
            ThreadCtx& c = *tls_ctx;
            c.lane = w % 32;
            c.sg = sgs[w / 32].get();
            c.sg_lanes = std::min<uint32_t>(32, n - (w / 32) * 32);
            c.tg_threads = n;
            ThreadIds id;
            ids_in(grp, w, id);
            try {
              body(id);
            } catch (const std::exception& e) {
              if (std::string(e.what()) == "aborted") throw;
              throw EmuError(std::string("thread_position_in_grid (") +
                             std::to_string(id.thread_position_in_grid.x) + "," +
                             std::to_string(id.thread_position_in_grid.y) + "," +
                             std::to_string(id.thread_position_in_grid.z) + "): " + e.what());
            }
          };
          ThreadCtx proto;
          proto.threaded = true;
          if (!sched.run(n, (n + 31) / 32, proto)) return fail(sched.error);
        }
    return 0;
  }

  // Threaded: worker w of a persistent pool is thread index w of every
  // threadgroup in turn; one barrier over all workers separates the groups
  // (threadgroup memory is shared static storage, reused by the next group).
  Barrier group_bar("threadgroup end"), tg_bar("threadgroup_barrier");
  std::vector<std::unique_ptr<SimdGroup>> sgs;
  for (uint32_t s = 0; s < (nmax + 31) / 32; ++s) sgs.emplace_back(new SimdGroup());
  std::mutex err_m;
  std::string first_error;
  auto poison_all = [&](const std::string& why) {
    {
      std::lock_guard<std::mutex> lk(err_m);
      if (first_error.empty() && why != "aborted") first_error = why;
    }
    group_bar.poison();
    tg_bar.poison();
    for (auto& s : sgs) s->bar.poison();
  };
  auto worker = [&](uint32_t w) {
    ThreadCtx c;
    c.threaded = true;
    c.lane = w % 32;
    c.sg = sgs[w / 32].get();
    c.tg_bar = &tg_bar;
    tls_ctx = &c;
    Group mine{};
    ThreadIds id;
    try {
      for (uint32_t gz = 0; gz < ng[2]; ++gz)
        for (uint32_t gy = 0; gy < ng[1]; ++gy)
          for (uint32_t gx = 0; gx < ng[0]; ++gx) {
            mine.pos = {gx, gy, gz};
            mine.ext = {std::min(t[0], g[0] - gx * t[0]), std::min(t[1], g[1] - gy * t[1]),
                        std::min(t[2], g[2] - gz * t[2])};
            const uint32_t n = mine.ext.x * mine.ext.y * mine.ext.z;
            if (ids_in(mine, w, id)) {
              c.bank = 0;
              c.tg_threads = n;
              c.sg_lanes = std::min<uint32_t>(32, n - (w / 32) * 32);
              try {
                body(id);
              } catch (const std::exception& e) {
                if (std::string(e.what()) == "aborted") throw;  // another thread failed first
                poison_all(std::string("thread_position_in_grid (") +
                           std::to_string(id.thread_position_in_grid.x) + "," +
                           std::to_string(id.thread_position_in_grid.y) + "," +
                           std::to_string(id.thread_position_in_grid.z) + "): " + e.what());
                throw;
              }
            }
            group_bar.wait(nmax);
          }
    } catch (const std::exception& e) {
      poison_all(e.what());
    }
    tls_ctx = nullptr;
  };
  Pool::get().run(nmax, worker);
  if (!first_error.empty()) return fail(first_error);
  return 0;
}

}  // namespace metal_emu
