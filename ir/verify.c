/* verify.c — checks that a function is well formed: every value defined
 * once and before its uses, every instruction valid for the op table
 * (arity, dtypes, attributes) with the type its rule infers, valid results.
 * Passes run it after each step; the parser runs it on what it reads. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ir_internal.h"

static int bad(const ir_func *f, ir_value v, const char *fmt, ...) KILN_PRINTF(3, 4);

/* "verify: @f: %3: reason"; the arguments may point into the error buffer */
static int bad(const ir_func *f, ir_value v, const char *fmt, ...) {
  char label[160], msg[1024];
  if (v >= 0)
    ir_value_label(f, v, label, sizeof label);
  else
    snprintf(label, sizeof label, "signature");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return kiln_set_error("verify: @%s: %s: %s", f->name ? f->name : "?", label, msg);
}

static int cmp_names(const void *a, const void *b) {
  const char *x = *(const char *const *)a, *y = *(const char *const *)b;
  return strcmp(x, y);
}

static int verify_names(const ir_func *f) {
  const char **names = malloc(((size_t)f->n_values + 1) * sizeof *names);
  if (!names) return kiln_set_error("verify: out of memory");
  int n = 0, rc = 0;
  for (int v = 0; v < f->n_values && !rc; v++) {
    if (!f->names[v]) continue;
    if (!ir_ident_ok(f->names[v])) rc = bad(f, v, "'%s' is not a valid value name", f->names[v]);
    names[n++] = f->names[v];
  }
  if (!rc) qsort(names, (size_t)n, sizeof *names, cmp_names);
  for (int i = 1; i < n && !rc; i++)
    if (!strcmp(names[i - 1], names[i]))
      rc = kiln_set_error("verify: @%s: %%%s: defined more than once", f->name, names[i]);
  free(names);
  return rc;
}

/* Does g (transitively) call f? Call chains deeper than 64 count as
 * recursion: the interpreter recurses once per level. */
static bool calls_back(const ir_func *g, const ir_func *f, int depth) {
  if (g == f || depth > 64) return true;
  for (int i = 0; i < g->n_instrs; i++) {
    const ir_instr *in = &g->instrs[i];
    if ((unsigned)in->op >= OP_COUNT) continue;
    op_kind k = kiln_ops[in->op].kind;
    if ((k == OPK_CALL || k == OPK_CONTROL) && in->attrs.callee && calls_back(in->attrs.callee, f, depth + 1))
      return true;
    if (k == OPK_CONTROL && in->attrs.callee2 && calls_back(in->attrs.callee2, f, depth + 1)) return true;
  }
  return false;
}

