"""Maximum-weight perfect matching of a small square matrix (the Hungarian method).

Used to relabel EPLB's nodes and GPUs so that experts stay where they are. The matrices
are small (nodes x nodes, GPUs per node x GPUs per node), so plain Python on lists is
faster than tensor code here and exact on integers.
"""

from __future__ import annotations

__all__ = ["max_weight_assignment"]


def max_weight_assignment(weight: list[list[int]]) -> list[int]:
    """A permutation ``perm`` maximising ``sum_i weight[i][perm[i]]``.

    Shortest augmenting paths with potentials (Kuhn-Munkres, ``O(n^3)``) on the cost
    ``-weight``. Deterministic: the same matrix gives the same permutation. Among equally
    good permutations the result is whichever the search meets first; callers that want
    a preferred one (e.g. the identity) add a small bonus to its entries.

    Args:
        weight: ``n x n`` numbers (ints or floats), ``n >= 1``.
    Returns:
        ``perm`` with ``perm[row] = column``.
    """
    n = len(weight)
    if n == 0 or any(len(row) != n for row in weight):
        raise ValueError(f"weight must be a non-empty square matrix, got {n} rows of lengths "
                         f"{sorted({len(r) for r in weight})}")
    inf = float("inf")
    u = [0.0] * (n + 1)          # row potentials (1-based, 0 is the virtual start)
    v = [0.0] * (n + 1)          # column potentials
    match = [0] * (n + 1)        # match[col] = row matched to col (0: none)
    way = [0] * (n + 1)
    for row in range(1, n + 1):
        match[0] = row
        col0 = 0
        minv = [inf] * (n + 1)
        used = [False] * (n + 1)
        while True:
            used[col0] = True
            r0 = match[col0]
            delta, col1 = inf, 0
            w_row = weight[r0 - 1]
            for col in range(1, n + 1):
                if used[col]:
                    continue
                cur = -w_row[col - 1] - u[r0] - v[col]
                if cur < minv[col]:
                    minv[col], way[col] = cur, col0
                if minv[col] < delta:
                    delta, col1 = minv[col], col
            for col in range(n + 1):
                if used[col]:
                    u[match[col]] += delta
                    v[col] -= delta
                else:
                    minv[col] -= delta
            col0 = col1
            if match[col0] == 0:
                break
        while col0:                # augment along the path back to the start
            col1 = way[col0]
            match[col0] = match[col1]
            col0 = col1
    perm = [0] * n
    for col in range(1, n + 1):
        perm[match[col] - 1] = col - 1
    return perm
