/* Persistent thread pool.
 *
 * `n` pinned workers run every job; the submitting thread never spins on a core the workers
 * need: it posts the job (bumps a generation word and wakes sleepers) and later waits on a
 * futex. A job is a few phases of independent items, claimed with an atomic counter (dynamic
 * balance: a descheduled worker only delays its current item); between phases workers meet at
 * a barrier (spin with pause, then yield). Idle workers spin for a while (KTINJECT_SPIN_US, default
 * 1000 us: the next MoE layer usually arrives sooner), yielding the CPU every few microseconds so
 * a runnable caller on their core is not starved, then sleep on the futex. The caller waits the
 * same way: short pause loops with sched_yield between them, then the futex (futex wake-ups are
 * slow in some VMs). */
#define _GNU_SOURCE
#include "ktk_int.h"
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#define MAX_PHASES 8

struct ktk_pool {
    int n, numa;
    pthread_t *th;
    int *cpu;                           /* cpu of each worker, -1: not pinned */
    int spare[64], nspare;              /* CPUs of the affinity mask no worker is pinned to (first 64) */
    _Atomic uint32_t gen, done, stop;
    _Atomic int sleepers;
    ktk_item_fn fn;
    void *ctx;
    int nphase;
    _Atomic int busy;                   /* a job posted and not yet waited for; claimed by compare-and-swap,
                                         * so two threads posting at once cannot both get the pool */
    int64_t items[MAX_PHASES];
    _Atomic int64_t next[MAX_PHASES];
    _Atomic int arrived[MAX_PHASES];
    _Atomic int finished;
    void **scratch;
    size_t *scratch_size;
    long spin_ns;
    /* trace (KTINJECT_POOL_TRACE): times of the current job, sums since the last read */
    int trace;
    long t_post, t_done, t_phase[MAX_PHASES];
    _Atomic long t_first, t_last;
    double tr[8];
};

struct worker_arg { ktk_pool *p; int tid; };

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}
static void futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}
static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void trace_start(ktk_pool *p) {
    long t = now_ns(), cur = 0;
    atomic_compare_exchange_strong(&p->t_first, &cur, t);
    cur = atomic_load(&p->t_last);
    while (cur < t && !atomic_compare_exchange_weak(&p->t_last, &cur, t)) {}
}

static void run_job(ktk_pool *p, int tid) {
    if (p->trace) trace_start(p);
    for (int ph = 0; ph < p->nphase; ph++) {
        int64_t i;
        while ((i = atomic_fetch_add_explicit(&p->next[ph], 1, memory_order_relaxed)) < p->items[ph])
            p->fn(p->ctx, ph, i, tid);
        if (ph + 1 < p->nphase) {
            if (atomic_fetch_add_explicit(&p->arrived[ph], 1, memory_order_acq_rel) == p->n - 1 && p->trace)
                p->t_phase[ph] = now_ns();           /* the last to arrive ends the phase */
            long spins = 0;
            while (atomic_load_explicit(&p->arrived[ph], memory_order_acquire) < p->n)
                if (++spins & 0x3ff) cpu_relax(); else sched_yield();
        }
    }
    if (atomic_fetch_add_explicit(&p->finished, 1, memory_order_acq_rel) == p->n - 1) {
        if (p->trace) p->t_done = now_ns();
        atomic_store_explicit(&p->done, 1, memory_order_release);
        futex_wake(&p->done);
    }
}

static void *worker(void *arg) {
    struct worker_arg *wa = arg;
    ktk_pool *p = wa->p;
    int tid = wa->tid;
    free(wa);
    char name[16];
    snprintf(name, sizeof name, "ktk-worker-%d", tid);
    pthread_setname_np(pthread_self(), name);        /* visible in top -H, /proc/<pid>/task */
    uint32_t seen = 0;
    for (;;) {
        uint32_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g == seen) {
            long t0 = now_ns();
            int k = 0;
            while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen) {
                cpu_relax();
                if (++k == 64) {
                    k = 0;
                    sched_yield();          /* let a runnable caller (Python, GPU launches) have the core */
                    if (now_ns() - t0 > p->spin_ns) {
                        atomic_fetch_add(&p->sleepers, 1);
                        while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen)
                            futex_wait(&p->gen, seen);
                        atomic_fetch_sub(&p->sleepers, 1);
                        break;
                    }
                }
            }
        }
        if (atomic_load(&p->stop)) break;
        seen = g;
        run_job(p, tid);
    }
    return NULL;
}

static int count_numa_nodes(void) {
    DIR *d = opendir("/sys/devices/system/node");
    if (!d) return 1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, "node", 4) && e->d_name[4] >= '0' && e->d_name[4] <= '9') n++;
    closedir(d);
    return n > 0 ? n : 1;
}

