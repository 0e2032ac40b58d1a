"""The one exception type the CLI turns into a one-line message and a nonzero exit."""


class AtomError(Exception):
    """A problem the user can fix: bad input, a missing file, an invalid value.

    The message names the file or field at fault and fits on one line.
    """
