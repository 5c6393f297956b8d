/* saved_helper.c — the fresh process of tests/saved_test.cc (fork + exec):
 *   saved_helper call DIR OUT NOUT IN...
 *                                     loads the saved function DIR, calls it
 *                                     on the inputs (tensor files: see
 *                                     read_tensor), writes its NOUT outputs
 *                                     to OUT.<k>
 *   saved_helper train OUT STEPS FIRST [--restore CK] [--save CK]
 *                                     trains the small model below with Adam
 *                                     for STEPS steps from step FIRST (each
 *                                     step's data depends on its number);
 *                                     --restore reads the model and the
 *                                     optimizer from CK first, --save writes
 *                                     them after; the model's variables go to
 *                                     OUT (safetensors)
 *   saved_helper save DIR             saves a small MLP with a captured
 *                                     constant to DIR (the fuzz seeds)
 * Exits 0 on success; on failure prints kiln_last_error() and exits 1.
 * Exported (-rdynamic), so a saved host call finds saved_test_double. */
#include <kiln.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the host callback saved_test.cc's functions call: out = 2 * in */
int saved_test_double(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out);
int saved_test_double(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_mul(in[0], kiln_scalar_like(in[0], 2));
  return out[0] ? 0 : -1;
}

static int fail(void) {
  fprintf(stderr, "saved_helper: %s\n", kiln_last_error());
  return 1;
}

/* A tensor file of the tests: int32 dtype, int32 rank, int64 dims, then
 * the row-major bytes (host order). saved_test.cc writes and reads the same. */
static kiln_tensor *read_tensor(const char *path) {
  FILE *f = fopen(path, "rb");
  int32_t head[2];
  int64_t shape[8];
  kiln_tensor *t = NULL;
  if (f && fread(head, sizeof head, 1, f) == 1 && head[1] >= 0 && head[1] <= 8 &&
      fread(shape, sizeof *shape, (size_t)head[1], f) == (size_t)head[1]) {
    int64_t n = 1;
    for (int d = 0; d < head[1]; d++) n *= shape[d];
    size_t bytes = (size_t)n * kiln_dtype_size((kiln_dtype)head[0]);
    void *data = malloc(bytes + 1);
    if (data && fread(data, 1, bytes, f) == bytes) t = kiln_tensor_new((kiln_dtype)head[0], head[1], shape, data);
    free(data);
  }
  if (f) fclose(f);
  if (!t) kiln_fail("saved_helper: %s: cannot read a tensor", path);
  return t;
}

static int write_tensor(const char *path, const kiln_tensor *t) {
  int32_t head[2] = {(int32_t)kiln_tensor_dtype(t), kiln_tensor_rank(t)};
  size_t bytes = (size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t));
  void *data = malloc(bytes + 1);
  FILE *f = fopen(path, "wb");
  int ok = data && f && kiln_tensor_read(t, data, bytes) == 0 && fwrite(head, sizeof head, 1, f) == 1 &&
           fwrite(kiln_tensor_shape(t), sizeof(int64_t), (size_t)head[1], f) == (size_t)head[1] &&
           fwrite(data, 1, bytes, f) == bytes;
  if (f && fclose(f)) ok = 0;
  free(data);
  return ok ? 0 : kiln_fail("saved_helper: %s: cannot write", path);
}

static int call(const char *dir, const char *out, int n_out, int n, char **paths) {
  kiln_function *f = kiln_function_load(dir);
  if (!f) return fail();
  kiln_scope_push();
  kiln_tensor *in[16], *res[16];
  int rc = n > 16 || n_out > 16 || n_out < 1 ? kiln_fail("saved_helper: 1 to 16 inputs and outputs") : 0;
  for (int i = 0; i < n && !rc; i++)
    if (!(in[i] = read_tensor(paths[i]))) rc = -1;
  if (!rc) rc = kiln_function_call(f, in, res);
  for (int k = 0; !rc && k < n_out; k++) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%d", out, k);
    if (write_tensor(path, res[k])) rc = -1;
  }
  kiln_scope_pop();
  kiln_function_free(f);
  return rc ? fail() : 0;
}

static int mlp_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  kiln_variable **v = user;
  kiln_tensor *h = kiln_relu(kiln_add(kiln_matmul(in[0], kiln_variable_read(v[0])), kiln_variable_read(v[1])));
  out[0] = kiln_mul(h, kiln_tensor_new(KILN_F32, 1, (int64_t[]){3}, (float[]){1, 2, 3}));
  return out[0] ? 0 : -1;
}

static int save(const char *dir) {
  kiln_scope_push();
  kiln_variable *v[2] = {kiln_variable_new(kiln_fill(KILN_F32, 2, (int64_t[]){2, 3}, 0.5), "w"),
                         kiln_variable_new(kiln_fill(KILN_F32, 1, (int64_t[]){3}, -0.25), "b")};
  kiln_function *f = kiln_function_new("mlp", mlp_body, v, 1, 1);
  kiln_tensor *x = kiln_ones(KILN_F32, 2, (int64_t[]){4, 2}), *y;
  int rc = f && kiln_function_call(f, &x, &y) == 0 ? kiln_function_save(f, dir) : -1;
  kiln_function_free(f);
  kiln_variable_free(v[0]);
  kiln_variable_free(v[1]);
  kiln_scope_pop();
  return rc ? fail() : 0;
}

