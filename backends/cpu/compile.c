/* compile.c — from an IR function to native code. The plan gives every
 * value a place (parameter, result, arena offset, constant, or the place of
 * the value a view reads) and every instruction a step: a compiled kernel
 * (a group of fusible instructions, one LLVM function with its loops) or a
 * runtime helper (dot, gather, ... through the eager kernels). One entry
 * function runs the steps in order. The module is optimised with O3 and
 * compiled to an object file for the host CPU on the calling thread (or the
 * object file is read from the disk cache, cache.c); one process-wide ORC
 * LLJIT links it into a JITDylib of the program's own. The object code holds
 * no address of this process: constants and the runtime's functions are
 * symbols that each program's JITDylib defines, so it can be cached.
 *
 * The work is shared out by file: backends/plan makes the plan under the
 * CPU's policy (plan.c; donate.c its donations), kernel.c and
 * program.c emit the module, parts.c optimises and compiles it, jit.c links
 * it; this file drives them and keeps the disk cache and the text stages. */
#include <llvm-c/BitReader.h>
#include <llvm-c/Core.h>
#include <llvm-c/Error.h>
#include <llvm-c/LLJIT.h>
#include <llvm-c/Linker.h>
#include <llvm-c/TargetMachine.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu/compile.h"

void cpu_build_free(cpu_build *cb) {
  plan_free(&cb->pl);
  cpu_chains_free(cb->chains);
  free(cb->slot_ptr);
  cpu_reuse_free(&cb->reuse);
  if (cb->eb) LLVMDisposeBuilder(cb->eb);
  llvm_emit_dispose(&cb->e);
  memset(cb, 0, sizeof *cb); /* a second call does nothing */
}

/* ---- the disk cache ---- */

/* What the key holds besides the IR: everything else the code depends on.
 * malloc'd; NULL out of memory. */
static char *cache_meta(const cpu_build *cb, const cpu_options *opt, LLVMOrcLLJITRef jit) {
  unsigned maj, min, pat;
  LLVMGetVersion(&maj, &min, &pat);
  const ir_func *f = cb->f;
  size_t n = 1024 + strlen(cpu_host_cpu()) + strlen(cpu_host_features()) + 4 * (size_t)cb->pl.n_consts;
  n += strlen(LLVMOrcLLJITGetTripleString(jit)) + strlen(LLVMOrcLLJITGetDataLayoutStr(jit));
  char *m = malloc(n);
  if (!m) return NULL;
  int k = snprintf(m, n,
                   "kiln cpu program 2\nllvm %u.%u.%u\ntriple %s\nlayout %s\ncpu %s\nfeatures %s\n%s\n"
                   "contract %d\nparts %d\nscan loops %d %d\nchains %d\narena %lld\nconsts",
                   maj, min, pat, LLVMOrcLLJITGetTripleString(jit), LLVMOrcLLJITGetDataLayoutStr(jit), cpu_host_cpu(),
                   cpu_host_features(), cpu_cache_build_id(), !opt->no_contract, opt->parts, opt->scan_loops, opt->scan_kernels,
                   !opt->no_chains, (long long)(f->buf_offset ? f->arena_bytes : -1));
  for (int i = 0; i < cb->pl.n_consts && k > 0 && (size_t)k < n; i++)
    k += snprintf(m + k, n - (size_t)k, " %u", cpu_const_align(cb->pl.consts[i]));
  if (k <= 0 || (size_t)k >= n) {
    free(m);
    return NULL;
  }
  return m;
}

/* The program's kernel info in an entry: kernels, groups, chains, each
 * group's failing op (int32 each). */
enum { INFO_HEAD = 3 };
static int32_t *kernel_info(const cpu_build *cb, size_t *len) {
  int ng = cb->pl.n_kernels;
  int32_t *v = malloc(((size_t)ng + INFO_HEAD) * sizeof *v);
  if (!v) return NULL;
  v[0] = cb->p->n_kernels;
  v[1] = ng;
  v[2] = cb->p->n_chains;
  for (int g = 0; g < ng; g++) v[INFO_HEAD + g] = (int32_t)cb->p->kernel_fail_op[g];
  *len = ((size_t)ng + INFO_HEAD) * sizeof *v;
  return v;
}

