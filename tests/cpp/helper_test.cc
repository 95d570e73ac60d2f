// jaxops/helper.h under load: every unit runs once whoever claims it, over many jobs back to
// back and after the helper fell asleep, from several calling threads at once, in a forked
// child, and on one CPU (no helper). Built and run by tests/test_helper.py; prints "ok".
#include "jaxops/helper.h"

#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

using jaxops::helper::share;

namespace {

std::atomic<int64_t> by_helper{0};  // units run off the calling thread

// A job of `units` units, each counting itself in `seen` and doing a little work; fails
// (exit 1) unless every unit ran exactly once.
void check_job(int64_t units, int64_t threads, const char* what) {
  std::vector<std::atomic<int>> seen(units);
  std::atomic<double> sink{0};
  const auto caller = std::this_thread::get_id();
  share(units, [&](int64_t i) {
    seen[i].fetch_add(1);
    if (std::this_thread::get_id() != caller) by_helper.fetch_add(1);
    double v = 0;
    for (int k = 0; k < 200; ++k) v += double(k * i) * 1e-9;
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
  while (jaxops::helper::Helper::get() && by_helper.load() == 0 &&
         std::chrono::steady_clock::now() < until)
    check_job(40, 2, "back to back");
  if (jaxops::helper::Helper::get() && by_helper.load() == 0) {
    std::printf("the helper ran no unit\n");
    return 1;
  }
  for (int rep = 0; rep < 20; ++rep) {  // past kSpin: the helper sleeps, is woken
    std::this_thread::sleep_for(jaxops::helper::kSpin * 2);
    check_job(64, 2, "after sleeping");
  }
  check_job(0, 2, "no units");
  check_job(50, 1, "one thread");
  std::vector<std::thread> callers;  // one holds the helper, the others run alone
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([] {
      for (int rep = 0; rep < 3000; ++rep) check_job(1 + rep % 30, 2, "concurrent callers");
    });
  for (auto& t : callers) t.join();
  for (int one_cpu : {0, 1}) {  // a forked child: a helper of its own, or none on one CPU
    const pid_t pid = fork();
    if (pid == 0) {
      if (one_cpu) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(sched_getcpu(), &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0) std::_Exit(3);
        if (jaxops::helper::Helper::get() != nullptr) std::_Exit(4);
      }
      for (int rep = 0; rep < 2000; ++rep) check_job(1 + rep % 40, 2, "forked child");
      std::_Exit(0);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::printf("forked child (one cpu: %d) failed: status %d\n", one_cpu, status);
      return 1;
    }
  }
  std::printf("ok (%lld units by the helper)\n", (long long)by_helper.load());
  return 0;
}
