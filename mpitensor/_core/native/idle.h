/* Waiting for a peer without keeping a core from it (see mpitensor/_core/idle.py).
 *
 * A rank that waits for a peer gives its core back between tests of what it waits for. A
 * yield costs a system call where the core is free, and keeps the rank's latency; but where
 * another program wants the core (a laptop running other work, a shared node, oversubscribed
 * test ranks), Linux's scheduler takes a yield as the end of the rank's slice: the rank then
 * waits the other program's whole slice (milliseconds), while a rank that sleeps is woken ahead
 * of it. So a few yields that come back late, each soon after the one before, mark the core
 * contested, and for a while after that waits sleep briefly instead of yielding (a late yield
 * now and then happens on a quiet machine too, where a thread of the program's own or the
 * system's ran).
 * Each compiled module that waits keeps its own `IdleState`; the Python engine's `Backoff`
 * follows the same rule (`_core.idle.pause`). */
#ifndef MPITENSOR_IDLE_H
#define MPITENSOR_IDLE_H

#include <sched.h>
#include <sys/prctl.h>
#include <time.h>

/* A wait spins this long before it pauses (a quiet machine's calls mostly end by then). */
#define IDLE_SPIN_NS 50000LL
/* A yield that took longer than this gave the core away for a slice (a quiet machine's take
 * microseconds, one given to a busy core's other program milliseconds). */
#define IDLE_SLOW_YIELD_NS 250000LL
/* IDLE_LATE_YIELDS of them, each within this long after the one before, mark the core contested. */
#define IDLE_AGAIN_NS 100000000LL
#define IDLE_LATE_YIELDS 3
/* For this long after, pauses sleep instead of yielding (then one yield looks again). */
#define IDLE_CONTESTED_NS 1000000000LL
/* The sleep of a pause on a contested core. */
#define IDLE_SLEEP_NS 20000L

typedef struct {
    long long contested_until; /* CLOCK_MONOTONIC ns; 0: the core was never contested */
    long long slow_at;         /* when the last yield that came back late ended */
    int late;                  /* how many came back late, each soon after the one before */
} IdleState;

static inline long long idle_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* Whether the core is contested now: pauses sleep, and waits need not spin first (a peer that
 * shares the core could not run meanwhile). */
static inline int idle_contested(IdleState *state) {
    return idle_now() < __atomic_load_n(&state->contested_until, __ATOMIC_RELAXED);
}

/* One pause of a wait for a peer: a yield, or a short sleep while the core is contested. Where
 * the node runs more of the job's ranks than it has cores (`oversubscribed`), always a yield:
 * the core goes to a peer of the job, which gives it back as soon as it waits in turn, while a
 * sleep could leave the core idle when a peer could run. */
static inline void idle_pause(IdleState *state, int oversubscribed) {
    if (oversubscribed) {
        sched_yield();
        return;
    }
    long long start = idle_now(); /* read once: the contested test and a yield's timing */
    if (start < __atomic_load_n(&state->contested_until, __ATOMIC_RELAXED)) {
        struct timespec pause = {0, IDLE_SLEEP_NS};
        /* The thread's timer slack (50 us by default) would add to each pause: 1 us while it sleeps. */
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
        nanosleep(&pause, NULL);
        prctl(PR_SET_TIMERSLACK, 0UL, 0, 0, 0); /* 0: the thread's default again */
        return;
    }
    sched_yield();
    long long end = idle_now();
    if (end - start <= IDLE_SLOW_YIELD_NS) return;
    long long before = __atomic_exchange_n(&state->slow_at, end, __ATOMIC_RELAXED);
    int late = end - before < IDLE_AGAIN_NS ? state->late + 1 : 1;
    state->late = late;
    if (late >= IDLE_LATE_YIELDS)
        __atomic_store_n(&state->contested_until, end + IDLE_CONTESTED_NS, __ATOMIC_RELAXED);
}

#endif
