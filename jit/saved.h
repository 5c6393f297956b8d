/* saved.h — a loaded function's saved traces (load.c builds them, save.c
 * writes them out again, function.c's trace cache compiles them on first
 * use through saved_trace_fn). Internal. */
#ifndef KILN_SAVED_H
#define KILN_SAVED_H

#include "function.h"
#include "manifest.h"

typedef struct saved_fn {
  manifest m;
  char **texts;          /* per trace: its .kir text as read */
  ir_module **modules;   /* per trace: parsed and verified; never run (a call clones it) */
  ir_func **funcs;       /* per trace: its function in modules[k] */
  kiln_tensor ***consts; /* per trace: its captured tensors (m.traces[k].n_consts) */
  kiln_variable **vars;  /* m.n_vars: the function's own (f->owned frees them) */
  int *scope;            /* per trace: the device scope's index, -1 where this process lacks it */
  int **in_device;       /* per trace, per input: the device's index, or -1 */
} saved_fn;

#endif