static int take_kernel_info(cpu_program *p, const cpu_build *cb, const void *info, size_t len) {
  int32_t head[INFO_HEAD];
  if (len < sizeof head) return -1;
  memcpy(head, info, sizeof head);
  if (head[1] != cb->pl.n_kernels || head[0] < 0 || head[0] > cb->pl.n_kernels || head[2] < 0 || head[2] > head[0] ||
      len != ((size_t)cb->pl.n_kernels + INFO_HEAD) * sizeof(int32_t))
    return -1;
  p->kernel_fail_op = calloc((size_t)cb->pl.n_kernels + 1, sizeof *p->kernel_fail_op);
  if (!p->kernel_fail_op) return -1;
  for (int g = 0; g < cb->pl.n_kernels; g++) {
    int32_t op;
    memcpy(&op, (const char *)info + (INFO_HEAD + (size_t)g) * sizeof op, sizeof op);
    if (op < 0 || op > OP_COUNT) return -1;
    p->kernel_fail_op[g] = (op_id)op;
  }
  p->n_kernels = head[0];
  p->n_chains = head[2];
  return 0;
}

/* what compiling made, dropped before compiling again */
static void forget_code(cpu_program *p) {
  cpu_jit_forget(p->jit_lib);
  p->jit_lib = NULL;
  p->entry = NULL;
  free(p->kernel_fail_op);
  p->kernel_fail_op = NULL;
  p->n_kernels = 0;
  free(p->bitcode);
  p->bitcode = NULL;
  p->bitcode_len = 0;
}

/* A cache hit: the entry's code linked, its info and bitcode taken. 0, or
 * -1 when the entry does not fit (nothing kept; no error). */
static int load_cached(cpu_program *p, const cpu_build *cb, LLVMOrcLLJITRef jit, const cpu_cache_entry *e) {
  int rc = take_kernel_info(p, cb, e->info, e->info_len);
  if (!rc && !(p->bitcode = malloc(e->bc_len + 1))) rc = -1;
  if (!rc) {
    memcpy(p->bitcode, e->bc, e->bc_len);
    p->bitcode_len = e->bc_len;
    const void *part[2];
    size_t len[2];
    int n = cpu_parts_unpack(e->obj, e->obj_len, 2, part, len);
    LLVMMemoryBufferRef obj[2];
    for (int i = 0; i < n; i++) obj[i] = LLVMCreateMemoryBufferWithMemoryRangeCopy(part[i], len[i], "kiln");
    rc = n < 1 ? -1 : cpu_load_code(p, cb->pl.consts, cb->pl.n_consts, jit, obj, n);
    p->parts = n;
  }
  if (rc) {
    if (cpu_cache_log())
      fprintf(stderr, "kiln: cache: @%s: a cached entry does not load (%s); recompiling\n", p->name,
              kiln_has_error() ? kiln_last_error() : "its kernel info differs");
    kiln_clear_error();
    forget_code(p);
  }
  return rc;
}

cpu_program *cpu_compile(const ir_func *f) { return cpu_compile_with(f, NULL); }

/* ---- the build (also kiln-aot's, aot.c) ---- */

/* opt, or a copy of it in *env with what KILN_CPU_CHAINS=0 asks (no row
 * chains, chain.c, for comparisons) */
static const cpu_options *cpu_options_env(const cpu_options *opt, cpu_options *env) {
  static const cpu_options none = {0};
  if (!opt) opt = &none;
  const char *chains = getenv("KILN_CPU_CHAINS");
  if (chains && !strcmp(chains, "0") && !opt->no_chains) {
    *env = *opt;
    env->no_chains = true;
    opt = env;
  }
  return opt;
}

int cpu_build_start(cpu_build *cb, const ir_func *f, const cpu_options *opt) {
  memset(cb, 0, sizeof *cb);
  if (!f) return kiln_set_error("cpu: no function");
  if (ir_verify(f)) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    return kiln_set_error("cpu: %s", msg);
  }
  cpu_program *p = cb->p = calloc(1, sizeof *p);
  if (!p) return cpu_oom();
  cb->f = f, cb->scan_loops = opt->scan_loops, cb->scan_kernels = opt->scan_kernels, cb->no_chains = opt->no_chains;
  p->name = malloc(strlen(f->name) + 1);
  p->param_types = malloc(((size_t)f->n_params + 1) * sizeof *p->param_types);
  p->result_types = malloc(((size_t)f->n_results + 1) * sizeof *p->result_types);
  if (!p->name || !p->param_types || !p->result_types) return cpu_oom();
  strcpy(p->name, f->name);
  p->n_params = f->n_params;
  p->n_results = f->n_results;
  for (int i = 0; i < f->n_params; i++) p->param_types[i] = f->types[i];
  for (int r = 0; r < f->n_results; r++) p->result_types[r] = f->types[f->results[r]];
  return cpu_plan(cb);
}

