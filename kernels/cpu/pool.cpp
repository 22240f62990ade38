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
// Bytes of its share of the next region a waiting worker requests: about what one core
// reads in the few microseconds between two regions.
constexpr int64_t PREFETCH_SHARE_BYTES = 64 * 1024;

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

// Region sizes a share's word holds: a region's jobs below 2^JOB_BITS (parallel_jobs
// splits larger ones), its generation in the bits left.
constexpr int JOB_BITS = 20;
constexpr uint64_t JOB_MASK = (uint64_t{1} << JOB_BITS) - 1;
constexpr int64_t MAX_JOBS = int64_t{1} << JOB_BITS;

// One thread's share of a region: jobs [begin, end), with the region's generation, in one
// word. Its owner claims from the front, so its jobs follow each other in memory (one read
// stream, which the hardware prefetchers follow); a thread whose own share is done takes
// from the back of another's, so a thread the OS has not scheduled holds up only the
// piece it claimed.
struct alignas(64) Share {
  std::atomic<uint64_t> word{0};

  static uint64_t pack(uint64_t generation, int64_t begin, int64_t end) {
    return generation << (2 * JOB_BITS) | static_cast<uint64_t>(begin) << JOB_BITS |
           static_cast<uint64_t>(end);
  }
  static int64_t begin(uint64_t w) { return static_cast<int64_t>(w >> JOB_BITS & JOB_MASK); }
  static int64_t end(uint64_t w) { return static_cast<int64_t>(w & JOB_MASK); }
};

thread_local bool in_region = false;  // set on workers too: a nested region runs inline

class Pool {
 public:
  explicit Pool(int64_t threads) : threads_(threads), shares_(threads) {
    for (int64_t i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }

  ~Pool() {
    stop_.store(true);
    region_.fetch_add(1);
    futex_wake_all(&region_);
    for (auto& w : workers_) w.join();
  }

  void run(int64_t jobs, const Job& fn, const Reads& next) {
    // Every share of the last region is empty (its jobs are done), so no thread claims
    // anything until a share below is stored; fn_ is stored before the shares (release),
    // so a thread that reads a share of this region (acquire) reads this fn.
    // A thread that read a share of an earlier region and fn_ after it fails its claim:
    // the share's word has changed, its generation with it (24 bits: the word comes back
    // only if that thread sleeps through 2^24 regions between the two reads).
    ++generation_;
    fn_.store(&fn, std::memory_order_release);
    next_base_.store(static_cast<const char*>(next.base), std::memory_order_relaxed);
    next_jobs_.store(next.jobs, std::memory_order_relaxed);
    next_job_bytes_.store(next.job_bytes, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    for (int64_t t = 0; t < threads_; ++t)
      shares_[t].word.store(
          Share::pack(generation_, jobs * t / threads_, jobs * (t + 1) / threads_),
          std::memory_order_release);
    region_.fetch_add(1);  // seq_cst, paired with the workers' `sleeping_` (no lost wake-up)
    if (sleeping_.load() > 0) futex_wake_all(&region_);
    claim_all(0);
    const auto all_done = [&] { return done_.load(std::memory_order_acquire) == jobs; };
    while (!spin_until(all_done, CALLER_SPIN)) sched_yield();
  }

 private:
  // Runs jobs of the current region until none is left: thread `self`'s own share from
  // the front, then the others' from the back.
  void claim_all(int64_t self) {
    while (claim(shares_[self], true)) {
    }
    for (int64_t i = 1; i < threads_; ++i)
      while (claim(shares_[(self + i) % threads_], false)) {
      }
  }

  // Half of what is left of `share` (at least one job), from its front or its back;
  // false when it is empty.
  bool claim(Share& share, bool front) {
    for (;;) {
      uint64_t w = share.word.load(std::memory_order_acquire);
      const int64_t begin = Share::begin(w), end = Share::end(w);
      if (begin >= end) return false;
      const Job* fn = fn_.load(std::memory_order_acquire);
      const int64_t count = std::max<int64_t>(1, (end - begin) / 2);
      const int64_t first = front ? begin : end - count;
      // begin up by count, or end down by it (the fields stay in range: begin <= end)
      const uint64_t rest = front ? w + (static_cast<uint64_t>(count) << JOB_BITS) : w - count;
      if (!share.word.compare_exchange_weak(w, rest, std::memory_order_acq_rel)) continue;
      (*fn)(first, first + count);
      done_.fetch_add(count, std::memory_order_release);
      return true;
    }
  }

  // Worker `self` requests the first lines of its share of the region after this one,
  // until `begun()` says a region has begun. A worker reading these while the caller
  // stores the next region's (a word each) requests lines of either: harmless, since a
  // prefetch of any address is.
  template <typename Begun>
  void prefetch_next(int64_t self, Begun begun) const {
    const char* base = next_base_.load(std::memory_order_relaxed);
    const int64_t jobs = next_jobs_.load(std::memory_order_relaxed);
    const int64_t job_bytes = next_job_bytes_.load(std::memory_order_relaxed);
    const int64_t begin = jobs * self / threads_ * job_bytes;  // the share as run() splits it
    const int64_t end =
        std::min(begin + PREFETCH_SHARE_BYTES, jobs * (self + 1) / threads_ * job_bytes);
    for (int64_t at = begin; at < end && !begun(); at += 512)
      for (int64_t line = at; line < std::min(at + 512, end); line += 64)
        _mm_prefetch(base + line, _MM_HINT_T0);
  }

  void work(int64_t self) {
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
      claim_all(self);
      prefetch_next(self, next);
    }
  }

  std::atomic<const Job*> fn_{nullptr};
  std::atomic<int64_t> done_{0};
  std::atomic<uint32_t> region_{0};  // the futex workers sleep on; bumped per region
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::atomic<const char*> next_base_{nullptr};  // the running region's `next`
  std::atomic<int64_t> next_jobs_{0}, next_job_bytes_{0};
  uint64_t generation_ = 0;  // the caller's alone (under pool_mutex)
  const int64_t threads_;
  std::vector<Share> shares_;
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

void parallel_jobs(int64_t jobs, const Job& fn, const Reads& next) {
  if (jobs <= 1 || in_region || num_threads == 1) {  // nested regions run inline
    fn(0, jobs);
    return;
  }
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (pool == nullptr) pool = new Pool(num_threads);
  in_region = true;
  if (jobs < MAX_JOBS) {
    pool->run(jobs, fn, next);
  } else {  // in regions whose sizes a share's word holds
    for (int64_t first = 0; first < jobs; first += MAX_JOBS - 1) {
      const Job part = [&](int64_t begin, int64_t end) { fn(first + begin, first + end); };
      pool->run(std::min(MAX_JOBS - 1, jobs - first), part, next);
    }
  }
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
