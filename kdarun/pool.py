"""KdaStatePool: the states of many sequences of one layer, a slot each, for serving.

One allocation holds every slot's recurrent state `[slots, H, D_v, D_k]` fp32 and one every
slot's conv state `[slots, W-1, conv_dim]` bf16, each slot laid out as `KdaSeqState`. The
batched calls take a device slot table (int32, one entry a sequence; -1 marks a padding row
that reads and writes no state), so a captured CUDA graph replays with new assignments. The
kernels never reach outside the pool: an entry that is neither -1 nor a slot acts as -1 and is
recorded in the pool's fault words, which `check_faults` (and `download`) turn into an error.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from .backend import DeviceOwner, DevicePtr, GpuBackend
from .config import Glm5NextKdaConfig, check_config
from .dtypes import BF16, F32, I32
from .errors import KdaError, check_int, check_slot_tables, int_array, is_host_sequence
from .state import KdaSeqState, conv_shape, recurrent_shape


class KdaStatePool(DeviceOwner):
    """`slots` sequences' states, zeroed on creation. After `free()` the pool, and every slot
    state `state(slot)` gave out, refuse every use."""

    _DEVICE_ATTRS = ("recurrent", "conv", "faults")
    FAULT_WORDS = 4  # faults: int32 {seen, table (0 slots, 1 snapshot slots), entry, value}

    def __init__(self, gpu: GpuBackend, cfg: Glm5NextKdaConfig, slots: int, stream: int = 0):
        self.cfg = check_config(cfg, "state pool")
        self.slots, self._gpu = check_int(slots, "state pool: slots", 1), gpu
        self.tp_rank: int | None = None  # as KdaSeqState.tp_rank: the rank whose heads it holds
        self._slot_ranks: dict[int, int | None] = {}  # each slot state's tp_rank (`state`)
        self.recurrent_nbytes = math.prod(recurrent_shape(cfg)) * F32.itemsize
        self.conv_nbytes = math.prod(conv_shape(cfg)) * BF16.itemsize
        gpu.check_free_memory(self.slots * (self.recurrent_nbytes + self.conv_nbytes),
                              f"a state pool of {self.slots} slots")
        self.recurrent = gpu.alloc(self.slots * self.recurrent_nbytes)  # [slots, H, Dv, Dk] fp32
        self.conv = gpu.alloc(self.slots * self.conv_nbytes)  # [slots, W-1, conv_dim] bf16
        gpu.memset(self.recurrent, 0, self.slots * self.recurrent_nbytes, stream)
        gpu.memset(self.conv, 0, self.slots * self.conv_nbytes, stream)
        self.faults = gpu.alloc(self.FAULT_WORDS * 4)  # the first bad table entry a kernel saw
        gpu.memset(self.faults, 0, self.FAULT_WORDS * 4, stream)

    def check_slots(self, slots: Sequence[int], what: str, skip: bool = False) -> None:
        """Every entry a slot of this pool, an integer in [0, slots), or -1 where `skip`:
        kernels index the pool with them unchecked."""
        self._require_live(what)
        if not is_host_sequence(slots):
            raise KdaError(f"{what}: pass the slots as a list or 1-D array of integers, got "
                           f"{slots!r}")
        low = -1 if skip else 0
        arr = int_array(slots)
        if arr is not None and (not len(arr) or (arr.min() >= low and arr.max() < self.slots)):
            return
        bad = [s for s in slots if not isinstance(s, (int, np.integer)) or isinstance(s, bool)
               or not low <= s < self.slots]
        if bad:
            raise KdaError(f"{what}: a slot must be an integer in [{low}, {self.slots})"
                           f"{' (-1 skips one)' if skip else ''}, got {bad[0]!r}"
                           f"{f' in {list(slots)[:16]}' if len(slots) > 1 else ''}")

    def _check(self, slot: int, method: str, arg: str = "slot") -> int:
        """`slot` as an int, else a KdaError naming the method and the argument."""
        self._require_live(method)
        self.check_slots([slot], f"state pool {method}: {arg}")
        return int(slot)

    def recurrent_at(self, slot: int) -> DevicePtr:
        return self.recurrent + self._check(slot, "recurrent_at") * self.recurrent_nbytes

    def conv_at(self, slot: int) -> DevicePtr:
        return self.conv + self._check(slot, "conv_at") * self.conv_nbytes

    def state(self, slot: int) -> KdaSeqState:
        """Slot `slot` as a `KdaSeqState` for the single-sequence calls (prefill, decode,
        decode_k); it shares the pool's memory, which `free` of the pool releases."""
        return self._slot_state(slot, "state")

    def _slot_state(self, slot: int, method: str) -> "_SlotState":
        return _SlotState(self, self._check(slot, method))

    def upload(self, slot: int, recurrent: np.ndarray, conv: np.ndarray, stream: int = 0) -> None:
        """Set one slot's states from host arrays of exactly the state shapes and dtypes."""
        self._slot_state(slot, "upload").upload(recurrent, conv, stream)

    def download(self, slot: int, stream: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(recurrent [H, Dv, Dk] fp32, conv [W-1, conv_dim] bf16) of one slot; synchronises.
        Raises `check_faults`' error first, as a slot's state may be stale after one."""
        state = self._slot_state(slot, "download")
        self.check_faults(stream, "state pool download")
        return state.download(stream)

    def check_faults(self, stream: int = 0, what: str = "state pool check_faults") -> None:
        """Raise a KdaError naming a slot table entry a batched call's kernels met that was
        neither -1 nor a slot of this pool (the first recorded), if any since the last check;
        the fault words are then cleared. A bad slot's row read and wrote no state (as a
        padding row), so its outputs are not its sequence's; a bad snapshot slot's snapshot
        was not stored (its row ran). The CUDA kernels record such entries rather than reach
        outside the pool; `check_tables` finds them (and twice-named slots) before a call
        instead. Synchronises."""
        self._require_live(what)
        seen, table, entry, value = self._gpu.download(self.faults, (self.FAULT_WORDS,),
                                                       np.int32, stream)
        if seen:
            self._gpu.memset(self.faults, 0, self.FAULT_WORDS * 4, stream)
            kind, lost = (("snapshot slot", "that snapshot was not stored") if table else
                          ("slot", "that row read and wrote no state, so its outputs are not "
                           "its sequence's"))
            raise KdaError(f"{what}: a batched call met {kind} {value} at entry {entry} of its "
                           f"table, neither -1 (skip) nor a slot in [0, {self.slots}); {lost}")

    def check_tables(self, slots: DevicePtr, b: int, snapshot_slots: DevicePtr | None = None,
                     k: int = 1, stream: int = 0, what: str = "state pool check_tables") -> None:
        """Check the device slot tables of a batched call (`decode_batch`: slots int32 [b];
        `verify_batch`: with snapshot_slots int32 [b, k-1]) as its kernels will read them:
        every entry -1 (a padding row, or a skipped snapshot) or a slot of this pool, and no
        slot named twice across both tables (`errors.check_slot_tables`). Nothing checks the
        tables before a CUDA call (that would copy them back and wait, which a captured graph
        cannot), and its kernels catch only entries outside the pool (`check_faults`): call
        this while developing, or on tables from code you do not trust.
        Copies the tables back and synchronises. `what` names the call in the error."""
        self._require_live(what)
        b = check_int(b, f"{what}: b", 1)
        k = check_int(k, f"{what}: k", 1)
        self.check_table_pointers(slots, b, snapshot_slots, k, what)
        table = self._gpu.download(slots, (b,), np.int32, stream)
        snaps = (self._gpu.download(snapshot_slots, (b, k - 1), np.int32, stream)
                 if snapshot_slots is not None and k > 1 else None)
        check_slot_tables(what, table, snaps, self.slots)

    def check_table_pointers(self, slots: DevicePtr, b: int, snapshot_slots: DevicePtr | None,
                             k: int, what: str) -> None:
        """What a batched call's tables are short of reading them: device pointers, not uploads
        of elements other than int32 (`GpuBackend.check_itemsize`), and slots [b] and
        snapshot_slots [b, k-1] inside their allocations where the backend knows them."""
        for ptr, n, name in ((slots, b, "slots"), (snapshot_slots, b * (k - 1), "snapshot_slots")):
            if ptr is None and name == "snapshot_slots":  # optional; slots is not
                continue
            DevicePtr.check(ptr, f"{what}: {name}")
            self._gpu.check_itemsize(ptr, I32, f"{what}: {name}")
            if n:
                self._gpu.check_region(ptr, n * I32.itemsize, f"{what}: {name}")

    def zero(self, slots: Sequence[int], stream: int = 0) -> None:
        """Zero the states of `slots` (a sequence of slots): new sequences start from there.
        Every slot is checked before any is zeroed."""
        self.check_slots(slots, "state pool zero")
        for s in slots:
            self._gpu.memset(self.recurrent_at(s), 0, self.recurrent_nbytes, stream)
            self._gpu.memset(self.conv_at(s), 0, self.conv_nbytes, stream)

    def copy(self, src: int, dst: int, stream: int = 0) -> None:
        """Slot dst's states become slot src's (forking a sequence, or keeping a snapshot)."""
        src, dst = self._check(src, "copy", "src"), self._check(dst, "copy", "dst")
        self._gpu.copy_d2d(self.recurrent_at(dst), self.recurrent_at(src), self.recurrent_nbytes,
                           stream)
        self._gpu.copy_d2d(self.conv_at(dst), self.conv_at(src), self.conv_nbytes, stream)

    def free(self) -> None:
        """Give back every slot's memory; the pool and its slot states refuse every use from
        then on."""
        with self._freeing():
            self._gpu.free(self.recurrent)
            self._gpu.free(self.conv)
            self._gpu.free(self.faults)


class _SlotState(KdaSeqState):
    """One slot of a pool, seen as a sequence's state: the pool owns the memory, and its
    addresses are read through the pool, so a freed pool's slot states refuse every use."""

    def __init__(self, pool: KdaStatePool, slot: int):  # noqa: super() would allocate
        self.cfg, self._gpu, self._pool, self._slot = pool.cfg, pool._gpu, pool, slot

    @property
    def recurrent(self) -> DevicePtr:
        return self._pool.recurrent + self._slot * self._pool.recurrent_nbytes

    @property
    def conv(self) -> DevicePtr:
        return self._pool.conv + self._slot * self._pool.conv_nbytes

    @property
    def tp_rank(self) -> int | None:  # kept by the pool, a slot's own (slot states are views)
        return self._pool._slot_ranks.get(self._slot)

    @tp_rank.setter
    def tp_rank(self, rank: int | None) -> None:
        self._pool._slot_ranks[self._slot] = rank

    def free(self) -> None:
        raise KdaError("a pool slot's state is freed with its pool (KdaStatePool.free)")
