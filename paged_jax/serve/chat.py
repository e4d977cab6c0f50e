"""Chat templates: a checkpoint's `chat_template` rendered with jinja2 as transformers does.

transformers renders `tokenizer_config.json`'s `chat_template` in an immutable sandboxed
jinja2 environment with `trim_blocks` / `lstrip_blocks`, the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, and a `raise_exception` function; we
do the same, so a checkpoint's prompt text is the one transformers would build.

The shipped byte-level model has no tokenizer_config.json; it gets `DEFAULT_TEMPLATE`,
one line per message as `<|role|>content` and an open `<|assistant|>` turn (it was not
trained on chat, so answers are byte-level continuations; the format is documented so
clients can build the same prompt themselves).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List

DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _token_text(value: Any) -> str:
  """A special token of tokenizer_config.json: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return str(value.get("content", ""))
  return "" if value is None else str(value)


def load_template(directory: str) -> Callable[[List[Dict[str, Any]]], str]:
  """`render(messages) -> str` for the checkpoint in `directory` (its chat_template, or
  DEFAULT_TEMPLATE when it has none). A template that does not parse is a ValueError."""
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2 import sandbox  # pylint: disable=g-import-not-at-top
  cfg: Dict[str, Any] = {}
  path = os.path.join(directory, "tokenizer_config.json")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      cfg = json.load(f)
  source = cfg.get("chat_template") or DEFAULT_TEMPLATE
  if isinstance(source, list):   # named templates: the "default" one
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    source = named.get("default") or next(iter(named.values()), DEFAULT_TEMPLATE)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = raise_exception
  env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                            indent=indent)
  try:
    template = env.from_string(source)
  except jinja2.exceptions.TemplateError as e:
    raise ValueError(f"{path}: chat_template does not parse ({e})") from None
  specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token")}

  def render(messages: List[Dict[str, Any]]) -> str:
    """The prompt text of `messages` with an open assistant turn; a template error
    (e.g. roles out of the order it accepts) is a ValueError with its message."""
    try:
      return template.render(messages=messages, add_generation_prompt=True, **specials)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"chat template: {e}") from None

  return render