int cpu_build_module(cpu_build *cb, const cpu_options *opt, const char *triple, const char *layout,
                     const char *entry_name, LLVMContextRef *ctx_out, LLVMModuleRef *mod_out) {
  LLVMContextRef ctx = LLVMContextCreate(); /* a context of its own: programs compile in parallel */
  LLVMModuleRef mod = LLVMModuleCreateWithNameInContext(cb->f->name, ctx);
  LLVMSetTarget(mod, triple);
  LLVMSetDataLayout(mod, layout);
  cb->x86 = !strncmp(triple, "x86_64", 6);
  llvm_emit_init(&cb->e, ctx, mod);
  cb->e.contract = !opt->no_contract;
  cb->e.const_data = cpu_const_data;
  cb->e.user = cb;
  int rc = cpu_emit_program(cb, entry_name);
  llvm_emit_dispose(&cb->e); /* the builders, before what they built */
  if (cb->eb) LLVMDisposeBuilder(cb->eb);
  cb->eb = NULL;
  if (rc) {
    LLVMDisposeModule(mod);
    LLVMContextDispose(ctx);
    return -1;
  }
  *ctx_out = ctx, *mod_out = mod;
  return 0;
}

/* ---- compiling ---- */

cpu_program *cpu_compile_with(const ir_func *f, const cpu_options *opt) {
  cpu_options env;
  opt = cpu_options_env(opt, &env);
  LLVMOrcLLJITRef jit = f ? cpu_jit_get() : NULL;
  if (f && !jit) return NULL;
  double t0 = cpu_now_ms();
  cpu_build cb;
  char *meta = NULL, dir[4096];
  uint8_t key[16];
  int started = cpu_build_start(&cb, f, opt);
  cpu_program *p = cb.p;
  if (started) goto fail;

  /* the disk cache: the plan is cheap and always made; LLVM is skipped */
  bool cache = cpu_cache_dir(dir, sizeof dir);
  if (cache) cache = (meta = cache_meta(&cb, opt, jit)) && !cpu_cache_key(f, meta, key);
  if (cache) {
    cpu_cache_entry e;
    if (cpu_cache_load(dir, key, meta, &e) == 1 && !load_cached(p, &cb, jit, &e)) p->from_cache = true;
    cpu_cache_entry_free(&e);
    if (p->from_cache) goto done;
  }

  LLVMContextRef ctx;
  LLVMModuleRef mod;
  int erc = cpu_build_module(&cb, opt, LLVMOrcLLJITGetTripleString(jit), LLVMOrcLLJITGetDataLayoutStr(jit),
                             "kiln_entry", &ctx, &mod);
  size_t info_len = 0;
  int32_t *info = !erc && cache ? kernel_info(&cb, &info_len) : NULL;
  LLVMMemoryBufferRef obj[2];
  int n_obj = 0;
  if (!erc) erc = cpu_optimize(p, ctx, mod, cb.pl.n_kernels, cb.max_work, opt->parts, false, obj, &n_obj);
  if (erc) {
    free(info);
    goto fail;
  }
  if (!info) {
    if (cpu_load_code(p, cb.pl.consts, cb.pl.n_consts, jit, obj, n_obj)) goto fail;
  } else { /* cached once it links */
    const void *data[2];
    size_t lens[2], packed_len = 0;
    LLVMMemoryBufferRef copy[2];
    for (int i = 0; i < n_obj; i++) {
      data[i] = LLVMGetBufferStart(obj[i]), lens[i] = LLVMGetBufferSize(obj[i]);
      copy[i] = LLVMCreateMemoryBufferWithMemoryRangeCopy(data[i], lens[i], "kiln");
    }
    void *packed = n_obj > 1 ? cpu_parts_pack(n_obj, data, lens, &packed_len) : NULL;
    int lrc = cpu_load_code(p, cb.pl.consts, cb.pl.n_consts, jit, copy, n_obj);
    cpu_cache_entry e = {.info = info,
                         .info_len = info_len,
                         .obj = n_obj > 1 ? packed : data[0],
                         .obj_len = n_obj > 1 ? packed_len : lens[0],
                         .bc = p->bitcode,
                         .bc_len = p->bitcode_len};
    if (!lrc && (n_obj == 1 || packed)) cpu_cache_store(dir, key, meta, &e);
    free(packed);
    free(info);
    for (int i = 0; i < n_obj; i++) LLVMDisposeMemoryBuffer(obj[i]);
    if (lrc) goto fail;
  }
done:
  p->compile_ms = cpu_now_ms() - t0;
  if (cpu_cache_log() && cache)
    fprintf(stderr, "kiln: cache: @%s: %s, %.1f ms\n", f->name, p->from_cache ? "hit" : "miss", p->compile_ms);
  cpu_build_free(&cb);
  free(meta);
  return p;
fail:
  cpu_build_free(&cb);
  free(meta);
  cpu_program_free(p);
  return NULL;
}

