class UserError(Exception):
    """A mistake the user can fix (bad option, missing file, ...).

    The CLI prints its message as one line and exits with code 2; library
    callers get an ordinary exception with the same message.
    """
