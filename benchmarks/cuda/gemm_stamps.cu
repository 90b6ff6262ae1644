// The library's Hopper GEMM tile (mknumba/roles/cuda/gemm_tile.cu, or with MK_PP_BM defined
// gemm_pingpong.cu) with its probe hooks
// (gemm_common.cuh: MK_STAMP, MK_FULL_WAIT) defined to record a timeline per block and work
// item, for benchmarks/probe_gemm_stamps.py. The library's builds leave the hooks empty (their
// PTX is unchanged); this file includes the library's tile, so the code between the stamps is
// the library's.
//
// PROBE_STAMPS: the device address of the stamp buffer (a compile-time constant: the probe
//   allocates the buffer once, then builds), uint64 words:
//     row (block b, item i) at ((b * (PROBE_ITEMS + 1)) + i) * 2 * PROBE_EVENTS, for items
//     i < PROBE_ITEMS (the block's seq-th work item) and one header row (i = PROBE_ITEMS);
//     event e of a row: words 2e (clock64 of the recording SM) and 2e + 1 (%globaltimer, ns);
//     EV_WAITS is a sum instead: word 0 the clock cycles the consumer thread 0 spent in its
//     full-barrier waits of k-steps 1.. of the item (k-step 0's is the ramp: EV_FIRST0), word 1
//     the longest one;
//     the header row: event 0 the block's start, event 1 (%smid, 0).
//   One thread records each event (a few stores per tile); the host zeroes the buffer before a
//   stamped launch, so an event never reached reads 0.
// PROBE_WAITS 0: no per-k-step clock reads (EV_WAITS stays 0), the cheapest stamping.
// Other defines pass through to the tile (MK_STAGES: a shallower ring; MK_PUBLISHER).
// compute.linked_source pastes the library's files named below (they are not beside this one).

#ifndef PROBE_STAMPS
#error "PROBE_STAMPS must be the stamp buffer's device address (benchmarks/probe_gemm_stamps.py)"
#endif
#ifndef PROBE_ITEMS
#define PROBE_ITEMS 64
#endif
#ifndef PROBE_BLOCKS
#define PROBE_BLOCKS 1024
#endif
#ifndef PROBE_WAITS
#define PROBE_WAITS 1
#endif

// Event numbers (probe_gemm_stamps.py EVENTS lists the same names in this order).
#define EV_BEGIN 0     // the compute role's work item begins (before its inputs' wait), thread 0
#define EV_READY 1     // the role's wait for the item's inputs is over (a split-K fold's flags)
#define EV_ENTER 2     // tile entry, consumer thread 0 (warpgroup 0)
#define EV_ENTER1 3    // tile entry, thread 128 (warpgroup 1)
#define EV_FIRST0 4    // warpgroup 0's first full-barrier wait done: k-step 0's data is there
#define EV_FIRST1 5    // the same, warpgroup 1
#define EV_MAIN0 6     // warpgroup 0's last MMA retired (wgmma_wait<0>)
#define EV_MAIN1 7     // the same, warpgroup 1
#define EV_STORED0 8   // warpgroup 0's thread 0 issued its epilogue's stores (or a fold's)
#define EV_STORED1 9   // the same, thread 128
#define EV_DONE 10     // the tile's end in thread 0 (after the consumers' barrier)
#define EV_PRODUCE 11  // the producer lane enters the tile's loads
#define EV_SLOT 12     // the producer got k-step 0's slot (its first load issues now)
#define EV_PRODUCED 13 // the producer issued the tile's last load
#define EV_WAITS 14    // (sum of clock cycles, longest) of warpgroup 0's waits for k-steps 1..
#define PROBE_EVENTS 16

namespace {

// The block's next work item, kept for the role-level stamps (mk_probe_role_stamp), which do
// not know the tile's seq: thread 0 sets it at each tile entry.
__shared__ unsigned probe_next_item;

// (clock64, %globaltimer), read back to back
__device__ __forceinline__ ulonglong2 probe_now() {
    ulonglong2 v;
    asm volatile("mov.u64 %0, %%clock64;\n\tmov.u64 %1, %%globaltimer;"
                 : "=l"(v.x), "=l"(v.y)::"memory");
    return v;
}

// the low 32 bits of the clock: enough for one wait, one register less in the main loop
__device__ __forceinline__ unsigned probe_clock32() {
    unsigned c;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
    return c;
}

// The block's index read at each stamp (volatile): no register holds a row address across the
// tile's code, whose registers are at the limit (168 at 288 threads) in the split-K kernel.
__device__ __forceinline__ unsigned probe_block() {
    unsigned b;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(b));
    return b;
}

__device__ __forceinline__ unsigned long long *probe_row(unsigned item) {
    return (unsigned long long *)(PROBE_STAMPS) +
           ((unsigned long long)probe_block() * (PROBE_ITEMS + 1) + item) * (2 * PROBE_EVENTS);
}

