"""Finite differences, the independent check of every backward.

    dL/dw_i ~ (L(w + h e_i) - L(w - h e_i)) / 2h          (error O(h^2); use float64)

``central_difference(loss, w, i)`` perturbs ``w[i]`` in place (through a view,
so a non-contiguous input keeps its layout), calls ``loss()`` twice, restores
``w[i]`` and returns the quotient. Lesson 00 and the tests use it to check
analytic gradients.
"""


def central_difference(loss, array, index, h=1e-6):
    """(loss() at array[index] + h  -  loss() at array[index] - h) / 2h; array restored."""
    old = array[index]
    try:
        array[index] = old + h
        lp = float(loss())
        array[index] = old - h
        lm = float(loss())
    finally:
        array[index] = old
    return (lp - lm) / (2 * h)
