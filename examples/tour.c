/* tour.c — a first walk through Kiln: tensors, broadcasting, reductions,
 * matmul, a composite op, random numbers, errors as values, scopes that
 * keep it all leak-free, gradients and staged functions. Run it with
 * ./scripts/tour.sh; read it top to bottom. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Prints "label: <tensor>", or the error if t is NULL. Returns 0 / -1. */
static int show(const char *label, kiln_tensor *t) {
  printf("  %-22s ", label);
  if (!t) {
    printf("(failed: %s)\n", kiln_last_error());
    return -1;
  }
  return kiln_tensor_print(t, stdout);
}

static void heading(const char *title) { printf("\n== %s ==\n", title); }

/* 1. Tensors: made from C arrays or by constructors, printed as NumPy does. */
static int tour_tensors(void) {
  heading("tensors");
  printf("  kiln %s, devices:", kiln_version());
  for (int i = 0; i < kiln_device_count(); i++) printf(" %s", kiln_device_name(i));
  printf("\n");

  kiln_tensor *a = kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 3), (float[]){1, 2, 3, 4, 5, 6});
  kiln_tensor *r = kiln_reshape(kiln_arange(KILN_I64, 6), KILN_SHAPE(3, -1));
  int rc = 0;
  rc |= show("a", a);
  rc |= show("arange(6) as (3, -1)", r);
  rc |= show("eye(3)", kiln_eye(KILN_F64, 3));
  rc |= show("cast(a, i32)", kiln_cast(a, KILN_I32));
  printf("  a has rank %d, shape (%lld, %lld), %lld elements, dtype %s, on %s\n",
         kiln_tensor_rank(a), (long long)kiln_tensor_shape(a)[0],
         (long long)kiln_tensor_shape(a)[1], (long long)kiln_tensor_size(a),
         kiln_dtype_name(kiln_tensor_dtype(a)), kiln_tensor_device(a));
  return rc;
}

/* 2. Broadcasting follows NumPy: shapes align on the right, 1s stretch. */
static int tour_broadcasting(void) {
  heading("broadcasting");
  kiln_tensor *a = kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 3), (float[]){1, 2, 3, 4, 5, 6});
  kiln_tensor *row = kiln_tensor_new(KILN_F32, KILN_SHAPE(3), (float[]){10, 20, 30});
  kiln_tensor *col = kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 1), (float[]){100, 200});
  int rc = 0;
  rc |= show("a + row  (2,3)+(3,)", kiln_add(a, row));
  rc |= show("a + col  (2,3)+(2,1)", kiln_add(a, col));
  rc |= show("a * 0.5  (scalar)", kiln_mul(a, kiln_scalar(KILN_F32, 0.5)));
  rc |= show("a > 3", kiln_greater(a, kiln_scalar(KILN_F32, 3)));
  return rc;
}

/* 3. Reductions take a list of axes (NULL = all of them). */
static int tour_reductions(void) {
  heading("reductions");
  kiln_tensor *a = kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 3), (float[]){1, 5, 3, 4, 2, 6});
  int rc = 0;
  rc |= show("a", a);
  rc |= show("sum over axis 1", kiln_reduce_sum(a, KILN_AXES(1), false));
  rc |= show("max over axis 0", kiln_reduce_max(a, KILN_AXES(0), true));
  rc |= show("mean of everything", kiln_reduce_mean(a, 0, NULL, false));
  rc |= show("argmax over axis 1", kiln_argmax(a, 1));
  return rc;
}

/* 4. Matmul: rank >= 2; leading dimensions broadcast as a batch. */
static int tour_matmul(void) {
  heading("matmul");
  kiln_tensor *a = kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 3), (float[]){1, 2, 3, 4, 5, 6});
  kiln_tensor *b = kiln_tensor_new(KILN_F32, KILN_SHAPE(3, 2), (float[]){1, 0, 0, 1, 1, 1});
  int rc = 0;
  rc |= show("a @ b", kiln_matmul(a, b));
  rc |= show("a @ transpose(a)", kiln_matmul(a, kiln_transpose(a, 0, NULL)));
  return rc;
}

/* 5. Composites such as softmax are built from the primitive ops. */
static int tour_softmax(void) {
  heading("softmax (a composite)");
  kiln_tensor *logits = kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 3), (float[]){1, 2, 3, 1, 1, 1});
  kiln_tensor *p = kiln_softmax(logits, -1);
  int rc = 0;
  rc |= show("softmax(logits, -1)", p);
  rc |= show("each row sums to", kiln_reduce_sum(p, KILN_AXES(-1), false));
  return rc;
}