// (clock64, globaltimer) into event ev of row ``item`` (PROBE_ITEMS: the header)
__device__ __forceinline__ void probe_write(int ev, unsigned item) {
    *(ulonglong2 *)(probe_row(item) + 2 * ev) = probe_now();
}

// event ev of work item ``item``, if the buffer has a row for it
__device__ __forceinline__ void probe_put(int ev, unsigned item) {
    if (item < PROBE_ITEMS && probe_block() < PROBE_BLOCKS) probe_write(ev, item);
}

__device__ __forceinline__ void probe_block_start(int, int) {
    if (threadIdx.x == 0 && probe_block() < PROBE_BLOCKS) {
        probe_write(0, PROBE_ITEMS);
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        *(ulonglong2 *)(probe_row(PROBE_ITEMS) + 2) = make_ulonglong2(smid, 0);
    }
    if (threadIdx.x == 0) probe_next_item = 0;
}

__device__ __forceinline__ void probe_enter(int item, int) {
    if (threadIdx.x == 0) {
        probe_put(EV_ENTER, item);
        probe_next_item = item + 1;
    } else if (threadIdx.x == 128) {
        probe_put(EV_ENTER1, item);
    }
}

__device__ __forceinline__ void probe_produce(int item, int) { probe_put(EV_PRODUCE, item); }
__device__ __forceinline__ void probe_produced(int item, int) { probe_put(EV_PRODUCED, item); }

// produce_tile: called by the producer lane alone
__device__ __forceinline__ void probe_slot_free(int item, int step) {
    if (step == 0) probe_put(EV_SLOT, item);
}

__device__ __forceinline__ void probe_by_warpgroup(int ev0, int ev1, int item) {
    if (threadIdx.x == 0) probe_put(ev0, item);
    else if (threadIdx.x == 128) probe_put(ev1, item);
}

__device__ __forceinline__ void probe_main_done(int item, int) {
    probe_by_warpgroup(EV_MAIN0, EV_MAIN1, item);
}

__device__ __forceinline__ void probe_stored(int item, int) {
    probe_by_warpgroup(EV_STORED0, EV_STORED1, item);
}

__device__ __forceinline__ void probe_done(int item, int) {
    if (threadIdx.x == 0) probe_put(EV_DONE, item);
}

// A split-K fold unit (mk_gemm_sm90_fold), which has no seq: the block's next item, as the
// role-level stamps take it, and then the one after.
__device__ __forceinline__ void probe_fold_enter(int, int) {
    if (threadIdx.x == 0) probe_put(EV_ENTER, probe_next_item);
}

__device__ __forceinline__ void probe_fold_done(int, int) {
    if (threadIdx.x == 0) probe_put(EV_DONE, probe_next_item++);
}

// After a full-barrier wait that began at clock t0 (32 bits): k-step 0 stamps the ramp's end;
// later k-steps add their wait to EV_WAITS (fire-and-forget reductions: thread 0 does not wait
// on them before its next MMA).
__device__ __forceinline__ void probe_waited(int item, int step, unsigned t0) {
    if (step == 0) {
        probe_by_warpgroup(EV_FIRST0, EV_FIRST1, item);
    } else if (PROBE_WAITS && threadIdx.x == 0 && item < PROBE_ITEMS &&
               probe_block() < PROBE_BLOCKS) {
        const unsigned long long dt = probe_clock32() - t0;
        unsigned long long *w = probe_row(item) + 2 * EV_WAITS;
        asm volatile("red.global.add.u64 [%0], %1;" ::"l"(w), "l"(dt) : "memory");
        asm volatile("red.global.max.u64 [%0], %1;" ::"l"(w + 1), "l"(dt) : "memory");
    }
}

}  // namespace

#define MK_STAMP(event, item, step) probe_##event(item, step)
#define MK_FULL_WAIT(bar, phase, item, step)                                                      \
    do {                                                                                           \
        const unsigned probe_t0_ = (PROBE_WAITS && threadIdx.x == 0) ? probe_clock32() : 0u;       \
        mbar_wait(bar, phase);                                                                     \
        probe_waited(item, step, probe_t0_);                                                       \
    } while (0)

// The tile: the ping-pong tile's when the build defines its shape (compute.sm90_defines), else
// gemm_tile.cu. gemm_common.cuh first: linked_source pastes a file once, where it is first met,
// and here that must be outside both branches.
#include "gemm_common.cuh"
#ifdef MK_PP_BM
#include "gemm_pingpong.cu"
#else
#include "gemm_tile.cu"
#endif

// The compute role's stamps (probe_gemm_stamps.py wraps the role's wait for an item's inputs:
// EV_BEGIN before, EV_READY after), in thread 0, for the block's next item.
extern "C" __device__ int mk_probe_role_stamp(int ev) {
    if (threadIdx.x == 0) probe_put(ev, probe_next_item);
    return 0;
}
