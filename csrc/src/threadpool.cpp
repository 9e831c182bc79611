#include "threadpool.h"

#include <chrono>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MLXINFER_PAUSE() _mm_pause()
#else
#define MLXINFER_PAUSE() std::this_thread::yield()
#endif

namespace mlxinfer {

int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) {
      return n;
    }
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

ThreadPool& ThreadPool::instance() {
  // Leaked on purpose: joining threads during static destruction at interpreter exit
  // can deadlock; the OS reclaims them.
  static ThreadPool* pool = new ThreadPool();
  return *pool;
}

ThreadPool::ThreadPool() {
  start(available_cpus());
}

ThreadPool::~ThreadPool() {
  stop();
}

void ThreadPool::start(int n) {
  if (n < 1) {
    n = 1;
  }
  quit_.store(false);
  size_.store(n);
  // Workers start from the current generation (read here, not in the new thread, or a
  // job published before a worker first runs would be missed and run() would wait forever).
  const unsigned gen0 = generation_.load();
  for (int i = 1; i < n; ++i) {
    workers_.emplace_back([this, i, gen0] { worker(i, gen0); });
  }
}

void ThreadPool::stop() {
  {
    std::lock_guard<std::mutex> lk(m_);
    quit_.store(true);
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
  workers_.clear();
}

void ThreadPool::resize(int n) {
  if (n <= 0) {
    n = available_cpus();
  }
  std::lock_guard<std::mutex> job(submit_);
  if (n == size_.load()) {
    return;
  }
  stop();
  start(n);
}

void ThreadPool::worker(int index, unsigned seen) {
  while (true) {
    // Spin (then yield) for a while: the next kernel call usually comes soon.
    auto t0 = std::chrono::steady_clock::now();
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      if (++spins < 64) {
        MLXINFER_PAUSE();
        continue;
      }
      spins = 0;
      auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                    std::chrono::steady_clock::now() - t0)
                    .count();
      if (us >= spin_us_.load(std::memory_order_relaxed)) {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return generation_.load() != seen; });
        break;
      }
      std::this_thread::yield();
    }
    bool joined = false;
    {
      // The generation and the job are published together under m_.
      std::lock_guard<std::mutex> lk(m_);
      seen = generation_.load();
      if (job_ != nullptr && index < size_.load()) {
        active_.fetch_add(1);
        joined = true;
      }
    }
    if (quit_.load()) {
      return;
    }
    if (joined) {
      claim_tasks();
      active_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
}

void ThreadPool::claim_tasks() {
  while (true) {
    int i = next_.fetch_add(1, std::memory_order_acq_rel);
    if (i >= tasks_) {
      return;
    }
    (*job_)(i);
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

namespace {
// Spin a little, then give the CPU away (a worker preempted mid-task may need it).
template <typename Pred>
void wait_until(Pred pred) {
  int spins = 0;
  while (!pred()) {
    if (++spins < 256) {
      MLXINFER_PAUSE();
    } else {
      std::this_thread::yield();
    }
  }
}
} // namespace

void ThreadPool::run(int tasks, const std::function<void(int)>& f) {
  std::unique_lock<std::mutex> job(submit_, std::try_to_lock);
  if (tasks <= 1 || size_.load() <= 1 || !job.owns_lock()) {
    for (int i = 0; i < tasks; ++i) {
      f(i);
    }
    return;
  }
  {
    std::lock_guard<std::mutex> lk(m_);
    job_ = &f;
    tasks_ = tasks;
    next_.store(0);
    done_.store(0);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  cv_.notify_all();
  claim_tasks();
  // Tasks claimed by workers may still be running.
  wait_until([&] { return done_.load(std::memory_order_acquire) == tasks; });
  {
    std::lock_guard<std::mutex> lk(m_);
    job_ = nullptr;
  }
  // A worker that joined late finds no task left; wait until it has let go of the job.
  wait_until([&] { return active_.load(std::memory_order_acquire) == 0; });
}

} // namespace mlxinfer
