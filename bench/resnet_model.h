/* resnet_model.h — ResNet v1.5 (torchvision's resnet50 with blocks
 * {3, 4, 6, 3} and width 64) in Kiln's public API, for bench_resnet.c and
 * tests/resnet_test.cc: a 7x7/2 stem conv, batch norm, relu and a 3x3/2 max
 * pool; bottleneck blocks (1x1, 3x3 carrying the stage's stride, 1x1 to 4x
 * the planes, batch norm after each conv, a 1x1 projection shortcut with
 * batch norm where the shape changes); global average pooling; a dense
 * layer; sparse softmax cross-entropy. NHWC images, HWIO filters, no conv
 * biases (as torchvision). Batch norm trains on the batch's statistics and
 * updates its running mean and (unbiased) variance with momentum 0.1, as
 * torch.nn.BatchNorm2d does; inference uses the running statistics.
 *
 * The variables are named and ordered as torchvision's state_dict
 * ("conv1.weight", "layer1.0.bn2.running_var", "fc.bias", ...), so the
 * check (resnet_check) can hand them to PyTorch as .npy files.
 *
 * Plain C that also compiles as C++ (the test includes it). */
#ifndef KILN_BENCH_RESNET_MODEL_H
#define KILN_BENCH_RESNET_MODEL_H

#include <kiln.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { RN_MAX_VARS = 512, RN_MAX_CONVS = 128 };

/* one conv of the network, as built: for bench_resnet's breakdown */
typedef struct {
  int64_t k, cin, cout, hw_in, hw_out;
  int stride;
} rn_conv_geo;

typedef struct {
  int blocks[4];    /* bottleneck blocks per stage; a 0 ends the stages */
  int64_t width;    /* stem channels and stage 0's planes (64) */
  int64_t classes;  /* 1000 */
  int64_t image;    /* input height = width (224) */
  kiln_dtype dtype; /* KILN_F32 or KILN_F64 */
  bool random_bn;   /* batch norm scale/offset/running stats random (the check), else 1/0/0/1 */
} resnet_config;

static inline resnet_config resnet50_config(void) {
  resnet_config c;
  memset(&c, 0, sizeof c);
  c.blocks[0] = 3, c.blocks[1] = 4, c.blocks[2] = 6, c.blocks[3] = 3;
  c.width = 64, c.classes = 1000, c.image = 224, c.dtype = KILN_F32;
  return c;
}

typedef struct {
  resnet_config cfg;
  int nvars;
  kiln_variable *vars[RN_MAX_VARS]; /* state_dict order */
  bool trainable[RN_MAX_VARS];      /* weights and biases; not the running statistics */
  int ntrain;
  kiln_variable *train[RN_MAX_VARS]; /* the trainable ones, in order */
  int64_t params;                    /* trainable elements */
  double flops;                      /* forward flops per image: 2 per multiply-add of the convs and the dense layer */
  int nconvs;
  rn_conv_geo convs[RN_MAX_CONVS];   /* in order */
  int64_t relu_elems, add_elems;     /* per image: elements through relu and the residual adds */
} resnet_model;

/* One walk over the architecture: with build set it creates the variables
 * (from init's values when init is given) and counts flops; otherwise it
 * computes, taking the variables in the same order. */
typedef struct {
  resnet_model *m;
  const resnet_model *init;
  bool build;
  int cur;
  bool train;  /* batch statistics (else the running ones) */
  bool update; /* training mode: assign the running statistics */
  int failed;
  int64_t last_elems; /* build: per image, of the last conv's result */
} rn_walk;

static inline kiln_tensor *rn_scaled(kiln_tensor *t, double s) { return kiln_mul(t, kiln_scalar_like(t, s)); }

/* a new variable called name, initialised to value (or to init's variable of the same index) */
static inline void rn_var(rn_walk *w, const char *name, kiln_tensor *value, bool trainable) {
  resnet_model *m = w->m;
  if (m->nvars >= RN_MAX_VARS) {
    kiln_fail("resnet: more than %d variables", (int)RN_MAX_VARS);
    w->failed = 1;
    return;
  }
  if (w->init) value = kiln_variable_read(w->init->vars[m->nvars]);
  kiln_variable *v = value ? kiln_variable_new(value, name) : NULL;
  if (!v) {
    w->failed = 1;
    return;
  }
  m->trainable[m->nvars] = trainable;
  m->vars[m->nvars++] = v;
  if (trainable) {
    m->train[m->ntrain++] = v;
    m->params += kiln_tensor_size(value);
  }
}

