"""Environment variables, read by name and checked: a wrong value stops with a message that
names the variable, what it means and an example, never a bare ValueError.

    env_flag("PDIST_TRACE", True)                                  # 1/true/yes/on, 0/false/no/off
    env_number("PDIST_TIMEOUT", None, "number of seconds", 120)    # a finite number > 0
"""
import math
import numbers
import os

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name, default):
    """A boolean environment variable: 1/true/yes/on or 0/false/no/off (any case);
    ``default`` when unset or empty. Anything else raises a ValueError that names
    the variable and the values it accepts."""
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return bool(default)
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of 0/1/false/true/no/yes/off/on")


def env_number(name, default, what, example, integer=False, zero_ok=False):
    """A numeric environment variable: ``default`` when unset or empty, else a finite number
    > 0 (>= 0 with ``zero_ok``; an integer with ``integer``). Anything else (abc, nan, inf,
    0, -1) raises a ValueError naming the variable, what it means and an example:
    ``PDIST_TIMEOUT='abc': must be a positive number of seconds, e.g. PDIST_TIMEOUT=120``."""
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    return check_number(raw, f"{name}={os.environ[name]!r}", what, f"{name}={example}", integer, zero_ok)


def check_number(value, label, what, example, integer=False, zero_ok=False):
    """``value`` (a number or its text) as a finite number > 0 (>= 0 with ``zero_ok``; an int
    with ``integer``), else a ValueError: ``{label}: must be a positive {what}, e.g. {example}``."""
    sign = "non-negative" if zero_ok else "positive"
    v = float("nan")
    if isinstance(value, str):
        text = value.strip()
        try:
            v = int(text) if integer and text.lstrip("+-").isdigit() else (v if integer else float(text))
        except ValueError:
            pass
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and (
            not integer or isinstance(value, numbers.Integral)):
        v = value
    if not (math.isfinite(v) and (v >= 0 if zero_ok else v > 0)):
        raise ValueError(f"{label}: must be a {sign} {what}, e.g. {example}")
    return v
