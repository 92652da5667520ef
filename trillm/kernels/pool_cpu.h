/* A small pool of helper threads for the compiled kernels: the caller splits a job into chunks,
 * runs them itself, and whichever helper is awake takes chunks too.
 *
 * Why not OpenMP: its workers spin-wait at every barrier, and on a machine whose other cores are
 * busy (the server's event loop, the HTTP side) a step stalls until the descheduled worker runs
 * again. Here nothing waits for a helper that has not started: chunks are claimed one at a time
 * from an atomic counter, so a helper that is not running claims nothing and the caller does the
 * whole job, as with no pool. The caller waits only for chunks a helper has claimed; it spins a
 * short while, then sleeps, which frees its core for a helper the scheduler had put aside.
 * Helpers spin a short while after each job (the next projection follows within microseconds in
 * a step), then sleep on a condition variable.
 *
 * Ownership: one pool per process (pool_cpu.pyx; the kernels' modules reach it through its
 * `run`), started by the first pool_set_helpers that asks for helpers; jobs from several threads
 * take turns.
 * A job's context lives on the caller's stack: a helper touches it only after claiming a chunk,
 * and `pool_run` returns only when every chunk is done.
 */
#ifndef TRILLM_POOL_CPU_H
#define TRILLM_POOL_CPU_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "shared_cpu.h"

#define POOL_MAX_HELPERS 63
/* A helper polls for the next job: first with `pause` (the next projection of a step follows
 * within microseconds), then yielding its core at each poll, so that another thread that wants
 * it (the server's event loop) runs first; then it sleeps. */
#define POOL_HELPER_PAUSES 2000
#define POOL_HELPER_YIELDS 200
#define POOL_CALLER_SPINS 4000 /* polls for helpers' chunks before the caller sleeps */

struct pool {
    pthread_mutex_t run_lock; /* one job at a time */
    pthread_mutex_t lock;
    pthread_cond_t job_posted, job_done;
    int helpers;        /* started */
    _Atomic int wanted; /* helpers 0 .. wanted - 1 take part in jobs */
    /* The job, in one word: its generation, its number of chunks and the next chunk to claim. A
     * helper claims by moving that word on by one, so a helper that read a finished job's word
     * never claims a chunk of a later job. */
    _Atomic uint64_t claim;
    _Atomic int64_t done; /* chunks finished */
    pool_chunk_fn *fn;
    void *ctx;
    _Atomic int helpers_asleep, caller_asleep;
};

#define POOL_FIELD_BITS 20
#define POOL_MAX_CHUNKS ((1 << POOL_FIELD_BITS) - 1)
#define POOL_FIELD(word, shift) ((int64_t)(((word) >> (shift)) & POOL_MAX_CHUNKS))
#define POOL_GEN(word) ((uint32_t)((word) >> (2 * POOL_FIELD_BITS)))

static struct pool the_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                               PTHREAD_COND_INITIALIZER};

