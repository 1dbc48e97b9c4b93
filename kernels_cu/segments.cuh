// Packed prefill's segment table: the one place a prefill kernel learns which tokens, chunks and
// state slots a segment (one sequence, or one window of it) owns. kdarun.kernels.segment_table
// writes it, int32:
//   [nseg][SEG_FIELDS] rows of {chunk0, chunks, row0, rows, slot, init, every, ckpt}, then the
//   checkpoint slots the rows' `ckpt` fields index (table[ckpt + j], -1: skipped).
// Segment i owns padded rows [64 chunk0, 64 (chunk0 + chunks)) of the chunk buffers and packed
// rows [row0, row0 + rows) of the per-token ones; its state is pool slot `slot`, read first when
// `init` (zero otherwise) and written at its end; with every > 0 the state after each `every`
// whole chunks goes to slot table[ckpt + j] (j = 0, 1, ...; only after whole chunks of its rows).
// A null table is one segment of T tokens at slot 0 starting from its state: a plain prefill,
// so that path runs the same code and gives the same bits.
#pragma once

#ifndef SEG_FIELDS
#error "build kernels_cu/ with the flags of kdarun.kernels.compile_defines()"
#endif

struct Segment {
    int chunk0, chunks, row0, rows, slot, init, every, ckpt;
};

__device__ __forceinline__ Segment segment_at(const int* __restrict__ table, int i, int T) {
    if (table == nullptr) return {0, (T + CHUNK - 1) / CHUNK, 0, T, 0, 1, 0, 0};
    const int* r = table + (long long)i * SEG_FIELDS;
    return {r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]};
}

// The segment holding chunk `chunk` (segments are in chunk order, each at least one chunk): a
// binary search over the rows' chunk0, for kernels that run over padded rows.
__device__ __forceinline__ int segment_of_chunk(const int* __restrict__ table, int nseg,
                                                int chunk) {
    if (table == nullptr) return 0;
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (table[(long long)mid * SEG_FIELDS] <= chunk) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// The pool slot that takes a segment's state after its chunk ci: its checkpoint after each
// `every` whole chunks of its rows, or -1 (none there, or table[ckpt + j] = -1: skipped).
__device__ __forceinline__ int checkpoint_slot(const int* __restrict__ table, const Segment& sg,
                                               int ci) {
    if (!sg.every || (ci + 1) % sg.every || (ci + 1) * CHUNK > sg.rows) return -1;
    return table[sg.ckpt + (ci + 1) / sg.every - 1];
}
