/* variable.h — what the rest of libkiln may do with a variable (variable.c)
 * besides the public API: its identity, its fixed type, its value under its
 * lock, and the owners of per-variable state (optimizer slots) that hear of
 * its end. Internal.
 *
 * Threads (API.md §8): a variable's value is replaced only under the
 * variable's lock, and a reference to it is taken only under that lock, so
 * a reader holds either the old or the new value, never a freed one. A
 * staged call locks its variables in increasing id; those it writes stay
 * locked from the read of their values to the write of its results. */
#ifndef KILN_VARIABLE_H
#define KILN_VARIABLE_H

#include "runtime.h"

/* A number no other variable of this process ever had (1, 2, ...). */
uint64_t variable_id(const kiln_variable *v);
/* A header with v's dtype and shape (fixed for v's life), without data: for
 * types only. Lives as long as v. */
const kiln_tensor *variable_type(const kiln_variable *v);
/* v's current value, retained (the caller releases it). */
kiln_tensor *variable_acquire(kiln_variable *v);

/* v's lock: recursive, so a host callback of a staged call may read a
 * variable that call writes. Several are taken in increasing variable_id. */
void variable_lock(kiln_variable *v);
void variable_unlock(kiln_variable *v);
/* With v locked by the caller: its value (not retained), and its
 * replacement by value (a reference the variable takes over). */
kiln_tensor *variable_value_locked(kiln_variable *v);
void variable_set_value_locked(kiln_variable *v, kiln_tensor *value);

/* ---- owners of per-variable state ----
 * One process-wide recursive lock guards every link between a variable and
 * the owners of state about it (and those owners' tables of that state).
 * kiln_variable_free calls each linked owner's drop(owner, v), under that
 * lock, before v is gone; drop forgets v (it may free variables). */
typedef void (*variable_drop_fn)(void *owner, kiln_variable *v);
void variable_links_lock(void);
void variable_links_unlock(void);
/* With the links lock held: owner hears of v's free (once per link). 0 / -1. */
int variable_link(kiln_variable *v, void *owner, variable_drop_fn drop);
/* With the links lock held: owner no longer hears of v. */
void variable_unlink(kiln_variable *v, void *owner);

#endif
