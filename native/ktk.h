/* ktk: native CPU kernels of ktinject (routed MoE experts on GGUF blocks).
 *
 * The public surface is narrow on purpose: pointers, sizes, strides. The Python wrapper
 * (ktinject/native) checks dtype, shape, contiguity and bounds before it calls in; the C side
 * re-checks what is cheap (types, sizes, expert ids) and returns a negative KTK_E* code.
 */
#ifndef KTK_H
#define KTK_H
#include <stddef.h>
#include <stdint.h>

/* ISA paths (runtime dispatch; one shared object holds them all). */
#define KTK_ISA_SCALAR 0
#define KTK_ISA_AVX2 1      /* AVX2 + FMA + F16C */
#define KTK_ISA_AVX512 2    /* AVX-512 F/BW/VL (+VNNI for int8 dots) */
#define KTK_ISA_AMX 3       /* AVX-512 for decode, AMX-BF16 tiles for grouped (prefill) work */

/* GGML type ids (gguf.GGMLQuantizationType). */
#define KTK_F32 0
#define KTK_F16 1
#define KTK_Q4_0 2
#define KTK_Q5_0 6
#define KTK_Q8_0 8
#define KTK_Q2_K 10
#define KTK_Q3_K 11
#define KTK_Q4_K 12
#define KTK_Q5_K 13
#define KTK_Q6_K 14
#define KTK_IQ4_XS 23
#define KTK_BF16 30

/* Error codes. */
#define KTK_OK 0
#define KTK_EINVAL -1      /* bad argument (sizes, types) */
#define KTK_ERANGE -2      /* a value out of range: an expert id; a NaN / Inf or overflow to quantize */
#define KTK_ENOMEM -3
#define KTK_EBUSY -4       /* a job is already in flight on this pool */
#define KTK_EISA -5        /* the requested ISA is not available */

/* ---- CPU features and ISA selection ---- */
int ktk_cpu_features(void);              /* bit i set: ISA i usable on this CPU (and compiled) */
int ktk_compiled_isas(void);             /* bit i set: ISA i compiled into this library */
int ktk_best_isa(void);
int ktk_amx_permission(void);            /* 1 when Linux granted AMX tile state */
#define KTK_VENDOR_OTHER 0
#define KTK_VENDOR_INTEL 1
#define KTK_VENDOR_AMD 2   /* AuthenticAMD, or HygonGenuine (Zen cores) */
int ktk_cpu_vendor(void);                /* from cpuid leaf 0 */
/* bit t set: the grouped (prefill) path of ISA `isa` multiplies GGML type t in 8-bit integers
 * (0 for scalar, AMX, an unusable ISA, or with $KTINJECT_VNNI_GROUPED=0 or $KTINJECT_PACKED_F32=0;
 * moe.c reads the same) */
unsigned ktk_grouped_int8_types(int isa);

/* ---- thread pool ---- */
typedef struct ktk_pool ktk_pool;
ktk_pool *ktk_pool_new(int nthreads, int pin);   /* nthreads <= 0: all CPUs of the affinity mask */
void ktk_pool_free(ktk_pool *p);
int ktk_pool_threads(const ktk_pool *p);
int ktk_pool_numa_nodes(const ktk_pool *p);

/* ---- quant facts and single-row helpers (tests, conversions) ---- */
int ktk_type_block(int type);            /* values per block, 0 if unsupported */
int ktk_type_size(int type);             /* bytes per block */
int64_t ktk_row_bytes(int type, int64_t n);   /* -1 if n is not a multiple of the block */
int ktk_dequant_row(int type, const uint8_t *src, float *dst, int64_t n);
int ktk_dequant_row_isa(int isa, int type, const uint8_t *src, float *dst, int64_t n);   /* the ISA's version */
/* y[r] = dot(row r of W, x) for r < rows; the kernel the MoE decode path uses. */
int ktk_gemv(int isa, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n,
             const float *x, float *y);

