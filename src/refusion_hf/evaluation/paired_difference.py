"""The accuracy difference of two decodings scored on the same problems, with a confidence interval that uses the
pairing (Python's `statistics` does the arithmetic).

Each problem gives one difference d_i = a_i - b_i of the two scores (for exact-match scores -1, 0 or +1). The
estimate is their mean; the interval is the normal one on that mean, mean +- z * s / sqrt(n), with s the sample
standard deviation of the d_i (n - 1 in the denominator) and z the standard normal quantile of the level. Pairing
removes the spread the two decodings share (problems both solve or both miss), so it is narrower than an interval
from two independent accuracies. It needs some hundreds of problems to be trusted (the normal approximation of a
mean of -1/0/+1 values); where every problem has the same difference the standard deviation is 0 and the interval
is that single value.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

DEFAULT_LEVEL = 0.95
METHOD = "normal interval on the mean of per-problem differences (paired: same problems)"


def paired_difference(first: Sequence[float], second: Sequence[float], level: float = DEFAULT_LEVEL) -> dict:
    """Mean of `first[i] - second[i]` over the problems, its standard error and the `level` interval.

    Raises ValueError unless both have the same length >= 2 and 0 < level < 1.
    """
    if len(first) != len(second):
        raise ValueError(f"paired scores need one per problem on both sides, got {len(first)} and {len(second)}.")
    if len(first) < 2:
        raise ValueError(f"an interval needs at least 2 paired problems, got {len(first)}.")
    if not 0 < level < 1:
        raise ValueError(f"`level` must be between 0 and 1, got {level}.")
    differences = [float(a) - float(b) for a, b in zip(first, second)]
    n = len(differences)
    mean = statistics.fmean(differences)
    standard_error = statistics.stdev(differences) / math.sqrt(n)
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
    return {
        "difference": mean,
        "standard_error": standard_error,
        "low": mean - z * standard_error,
        "high": mean + z * standard_error,
        "level": level,
        "num_problems": n,
        "first_better": sum(d > 0 for d in differences),
        "second_better": sum(d < 0 for d in differences),
        "method": METHOD,
    }