/* 6. Random numbers: a counter-based generator; the same seed, the same numbers. */
static int tour_random(void) {
  heading("random numbers");
  kiln_random_seed(42);
  kiln_tensor *n1 = kiln_random_normal(KILN_F32, KILN_SHAPE(2, 3));
  kiln_tensor *dice = kiln_random_uniform(KILN_I32, KILN_SHAPE(8), 1, 7);
  kiln_random_seed(42);
  kiln_tensor *n2 = kiln_random_normal(KILN_F32, KILN_SHAPE(2, 3));
  int rc = 0;
  rc |= show("normal, seed 42", n1);
  rc |= show("eight dice", dice);
  rc |= show("normal, seed 42 again", n2);
  kiln_tensor *same = kiln_reduce_min(kiln_cast(kiln_equal(n1, n2), KILN_I32), 0, NULL, false);
  if (!same) return -1;
  printf("  same numbers again: %s\n", kiln_tensor_item(same) == 1 ? "yes" : "no");
  return rc;
}

/* 7. Errors are values: NULL (or -1) and a message naming the op. A NULL
 * input makes the next op fail too while keeping the first message, so a
 * chain can be checked once at its end. Nothing aborts. */
static int tour_errors(void) {
  heading("errors");
  kiln_tensor *params = kiln_tensor_new(KILN_F32, KILN_SHAPE(3), (float[]){10, 20, 30});
  kiln_tensor *idx = kiln_tensor_new(KILN_I64, KILN_SHAPE(2), (int64_t[]){2, 7});
  kiln_tensor *g = kiln_gather(params, idx, 0);
  printf("  gather index 7 of 3:  %s -> \"%s\"\n", g ? "a tensor?!" : "NULL", kiln_last_error());
  kiln_clear_error();

  kiln_tensor *a = kiln_zeros(KILN_F32, KILN_SHAPE(2, 3));
  kiln_tensor *b = kiln_zeros(KILN_F32, KILN_SHAPE(4));
  kiln_tensor *chain = kiln_exp(kiln_mul(kiln_add(a, b), a));
  printf("  exp((a + b) * a):     %s -> \"%s\"\n", chain ? "a tensor?!" : "NULL", kiln_last_error());
  kiln_clear_error();

  kiln_tensor *c = kiln_add(a, kiln_zeros(KILN_I32, KILN_SHAPE(2, 3)));
  printf("  f32 + i32:            %s -> \"%s\"\n", c ? "a tensor?!" : "NULL", kiln_last_error());
  kiln_clear_error();
  return g || chain || c ? -1 : 0;
}

/* 8. Ownership: main() pushes a scope around each section, so everything
 * above was released at its pop. To keep a tensor past the scope it was made
 * in, escape it to the enclosing scope; kiln_retain gives a reference of your
 * own, which kiln_release ends. */
static int tour_scopes(void) {
  heading("scopes");
  int64_t before = kiln_debug_live_tensors();
  kiln_scope_push();
  kiln_tensor *tmp = kiln_arange(KILN_F32, 3);
  kiln_tensor *kept = kiln_scope_escape(kiln_square(tmp)); /* tmp dies at the pop */
  kiln_scope_pop();
  int rc = show("escaped from a scope", kept);
  printf("  tensors alive: %lld more than before the scope\n",
         (long long)(kiln_debug_live_tensors() - before));
  kiln_tensor *mine = kiln_retain(kept); /* outlives every scope... */
  kiln_release(mine);                    /* ...until released by hand */
  return rc;
}

/* 9. Gradients: a tape records the ops that depend on what it watches, and
 * kiln_tape_gradient walks them backwards. Tapes nest, so an outer tape can
 * differentiate the inner tape's gradient: d2(x^3)/dx2 = 6x = 18 at x = 3.
 * Variables are watched automatically; an optimizer applies the gradients. */