static inline kiln_variable *rn_next(rn_walk *w) {
  if (w->cur >= w->m->nvars) {
    kiln_fail("resnet: the model has only %d variables", w->m->nvars);
    w->failed = 1;
    return NULL;
  }
  return w->m->vars[w->cur++];
}

static inline kiln_tensor *rn_read(rn_walk *w) {
  kiln_variable *v = rn_next(w);
  return v ? kiln_variable_read(v) : NULL;
}

/* k x k conv, cin -> cout, padding k / 2 on each side (torchvision's), *hw updated */
static inline kiln_tensor *rn_conv(rn_walk *w, kiln_tensor *h, int64_t k, int64_t cin, int64_t cout, int stride,
                                   int64_t *hw, const char *name) {
  int64_t pad = k / 2, hw_in = *hw, out = (hw_in + 2 * pad - k) / stride + 1;
  *hw = out;
  if (w->build) {
    char full[256];
    snprintf(full, sizeof full, "%s.weight", name);
    /* kaiming_normal_(mode="fan_out", nonlinearity="relu"), as torchvision */
    int64_t shape[4] = {k, k, cin, cout};
    rn_var(w, full, rn_scaled(kiln_random_normal(w->m->cfg.dtype, 4, shape), sqrt(2.0 / (double)(k * k * cout))),
           true);
    w->m->flops += 2.0 * (double)(out * out) * (double)(k * k * cin * cout);
    if (w->m->nconvs < RN_MAX_CONVS) {
      rn_conv_geo g = {k, cin, cout, hw_in, out, stride};
      w->m->convs[w->m->nconvs++] = g;
    }
    w->last_elems = out * out * cout;
    return NULL;
  }
  kiln_conv_opts o;
  memset(&o, 0, sizeof o);
  o.stride[0] = o.stride[1] = stride;
  for (int i = 0; i < 4; i++) o.padding[i] = (int)pad;
  return kiln_conv2d(h, rn_read(w), &o);
}

/* batch norm over the channels of h [n, hw, hw, c] (epsilon 1e-5, momentum 0.1) */
static inline kiln_tensor *rn_bn(rn_walk *w, kiln_tensor *h, int64_t c, const char *name) {
  if (w->build) {
    static const char *const part[4] = {"weight", "bias", "running_mean", "running_var"};
    kiln_dtype dt = w->m->cfg.dtype;
    int64_t shape[1] = {c};
    kiln_tensor *v[4];
    if (w->m->cfg.random_bn) {
      v[0] = kiln_random_uniform(dt, 1, shape, 0.5, 1.5);
      v[1] = rn_scaled(kiln_random_normal(dt, 1, shape), 0.1);
      v[2] = rn_scaled(kiln_random_normal(dt, 1, shape), 0.1);
      v[3] = kiln_random_uniform(dt, 1, shape, 0.5, 1.5);
    } else {
      v[0] = kiln_ones(dt, 1, shape), v[1] = kiln_zeros(dt, 1, shape);
      v[2] = kiln_zeros(dt, 1, shape), v[3] = kiln_ones(dt, 1, shape);
    }
    for (int i = 0; i < 4; i++) {
      char full[256];
      snprintf(full, sizeof full, "%s.%s", name, part[i]);
      rn_var(w, full, v[i], i < 2);
    }
    return NULL;
  }
  kiln_tensor *scale = rn_read(w), *offset = rn_read(w);
  kiln_variable *rm = rn_next(w), *rv = rn_next(w);
  if (!h || !rm || !rv) return NULL;
  if (!w->train) return kiln_batch_norm(h, kiln_variable_read(rm), kiln_variable_read(rv), offset, scale, 1e-5);
  kiln_tensor *mean = NULL, *var = NULL;
  static const int axes[3] = {0, 1, 2};
  if (kiln_moments(h, 3, axes, false, &mean, &var)) return NULL;
  if (w->update) {
    const int64_t *s = kiln_tensor_shape(h);
    double n = (double)(s[0] * s[1] * s[2]);
    kiln_tensor *m_new = kiln_add(rn_scaled(kiln_variable_read(rm), 0.9), rn_scaled(kiln_stop_gradient(mean), 0.1));
    kiln_tensor *v_new = kiln_add(rn_scaled(kiln_variable_read(rv), 0.9),
                                  rn_scaled(kiln_stop_gradient(var), 0.1 * n / (n > 1 ? n - 1 : 1)));
    if (kiln_variable_assign(rm, m_new) || kiln_variable_assign(rv, v_new)) {
      w->failed = 1;
      return NULL;
    }
  }
  return kiln_batch_norm(h, mean, var, offset, scale, 1e-5);
}