ktk_pool *ktk_pool_new(int nthreads, int pin) {
    cpu_set_t set;
    int cpus[CPU_SETSIZE], ncpu = 0;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &set)) cpus[ncpu++] = c;
    }
    if (ncpu == 0) { ncpu = (int)sysconf(_SC_NPROCESSORS_ONLN); for (int c = 0; c < ncpu; c++) cpus[c] = c; }
    if (nthreads <= 0) nthreads = ncpu;
    if (nthreads > 1024) return NULL;
    ktk_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = nthreads;
    p->numa = count_numa_nodes();
    p->th = calloc((size_t)nthreads, sizeof *p->th);
    p->cpu = calloc((size_t)nthreads, sizeof *p->cpu);
    p->scratch = calloc((size_t)nthreads, sizeof *p->scratch);
    p->scratch_size = calloc((size_t)nthreads, sizeof *p->scratch_size);
    const char *s = getenv("KTINJECT_SPIN_US");
    p->spin_ns = (s ? atol(s) : 1000) * 1000L;
    s = getenv("KTINJECT_POOL_TRACE");
    p->trace = s && *s && *s != '0';
    if (!p->th || !p->cpu || !p->scratch || !p->scratch_size) { ktk_pool_free(p); return NULL; }
    if (pin && nthreads < ncpu)
        for (int c = nthreads; c < ncpu && p->nspare < 64; c++) p->spare[p->nspare++] = cpus[c];
    for (int i = 0; i < nthreads; i++) {
        /* CPUs in affinity order: on several NUMA nodes the kernel numbers them node by node,
         * so consecutive workers (which take consecutive expert rows) share a node. */
        p->cpu[i] = pin && nthreads <= ncpu ? cpus[i] : -1;
        struct worker_arg *wa = malloc(sizeof *wa);
        if (!wa) { p->n = i; ktk_pool_free(p); return NULL; }
        wa->p = p; wa->tid = i;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        if (p->cpu[i] >= 0) {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(p->cpu[i], &one);
            pthread_attr_setaffinity_np(&attr, sizeof one, &one);
        }
        int rc = pthread_create(&p->th[i], &attr, worker, wa);
        pthread_attr_destroy(&attr);
        if (rc) { free(wa); p->n = i; ktk_pool_free(p); return NULL; }
    }
    return p;
}

void ktk_pool_free(ktk_pool *p) {
    if (!p) return;
    if (atomic_load(&p->busy)) ktk_pool_wait(p);
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->gen, 1);
    futex_wake(&p->gen);
    for (int i = 0; i < p->n; i++)
        if (p->th && p->th[i]) pthread_join(p->th[i], NULL);
    if (p->scratch)
        for (int i = 0; i < p->n; i++) free(p->scratch[i]);
    free(p->scratch); free(p->scratch_size); free(p->th); free(p->cpu);
    free(p);
}

int ktk_pool_threads(const ktk_pool *p) { return p ? p->n : 0; }
int ktk_pool_numa_nodes(const ktk_pool *p) { return p ? p->numa : 0; }

void *ktk_pool_scratch(ktk_pool *p, int tid, size_t bytes) {
    if (p->scratch_size[tid] < bytes) {
        free(p->scratch[tid]);
        bytes = (bytes + 4095) & ~(size_t)4095;
        p->scratch[tid] = aligned_alloc(64, bytes);
        p->scratch_size[tid] = p->scratch[tid] ? bytes : 0;
    }
    return p->scratch[tid];
}

int ktk_pool_run_async(ktk_pool *p, ktk_item_fn fn, void *ctx, int nphase, const int64_t *items) {
    if (!p || nphase < 1 || nphase > MAX_PHASES) return KTK_EINVAL;
    int idle = 0;
    if (!atomic_compare_exchange_strong(&p->busy, &idle, 1)) return KTK_EBUSY;
    p->fn = fn; p->ctx = ctx; p->nphase = nphase;
    for (int i = 0; i < nphase; i++) {
        p->items[i] = items[i];
        atomic_store_explicit(&p->next[i], 0, memory_order_relaxed);
        atomic_store_explicit(&p->arrived[i], 0, memory_order_relaxed);
    }
    atomic_store_explicit(&p->finished, 0, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    if (p->trace) { atomic_store(&p->t_first, 0); atomic_store(&p->t_last, 0); p->t_post = now_ns(); }
    atomic_fetch_add(&p->gen, 1);   /* seq_cst: ordered before the sleepers load */
    if (atomic_load(&p->sleepers) > 0) futex_wake(&p->gen);
    return KTK_OK;
}

int ktk_pool_wait(ktk_pool *p) {
    if (!p || !atomic_load(&p->busy)) return KTK_OK;
    long t0 = now_ns();
    int k = 0;
    while (!atomic_load_explicit(&p->done, memory_order_acquire)) {
        cpu_relax();
        if (++k == 64) {
            k = 0;
            if (now_ns() - t0 > p->spin_ns) break;
            sched_yield();
        }
    }
    while (!atomic_load_explicit(&p->done, memory_order_acquire)) futex_wait(&p->done, 0);
    atomic_store(&p->busy, 0);
    if (p->trace) {
        long t1 = now_ns();
        p->tr[0] += 1;
        p->tr[1] += (atomic_load(&p->t_first) - p->t_post) / 1e3;
        p->tr[2] += (atomic_load(&p->t_last) - p->t_post) / 1e3;
        p->tr[3] += (p->t_done - p->t_post) / 1e3;
        p->tr[4] += (t1 - t0) / 1e3;
        for (int ph = 0; ph < 3; ph++)
            p->tr[5 + ph] += ph + 1 < p->nphase ? (p->t_phase[ph] - p->t_post) / 1e3 : 0;
    }
    return KTK_OK;
}

int ktk_pool_pin_outside(ktk_pool *p) {
    if (!p || p->nspare == 0) return 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = 0; i < p->nspare; i++) CPU_SET(p->spare[i], &set);
    return sched_setaffinity(0, sizeof set, &set) == 0 ? p->nspare : 0;   /* 0 = the calling thread */
}

int ktk_pool_trace(ktk_pool *p, double *out, int n) {
    if (!p || !p->trace || !out || n < 5) return 0;
    int m = n < 8 ? n : 8;
    for (int i = 0; i < m; i++) { out[i] = p->tr[i]; p->tr[i] = 0; }
    for (int i = m; i < 8; i++) p->tr[i] = 0;
    return m;
}
