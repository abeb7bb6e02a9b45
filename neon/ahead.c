/* Proposals and prefills on the draft's own thread while the caller (the target's
 * verification) runs; started without any Python lock. */
#include "draft_engine.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The worker drafts at the lowest priority (Linux SCHED_IDLE): on the CPU time the
 * target's threads leave, so the thread scheduling the target's pass never waits
 * behind it (measured in docs/decoding.md, where it says SCHED_IDLE).  A
 * caller that waits for an unfinished proposal lifts it back to normal, so a busy
 * machine cannot starve it.  The worker is always woken at SCHED_IDLE: woken at normal
 * priority it would preempt the thread that woke it (the scheduler often places a
 * wakee on its waker's CPU); a request that wants normal priority (a prompt's prefill)
 * gets it once the worker runs. */
static void ahead_priority(pthread_t th, int idle) {
#if defined(__linux__)
    struct sched_param sp = {0};
    pthread_setschedparam(th, idle ? SCHED_IDLE : SCHED_OTHER, &sp);
#else
    (void)th;
    (void)idle;
#endif
}

static void *ahead_main(void *arg) {
    spel_draft *d = arg;
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "spel-draft");   /* what top -H and perf show */
#endif
    pthread_mutex_lock(&d->ahead.mu);
    for (;;) {
        while (!d->ahead.quit && !(d->ahead.busy && !d->ahead.ready)) pthread_cond_wait(&d->ahead.cv, &d->ahead.mu);
        if (d->ahead.quit) break;
        int urgent = !d->ahead.idle;
        pthread_mutex_unlock(&d->ahead.mu);
        if (urgent) ahead_priority(pthread_self(), 0);
        /* the target runs meanwhile: this thread alone, the pool's helpers stay for the
         * calls the target waits for */
        d->work_pool = NULL;
        /* a catch-up (prefill, or the one before a shadow proposal), then the proposal */
        int rc = d->ahead.n_tokens ? spel_draft_prefill_now(d, d->ahead.tokens, d->ahead.n_tokens) : 0;
        if (rc == 0 && !d->ahead.prefill)
            rc = spel_draft_propose_now(d, d->ahead.pending, d->ahead.k, d->ahead.start, d->ahead.guess, d->ahead.out);
        d->work_pool = d->pool;
        pthread_mutex_lock(&d->ahead.mu);
        d->ahead.rc = rc;
        d->ahead.ready = 1;
        pthread_cond_broadcast(&d->ahead.cv);
    }
    pthread_mutex_unlock(&d->ahead.mu);
    return NULL;
}

void spel_draft_ahead_stop(spel_draft *d) {
    if (!d->ahead.started) return;
    pthread_mutex_lock(&d->ahead.mu);
    d->ahead.quit = 1;
    pthread_cond_broadcast(&d->ahead.cv);
    pthread_mutex_unlock(&d->ahead.mu);
    pthread_join(d->ahead.th, NULL);   /* a running request finishes first */
    pthread_cond_destroy(&d->ahead.cv);
    pthread_mutex_destroy(&d->ahead.mu);
    free(d->ahead.out);
    free(d->ahead.tokens);
    d->ahead.tokens = NULL;
    d->ahead.started = 0;
}

static int ahead_start(spel_draft *d) {
    if (!d->ahead.started) {
        d->ahead.out = malloc(sizeof(int32_t) * ((size_t)d->R + 1));
        if (!d->ahead.out) return spel_draft_fail(d, "out of memory");
        pthread_mutex_init(&d->ahead.mu, NULL);
        pthread_cond_init(&d->ahead.cv, NULL);
        d->ahead.quit = d->ahead.busy = d->ahead.ready = 0;
        if (pthread_create(&d->ahead.th, NULL, ahead_main, d)) {
            pthread_cond_destroy(&d->ahead.cv);
            pthread_mutex_destroy(&d->ahead.mu);
            free(d->ahead.out);
            d->ahead.out = NULL;
            return spel_draft_fail(d, "cannot start the draft's proposal thread");
        }
        d->ahead.started = 1;
    }
    return 0;
}

/* hand the request whose fields the caller set (holding ahead.mu) to the worker: it
 * runs at SCHED_IDLE (`idle`) or, once it has started, at normal priority */
static void ahead_post(spel_draft *d, int idle) {
    ahead_priority(d->ahead.th, 1);
    d->ahead.idle = idle;
    d->ahead.ready = 0;
    __atomic_store_n(&d->ahead.cancel, 0, __ATOMIC_RELAXED);
    d->ahead.busy = 1;
    pthread_cond_broadcast(&d->ahead.cv);
    pthread_mutex_unlock(&d->ahead.mu);
}

static int propose_at_async(spel_draft *d, int32_t pending, int k, int start, int guess) {
    REFUSE_IF_BUSY(d);
    /* checked now, so an accepted request can only fail inside run_token */
    if (spel_draft_check_propose(d, k, start) || ahead_start(d)) return -1;
    pthread_mutex_lock(&d->ahead.mu);
    d->ahead.prefill = 0;
    d->ahead.n_tokens = 0;
    d->ahead.pending = pending;
    d->ahead.k = k;
    d->ahead.start = start;
    d->ahead.guess = guess;
    ahead_post(d, 1);
    return 0;
}

int spel_draft_propose_at_async(spel_draft *d, int32_t pending, int k, int start, int guess) {
    GUARDED(d, propose_at_async(d, pending, k, start, guess));
}

