// jaxops/helper.h under load: every unit runs once whoever claims it, over many jobs back to
// back and after the helpers fell asleep, shared by as many helpers as the CPUs allow, from
// several calling threads at once, in a forked child, and on one CPU (no helper). Built and
// run by tests/test_helper.py (also with JAXOPS_HELPER_CPUS, more CPUs than the machine has);
// prints "ok".
#include "jaxops/helper.h"

#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

using jaxops::helper::share;

namespace {

std::atomic<int64_t> by_helper{0};  // units run off the calling thread
std::mutex seen_mutex;
std::set<std::thread::id> helpers_seen;  // the threads other than the callers that ran units
int work_per_unit = 200;

size_t seen_count() {
  std::lock_guard<std::mutex> lock(seen_mutex);
  return helpers_seen.size();
}

// A job of `units` units, each counting itself in `seen` and doing a little work; fails
// (exit 1) unless every unit ran exactly once.
void check_job(int64_t units, int64_t threads, const char* what) {
  std::vector<std::atomic<int>> seen(units);
  std::atomic<double> sink{0};
  const auto caller = std::this_thread::get_id();
  share(units, [&](int64_t i) {
    seen[i].fetch_add(1);
    if (std::this_thread::get_id() != caller) {
      by_helper.fetch_add(1);
      std::lock_guard<std::mutex> lock(seen_mutex);
      helpers_seen.insert(std::this_thread::get_id());
    }
    double v = 0;
    for (int k = 0; k < work_per_unit; ++k) v += double(k * i) * 1e-9;
    sink.store(v);
  }, threads);
  for (int64_t i = 0; i < units; ++i)
    if (seen[i].load() != 1) {
      std::printf("%s: unit %lld of %lld ran %d times\n", what, (long long)i, (long long)units,
                  seen[i].load());
      std::exit(1);
    }
}

}  // namespace

int main() {
  for (int rep = 0; rep < 20000; ++rep) check_job(1 + rep % 40, 2, "back to back");
  // (more than one CPU: the helper takes part, given time on a loaded machine)
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (jaxops::helper::Helpers::get() && by_helper.load() == 0 &&
         std::chrono::steady_clock::now() < until)
    check_job(40, 2, "back to back");
  if (jaxops::helper::Helpers::get() && by_helper.load() == 0) {
    std::printf("the helper ran no unit\n");
    return 1;
  }
  // as many helpers as asked for, up to one fewer than the CPUs: each takes part, given time
#ifdef JAXOPS_HELPER_CPUS
  const int cpus = JAXOPS_HELPER_CPUS;
#else
  cpu_set_t set;
  const int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
#endif
  const size_t helpers = size_t(std::min(7, cpus - 1));
  work_per_unit = 5000;
  const auto many_until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (seen_count() < helpers && std::chrono::steady_clock::now() < many_until)
    check_job(400, 8, "eight threads");
  work_per_unit = 200;
  if (seen_count() != helpers) {
    std::printf("%zu helpers ran units of jobs of 8 threads, not %zu\n", seen_count(), helpers);
    return 1;
  }
  for (int rep = 0; rep < 5000; ++rep) check_job(1 + rep % 40, 1 + rep % 9, "1-9 threads");
  for (int rep = 0; rep < 20; ++rep) {  // past kSpin: the helpers sleep, are woken
    std::this_thread::sleep_for(jaxops::helper::kSpin * 2);
    check_job(64, 2 + rep % 7, "after sleeping");
  }
  check_job(0, 2, "no units");
  check_job(50, 1, "one thread");
  std::vector<std::thread> callers;  // one holds the helpers, the others run alone
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([c] {
      for (int rep = 0; rep < 3000; ++rep)
        check_job(1 + rep % 30, 2 + c, "concurrent callers");
    });
  for (auto& t : callers) t.join();
#ifdef JAXOPS_HELPER_CPUS
  const bool one_cpu_too = false;  // (the CPUs are not the process's)
#else
  const bool one_cpu_too = true;
#endif
  for (int one_cpu : {0, 1}) {  // a forked child: helpers of its own, or none on one CPU
    if (one_cpu && !one_cpu_too) break;
    const pid_t pid = fork();
    if (pid == 0) {
      if (one_cpu) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(sched_getcpu(), &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0) std::_Exit(3);
        if (jaxops::helper::Helpers::get() != nullptr) std::_Exit(4);
      }
      for (int rep = 0; rep < 2000; ++rep) check_job(1 + rep % 40, 2 + rep % 4, "forked child");
      std::_Exit(0);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::printf("forked child (one cpu: %d) failed: status %d\n", one_cpu, status);
      return 1;
    }
  }
  std::printf("ok (%lld units by %zu helpers)\n", (long long)by_helper.load(), seen_count());
  return 0;
}
