/* Persistent thread pool.
 *
 * `n` pinned workers run every job; the submitting thread never spins on a core the workers
 * need: it posts the job (bumps a generation word and wakes sleepers) and later waits on a
 * futex. A job is a few phases of independent items. Items are claimed from a per-phase counter
 * that carries the job's generation (a compare-and-swap: a worker still busy with, or late for,
 * an older job can never claim an item of a newer one), and a phase ends when all its items are
 * *completed*, not when every worker has arrived: a worker that is descheduled, asleep or late
 * for a job delays nobody (its share is claimed by the others), and one that arrives after the
 * job is done finds nothing to claim and goes back to waiting. Idle workers spin for a while
 * (KTINJECT_SPIN_US, default 1000 us: the next MoE layer usually arrives sooner), yielding the
 * CPU every few microseconds so a runnable caller on their core is not starved, then sleep on
 * the futex. The caller waits the same way: short pause loops with sched_yield between them,
 * then the futex (futex wake-ups are slow in some VMs). */
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
    cpu_set_t worker_cpus;              /* the CPUs workers are pinned to */
    int pinned;                         /* whether any worker is pinned (worker_cpus not empty) */
    int spare[64], nspare;              /* CPUs of the affinity mask no worker is pinned to (first 64) */
    _Atomic uint32_t gen, stop;         /* gen: the generation of the last job posted */
    _Atomic uint32_t done;              /* the generation of the last job completed */
    _Atomic int sleepers;
    ktk_item_fn fn;                     /* fn, ctx: read only by a worker holding a claimed item */
    void *ctx;
    _Atomic int nphase;
    _Atomic int busy;                   /* a job posted and not yet waited for; claimed by compare-and-swap,
                                         * so two threads posting at once cannot both get the pool */
    _Atomic int64_t items[MAX_PHASES];
    _Atomic uint64_t claim[MAX_PHASES]; /* generation << 32 | the next item to claim */
    _Atomic int64_t completed[MAX_PHASES];
    void **scratch;
    size_t *scratch_size;
    long spin_ns;
    int64_t claim_n;                    /* items taken per claim ($KTINJECT_POOL_CLAIM, 1-64; 1 by default) */
    _Atomic int64_t claim_ph[MAX_PHASES];   /* the current job's, per phase: claim_n or the poster's choice */
    /* trace (KTINJECT_POOL_TRACE): times of the current job, sums since the last read */
    int trace;
    long t_post, t_done, t_phase[MAX_PHASES];
    /* the job whose t_done / t_phase[ph] is written, stored after the time (release): the waiter
     * reads a time only once its stamp is the job's own (the worker that ends a phase or the job
     * writes its time after others can already see the end) */
    _Atomic uint32_t t_done_gen, t_phase_gen[MAX_PHASES];
    _Atomic long t_first, t_last;
    _Atomic int t_last_tid;             /* the worker that started last (the one that moved t_last) */
    double tr[10];                      /* see ktk_pool_trace */
    double *late_by;                    /* per worker: jobs it started LATE_NS after the post or later, last */
};

#define LATE_NS 20000L

struct worker_arg { ktk_pool *p; int tid; };

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}
static void futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
int ktk_spin_pause = 1;
static pthread_once_t spin_once = PTHREAD_ONCE_INIT;
static void spin_read(void) {
    const char *s = getenv("KTINJECT_SPIN_PAUSE");
    ktk_spin_pause = !(s && s[0] == '0' && s[1] == 0);
}
static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void trace_start(ktk_pool *p, int tid) {
    long t = now_ns(), cur = 0;
    atomic_compare_exchange_strong(&p->t_first, &cur, t);
    cur = atomic_load(&p->t_last);
    while (cur < t) {
        if (atomic_compare_exchange_weak(&p->t_last, &cur, t)) { atomic_store(&p->t_last_tid, tid); break; }
    }
}

/* Claim the next items of phase `ph` of job `g` (up to claim_n consecutive ones, *count of them):
 * the first one's index, -1 when the phase has none left, -2 when job g is no longer the posted one
 * (a newer job reset the counter). Consecutive items are neighbours in the caller's work (the MoE
 * layer: row chunks of one expert), so taking several at once keeps their shared inputs in one
 * worker's cache. */
