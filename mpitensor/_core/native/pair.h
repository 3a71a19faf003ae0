/* Two ranks of one node that exchange their inputs through shared memory, each waiting in the
 * kernel until the other's is there (see mpitensor/_transport/mpi/pair.py).
 *
 * A held all-reduce of 2 ranks whose core is contested moves its data in one exchange. Through
 * MPI, a rank waits for its peer's message in MPI's loop, which can only pause briefly and look
 * again (`idle.h`): while the peer waits for a core, the rank wakes every few microseconds and
 * spends the CPU time its own computation then lacks. Here each rank writes its input into its
 * slot of a segment both map, and a rank whose peer's input is not there yet sleeps on a futex
 * the peer wakes once it wrote it, as gloo's ranks sleep in a socket's receive.
 *
 * The lane takes this table from `mpitensor._core._pair.api_address()` at bind. One call's
 * exchange: `post` (this rank's input into its slot), `await_peer` (the peer's slot, once
 * written), the caller reduces, then `done` (the peer may reuse its slot).
 *
 * The check of a call waits for the peer too, in MPI: where a pair is set up, each rank says in
 * the segment how many checks of the group it posted (`ring`), and a rank whose check is late
 * on a contested core sleeps until the peer's is posted (`doze`) rather than looking every few
 * microseconds; MPI's test then finds it. Only a hint: a wait never depends on it for more than
 * a short sleep. */
#ifndef MPITENSOR_PAIR_H
#define MPITENSOR_PAIR_H

#include <stddef.h>
#include <stdint.h>

typedef struct Pair Pair;

typedef struct {
    /* The pair of the 2-rank communicator `comm` (its MPI handle) for a call of `nbytes`: 1
     * (*pair set), 0 none set up yet for that size (the Python path sets one up), -1 none
     * will be (not on one node, or too large: MPI's own exchange). */
    int (*find)(intptr_t comm, size_t nbytes, Pair **pair);
    /* Write this call's input (`nbytes`) into this rank's slot; 0, or -1 where the peer's
     * process is gone. Call without the GIL. */
    int (*post)(Pair *pair, const void *send, size_t nbytes);
    /* The peer's input of this call, once it is written; NULL where the peer's process is gone. */
    const void *(*await_peer)(Pair *pair);
    /* This rank's input of this call, as `post` wrote it. */
    const void *(*own)(Pair *pair);
    /* This rank has read the peer's input of this call. */
    void (*done)(Pair *pair);
    /* This rank posted its group's first `checks` checks (the peer's `doze` may wait for it). */
    void (*ring)(intptr_t comm, uint32_t checks);
    /* Sleep until the peer of `comm` posted its first `checks` checks, for at most `ns`: 1 it
     * had before (no sleep: the caller pauses as it would have), 0 it slept (woken or not),
     * -1 no pair. Call without the GIL. */
    int (*doze)(intptr_t comm, uint32_t checks, long ns);
} PairApi;

#endif
