"""KdaError: the one exception kdarun raises for bad input or bad use. It sits at the bottom
of the package and imports nothing, so every module may raise it."""


class KdaError(Exception):
    """Every error kdarun raises for bad input or bad use; the message says what, where,
    expected vs actual."""
