/* compile.c — the last step of staging (DESIGN.md "Staging", step 3): the
 * optimized IR of a trace becomes native code through the CPU backend, or
 * PTX through the CUDA backend for a trace under a GPU's device scope, and
 * calls run it. The reference interpreter stays the fallback: for IR a
 * backend cannot take, and with KILN_BACKEND=interp. */
#include <stdio.h>
#include <stdlib.h>

#include "jit.h"
#include "cpu/cpu.h"
#include "cuda/cuda_rt.h"
#include "cuda/ptx.h"
#include "mlir/mlir.h"

typedef enum { BACKEND_AUTO, BACKEND_CPU, BACKEND_INTERP } backend_choice;

static backend_choice backend_env(void) {
  const char *env = getenv("KILN_BACKEND");
  if (!env || !*env) return BACKEND_AUTO;
  if (!strcmp(env, "interp")) return BACKEND_INTERP;
  if (!strcmp(env, "cpu")) return BACKEND_CPU;
  return BACKEND_AUTO;
}

static bool log_compile(void) {
  const char *env = getenv("KILN_LOG");
  return env && strstr(env, "compile");
}

/* Puts "who: @name: " before the current error; -1. */
static int rename_error(const char *who, const char *name) {
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", kiln_last_error());
  return kiln_set_error("%s: @%s: %s", who, name, msg);
}

static void dump_stage(traced_fn *fn, const char *name, int trace_no, int step, const char *stage) {
  char *text = cpu_program_text(fn->cpu, stage);
  if (!text) kiln_clear_error();
  jit_dump(name, trace_no, step, stage, text);
  free(text);
}

/* A trace under gpu:N's scope: compiled for that GPU's architecture; where
 * the CUDA backend cannot take it, calls run the interpreter (whose ops
 * are the eager GPU kernels). */
static int compile_gpu(traced_fn *fn, const char *name, int trace_no, int step, backend_choice choice) {
  int gpu = device_current() - 1;
  const char *arch = cuda_arch_of(gpu);
  fn->cuda = cuda_compile(fn->opt_func, arch);
  if (!fn->cuda) {
    if (choice == BACKEND_CPU) return rename_error("function_call", name); /* compiled code, or an error */
    if (log_compile()) fprintf(stderr, "kiln: compile @%s: interpreted on gpu:%d: %s\n", name, gpu, kiln_last_error());
    kiln_clear_error();
    return 0;
  }
  fn->compile_ms = fn->cuda->compile_ms;
  if (log_compile())
    fprintf(stderr, "kiln: compile @%s: %d kernels for %s (gpu:%d) in %.2f ms\n", name,
            cuda_program_kernels(fn->cuda), arch, gpu, fn->compile_ms);
  if (trace_no >= 0 && getenv("KILN_DUMP")) jit_dump(name, trace_no, step + 2, "ptx", fn->cuda->ptx);
  return 0;
}

int jit_compile(traced_fn *fn, const char *name, int trace_no, int step) {
  backend_choice choice = backend_env();
  if (choice == BACKEND_INTERP) return 0;
  if (device_is_remote(device_current())) return 0; /* the worker compiles its copy (dist_remote.c) */
  if (device_current() != 0) return compile_gpu(fn, name, trace_no, step, choice);
  fn->cpu = cpu_compile(fn->opt_func);
  if (!fn->cpu) {
    if (choice == BACKEND_CPU) return rename_error("function_call", name);
    if (log_compile()) fprintf(stderr, "kiln: compile @%s: interpreted: %s\n", name, kiln_last_error());
    kiln_clear_error();
    return 0;
  }
  fn->compile_ms = cpu_program_compile_ms(fn->cpu);
  if (log_compile())
    fprintf(stderr,
            "kiln: compile @%s: %d kernels in %.2f ms (%d part%s; LLVM passes %.2f, codegen %.2f), arena %zu bytes "
            "(buffers pass %lld), entry at %p\n",
            name, cpu_program_kernels(fn->cpu), fn->compile_ms, cpu_program_parts(fn->cpu),
            cpu_program_parts(fn->cpu) == 1 ? "" : "s on as many threads", fn->cpu->opt_ms, fn->cpu->codegen_ms,
            fn->cpu->arena_bytes, (long long)fn->opt_func->arena_bytes, *(void **)&fn->cpu->entry);
  if (trace_no >= 0 && getenv("KILN_DUMP")) {
    dump_stage(fn, name, trace_no, step, "llvm");
    dump_stage(fn, name, trace_no, step + 1, "asm");
    char *ptx = jit_stage_text(fn, name, "ptx"); /* for inspection, as kiln_function_ir gives it */
    if (ptx) jit_dump(name, trace_no, step + 2, "ptx", ptx);
    else kiln_clear_error();
    free(ptx);
  }
  return 0;
}

