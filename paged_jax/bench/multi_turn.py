"""Multi-turn chats: each turn's prompt is the whole history, turns arriving interleaved.

    convs = multi_turn.synthetic(16, 4, first=(64, 160), user=(16, 48), output=(16, 16),
                                 start_rate=0.25, think_mean=20.0, vocab=256, seed=0)
    convs = multi_turn.sharegpt(64, seed=0, max_len=2048, start_rate=0.5, think_mean=30.0)
    clock = multi_turn.transfer_clock(device_model, engine)   # prices host-tier copies
    result = multi_turn.serve(engine, convs, clock)
    result["summary"]["ttft_p99_s"], result["prompt_tokens_computed"]

A `Conversation` holds its user turns (turn 0's is the first prompt) and each turn's
answer length; the answers are the engine's own (greedy), so turn t's prompt is
user[0] + answer[0] + user[1] + ... + user[t] (`Conversation.prompt`): every earlier
prompt is a prefix of it. Chats start as a Poisson process (`start_rate` per unit of
time: engine steps or the clock's seconds); a chat's turn t arrives `think[t]` after the
answer to turn t - 1 finished (closed loop per chat, as a user waits for the answer), so
many chats' turns interleave and a device cache alone loses earlier turns before their
chat comes back (issue 40, point 3).

Two streams: `synthetic` (seeded random token ids) and `sharegpt` (the real ShareGPT V3
trace's multi-turn conversations, `sharegpt_trace`'s optional extra: cl100k lengths of each
human / gpt turn, the human text's bytes as token ids, chats cut before the turn whose
history would pass `max_len`).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from paged_jax.bench import latency
from paged_jax.bench.recorder import LoopRecorder
from paged_jax.config import check_int


@dataclasses.dataclass(frozen=True)
class Conversation:
  """One chat.

  Attributes:
    user: per turn, the user's new token ids (i32 arrays; turn 0's is the first prompt).
    output_lens: per turn, the answer's tokens (>= 1).
    start: when turn 0 arrives (time units of the stream).
    think: per turn, the wait between the previous answer's finish and the turn's
      arrival (entry 0 unused).
  """
  user: Tuple[np.ndarray, ...]
  output_lens: Tuple[int, ...]
  start: float
  think: Tuple[float, ...]

  @property
  def turns(self) -> int:
    return len(self.user)

  def prompt(self, turn: int, answers: Sequence[Sequence[int]]) -> List[int]:
    """Turn `turn`'s prompt: user[0] + answers[0] + ... + user[turn] (ints)."""
    out: List[int] = []
    for t in range(turn + 1):
      out += [int(x) for x in self.user[t]]
      if t < turn:
        out += [int(x) for x in answers[t]]
    return out

  def prompt_lens(self) -> List[int]:
    """Each turn's prompt length (answers of `output_lens` tokens)."""
    n, out = 0, []
    for t in range(self.turns):
      n += len(self.user[t])
      out.append(n)
      n += self.output_lens[t]
    return out


def _check_range(name: str, r: Tuple[int, int], lo: int = 1) -> None:
  if len(r) != 2 or int(r[0]) < lo or int(r[1]) < int(r[0]):
    raise ValueError(f"{name} must be (low, high) with {lo} <= low <= high, got {r!r}")


def synthetic(num: int, turns: int, *, first: Tuple[int, int], user: Tuple[int, int],
              output: Tuple[int, int], start_rate: float, think_mean: float, vocab: int,
              seed: int) -> List[Conversation]:
  """`num` chats of `turns` turns, seeded: a first prompt of `first` (low, high) tokens,
  later turns adding `user` tokens each (ids uniform in [1, vocab)), answers of `output`
  tokens (uniform; drawn from a second stream of the seed only when low < high), starts a
  Poisson process of `start_rate`, think times exponential with mean `think_mean`."""
  check_int("num", num, 1)
  check_int("turns", turns, 1)
  for name, r in (("first", first), ("user", user), ("output", output)):
    _check_range(name, r)
  if not start_rate > 0 or not think_mean >= 0:
    raise ValueError(f"start_rate must be > 0 and think_mean >= 0, got {start_rate}, "
                     f"{think_mean}")
  rng = np.random.default_rng(seed)
  firsts = [rng.integers(1, vocab, int(n)) for n in rng.integers(first[0], first[1] + 1, num)]
  users = [[rng.integers(1, vocab, int(n)) for n in rng.integers(user[0], user[1] + 1, turns)]
           for _ in range(num)]
  start = np.cumsum(rng.exponential(1 / start_rate, num))
  think = rng.exponential(think_mean, (num, turns))
  if output[0] == output[1]:
    outs = np.full((num, turns), output[0])
  else:
    outs = np.random.default_rng([seed, 1]).integers(output[0], output[1] + 1, (num, turns))
  return [Conversation(tuple([firsts[c].astype(np.int32)]
                             + [u.astype(np.int32) for u in users[c][1:]]),
                       tuple(int(x) for x in outs[c]), float(start[c]),
                       tuple(float(x) for x in think[c])) for c in range(num)]


