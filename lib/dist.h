/* dist.h — distribution (API.md §12), internal. Four files, one idea each:
 * dist_mpi.c moves bytes between the world's processes (MPI, or a world of
 * one process where Kiln is built without it), dist_collectives.c gives the
 * public collectives their meaning on tensors, dist_gradients.c their
 * adjoints under tapes, dist_data_parallel.c the training helpers built on
 * them. Staged collectives and remote devices come as further files on the
 * same transport. */
#ifndef KILN_DIST_H
#define KILN_DIST_H

#include "ops.h"

typedef enum { DIST_SUM, DIST_MEAN, DIST_MAX, DIST_MIN } dist_op;
typedef enum {
  DIST_ALL_REDUCE = 1,
  DIST_ALL_GATHER,
  DIST_REDUCE_SCATTER,
  DIST_BROADCAST,
  DIST_AVERAGE_GRADIENTS,
  DIST_SYNC_VARIABLES,
} dist_kind;

/* "sum" -> DIST_SUM ...; -1 (and the error, naming who) for anything else */
int dist_op_parse(const char *who, const char *op);
const char *dist_op_name(dist_op op);

/* ---- the transport (dist_mpi.c) ----
 * Every function takes who, the public function's name that errors begin
 * with. All of them but dist_join run under dist_lock, which one collective
 * holds from its header to its last byte: Kiln's collectives of one process
 * never interleave, so they reach MPI one at a time whatever thread level
 * MPI granted. */

/* Joins the world if this process has not (kiln_dist_init). 0 / -1. */
int dist_join(const char *who);
int dist_world_rank(void);
int dist_world_size(void);
void dist_lock(void);
void dist_unlock(void);

/* What one process says it is about to do. Every rank of a collective
 * exchanges it first (dist_agree); a field that differs between ranks fails
 * the collective on every rank, before any data moves. */
typedef struct dist_header {
  int kind;           /* dist_kind */
  int op;             /* dist_op, or -1 */
  int dtype;          /* kiln_dtype, or -1 */
  int rank;           /* the tensor's rank */
  int64_t shape[KILN_MAX_RANK];
  int64_t arg;        /* all_gather / reduce_scatter: the axis; broadcast: the root */
  uint64_t digest;    /* average_gradients / sync_variables: a hash of every tensor's dtype and shape */
} dist_header;
/* Exchanges h with every rank. ok false: this rank's call is invalid (its
 * error is set and kept); the others fail naming it. A mismatch fails on
 * every rank with a message that names the first rank unlike rank 0 and
 * how; the ranks then agree again on the sequence, so the world stays
 * usable. 0 / -1. */
int dist_agree(const char *who, const dist_header *h, bool ok);

/* Data movement on host buffers, wire dtypes F32, F64, I32, I64 and BOOL
 * (bytes). op: DIST_SUM, DIST_MAX or DIST_MIN. Each waits at most
 * KILN_DIST_TIMEOUT_S for the other ranks; an expired wait breaks the world
 * (MPI cannot take back a collective half done): every later call fails.
 * 0 / -1. */
/* buf[0, count) = the reduction over ranks of send[0, count), the same bytes
 * on every rank; send == buf reduces in place */
int dist_allreduce(const char *who, const void *send, void *buf, int64_t count, kiln_dtype dt, dist_op op);
/* recv = the ranks' send blocks of `bytes` each, in rank order */
int dist_allgather(const char *who, const void *send, void *recv, size_t bytes);
/* send holds size blocks of count elements; recv gets block `rank` reduced over ranks */
int dist_reduce_scatter(const char *who, const void *send, void *recv, int64_t count, kiln_dtype dt, dist_op op);
/* buf = root's buf */
int dist_broadcast(const char *who, void *buf, size_t bytes, int root);
/* seconds spent waiting for the other ranks in data movement since the
 * process started (the benchmarks' share of time communicating) */
double dist_wait_seconds(void);

/* ---- point to point (dist_mpi.c), for remote devices (dist_remote.c) ----
 * Byte messages on a communicator of their own, outside dist_lock's
 * collectives. */
/* KILN_DIST_TIMEOUT_S, or 60 */
double dist_timeout(void);
/* Sends bytes to rank `to`; -1 when it takes no message within the timeout. */
int dist_send(const char *who, int to, int tag, const void *buf, size_t bytes);
/* One message of tag from rank `from` (-1: any) into malloc'd *buf (the
 * caller frees it), waiting at most `wait` seconds (0: forever, < 0: not at all). 0 got
 * one, 1 none came (no error set), -1 error. */
