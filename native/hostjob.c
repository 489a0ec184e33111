/* Stream-ordered MoE jobs: the routed-experts layer driven by a CUDA stream's host functions.
 *
 * A GPU-resident model cannot hand its hidden states to the CPU without waiting on the stream,
 * and a CUDA graph cannot contain that wait. Instead the stream itself drives the CPU: it copies
 * the inputs into pinned host buffers (memcpy nodes), then calls `ktk_host_submit` (a host
 * function node: posts the job to the pool and returns at once), runs the shared experts, calls
 * `ktk_host_sync` (waits for the pool) and copies the result back. Python only records these
 * nodes (ktinject/native/hostfn.py); they replay inside a CUDA graph as they are.
 *
 * Both functions run on the CUDA driver's callback thread and must not call CUDA. They cannot
 * return an error either: a failed job zeroes its output, keeps the code in `status`, and the
 * first failure since the last check is kept for `ktk_host_error`, which Python reads at the
 * next call and at the end of generation, so nothing fails silently. */
#define _GNU_SOURCE
#include "ktk_int.h"
#include <stdatomic.h>
#include <stdlib.h>

#define SKIPPED 1                      /* status of a job skipped by KTINJECT_HOSTJOB_SKIP (not an error) */

static _Atomic int first_error;
static ktk_host_job *_Atomic first_job;  /* the job that failed first (names the layer in Python) */
static __thread int placed;            /* this (driver) thread was moved off the workers' cores */

/* the output's size as the record gives it, when the record agrees with its layer (else 0: a
 * record whose `hidden` is not the layer's says nothing trustworthy about its buffer) */
static size_t out_floats(const ktk_host_job *j) {
    if (!j->out || !j->moe || j->T <= 0 || j->hidden <= 0 || j->hidden != ktk_moe_hidden(j->moe)) return 0;
    return (size_t)(j->T * j->hidden);
}

static void fail(ktk_host_job *j, int rc) {
    j->status = rc;
    size_t n = out_floats(j);
    if (n) memset(j->out, 0, n * sizeof(float));
    int none = 0;
    if (atomic_compare_exchange_strong(&first_error, &none, rc)) atomic_store(&first_job, j);
}

/* KTINJECT_HOSTJOB_SKIP=1 (measurement only: scripts/profile_decode.py): jobs return zeros at
 * once, so a decode step's time is its GPU work and the host-node round trips alone. */
static int skip_jobs(void) {
    static _Atomic int skip = -1;             /* read once; "1" or "2" as Python reads it (hostfn.py) */
    int v = atomic_load(&skip);
    if (v < 0) {
        const char *s = getenv("KTINJECT_HOSTJOB_SKIP");
        v = s && (s[0] == '1' || s[0] == '2') && s[1] == 0;
        atomic_store(&skip, v);
    }
    return v;
}

void ktk_host_submit(void *arg) {
    ktk_host_job *j = arg;
    if (!j) return;
    if (!j->moe || !j->pool || j->k < 1 || !out_floats(j) || !j->x || !j->ids || !j->w) {   /* out_floats: T, hidden */
        fail(j, KTK_EINVAL);
        return;
    }
    if (skip_jobs()) {
        memset(j->out, 0, out_floats(j) * sizeof(float));
        j->status = SKIPPED;                    /* not KTK_OK: sync has nothing to wait for */
        return;
    }
    if (!placed) { ktk_pool_pin_outside(j->pool); placed = 1; }   /* spinning in sync must not steal a worker's core */
    int rc = ktk_moe_submit(j->moe, j->pool, j->isa, j->T, j->k, j->x, j->ids, j->w, j->out);
    if (rc) { fail(j, rc); return; }
    j->status = KTK_OK;
}

void ktk_host_sync(void *arg) {
    ktk_host_job *j = arg;
    if (!j || j->status != KTK_OK) return;       /* a failed submit left zeros and its code */
    int rc = ktk_moe_sync(j->moe, j->pool);
    if (rc) fail(j, rc);
}

int ktk_host_error(int clear, void **job) {
    if (job) *job = atomic_load(&first_job);
    if (!clear) return atomic_load(&first_error);
    atomic_store(&first_job, NULL);
    return atomic_exchange(&first_error, 0);
}

