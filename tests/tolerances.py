"""Tolerances shared by the tests, each with the error model that justifies it.

Unit roundoff: float32 arithmetic rounds each operation with relative error <= EPS32 / 2.
"""

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


def quantizer_slack(x, minimum, scale, levels):
    """Float32 slack on top of the quantizer's exact error bound (scale / 2 or scale).

    Codes are t = (x - m) / s computed in float32: the subtraction and the division each round
    with relative error EPS32 / 2, moving t by at most EPS32 * (|x| + |m|) / s + EPS32 * levels,
    i.e. the reconstruction by EPS32 * (|x| + |m| + levels * s). A factor 4 covers the float32
    rounding of the stored-scale computation and of the reconstruction itself.
    """
    return 4 * EPS32 * (np.abs(x) + np.abs(minimum) + levels * np.abs(scale))


def identity_tolerance(num_terms, magnitude):
    """Bound on |fl(sum of num_terms products of <= 3 float32 factors) - exact sum|.

    Standard summation analysis: any evaluation order of n such terms has error
    <= gamma_{n+2} * sum |term|, gamma_k = k u / (1 - k u), u = EPS32 / 2. Using EPS32 instead of
    u covers the 1 / (1 - k u) factor. `magnitude` is sum |term| computed in float64.
    """
    return (num_terms + 2) * EPS32 * magnitude
