// The native kernels' thread pool (declared in thread_pool.h): ``pool_set_threads(n)`` keeps n - 1 worker threads
// (the thread that calls a kernel is the n-th); ``parallel_chunks`` hands a job's chunks out one at a time from an
// atomic ticket, so a thread that starts late takes fewer of them.
//
// A job is published by one store of the ticket (generation << 32 | next chunk), after its task, context and
// chunk count (``limit``: generation << 32 | chunks). A thread takes a chunk with fetch_add on the ticket and runs
// it only when ``limit`` names the generation the ticket gave it and the index is below its count: a worker still
// looking at an old job can take a chunk of the new one (and run it correctly: the job cannot finish, and its
// fields cannot change, before that chunk is done) but never runs an old or a future job's chunk. The caller counts
// the chunks done and returns when all are (``wait_done``: a short spin, then a futex).
//
// Idle workers spin (``_mm_pause``) for SPIN after their last job, so the next product of a step finds them awake
// (the gaps between a step's native calls are tens of microseconds), then sleep on a condition variable: between
// steps and between requests they leave the cores to the HTTP loop, the tokenizer and other processes.
//
// Stalls: on a machine whose other work takes the cores, a worker can lose its core while it holds a chunk, and the
// caller then waits a scheduler time slice (milliseconds) for it, many times a step; or the workers get no core at
// all and only spin against the caller (and everything else) when they do. When the caller waits longer than STALL
// plus twice its own share of a call twice within STALL_WINDOW calls, or runs every chunk itself MISSES calls in a
// row while the workers were awake, it runs the next calls alone for FIRST_BACKOFF (the workers fall asleep),
// doubling with each stall in a row up to LAST_BACKOFF; a call that splits without a stall resets it. So a busy
// machine costs about what one thread costs, and a quiet one gets every thread. (The bits are the same either way.)
// The first version backed off on any single stall or miss, and on a quiet 2-core VM fed itself: asleep after a
// back-off, the workers woke too late for the next calls, which counted as misses, and two thirds of a step's calls
// ran alone (2026-11-28).
//
// A forked child (the pool's workers do not exist there) starts over with a pool of one thread.
//
// Compiled in the AVX2 pass alone (decoding/weights/native.py compiles every source twice).
#ifndef PANEL_WIDE

