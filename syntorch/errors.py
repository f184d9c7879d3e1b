"""What goes wrong in a command, and how a command reports it: every entry point (`syntorch <command>`,
`python -m syntorch.train`) runs through `run_command`, so each failure reads and exits the same way."""
import os
import signal
import sys


class UserError(Exception):
    """A mistake the user can fix (bad option, missing file, ...).

    The CLI prints its message as one line and exits with code 2; library
    callers get an ordinary exception with the same message.
    """


class RankFailed(RuntimeError):
    """A rank of a multi-rank run raised, died or stopped responding; the others were stopped.

    The message names the rank and the cause; the CLI prints it like a UserError (one line, exit code 2).
    """


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so every `finally` runs: spawned
    ranks are stopped (parallel.launch.spawn) and temporary output folders removed (outdir)."""


def _terminate(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeated SIGTERM must not cut short the cleanup it asks for
    raise Terminated


def run_command(name: str, run) -> int:
    """`run()`'s exit code, with every way it can end as one line on stderr: a user's mistake or a failed rank
    (exit 2), Ctrl-C (130), SIGTERM (143), stdout closed by its reader (1, quietly)."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return run() or 0
    except (UserError, RankFailed) as e:  # a rank that raised, died or stopped reads like a user's error
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{name}: terminated", file=sys.stderr)
        return 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended
    except BrokenPipeError:  # stdout piped into a reader that stopped (`| head`): not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not fail again
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
