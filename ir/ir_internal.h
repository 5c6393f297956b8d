/* ir_internal.h — helpers shared by the files of ir/ (not exported): type
 * comparison, value labels as the printer spells them, and the text form of
 * one constant element. */
#ifndef KILN_IR_INTERNAL_H
#define KILN_IR_INTERNAL_H

#include "ir.h"

bool ir_type_eq(const op_type *a, const op_type *b);
/* valid dtype and shape (shape_check); what names the error */
int ir_type_check(const char *what, const op_type *t);
/* [A-Za-z_][A-Za-z0-9_.]* */
bool ir_ident_ok(const char *s);
/* the printer's number of each unnamed value (-1 for named ones) */
void ir_number_values(const ir_func *f, int32_t *num);
/* "%x" or "%3", as printed */
char *ir_value_label(const ir_func *f, ir_value v, char *buf, size_t n);
/* Parses one element token of a dense<...> literal into element i of data;
 * 0, or -1 if it is not a value of dt (no error set). */
int ir_elem_from_text(kiln_dtype dt, const char *tok, size_t len, void *data, int64_t i);

/* ir_check_instr for cond, while and scan (control.c) */
int ir_check_control(const ir_module *m, op_id op, const op_attrs *a, int n, const op_type *in, int *n_out,
                     op_type **out);

/* the spelling of attrs.reduce (a dist_op) in .kir text */
static const char *const ir_reduce_names[4] = {"sum", "mean", "max", "min"};

/* a growable string */
typedef struct ir_buf {
  char *s;
  size_t len, cap;
  bool oom;
} ir_buf;
void ir_buf_printf(ir_buf *b, const char *fmt, ...) KILN_PRINTF(2, 3);
void ir_buf_put(ir_buf *b, const char *s, size_t n);
/* the text (caller frees), or NULL with the error set after out of memory */
char *ir_buf_take(ir_buf *b);

#endif
