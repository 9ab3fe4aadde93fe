"""Poor man's configurator, after nanoGPT, exec'd by a script after its config globals: config
files (Python assignments), then --key=value, each checked for its type and its rule in `valid`;
a mistake is one line, exit code 2. Then `config` holds the values, `given_at` their argv places."""
import ast as _ast
import contextlib as _contextlib
import difflib as _difflib
import math as _math
import os as _os
import signal as _signal
import sys as _sys

for _signum in (_signal.SIGINT, _signal.SIGTERM):  # the imports are done: Ctrl-C and SIGTERM
    if _signal.getsignal(_signum) is not _signal.SIG_IGN:
        _signal.signal(_signum, _signal.default_int_handler)  # raise KeyboardInterrupt

def _keys_of(namespace):  # config keys: lower-case names of these types; UPPER_CASE are constants
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not k.isupper() and isinstance(v, (int, float, bool, str))}

def _config_error(msg, word="", words=()):  # and the closest of words to word, if one is close
    close = _difflib.get_close_matches(str(word), [str(w) for w in words], n=1)
    print(f"error: {msg}" + (f" (did you mean {close[0]!r}?)" if close else ""), file=_sys.stderr)
    _sys.exit(2)

def _shown(value):  # a value in a message: not all of a 5,000-word one
    return repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."

def _set(key, value, source, position):
    if key not in _defaults:
        _config_error(f"unknown config key '{key}' in {source}", key, _defaults)
    if isinstance(_defaults[key], float) and type(value) is int:
        value = float(value)  # lr=1 means lr=1.0
    if type(value) is not type(_defaults[key]):
        _config_error(f"config key '{key}' in {source} must be {type(_defaults[key]).__name__}, "
                      f"got {_shown(value)}")
    globals()[key], given_at[key] = value, position

def _read_config_file(path):
    python = "config files are Python assignments (key = value), such as config/t5_tiny.py"
    try:
        source = open(path, encoding="utf-8").read()
        tree = _ast.parse(source, path)
    except FileNotFoundError:
        _config_error(f"config file '{path}' not found (pass a path such as config/t5_tiny.py)")
    except OSError as e:
        _config_error(f"config file '{path}' can't be read: {e.strerror}")
    except (SyntaxError, ValueError) as e:  # ValueError: not UTF-8, or a null byte
        kind = "UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"Python ({e})"
        _config_error(f"config file '{path}' is not {kind}: {python}")
    for node in tree.body:  # assignments (not `x: int` alone), calls such as exec(...), docstrings
        if not (isinstance(node, (_ast.Assign, _ast.AugAssign, _ast.AnnAssign)) and node.value or
                isinstance(node, _ast.Expr) and isinstance(node.value, (_ast.Call, _ast.Constant))):
            _config_error(f"config file '{path}' line {node.lineno} is not an assignment: {python}")
    try:
        exec(source, settings := {})
    except Exception as e:
        _config_error(f"config file '{path}' failed: {type(e).__name__}: {e}")
    return _keys_of(settings) or _config_error(f"config file '{path}' sets no config key: {python}")

def _satisfies(value, rule):  # rule: "any", "non-empty", "folder", "> 0", ">= 3", "in [0, 1)"...
    if rule in ("any", "non-empty", "folder"):
        return rule == "any" or value != "" and (rule == "non-empty" or not _os.path.isfile(value))
    # "in [0, 1)": its ends (a square bracket includes its end); "> 0" is (0, inf), ">= 3" [3, inf)
    low, high = map(float, rule[4:-1].split(",") if rule.startswith("in ") else (rule[2:], "inf"))
    above = low < value or rule.startswith((">=", "in [")) and value == low
    return above and (value < high or rule.endswith("]") and value == high)

_defaults, given_at = _keys_of(globals()), {}
for _position, _arg in enumerate(_sys.argv[1:], 1):
    if not _arg.startswith("--"):
        _typed = [arg.split("=")[0] for arg in _sys.argv[1:_position] if arg.startswith("--")]
        if _typed:  # a config file after a --key=value would override it unseen
            _config_error(f"config file '{_arg}' comes after {_typed[0]}, which it could override: "
                          f"name config files first, then --key=value")
        for _key, _value in _read_config_file(_arg).items():
            _set(_key, _value, _arg, _position)
    elif "=" not in _arg:
        _config_error(f"'{_arg}' needs a value: write --key=value")
    else:
        _key, _value = _arg[2:].split("=", 1)
        if not isinstance(_defaults.get(_key), str):  # a string key takes the text as typed
            with _contextlib.suppress(SyntaxError, ValueError, MemoryError, RecursionError):
                _value = _ast.literal_eval(_value)  # else a word, which _set refuses for a number
        _set(_key, _value, f"--{_key}", _position)

for _key, _rule in globals().get("valid", {}).items():  # a rule, a tuple of values, or a function
    _value = globals()[_key]
    if isinstance(_value, float) and not _math.isfinite(_value):
        _config_error(f"config key '{_key}' is {_value!r}; it must be a finite number")
    if isinstance(_value, int) and not -2**63 <= _value < 2**63:  # what torch and numpy take
        _config_error(f"config key '{_key}' is {_value}; it must be below 2**63")
    if callable(_rule):
        _rule(_value)  # raises UserError
    elif isinstance(_rule, tuple) and _value not in _rule:
        _config_error(f"config key '{_key}' is {_shown(_value)}; it must be one of "
                      + ", ".join(map(repr, _rule)), _value, _rule)
    elif not isinstance(_rule, tuple) and not _satisfies(_value, _rule):
        if _rule == "folder":
            _rule = "non-empty" if _value == "" else "a folder, not a file"
        _config_error(f"config key '{_key}' is {_shown(_value)}; it must be {_rule}")
config = {k: globals()[k] for k in _defaults}