def sharegpt(num: int, *, seed: int, max_len: int, start_rate: float, think_mean: float,
             min_turns: int = 2, max_turns: int = 16) -> List[Conversation]:
  """`num` chats from the real ShareGPT trace's multi-turn conversations (seeded).

  Conversations with at least `min_turns` human / gpt rounds (`sharegpt_trace.rounds`)
  are drawn in a seeded order; each keeps its rounds while the history (every earlier
  round plus this user turn) and the answer fit `max_len` (cl100k tokens; an empty
  answer counts 1), at most `max_turns`, and is used when `min_turns` remain. Starts
  and think times as `synthetic`'s (from a stream of the seed). ImportError (one line)
  without the optional extra."""
  from paged_jax.bench import sharegpt_trace  # pylint: disable=g-import-not-at-top
  check_int("num", num, 1)
  check_int("min_turns", min_turns, 1)
  check_int("max_turns", max_turns, min_turns)
  check_int("max_len", max_len, 2)
  if not start_rate > 0 or not think_mean >= 0:
    raise ValueError(f"start_rate must be > 0 and think_mean >= 0, got {start_rate}, "
                     f"{think_mean}")
  dialogues = sharegpt_trace.dialogues()
  enc = sharegpt_trace.encoder()
  rng = np.random.default_rng([seed, 40])
  pool = [i for i, d in enumerate(dialogues) if len(sharegpt_trace.rounds(d)) >= min_turns]
  picked: List[Tuple[List[np.ndarray], List[int]]] = []
  for i in rng.permutation(pool):
    rounds = sharegpt_trace.rounds(dialogues[i])[:max_turns]
    lens = [len(x) for x in enc.encode_ordinary_batch([t for r in rounds for t in r],
                                                      num_threads=1)]
    users, outs, held = [], [], 0
    for k, (text, _) in enumerate(rounds):
      u, o = max(1, lens[2 * k]), max(1, lens[2 * k + 1])
      if held + u + o > max_len:
        break
      users.append(sharegpt_trace.token_ids(text, u))
      outs.append(o)
      held += u + o
    if len(users) >= min_turns:
      picked.append((users, outs))
    if len(picked) == num:
      break
  if len(picked) < num:
    raise ValueError(f"num must be <= {len(picked)} (conversations with >= {min_turns} "
                     f"turns that fit max_len={max_len}), got {num}")
  times = np.random.default_rng([seed, 41])
  start = np.cumsum(times.exponential(1 / start_rate, num))
  think = times.exponential(think_mean, (num, max_turns))
  return [Conversation(tuple(u), tuple(o), float(start[c]),
                       tuple(float(x) for x in think[c, :len(u)]))
          for c, (u, o) in enumerate(picked)]


def stream_stats(convs: Sequence[Conversation]) -> Dict[str, float]:
  """Sizes of a stream: chats, turns, mean turns, mean prompt / answer tokens, the
  longest chat and "history_tokens": every chat's whole history (its last prompt and
  answer) summed, what a cache must hold to lose no turn."""
  prompts = [p for c in convs for p in c.prompt_lens()]
  outs = [o for c in convs for o in c.output_lens]
  return {"conversations": len(convs), "turns": len(prompts),
          "mean_turns": len(prompts) / len(convs), "mean_prompt_len": float(np.mean(prompts)),
          "mean_output_len": float(np.mean(outs)),
          "max_history_len": int(max(c.prompt_lens()[-1] + c.output_lens[-1] for c in convs)),
          "history_tokens": int(sum(c.prompt_lens()[-1] + c.output_lens[-1] for c in convs))}


class TierTransfers:
  """A `perf.ModelClock` `to_step`: the engine's step report as a `perf.StepShape` plus
  the host tier's copies of that step, read from the engine's public counters after the
  step: promotions (host -> device) from `Engine.host_stats["promoted_blocks"]`, stores
  (device -> host) from the "stored" events of medium "host" in `Engine.kv_events()`
  (drained here; a block the host already held is not copied again). Totals in
  `blocks_in` / `blocks_out`."""

  def __init__(self, engine, block_size: int):
    self.engine, self.block_size = engine, block_size
    self._promoted = engine.host_stats["promoted_blocks"]
    engine.kv_events()
    self.blocks_in = self.blocks_out = 0

  def __call__(self, report):
    from paged_jax.perf import StepShape  # pylint: disable=g-import-not-at-top
    shape = StepShape.from_report(report, block_size=self.block_size)
    now = self.engine.host_stats["promoted_blocks"]
    n_in, self._promoted = now - self._promoted, now
    n_out = sum(len(e.block_hashes) for e in self.engine.kv_events()
                if e.medium == "host" and e.kind == "stored")
    self.blocks_in += n_in
    self.blocks_out += n_out
    return dataclasses.replace(shape, host_in_blocks=int(n_in), host_out_blocks=int(n_out))


