/* cpu.h — the LLVM CPU backend: compiles a verified IR function into one
 * LLVM module (a function per kernel, one entry function that runs them in
 * order over a per-call arena), JIT-compiles it with ORC LLJIT for the host
 * CPU and runs it. Internal to the library; the entry points are exported
 * for the tests and tools. */
#ifndef KILN_CPU_H
#define KILN_CPU_H

#include "ir.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cpu_program cpu_program;

/* Compiles f (a verified ir_func; the program retains its constants, so f
 * may be freed afterwards) to native code, or loads it from the disk cache
 * (below). NULL with "cpu: ..." in the error. */
KILN_EXPORT cpu_program *cpu_compile(const ir_func *f);
/* How to compile; zero (or NULL) is cpu_compile's choice. */
typedef struct cpu_options {
  bool no_contract; /* no FMA contraction of a fused kernel's multiplies and adds:
                       every op then rounds as its eager kernel does (tests) */
  int parts;        /* the LLVM modules to compile on as many threads: 0 is the
                       backend's choice (two for big programs, with 2+ threads),
                       1 one, 2 two whenever there are two kernels (tests) */
  bool scan_loops;  /* every scan a loop over its body's steps, none one kernel
                       (scan_kernel.c): for comparisons */
  bool scan_kernels; /* every elementwise scan one kernel, however long its
                        rows (scan_kernel.c): for comparisons and tests */
  bool no_chains;    /* no row chains (chain.c): every kernel of its own, for
                        comparisons and tests */
} cpu_options;
KILN_EXPORT cpu_program *cpu_compile_with(const ir_func *f, const cpu_options *opt);
/* Runs it: args one per parameter (concrete CPU tensors of the parameter
 * types); writes one new tensor per result, owned as op results are (the
 * innermost scope, or the caller). 0, or -1 with the error set and results
 * untouched. Thread-safe: many threads may run one program at once. */
KILN_EXPORT int cpu_run(cpu_program *p, kiln_tensor *const *args, kiln_tensor **results);
/* cpu_run, where the caller may give up parameters' buffers: with donate[i]
 * true, the caller holds args[i] and will drop its value after the call
 * (a variable's old value being assigned a new one), so a result of the
 * same type may be written over it in place and be args[i] itself
 * (cpu_program_donor). donate NULL is cpu_run. */
KILN_EXPORT int cpu_run_donating(cpu_program *p, kiln_tensor *const *args, kiln_tensor **results,
                                 const bool *donate);
/* The parameter whose buffer result r may be written over, or -1: r is
 * stored by a kernel that reads that parameter only at the element it
 * writes, no later step reads it or can fail, and no result returns it. */
KILN_EXPORT int cpu_program_donor(const cpu_program *p, int r);
/* The program's optimized LLVM IR ("llvm") or assembly ("asm"); malloc'd,
 * NULL with the error set for another stage. */
KILN_EXPORT char *cpu_program_text(cpu_program *p, const char *stage);
KILN_EXPORT void cpu_program_free(cpu_program *p); /* NULL is fine */
/* Compiled kernels (LLVM functions) in the program. */
KILN_EXPORT int cpu_program_kernels(const cpu_program *p);
/* Of those, the row chains (chain.c: several kernels' code as one). */
KILN_EXPORT int cpu_program_chains(const cpu_program *p);
/* Milliseconds cpu_compile took (emission, optimisation, code generation;
 * on a disk cache hit, reading and linking the cached code). */
KILN_EXPORT double cpu_program_compile_ms(const cpu_program *p);
/* Whether its code came from the disk cache rather than from LLVM.
 *
 * The cache: with KILN_CACHE_DIR (default $XDG_CACHE_HOME/kiln, else
 * ~/.cache/kiln; "" or "off" turns it off), cpu_compile keeps each program's
 * object code in <dir>/<key>.kco, keyed by a hash of the IR (callees
 * included), the options, the LLVM version, the host CPU and its features and
 * the build of the library, so another process compiling the same IR skips
 * LLVM. Corrupt or stale entries are rebuilt; a cache that cannot be written
 * is skipped (KILN_LOG=cache says what it does). */
KILN_EXPORT bool cpu_program_from_cache(const cpu_program *p);
/* The modules its code was compiled as, on as many threads (1 or 2). */
KILN_EXPORT int cpu_program_parts(const cpu_program *p);
/* Steps of the plan that run while a staged collective started before
 * them is in flight (overlap.c; the tests' view of the overlap planned). */