static int64_t claim_item(ktk_pool *p, int ph, uint32_t g, int64_t *count) {
    uint64_t v = atomic_load_explicit(&p->claim[ph], memory_order_acquire);
    for (;;) {
        if ((uint32_t)(v >> 32) != g) return -2;
        int64_t i = (int64_t)(uint32_t)v, n = atomic_load_explicit(&p->items[ph], memory_order_relaxed);
        if (i >= n) return -1;
        const int64_t cn = atomic_load_explicit(&p->claim_ph[ph], memory_order_relaxed);
        int64_t take = cn < n - i ? cn : n - i;   /* i + take <= n <= INT32_MAX: no carry */
        if (atomic_compare_exchange_weak_explicit(&p->claim[ph], &v, v + (uint64_t)take, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *count = take;
            return i;
        }
    }
}

/* Mark job g done (generations only move forward: a late worker cannot undo a newer job's mark). */
static void mark_done(ktk_pool *p, uint32_t g) {
    uint32_t cur = atomic_load(&p->done);
    while ((int32_t)(g - cur) > 0) {
        if (atomic_compare_exchange_weak(&p->done, &cur, g)) {
            if (p->trace) { p->t_done = now_ns(); atomic_store_explicit(&p->t_done_gen, g, memory_order_release); }
            futex_wake(&p->done);
            return;
        }
    }
}

static void run_job(ktk_pool *p, int tid, uint32_t g) {
    if (p->trace && atomic_load(&p->gen) == g) trace_start(p, tid);
    int nphase = atomic_load_explicit(&p->nphase, memory_order_relaxed);
    for (int ph = 0; ph < nphase; ph++) {
        int64_t i, cnt;
        while ((i = claim_item(p, ph, g, &cnt)) >= 0) {
            for (int64_t j = i; j < i + cnt; j++)
                p->fn(p->ctx, ph, j, tid);      /* job g stays posted until these items are counted */
            int64_t c = atomic_fetch_add_explicit(&p->completed[ph], cnt, memory_order_acq_rel) + cnt;
            if (p->trace && c == atomic_load_explicit(&p->items[ph], memory_order_relaxed)) {
                p->t_phase[ph] = now_ns();
                atomic_store_explicit(&p->t_phase_gen[ph], g, memory_order_release);
            }
        }
        if (i == -2) return;                    /* a newer job: nothing of g is left to do */
        /* the phase's items are all claimed: wait until they are all done (or g is over) */
        long spins = 0;
        while (atomic_load_explicit(&p->completed[ph], memory_order_acquire)
               < atomic_load_explicit(&p->items[ph], memory_order_relaxed)) {
            if (atomic_load_explicit(&p->gen, memory_order_relaxed) != g) return;
            if (++spins & 0x3ff) ktk_relax(); else sched_yield();
        }
    }
    if (atomic_load_explicit(&p->gen, memory_order_acquire) == g) mark_done(p, g);
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
                ktk_relax();
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
        run_job(p, tid, g);
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

void ktk_cpu_spread(int n, int *cpus, const int *pkg, const int *core) {
    if (n < 2 || n > 4096 || !cpus || !pkg || !core) return;
    for (int i = 0; i < n; i++)
        if (pkg[i] < 0 || core[i] < 0) return;          /* topology unknown: keep the order */
    int *rank = malloc((size_t)n * sizeof *rank), *idx = malloc((size_t)n * sizeof *idx),
        *out = malloc((size_t)n * sizeof *out);
    if (rank && idx && out) {
        for (int i = 0; i < n; i++) {
            rank[i] = 0;                                 /* siblings of its core before it in the order */
            for (int j = 0; j < i; j++) rank[i] += pkg[j] == pkg[i] && core[j] == core[i];
            idx[i] = i;
        }
        for (int i = 1; i < n; i++) {                    /* stable insertion sort by (package, rank) */
            int v = idx[i], j = i - 1;
            while (j >= 0 && (pkg[idx[j]] > pkg[v] || (pkg[idx[j]] == pkg[v] && rank[idx[j]] > rank[v]))) {
                idx[j + 1] = idx[j];
                j--;
            }
            idx[j + 1] = v;
        }
        for (int i = 0; i < n; i++) out[i] = cpus[idx[i]];
        memcpy(cpus, out, (size_t)n * sizeof *cpus);
    }
    free(rank); free(idx); free(out);
}

static int topology_value(int cpu, const char *name) {
    char path[96];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/%s", cpu, name);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int v = -1;
    if (fscanf(f, "%d", &v) != 1) v = -1;
    fclose(f);
    return v;
}

/* Workers go to one CPU of every physical core before the second hyperthread of any (per
 * package), whatever the numbering: Linux numbers siblings (0, n/2) on most hosts, but a VM may
 * number them (0, 1), and then 8 workers on the first 8 CPUs would share 4 cores. */
static void spread_over_cores(int *cpus, int n) {
    int *pkg = malloc((size_t)n * sizeof *pkg), *core = malloc((size_t)n * sizeof *core);
    if (pkg && core) {
        for (int i = 0; i < n; i++) {
            pkg[i] = topology_value(cpus[i], "physical_package_id");
            core[i] = topology_value(cpus[i], "core_id");
        }
        ktk_cpu_spread(n, cpus, pkg, core);
    }
    free(pkg); free(core);
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
    p->late_by = calloc((size_t)nthreads, sizeof *p->late_by);
    pthread_once(&spin_once, spin_read);   /* before any thread of this pool spins */
    const char *s = getenv("KTINJECT_SPIN_US");
    p->spin_ns = (s ? atol(s) : 1000) * 1000L;
    s = getenv("KTINJECT_POOL_TRACE");
    p->trace = s && *s && *s != '0';
    s = getenv("KTINJECT_POOL_CLAIM");
    p->claim_n = s ? atol(s) : 1;
    if (p->claim_n < 1 || p->claim_n > 64) p->claim_n = 1;
    if (!p->th || !p->cpu || !p->scratch || !p->scratch_size || !p->late_by) { ktk_pool_free(p); return NULL; }
    if (pin && nthreads < ncpu) {
        spread_over_cores(cpus, ncpu);
        for (int c = nthreads; c < ncpu && p->nspare < 64; c++) p->spare[p->nspare++] = cpus[c];
    }
    for (int i = 0; i < nthreads; i++) {
        /* CPUs in affinity order, one per physical core first when there are more CPUs than
         * workers (spread_over_cores); on several NUMA nodes the kernel numbers CPUs node by node,
         * so consecutive workers (which take consecutive expert rows) share a node. */
        p->cpu[i] = pin && nthreads <= ncpu ? cpus[i] : -1;
        struct worker_arg *wa = malloc(sizeof *wa);
        if (!wa) { p->n = i; ktk_pool_free(p); return NULL; }
        wa->p = p; wa->tid = i;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        if (p->cpu[i] >= 0) {
            CPU_SET(p->cpu[i], &p->worker_cpus);
            p->pinned = 1;
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
    free(p->scratch); free(p->scratch_size); free(p->th); free(p->cpu); free(p->late_by);
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
    return ktk_pool_run_async_claims(p, fn, ctx, nphase, items, NULL);
}

int ktk_pool_run_async_claims(ktk_pool *p, ktk_item_fn fn, void *ctx, int nphase, const int64_t *items,
                              const int64_t *claims) {
    if (!p || nphase < 1 || nphase > MAX_PHASES) return KTK_EINVAL;
    for (int i = 0; i < nphase; i++)
        if (items[i] < 0 || items[i] > INT32_MAX || (claims && (claims[i] < 0 || claims[i] > 64))) return KTK_EINVAL;
    int idle = 0;
    if (!atomic_compare_exchange_strong(&p->busy, &idle, 1)) return KTK_EBUSY;
    uint32_t g = atomic_load(&p->gen) + 1;
    /* the claim counters first: from here on no worker of an older job can claim anything */
    for (int i = 0; i < MAX_PHASES; i++) atomic_store(&p->claim[i], (uint64_t)g << 32);
    p->fn = fn; p->ctx = ctx;
    atomic_store_explicit(&p->nphase, nphase, memory_order_relaxed);
    for (int i = 0; i < nphase; i++) {
        atomic_store_explicit(&p->items[i], items[i], memory_order_relaxed);
        atomic_store_explicit(&p->completed[i], 0, memory_order_relaxed);
        atomic_store_explicit(&p->claim_ph[i], claims && claims[i] ? claims[i] : p->claim_n, memory_order_relaxed);
    }
    if (p->trace) { atomic_store(&p->t_first, 0); atomic_store(&p->t_last, 0); p->t_post = now_ns(); }
    atomic_store(&p->gen, g);       /* seq_cst: publishes the job, ordered before the sleepers load */
    if (atomic_load(&p->sleepers) > 0) futex_wake(&p->gen);
    return KTK_OK;
}

int ktk_pool_wait(ktk_pool *p) {
    if (!p || !atomic_load(&p->busy)) return KTK_OK;
    uint32_t g = atomic_load(&p->gen);
    long t0 = now_ns();
    int k = 0;
    uint32_t d;
    /* On a CPU no worker is pinned to (the doorbell thread's, or a caller pinned outside), spinning
     * takes nothing from the workers, so wait that way 20 times longer before the futex, whose
     * wake-up costs 50-90 us a call in a VM: the whole layer at low thread counts, where a layer
     * takes milliseconds (seventeenth session). */
    int here = sched_getcpu();
    long budget = p->pinned && here >= 0 && here < CPU_SETSIZE && !CPU_ISSET(here, &p->worker_cpus)
                  ? 20 * p->spin_ns : p->spin_ns;
    while ((d = atomic_load_explicit(&p->done, memory_order_acquire)) != g) {
        ktk_relax();
        if (++k == 64) {
            k = 0;
            if (now_ns() - t0 > budget) break;
            sched_yield();
        }
    }
    while ((d = atomic_load_explicit(&p->done, memory_order_acquire)) != g) futex_wait(&p->done, d);
    if (p->trace) {
        long t1 = now_ns();
        int nphase = atomic_load(&p->nphase);
        for (long spin = 0; spin < 1000000; spin++) {   /* the stamps follow the end by nanoseconds (bounded: trace only) */
            int ok = atomic_load_explicit(&p->t_done_gen, memory_order_acquire) == g;
            for (int ph = 0; ok && ph + 1 < nphase; ph++)
                ok = atomic_load(&p->items[ph]) == 0 || atomic_load_explicit(&p->t_phase_gen[ph], memory_order_acquire) == g;
            if (ok) break;
            ktk_relax();
        }
        p->tr[0] += 1;
        p->tr[1] += (atomic_load(&p->t_first) - p->t_post) / 1e3;
        p->tr[2] += (atomic_load(&p->t_last) - p->t_post) / 1e3;
        p->tr[3] += (p->t_done - p->t_post) / 1e3;
        p->tr[4] += (t1 - t0) / 1e3;
        long end = p->t_post;                           /* a phase without items ends where the one before did */
        for (int ph = 0; ph < 3; ph++) {
            if (ph + 1 < nphase && atomic_load(&p->items[ph]) > 0) end = p->t_phase[ph];
            p->tr[5 + ph] += ph + 1 < nphase ? (end - p->t_post) / 1e3 : 0;
        }
        long late = atomic_load(&p->t_last) - p->t_post;
        if (late / 1e3 > p->tr[8]) p->tr[8] = late / 1e3;
        if (late >= LATE_NS) {
            p->tr[9] += 1;
            int tid = atomic_load(&p->t_last_tid);
            if (tid >= 0 && tid < p->n) p->late_by[tid] += 1;
        }
    }
    atomic_store(&p->busy, 0);
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
    int m = n < 10 + p->n ? n : 10 + p->n;
    for (int i = 0; i < m; i++) out[i] = i < 10 ? p->tr[i] : p->late_by[i - 10];
    memset(p->tr, 0, sizeof p->tr);
    memset(p->late_by, 0, (size_t)p->n * sizeof *p->late_by);
    return m;
}
