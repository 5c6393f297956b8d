/* ffi.c — kiln_jit (API.md §5): stages a C function of a natural signature.
 * A libffi closure of fn's own type collects the tensor arguments and calls
 * the one kiln_function behind it, with the static arguments' values as
 * part of the trace key (function_call_keyed); its body calls fn back
 * through ffi_call with the symbolic tensors and those values. */
#include <dlfcn.h>
#include <ffi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "runtime.h"
#include "function.h"

/* One static argument's value. Zeroed before it is set, so that memcmp
 * compares keys (doubles by bit pattern, pointers by identity). */
typedef union {
  int i;
  int64_t l;
  double d;
  bool b;
  void *p;
} jit_static;

typedef struct jit_obj jit_obj;

struct jit_obj {
  kiln_fnptr fn;
  char ret;
  char *args; /* the argument letters */
  int n_args, n_t, n_o, n_static, n_out;
  ffi_type **atypes;
  ffi_cif cif; /* fn's signature: both the closure's and the call's */
  ffi_closure *closure;
  void *code;
  kiln_function *f; /* its trace cache is keyed by the static values too */
  jit_obj *next;
};

/* Every live closure, to map a code pointer back to its object. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static jit_obj *registry;

static ffi_type *letter_type(char c) {
  switch (c) {
  case 't': case 'o': case 'p': return &ffi_type_pointer;
  case 'i': return &ffi_type_sint;
  case 'l': return &ffi_type_sint64;
  case 'd': return &ffi_type_double;
  case 'b': return &ffi_type_uint8;
  case 'v': return &ffi_type_void;
  default: return NULL;
  }
}

static void read_static(char c, void *arg, jit_static *v) {
  memset(v, 0, sizeof *v);
  switch (c) {
  case 'i': v->i = *(int *)arg; break;
  case 'l': v->l = *(int64_t *)arg; break;
  case 'd': v->d = *(double *)arg; break;
  case 'b': v->b = *(bool *)arg; break;
  default: v->p = *(void **)arg; break;
  }
}

/* The staged body: fn itself, with symbolic tensors and the call's statics. */
static int jit_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  jit_obj *j = user;
  (void)n_in;
  (void)n_out;
  size_t len = 0;
  const jit_static *vals = j->n_static ? function_body_key(j->f, &len) : NULL;
  if (j->n_static && (!vals || len != (size_t)j->n_static * sizeof *vals))
    return kiln_set_error("jit: @%s takes static arguments: call it through the pointer kiln_jit returned, "
                          "which passes their values", j->f->name);
  void **argv = calloc((size_t)j->n_args + 1, sizeof *argv);
  kiln_tensor **slots = calloc((size_t)j->n_o + 1, sizeof *slots);
  kiln_tensor ***pslots = calloc((size_t)j->n_o + 1, sizeof *pslots);
  if (!argv || !slots || !pslots) {
    free(argv);
    free(slots);
    free(pslots);
    return kiln_set_error("jit: out of memory");
  }
  int t = 0, o = 0, s = 0;
  for (int a = 0; a < j->n_args; a++) {
    char c = j->args[a];
    if (c == 't') {
      argv[a] = (void *)&in[t++];
    } else if (c == 'o') {
      pslots[o] = &slots[o];
      argv[a] = &pslots[o++];
    } else {
      argv[a] = (void *)&vals[s++];
    }
  }
  union {
    ffi_arg a;
    void *p;
  } r;
  memset(&r, 0, sizeof r);
  ffi_call(&j->cif, FFI_FN(j->fn), &r, argv);
  int rc = 0, k = 0;
  if (j->ret == 't') {
    out[k++] = r.p;
    if (!r.p) rc = kiln_has_error() ? -1 : kiln_set_error("jit: the function returned NULL without an error");
  } else if (j->ret == 'i' && (int)(ffi_sarg)r.a != 0) {
    rc = kiln_has_error() ? -1 : kiln_set_error("jit: the function returned %d without an error", (int)(ffi_sarg)r.a);
  }
  for (int i = 0; i < j->n_o; i++) out[k++] = slots[i];
  free(argv);
  free(slots);
  free(pslots);
  return rc;
}

