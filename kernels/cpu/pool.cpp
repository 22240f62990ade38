#include "pool.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Job = std::function<void(int64_t, int64_t)>;

// A worker keeps looking for the next region this long before it sleeps: within a step the
// regions follow each other in microseconds, between steps it should give the core away.
constexpr auto WORKER_SPIN = std::chrono::microseconds(50);
// The caller spins this long for jobs another thread still runs, then yields its core
// between looks, so a worker preempted on the same core can finish.
constexpr auto CALLER_SPIN = std::chrono::microseconds(50);

// A claim takes 1 / (GUIDED * threads) of the jobs left.
constexpr int64_t GUIDED = 2;

// The next job of a region not open yet: past any region's jobs.
constexpr uint64_t CLOSED = 0xFFFFFFFF;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
          nullptr, 0);
}

// Spins (with pause) until done() or the time runs out; true when done() held.
template <typename Done>
bool spin_until(Done done, Clock::duration limit) {
  const auto end = Clock::now() + limit;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      _mm_pause();
    }
    if (Clock::now() >= end) return false;
  }
}

thread_local bool in_region = false;  // set on workers too: a nested region runs inline

class Pool {
 public:
  explicit Pool(int64_t threads) : threads_(threads) {
    for (int64_t i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }

  ~Pool() {
    stop_.store(true);
    region_.fetch_add(1);
    futex_wake_all(&region_);
    for (auto& w : workers_) w.join();
  }

  void run(int64_t jobs, const Job& fn) {
    // A new region. A worker may still be in claim_all with the last region's claims, and
    // read the function and sizes stored here next to them: a claim it made on those would
    // run jobs of this region twice. So the new generation goes up first, closed (no job
    // left), and a worker that reads the new function or sizes (acquire) sees it and fails
    // its claim; opening the generation (next job 0) then publishes them.
    const uint64_t generation = (claims_.load(std::memory_order_relaxed) >> 32) + 1;
    claims_.store(generation << 32 | CLOSED, std::memory_order_relaxed);
    fn_.store(&fn, std::memory_order_release);
    jobs_.store(jobs, std::memory_order_release);
    done_.store(0, std::memory_order_relaxed);
    claims_.store(generation << 32, std::memory_order_release);
    region_.fetch_add(1);  // seq_cst, paired with the workers' `sleeping_` (no lost wake-up)
    if (sleeping_.load() > 0) futex_wake_all(&region_);
    claim_all();
    const auto all_done = [&] { return done_.load(std::memory_order_acquire) == jobs; };
    while (!spin_until(all_done, CALLER_SPIN)) sched_yield();
  }

 private:
  // Claims and runs jobs of the current region until none is left. A claim succeeds only
  // while the generation it read the region's function and sizes under is still current.
  void claim_all() {
    for (;;) {
      uint64_t claim = claims_.load(std::memory_order_acquire);
      const Job* fn = fn_.load(std::memory_order_acquire);
      const int64_t jobs = jobs_.load(std::memory_order_acquire);
      const int64_t first = static_cast<uint32_t>(claim);
      if (first >= jobs) return;
      // Guided: a share of what is left, so claims are few while much is left and small
      // near the end, where the threads must finish together.
      const int64_t count = std::max<int64_t>(1, (jobs - first) / (GUIDED * threads_));
      if (!claims_.compare_exchange_weak(claim, claim + count, std::memory_order_acq_rel))
        continue;
      (*fn)(first, first + count);
      done_.fetch_add(count, std::memory_order_release);
    }
  }

  void work() {
    in_region = true;
    uint32_t seen = region_.load();
    while (!stop_.load(std::memory_order_relaxed)) {
      const auto next = [&] { return region_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(next, WORKER_SPIN)) {
        sleeping_.fetch_add(1);
        futex_wait(&region_, seen);
        sleeping_.fetch_sub(1);
        continue;
      }
      seen = region_.load(std::memory_order_acquire);
      claim_all();
    }
  }

  std::atomic<uint64_t> claims_{0};  // generation << 32 | next unclaimed job
  std::atomic<const Job*> fn_{nullptr};
  std::atomic<int64_t> jobs_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<uint32_t> region_{0};  // the futex workers sleep on; bumped per region
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  const int64_t threads_;
  std::vector<std::thread> workers_;
};

std::mutex pool_mutex;  // one region at a time; guards the two below
int64_t num_threads = std::max(1u, std::thread::hardware_concurrency());
Pool* pool = nullptr;  // started on first use

// A forked child has none of the parent's threads: it starts a pool of its own (the
// parent's is left alone, not joined).
void forget_pool_in_child() {
  new (&pool_mutex) std::mutex();
  pool = nullptr;
}
[[maybe_unused]] const int at_fork = pthread_atfork(nullptr, nullptr, forget_pool_in_child);

}  // namespace

void parallel_jobs(int64_t jobs, const Job& fn) {
  if (jobs <= 1 || in_region || num_threads == 1) {  // nested regions run inline
    fn(0, jobs);
    return;
  }
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (pool == nullptr) pool = new Pool(num_threads);
  in_region = true;
  pool->run(jobs, fn);
  in_region = false;
}

void set_num_threads(int64_t threads) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (threads < 1) threads = 1;
  if (threads == num_threads) return;
  delete pool;
  pool = nullptr;
  num_threads = threads;
}

int64_t get_num_threads() { return num_threads; }
