/* Persistent worker pool for the draft's GEMVs.
 *
 * threads-1 helper threads live as long as the pool; the calling thread is the
 * remaining worker.  A dispatch publishes one 64-bit ticket (generation | nblocks |
 * next block) and runs blocks itself; anyone claims a block by a compare-and-swap on
 * the ticket, which only succeeds while the ticket still carries the generation the
 * claimer saw, so a late helper can never run (or read the job of) a newer dispatch.
 * The dispatcher returns when all blocks are done; helpers that were descheduled
 * simply miss the job.  Idle helpers spin on the ticket for a short while (the gap
 * between the GEMVs of one token), then yield, then sleep on a condition variable.
 * Each row is computed by exactly one thread with the same code, so results do not
 * depend on the thread count. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "spel_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax(void) { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax(void) { __asm__ __volatile__("yield"); }
#else
static inline void cpu_relax(void) {}
#endif

#define SPIN_ITERS 4000     /* ~tens of microseconds of pause before yielding */
#define YIELD_ITERS 20      /* then a few yields before sleeping */
#define MAX_BLOCKS 0xFFFF   /* blocks per dispatch that fit the ticket */

struct spel_pool {
    int threads;
    pthread_t *helpers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int sleepers;
    _Atomic uint64_t ticket;    /* gen << 32 | nblocks << 16 | next */
    atomic_int_fast64_t done;   /* blocks finished in the current generation */
    atomic_int stop;
    uint32_t gen;               /* dispatcher-side copy */
    spel_task_fn fn;            /* read only by a thread holding a claimed block */
    void *ctx;
};

static inline uint32_t ticket_gen(uint64_t t) { return (uint32_t)(t >> 32); }

/* Claim and run one block of generation gen; 0 when there is none left. */
static int run_one(spel_pool *p, uint32_t gen) {
    uint64_t t = atomic_load_explicit(&p->ticket, memory_order_acquire);
    for (;;) {
        if (ticket_gen(t) != gen) return 0;
        uint32_t nb = (uint32_t)(t >> 16) & 0xFFFF, b = (uint32_t)t & 0xFFFF;
        if (b >= nb) return 0;
        if (atomic_compare_exchange_weak_explicit(&p->ticket, &t, t + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            p->fn(p->ctx, b);
            atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
            return 1;
        }
    }
}

static void *helper_main(void *arg) {
    spel_pool *p = arg;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = ticket_gen(atomic_load_explicit(&p->ticket, memory_order_acquire))) == seen) {
            if (spins < SPIN_ITERS) {
                cpu_relax();
                spins++;
            } else if (spins < SPIN_ITERS + YIELD_ITERS) {
                sched_yield();
                spins++;
            } else {
                /* sleepers is raised before re-checking the ticket under the mutex;
                 * the dispatcher stores the ticket before reading sleepers (both
                 * seq_cst), so either we see the new ticket or it sees us and wakes us. */
                atomic_fetch_add(&p->sleepers, 1);
                pthread_mutex_lock(&p->mu);
                while (ticket_gen(atomic_load(&p->ticket)) == seen) pthread_cond_wait(&p->cv, &p->mu);
                pthread_mutex_unlock(&p->mu);
                atomic_fetch_sub(&p->sleepers, 1);
            }
        }
        seen = g;
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        while (run_one(p, g)) {
        }
    }
    return NULL;
}

static void publish(spel_pool *p, uint32_t nblocks) {
    p->gen++;
    atomic_store(&p->ticket, (uint64_t)p->gen << 32 | (uint64_t)nblocks << 16);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
}

spel_pool *spel_pool_create(int threads) {
    if (threads < 1 || threads > SPEL_MAX_THREADS) return NULL;
    spel_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->threads = threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->ticket, 0);
    atomic_init(&p->done, 0);
    atomic_init(&p->stop, 0);
    if (threads > 1) {
        p->helpers = calloc((size_t)threads - 1, sizeof(pthread_t));
        if (!p->helpers) { free(p); return NULL; }
        for (int i = 0; i < threads - 1; i++) {
            if (pthread_create(&p->helpers[i], NULL, helper_main, p) != 0) {
                p->threads = i + 1;   /* destroy joins the ones that started */
                spel_pool_destroy(p);
                return NULL;
            }
        }
    }
    return p;
}

void spel_pool_destroy(spel_pool *p) {
    if (!p) return;
    if (p->threads > 1) {
        atomic_store(&p->stop, 1);
        publish(p, 0);
        for (int i = 0; i < p->threads - 1; i++) pthread_join(p->helpers[i], NULL);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->helpers);
    free(p);
}

int spel_pool_threads(const spel_pool *p) { return p ? p->threads : 1; }

int64_t spel_pool_block_rows(const spel_pool *p, int64_t rows) {
    int64_t parts = (int64_t)spel_pool_threads(p) * SPEL_BLOCKS_PER_THREAD;
    int64_t bs = (rows + parts - 1) / parts;
    return bs < 1 ? 1 : bs;
}

void spel_pool_run(spel_pool *p, spel_task_fn fn, void *ctx, int64_t nblocks) {
    if (!p || p->threads == 1 || nblocks <= 1 || nblocks > MAX_BLOCKS) {
        for (int64_t b = 0; b < nblocks; b++) fn(ctx, b);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    publish(p, (uint32_t)nblocks);
    while (run_one(p, p->gen)) {
    }
    int spins = 0;
    while (atomic_load_explicit(&p->done, memory_order_acquire) < nblocks) {
        if (++spins < SPIN_ITERS) cpu_relax();
        else sched_yield();   /* a helper holding a block may be descheduled */
    }
}

/* --- stress test support --- */
static void count_block(void *ctx, int64_t block) {
    (void)block;
    atomic_fetch_add_explicit((atomic_int_fast64_t *)ctx, 1, memory_order_relaxed);
}

int64_t spel_pool_stress(spel_pool *p, int64_t n, int64_t nblocks) {
    atomic_int_fast64_t count;
    atomic_init(&count, 0);
    for (int64_t i = 0; i < n; i++) spel_pool_run(p, count_block, &count, nblocks);
    return (int64_t)atomic_load(&count);
}
