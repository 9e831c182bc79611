// A small persistent thread pool for the kernels (MLX's CPU ops run single-threaded
// inside one stream thread; this pool fans one kernel call out over the cores).
//
// A job is a number of tasks; the caller and the woken workers claim them from a shared
// counter, so a worker that the OS does not schedule in time (a loaded machine) costs
// nothing: the caller takes its tasks. Workers spin briefly after a job (decode issues
// kernel calls every few tens of microseconds) and then sleep on a condition variable.
// Only one job runs at a time: a second caller (another MLX stream) that finds the pool
// busy runs its whole job inline, so the pool never puts more threads to work than it
// was sized for.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlxinfer {

class ThreadPool {
 public:
  static ThreadPool& instance();

  // Participants, the caller included (>= 1).
  int size() const {
    return size_.load();
  }
  // Resize (joins and restarts workers). n <= 0 means "the CPUs this process may use".
  void resize(int n);
  // How long idle workers spin before sleeping, in microseconds.
  void set_spin_us(int us) {
    spin_us_.store(us < 0 ? 0 : us);
  }
  int spin_us() const {
    return spin_us_.load();
  }

  // Runs f(i) for each task i in [0, tasks) on up to size() threads, the caller
  // included. Returns when all are done.
  void run(int tasks, const std::function<void(int)>& f);

  ~ThreadPool();

 private:
  ThreadPool();
  void start(int n);
  void stop();
  void worker(int index, unsigned seen);
  void claim_tasks();

  std::atomic<int> size_{1};
  std::atomic<int> spin_us_{200};
  std::vector<std::thread> workers_;
  std::mutex submit_; // one job at a time
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<unsigned> generation_{0};
  std::atomic<int> next_{0}; // next task to claim
  std::atomic<int> done_{0}; // tasks finished
  std::atomic<int> active_{0}; // workers inside the current job
  std::atomic<bool> quit_{false};
  const std::function<void(int)>* job_ = nullptr;
  int tasks_ = 0;
};

int available_cpus();

} // namespace mlxinfer