static inline kiln_tensor *rn_relu(rn_walk *w, kiln_tensor *h) {
  if (!w->build) return kiln_relu(h);
  w->m->relu_elems += w->last_elems;
  return NULL;
}

/* t handed to the scope around the current one, which then closes: an
 * eager step frees each piece's temporaries as soon as the piece is done,
 * as PyTorch's reference counts do, so the activations it works on stay
 * in the caches (what the tape needs for the gradient it keeps itself).
 * Open with kiln_scope_push(). */
static inline kiln_tensor *rn_keep(kiln_tensor *t) {
  t = kiln_scope_escape(t);
  kiln_scope_pop();
  return t;
}

/* torchvision's Bottleneck: the stride on the 3x3 conv (v1.5) */
static inline kiln_tensor *rn_bottleneck(rn_walk *w, kiln_tensor *h, int64_t cin, int64_t planes, int stride,
                                         int64_t *hw, const char *prefix) {
  char name[160];
  int64_t hw_in = *hw;
  kiln_scope_push(); /* the block's */
  kiln_scope_push();
  snprintf(name, sizeof name, "%s.conv1", prefix);
  kiln_tensor *t = rn_conv(w, h, 1, cin, planes, 1, hw, name);
  snprintf(name, sizeof name, "%s.bn1", prefix);
  t = rn_keep(rn_relu(w, rn_bn(w, t, planes, name)));
  kiln_scope_push();
  snprintf(name, sizeof name, "%s.conv2", prefix);
  t = rn_conv(w, t, 3, planes, planes, stride, hw, name);
  snprintf(name, sizeof name, "%s.bn2", prefix);
  t = rn_keep(rn_relu(w, rn_bn(w, t, planes, name)));
  snprintf(name, sizeof name, "%s.conv3", prefix);
  t = rn_conv(w, t, 1, planes, 4 * planes, 1, hw, name);
  snprintf(name, sizeof name, "%s.bn3", prefix);
  t = rn_bn(w, t, 4 * planes, name);
  kiln_tensor *shortcut = h;
  if (stride != 1 || cin != 4 * planes) {
    snprintf(name, sizeof name, "%s.downsample.0", prefix);
    shortcut = rn_conv(w, h, 1, cin, 4 * planes, stride, &hw_in, name);
    snprintf(name, sizeof name, "%s.downsample.1", prefix);
    shortcut = rn_bn(w, shortcut, 4 * planes, name);
  }
  if (w->build) {
    w->m->add_elems += *hw * *hw * 4 * planes;
    w->m->relu_elems += *hw * *hw * 4 * planes;
    return rn_keep(NULL);
  }
  return rn_keep(kiln_relu(kiln_add(t, shortcut)));
}