int dist_recv(const char *who, int from, int tag, double wait, void **buf, size_t *bytes, int *source);
/* kiln_dist_finalize's part for remote devices, under dist_lock: rank 0
 * stops every other rank's server (and hears every rank that serves none),
 * the others wait for rank 0's word. -1 when some rank did not answer: the
 * communicator may still hold its messages. */
int dist_remote_finish(void);

/* ---- tensors on the wire (dist_collectives.c) ---- */
/* The dtype a tensor travels and reduces in: f16 and bf16 as f32, and i32
 * as i64 for "mean" (the sum of the ranks must not overflow). */
kiln_dtype dist_wire_dtype(kiln_dtype dt, dist_op op);
/* n elements from dtype `from` at src to dtype `to` at dst: a copy, or a
 * conversion between f16/bf16 and f32 or between i32 and i64 */
void dist_convert(kiln_dtype from, const void *src, kiln_dtype to, void *dst, int64_t n);
/* buf[0, n) /= size in the wire dtype (integers truncate toward zero) */
void dist_divide(kiln_dtype wire, void *buf, int64_t n, int size);
/* A host copy of t's data for the wire (t on the CPU: t retained), or NULL. */
kiln_tensor *dist_host(const char *who, kiln_tensor *t);
/* Fills h with t's type. */
void dist_describe(dist_header *h, dist_kind kind, int op, const kiln_tensor *t, int64_t arg);

/* One collective of host tensor in into out, allocated with its result
 * type: the checks, the header exchange and the data movement of the eager
 * call, for a staged instruction (op: a dist_op or -1; world: the size it
 * was staged for, which must be this world's). 0 / -1. */
int dist_run_into(const char *who, dist_kind kind, int op, int64_t arg, int world, kiln_tensor *in,
                  kiln_tensor *out);

/* ---- staged collectives started now, waited for later (dist_async.c) ----
 * A start queues dist_run_into for the process's communication thread,
 * which runs the queue in order, and returns its job (*job; NULL when it
 * ran at once: KILN_DIST_OVERLAP=0, or MPI lets one thread at a time only
 * call it; then its rc is the start's). in and out are headers over
 * buffers that must stay untouched until the wait. */
typedef struct dist_job dist_job;
int dist_async_start(const char *who, dist_kind kind, int op, int64_t arg, int world, const kiln_tensor *in,
                     const kiln_tensor *out, dist_job **job);
/* Waits for job (NULL: nothing) and frees it: its rc; with keep_error a
 * failure's message (beginning with the op's name) becomes this thread's
 * error. */
int dist_async_wait(dist_job *job, bool keep_error);
/* whether starts queue now (KILN_DIST_OVERLAP is not "0", and the thread level allows) */
bool dist_async_enabled(void);
/* Waits until every started job has finished (nothing on the communication
 * thread itself): dist_lock's first step, so the world's other users come
 * after the collectives already started. */
void dist_async_drain(void);
/* Joins the communication thread (kiln_dist_finalize; a later start makes another). */
void dist_async_finish(void);
/* whether MPI lets any thread call it at any time (MPI_THREAD_MULTIPLE;
 * always without MPI). Less, the communication thread is not used: remote
 * devices' messages (dist_send, dist_recv) do not all pass dist_lock, so
 * only the caller's thread may call MPI. */
bool dist_threads_ok(void);
/* The processes of the world on this machine, this one included (1 before
 * joining or without MPI). */
int dist_local_size(void);

/* ---- staged collectives (dist_staged.c) ---- */
/* kiln_all_reduce ... on a symbolic tensor while tracing: the IR
 * instruction (op_apply), whose CPU kernel is dist_run_into. */
kiln_tensor *dist_stage(const char *who, dist_kind kind, const char *op, int64_t arg, kiln_tensor *t);
/* The collective instruction op (attrs a) of buffer in (of in_type) into
 * out (of out_type) started (dist_async_start): compiled code's start. */
int dist_staged_start(op_id op, const op_attrs *a, const op_type *in_type, const op_type *out_type, void *in,
                      void *out, dist_job **job);
/* the collective an instruction runs, 0 for other ops */
dist_kind dist_kind_of(op_id op);

/* ---- gradients (dist_gradients.c) ---- */
/* Records out = the collective (kind, op, arg) of in on the active tapes. 0 / -1. */
int dist_record(dist_kind kind, dist_op op, int64_t arg, kiln_tensor *in, kiln_tensor *out);

/* The gradient rule (kiln_grads) of the collective instructions, as
 * dist_record's nodes: staged bodies and replays record them by op. */
struct grad_args;
int dist_grad_rule(const struct grad_args *g);

#endif
