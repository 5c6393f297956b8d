/* json.h — the JSON reader and writer shared by the file formats Kiln
 * reads from untrusted files (json.c): the safetensors header
 * (checkpoint.c) and a saved function's manifest (jit/manifest.c). The
 * reader is a set of steps a format's own recursive descent calls, so each
 * format checks exactly its own keys. Internal. */
#ifndef KILN_JSON_H
#define KILN_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "compat.h"

#define JSON_MAX_DEPTH 64
#define JSON_FOUND_BYTES 48 /* a buffer for json_found */

/* The reader's state: the bytes, the position and the first error, which
 * reads "corrupt <what> at byte <i + base>: ..." (base: where s starts in
 * its file). */
typedef struct {
  const uint8_t *s;
  size_t n, i;
  const char *what;
  size_t base;
  char err[320];
} json_parser;

/* true when s[0..n) is well-formed UTF-8 (no overlong forms, surrogates or
 * code points past U+10FFFF); else the offending byte's offset in *bad */
bool json_utf8_valid(const uint8_t *s, size_t n, size_t *bad);
/* Records the first error (later ones are dropped); -1. */
KILN_PRINTF(2, 3) int json_fail(json_parser *p, const char *fmt, ...);
/* What is at the current position, for messages ("'x'", "byte 0x00",
 * "the end of the <what>"), in buf (JSON_FOUND_BYTES) or a literal. */
const char *json_found(const json_parser *p, char *buf, size_t n);
void json_ws(json_parser *p);                 /* skips white space */
bool json_at(const json_parser *p, char c);   /* the next byte is c */
int json_expect(json_parser *p, char c);      /* white space, then c; 0 / -1 */
/* A string. With out, its decoded bytes go to a malloc'd, NUL-terminated
 * buffer (the caller frees it); without, it is checked and skipped. 0 / -1. */
int json_string(json_parser *p, char **out, size_t *out_len);
/* A non-negative integer below 2^63 (what names it in errors). 0 / -1. */
int json_uint(json_parser *p, const char *what, uint64_t *out);
int json_number(json_parser *p);              /* any number, checked and skipped */
int json_skip(json_parser *p, int depth);     /* any value, checked and skipped */

/* A growing NUL-terminated text; oom set (and the text frozen) once an
 * allocation failed. */
typedef struct {
  char *s;
  size_t n, cap;
  bool oom;
} json_buf;
void json_buf_put(json_buf *b, const char *s, size_t n);
void json_buf_str(json_buf *b, const char *s);
void json_buf_u64(json_buf *b, uint64_t v);
/* s as a JSON string, escaped as serde_json (safetensors' reference) does */
void json_buf_quoted(json_buf *b, const char *s);

#endif
