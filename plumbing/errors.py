"""The project-wide user-error type.

`tinyllm.py` and the scripts catch it and print one line on stderr with exit code 2; anything
else is a bug and keeps its traceback.

    >>> str(UsageError("model.n_layer must be positive, got 0"))
    'model.n_layer must be positive, got 0'
"""


class UsageError(ValueError):
    """A mistake the user can fix: bad input, a missing file, a bad config value."""


def first_line(err: BaseException) -> str:
    """A library's error as one line of ours: its message's first line, else its type's name.

    >>> first_line(OSError("unreachable\\nretried 5 times"))
    'unreachable'
    """
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