/* the logits [n, classes] of x [n, image, image, 3] */
static inline kiln_tensor *rn_walk_net(rn_walk *w, kiln_tensor *x) {
  const resnet_config *c = &w->m->cfg;
  int64_t hw = c->image, ch = c->width;
  kiln_tensor *h = rn_conv(w, x, 7, 3, ch, 2, &hw, "conv1");
  h = rn_relu(w, rn_bn(w, h, ch, "bn1"));
  hw = (hw + 2 - 3) / 2 + 1;
  if (!w->build) {
    static const int window[2] = {3, 3};
    kiln_conv_opts o;
    memset(&o, 0, sizeof o);
    o.stride[0] = o.stride[1] = 2;
    for (int i = 0; i < 4; i++) o.padding[i] = 1;
    h = kiln_max_pool2d(h, window, &o);
  }
  for (int s = 0; s < 4 && c->blocks[s] > 0; s++) {
    int64_t planes = c->width << s;
    for (int b = 0; b < c->blocks[s]; b++) {
      char prefix[64];
      snprintf(prefix, sizeof prefix, "layer%d.%d", s + 1, b);
      h = rn_bottleneck(w, h, ch, planes, s > 0 && b == 0 ? 2 : 1, &hw, prefix);
      ch = 4 * planes;
    }
  }
  if (w->build) {
    double bound = 1 / sqrt((double)ch); /* nn.Linear's default */
    int64_t ws[2] = {ch, c->classes}, bs[1] = {c->classes};
    rn_var(w, "fc.weight", kiln_random_uniform(c->dtype, 2, ws, -bound, bound), true);
    rn_var(w, "fc.bias", kiln_random_uniform(c->dtype, 1, bs, -bound, bound), true);
    w->m->flops += 2.0 * (double)(ch * c->classes);
    return NULL;
  }
  static const int hw_axes[2] = {1, 2};
  h = kiln_reduce_mean(h, 2, hw_axes, false);
  kiln_tensor *wt = rn_read(w), *bias = rn_read(w);
  return kiln_add(kiln_matmul(h, wt), bias);
}

/* A new model (kiln_random_seed first for fixed weights), or one with
 * init's values when init is given (init built from the same cfg). NULL with
 * Kiln's error set on failure. */
static inline resnet_model *resnet_new(const resnet_config *cfg, const resnet_model *init) {
  resnet_model *m = (resnet_model *)calloc(1, sizeof *m);
  if (!m) {
    kiln_fail("resnet: out of memory");
    return NULL;
  }
  m->cfg = *cfg;
  rn_walk w;
  memset(&w, 0, sizeof w);
  w.m = m, w.init = init, w.build = true;
  kiln_scope_push();
  rn_walk_net(&w, NULL);
  kiln_scope_pop();
  if (w.failed) {
    for (int i = 0; i < m->nvars; i++) kiln_variable_free(m->vars[i]);
    free(m);
    return NULL;
  }
  return m;
}

static inline void resnet_free(resnet_model *m) {
  if (!m) return;
  for (int i = 0; i < m->nvars; i++) kiln_variable_free(m->vars[i]);
  free(m);
}

/* logits [n, classes]; train: batch statistics (and, with update, the
 * running statistics assigned), else the running statistics */
static inline kiln_tensor *resnet_forward(resnet_model *m, kiln_tensor *x, bool train, bool update) {
  rn_walk w;
  memset(&w, 0, sizeof w);
  w.m = m, w.train = train, w.update = update;
  kiln_tensor *logits = rn_walk_net(&w, x);
  if (w.failed) return NULL;
  if (logits && w.cur != m->nvars) {
    kiln_fail("resnet: the forward pass used %d of %d variables", w.cur, m->nvars);
    return NULL;
  }
  return logits;
}

static inline kiln_tensor *resnet_loss(kiln_tensor *labels, kiln_tensor *logits) {
  return kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(labels, logits), 0, NULL, false);
}

/* The training-mode loss and its gradients w.r.t. m->train (grads has
 * m->ntrain slots); update: also assign the running statistics. 0 / -1. */
static inline int resnet_loss_grads(resnet_model *m, kiln_tensor *x, kiln_tensor *labels, bool update,
                                    kiln_tensor **loss, kiln_tensor **grads) {
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *l = resnet_loss(labels, resnet_forward(m, x, true, update));
  kiln_tape_end(tape);
  int rc = tape && l ? 0 : -1;
  if (!rc) rc = kiln_tape_gradient_vars(tape, l, m->ntrain, m->train, grads);
  kiln_tape_free(tape);
  *loss = l;
  return rc;
}

/* One SGD-with-momentum step (opt: kiln_sgd_momentum_new), running
 * statistics updated; *loss gets the loss before the update. 0 / -1. */