static int tour_gradients(void) {
  heading("gradients");
  kiln_tensor *x = kiln_scalar(KILN_F64, 3.0);
  kiln_tape *outer = kiln_tape_begin(false), *inner = kiln_tape_begin(false);
  kiln_tape_watch(outer, x);
  kiln_tape_watch(inner, x);
  kiln_tensor *y = kiln_mul(kiln_mul(x, x), x); /* x^3 */
  kiln_tape_end(inner);
  kiln_tensor *dy = NULL, *d2y = NULL;
  int rc = kiln_tape_gradient(inner, y, 1, &x, &dy); /* recorded by outer */
  kiln_tape_end(outer);
  rc |= kiln_tape_gradient(outer, dy, 1, &x, &d2y);
  kiln_tape_free(inner);
  kiln_tape_free(outer);
  rc |= show("x^3 at x = 3", y);
  rc |= show("d/dx = 3x^2", dy);
  rc |= show("d2/dx2 = 6x", d2y);

  /* one step of gradient descent on a linear model y = w.x + b */
  kiln_tensor *xs = kiln_tensor_new(KILN_F32, KILN_SHAPE(4, 2), (float[]){1, 0, 0, 1, 1, 1, 2, 1});
  kiln_tensor *ys = kiln_tensor_new(KILN_F32, KILN_SHAPE(4, 1), (float[]){3, 2, 5, 8});
  kiln_variable *w = kiln_variable_new(kiln_zeros(KILN_F32, KILN_SHAPE(2, 1)), "w");
  kiln_variable *b = kiln_variable_new(kiln_zeros(KILN_F32, KILN_SHAPE(1)), "b");
  kiln_optimizer *sgd = kiln_sgd_new(0.05);
  kiln_variable *vars[2] = {w, b};
  for (int step = 0; step < 3 && rc == 0; step++) {
    kiln_scope_push();
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tensor *pred = kiln_add(kiln_matmul(xs, kiln_variable_read(w)), kiln_variable_read(b));
    kiln_tensor *loss = kiln_reduce_mean(kiln_square(kiln_sub(pred, ys)), 0, NULL, false);
    kiln_tape_end(tape);
    kiln_tensor *grads[2];
    rc |= kiln_tape_gradient_vars(tape, loss, 2, vars, grads);
    rc |= kiln_optimizer_apply(sgd, 2, vars, grads);
    printf("  step %d: loss %.4f\n", step, loss ? kiln_tensor_item(loss) : -1.0);
    kiln_tape_free(tape);
    kiln_scope_pop();
  }
  rc |= show("w after 3 steps", kiln_variable_read(w));
  if (rc) printf("  (failed: %s)\n", kiln_last_error());
  kiln_optimizer_free(sgd);
  kiln_variable_free(w);
  kiln_variable_free(b);
  return rc ? -1 : 0;
}

/* 10. Staged functions: the body runs once with symbolic tensors and is
 * recorded as IR; later calls with the same dtypes and shapes reuse it. */
static int scaled_tanh(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_mul(kiln_tanh(in[0]), kiln_scalar_like(in[0], 2));
  return out[0] ? 0 : -1;
}

static int tour_staging(void) {
  heading("staged functions");
  kiln_function *f = kiln_function_new("scaled_tanh", scaled_tanh, NULL, 1, 1);
  if (!f) return show("function_new", NULL);
  kiln_tensor *a = kiln_tensor_new(KILN_F32, KILN_SHAPE(3), (float[]){-1, 0, 1});
  kiln_tensor *b = kiln_tensor_new(KILN_F32, KILN_SHAPE(3), (float[]){2, 3, 4});
  kiln_tensor *ya = NULL, *yb = NULL;
  int rc = 0;
  rc |= kiln_function_call(f, &a, &ya) ? show("call 1", NULL) : show("f([-1, 0, 1])", ya);
  rc |= kiln_function_call(f, &b, &yb) ? show("call 2", NULL) : show("f([2, 3, 4])", yb);
  printf("  traces made: %d (the second call reused the first)\n", kiln_function_trace_count(f));
  char *ir = kiln_function_ir(f, 0, "optimized");
  if (ir)
    printf("  its IR:\n%s", ir);
  else
    rc |= show("function_ir", NULL);
  free(ir);
  /* the IR above became one LLVM module: print its kernel's vector loop */
  char *llvm = kiln_function_ir(f, 0, "llvm");
  if (llvm) {
    printf("  the compiled kernel (LLVM IR, first lines of its body):\n");
    const char *def = strstr(llvm, "\ndefine ");
    int lines = 0;
    for (const char *p = def ? def + 1 : llvm; *p && lines < 12; lines++) {
      const char *nl = strchr(p, '\n');
      int len = nl ? (int)(nl - p) : (int)strlen(p);
      printf("    %.*s\n", len > 110 ? 110 : len, p);
      p = nl ? nl + 1 : p + len;
    }
    printf("    ...\n");
  } else {
    rc |= show("function_ir llvm", NULL);
  }
  free(llvm);
  kiln_stats st;
  if (kiln_function_stats(f, 0, &st) == 0)
    printf("  stats: %d ops traced, %d after the passes, %d kernel(s); trace %.2f ms, passes %.2f ms, "
           "LLVM %.2f ms\n",
           st.traced_ops, st.optimized_ops, st.kernels, st.trace_ms, st.optimize_ms, st.compile_ms);
  kiln_function_free(f);
  return rc ? -1 : 0;
}

