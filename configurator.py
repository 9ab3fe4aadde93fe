"""
Poor man's configurator, after nanoGPT. A script defines its config as module-level globals, then runs
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
which applies, in order, every config file named on the command line and every --key=value override:
    python train.py config/t5_tiny.py --batch_size=16 --compile=False
Config files are plain Python assignments. Unlike nanoGPT, mistakes are caught here instead of silently
creating a new global: an unknown key names the closest valid one, a value of the wrong type or a missing
config file is refused, each with one line on stderr and exit code 2. Afterwards `config` holds every
final value, for logging and checkpoints.

A script declares each key's valid values below the group of defaults it belongs to, in a dict named `valid`:
    batch_size = 128
    lr_schedule = "cosine"
    valid.update(batch_size="> 0", lr_schedule=("cosine", "inverse_sqrt", "constant"))
A rule is one of
    "> 0", ">= 1", "< 1", "<= 1"   one comparison
    "in (0, 1)", "in [0, 1)"       an interval; a square bracket includes its end, a round one excludes it
    "non-empty", "any"             for strings (and "any" for bools and free text)
    a tuple                        the allowed values
    a function                     the owner of the name checks it, e.g. T5Config.from_preset for a model preset; it
                                   raises UserError with its own message (exit code 1, as when the script calls it)
and the final values are checked before the script does anything else: a violation is one line naming the key,
its value and the rule, exit code 2. When a script has `valid`, every key must be in it.
"""
import ast as _ast
import difflib as _difflib
import operator as _operator
import sys as _sys


def _config_error(msg):
    print(f"error: {msg}", file=_sys.stderr)
    _sys.exit(2)


def _print_user_errors(exc_type, exc, tb, _default=_sys.excepthook):
    # bad input (missing data, vocab mismatch, corrupt checkpoint...) is raised as model.UserError deep inside the
    # libraries; the user needs its one-line message, not a traceback through torch. Python then exits with code 1.
    # No sys.exit here: under torchrun, torch.distributed wraps this hook to prefix each line with the rank, and an
    # exit from inside it would swallow the message.
    if exc_type.__name__ == "UserError":
        print(f"error: {exc}", file=_sys.stderr)
    elif issubclass(exc_type, OSError) and exc.strerror:
        # a file or folder that could not be read or written (missing, no permission, disk full...) that no more
        # specific message caught: its name and the operating system's reason say what to fix
        names = " -> ".join(str(name) for name in (exc.filename, exc.filename2) if name is not None)
        print(f"error: {names + ': ' if names else ''}{exc.strerror}", file=_sys.stderr)
    else:
        _default(exc_type, exc, tb)


_sys.excepthook = _print_user_errors
_config_types = (int, float, bool, str, type(None))
# config keys are the script's lower-case globals of these types; UPPER_CASE ones are constants
_defaults = {k: v for k, v in globals().items()
             if not k.startswith("_") and not k.isupper() and isinstance(v, _config_types)}


def _check(key, value, source):
    if key not in _defaults:
        close = _difflib.get_close_matches(key, _defaults, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        _config_error(f"unknown config key '{key}' in {source}{hint}")
    default = _defaults[key]
    if default is None or type(value) is type(default):
        return value
    if isinstance(default, float) and type(value) is int:
        return float(value)  # lr=1 means lr=1.0
    if isinstance(default, str):
        return str(value)  # --out_dir=2024 is a folder name, not a number
    _config_error(f"config key '{key}' in {source} must be {type(default).__name__}, got {value!r}")


for _arg in _sys.argv[1:]:
    if not _arg.startswith("--"):
        try:
            with open(_arg, encoding="utf-8") as _f:
                _source = _f.read()
        except FileNotFoundError:
            _config_error(f"config file '{_arg}' not found (pass a path such as config/t5_tiny.py)")
        except OSError as _e:
            _config_error(f"config file '{_arg}' can't be read: {_e.strerror}")
        except UnicodeDecodeError:
            _config_error(f"config file '{_arg}' is not UTF-8 text: pass a Python file such as config/t5_tiny.py")
        _file_globals = {}
        try:
            exec(_source, _file_globals)
        except Exception as _e:
            _config_error(f"config file '{_arg}' failed: {type(_e).__name__}: {_e}")
        for _key, _value in _file_globals.items():
            if not _key.startswith("_") and isinstance(_value, _config_types):
                globals()[_key] = _check(_key, _value, _arg)
    else:
        if "=" not in _arg:
            _config_error(f"'{_arg}' needs a value: write --key=value")
        _key, _value = _arg[2:].split("=", 1)
        try:
            _value = _ast.literal_eval(_value)
        except (SyntaxError, ValueError):
            pass  # a bare word such as --optimizer=adafactor stays a string
        globals()[_key] = _check(_key, _value, f"--{_key}")


def _satisfies(value, rule):
    if isinstance(rule, tuple):
        return value in rule
    if rule in ("any", "non-empty"):
        return rule == "any" or value != ""
    op, bound = rule.split(" ", 1)
    if op == "in":  # "in (0, 1]": the brackets say whether each end belongs to the interval
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
        if callable(rule):
            rule(value)
        elif not _satisfies(value, rule):
            if isinstance(rule, tuple):
                close = _difflib.get_close_matches(str(value), [str(choice) for choice in rule], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                rule = "one of " + ", ".join(repr(choice) for choice in rule) + hint
            _config_error(f"config key '{key}' is {value!r}; it must be {rule}")


if isinstance(globals().get("valid"), dict):
    _check_valid(globals()["valid"])
config = {k: globals()[k] for k in _defaults}
