"""The project-wide user-error type.

It lives in the lowest layer (the tokenizer package has no project dependencies) so that every
package can raise it. `tinyllm.py` catches it and prints one line on stderr with exit code 2;
anything else is a bug and keeps its traceback.
"""


class UsageError(ValueError):
    """A mistake the user can fix: bad input, a missing file, a bad config value."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped and kept its last good checkpoint."""