static inline int resnet_train_step(resnet_model *m, kiln_optimizer *opt, kiln_tensor *x, kiln_tensor *labels,
                                    kiln_tensor **loss) {
  kiln_tensor *grads[RN_MAX_VARS];
  memset(grads, 0, sizeof grads);
  int rc = resnet_loss_grads(m, x, labels, true, loss, grads);
  if (!rc) rc = kiln_optimizer_apply(opt, m->ntrain, m->train, grads);
  return rc;
}

/* ---- staged bodies (user: a resnet_stage) ---- */

typedef struct {
  resnet_model *m;
  kiln_optimizer *opt;
} resnet_stage;

/* in: x, labels; out: the loss (the whole step: forward, gradient, update) */
static inline int resnet_train_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  resnet_stage *s = (resnet_stage *)user;
  return resnet_train_step(s->m, s->opt, in[0], in[1], &out[0]);
}

/* in: x; out: the inference-mode logits */
static inline int resnet_infer_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  resnet_stage *s = (resnet_stage *)user;
  out[0] = resnet_forward(s->m, in[0], false, false);
  return out[0] ? 0 : -1;
}

/* in: x, labels; out: the loss, then the gradient of each trainable variable */
static inline int resnet_grads_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  resnet_stage *s = (resnet_stage *)user;
  return resnet_loss_grads(s->m, in[0], in[1], false, &out[0], out + 1);
}

/* ---- .npy files (NumPy's format 1.0; f32, f64, i64, little-endian, C order) ---- */

static inline const char *rn_npy_descr(kiln_dtype dt) {
  return dt == KILN_F32 ? "<f4" : dt == KILN_F64 ? "<f8" : dt == KILN_I64 ? "<i8" : NULL;
}

static inline int rn_save_npy(const char *path, kiln_tensor *t) {
  if (!t) return -1;
  kiln_dtype dt = kiln_tensor_dtype(t);
  const char *descr = rn_npy_descr(dt);
  if (!descr) return kiln_fail("save_npy: %s: dtype %s is not f32, f64 or i64", path, kiln_dtype_name(dt));
  char head[512];
  int n = snprintf(head, sizeof head, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
  int rank = kiln_tensor_rank(t);
  for (int i = 0; i < rank; i++)
    n += snprintf(head + n, sizeof head - (size_t)n, "%lld%s", (long long)kiln_tensor_shape(t)[i],
                  rank == 1 || i + 1 < rank ? ", " : "");
  n += snprintf(head + n, sizeof head - (size_t)n, "), }");
  while ((10 + n + 1) % 64) head[n++] = ' ';
  head[n++] = '\n';
  size_t bytes = (size_t)kiln_tensor_size(t) * (dt == KILN_F32 ? 4 : 8);
  void *data = malloc(bytes + 1);
  FILE *f = data ? fopen(path, "wb") : NULL;
  int rc = f && !kiln_tensor_read(t, data, bytes) ? 0 : -1;
  unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(n & 255), (unsigned char)(n >> 8)};
  if (!rc && (fwrite(pre, 1, 10, f) != 10 || fwrite(head, 1, (size_t)n, f) != (size_t)n ||
              fwrite(data, 1, bytes, f) != bytes))
    rc = -1;
  if (f && fclose(f)) rc = -1;
  free(data);
  return rc ? kiln_fail("save_npy: cannot write %s", path) : 0;
}

/* NULL with the error set when path is missing or not such a file */
static inline kiln_tensor *rn_load_npy(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    kiln_fail("load_npy: cannot open %s", path);
    return NULL;
  }
  unsigned char pre[10];
  char head[1024];
  kiln_tensor *t = NULL;
  size_t n = 0;
  if (fread(pre, 1, 10, f) == 10 && !memcmp(pre, "\x93NUMPY", 6) && pre[6] == 1 &&
      (n = (size_t)pre[8] | (size_t)pre[9] << 8) < sizeof head && fread(head, 1, n, f) == n) {
    head[n] = 0;
    kiln_dtype dt = strstr(head, "'<f4'") ? KILN_F32 : strstr(head, "'<f8'") ? KILN_F64 : KILN_I64;
    const char *sh = strstr(head, "'shape': (");
    bool ok = sh && (dt != KILN_I64 || strstr(head, "'<i8'")) && strstr(head, "'fortran_order': False");
    int64_t shape[8], size = 1;
    int rank = 0;
    for (const char *p = sh ? sh + 10 : NULL; ok && *p != ')';) {
      char *end;
      long long d = strtoll(p, &end, 10);
      if (end == p || rank == 8) {
        ok = false;
        break;
      }
      shape[rank++] = d, size *= d;
      p = end;
      while (*p == ',' || *p == ' ') p++;
    }
    size_t bytes = (size_t)size * (dt == KILN_F32 ? 4 : 8);
    void *data = ok ? malloc(bytes + 1) : NULL;
    if (data && fread(data, 1, bytes, f) == bytes) t = kiln_tensor_new(dt, rank, shape, data);
    free(data);
  }
  fclose(f);
  if (!t) kiln_fail("load_npy: %s is not an f32, f64 or i64 .npy file in C order", path);
  return t;
}