/* ---- dense layers on GGML rows (linear.c) ----
 * y[t*rows + r] = dot(row r of W, x[t*n ...]) for t < T, r < rows, over the pool's workers (the
 * calling thread alone when p is NULL or busy). ktk_dequant_rows: dst[r*n ...] = row r as f32. */
int ktk_linear(ktk_pool *p, int isa, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n,
               int64_t T, const float *x, float *y);
int ktk_dequant_rows(ktk_pool *p, int isa, int type, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n,
                     float *dst);
/* bit t set: ktk_linear multiplies GGML type t with the 8-bit grouped GEMM from
 * ktk_linear_grouped_min() tokens on (0 there: never; $KTINJECT_LINEAR_GROUPED_MIN, default 16) */
unsigned ktk_linear_grouped_types(int isa);
int64_t ktk_linear_grouped_min(void);

/* ---- the fused MoE layer ---- */
typedef struct {
    int gate_type, up_type, down_type;   /* GGML types */
    int64_t n_experts, hidden, inter;     /* E, H, I */
    const uint8_t *gate;                  /* [E*I, gate_rb] */
    const uint8_t *up;                    /* [E*I, up_rb]   */
    const uint8_t *down;                  /* [E*H, down_rb] */
    int64_t gate_rb, up_rb, down_rb;      /* row bytes */
    int64_t gate_es, up_es, down_es;      /* bytes from one expert to the next (0: rows * row bytes) */
    /* NULL, or the matrix repacked by ktk_r16_repack (experts back to back, ktk_r16_row_bytes per
     * row): the decode (row-dot) path reads it, the grouped (prefill) path the GGML rows above.
     * Gate and up both or neither, of one type. */
    const uint8_t *gate_r16, *up_r16, *down_r16;
    /* NULL, or the matrix requantized by ktk_i8_repack (experts back to back, ktk_i8_expert_bytes
     * each): on the AMX path with AMX-INT8, the grouped (prefill) experts multiply it with 8-bit
     * tiles instead of converting the GGML rows to bf16. Gate and up both or neither. */
    const uint8_t *gate_i8, *up_i8, *down_i8;
    int64_t gate_i8_group, down_i8_group;  /* the copies' group sizes G (gate and up share one; 0: ktk_i8_group, I4: ktk_i4_group) */
    int i8_bits;                          /* 8 (or 0): the *_i8 copies are I8 ones; 4: I4 (ktk_i4_repack) */
    /* NULL, or a BF16 matrix copied tile-major by ktk_bt_repack (experts back to back, ktk_bt_expert_bytes each): on
     * the AMX path the grouped (prefill) experts' bf16 tiles load it as 1 KiB blocks instead of 16 rows a tile from
     * the GGML rows (the same values, the same bits). Gate and up both or neither; the I8 copies come first. */
    const uint8_t *gate_bt, *up_bt, *down_bt;
} ktk_moe_desc;

typedef struct ktk_moe ktk_moe;
ktk_moe *ktk_moe_new(const ktk_moe_desc *d, int *err);
void ktk_moe_free(ktk_moe *m);

/* out[t] = sum_j w[t,j] * down_e(SiLU(gate_e x_t) * up_e x_t), e = ids[t,j].
 * x: [T, H] f32, ids: [T, k] int64, w: [T, k] f32, out: [T, H] f32.
 * submit returns at once (the pool's workers compute); sync waits and returns the status. */
int ktk_moe_submit(ktk_moe *m, ktk_pool *p, int isa, int64_t T, int64_t k, const float *x,
                   const int64_t *ids, const float *w, float *out);
int ktk_moe_sync(ktk_moe *m, ktk_pool *p);
int ktk_moe_forward(ktk_moe *m, ktk_pool *p, int isa, int64_t T, int64_t k, const float *x,
                    const int64_t *ids, const float *w, float *out);
