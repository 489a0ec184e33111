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
#include "ktk_int.h"
#include <stdatomic.h>

static _Atomic int first_error;
static ktk_host_job *_Atomic first_job;  /* the job that failed first (names the layer in Python) */
static __thread int placed;            /* this (driver) thread was moved off the workers' cores */

static void fail(ktk_host_job *j, int rc) {
    j->status = rc;
    if (j->out && j->T > 0 && j->hidden > 0) memset(j->out, 0, (size_t)(j->T * j->hidden) * sizeof(float));
    int none = 0;
    if (atomic_compare_exchange_strong(&first_error, &none, rc)) atomic_store(&first_job, j);
}

void ktk_host_submit(void *arg) {
    ktk_host_job *j = arg;
    if (!j) return;
    if (!j->moe || !j->pool || j->T < 0 || j->k < 1 || j->hidden <= 0) { fail(j, KTK_EINVAL); return; }
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
