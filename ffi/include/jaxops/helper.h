// Helper threads for the CPU kernels that run on XLA's calling thread (conv.h): share(units,
// work, threads) runs work(i) for every i < units, claimed one at a time by the calling thread
// (from the front) and by up to threads - 1 helper threads of the process (from the back),
// and returns when all are done. ORT's inference session at its defaults runs a convolution
// on every core; XLA:CPU runs a custom call on one.
//
// A helper polls for kSpin after its last unit (a forward's kernels come ~20-200 us apart,
// and waking a sleeping thread costs more than that on a VM), then sleeps. The caller never
// waits for a helper that has not started on its job: it claims every unit left and takes the
// job back, so a late, descheduled or absent helper costs at most the caller's own time.
// Where the process may run on one CPU only, another caller holds the helpers, no thread can
// be started, or after a fork (the child has no helper threads), everything runs on the caller.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace jaxops::helper {

constexpr auto kSpin = std::chrono::milliseconds(2);
constexpr int kMaxHelpers = 63;  // a job's most (with the caller: 64 threads)

inline void pause() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

// One shared job: the caller claims units from the front, the helpers from the back (each
// then reads and writes its own part of the data, which other threads wrote before: moving
// it between cores cost a helper more than its half of the work where two took turns);
// `finished` counts the helpers that took the job and are done with it (and have run `tidy`,
// where given: what a thread does after its last unit of a job).
struct Job {
  void (*run)(const void* work, int64_t unit);
  const void* work;
  void (*tidy)() = nullptr;
  std::atomic<uint64_t> range;  // the units left: [front, back), front in the high half
  std::atomic<int> finished{0};

  int cpu = sched_getcpu();  // the caller's

  Job(void (*run)(const void*, int64_t), const void* work, uint32_t units)
      : run(run), work(work), range(units) {}

  int64_t claim(bool from_back) {  // -1: none left
    uint64_t r = range.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = uint32_t(r >> 32), back = uint32_t(r);
      if (front >= back) return -1;
      const uint64_t left = from_back ? (r - 1) : (r + (uint64_t(1) << 32));
      if (range.compare_exchange_weak(r, left, std::memory_order_relaxed))
        return from_back ? back - 1 : front;
    }
  }

  bool any_left() const {
    const uint64_t r = range.load(std::memory_order_relaxed);
    return uint32_t(r >> 32) < uint32_t(r);
  }

  void drain(bool from_back = false) {
    for (int64_t i; (i = claim(from_back)) >= 0;) run(work, i);
  }
};

// The process's helper threads, started as jobs first ask for them and never stopped; each
// takes a job from a slot of its own, so that a job's caller knows which helpers took it.
class Helpers {
 public:
  // The process's helpers, or null where there are none to have (one CPU, after a fork: new
  // ones are made for the child).
  static Helpers* get() {
    static std::atomic<Helpers*> current{nullptr};
    Helpers* h = current.load(std::memory_order_acquire);
    if (!h || h->pid_ != getpid()) {
      Helpers* fresh = new Helpers;  // (never freed: its threads may outlive any owner)
      if (current.compare_exchange_strong(h, fresh, std::memory_order_acq_rel)) h = fresh;
      else delete fresh;  // another thread made them first (no thread started yet)
    }
    return h->cpus_ > 1 && h->pid_ == getpid() ? h : nullptr;
  }

