"""
What each script imports first, before its slow imports: from then on an error the user can fix
(UserError, an OS error on a file, running out of memory) is one line `error: ...` on stderr, not a
traceback, and so are Ctrl-C and SIGTERM. Under torchrun, rank 0 says the line again, last. While
the script imports, either signal stops it at once; configurator.py makes them a KeyboardInterrupt.
"""
import atexit
import contextlib
import os
import select
import signal
import sys

INTERRUPTED = "interrupted: what was finished is kept; run the same command again to go on"

def one_line(exc_type, exc):
    """what the hook prints for an exception, or None for a traceback: bad input, an OS error on a
    file, running out of memory, Ctrl-C"""
    lines = str(exc).strip().splitlines() or [exc_type.__name__]
    if exc_type.__name__ == "UserError":
        return f"error: {exc}"
    if issubclass(exc_type, KeyboardInterrupt):
        return INTERRUPTED
    if issubclass(exc_type, OSError) and exc.strerror:
        names = " -> ".join(str(name) for name in (exc.filename, exc.filename2) if name is not None)
        return f"error: {names + ': ' if names else ''}{exc.strerror}"
    # torch's OutOfMemoryError is a GPU's; on a CPU torch raises a RuntimeError
    if issubclass(exc_type, MemoryError) or exc_type.__name__ == "OutOfMemoryError" or (
            issubclass(exc_type, RuntimeError) and "can't allocate memory" in lines[0]):
        return (f"error: out of memory ({lines[0][:120]}): lower batch_size, input_length or the "
                f"model, or raise grad_accum_steps (the same batch in smaller micro-batches)")

def print_user_errors(exc_type, exc, tb, _default=sys.excepthook):
    # no sys.exit: torchrun wraps this hook to prefix each line, and an exit would lose it
    for s in (signal.SIGINT, signal.SIGTERM):  # from here, no signal (torchrun's, as another rank
        signal.signal(s, signal.SIG_IGN)  # fails too) cuts the line short
    message = None
    with contextlib.suppress(Exception):  # whatever the exception holds, the hook itself never fails
        message = one_line(exc_type, exc)
    if message is None:
        return _default(exc_type, exc, tb)
    print(message, file=sys.stderr)
    say_last(message)
    atexit.register(leave, 130 if issubclass(exc_type, KeyboardInterrupt) else 1)

def leave(code):
    """Under torchrun, the rank ends at once, its output flushed: a collective it left would hang
    the interpreter's clean-up until torchrun kills it."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

def say_last(message):
    """Under torchrun, rank 0 says message again after torchrun's own report, which comes once the
    ranks exit: a child, out of the rank's process group (which torchrun stops), waits for torchrun
    to exit and says it, last."""
    if not (os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK") == "0"):
        return
    launcher = os.getppid()
    if os.fork() == 0:
        os.setsid()
        with contextlib.suppress(AttributeError, OSError):  # no pidfd on this OS, or torchrun gone already
            select.select([os.pidfd_open(launcher)], [], [])  # readable once it has exited
        os.write(2, f"{message}\n".encode())
        os._exit(0)

def interrupted_while_starting(signum, frame):
    # while the script imports: nothing to clean up yet, and a library's bare `except:` could
    # swallow the KeyboardInterrupt, and the program go on
    os.write(2, f"{INTERRUPTED}\n".encode())
    say_last(INTERRUPTED)
    os._exit(128 + signum)

sys.excepthook = print_user_errors
for _signal in (signal.SIGINT, signal.SIGTERM):
    if signal.getsignal(_signal) in (signal.default_int_handler, signal.SIG_DFL):  # not if ignored
        signal.signal(_signal, interrupted_while_starting)
