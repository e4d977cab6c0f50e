"""Experiment settings as frozen dataclasses whose fields are the command-line flags.

    @dataclasses.dataclass(frozen=True)
    class Config(configs.ExperimentConfig):
      \"\"\"Flags of experiments.foo.\"\"\"
      workload: str = configs.flag("sharegpt", "request stream", choices=("sharegpt", "alpaca"))
      num_requests: int = configs.flag(500, "requests in the stream", lower=1)
      block_sizes: Tuple[int, ...] = configs.flag((8, 16), "KV block sizes", lower=1)
      out: str = configs.flag("results/foo", "output directory")

      def check(self) -> None:       # optional: rules between fields (ValueError naming them)
        ...

    common.run_app(main, Config)     # flags from the fields; main(config, out) gets a checked one
    result = run(Config(num_requests=50))        # the same settings from tests, demo, notebooks

A field's type picks its absl flag: int, float, str (an enum with `choices`), bool,
Optional[X] (default None), Tuple[X, ...] (a comma-separated list, or with `multi=True` a
repeated flag; bounds and choices apply to each element), Dict[str, int] (comma-separated
key:value pairs). A numeric field may also take literal `words` (e.g. `--rates=auto`: the
field's elements are numbers or one of the words). Building a Config checks every field's type, range and choices, then
`check()`: one ValueError naming the flag (`--name must be ..., got ...`) whether the
values came from a command line or from code. Floats must be finite unless a field says
`finite=False`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Dict, Optional, Sequence, Tuple

_META = "experiment_flag"


def flag(default: Any, help: str, *, lower: Optional[float] = None,  # pylint: disable=redefined-builtin
         upper: Optional[float] = None, lower_open: bool = False, upper_open: bool = False,
         choices: Optional[Sequence[Any]] = None, multi: bool = False,
         finite: bool = True, words: Sequence[str] = ()) -> Any:
  """A Config field that is also a flag.

  Args:
    default: the flag's default (a tuple for a list flag, a dict for a key:value one).
    help: one line for --help.
    lower, upper: allowed range, inclusive (`lower_open` / `upper_open`: that end excluded).
    choices: allowed values (of each element for a list).
    multi: a tuple field given as a repeated flag (`--prompt=a --prompt=b`).
    finite: floats must be finite (not nan or inf).
    words: strings a numeric field (or each element of a list of numbers) may be instead.
  """
  meta = {_META: dict(help=help, lower=lower, upper=upper, lower_open=lower_open,
                      upper_open=upper_open,
                      choices=tuple(choices) if choices is not None else None, multi=multi,
                      finite=finite, words=tuple(words))}
  if isinstance(default, dict):
    return dataclasses.field(default_factory=lambda: dict(default), metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class _Kind:
  """What a field's annotation means: its element type, and the container around it."""
  base: type                 # int, float, str or bool (a dict's value type)
  optional: bool = False
  container: str = ""        # "", "tuple" or "dict"


def _kind(hint) -> _Kind:
  args = typing.get_args(hint)
  if typing.get_origin(hint) is typing.Union and type(None) in args:
    inner = _kind(next(a for a in args if a is not type(None)))
    return dataclasses.replace(inner, optional=True)
  origin = typing.get_origin(hint)
  if origin in (tuple, Tuple):
    return _Kind(args[0], container="tuple")
  if origin in (dict, Dict):
    return _Kind(args[1], container="dict")
  if hint in (int, float, str, bool):
    return _Kind(hint)
  raise TypeError(f"unsupported flag type {hint!r}")


def fields(cls) -> Dict[str, Tuple[dataclasses.Field, _Kind, dict]]:
  """{name: (field, kind, flag metadata)} of every flag field of a Config class."""
  hints = typing.get_type_hints(cls)
  return {f.name: (f, _kind(hints[f.name]), f.metadata[_META])
          for f in dataclasses.fields(cls) if _META in f.metadata}


def _fmt(x) -> str:
  return f"{x:g}" if isinstance(x, float) else str(x)


def rule(kind: _Kind, meta: dict) -> str:
  """The allowed values of one element, in words ("an int >= 1", "one of a, b")."""
  if meta.get("words"):
    return _rule(kind, meta) + " or " + " or ".join(meta["words"])
  return _rule(kind, meta)


def _rule(kind: _Kind, meta: dict) -> str:
  if meta["choices"] is not None:
    return "one of " + ", ".join(map(str, meta["choices"]))
  noun = {int: "an int", float: "a finite number" if meta["finite"] else "a number",
          str: "a string", bool: "true or false"}[kind.base]
  lo, hi = meta["lower"], meta["upper"]
  if lo is not None and hi is not None:
    return (f"{noun} in {'(' if meta['lower_open'] else '['}{_fmt(lo)}, {_fmt(hi)}"
            f"{')' if meta['upper_open'] else ']'}")
  if lo is not None:
    return f"{noun} {'>' if meta['lower_open'] else '>='} {_fmt(lo)}"
  if hi is not None:
    return f"{noun} {'<' if meta['upper_open'] else '<='} {_fmt(hi)}"
  return noun


