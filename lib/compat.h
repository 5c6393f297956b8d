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

/* Runtime dispatch for the hot C kernels. The default build targets baseline
 * x86-64 (it must run on any x86-64 CPU and under valgrind); KILN_HOT on a
 * loop compiles it three times, for baseline x86-64, x86-64-v3 (AVX2, FMA)
 * and x86-64-v4 (AVX-512), and the dynamic loader picks the one the CPU runs
 * best (GCC function multiversioning, an ifunc). Functions they inline are
 * compiled into each clone. KILN_HOT_AVX512 compiles one function for
 * AVX-512 in whole zmm registers only: its caller checks KILN_HAVE_AVX512()
 * first. A -march=native build (-DKILN_NATIVE=ON, which defines
 * KILN_NATIVE_BUILD) needs neither: everything is compiled for the host, and
 * elsewhere (aarch64, other compilers) they are nothing. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(KILN_NATIVE_BUILD) && \
    !defined(__AVX512F__)
#define KILN_MULTIVERSION 1
#define KILN_HOT __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#define KILN_HOT_AVX512 __attribute__((target("arch=x86-64-v4,prefer-vector-width=512")))
#define KILN_HAVE_AVX512() (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl"))
#else
#define KILN_MULTIVERSION 0
#define KILN_HOT
#define KILN_HOT_AVX512
#define KILN_HAVE_AVX512() 0
#endif
/* KILN_TILE on a C micro-kernel: its MR x NR accumulators become registers
 * only when its tile loops unroll whole, which gcc does at -O3. libkiln_rt
 * (KILN_RT_BUILD) is built -O2 for size, and its micro-kernels -O3 by this. */
#if defined(KILN_RT_BUILD) && defined(__GNUC__) && !defined(__clang__)
#define KILN_TILE __attribute__((optimize("O3")))
#else
#define KILN_TILE
#endif
/* Whether fmaf/fma are a fused multiply-add in hardware wherever a hot
 * kernel runs them: so with FMA at compile time, on aarch64, and in the
 * multiversioned build (the x86-64-v3 and v4 clones inline them as one
 * instruction; the baseline clone calls libm's, exact but slow, which only a
 * CPU older than AVX2 runs). The kernels then fuse exactly as compiled code
 * (llvm.fma) does, bit for bit. */
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA) || KILN_MULTIVERSION
#define KILN_FUSED_FMA 1
#else
#define KILN_FUSED_FMA 0
#endif

#endif