/* ---- the check: eager == staged (== PyTorch) on a small ResNet ---- */

/* max |a - b| / max(max |b|, 1e-12) over the elements, or +inf when the
 * shapes differ or a read fails */
static inline double rn_rel_diff(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_tensor_size(a) != kiln_tensor_size(b) || kiln_tensor_rank(a) != kiln_tensor_rank(b))
    return INFINITY;
  int64_t n = kiln_tensor_size(a);
  double *x = (double *)malloc((size_t)(n + 1) * sizeof *x), *y = (double *)malloc((size_t)(n + 1) * sizeof *y);
  double d = INFINITY;
  kiln_scope_push();
  if (x && y && !kiln_tensor_read(kiln_cast(a, KILN_F64), x, (size_t)n * sizeof *x) &&
      !kiln_tensor_read(kiln_cast(b, KILN_F64), y, (size_t)n * sizeof *y)) {
    double diff = 0, ref = 1e-12;
    for (int64_t i = 0; i < n; i++) {
      double e = fabs(x[i] - y[i]);
      if (!(e <= diff)) diff = e; /* NaN sticks */
      if (fabs(y[i]) > ref) ref = fabs(y[i]);
    }
    d = diff / ref;
  }
  kiln_scope_pop();
  free(x);
  free(y);
  return d;
}

/* the small network of the check: stem 8 channels, a block at stride 1 and
 * one at stride 2 (both with projections), 32x32 images, 10 classes, f64 */
static inline resnet_config resnet_check_config(void) {
  resnet_config c;
  memset(&c, 0, sizeof c);
  c.blocks[0] = 1, c.blocks[1] = 1;
  c.width = 8, c.classes = 10, c.image = 32, c.dtype = KILN_F64, c.random_bn = true;
  return c;
}

enum { RN_CHECK_BATCH = 2, RN_CHECK_STEPS = 2 };
static const double RN_CHECK_LR = 0.05;

/* appends a line to report (when there is room) */
static inline void rn_note(char *report, size_t size, const char *fmt, const char *what, double a, double b) {
  size_t len = strlen(report);
  if (len + 1 < size) snprintf(report + len, size - len, fmt, what, a, b);
}

/* compare a with b within tol, noting the worst; 1 when they differ */
static inline int rn_expect(const char *what, kiln_tensor *a, kiln_tensor *b, double tol, double *worst, char *report,
                            size_t size) {
  double d = rn_rel_diff(a, b);
  if (!(d <= *worst)) *worst = d;
  if (d <= tol) return 0;
  rn_note(report, size, "%s: relative difference %.3g (tolerance %.3g)\n", what, d, tol);
  return 1;
}

/* Runs the check: a small ResNet in f64, its inference logits, training
 * loss and gradients eagerly and staged, then RN_CHECK_STEPS SGD-momentum
 * steps eagerly and staged from the same weights; every result must agree
 * within tol. When torch_cmd is given, the weights, input and Kiln's
 * results are written under dir as .npy files, torch_cmd (a shell command
 * that gets dir appended, e.g. "python3 bench/resnet_torch.py --check") runs
 * the same in PyTorch and writes torch.*.npy there, which must agree too.
 * Returns the number of mismatches (0 = pass) or -1 when something failed
 * to run; report gets one line per mismatch or the error, and the worst
 * differences seen (eager vs staged, Kiln vs PyTorch). */