def _element(name: str, value: Any, kind: _Kind, meta: dict) -> Any:
  """One checked element (ints accepted for floats); ValueError naming the flag."""
  bad = ValueError(f"--{name} must be {rule(kind, meta)}, got {value!r}")
  if isinstance(value, str) and value in meta.get("words", ()):
    return value
  if kind.base is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if kind.base is int and (isinstance(value, bool) or not isinstance(value, int)):
    raise bad
  if not isinstance(value, kind.base):
    raise bad
  if meta["choices"] is not None and value not in meta["choices"]:
    raise bad
  if kind.base in (int, float):
    lo, hi = meta["lower"], meta["upper"]
    if kind.base is float and meta["finite"] and not math.isfinite(value):
      raise bad
    if lo is not None and not (value > lo if meta["lower_open"] else value >= lo):
      raise bad
    if hi is not None and not (value < hi if meta["upper_open"] else value <= hi):
      raise bad
  return value


def checked(name: str, value: Any, kind: _Kind, meta: dict) -> Any:
  """A field's value checked (lists become tuples); ValueError naming the flag."""
  if value is None:
    if kind.optional:
      return None
    raise ValueError(f"--{name} must be given")
  if kind.container == "tuple":
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
      raise ValueError(f"--{name} must be a list of {rule(kind, meta)}, got {value!r}")
    return tuple(_element(name, v, kind, meta) for v in value)
  if kind.container == "dict":
    if not isinstance(value, dict):
      raise ValueError(f"--{name} must be key:value pairs, got {value!r}")
    return {str(k): _element(f"{name}[{k}]", v, kind, meta) for k, v in value.items()}
  return _element(name, value, kind, meta)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Base of every experiment's Config: checks each flag field, then `check()`."""

  def __post_init__(self):
    for name, (_, kind, meta) in fields(type(self)).items():
      object.__setattr__(self, name, checked(name, getattr(self, name), kind, meta))
    self.check()

  def check(self) -> None:
    """Rules between fields; ValueError naming the flags. Override as needed."""

  def flags(self) -> Dict[str, Any]:
    """{flag name: value}: what a result records as the settings it ran with."""
    return {name: getattr(self, name) for name in fields(type(self))}


def check_multiple(config: ExperimentConfig, name: str, of: str) -> None:
  """ValueError unless flag `name` is a multiple of flag `of` (a KV budget of whole blocks:
  `check_multiple(self, "kv_budget_tokens", "block_size")` in a Config's `check`)."""
  value, unit = getattr(config, name), getattr(config, of)
  if value % unit:
    raise ValueError(f"--{name} must be a multiple of --{of}={unit}, got {value}")


# ---- absl ------------------------------------------------------------------------------
def _flag_default(value, kind: _Kind):
  if value is None or kind.container == "":
    return value
  if kind.container == "dict":
    return [f"{k}:{v}" for k, v in value.items()]
  return [str(v) for v in value]


def define_flags(cls, flag_values) -> None:
  """Defines one absl flag per field of `cls` on `flag_values` (help: the field's help and
  its allowed values)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  for name, (field, kind, meta) in fields(cls).items():
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    help_text = f"{meta['help']} [{rule(kind, meta)}]"
    kw = dict(flag_values=flag_values)
    if kind.container == "tuple" and meta["multi"]:
      flags.DEFINE_multi_string(name, _flag_default(default, kind), help_text, **kw)
    elif kind.container:
      flags.DEFINE_list(name, _flag_default(default, kind), help_text, **kw)
    elif kind.base is bool:
      flags.DEFINE_boolean(name, default, help_text, **kw)
    elif meta["words"]:   # a number or a word: parsed in from_flags
      flags.DEFINE_string(name, None if default is None else str(default), help_text, **kw)
    elif kind.base is int:
      flags.DEFINE_integer(name, default, help_text, **kw)
    elif kind.base is float:
      flags.DEFINE_float(name, default, help_text, **kw)
    else:   # choices are checked with the Config, so the message is the same from code
      flags.DEFINE_string(name, default, help_text, **kw)


def _parse(name: str, text: str, kind: _Kind, words: Sequence[str] = ()) -> Any:
  if kind.base is str or text in words:
    return text
  try:
    return kind.base(text)
  except ValueError:
    raise ValueError(f"--{name}: {text!r} is not {'an int' if kind.base is int else 'a number'}"
                     ) from None


def from_flags(cls, flag_values):
  """A checked `cls` from parsed absl flags; ValueError (one line) on a bad value."""
  values = {}
  for name, (_, kind, meta) in fields(cls).items():
    raw = flag_values[name].value
    words = meta.get("words", ())
    if raw is not None and kind.container == "" and words:
      values[name] = _parse(name, raw, kind, words)
    elif raw is None or kind.container == "":
      values[name] = raw
    elif kind.container == "dict":
      pairs = [x.split(":", 1) for x in raw if x]
      if any(len(p) != 2 for p in pairs):
        raise ValueError(f"--{name} must be comma-separated key:value pairs, got {raw!r}")
      values[name] = {k: _parse(name, v, kind, words) for k, v in pairs}
    else:
      values[name] = tuple(_parse(name, x, kind, words) for x in raw if x != "")
  return cls(**values)