/* ---- training ---- */

enum { BATCH = 8, IN = 5, HIDDEN = 7 };

typedef struct {
  kiln_variable *w1, *b1, *w2;
  kiln_optimizer *opt;
} model;

static int train_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  model *m = user;
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *h = kiln_tanh(kiln_add(kiln_matmul(in[0], kiln_variable_read(m->w1)), kiln_variable_read(m->b1)));
  kiln_tensor *pred = kiln_matmul(h, kiln_variable_read(m->w2));
  kiln_tensor *loss = kiln_reduce_mean(kiln_square(kiln_sub(pred, in[1])), 0, NULL, false);
  kiln_tape_end(tape);
  kiln_variable *vars[3] = {m->w1, m->b1, m->w2};
  kiln_tensor *grads[3] = {NULL, NULL, NULL};
  int rc = loss ? kiln_tape_gradient_vars(tape, loss, 3, vars, grads) : -1;
  kiln_tape_free(tape);
  if (!rc) rc = kiln_optimizer_apply(m->opt, 3, vars, grads);
  out[0] = loss;
  return rc;
}

/* step t's batch: a fixed function of t */
static void batch(int t, float *x, float *y) {
  for (int i = 0; i < BATCH * IN; i++) x[i] = (float)((i * 37 + t * 11) % 17) / 8.0f - 1.0f;
  for (int i = 0; i < BATCH; i++) y[i] = (float)((i * 5 + t * 3) % 7) / 3.0f - 1.0f;
}

static int train(const char *out, int steps, int first, const char *restore, const char *save) {
  kiln_random_seed(42);
  kiln_scope_push();
  model m = {kiln_variable_new(kiln_random_normal(KILN_F32, 2, (int64_t[]){IN, HIDDEN}), "w1"),
             kiln_variable_new(kiln_zeros(KILN_F32, 1, (int64_t[]){HIDDEN}), "b1"),
             kiln_variable_new(kiln_random_normal(KILN_F32, 2, (int64_t[]){HIDDEN, 1}), "w2"),
             kiln_adam_new(0.01, 0.9, 0.999, 1e-7)};
  kiln_scope_pop();
  kiln_variable *model_vars[3] = {m.w1, m.b1, m.w2}, *all[16];
  kiln_function *f = kiln_function_new("train_step", train_body, &m, 2, 1);
  int rc = m.w1 && m.b1 && m.w2 && m.opt && f ? 0 : -1;
  if (!rc && restore) rc = kiln_optimizer_build(m.opt, 3, model_vars);
  int n_opt = rc ? -1 : kiln_optimizer_variables(m.opt, 13, all + 3);
  if (n_opt < 0 || n_opt > 13) rc = -1;
  memcpy(all, model_vars, sizeof model_vars);
  if (!rc && restore) rc = kiln_checkpoint_restore(restore, 3 + n_opt, all);
  for (int t = first; t < first + steps && !rc; t++) {
    float x[BATCH * IN], y[BATCH];
    batch(t, x, y);
    kiln_scope_push();
    kiln_tensor *in[2] = {kiln_tensor_new(KILN_F32, 2, (int64_t[]){BATCH, IN}, x),
                          kiln_tensor_new(KILN_F32, 2, (int64_t[]){BATCH, 1}, y)}, *loss;
    rc = kiln_function_call(f, in, &loss);
    kiln_scope_pop();
  }
  if (!rc && save) { /* the slots exist now: list them again */
    n_opt = kiln_optimizer_variables(m.opt, 13, all + 3);
    rc = n_opt < 0 || n_opt > 13 ? -1 : kiln_checkpoint_save(save, 3 + n_opt, all);
  }
  if (!rc) rc = kiln_checkpoint_save(out, 3, model_vars);
  kiln_function_free(f);
  kiln_optimizer_free(m.opt);
  for (int i = 0; i < 3; i++) kiln_variable_free(model_vars[i]);
  return rc ? fail() : 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "save")) return save(argv[2]);
  if (argc >= 5 && !strcmp(argv[1], "call")) return call(argv[2], argv[3], atoi(argv[4]), argc - 5, argv + 5);
  if (argc >= 5 && !strcmp(argv[1], "train")) {
    const char *restore = NULL, *save = NULL;
    for (int i = 5; i + 1 < argc; i += 2) {
      if (!strcmp(argv[i], "--restore")) restore = argv[i + 1];
      if (!strcmp(argv[i], "--save")) save = argv[i + 1];
    }
    return train(argv[2], atoi(argv[3]), atoi(argv[4]), restore, save);
  }
  fprintf(stderr, "usage: saved_helper call DIR OUT NOUT IN... | train OUT STEPS FIRST [--restore CK] [--save CK]\n");
  return 2;
}