static inline void pool_pause(void)
{
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

/* Claims and runs chunks of generation `gen` until none is left. */
static void pool_work(struct pool *p, uint32_t gen)
{
    for (;;) {
        uint64_t claim = atomic_load(&p->claim);
        const int64_t chunks = POOL_FIELD(claim, POOL_FIELD_BITS), chunk = POOL_FIELD(claim, 0);
        if (POOL_GEN(claim) != gen || chunk >= chunks) return;
        if (!atomic_compare_exchange_weak(&p->claim, &claim, claim + 1)) continue;
        p->fn(p->ctx, chunk);
        if (atomic_fetch_add(&p->done, 1) + 1 == chunks && atomic_load(&p->caller_asleep)) {
            pthread_mutex_lock(&p->lock);
            pthread_cond_signal(&p->job_done);
            pthread_mutex_unlock(&p->lock);
        }
    }
}

struct pool_helper_arg {
    struct pool *pool;
    int index;
};

static void *pool_helper(void *arg)
{
    struct pool *p = ((struct pool_helper_arg *)arg)->pool;
    const int index = ((struct pool_helper_arg *)arg)->index;
    free(arg);
    uint32_t seen = POOL_GEN(atomic_load(&p->claim));
    for (;;) {
        uint32_t gen = seen;
        for (int spin = 0; spin < POOL_HELPER_PAUSES + POOL_HELPER_YIELDS && gen == seen; spin++) {
            if (spin < POOL_HELPER_PAUSES)
                pool_pause();
            else
                sched_yield();
            gen = POOL_GEN(atomic_load(&p->claim));
        }
        if (gen == seen) {
            pthread_mutex_lock(&p->lock);
            atomic_fetch_add(&p->helpers_asleep, 1);
            while ((gen = POOL_GEN(atomic_load(&p->claim))) == seen) pthread_cond_wait(&p->job_posted, &p->lock);
            atomic_fetch_sub(&p->helpers_asleep, 1);
            pthread_mutex_unlock(&p->lock);
        }
        seen = gen;
        if (index < atomic_load(&p->wanted)) pool_work(p, gen);
    }
    return NULL;
}

/* Sets how many helper threads later jobs use (0: none, the caller works alone); helpers are
 * started as needed and never stopped. Returns the number in use. */
static int pool_set_helpers(int helpers)
{
    struct pool *p = &the_pool;
    if (helpers < 0) helpers = 0;
    if (helpers > POOL_MAX_HELPERS) helpers = POOL_MAX_HELPERS;
    pthread_mutex_lock(&p->lock);
    while (p->helpers < helpers) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        struct pool_helper_arg *arg = malloc(sizeof(*arg));
        if (arg != NULL) *arg = (struct pool_helper_arg){p, p->helpers};
        const int failed = arg == NULL || pthread_create(&thread, &attr, pool_helper, arg);
        pthread_attr_destroy(&attr);
        if (failed) {
            free(arg);
            break;
        }
        p->helpers++;
    }
    const int wanted = helpers < p->helpers ? helpers : p->helpers;
    atomic_store(&p->wanted, wanted);
    pthread_mutex_unlock(&p->lock);
    return wanted;
}

/* Runs fn(ctx, c) for every chunk c < chunks, on the caller and the helpers; returns when all
 * are done (a pool_runner). Never waits for a helper that has not claimed a chunk. Callers from
 * several threads take turns. */
static void pool_run(pool_chunk_fn *fn, void *ctx, int64_t chunks)
{
    struct pool *p = &the_pool;
    if (atomic_load(&p->wanted) == 0 || chunks < 2 || chunks > POOL_MAX_CHUNKS) {
        for (int64_t c = 0; c < chunks; c++) fn(ctx, c);
        return;
    }
    pthread_mutex_lock(&p->run_lock);
    const uint32_t gen = (POOL_GEN(atomic_load(&p->claim)) + 1) & POOL_GEN(~(uint64_t)0); /* wraps */
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->done, 0);
    /* publishes the job */
    atomic_store(&p->claim, ((uint64_t)gen << (2 * POOL_FIELD_BITS)) | ((uint64_t)chunks << POOL_FIELD_BITS));
    if (atomic_load(&p->helpers_asleep)) {
        pthread_mutex_lock(&p->lock);
        pthread_cond_broadcast(&p->job_posted);
        pthread_mutex_unlock(&p->lock);
    }
    pool_work(p, gen);
    for (int spin = 0; spin < POOL_CALLER_SPINS && atomic_load(&p->done) < chunks; spin++) pool_pause();
    if (atomic_load(&p->done) < chunks) {
        pthread_mutex_lock(&p->lock);
        atomic_store(&p->caller_asleep, 1);
        while (atomic_load(&p->done) < chunks) pthread_cond_wait(&p->job_done, &p->lock);
        atomic_store(&p->caller_asleep, 0);
        pthread_mutex_unlock(&p->lock);
    }
    pthread_mutex_unlock(&p->run_lock);
}

#endif