/* The closure: what a call of the jitted pointer runs. */
static void jit_handler(ffi_cif *cif, void *ret, void **args, void *user) {
  jit_obj *j = user;
  (void)cif;
  kiln_tensor **in = calloc((size_t)j->n_t + 1, sizeof *in);
  kiln_tensor **out = calloc((size_t)j->n_out + 1, sizeof *out);
  jit_static *vals = calloc((size_t)j->n_static + 1, sizeof *vals);
  int rc = -1;
  if (!in || !out || !vals) {
    kiln_set_error("jit: out of memory");
  } else {
    int t = 0, s = 0;
    for (int a = 0; a < j->n_args; a++) {
      char c = j->args[a];
      if (c == 't') in[t++] = *(kiln_tensor **)args[a];
      else if (c != 'o') read_static(c, args[a], &vals[s++]);
    }
    rc = j->n_static ? function_call_keyed(j->f, in, out, vals, (size_t)j->n_static * sizeof *vals)
                     : kiln_function_call(j->f, in, out);
  }
  int k = 0;
  if (j->ret == 't') *(void **)ret = rc ? NULL : out[k++];
  else if (j->ret == 'i') *(ffi_arg *)ret = (ffi_arg)(ffi_sarg)rc;
  for (int a = 0; a < j->n_args; a++) {
    if (j->args[a] != 'o') continue;
    kiln_tensor **dst = *(kiln_tensor ***)args[a];
    if (dst) *dst = rc ? NULL : out[k];
    k++;
  }
  free(in);
  free(out);
  free(vals);
}

/* fn's symbol name where the process exports one (errors then say
 * "@newton: ..."), else "jit" */
static const char *fn_name(kiln_fnptr fn) {
  Dl_info info;
  void *p;
  memcpy(&p, &fn, sizeof p);
  if (dladdr(p, &info) && info.dli_sname && info.dli_saddr == p) return info.dli_sname;
  return "jit";
}

static int bad_sig(const char *sig, const char *fmt, int pos, char c) {
  char what[96];
  snprintf(what, sizeof what, fmt, c, pos);
  return kiln_set_error("jit: bad signature '%s': %s", sig, what);
}

/* Checks sig; 0, or -1 with the error naming the offending letter. */
static int parse_sig(const char *sig) {
  for (int i = 0; sig[i]; i++)
    if (sig[i] != ':' && !letter_type(sig[i])) return bad_sig(sig, "unknown letter '%c' at %d", i, sig[i]);
  if (sig[0] == ':') return bad_sig(sig, "missing return type ('%c' at %d)", 0, ':');
  if (!sig[0] || sig[1] != ':')
    return kiln_set_error("jit: bad signature '%s': expected \"R:ARGS\" (missing ':' at 1)", sig);
  if (sig[0] == 'o') return bad_sig(sig, "'%c' at %d cannot be a return type (t, v or i)", 0, 'o');
  if (sig[0] != 't' && sig[0] != 'v' && sig[0] != 'i')
    return bad_sig(sig, "return type '%c' at %d is not supported (t, v or i)", 0, sig[0]);
  for (int i = 2; sig[i]; i++) {
    if (sig[i] == ':') return bad_sig(sig, "a second '%c' at %d", i, ':');
    if (sig[i] == 'v') return bad_sig(sig, "'%c' at %d is only a return type", i, 'v');
  }
  return 0;
}

static void jit_obj_release(void *p) {
  jit_obj *j = p;
  if (j->closure) ffi_closure_free(j->closure);
  free(j->atypes);
  free(j->args);
  free(j);
}

/* The object goes with its function's last hold (a tape may still hold the
 * function: its backward runs the body, whose user is j). */
static void jit_obj_free(jit_obj *j) {
  if (!j) return;
  if (!j->f) return jit_obj_release(j);
  j->f->user_free = jit_obj_release;
  kiln_function_free(j->f);
}