KILN_EXPORT int cpu_program_overlapped(const cpu_program *p);

/* ---- ahead-of-time objects (aot.c), for kiln-aot ---- */
typedef struct cpu_aot_spec {
  const char *name;   /* a C identifier: the object exports int <name>_run(inputs, outputs) */
  const char *triple; /* the object's target triple; NULL: the host's (the CPU is the JIT's: KILN_CPU) */
  int n_in;           /* the function's first parameters, which <name>_run takes */
  const kiln_tensor *const *data; /* the values of the others, embedded in the object */
} cpu_aot_spec;
/* f compiled as a relocatable object that links with libkiln_rt alone
 * (rt/rt.h): *obj (malloc'd, *len bytes), and the arena each call takes.
 * Host calls are refused. 0, or -1 with "cpu: ..." in the error. */
KILN_EXPORT int cpu_aot_object(const ir_func *f, const cpu_aot_spec *spec, void **obj, size_t *len,
                               size_t *arena_bytes);

/* ---- shared by compile.c and run.c ---- */

/* What the generated code passes back to the runtime: the error flag that
 * kernels raise (at offset 0, so the kernels get its address directly) and
 * the program. */
typedef struct cpu_call {
  int32_t err;
  int32_t failed_kernel;
  const cpu_program *prog;
  struct dist_job **jobs; /* per helper: its collective in flight (overlap.c), or NULL */
  kiln_tensor *const *args; /* the call's parameters: a helper's input that is one reads as it */
  const bool *donate;       /* (NULL, or per parameter: written over in place by this call) */
} cpu_call;

/* An op run by a runtime helper: an eager kernel over the raw buffers (dot,
 * gather, scatter_add, concat, argmax, iota, random draws), or a host
 * callback on tensors copied in and out. */
typedef struct cpu_helper {
  op_id op;
  op_attrs attrs;
  int n_in, n_out;
  op_type *in_types, *out_types;
  /* host_call: the callback, copied out of the module */
  kiln_host_fn host_fn;
  void *host_user;
  char *host_name;
  /* a dot with a bias (in[2]) and activation applied as it stores its
   * tiles (a gemm_epilogue of lib/matmul.h; 0 = a plain dot) */
  int epilogue;
  /* a dot whose operands are given as they lay before the transposes the
   * IR had (in[0] is [k, m], in[1] is [n, k]), for matmul_trans: those
   * transposes are never made */
  bool trans_a, trans_b;
} cpu_helper;

/* How each result is produced: written by the entry function into a new
 * tensor, or an argument / constant / earlier result returned again. */
enum { CPU_RES_OWN, CPU_RES_PARAM, CPU_RES_CONST, CPU_RES_SAME };
typedef struct cpu_result {
  int kind;
  int index;        /* parameter or earlier result */
  kiln_tensor *cst; /* CPU_RES_CONST (retained by the program) */
} cpu_result;

struct cpu_program {
  char *name;
  int n_params, n_results;
  op_type *param_types, *result_types;
  cpu_result *results;
  kiln_tensor **consts; /* retained: kernels read their data in place */
  int n_consts;
  cpu_helper *helpers;
  int n_helpers;
  op_id *kernel_fail_op; /* per kernel: the op whose check can fail it */
  int *donor;            /* per result: cpu_program_donor */
  int n_kernels;
  int n_chains; /* of n_kernels, row chains */
  int n_overlapped; /* cpu_program_overlapped */
  bool collectives; /* a helper is a collective: calls keep a job slot per helper (run.c) */
  size_t arena_bytes;
  size_t arena_unpacked_bytes; /* plan.arena_unpacked: before slots shared bytes by liveness */
  /* the arena of a finished call, kept for the next (taken and put back
   * with __atomic builtins; concurrent calls allocate their own), and its
   * allocator class: a big step faults no fresh pages in at every call */
  void *spare_arena;
  int32_t arena_cls;
  int (*entry)(void **params, void **results, void *arena, cpu_call *call);
  void *jit_lib;  /* the ORC JITDylib holding its code and its symbols */
  char *bitcode;  /* the optimized module, for cpu_program_text */
  size_t bitcode_len;
  double compile_ms;
  double opt_ms, codegen_ms; /* of compile_ms: LLVM's pass pipeline, and code generation */
  bool from_cache; /* its code was read from the disk cache */
  int parts;       /* cpu_program_parts */
};

