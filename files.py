"""Where every file is read and written: a failure is one UserError naming the file, and a write goes through a
temporary file renamed over the old one, so that a crash or a full disk never leaves half a file."""
import contextlib
import errno
import os

from model import UserError

# errors only writing meets: disk or quota full, file too large, read-only file system
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)

def reason(e):
    """what went wrong, in a few words"""
    if isinstance(e, KeyError):
        return f"it has no {e.args[0]!r}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__

@contextlib.contextmanager
def reading(path, message="could not read {path}: {reason}", errors=Exception):
    """Where a named file (or a download) is read: whatever fails inside (`errors`) becomes one UserError,
    `message` filled in with path, the reason and the kind of error."""
    try:
        yield
    except UserError:
        raise
    except errors as e:
        raise UserError(message.format(path=path, reason=reason(e), kind=type(e).__name__)) from None

def write_failure(e):
    """the OSError behind e that only writing meets (torch's zip writer wraps it in a RuntimeError), or None"""
    while e is not None and not (isinstance(e, OSError) and e.errno in WRITE_ERRNOS):
        e = e.__context__
    return e

def write_error(path, e):
    kept = f"; the previous {os.path.basename(path)} is unchanged" if os.path.exists(path) else ""
    return UserError(f"could not write {path}: {reason(e)}{kept}")

@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Where every file is written: into path.tmp, renamed over path once complete. A failure to write is one
    UserError naming path; other errors (reading an input, say) stay the caller's."""
    try:
        f = open(path + ".tmp", mode)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(f.name, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            f.close()  # flushes, which may fail again as the write did
        with contextlib.suppress(OSError):
            os.remove(f.name)
        failure = write_failure(e)
        if failure is None:
            raise
        raise write_error(path, failure) from None