/* The text stages, rebuilt from the optimized module's bitcode. */
char *cpu_program_text(cpu_program *p, const char *stage) {
  if (!p || !stage) {
    kiln_set_error("cpu: no program or stage");
    return NULL;
  }
  bool assembly = !strcmp(stage, "asm");
  if (!assembly && strcmp(stage, "llvm")) {
    kiln_set_error("cpu: unknown stage \"%s\" (llvm, asm)", stage);
    return NULL;
  }
  if (!cpu_jit_get()) return NULL;
  LLVMContextRef ctx = LLVMContextCreate();
  LLVMModuleRef m = NULL;
  char *out = NULL;
  const void *part[2];
  size_t len_of[2];
  int n = cpu_parts_unpack(p->bitcode, p->bitcode_len, 2, part, len_of);
  bool read = n >= 1;
  for (int i = 0; i < n && read; i++) { /* a program compiled in two parts is shown as one module */
    LLVMMemoryBufferRef mb = LLVMCreateMemoryBufferWithMemoryRangeCopy(part[i], len_of[i], "kiln");
    LLVMModuleRef mi = NULL;
    read = !LLVMParseBitcodeInContext2(ctx, mb, &mi);
    LLVMDisposeMemoryBuffer(mb);
    if (read && !m)
      m = mi;
    else if (read)
      read = !LLVMLinkModules2(m, mi); /* takes mi */
  }
  char who[300];
  snprintf(who, sizeof who, "cpu: @%s", p->name);
  if (!read)
    kiln_set_error("%s: cannot read back the module", who);
  else
    out = cpu_module_text(m, assembly, who);
  if (m) LLVMDisposeModule(m);
  LLVMContextDispose(ctx);
  return out;
}

char *cpu_module_text(void *module, bool assembly, const char *who) {
  LLVMModuleRef m = module;
  char *out = NULL, *text = NULL, *msg = NULL;
  LLVMMemoryBufferRef ob = NULL;
  LLVMTargetMachineRef tm = NULL;
  if (!assembly) {
    text = LLVMPrintModuleToString(m);
  } else if (!(tm = cpu_host_machine())) {
    kiln_set_error("%s: %s", who, cpu_jit_error());
  } else if (LLVMTargetMachineEmitToMemoryBuffer(tm, m, LLVMAssemblyFile, &msg, &ob)) {
    kiln_set_error("%s: no assembly: %s", who, msg ? msg : "");
  }
  const char *src = text ? text : ob ? LLVMGetBufferStart(ob) : NULL;
  size_t len = text ? strlen(text) : ob ? LLVMGetBufferSize(ob) : 0;
  if (src && (out = malloc(len + 1))) {
    memcpy(out, src, len);
    out[len] = 0;
  } else if (src) {
    kiln_set_error("%s: out of memory", who);
  }
  if (text) LLVMDisposeMessage(text);
  if (msg) LLVMDisposeMessage(msg);
  if (ob) LLVMDisposeMemoryBuffer(ob);
  if (tm) LLVMDisposeTargetMachine(tm);
  return out;
}
