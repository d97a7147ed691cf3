"""One exception type for every user-facing mistake.

The CLI turns a LongattnError into one line on stderr and exit code 2, no traceback.
Library code raises it for bad input (missing checkpoint, impossible setting) with a
message that says what is wrong and what to do.
"""


class LongattnError(Exception):
    """A user-facing error: bad input, a missing or corrupt file, an impossible setting."""