/* the checks of a catch-up over n tokens with `after` more positions behind it, then
 * its tokens copied for the worker (ahead.mu held on success) */
static int catch_up_request(spel_draft *d, const int32_t *tokens, int64_t n, int64_t after) {
    if (n < 0) return spel_draft_fail(d, "prefill of %lld tokens", (long long)n);
    if (d->last_m) return spel_draft_fail(d, "prefill needs a committed state (commit the last batch first)");
    if (d->pos + n + after > d->cfg.max_seq)
        return spel_draft_fail(d, "prefill of %lld tokens at position %lld passes max_seq=%d", (long long)n,
                    (long long)d->pos, d->cfg.max_seq);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= d->cfg.vocab)
            return spel_draft_fail(d, "token %d out of range 0..%d", tokens[i], d->cfg.vocab - 1);
    int32_t *copy = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!copy) return spel_draft_fail(d, "out of memory");
    memcpy(copy, tokens, sizeof(int32_t) * (size_t)n);
    if (ahead_start(d)) {
        free(copy);
        return -1;
    }
    pthread_mutex_lock(&d->ahead.mu);
    free(d->ahead.tokens);
    d->ahead.tokens = copy;
    d->ahead.n_tokens = n;
    return 0;
}

static int prefill_async(spel_draft *d, const int32_t *tokens, int64_t n, int background) {
    REFUSE_IF_BUSY(d);
    if (catch_up_request(d, tokens, n, 0)) return -1;
    d->ahead.prefill = 1;
    d->ahead.k = 0;
    d->ahead.guess = 0;
    ahead_post(d, background != 0);
    return 0;
}

int spel_draft_prefill_async(spel_draft *d, const int32_t *tokens, int64_t n, int background) {
    GUARDED(d, prefill_async(d, tokens, n, background));
}

static int shadow_async(spel_draft *d, const int32_t *tokens, int64_t n, int32_t pending, int k) {
    REFUSE_IF_BUSY(d);
    if (pending < 0 || pending >= d->cfg.vocab)
        return spel_draft_fail(d, "token %d out of range 0..%d", pending, d->cfg.vocab - 1);
    if (spel_draft_check_propose(d, k, 0) || catch_up_request(d, tokens, n, k + 1)) return -1;
    d->ahead.prefill = 0;
    d->ahead.pending = pending;
    d->ahead.k = k;
    d->ahead.start = 0;
    d->ahead.guess = 0;
    ahead_post(d, 1);
    return 0;
}

int spel_draft_shadow_async(spel_draft *d, const int32_t *tokens, int64_t n, int32_t pending, int k) {
    GUARDED(d, shadow_async(d, tokens, n, pending, k));
}

/* timeout_us < 0: as long as it takes */
int spel_draft_wait_ahead(spel_draft *d, int32_t *out_tokens, int64_t timeout_us) {
    if (!d->ahead.busy) return spel_draft_fail(d, "wait: no asynchronous proposal was started");
    pthread_mutex_lock(&d->ahead.mu);
    /* now on the critical path (a poll, timeout 0, is not a wait) */
    if (!d->ahead.ready && timeout_us != 0) ahead_priority(d->ahead.th, 0);
    if (timeout_us < 0) {
        while (!d->ahead.ready) pthread_cond_wait(&d->ahead.cv, &d->ahead.mu);
    } else if (timeout_us > 0) {   /* a timed wait sleeps its timer slack (~50 us) even when due */
        struct timespec until;   /* the condition variable's clock: CLOCK_REALTIME */
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += (time_t)(timeout_us / 1000000);
        until.tv_nsec += (long)(timeout_us % 1000000) * 1000;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        while (!d->ahead.ready)
            if (pthread_cond_timedwait(&d->ahead.cv, &d->ahead.mu, &until) == ETIMEDOUT) break;
    }
    if (!d->ahead.ready) {
        pthread_mutex_unlock(&d->ahead.mu);
        return SPEL_TIMEOUT;
    }
    d->ahead.busy = 0;
    __atomic_store_n(&d->ahead.cancel, 0, __ATOMIC_RELAXED);
    int rc = d->ahead.rc;
    pthread_mutex_unlock(&d->ahead.mu);
    if (rc == 0 && out_tokens && !d->ahead.prefill)
        memcpy(out_tokens, d->ahead.out, sizeof(int32_t) * ((size_t)d->ahead.k + (d->ahead.guess ? 1 : 0)));
    return rc;
}

int spel_draft_wait(spel_draft *d, int32_t *out_tokens) { GUARDED(d, spel_draft_wait_ahead(d, out_tokens, -1)); }

int spel_draft_wait_for(spel_draft *d, int32_t *out_tokens, int64_t timeout_us) {
    if (timeout_us < 0) return spel_draft_fail(d, "wait_for: negative timeout %lld us", (long long)timeout_us);
    GUARDED(d, spel_draft_wait_ahead(d, out_tokens, timeout_us));
}

/* Ask a running asynchronous proposal to stop after its current forward (its result is
 * then not wanted: the round did not accept everything).  spel_draft_wait returns
 * SPEL_CANCELLED for a proposal that stopped early; the batch before its offset stays. */
static int cancel(spel_draft *d) {
    if (!d->ahead.busy) return spel_draft_fail(d, "cancel: no asynchronous proposal was started");
    __atomic_store_n(&d->ahead.cancel, 1, __ATOMIC_RELAXED);
    return 0;
}

int spel_draft_cancel(spel_draft *d) { GUARDED(d, cancel(d)); }
