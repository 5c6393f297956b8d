/* json.c — the small JSON reader and writer of the formats Kiln writes
 * itself or reads from untrusted files: the safetensors header
 * (checkpoint.c) and a saved function's manifest (jit/manifest.c). The
 * reader trusts nothing: every error names the byte it was found at. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

bool json_utf8_valid(const uint8_t *s, size_t n, size_t *bad) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    size_t k;
    uint32_t lo = 0x80, hi = 0xbf; /* allowed range of the first continuation byte */
    if (c < 0x80) {
      i++;
      continue;
    } else if (c >= 0xc2 && c <= 0xdf) {
      k = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      k = 2;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      k = 3;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    } else {
      *bad = i;
      return false;
    }
    if (n - i <= k) {
      *bad = i;
      return false;
    }
    for (size_t j = 1; j <= k; j++) {
      uint8_t d = s[i + j];
      if (d < (j == 1 ? lo : 0x80) || d > (j == 1 ? hi : 0xbf)) {
        *bad = i;
        return false;
      }
    }
    i += k + 1;
  }
  return true;
}




int json_fail(json_parser *p, const char *fmt, ...) {
  if (p->err[0]) return -1;
  int used = snprintf(p->err, sizeof p->err, "corrupt %s at byte %zu: ", p->what, p->i + p->base);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->err + used, sizeof p->err - (size_t)used, fmt, ap);
  va_end(ap);
  return -1;
}

const char *json_found(const json_parser *p, char *buf, size_t n) {
  if (p->i >= p->n) {
    snprintf(buf, n, "the end of the %s", p->what);
    return buf;
  }
  unsigned char c = p->s[p->i];
  if (c >= 0x20 && c < 0x7f)
    snprintf(buf, n, "'%c'", c);
  else
    snprintf(buf, n, "byte 0x%02x", c);
  return buf;
}

void json_ws(json_parser *p) {
  while (p->i < p->n) {
    uint8_t c = p->s[p->i];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->i++;
  }
}

bool json_at(const json_parser *p, char c) { return p->i < p->n && p->s[p->i] == (uint8_t)c; }

int json_expect(json_parser *p, char c) {
  json_ws(p);
  if (json_at(p, c)) {
    p->i++;
    return 0;
  }
  char b[JSON_FOUND_BYTES];
  return json_fail(p, "expected '%c', found %s", c, json_found(p, b, sizeof b));
}

static int hexval(uint8_t c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* \uXXXX at p->i (the backslash); advances past it */
static int unicode_escape(json_parser *p, uint32_t *cp) {
  if (p->n - p->i < 6 || p->s[p->i + 1] != 'u') return json_fail(p, "bad \\u escape");
  uint32_t v = 0;
  for (int k = 2; k < 6; k++) {
    int h = hexval(p->s[p->i + (size_t)k]);
    if (h < 0) return json_fail(p, "bad \\u escape");
    v = v * 16 + (uint32_t)h;
  }
  p->i += 6;
  *cp = v;
  return 0;
}

static size_t put_utf8(char *o, uint32_t cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xc0 | cp >> 6);
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xe0 | cp >> 12);
    o[1] = (char)(0x80 | (cp >> 6 & 0x3f));
    o[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
  }
  o[0] = (char)(0xf0 | cp >> 18);
  o[1] = (char)(0x80 | (cp >> 12 & 0x3f));
  o[2] = (char)(0x80 | (cp >> 6 & 0x3f));
  o[3] = (char)(0x80 | (cp & 0x3f));
  return 4;
}

/* A string at p->i. With out, its decoded bytes go to a malloc'd,
 * NUL-terminated buffer (the caller frees it); without, it is checked and
 * skipped. A decoded string is never longer than its JSON spelling. */
int json_string(json_parser *p, char **out, size_t *out_len) {
  json_ws(p);
  char b[JSON_FOUND_BYTES];
  if (!json_at(p, '"')) return json_fail(p, "expected a string, found %s", json_found(p, b, sizeof b));
  size_t open = p->i++, end = p->i;
  while (end < p->n && p->s[end] != '"') end += p->s[end] == '\\' ? 2 : 1;
  if (end >= p->n) {
    p->i = open;
    return json_fail(p, "unterminated string");
  }
  char *o = NULL;
  size_t len = 0;
  if (out && !(o = malloc(end - p->i + 1))) return json_fail(p, "out of memory");
  while (p->i < end) {
    uint8_t c = p->s[p->i];
    char tmp[4];
    size_t k = 1;
    if (c < 0x20) {
      free(o);
      return json_fail(p, "control byte 0x%02x in a string", c);
    }
    if (c != '\\') {
      tmp[0] = (char)c;
      p->i++;
    } else {
      uint8_t e = p->s[p->i + 1]; /* end points at the closing quote, so this is in bounds */
      const char *simple = strchr("\"\\/bfnrt", e);
      if (e && simple) {
        tmp[0] = "\"\\/\b\f\n\r\t"[simple - "\"\\/bfnrt"];
        p->i += 2;
      } else if (e == 'u') {
        uint32_t cp, lo;
        if (unicode_escape(p, &cp)) {
          free(o);
          return -1;
        }
        if (cp >= 0xdc00 && cp <= 0xdfff) {
          p->i -= 6;
          free(o);
          return json_fail(p, "lone surrogate \\u%04x in a string", (unsigned)cp);
        }
        if (cp >= 0xd800 && cp <= 0xdbff) {
          if (p->i + 6 > end || p->s[p->i] != '\\' || unicode_escape(p, &lo) || lo < 0xdc00 ||
              lo > 0xdfff) {
            p->err[0] = '\0'; /* report the pair, not its second half */
            free(o);
            return json_fail(p, "lone surrogate \\u%04x in a string", (unsigned)cp);
          }
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        }
        k = put_utf8(tmp, cp);
      } else {
        free(o);
        return json_fail(p, "bad escape '\\%c' in a string", e >= 0x20 && e < 0x7f ? e : '?');
      }
    }
    if (o) memcpy(o + len, tmp, k);
    len += k;
  }
  p->i = end + 1;
  if (o) {
    o[len] = '\0';
    *out = o;
    *out_len = len;
  }
  return 0;
}