static inline int resnet_check(const char *torch_cmd, const char *dir, double tol, char *report, size_t size) {
  report[0] = 0;
  resnet_config cfg = resnet_check_config();
  kiln_random_seed(16);
  resnet_model *a = resnet_new(&cfg, NULL);
  resnet_model *b = a ? resnet_new(&cfg, a) : NULL;
  kiln_optimizer *opt_a = kiln_sgd_momentum_new(RN_CHECK_LR, 0.9, false);
  kiln_optimizer *opt_b = kiln_sgd_momentum_new(RN_CHECK_LR, 0.9, false);
  resnet_stage sb = {b, opt_b};
  kiln_function *f_infer = kiln_function_new("resnet_check_infer", resnet_infer_body, &sb, 1, 1);
  kiln_function *f_grads = kiln_function_new("resnet_check_grads", resnet_grads_body, &sb, 2, 1 + (a ? a->ntrain : 0));
  kiln_function *f_train = kiln_function_new("resnet_check_train", resnet_train_body, &sb, 2, 1);
  int bad = 0, rc = a && b && opt_a && opt_b && f_infer && f_grads && f_train ? 0 : -1;
  double worst_staged = 0, worst_torch = 0;
  char path[1024], what[160];
  kiln_scope_push();
  int64_t xs[4] = {RN_CHECK_BATCH, cfg.image, cfg.image, 3}, ls[1] = {RN_CHECK_BATCH};
  kiln_tensor *x = kiln_random_normal(cfg.dtype, 4, xs);
  kiln_tensor *labels = kiln_cast(kiln_random_uniform(KILN_F64, 1, ls, 0, (double)cfg.classes), KILN_I64);
  if (!x || !labels) rc = -1;
  if (!rc && torch_cmd) { /* the initial weights, before anything trains */
    snprintf(path, sizeof path, "%s/x.npy", dir);
    rc = rn_save_npy(path, x);
    snprintf(path, sizeof path, "%s/labels.npy", dir);
    if (!rc) rc = rn_save_npy(path, labels);
    for (int i = 0; !rc && i < a->nvars; i++) {
      snprintf(path, sizeof path, "%s/init.%s.npy", dir, kiln_variable_name(a->vars[i]));
      rc = rn_save_npy(path, kiln_variable_read(a->vars[i]));
    }
    snprintf(path, sizeof path, "%s/config.txt", dir);
    FILE *fc = rc ? NULL : fopen(path, "w");
    if (fc) {
      fprintf(fc, "%d %d %d %d %lld %lld %d %d %g\n", cfg.blocks[0], cfg.blocks[1], cfg.blocks[2], cfg.blocks[3],
              (long long)cfg.width, (long long)cfg.classes, (int)RN_CHECK_BATCH, (int)RN_CHECK_STEPS, RN_CHECK_LR);
      rc = fclose(fc) ? kiln_fail("resnet_check: cannot write %s", path) : 0;
    } else if (!rc) {
      rc = kiln_fail("resnet_check: cannot write %s", path);
    }
  }
  /* inference */
  kiln_tensor *logits = NULL, *logits_s = NULL;
  if (!rc && !(logits = resnet_forward(a, x, false, false))) rc = -1;
  if (!rc) rc = kiln_function_call(f_infer, &x, &logits_s);
  if (!rc) bad += rn_expect("inference logits, eager vs staged", logits, logits_s, tol, &worst_staged, report, size);
  /* loss and gradients */
  kiln_tensor *loss = NULL, *grads[RN_MAX_VARS], *staged[RN_MAX_VARS + 1];
  memset(grads, 0, sizeof grads);
  memset(staged, 0, sizeof staged);
  kiln_tensor *in[2] = {x, labels};
  if (!rc) rc = resnet_loss_grads(a, x, labels, false, &loss, grads);
  if (!rc) rc = kiln_function_call(f_grads, in, staged);
  if (!rc) {
    bad += rn_expect("training loss, eager vs staged", loss, staged[0], tol, &worst_staged, report, size);
    for (int i = 0; i < a->ntrain; i++) {
      snprintf(what, sizeof what, "gradient of %s, eager vs staged", kiln_variable_name(a->train[i]));
      bad += rn_expect(what, grads[i], staged[1 + i], tol, &worst_staged, report, size);
    }
  }
  /* training steps */
  kiln_tensor *step_loss[RN_CHECK_STEPS];
  for (int s = 0; !rc && s < RN_CHECK_STEPS; s++) {
    kiln_tensor *ls_s = NULL;
    rc = resnet_train_step(a, opt_a, x, labels, &step_loss[s]);
    if (!rc) rc = kiln_function_call(f_train, in, &ls_s);
    snprintf(what, sizeof what, "loss at step %d, eager vs staged", s);
    if (!rc) bad += rn_expect(what, step_loss[s], ls_s, tol, &worst_staged, report, size);
  }
  for (int i = 0; !rc && i < a->nvars; i++) {
    snprintf(what, sizeof what, "%s after %d steps, eager vs staged", kiln_variable_name(a->vars[i]), RN_CHECK_STEPS);
    bad += rn_expect(what, kiln_variable_read(a->vars[i]), kiln_variable_read(b->vars[i]), tol, &worst_staged, report,
                     size);
  }
  /* PyTorch */
  if (!rc && torch_cmd) {
    size_t len = strlen(torch_cmd) + strlen(dir) + 8;
    char *cmd = (char *)malloc(len);
    int st = -1;
    if (cmd) {
      snprintf(cmd, len, "%s '%s'", torch_cmd, dir);
      st = system(cmd);
    }
    if (st != 0) rc = kiln_fail("resnet_check: `%s '%s'` failed (status %d)", torch_cmd, dir, st);
    free(cmd);
  }
  if (!rc && torch_cmd) {
    snprintf(path, sizeof path, "%s/torch.logits.npy", dir);
    kiln_tensor *t = rn_load_npy(path);
    bad += rn_expect("inference logits, Kiln vs PyTorch", logits, t, tol, &worst_torch, report, size);
    snprintf(path, sizeof path, "%s/torch.loss.npy", dir);
    t = rn_load_npy(path);
    bad += rn_expect("training loss, Kiln vs PyTorch", loss, t, tol, &worst_torch, report, size);
    for (int i = 0; i < a->ntrain; i++) {
      const char *name = kiln_variable_name(a->train[i]);
      snprintf(path, sizeof path, "%s/torch.grad.%s.npy", dir, name);
      snprintf(what, sizeof what, "gradient of %s, Kiln vs PyTorch", name);
      bad += rn_expect(what, grads[i], rn_load_npy(path), tol, &worst_torch, report, size);
    }
    for (int s = 0; s < RN_CHECK_STEPS; s++) {
      snprintf(path, sizeof path, "%s/torch.step%d.loss.npy", dir, s);
      snprintf(what, sizeof what, "loss at step %d, Kiln vs PyTorch", s);
      bad += rn_expect(what, step_loss[s], rn_load_npy(path), tol, &worst_torch, report, size);
    }
    for (int i = 0; i < a->nvars; i++) {
      const char *name = kiln_variable_name(a->vars[i]);
      snprintf(path, sizeof path, "%s/torch.final.%s.npy", dir, name);
      snprintf(what, sizeof what, "%s after %d steps, Kiln vs PyTorch", name, RN_CHECK_STEPS);
      bad += rn_expect(what, kiln_variable_read(a->vars[i]), rn_load_npy(path), tol, &worst_torch, report, size);
    }
    kiln_clear_error(); /* a missing file shows as a mismatch */
  }
  kiln_scope_pop();
  if (rc) {
    size_t len = strlen(report);
    if (len + 1 < size) snprintf(report + len, size - len, "error: %s\n", kiln_last_error());
  } else {
    size_t len = strlen(report);
    if (len + 1 < size)
      snprintf(report + len, size - len,
               "resnet check: %d variables, %lld parameters; worst relative difference eager vs staged %.3g%s", a->nvars,
               (long long)a->params, worst_staged, torch_cmd ? ", Kiln vs PyTorch " : "");
    len = strlen(report);
    if (torch_cmd && len + 1 < size) snprintf(report + len, size - len, "%.3g", worst_torch);
  }
  kiln_function_free(f_train);
  kiln_function_free(f_grads);
  kiln_function_free(f_infer);
  kiln_optimizer_free(opt_a);
  kiln_optimizer_free(opt_b);
  resnet_free(a);
  resnet_free(b);
  return rc ? -1 : bad;
}

#endif
