"""KdaError: the one exception kdarun raises for bad input or bad use; `check_int`, the one
check of an integer argument, and `check_ints` / `check_flags` of host sequences of integers /
flags (`is_host_sequence`: what counts as one); `check_slot_tables`, the one check of a batch's
slot tables; `format_bytes` for the sizes messages give. It sits at the bottom of the package
and imports nothing of it, so every module may raise it."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np


class KdaError(Exception):
    """Every error kdarun raises for bad input or bad use; the message says what, where,
    expected vs actual."""


def check_int(value: object, what: str, low: int | None = None,
              high: int | None = None) -> int:
    """`value` as an int when it is an integer (a Python or NumPy one, not a bool) within
    [low, high] (either end may be open: None); else a KdaError naming `what`."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok:
        value = int(value)
        ok = (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        if high is None:
            want = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"
                    }.get(low, f"an integer >= {low}")
        else:
            want = f"an integer in [{low}, {high}]" if low is not None else \
                f"an integer <= {high}"
        raise KdaError(f"{what} must be {want}, got {value!r}")
    return value


def is_host_sequence(values: object) -> bool:
    """An ordered host container (list, tuple, range, 1-D array, ...), not a string, a set or
    a dict, whose order would be arbitrary, nor a 0-d or 2-D array."""
    if isinstance(values, np.ndarray):
        return values.ndim == 1
    return isinstance(values, Sequence) and not isinstance(values, (str, bytes))


def int_array(values: object) -> np.ndarray | None:
    """A new int64 array [n] of `values` when it is a list or tuple of Python ints or a 1-D
    NumPy integer array (not a subclass such as a masked array) whose values fit int64; else
    None, and the caller checks entry by entry for its message (a bool, a float, a NumPy
    scalar, another container). One pass in C where a loop of `check_int` would take a
    microsecond an entry: a pack of many sequences is checked in microseconds."""
    if type(values) is np.ndarray:
        ok = values.ndim == 1 and (values.dtype.kind == "i" or (
            values.dtype.kind == "u" and (not len(values) or int(values.max()) < 2**63)))
    elif type(values) in (list, tuple):
        ok = {*map(type, values)} <= {int}  # bools are not ints here
    else:
        ok = False
    if not ok:
        return None
    try:
        return np.array(values, np.int64)
    except OverflowError:  # a Python int past int64: no table holds it
        return None


def check_flags(values: object, what: str) -> np.ndarray:
    """`values` (a host sequence of True / False: Python or NumPy bools) as a new bool array
    [n]; else a KdaError naming the first entry that is not one."""
    if not is_host_sequence(values):
        raise KdaError(f"{what} must be a host sequence of True / False (list, tuple or "
                       f"array), got {values!r}")
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype == np.bool_:
        return values.copy()
    if type(values) not in (list, tuple) or not {*map(type, values)} <= {bool, np.bool_}:
        bad = [f for f in values if not isinstance(f, (bool, np.bool_))]
        if bad:
            raise KdaError(f"{what} must hold True or False, got {bad[0]!r}")
    return np.fromiter(values, bool, len(values))


def check_ints(values: object, what: str, low: int | None = None,
               high: int | None = None) -> np.ndarray:
    """`values` (a host sequence of integers, not bools) as an int64 array [n] when every
    entry is within [low, high]; else `check_int`'s KdaError for the first entry that is not,
    named what[i]."""
    if not is_host_sequence(values):
        raise KdaError(f"{what} must be a host sequence of integers (list, tuple or array), "
                       f"got {values!r}")
    arr = int_array(values)
    if arr is not None and (not len(arr) or ((low is None or arr.min() >= low) and
                                             (high is None or arr.max() <= high))):
        return arr
    checked = [check_int(v, f"{what}[{i}]", low, high) for i, v in enumerate(values)]
    try:  # a list of NumPy scalars, say: valid, only not one of int_array's forms
        return np.array(checked, np.int64)
    except OverflowError:
        raise KdaError(f"{what} must be integers that fit int64, got "
                       f"{max(checked, key=abs)}") from None


def check_slot_tables(what: str, slots, snaps=None, nslots: int | None = None) -> None:
    """A batched call's slot tables as its kernels will read them: slots [b] and snapshot slots
    [b, k-1] (or None), integer arrays. A KdaError names the first problem: a slot that is
    neither -1 (a padding row) nor in [0, nslots) (not checked where nslots is None), a slot
    named twice, a snapshot slot named twice or equal to a slot of the batch (two writers of
    one slot race on a GPU)."""
    slots = [int(s) for s in slots]
    snap = [int(s) for s in (snaps.ravel() if snaps is not None else ())]
    for kind, table in (("slot", slots), ("snapshot slot", snap)):
        for i, s in enumerate(table):
            if s < -1 or (nslots is not None and s >= nslots):
                within = f"[0, {nslots})" if nslots is not None else "the pool"
                raise KdaError(f"{what}: {kind} {s} at entry {i} is neither -1 (skip) nor a "
                               f"slot in {within}")
    seen: dict[int, str] = {}
    for kind, table in (("slot", slots), ("snapshot slot", snap)):
        for i, s in enumerate(table):
            if s < 0:
                continue
            if s in seen:
                raise KdaError(f"{what}: pool slot {s} is named twice ({seen[s]} and {kind} "
                               f"entry {i}); a slot may be written by one row of a batch only")
            seen[s] = f"{kind} entry {i}"


def format_bytes(n: int) -> str:
    """A byte count for messages: `1.50 GiB`, `300.0 MiB`, `12 bytes`."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n} bytes"