  // Runs job on this thread and up to `wanted` helpers (at most one fewer than the CPUs the
  // process may use); false where another caller holds them or none can start (the job is
  // then untouched).
  bool run(Job& job, int64_t wanted) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    const int64_t most = std::min<int64_t>({wanted, cpus_ - 1, kMaxHelpers});
    int helpers = 0;
    while (helpers < most && start(helpers)) ++helpers;
    if (helpers == 0) return false;
    for (int i = 0; i < helpers; ++i) slots_[i].store(&job, std::memory_order_seq_cst);
    asked_.store(helpers, std::memory_order_seq_cst);
    posted_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) {
      { std::lock_guard<std::mutex> lock(m_); }
      wake_.notify_all();
    }
    job.drain();
    // take the job back from the helpers that have not taken it; wait for those that have
    // (each for its unit in progress)
    int took = 0;
    for (int i = 0; i < helpers; ++i)
      took += slots_[i].exchange(nullptr, std::memory_order_acq_rel) != &job;
    for (int spins = 0; job.finished.load(std::memory_order_acquire) < took; ++spins) {
      if (spins < 64) pause();
      else sched_yield();  // (a helper may be on this CPU)
    }
    return true;
  }

 private:
  Helpers() : pid_(getpid()) {
#ifdef JAXOPS_HELPER_CPUS  // (tests/cpp/helper_test.cc: more helpers than the machine has CPUs)
    cpus_ = JAXOPS_HELPER_CPUS;
#else
    cpu_set_t set;
    cpus_ = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
#endif
  }

  bool start(int i) {  // (under busy_)
    if (i < started_) return true;
    try {
      std::thread([this, i] { loop(i); }).detach();
    } catch (...) {  // (no thread to be had: the ones started so far take part)
      return false;
    }
    started_ = i + 1;
    return true;
  }

  // Helper i's next job: polled for kSpin, yielding the CPU between polls (a helper woken onto
  // the caller's CPU then leaves it to the caller), then waited for asleep until a job is
  // posted for it or for as many helpers as it is (helpers 0 .. n - 1 of a job asking for n);
  // woken, it polls again whether or not that job is still there. (Waking takes longer
  // than a job lasts on this KVM guest: a helper that waited for a job it could still take went
  // back to sleep at nearly every post, and took 396-455 of the 800 jobs of DeepLabV3's 400
  // forwards in loops of 9, each loop after a 3 ms sleep; woken by any post, 589. 2026-12-04.)
  Job* wait(int i) {
    std::atomic<Job*>& slot = slots_[i];
    auto until = std::chrono::steady_clock::now() + kSpin;
    for (int polls = 0;; ++polls) {
      if (slot.load(std::memory_order_relaxed))  // (read-only until there is one)
        if (Job* j = slot.exchange(nullptr, std::memory_order_acq_rel)) return j;
      sched_yield();
      if (polls % 16 || std::chrono::steady_clock::now() < until) continue;
      std::unique_lock<std::mutex> lock(m_);
      const uint64_t seen = posted_.load(std::memory_order_seq_cst);
      sleeping_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] {  // (a job posted before `seen` was read is still waited for)
        return slot.load(std::memory_order_seq_cst) != nullptr ||
               (posted_.load(std::memory_order_seq_cst) != seen &&
                asked_.load(std::memory_order_seq_cst) > i);
      });
      sleeping_.fetch_sub(1, std::memory_order_relaxed);
      until = std::chrono::steady_clock::now() + kSpin;
    }
  }

  // Where a helper runs on the caller's CPU, it moves to another one it may run on: a helper
  // woken from sleep was placed there (on this KVM guest), and ran only when the caller's time
  // slice ended: DeepLabV3's forward shared nothing after an idle wait. Its own CPU mask
  // stays as it was.
  static void leave(int cpu) {
    if (cpu < 0 || sched_getcpu() != cpu) return;
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof mask, &mask) != 0 || !CPU_ISSET(cpu, &mask)) return;
    cpu_set_t others = mask;
    CPU_CLR(cpu, &others);
    if (CPU_COUNT(&others) == 0 || sched_setaffinity(0, sizeof others, &others) != 0) return;
    sched_setaffinity(0, sizeof mask, &mask);  // (moved now; free to move again later)
  }

  void loop(int i) {
    for (;;) {
      Job* j = wait(i);
      if (j->any_left()) leave(j->cpu);  // (else the caller waits for finished)
      j->drain(true);
      if (j->tidy) j->tidy();
      j->finished.fetch_add(1, std::memory_order_release);
    }
  }

  pid_t pid_;
  int cpus_ = 1;
  int started_ = 0;  // helpers 0 .. started_ - 1 run (under busy_)
  std::mutex busy_;  // one sharing caller at a time
  std::mutex m_;
  std::condition_variable wake_;
  std::atomic<Job*> slots_[kMaxHelpers] = {};
  std::atomic<int> sleeping_{0};
  std::atomic<uint64_t> posted_{0};  // jobs posted so far (sleeping helpers wake at the next)
  std::atomic<int> asked_{0};  // the helpers the last job posted asked for
};

// work(i) for every i in [0, units): on this thread alone where `threads` < 2, units < 2 or
// no helper is free, else shared with up to threads - 1 helpers (no more than units - 1),
// each of which then runs tidy() after its last unit (the caller's own tidying is its own).
template <class F>
void share(int64_t units, const F& work, int64_t threads, void (*tidy)() = nullptr) {
  if (threads < 2 || units < 2 || units > int64_t(UINT32_MAX)) {
    for (int64_t i = 0; i < units; ++i) work(i);
    return;
  }
  Job job([](const void* w, int64_t i) { (*static_cast<const F*>(w))(i); }, &work,
          uint32_t(units));
  job.tidy = tidy;
  Helpers* h = Helpers::get();
  if (!h || !h->run(job, std::min(threads, units) - 1)) job.drain();
}

}  // namespace jaxops::helper
