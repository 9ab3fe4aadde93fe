"""
Poor man's configurator, after nanoGPT. A script defines its config as module-level globals, then runs
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
which applies, in order, every config file named on the command line and every --key=value override:
    python train.py config/t5_tiny.py --batch_size=16 --compile=False
Config files are plain Python assignments. Unlike nanoGPT, mistakes are caught here instead of silently
creating a new global: an unknown key names the closest valid one, a value of the wrong type or a missing
config file is refused, each with one line on stderr and exit code 2. Afterwards `config` holds every
final value, for logging and checkpoints.
"""
import ast as _ast
import difflib as _difflib
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
    else:
        _default(exc_type, exc, tb)


_sys.excepthook = _print_user_errors
_config_types = (int, float, bool, str, type(None))
_defaults = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, _config_types)}


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
            with open(_arg) as _f:
                _source = _f.read()
        except OSError:
            _config_error(f"config file '{_arg}' not found (pass a path such as config/t5_tiny.py)")
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

config = {k: globals()[k] for k in _defaults}
