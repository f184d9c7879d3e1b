class UserError(Exception):
    """A mistake the user can fix (bad option, missing file, ...).

    The CLI prints its message as one line and exits with code 2; library
    callers get an ordinary exception with the same message.
    """


class RankFailed(RuntimeError):
    """A rank of a multi-rank run raised, died or stopped responding; the others were stopped.

    The message names the rank and the cause; the CLI prints it like a UserError (one line, exit code 2).
    """