int ir_verify(const ir_func *f) {
  char t1[256], t2[256];
  if (!f || !f->name || !*f->name) return kiln_set_error("verify: function without a name");
  if (f->n_params < 0 || f->n_params > f->n_values || f->n_instrs < 0 || f->n_results < 0)
    return bad(f, -1, "%s", "inconsistent counts of parameters, values and instructions");
  for (int v = 0; v < f->n_values; v++) {
    if (ir_type_check("type", &f->types[v])) return bad(f, v, "bad type: %s", kiln_last_error());
    if (v < f->n_params ? f->def[v] != -1
                        : f->def[v] < 0 || f->def[v] >= f->n_instrs || v < f->instrs[f->def[v]].out ||
                              v >= f->instrs[f->def[v]].out + f->instrs[f->def[v]].n_out)
      return bad(f, v, "%s", v < f->n_params ? "a parameter with a defining instruction" : "has no defining instruction");
  }
  if (verify_names(f)) return -1;

  op_type small[4], *types = small;
  int cap = 4, rc = 0;
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *in = &f->instrs[i];
    ir_value out = in->out;
    bool outs_ok = in->n_out >= 1 && out >= f->n_params && out + in->n_out <= f->n_values;
    for (int k = 0; outs_ok && k < in->n_out; k++) outs_ok = f->def[out + k] == i;
    if (!outs_ok) {
      rc = bad(f, -1, "instruction %d has invalid results (%d, %d of them)", i, (int)out, in->n_out);
      break;
    }
    if ((unsigned)in->op >= OP_COUNT) {
      rc = bad(f, out, "%s", "invalid op");
      break;
    }
    if (in->n_in < 0 || (in->n_in > 0 && !in->in)) {
      rc = bad(f, out, "%s", "bad input list");
      break;
    }
    if (in->n_in > cap) {
      if (types != small) free(types);
      cap = in->n_in;
      if (!(types = malloc((size_t)cap * sizeof *types))) {
        types = small;
        cap = 4;
        rc = kiln_set_error("verify: out of memory");
        break;
      }
    }
    for (int k = 0; k < in->n_in && !rc; k++) {
      ir_value x = in->in[k];
      if (x < 0 || x >= f->n_values) {
        rc = bad(f, out, "input %d (%d) is not a value", k, (int)x);
      } else if (x >= f->n_params && f->def[x] >= i) {
        char l[160];
        rc = bad(f, out, "input %d (%s) is used before its definition", k, ir_value_label(f, x, l, sizeof l));
      } else {
        types[k] = f->types[x];
      }
    }
    if (rc) break;
    if (in->op != OP_CONSTANT && in->attrs.value) {
      rc = bad(f, out, "%s", "only constants hold a value");
      break;
    }
    op_kind kind = kiln_ops[in->op].kind;
    bool control = kind == OPK_CONTROL;
    if ((kind != OPK_CALL && !control && in->attrs.callee) || (!control && in->attrs.callee2) ||
        (kind != OPK_HOST && in->attrs.host)) {
      rc = bad(f, out, "%s", "only calls and control flow hold a callee and host calls a callback");
      break;
    }
    const ir_func *rg[2];
    int nr = ir_regions(in, rg);
    for (int k = 0; k < nr && !rc; k++)
      if (rg[k] && !rg[k]->region) rc = bad(f, out, "@%s is not marked as a region", rg[k]->name);
    if (rc) break;
    if ((kind == OPK_CALL || control) && in->attrs.callee && calls_back(in->attrs.callee, f, 0)) {
      rc = bad(f, out, "@%s calls @%s back (recursion)", in->attrs.callee->name, f->name);
      break;
    }
    if (control && in->attrs.callee2 && calls_back(in->attrs.callee2, f, 0)) {
      rc = bad(f, out, "@%s calls @%s back (recursion)", in->attrs.callee2->name, f->name);
      break;
    }
    if (kind == OPK_CALL && in->attrs.callee && in->attrs.callee->region) {
      rc = bad(f, out, "@%s is a region, not a function to call", in->attrs.callee->name);
      break;
    }
    op_type *t = NULL;
    int n_out = 0;
    if (ir_check_instr(f->module, in->op, &in->attrs, in->n_in, types, &n_out, &t)) {
      rc = bad(f, out, "%s", kiln_last_error());
      break;
    }
    if (n_out != in->n_out)
      rc = bad(f, out, "%d results, but %s gives %d", in->n_out, kiln_ops[in->op].name, n_out);
    for (int k = 0; k < n_out && !rc; k++)
      if (!ir_type_eq(&t[k], &f->types[out + k]))
        rc = bad(f, out + k, "type %s, but %s infers %s", ir_type_str(t1, sizeof t1, &f->types[out + k]),
                 kiln_ops[in->op].name, ir_type_str(t2, sizeof t2, &t[k]));
    free(t);
  }
  if (types != small) free(types);
  if (rc) return -1;
  if (f->n_results > 0 && !f->results) return bad(f, -1, "%s", "results missing");
  for (int r = 0; r < f->n_results; r++) {
    if (f->results[r] < 0 || f->results[r] >= f->n_values) {
      return bad(f, -1, "result %d (%d) is not a value", r, (int)f->results[r]);
    }
  }
  return 0;
}

/* How many control-flow instructions of m hold region g. */
static int region_uses(const ir_module *m, const ir_func *g) {
  int n = 0;
  for (int i = 0; i < m->n_funcs; i++)
    for (int j = 0; j < m->funcs[i]->n_instrs; j++) {
      const ir_func *rg[2];
      int nr = ir_regions(&m->funcs[i]->instrs[j], rg);
      for (int k = 0; k < nr; k++) n += rg[k] == g;
    }
  return n;
}

int ir_verify_module(const ir_module *m) {
  if (!m) return kiln_set_error("verify: no module");
  for (int i = 0; i < m->n_funcs; i++) {
    if (ir_verify(m->funcs[i])) return -1;
    for (int j = 0; j < i; j++)
      if (!strcmp(m->funcs[i]->name, m->funcs[j]->name))
        return kiln_set_error("verify: @%s: defined more than once", m->funcs[i]->name);
    int uses = m->funcs[i]->region ? region_uses(m, m->funcs[i]) : 0; /* 0: left over by a pass */
    if (uses > 1)
      return kiln_set_error("verify: @%s: a region must belong to one instruction, it belongs to %d",
                            m->funcs[i]->name, uses);
  }
  return 0;
}
