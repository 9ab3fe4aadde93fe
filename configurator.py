"""
Poor man's configurator, after nanoGPT's, exec'd by each script after its
config globals:
    python train.py config/t5_tiny.py --batch_size=32 --compile=False
Config files (Python) run first, then --key=value. A key must be one of the
script's globals and keep its type; a string takes its text as typed. A
mistake is one line, `error: ...`. check_config(config, rules) refuses
what the script's rules forbid.
"""
import ast as _ast
import difflib as _difflib
import math as _math
import os as _os
import sys as _sys

def _set(key, value, where):
    if key not in _defaults:
        close = _difflib.get_close_matches(key.lower(), _defaults, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise SystemExit(f"error: unknown config key '{key}' in {where}{hint}")
    default = _defaults[key]
    if isinstance(default, float) and type(value) is int:
        value = float(value)  # lr=1 means lr=1.0
    if type(value) is not type(default):
        raise SystemExit(f"error: config key '{key}' in {where} must be "
                         f"{type(default).__name__}, got {value!r:.60}")
    if isinstance(value, float) and not _math.isfinite(value):
        raise SystemExit(f"error: config key '{key}' is {value}; it must be "
                         f"a finite number")
    if isinstance(value, int) and not -2**63 <= value < 2**63:  # torch's
        raise SystemExit(f"error: config key '{key}' is {value}; it must be "
                         f"below 2**63")
    globals()[key] = value

# the script's config keys: its lower-case globals of these types
_defaults = {k: v for k, v in globals().items()
             if not k.startswith("_") and not k.isupper()
             and isinstance(v, (int, float, bool, str))}
# a value after a space would be read as a config file
for _arg in _sys.argv[1:]:
    if _arg.startswith("--") and "=" not in _arg:
        raise SystemExit(f"error: '{_arg}' needs a value: write {_arg}=value")
for _arg in [a for a in _sys.argv[1:] if not a.startswith("--")]:  # files
    try:
        exec(open(_arg, encoding="utf-8").read(), _file := {})
    except FileNotFoundError:
        raise SystemExit(f"error: config file '{_arg}' not found (such as "
                         f"config/t5_tiny.py)")
    except Exception as _e:
        raise SystemExit(f"error: config file '{_arg}' is not Python: "
                         f"{type(_e).__name__}: {_e}")
    _file = {k: v for k, v in _file.items()
             if not k.startswith("_") and type(v) is not type(_sys)}
    if not _file:
        raise SystemExit(f"error: config file '{_arg}' sets no config key: "
                         f"write key = value lines")
    for _key, _value in _file.items():
        _set(_key, _value, _arg)
for _arg in [a for a in _sys.argv[1:] if a.startswith("--")]:  # then these
    _key, _value = _arg[2:].split("=", 1)
    if not isinstance(_defaults.get(_key), str):  # a word stays a word
        try:
            _value = _ast.literal_eval(_value)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            pass  # the type check refuses it
    _set(_key, _value, f"--{_key}")
config = {k: globals()[k] for k in _defaults}

def check_config(config, rules):
    """rules: (key, whether its value is valid, what it must be), and a
    *_dir key's, a folder's path; a line for each rule the config fails"""
    rules += [(key, path and not _os.path.isfile(path), "a folder's path")
              for key, path in config.items() if key.endswith("_dir")]
    mistakes = [f"error: config key '{key}' is {config[key]!r}; it must be "
                f"{rule}" for key, valid, rule in rules if not valid]
    if mistakes:
        raise SystemExit("\n".join(mistakes))
