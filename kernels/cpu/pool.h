// The kernels' own thread pool. OpenMP splits a loop into one fixed share per thread and
// waits at its end for every thread, so one thread the OS has not scheduled (a busy
// neighbour on its core) stalls the whole step once per parallel region. Here each thread
// has a share too, but claims it a piece at a time from its front (its jobs stay in order,
// one stream through memory), and a thread done with its own takes pieces from the back of
// the others': a thread that is not running holds up only the piece it holds, and a region
// ends when its jobs are done, whoever did them.
#pragma once
#include <cstdint>
#include <functional>

// The bytes a region will read first, a share per thread: `jobs` jobs of `job_bytes`
// contiguous bytes each from `base`, split among the threads as parallel_jobs splits jobs.
struct Reads {
  const void* base = nullptr;
  int64_t jobs = 0, job_bytes = 0;
};

// fn(begin, end) over ranges that together cover the jobs [0, jobs) once, on the calling
// thread and the pool's workers. A worker done with its jobs then requests the first bytes
// of its share of `next` (the region the caller runs after this one) until that begins:
// the memory reads them while the caller finishes this region's last jobs and runs the
// serial code between the two.
void parallel_jobs(int64_t jobs, const std::function<void(int64_t, int64_t)>& fn,
                   const Reads& next = {});

// Threads that run jobs, the caller included (>= 1). Changing it restarts the workers.
void set_num_threads(int64_t threads);
int64_t get_num_threads();
