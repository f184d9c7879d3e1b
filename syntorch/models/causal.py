"""How many (query, key) pairs a causal mask keeps: the models' masks carry it for the tracer's attention FLOPs
(trace/attention.py), which meta tensors cannot count from values. Here, below both, so the models need not
import the trace package."""


def causal_pairs(queries: int, keys: int, offset: int = 0, window: int = 0) -> int:
    """(query, key) pairs a causal mask keeps, the diagonal included: query i, at slot offset + i, attends
    keys j <= offset + i (only those with offset + i - j < window, given a sliding window). Plain integers: it
    runs inside traced code, where tensor ops would be recorded."""
    def seen(n: int) -> int:  # sum over x = 1..n of min(x, keys): keys up to slot x - 1
        return n * (n + 1) // 2 if n <= keys else keys * (keys + 1) // 2 + (n - keys) * keys

    def dropped(n: int) -> int:  # sum over x = 1..n of max(x - window, 0): keys the window left behind
        m = max(n - window, 0) if window else 0
        return m * (m + 1) // 2

    end = offset + queries
    return seen(end) - seen(offset) - (dropped(end) - dropped(offset))
