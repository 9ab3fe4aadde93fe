"""
Poor man's configurator, after nanoGPT. A script defines its config as globals, then runs
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
to apply config files (Python assignments), then --key=value overrides, and to check each key's rule
in its dict `valid`: "> 0", "in [0, 1)", "non-empty", "any", "folder", a tuple of values, or a
function raising UserError. A key whose default is a string takes the text as typed, others a Python
literal. A mistake stops the script with one line, exit code 2. Then `config` holds the values,
`given_at` each given key's position. Imported first, before the slow imports, this file only installs
the hook that prints an error, or Ctrl-C, as one line.
"""
import ast as _ast
import difflib as _difflib
import math as _math
import operator as _operator
import os as _os
import select as _select
import signal as _signal
import sys as _sys

INTERRUPTED = "interrupted: what was finished is kept; run the same command again to go on"

def _one_line(exc_type, exc):
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
    if issubclass(exc_type, MemoryError) or exc_type.__name__ == "OutOfMemoryError" or (
            issubclass(exc_type, RuntimeError) and "can't allocate memory" in lines[0]):  # torch on a CPU
        return (f"error: out of memory ({lines[0][:120]}): lower batch_size, input_length or the model, "
                f"or raise grad_accum_steps (the same batch in smaller micro-batches)")

def _print_user_errors(exc_type, exc, tb, _default=_sys.excepthook):
    # no sys.exit: torchrun wraps this hook to prefix each line, and an exit would lose it
    try:
        message = _one_line(exc_type, exc)
    except Exception:  # whatever the exception holds, the hook itself never fails
        message = None
    if message is None:
        return _default(exc_type, exc, tb)
    print(message, file=_sys.stderr)
    if _os.environ.get("TORCHELASTIC_RUN_ID") and _os.environ.get("RANK") == "0":
        # torchrun reports after the ranks exit: a child, out of the rank's process group (which
        # torchrun stops), waits for torchrun to exit and says it again, last
        launcher = _os.getppid()
        if _os.fork() == 0:
            _os.setsid()
            try:
                _select.select([_os.pidfd_open(launcher)], [], [])  # readable once it has exited
            except (AttributeError, OSError):  # no pidfd on this OS, or torchrun gone already
                pass
            _os.write(2, f"{message}\n".encode())
            _os._exit(0)

def _interrupted_while_starting(signum, frame):
    # while the script imports: nothing to clean up yet, and a library's bare `except:` could swallow
    # the KeyboardInterrupt, and the program go on
    _os.write(2, f"{INTERRUPTED}\n".encode())
    _os._exit(130)

_sys.excepthook = _print_user_errors
if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:  # not where the caller ignores it
    _signal.signal(_signal.SIGINT, _interrupted_while_starting)

def _config_error(msg):
    print(f"error: {msg}", file=_sys.stderr)
    _sys.exit(2)

def _shown(value):  # a value in a message: not all of a 5,000-word one
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

def _check(key, value, source, position):
    if key not in _defaults:
        close = _difflib.get_close_matches(key, _defaults, n=1)
        _config_error(f"unknown config key '{key}' in {source}{f' (did you mean {close[0]!r}?)' if close else ''}")
    given_at[key] = position
    default = _defaults[key]
    if default is None or type(value) is type(default):
        return value
    if isinstance(default, float) and type(value) is int:
        return float(value)  # lr=1 means lr=1.0
    _config_error(f"config key '{key}' in {source} must be {type(default).__name__}, got {_shown(value)}")

def _read_config_file(path):
    python = "config files are Python assignments (key = value), such as config/t5_tiny.py"
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = _ast.parse(source, path)
    except FileNotFoundError:
        _config_error(f"config file '{path}' not found (pass a path such as config/t5_tiny.py)")
    except OSError as e:
        _config_error(f"config file '{path}' can't be read: {e.strerror}")
    except (UnicodeDecodeError, SyntaxError, ValueError) as e:
        kind = "UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"Python ({e})"
        _config_error(f"config file '{path}' is not {kind}: {python}")
    for node in tree.body:  # assignments, or a call such as exec(open(...).read()), or a docstring
        if not (isinstance(node, (_ast.Assign, _ast.AugAssign)) or isinstance(node, _ast.AnnAssign) and node.value
                or isinstance(node, _ast.Expr) and isinstance(node.value, (_ast.Call, _ast.Constant))):
            _config_error(f"config file '{path}' line {node.lineno} is not an assignment: {python}")
    settings = {}
    try:
        exec(source, settings)
    except Exception as e:
        _config_error(f"config file '{path}' failed: {type(e).__name__}: {e}")
    settings = {k: v for k, v in settings.items() if not k.startswith("_") and isinstance(v, _config_types)}
    return settings or _config_error(f"config file '{path}' sets no config key: {python}")