/* The GPU a GPU trace runs on: the device scope's, else where its first
 * GPU argument lives (a backward pass run outside the scope); the
 * interpreter where that GPU is not of the architecture compiled for. */
static int exec_gpu(const traced_fn *fn, kiln_tensor *const *args, kiln_tensor **res) {
  int dev = device_current();
  for (int i = 0; dev == 0 && i < fn->opt_func->n_params; i++) dev = args[i] ? args[i]->device : 0;
  if (dev == 0 || strcmp(cuda_arch_of(dev - 1), fn->cuda->arch)) return ir_run(fn->opt_func, args, res);
  return cuda_program_run(fn->cuda, dev - 1, args, res);
}

int jit_exec(const traced_fn *fn, kiln_tensor *const *args, kiln_tensor **res) {
  return jit_exec_donating(fn, args, res, NULL);
}

/* A call that failed while running reads the same compiled and
 * interpreted: "@name: " and the failing op's message (the interpreter's
 * "interpret: @name: %value: " is dropped; its other errors stay). -1. */
static int run_error(const traced_fn *fn) {
  const char *name = fn->opt_func->name, *m = kiln_last_error();
  char pre[300], msg[1024];
  int n = snprintf(pre, sizeof pre, "interpret: @%s: %%", name);
  if (n > 0 && (size_t)n < sizeof pre && !strncmp(m, pre, (size_t)n)) {
    const char *c = strstr(m + n, ": ");
    if (c) m = c + 2;
  } else if (!strncmp(m, "interpret:", 10) || (m[0] == '@' && !strncmp(m + 1, name, strlen(name)))) {
    return -1;
  }
  snprintf(msg, sizeof msg, "%s", m);
  return kiln_set_error("@%s: %s", name, msg);
}

int jit_exec_donating(const traced_fn *fn, kiln_tensor *const *args, kiln_tensor **res, const bool *donate) {
  int rc;
  if (KILN_UNLIKELY(fn->cuda != NULL)) {
    rc = exec_gpu(fn, args, res);
  } else {
    bool host = fn->cpu != NULL;
    for (int i = 0; host && i < fn->opt_func->n_params; i++) host = args[i]->device == 0;
    rc = KILN_LIKELY(host) ? cpu_run_donating(fn->cpu, args, res, donate) : ir_run(fn->opt_func, args, res);
  }
  return KILN_LIKELY(rc == 0) ? 0 : run_error(fn);
}

char *jit_stage_text(traced_fn *fn, const char *name, const char *stage) {
  const char *who = "function_ir";
  if (!strcmp(stage, "ptx")) { /* cross-compiled: no GPU needed */
    const char *arch = getenv("KILN_CUDA_ARCH");
    char *text = cuda_ptx_text(fn->opt_func, arch && *arch ? arch : "sm_80");
    if (!text) rename_error(who, name);
    return text;
  }
  if (!fn->cpu) {
    kiln_set_error("%s: @%s: this trace has no compiled code (interpreted: KILN_BACKEND=interp, a GPU trace, "
                   "or IR the CPU backend cannot take; KILN_LOG=compile says why)",
                   who, name);
    return NULL;
  }
  char *text = cpu_program_text(fn->cpu, stage);
  if (!text) rename_error(who, name);
  return text;
}

char *jit_mlir_text(traced_fn *fn, const char *name) {
  char *text = mlir_emit_func(fn->func);
  if (!text) rename_error("function_ir", name);
  return text;
}