/* A non-negative integer below 2^63 (offsets and dimensions). */
int json_uint(json_parser *p, const char *what, uint64_t *out) {
  json_ws(p);
  char b[JSON_FOUND_BYTES];
  if (json_at(p, '-')) return json_fail(p, "%s is negative", what);
  if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9')
    return json_fail(p, "expected %s (an integer), found %s", what, json_found(p, b, sizeof b));
  size_t start = p->i;
  uint64_t v = 0;
  while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
    uint64_t d = p->s[p->i] - '0';
    if (v > ((uint64_t)INT64_MAX - d) / 10) {
      p->i = start;
      return json_fail(p, "%s is too large", what);
    }
    v = v * 10 + d;
    p->i++;
  }
  if (p->s[start] == '0' && p->i - start > 1) {
    p->i = start;
    return json_fail(p, "%s has a leading zero", what);
  }
  if (json_at(p, '.') || json_at(p, 'e') || json_at(p, 'E')) {
    p->i = start;
    return json_fail(p, "%s is not an integer", what);
  }
  *out = v;
  return 0;
}

/* Any JSON number, checked and skipped. */
int json_number(json_parser *p) {
  size_t i = p->i;
  const uint8_t *s = p->s;
#define DIGIT(j) ((j) < p->n && s[j] >= '0' && s[j] <= '9')
  if (i < p->n && s[i] == '-') i++;
  if (!DIGIT(i)) goto bad;
  if (s[i] == '0')
    i++;
  else
    while (DIGIT(i)) i++;
  if (i < p->n && s[i] == '.') {
    if (!DIGIT(i + 1)) goto bad;
    for (i++; DIGIT(i);) i++;
  }
  if (i < p->n && (s[i] == 'e' || s[i] == 'E')) {
    i++;
    if (i < p->n && (s[i] == '+' || s[i] == '-')) i++;
    if (!DIGIT(i)) goto bad;
    while (DIGIT(i)) i++;
  }
#undef DIGIT
  p->i = i;
  return 0;
bad:
  return json_fail(p, "malformed number");
}

/* Any JSON value, checked and skipped (unknown keys, __metadata__). */
int json_skip(json_parser *p, int depth) {
  json_ws(p);
  char b[JSON_FOUND_BYTES];
  if (depth > JSON_MAX_DEPTH) return json_fail(p, "nested more than %d deep", JSON_MAX_DEPTH);
  if (p->i >= p->n) return json_fail(p, "expected a value, found the end of the %s", p->what);
  uint8_t c = p->s[p->i];
  if (c == '"') return json_string(p, NULL, NULL);
  if (c == '-' || (c >= '0' && c <= '9')) return json_number(p);
  const char *const words[] = {"true", "false", "null"};
  for (int w = 0; w < 3; w++) {
    size_t k = strlen(words[w]);
    if (p->n - p->i >= k && memcmp(p->s + p->i, words[w], k) == 0) {
      p->i += k;
      return 0;
    }
  }
  if (c != '{' && c != '[') return json_fail(p, "expected a value, found %s", json_found(p, b, sizeof b));
  char close = c == '{' ? '}' : ']';
  p->i++;
  json_ws(p);
  if (json_at(p, close)) {
    p->i++;
    return 0;
  }
  for (;;) {
    if (c == '{' && (json_string(p, NULL, NULL) || json_expect(p, ':'))) return -1;
    if (json_skip(p, depth + 1)) return -1;
    json_ws(p);
    if (json_at(p, ',')) {
      p->i++;
      continue;
    }
    if (json_at(p, close)) {
      p->i++;
      return 0;
    }
    return json_fail(p, "expected ',' or '%c', found %s", close, json_found(p, b, sizeof b));
  }
}


/* ---- writing ---- */

void json_buf_put(json_buf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1) cap *= 2;
    char *grown = realloc(b->s, cap);
    if (!grown) {
      b->oom = true;
      return;
    }
    b->s = grown;
    b->cap = cap;
  }
  memcpy(b->s + b->n, s, n);
  b->n += n;
  b->s[b->n] = '\0';
}

void json_buf_str(json_buf *b, const char *s) { json_buf_put(b, s, strlen(s)); }

void json_buf_u64(json_buf *b, uint64_t v) {
  char tmp[24];
  json_buf_put(b, tmp, (size_t)snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v));
}

/* A JSON string, escaped as serde_json (the reference) escapes it. */
void json_buf_quoted(json_buf *b, const char *s) {
  json_buf_put(b, "\"", 1);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    const char *esc = NULL;
    char u[8];
    switch (c) {
    case '"': esc = "\\\""; break;
    case '\\': esc = "\\\\"; break;
    case '\b': esc = "\\b"; break;
    case '\f': esc = "\\f"; break;
    case '\n': esc = "\\n"; break;
    case '\r': esc = "\\r"; break;
    case '\t': esc = "\\t"; break;
    default:
      if (c < 0x20) {
        snprintf(u, sizeof u, "\\u%04x", c);
        esc = u;
      }
    }
    if (esc)
      json_buf_str(b, esc);
    else
      json_buf_put(b, (const char *)&c, 1);
  }
  json_buf_put(b, "\"", 1);
}
