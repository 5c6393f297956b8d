/* compat.h — the one place for compiler-specific extensions (GCC/Clang).
 * Everything else in Kiln is plain C11. */
#ifndef KILN_COMPAT_H
#define KILN_COMPAT_H

#define KILN_LIKELY(x) __builtin_expect(!!(x), 1)
#define KILN_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define KILN_CONSTRUCTOR __attribute__((constructor))
#define KILN_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define KILN_UNUSED __attribute__((unused))
#if defined(__x86_64__) || defined(__i386__)
#define KILN_CPU_RELAX() __builtin_ia32_pause()
#else
#define KILN_CPU_RELAX() ((void)0)
#endif
/* A thread-local read on the eager hot path: one load instead of a call to
 * __tls_get_addr. Only for a few small variables: they take static TLS. */
/* C++ spells C11's _Thread_local thread_local (tests include internal headers) */
#if defined(__cplusplus) && !defined(_Thread_local)
#define _Thread_local thread_local
#endif
#define KILN_TLS_FAST __attribute__((tls_model("initial-exec")))
/* exports one internal function from the -fvisibility=hidden library (test hooks) */
#define KILN_EXPORT __attribute__((visibility("default")))
#define KILN_RESTRICT __restrict__
#define KILN_ASSUME_ALIGNED(p, n) __builtin_assume_aligned((p), (n))
/* a * b into *out; true on overflow */
#define KILN_MUL_OVERFLOW(a, b, out) __builtin_mul_overflow((a), (b), (out))
#define KILN_ADD_OVERFLOW(a, b, out) __builtin_add_overflow((a), (b), (out))

#endif