/* The runtime helpers the generated code calls (run.c). */
int cpu_rt_helper(cpu_call *call, int32_t helper, void **bufs);
void cpu_rt_kernel_fail(cpu_call *call, int32_t kernel);
/* Drops a program's code from the JIT (jit.c). */
void cpu_jit_forget(void *lib);
/* For gemm.c (jit.c): a new target machine for the host CPU (an
 * LLVMTargetMachineRef the caller disposes), and object code linked into a
 * JITDylib of its own, which stays for the life of the process: the address
 * of symbol name. NULL / 0 with the error set. */
void *cpu_jit_host_machine(void);
/* Whether the JIT's target CPU (the host's, or KILN_CPU's) has an LLVM
 * feature ("avx2", "fma", "avx512f"); false without a JIT. */
bool cpu_jit_target_has(const char *feature);
/* An LLVMModuleRef as LLVM IR text or, with assembly, the host's assembly
 * (the text stages of programs and of gemm.c's kernels): malloc'd; NULL
 * with "<who>: ..." in the error. */
char *cpu_module_text(void *module, bool assembly, const char *who);
uintptr_t cpu_jit_link(const void *obj, size_t len, const char *name);

/* The disk cache (cache.c). An entry's parts; on a load they point into
 * file, which cpu_cache_entry_free frees. */
typedef struct cpu_cache_entry {
  const void *info; /* the program's kernel info (compile.c's layout) */
  size_t info_len;
  const void *obj; /* object code */
  size_t obj_len;
  const void *bc; /* the optimized module's bitcode */
  size_t bc_len;
  void *file;
} cpu_cache_entry;
/* Several buffers as one: a program compiled in parts keeps its objects, and
 * their bitcode, this way. "KILNPRT1", a uint32 count, then per part a
 * uint64 length and the bytes. A buffer without the tag is a single part.
 * pack: malloc'd, NULL out of memory; unpack: the count (at most max), or -1
 * for a malformed buffer. */
KILN_EXPORT void *cpu_parts_pack(int n, const void *const *data, const size_t *len, size_t *out_len);
KILN_EXPORT int cpu_parts_unpack(const void *buf, size_t len, int max, const void **data, size_t *lens);
/* The cache directory into buf (created, 0700, if missing); false when the
 * cache is off, or the directory may not hold code we run: not this user's,
 * or writable by others (said once on stderr), or it cannot be made. */
KILN_EXPORT bool cpu_cache_dir(char *buf, size_t n);
/* KILN_LOG names "cache". */
bool cpu_cache_log(void);
/* Identifies the build of this library (a line of text). */
const char *cpu_cache_build_id(void);
/* A strong 128-bit hash (MurmurHash3 x64-128). */
void cpu_hash128(const void *data, size_t len, uint8_t out[16]);
/* The key of f (printed with every function it calls) under meta, the
 * text of everything else the code depends on. 0, or -1 out of memory. */
int cpu_cache_key(const ir_func *f, const char *meta, uint8_t key[16]);
/* 1: a valid entry for key and meta, in e; 0: none; -1: a corrupt or stale
 * one (to be rebuilt). Never an error. */
KILN_EXPORT int cpu_cache_load(const char *dir, const uint8_t key[16], const char *meta, cpu_cache_entry *e);
KILN_EXPORT void cpu_cache_entry_free(cpu_cache_entry *e);
/* Writes an entry atomically (a temporary file, 0600, renamed into place),
 * creating dir as needed; an entry over the bound (below) is not stored. 0,
 * or -1 when it could not (never an error). Trims dir when the bytes it
 * stored pass the bound or a tenth of it since the last scan (amortized
 * O(1) per store). */
KILN_EXPORT int cpu_cache_store(const char *dir, const uint8_t key[16], const char *meta, const cpu_cache_entry *e);
/* Deletes the least recently used entries of dir until they total at most
 * 90% of limit bytes (when they exceed limit), and temporary files older
 * than an hour. Returns the bytes of the entries left. */
KILN_EXPORT int64_t cpu_cache_trim(const char *dir, int64_t limit);
/* KILN_CACHE_MAX_MB in bytes: default 1024 MB; a value that is not a
 * positive number is said once on stderr and the default is used; one over
 * 2^40 MB (inf, 1e13) is said once and clamped. An entry holds at most the
 * smaller of this and 256 MB. */
KILN_EXPORT int64_t cpu_cache_limit_bytes(void);

#ifdef __cplusplus
}
#endif
#endif