def transfer_clock(device_model, engine, *, serial_stores: bool = False):
  """A `perf.ModelClock` for `engine` that charges its host tier's copies
  (`TierTransfers`; `serial_stores`: the download runs after the step, not beside it).
  The clock's `transfers` attribute is the counter."""
  from paged_jax.perf import ModelClock  # pylint: disable=g-import-not-at-top
  counter = TierTransfers(engine, engine.cache_config.block_size)
  to_step = counter
  if serial_stores:
    def to_step(report):
      s = counter(report)
      return dataclasses.replace(s, host_in_blocks=s.host_in_blocks + s.host_out_blocks,
                                 host_out_blocks=0)
  clock = ModelClock(device_model, block_size=engine.cache_config.block_size,
                     to_step=to_step)
  clock.transfers = counter
  return clock


def serve(engine, convs: Sequence[Conversation], clock, *, keep_outputs: bool = False,
          progress=None) -> Dict[str, Any]:
  """Serves every chat to its end on `engine` (greedy, each answer exactly its length).

  A chat's turn arrives at its start (turn 0) or `think` after its previous answer
  finished; the loop adds what has arrived, runs one step (`LoopRecorder`), or jumps the
  clock to the next arrival when nothing runs. TTFT and latency count from the arrival.

  Returns {"summary" (`latency.summarize` over every turn), "prompt_tokens",
  "prompt_tokens_computed" (prefill), "hit_tokens" (device and host), "host_hit_tokens",
  "exchange_calls", "host_in_blocks" / "host_out_blocks" (when the clock is a
  `transfer_clock`), "steps", "preemptions", "clock" (its totals), and with
  `keep_outputs` "outputs" (per chat, each turn's answer)}.
  """
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  s0 = dict(engine.stats)
  h0 = engine.metrics().get("prefix_host_hit_tokens", 0)
  calls0 = engine.host_stats["calls"]
  rec = LoopRecorder(engine, clock, progress)
  due = [(c.start, i, 0) for i, c in enumerate(convs)]
  heapq.heapify(due)
  answers: List[List[List[int]]] = [[] for _ in convs]
  turn_of: Dict[int, Tuple[int, int]] = {}
  arrival: Dict[int, float] = {}
  prompt_tokens = 0
  while due or engine.has_unfinished():
    now = rec.clock.now()
    while due and due[0][0] <= now:
      t_arr, c, t = heapq.heappop(due)
      prompt = convs[c].prompt(t, answers[c])
      rid = engine.add_request(prompt, SamplingParams(
          max_tokens=convs[c].output_lens[t], temperature=0.0))
      turn_of[rid], arrival[rid] = (c, t), t_arr
      prompt_tokens += len(prompt)
    if not engine.has_unfinished():
      rec.clock.wait_until(due[0][0])
      continue
    for out in rec.step():
      c, t = turn_of[out.request_id]
      answers[c].append([int(x) for x in out.outputs[0]])
      if t + 1 < convs[c].turns:
        heapq.heappush(due, (rec.finish[out.request_id] + convs[c].think[t + 1], c, t + 1))
  totals = rec.close()
  ids = sorted(turn_of)
  first, finish = rec.timestamps(ids)
  out_len = [convs[turn_of[i][0]].output_lens[turn_of[i][1]] for i in ids]
  d = lambda k: engine.stats.get(k, 0) - s0.get(k, 0)
  res = {"summary": latency.summarize([arrival[i] for i in ids], first, finish, out_len),
         "prompt_tokens": prompt_tokens, "prompt_tokens_computed": d("prefill_tokens"),
         "hit_tokens": d("prefix_hit_tokens"),
         "host_hit_tokens": engine.metrics().get("prefix_host_hit_tokens", 0) - h0,
         "exchange_calls": engine.host_stats["calls"] - calls0,
         "steps": totals["loop_steps"], "preemptions": totals["preemptions"]}
  transfers = getattr(clock, "transfers", None)
  if transfers is not None:
    res.update(host_in_blocks=transfers.blocks_in, host_out_blocks=transfers.blocks_out)
  if hasattr(clock, "totals"):
    res["clock"] = clock.totals()
  if keep_outputs:
    res["outputs"] = answers
  return res
