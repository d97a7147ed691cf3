"""One exception type for every user-facing mistake.

The CLI turns a LongattnError into one line on stderr and exit code 2, no traceback.
Library code raises it for bad input (missing checkpoint, impossible setting) with a
message that says what is wrong and what to do.
"""


class LongattnError(Exception):
    """A user-facing error: bad input, a missing or corrupt file, an impossible setting."""


def check_int(name: str, value, minimum=0, *, allow_none: bool = False):
    """Return ``value`` when it is a plain int (bools refused) of at least ``minimum``.

    Args:
        name: how the message names the value, with any context ("ring cache window").
        minimum: the smallest allowed value; None allows any integer.
        allow_none: let None through unchanged (e.g. a window that is off).

    Raises:
        LongattnError: one line naming the value, what it must be, and what it got.
    """
    if value is None and allow_none:
        return None
    if (isinstance(value, bool) or not isinstance(value, int)
            or (minimum is not None and value < minimum)):
        want = ("an integer" if minimum is None else
                "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}")
        raise LongattnError(f"{name} must be {want}, got {value!r}")
    return value
