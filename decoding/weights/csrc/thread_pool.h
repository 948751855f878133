// The native kernels' thread pool (thread_pool.cpp): one pool per process, created when its size is first set
// (``pool_set_threads``), its workers spinning briefly after each job and then sleeping.
//
// Exactness: the pool only decides which thread runs which chunk of a call. The kernels cut their work into chunks
// of whole output elements (column panels of a product, (kv head, row) units of attention, rows of the small operations), so
// every output element is still computed by one thread with the same sequence of operations: a row's result is the
// same bits alone or batched, at any thread count.
//
// Only declarations and templates over the caller's types live here: the file is included by objects compiled with
// and without AVX-512, and an inline function shared by both could be linked from the AVX-512 object.
#pragma once

#include <cstdint>

namespace lookahead {

using Task = void (*)(void* context, int64_t chunk);

// Runs task(context, c) once for every c in [0, chunks), spread over the pool's threads (the calling thread takes
// chunks too), and returns when all have run. One call at a time uses the workers: a call made while another runs
// (another thread's, or one from inside a task) runs its chunks on the calling thread alone.
void parallel_chunks(int64_t chunks, Task task, void* context);

// The pool's threads, the caller included (1 until ``pool_set_threads`` says otherwise).
int pool_size();

// A call whose cost (multiply-adds, or elements touched) is below this runs on the calling thread alone: handing
// out its chunks would cost more than it saves (``pool_set_min_cost`` changes it: tests split every call with 0).
constexpr int64_t MIN_PARALLEL_COST = 1 << 15;
int64_t min_parallel_cost();

// Chunks per thread when a call is split: more than one, so that a thread that starts late (the machine's other
// work took its core) leaves its share to the others.
constexpr int64_t CHUNKS_PER_THREAD = 4;

// body(begin, end) over [0, items) cut into ranges whose starts are multiples of ``align`` (a kernel's tile width,
// so every range but the last holds whole tiles), each range run by one thread; the whole of [0, items) on the
// calling thread when ``cost`` is below min_parallel_cost(), the pool has one thread or there is a single range.
template <class Body>
void parallel_ranges(int64_t items, int64_t align, int64_t cost, Body&& body) {
    const int threads = pool_size();
    const int64_t groups = (items + align - 1) / align;
    if (threads <= 1 || groups <= 1 || cost < min_parallel_cost()) {
        body(int64_t{0}, items);
        return;
    }
    const int64_t wanted = threads * CHUNKS_PER_THREAD;
    const int64_t size = ((groups + wanted - 1) / wanted) * align;  // items per range
    struct Job {
        Body* body;
        int64_t items, size;
    } job{&body, items, size};
    auto run = [](void* context, int64_t chunk) {
        const Job& own = *static_cast<const Job*>(context);
        const int64_t begin = chunk * own.size;
        (*own.body)(begin, begin + own.size < own.items ? begin + own.size : own.items);
    };
    parallel_chunks((items + size - 1) / size, run, &job);
}

}  // namespace lookahead