/* ---- doorbells: the same jobs without host functions ------------------------------------------
 *
 * A host-function node costs a round trip through the driver's callback thread (the GPU raises an
 * interrupt, the thread wakes, runs, and signals back): tens to a hundred microseconds, twice per
 * layer. A doorbell needs none of it. Each job gets two 32-bit flags in page-locked memory that the
 * GPU reaches over the bus: the stream writes `go = 1` after its input copies
 * (cuStreamWriteValue32), and later waits for `done == 1` (cuStreamWaitValue32) and clears it
 * before copying the output back. One dispatcher thread (started with the first bell, moved off
 * the workers' cores) polls the armed bells: it clears `go`, runs the job on the pool, and sets
 * `done`. Each flag is set by one side and cleared by the other, so the same values work at every
 * replay of a CUDA graph. A failed job still rings `done` (with zeros and its error kept, as for
 * the host functions), so the GPU never waits forever on a job that ran.
 *
 * The dispatcher spins between jobs (decode rings a bell every few hundred microseconds) for
 * KTINJECT_SPIN_US (default 1000 us) after the last job, then polls every 50 us, and every 1 ms
 * after 100 ms of quiet. */
#include <pthread.h>
#include <time.h>

#define MAX_BELLS 4096

typedef struct {
    ktk_host_job *job;
    _Atomic uint32_t *go, *done;
} bell;

static pthread_mutex_t bell_mu = PTHREAD_MUTEX_INITIALIZER;
int ktk_bell_remove(ktk_host_job *job);
static bell bells[MAX_BELLS];
static int nbells;
static _Atomic int bell_thread_started;
static _Atomic long bell_rings;

static long now_ns_(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void run_job(ktk_host_job *j) {
    ktk_host_submit(j);
    ktk_host_sync(j);
}

/* One pass over the bells: run every job whose `go` is set. Returns how many ran. */
int ktk_bell_poll(void) {
    int ran = 0;
    pthread_mutex_lock(&bell_mu);
    for (int i = 0; i < nbells; i++) {
        bell *b = &bells[i];
        if (atomic_load_explicit(b->go, memory_order_acquire) != 1) continue;
        atomic_store_explicit(b->go, 0, memory_order_relaxed);
        run_job(b->job);
        atomic_store_explicit(b->done, 1, memory_order_release);
        atomic_fetch_add_explicit(&bell_rings, 1, memory_order_relaxed);
        ran++;
    }
    pthread_mutex_unlock(&bell_mu);
    return ran;
}

static void *bell_main(void *arg) {
    (void)arg;
    const char *s = getenv("KTINJECT_SPIN_US");
    long spin_ns = (s ? atol(s) : 1000) * 1000L;
    long last = now_ns_();
    for (;;) {
        if (ktk_bell_poll()) { last = now_ns_(); continue; }
        long idle = now_ns_() - last;
        if (idle < spin_ns) {
            ktk_relax();
            continue;
        }
        struct timespec ts = {0, idle < 100000000L ? 50000L : 1000000L};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* Arm a bell for `job`: flags[0] is `go`, flags[16] is `done` (64 bytes apart), both 0. Starts the
 * dispatcher thread on first use (moved off the workers of `job->pool`). */
int ktk_bell_add(ktk_host_job *job, uint32_t *flags) {
    if (!job || !flags || !job->pool) return KTK_EINVAL;
    pthread_mutex_lock(&bell_mu);
    int rc = KTK_OK;
    if (nbells >= MAX_BELLS) rc = KTK_ENOMEM;
    else {
        for (int i = 0; i < nbells; i++)
            if (bells[i].job == job) { rc = KTK_EINVAL; break; }
    }
    if (rc == KTK_OK) {
        bells[nbells].job = job;
        bells[nbells].go = (_Atomic uint32_t *)flags;
        bells[nbells].done = (_Atomic uint32_t *)(flags + 16);
        nbells++;
    }
    pthread_mutex_unlock(&bell_mu);
    if (rc == KTK_OK && !atomic_exchange(&bell_thread_started, 1)) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &a, bell_main, NULL) != 0) {
            atomic_store(&bell_thread_started, 0);
            ktk_bell_remove(job);                   /* nobody would answer it: not armed */
            rc = KTK_ENOMEM;
        } else {
            pthread_setname_np(t, "ktk-bells");   /* its first job moves it off the workers' cores */
        }
        pthread_attr_destroy(&a);
    }
    return rc;
}

/* Disarm `job`'s bell (waits for a job of it that is running). Returns 1 if it was armed. */
int ktk_bell_remove(ktk_host_job *job) {
    int found = 0;
    pthread_mutex_lock(&bell_mu);
    for (int i = 0; i < nbells; i++) {
        if (bells[i].job != job) continue;
        bells[i] = bells[--nbells];
        found = 1;
        break;
    }
    pthread_mutex_unlock(&bell_mu);
    return found;
}

/* Jobs run through bells since the process started (tests, profiles). */
long ktk_bell_rings(void) { return atomic_load(&bell_rings); }

/* 1 when the dispatcher thread runs (tests: 0 lets them poll by hand with ktk_bell_poll). */
int ktk_bell_thread(void) { return atomic_load(&bell_thread_started); }