kiln_fnptr kiln_jit(kiln_fnptr fn, const char *sig) {
  if (!fn) {
    kiln_set_error("jit: fn is NULL");
    return NULL;
  }
  if (!sig) {
    kiln_set_error("jit: signature is NULL");
    return NULL;
  }
  if (parse_sig(sig)) return NULL;
  jit_obj *j = calloc(1, sizeof *j);
  if (!j) {
    kiln_set_error("jit: out of memory");
    return NULL;
  }
  j->fn = fn;
  j->ret = sig[0];
  j->n_args = (int)strlen(sig + 2);
  j->args = strdup(sig + 2);
  j->atypes = calloc((size_t)j->n_args + 1, sizeof *j->atypes);
  if (!j->args || !j->atypes) {
    kiln_set_error("jit: out of memory");
    jit_obj_free(j);
    return NULL;
  }
  for (int a = 0; a < j->n_args; a++) {
    char c = j->args[a];
    j->atypes[a] = letter_type(c);
    if (c == 't') j->n_t++;
    else if (c == 'o') j->n_o++;
    else j->n_static++;
  }
  j->n_out = (j->ret == 't') + j->n_o;
  if (ffi_prep_cif(&j->cif, FFI_DEFAULT_ABI, (unsigned)j->n_args, letter_type(j->ret), j->atypes) != FFI_OK) {
    kiln_set_error("jit: libffi cannot describe signature '%s'", sig);
    jit_obj_free(j);
    return NULL;
  }
  j->closure = ffi_closure_alloc(sizeof(ffi_closure), &j->code);
  if (!j->closure || ffi_prep_closure_loc(j->closure, &j->cif, jit_handler, j, j->code) != FFI_OK) {
    kiln_set_error("jit: libffi cannot make a closure for '%s'", sig);
    jit_obj_free(j);
    return NULL;
  }
  int *tpos = calloc((size_t)j->n_t + 1, sizeof *tpos), *spos = calloc((size_t)j->n_static + 1, sizeof *spos);
  char *letters = calloc((size_t)j->n_static + 1, 1);
  int rc = tpos && spos && letters ? 0 : kiln_set_error("jit: out of memory");
  for (int a = 0, t = 0, s = 0; a < j->n_args && !rc; a++) {
    char c = j->args[a];
    if (c == 't') tpos[t++] = a;
    else if (c != 'o') spos[s] = a, letters[s++] = c;
  }
  if (!rc) rc = (j->f = kiln_function_new(fn_name(fn), jit_body, j, j->n_t, j->n_out)) ? 0 : -1;
  if (!rc && j->n_static) rc = function_set_statics(j->f, letters, tpos, spos);
  free(tpos);
  free(spos);
  free(letters);
  if (rc) {
    jit_obj_free(j);
    return NULL;
  }
  pthread_mutex_lock(&registry_lock);
  j->next = registry;
  registry = j;
  pthread_mutex_unlock(&registry_lock);
  kiln_fnptr code;
  memcpy(&code, &j->code, sizeof code);
  return code;
}

/* Unlinks j (remove) or just finds it; caller holds registry_lock. */
static jit_obj *registry_find(kiln_fnptr jitted, bool remove) {
  for (jit_obj **p = &registry; *p; p = &(*p)->next) {
    kiln_fnptr code;
    memcpy(&code, &(*p)->code, sizeof code);
    if (code != jitted) continue;
    jit_obj *j = *p;
    if (remove) *p = j->next;
    return j;
  }
  return NULL;
}

kiln_function *kiln_jit_function(kiln_fnptr jitted) {
  pthread_mutex_lock(&registry_lock);
  jit_obj *j = jitted ? registry_find(jitted, false) : NULL;
  kiln_function *f = j ? j->f : NULL;
  pthread_mutex_unlock(&registry_lock);
  if (!j)
    kiln_set_error("jit_function: %s", jitted ? "the pointer is not from kiln_jit (or was freed)" : "jitted is NULL");
  return f;
}

void kiln_jit_free(kiln_fnptr jitted) {
  if (!jitted) return;
  pthread_mutex_lock(&registry_lock);
  jit_obj *j = registry_find(jitted, true);
  pthread_mutex_unlock(&registry_lock);
  if (!j) {
    kiln_set_error("jit_free: the pointer is not from kiln_jit (or was freed)");
    return;
  }
  jit_obj_free(j);
}