/* The cost of one tiny eager op: what staging is for. */
static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

static int fused_chain(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  kiln_tensor *x = in[0];
  kiln_tensor *t = kiln_tanh(kiln_add(kiln_mul(x, kiln_scalar_like(x, 1.5)), kiln_scalar_like(x, 0.5)));
  out[0] = kiln_add(kiln_mul(t, kiln_scalar_like(x, 2)), x);
  return out[0] ? 0 : -1;
}

static int tour_benchmark(void) {
  heading("one benchmark");
  enum { RUNS = 9, ADDS = 1000 };
  kiln_tensor *x = kiln_scalar(KILN_F32, 1), *y = kiln_scalar(KILN_F32, 2);
  if (!x || !y) return -1;
  double ns[RUNS];
  for (int r = -1; r < RUNS; r++) { /* run -1 warms up */
    double t0 = now_ns();
    kiln_scope_push();
    for (int i = 0; i < ADDS; i++) kiln_add(x, y);
    kiln_scope_pop();
    if (r >= 0) ns[r] = (now_ns() - t0) / ADDS;
  }
  qsort(ns, RUNS, sizeof ns[0], cmp_double);
  printf("  eager add of two 1-element f32 tensors: %.0f ns (median of %d runs of %d)\n",
         ns[RUNS / 2], RUNS, ADDS);

  /* a fused chain on 4M floats: op by op (each op a pass over memory) and
   * staged (one compiled kernel), beside a plain C loop over the same data */
  enum { N = 1 << 22, REPS = 5 };
  kiln_tensor *v = kiln_random_uniform(KILN_F32, KILN_SHAPE(N), -1, 1);
  kiln_function *f = kiln_function_new("fused", fused_chain, NULL, 1, 1);
  float *cx = malloc(N * sizeof *cx), *cy = malloc(N * sizeof *cy);
  if (!v || !f || !cx || !cy || kiln_tensor_read(v, cx, N * sizeof *cx)) {
    free(cx), free(cy), kiln_function_free(f);
    return show("fused benchmark", NULL);
  }
  double eager[REPS], staged[REPS], plain[REPS];
  for (int r = -1; r < REPS; r++) {
    kiln_scope_push();
    kiln_tensor *y = NULL;
    double t0 = now_ns();
    fused_chain(NULL, 1, &v, 1, &y);
    double t1 = now_ns();
    kiln_function_call(f, &v, &y);
    double t2 = now_ns();
    for (int i = 0; i < N; i++) cy[i] = cx[i] * 1.5f + 0.5f; /* the same bytes moved, no math */
    double t3 = now_ns();
    kiln_scope_pop();
    if (r >= 0) eager[r] = t1 - t0, staged[r] = t2 - t1, plain[r] = t3 - t2;
  }
  qsort(eager, REPS, sizeof eager[0], cmp_double);
  qsort(staged, REPS, sizeof staged[0], cmp_double);
  qsort(plain, REPS, sizeof plain[0], cmp_double);
  printf("  tanh(x*1.5+0.5)*2+x on %d floats: eager %.2f ms, staged %.2f ms (%.1fx), "
         "a C loop y = 1.5x+0.5 over the same bytes %.2f ms (median of %d)\n",
         N, eager[REPS / 2] / 1e6, staged[REPS / 2] / 1e6, eager[REPS / 2] / staged[REPS / 2], plain[REPS / 2] / 1e6,
         REPS);
  free(cx), free(cy);
  kiln_function_free(f);
  return 0;
}

int main(void) {
  static int (*const sections[])(void) = {
      tour_tensors, tour_broadcasting, tour_reductions, tour_matmul,
      tour_softmax, tour_random,       tour_errors,     tour_scopes,
      tour_gradients, tour_staging,    tour_benchmark,
  };
  int failures = 0;
  for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++) {
    kiln_scope_push(); /* every tensor a section makes is released at the pop */
    if (sections[i]() != 0) failures++;
    kiln_scope_pop();
  }
  long long live = (long long)kiln_debug_live_tensors();
  printf("\n%d section(s) failed; %lld tensors still alive at exit\n", failures, live);
  return failures == 0 && live == 0 ? 0 : 1;
}