/* `calls` layers back to back from the calling thread, as the doorbell dispatcher (hostjob.c)
 * hands layers over in a hybrid decode: call i runs layer m[i % n] on routing (ids[i % nroutes],
 * w[i % nroutes]), each [T, k], and posts call i + 1 as soon as call i is done. x: [T, hidden] f32,
 * out: [T, hidden] f32, rewritten by every call. Every layer must have the same hidden size. The
 * wall time of all calls goes to *seconds. KTK_OK, KTK_EINVAL, KTK_ERANGE (an expert id out of
 * range; no layer ran) or the first failing call's code. */
int ktk_moe_chain(ktk_moe **m, int64_t n, ktk_pool *p, int isa, int64_t T, int64_t k, const float *x,
                  const int64_t **ids, const float **w, int64_t nroutes, float *out, int64_t calls,
                  double *seconds);

/* ---- R16 layouts (r16.c): 16 rows interleaved block by block for the AVX-512 VNNI decode
 * kernels (Q4_K, Q5_K, Q4_0, Q5_0, Q8_0, Q6_K, IQ4_XS; layout in r16.c). A group of 16 rows takes 16 * row_bytes bytes.
 * repack: n_experts matrices of `rows` GGML rows (src_rb bytes each, src_es bytes from one
 * expert's first row to the next) -> dst, experts back to back (rows % 16 == 0), over the pool
 * (NULL: the calling thread). dequant: rows R16 rows -> dst [rows, n] f32 (GGML's values).
 * gemv: y[t * rows + r] = dot(row r, x[t * n ...]) for t < T <= 4 (tests). */
int ktk_r16_supported(int type);
int64_t ktk_r16_row_bytes(int type, int64_t n);   /* -1 if unsupported or n is not a multiple of the block */
int ktk_r16_repack(ktk_pool *p, int type, const uint8_t *src, int64_t src_rb, int64_t src_es, int64_t n_experts,
                   int64_t rows, int64_t n, uint8_t *dst);
int ktk_r16_dequant(int type, const uint8_t *w, int64_t rows, int64_t n, float *dst);
int ktk_r16_gemv(int isa, int type, const uint8_t *w, int64_t rows, int64_t n, int64_t T, const float *x, float *y);
/* how the R16 decode kernels of GGML type `type` read memory here: the software prefetch distance
 * in bytes (0: none), into L2 (1) or L1 (0), and the segments read side by side per (group, token)
 * pair; the defaults depend on the CPU's vendor (docs/native.md), $KTINJECT_R16_PF,
 * $KTINJECT_R16_PF_L2 and $KTINJECT_R16_SPLIT override them (read once). KTK_EINVAL: no R16 layout. */
int ktk_r16_stream(int type, int *pf_bytes, int *l2, int *split);

/* ---- BF16 tile copies (amx.c): BF16 expert matrices copied at load into the tile-major layout the AMX-BF16
 * GEMM multiplies (ktk_amx_rows_bf16's: in each block of 32 rows, k-step ks's 32 values of row r at (ks * 32 + r)
 * * 32, so each 16-row A tile is 1 KiB of contiguous memory). expert_bytes: rows * n * 2 (-1 unless rows % 32 == 0
 * and n % 32 == 0). repack: as ktk_r16_repack, from KTK_BF16 rows only (KTK_EINVAL otherwise): a copy, no rounding. */
int64_t ktk_bt_expert_bytes(int64_t rows, int64_t n);
int ktk_bt_repack(ktk_pool *p, int type, const uint8_t *src, int64_t src_rb, int64_t src_es, int64_t n_experts,
                  int64_t rows, int64_t n, uint8_t *dst);

/* ---- I8 copies (i8.c): expert matrices requantized at load to int8 per row and group of G values,
 * tile-major, for the AMX-INT8 prefill path (layout in i8.c). G: a multiple of 64 that divides n,
 * at most KTK_I8_GMAX; 0 stands for ktk_i8_group(n), the default: the smallest such G >= 256 where
 * that is <= 1024, else the largest below 256 (-1 if n % 64). expert_bytes: one expert's bytes (-1
 * unless rows % 32 == 0, n % 64 == 0 and G fits n). repack: as ktk_r16_repack, from any GGML type
 * with a dequantization. dequant: one expert's copy -> dst [rows, n] f32 (the values the tiles
 * multiply). */