def _satisfies(value, rule):
    if isinstance(rule, tuple):
        return value in rule
    if rule in ("any", "non-empty", "folder"):
        return rule == "any" or value != "" and (rule == "non-empty" or not _os.path.isfile(value))
    op, bound = rule.split(" ", 1)
    if op == "in":  # "in (0, 1]": a square bracket includes its end
        low, high = (_ast.literal_eval(end) for end in bound[1:-1].split(","))
        above = low < value or (bound[0] == "[" and low == value)
        return above and (value < high or (bound[-1] == "]" and value == high))
    compare = {">": _operator.gt, ">=": _operator.ge, "<": _operator.lt, "<=": _operator.le}[op]
    return compare(value, _ast.literal_eval(bound))

def _check_valid(rules):
    missing = [key for key in _defaults if key not in rules]
    if missing:  # a bug in the script, not bad input: the traceback points at it
        raise RuntimeError(f"config keys without a rule in `valid`: {', '.join(missing)}")
    for key, rule in rules.items():
        value = globals()[key]
        if isinstance(value, float) and not _math.isfinite(value):
            _config_error(f"config key '{key}' is {value!r}; it must be a finite number")
        if isinstance(value, int) and not -2**63 <= value < 2**63:  # what torch and numpy take
            _config_error(f"config key '{key}' is {value}; it must be below 2**63")
        if callable(rule):
            rule(value)
        elif not _satisfies(value, rule):
            if isinstance(rule, tuple):
                close = _difflib.get_close_matches(str(value), [str(choice) for choice in rule], n=1)
                rule = "one of " + ", ".join(map(repr, rule)) + (f" (did you mean {close[0]!r}?)" if close else "")
            if rule == "folder":
                rule = "non-empty" if value == "" else "a folder, not a file"
            _config_error(f"config key '{key}' is {_shown(value)}; it must be {rule}")

if __name__ != "configurator":  # exec'd by a script, not imported: its config, from the command line
    if _signal.getsignal(_signal.SIGINT) is not _signal.SIG_IGN:  # Ctrl-C: a KeyboardInterrupt again
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    _config_types = (int, float, bool, str, type(None))
    # config keys are the script's lower-case globals of these types; UPPER_CASE ones are constants
    _defaults = {k: v for k, v in globals().items()
                 if not k.startswith("_") and not k.isupper() and isinstance(v, _config_types)}
    given_at = {}
    _typed = None  # the first --key=value: a config file after it would override it unseen
    for _position, _arg in enumerate(_sys.argv[1:], 1):
        if not _arg.startswith("--"):
            if _typed:
                _config_error(f"config file '{_arg}' comes after {_typed}, which it could override: name "
                              f"config files first, then --key=value")
            for _key, _value in _read_config_file(_arg).items():
                globals()[_key] = _check(_key, _value, _arg, _position)
            continue
        if "=" not in _arg:
            _config_error(f"'{_arg}' needs a value: write --key=value")
        _typed = _typed or _arg.split("=")[0]
        _key, _value = _arg[2:].split("=", 1)
        if not isinstance(_defaults.get(_key), str):  # a string key takes the text as typed
            try:
                _value = _ast.literal_eval(_value)
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                pass  # a bare word such as --optimizer=adafactor, which _check refuses where not a string
        globals()[_key] = _check(_key, _value, f"--{_key}", _position)
    if isinstance(globals().get("valid"), dict):
        _check_valid(globals()["valid"])
    config = {k: globals()[k] for k in _defaults}
