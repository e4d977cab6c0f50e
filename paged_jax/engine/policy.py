"""Scheduling policies: the order requests are served in, as a sort key (vLLM's "fcfs"
and "priority" policies; any `key(request) -> sortable` plugs in the same way).

    Engine(..., scheduling_policy="priority")
    engine.add_request(prompt, params, priority=-1)      # lower value first
    Engine(..., scheduling_policy=lambda r: r.prompt_len)  # shortest prompt first

The scheduler (`planning.py`) serves running requests in key order, brings swapped ones
back and admits waiting ones in key order, strictly (a head that does not fit waits; no
later request overtakes it), and preempts from the other end: the running request with
the largest key goes first (as vLLM's priority policy picks its victim). Ties are broken
by arrival. A key is computed once, when the request is queued, from these attributes
of the request (`sequence.Group`):

  arrival     int, the order requests were queued in (0, 1, 2, ...)
  priority    int, `add_request(..., priority=)` (default 0)
  prompt_len  int, prompt tokens
  request_id, params (its SamplingParams)

docs/extending.md walks through adding a policy.
"""

from __future__ import annotations

from typing import Any, Callable, Union

KeyFn = Callable[[Any], Any]

POLICIES = {
    "fcfs": lambda request: request.arrival,
    "priority": lambda request: (request.priority, request.arrival),
}


def resolve(policy: Union[str, KeyFn]) -> KeyFn:
  """The key function of a policy name or a callable; a one-line ValueError otherwise."""
  if isinstance(policy, str):
    if policy in POLICIES:
      return POLICIES[policy]
  elif callable(policy):
    return policy
  raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)} or a callable "
                   f"key(request) -> sortable, got {policy!r}")


def sort_key(key: KeyFn, request, other_key: Any = None) -> tuple:
  """(key(request), arrival): a request's place in the queues. `other_key`, another
  request's sort key, is compared with it so a key that cannot order requests fails
  here, at `add_request`, with a one-line ValueError, not inside a later step."""
  try:
    k = (key(request), request.arrival)
    if other_key is not None:
      _ = k < other_key
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"scheduling_policy key failed on request {request.request_id!r}: "
                     f"{type(e).__name__}: {e}") from None
  return k