#define KTK_I8_GMAX 1024
int ktk_amx_int8_usable(void);
/* whether the AVX-512 path here has AVX512-BF16 (vdpbf16ps); and whether its BF16 experts' grouped (prefill) work
 * runs on bf16 dot products of the packed tokens (moe.c) rather than f32 panels: $KTINJECT_AVX512_BF16_GROUPED=1 / 0,
 * unset: on AMD CPUs only (Zen 4: 2.18x the f32 panels; the lent Sapphire Rapids-class Xeon: 1.09-1.28x slower) */
int ktk_avx512bf16_usable(void);
int ktk_avx512bf16_grouped(void);
int64_t ktk_i8_group(int64_t n);
int64_t ktk_i8_expert_bytes(int64_t rows, int64_t n, int64_t G);
int ktk_i8_repack(ktk_pool *p, int type, const uint8_t *src, int64_t src_rb, int64_t src_es, int64_t n_experts,
                  int64_t rows, int64_t n, int64_t G, uint8_t *dst);
int ktk_i8_dequant(const uint8_t *w, int64_t rows, int64_t n, int64_t G, float *dst);
/* I4 copies: the same shape rules, 4 bits a weight, symmetric, with an integer sub-scale per 64 values under a
 * scale per row and group (layout in i8.c; default group ktk_i4_group(n): the longest up to KTK_I8_GMAX that
 * divides n), for the same tiles (AMX-INT8, the nibbles widened to bytes in L1). */
int64_t ktk_i4_group(int64_t n);
int64_t ktk_ix_group(int64_t n, int bits);   /* the default group of the width: bits 4 or 8 */
int64_t ktk_i4_expert_bytes(int64_t rows, int64_t n, int64_t G);
int ktk_i4_repack(ktk_pool *p, int type, const uint8_t *src, int64_t src_rb, int64_t src_es, int64_t n_experts,
                  int64_t rows, int64_t n, int64_t G, uint8_t *dst);
int ktk_i4_dequant(const uint8_t *w, int64_t rows, int64_t n, int64_t G, float *dst);

/* ---- stream-ordered jobs (hostjob.c): host functions of a CUDA stream, see that file ----
 * `ktk_host_submit(job)` posts the layer to the pool and returns; `ktk_host_sync(job)` waits.
 * They never fail loudly (they run on the driver's callback thread): a failed job zeroes `out`,
 * sets `status`, and the first failure is kept for ktk_host_error, which also gives the failed
 * job's address through `job` (when not NULL; clear = 1 resets both). */
typedef struct {
    ktk_moe *moe;
    ktk_pool *pool;
    int isa;
    int64_t T, k, hidden;
    const float *x;                       /* [T, hidden] */
    const int64_t *ids;                   /* [T, k] */
    const float *w;                       /* [T, k] */
    float *out;                           /* [T, hidden] */
    int status;                           /* KTK_OK or the failed step's code */
} ktk_host_job;
void ktk_host_submit(void *job);
void ktk_host_sync(void *job);
int ktk_host_error(int clear, void **job);

/* ---- doorbells (hostjob.c): the same jobs rung by the GPU through flags in page-locked memory
 * (cuStreamWriteValue32 / cuStreamWaitValue32) instead of host functions. flags[0] is `go` (set
 * by the GPU, cleared by the dispatcher thread), flags[16] is `done` (set by the dispatcher after
 * the job, cleared by the GPU). ktk_bell_poll runs the armed jobs whose `go` is set (the thread's
 * loop; tests call it too); ktk_bell_rings counts the jobs run so; ktk_bell_thread says whether
 * the dispatcher runs. */