#include "thread_pool.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace lookahead {
namespace {

constexpr auto SPIN = std::chrono::microseconds(200);  // how long an idle worker spins before it sleeps
constexpr auto WAIT_SPIN = std::chrono::microseconds(50);  // how long a caller spins on the last chunks, then sleeps
constexpr auto STALL = std::chrono::microseconds(50);  // a wait this much longer than twice the caller's share: a stall
constexpr auto FIRST_BACKOFF = std::chrono::milliseconds(20);  // calls run alone this long after a stall...
constexpr auto LAST_BACKOFF = std::chrono::milliseconds(640);  // ...doubling with each stall in a row, up to this
constexpr int64_t STALL_WINDOW = 64;  // a second stall within this many split calls of the last: the machine is busy
constexpr int MISSES = 16;  // calls in a row whose chunks the caller ran alone (no worker got a core): a stall too
constexpr auto MISS_TIME = std::chrono::microseconds(20);  // ...counting calls this long whose workers were awake
constexpr uint64_t LOW = 0xffffffffu;
constexpr int MAX_THREADS = 256;

struct Pool {
    std::atomic<uint64_t> ticket{0};  // generation << 32 | next chunk
    std::atomic<uint64_t> limit{0};   // generation << 32 | chunks, of the job the ticket's generation names
    std::atomic<int32_t> done{0};     // chunks of the current job run to the end (a futex word)
    std::atomic<int32_t> waiting{0};  // the caller sleeps on ``done``
    std::atomic<int> sleepers{0};
    std::atomic<bool> stop{false};
    std::atomic_flag busy = ATOMIC_FLAG_INIT;  // a caller is using the workers
    Task task = nullptr;  // the current job, written before its ticket is published
    void* context = nullptr;
    std::mutex mutex;
    std::condition_variable wake;
    std::vector<std::thread> workers;
    // Stalls: touched by the caller holding ``busy`` only.
    std::chrono::steady_clock::time_point alone_until{};
    std::chrono::steady_clock::duration backoff = FIRST_BACKOFF;
    int misses = 0;
    int64_t calls = 0, last_stall = -(1 << 30);  // split calls so far; the index of the last stall
};

Pool* pool = new Pool();  // never deleted: workers may outlive static destruction at exit
std::atomic<int64_t> min_cost{MIN_PARALLEL_COST};

uint32_t generation_of(uint64_t value) { return static_cast<uint32_t>(value >> 32); }

// Takes and runs chunks of the job the ticket currently names until there are none left; returns how many it ran.
int64_t take_chunks(Pool& own) {
    int64_t ran = 0;
    for (;;) {
        const uint64_t ticket = own.ticket.fetch_add(1, std::memory_order_acq_rel);
        const uint64_t limit = own.limit.load(std::memory_order_acquire);
        if (generation_of(limit) != generation_of(ticket) || (ticket & LOW) >= (limit & LOW)) return ran;
        own.task(own.context, static_cast<int64_t>(ticket & LOW));
        ++ran;
        if (own.done.fetch_add(1, std::memory_order_seq_cst) + 1 == static_cast<int32_t>(limit & LOW) &&
            own.waiting.load(std::memory_order_seq_cst) != 0) {
            syscall(SYS_futex, reinterpret_cast<int32_t*>(&own.done), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
        }
    }
}

// The caller, its own chunks run, waits for the others': it spins for WAIT_SPIN (a worker finishing a chunk in
// parallel), then sleeps on the futex until the last chunk is done. Sleeping frees its core, so that a worker the
// machine's other work had preempted holding a chunk can be run there at once.
void wait_done(Pool& own, int32_t chunks) {
    const auto deadline = std::chrono::steady_clock::now() + WAIT_SPIN;
    for (int spins = 0;; ++spins) {
        const int32_t done = own.done.load(std::memory_order_acquire);
        if (done >= chunks) return;
        if ((spins & 31) != 31 || std::chrono::steady_clock::now() < deadline) {
            _mm_pause();
            continue;
        }
        own.waiting.store(1, std::memory_order_seq_cst);
        const int32_t seen = own.done.load(std::memory_order_seq_cst);
        if (seen < chunks) {
            syscall(SYS_futex, reinterpret_cast<int32_t*>(&own.done), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
        }
        own.waiting.store(0, std::memory_order_relaxed);
    }
}

void work(Pool* own, uint32_t seen) {
    for (;;) {
        const auto deadline = std::chrono::steady_clock::now() + SPIN;
        uint32_t current = generation_of(own->ticket.load(std::memory_order_acquire));
        for (int spins = 0; current == seen && !own->stop.load(std::memory_order_relaxed); ++spins) {
            _mm_pause();
            if ((spins & 63) == 63) sched_yield();  // a thread waiting for this core (ours, or another process's) runs
            if ((spins & 63) == 63 && std::chrono::steady_clock::now() > deadline) {
                own->sleepers.fetch_add(1, std::memory_order_seq_cst);
                std::unique_lock<std::mutex> lock(own->mutex);
                own->wake.wait(lock, [&] {
                    return own->stop.load() || generation_of(own->ticket.load(std::memory_order_seq_cst)) != seen;
                });
                own->sleepers.fetch_sub(1, std::memory_order_relaxed);
            }
            current = generation_of(own->ticket.load(std::memory_order_acquire));
        }
        if (own->stop.load()) return;
        seen = current;
        take_chunks(*own);
    }
}

void stop_workers(Pool& own) {
    {
        std::lock_guard<std::mutex> lock(own.mutex);
        own.stop.store(true);
    }
    own.wake.notify_all();
    for (std::thread& worker : own.workers) worker.join();
    own.workers.clear();
    own.stop.store(false);
}

void forked_child() { pool = new Pool(); }  // the parent's workers do not exist here; the old pool is left as is

const bool registered = pthread_atfork(nullptr, nullptr, forked_child) == 0;

}  // namespace

int pool_size() { return static_cast<int>(pool->workers.size()) + 1; }

int64_t min_parallel_cost() { return min_cost.load(std::memory_order_relaxed); }

void parallel_chunks(int64_t chunks, Task task, void* context) {
    Pool& own = *pool;
    if (chunks <= 1 || chunks > INT32_MAX || own.workers.empty() || own.busy.test_and_set(std::memory_order_acquire)) {
        for (int64_t chunk = 0; chunk < chunks; ++chunk) task(context, chunk);
        return;
    }
    const auto start = std::chrono::steady_clock::now();
    if (start < own.alone_until) {  // backing off after a stall
        for (int64_t chunk = 0; chunk < chunks; ++chunk) task(context, chunk);
        own.busy.clear(std::memory_order_release);
        return;
    }
    const uint32_t generation = generation_of(own.ticket.load(std::memory_order_relaxed)) + 1;
    own.task = task;
    own.context = context;
    own.done.store(0, std::memory_order_relaxed);
    own.limit.store((static_cast<uint64_t>(generation) << 32) | static_cast<uint64_t>(chunks),
                    std::memory_order_release);
    own.ticket.store(static_cast<uint64_t>(generation) << 32, std::memory_order_seq_cst);
    const bool asleep = own.sleepers.load(std::memory_order_seq_cst) > 0;
    if (asleep) {
        { std::lock_guard<std::mutex> lock(own.mutex); }
        own.wake.notify_all();
    }
    const int64_t mine = take_chunks(own);
    const auto shared = std::chrono::steady_clock::now();
    wait_done(own, static_cast<int32_t>(chunks));
    const auto end = std::chrono::steady_clock::now();
    // A miss: a call long enough for an awake worker to join, whose chunks the caller ran alone. A call that
    // found the workers asleep (their wake-up takes tens of microseconds) or a short one says nothing.
    const bool missed = mine == chunks && !asleep && shared - start > MISS_TIME;
    own.misses = missed ? own.misses + 1 : mine == chunks ? own.misses : 0;
    // A stall counts only when it follows another within STALL_WINDOW calls: on a quiet machine a worker is
    // preempted now and then (a kernel thread, a timer), and backing off for it cost more than the stall.
    ++own.calls;
    bool stalled = end - shared > STALL + 2 * (shared - start);
    if (stalled) {
        stalled = own.calls - own.last_stall <= STALL_WINDOW;
        own.last_stall = own.calls;
    }
    if (stalled || own.misses >= MISSES) {  // go alone a while
        own.alone_until = end + own.backoff;
        own.backoff = own.backoff * 2 < LAST_BACKOFF ? own.backoff * 2 : LAST_BACKOFF;
        own.misses = 0;
    } else if (mine < chunks && end - shared <= shared - start) {  // the split paid: the workers have cores
        own.backoff = FIRST_BACKOFF;
    }
    own.busy.clear(std::memory_order_release);
}

}  // namespace lookahead

extern "C" {

// The pool's size, the calling thread included: n - 1 workers are started (after the old ones are stopped) when
// it changes; n < 1 counts as 1, n above 256 as 256. Not to be called while a kernel runs. Returns the size.
int pool_set_threads(int threads) {
    using namespace lookahead;
    (void)registered;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    Pool& own = *pool;
    if (threads == pool_size()) return threads;
    stop_workers(own);
    const uint32_t seen = generation_of(own.ticket.load());
    for (int i = 1; i < threads; ++i) own.workers.emplace_back(work, &own, seen);
    return threads;
}

int pool_threads() { return lookahead::pool_size(); }

// The smallest cost a call splits at (negative: the default, MIN_PARALLEL_COST); returns the one now in force.
int64_t pool_set_min_cost(int64_t cost) {
    lookahead::min_cost.store(cost < 0 ? lookahead::MIN_PARALLEL_COST : cost);
    return lookahead::min_cost.load();
}

}  // extern "C"

#endif  // PANEL_WIDE