int ktk_bell_add(ktk_host_job *job, uint32_t *flags);
int ktk_bell_remove(ktk_host_job *job);
int ktk_bell_poll(void);
long ktk_bell_rings(void);
int ktk_bell_thread(void);

/* ---- pool trace (KTINJECT_POOL_TRACE=1 at pool creation): sums since the last read, then reset.
 * out[0] jobs, out[1] us from post to the first worker starting, out[2] us to the last worker
 * starting, out[3] us from post to done, out[4] us the caller spent in wait, out[5..7] us from
 * post to the end of phases 0..2, out[8] the most us any job's last worker started after its
 * post, out[9] the jobs whose last worker started 20 us or more after the post, out[10 + i] how
 * many of those worker i was the last to start. Fills min(n, 10 + threads) values and returns
 * that count (>= 5), or 0 when tracing is off. */
int ktk_pool_trace(ktk_pool *p, double *out, int n);
/* Pin the calling thread to the CPUs of the pool's affinity mask that no worker uses (the
 * threads that drive a GPU then never take a worker's core); returns their count, 0 = none. */
int ktk_pool_pin_outside(ktk_pool *p);
/* Reorder cpus[0 .. n) so that each physical core comes once before any comes twice, per package:
 * stable by (pkg[i], how many CPUs of the same (pkg, core) come before i). pkg and core are read by
 * position in the order given; a negative one (unknown topology) leaves the order as it is. The
 * pool does this to the CPUs of its affinity mask when it has fewer workers than CPUs. */
void ktk_cpu_spread(int n, int *cpus, const int *pkg, const int *core);

/* ---- bandwidth probe: best GB/s over `reps` full reads of `bytes` by every pool thread in each of
 * three patterns (one sequential stream a 4 MiB chunk; four; four with L2 prefetches: probe.c) ----
 * read_gbps allocates, fills and frees its buffer each call; a ktk_probe keeps one (`bytes`
 * rounded down to 4 MiB chunks, at least one; filled by the workers at creation) for repeated
 * passes, so the bench can measure the bandwidth beside each of its measurements. new: NULL when
 * the memory is not there or the arguments are bad; pass: -1 on bad arguments. */
double ktk_probe_read_gbps(ktk_pool *p, int isa, size_t bytes, int reps);
typedef struct ktk_probe ktk_probe;
ktk_probe *ktk_probe_new(ktk_pool *p, size_t bytes);
void ktk_probe_free(ktk_probe *pr);
size_t ktk_probe_bytes(const ktk_probe *pr);
double ktk_probe_pass(ktk_probe *pr, ktk_pool *p, int isa, int reps);
/* ---- tile-unit probe (AMX): us per 32 x 48 x 2048 bf16 tile GEMM, hot, for n items run by the
 * pool's workers (one each when n = threads) into us[0 .. n). KTK_OK, KTK_EINVAL, KTK_EISA (no
 * usable AMX), KTK_ENOMEM. */
int ktk_probe_amx_gemm(ktk_pool *p, double *us, int n);

/* ---- K-quant quantizers (kquant.c): n super-blocks of 256 floats -> Q4_K / Q5_K / Q6_K blocks
 * (type KTK_Q4_K, KTK_Q5_K or KTK_Q6_K; out holds n * 144 / 176 / 210 bytes). KTK_OK, KTK_EINVAL,
 * or KTK_ERANGE for a NaN / Inf value or a scale past fp16's range (blocks before it are written). */
int ktk_quantize_k(int type, const float *x, int64_t n, uint8_t *out);
/* n blocks of 32 floats -> KTK_Q4_0 / KTK_Q5_0 / KTK_Q8_0 blocks (18 / 22 / 34 bytes), the bytes the
 * gguf package's numpy quantizers write; errors as ktk_quantize_k. */
int ktk_quantize_legacy(int type, const float *x, int64_t n, uint8_t *out);

#endif
