"""Data parallelism: `dp` engine replicas behind one request router.

    mesh = make_mesh(tp=2, dp=2)                      # 4 devices
    front = DataParallelEngine(model_config, params, cache_config, mesh=mesh,
                               routing="least_loaded")
    outs = front.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    front.metrics()                                   # per replica + combined

Each replica is a full `Engine` (its own scheduler, block manager and KV pages)
on its own `tp`-sized group of devices (`dp_submeshes`), tensor-parallel inside
when tp > 1. Requests never move between replicas, so replicas share nothing
and need no communication; a request's output depends only on its own prompt
and sampling params, so routing never changes what it generates.

Routing (`Router`):
  least_loaded     the replica with the fewest outstanding KV blocks (prompt +
                   max_tokens of every unfinished request, times its sequences),
                   ties to the fewest requests, then the lowest index.
  prefix_affinity  requests whose first `affinity_blocks` full blocks of prompt
                   are equal go to the same replica, so its prefix cache can
                   share them; an unseen prefix (or a prompt shorter than one
                   block) goes least-loaded and pins that prefix there.
  "auto" picks prefix_affinity when the cache has prefix caching on.

Replicas are stepped from a thread pool (`concurrent=True`): JAX releases the
GIL while a device program runs, so replicas on different devices overlap.
"""

from __future__ import annotations

import collections
from concurrent import futures
import hashlib
from typing import Any, Dict, Optional, Sequence as Seq

import jax
import numpy as np
from jax.sharding import Mesh

from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.distributed.mesh import dp_submeshes
from paged_jax.distributed.tp_engine import make_tp_engine

ROUTING_POLICIES = ("auto", "least_loaded", "prefix_affinity")


class Router:
  """Chooses a replica per request; tracks outstanding load host-side.

  Args:
    num_replicas: dp.
    block_size: KV block size (tokens), for load in blocks and prefix keys.
    policy: "least_loaded" or "prefix_affinity".
    affinity_blocks: full prompt blocks forming the prefix-affinity key (>= 1).
  """

  def __init__(self, num_replicas: int, block_size: int, policy: str = "least_loaded",
               affinity_blocks: int = 1):
    if policy not in ROUTING_POLICIES[1:]:
      raise ValueError(f"policy must be one of {ROUTING_POLICIES[1:]}, got {policy!r}")
    if isinstance(affinity_blocks, bool) or not isinstance(affinity_blocks, int) or \
        affinity_blocks < 1:
      raise ValueError(f"affinity_blocks must be an int >= 1, got {affinity_blocks!r}")
    self.num_replicas = num_replicas
    self.block_size = block_size
    self.policy = policy
    self.affinity_blocks = affinity_blocks
    self.load_blocks = [0] * num_replicas       # outstanding KV blocks per replica
    self.load_requests = [0] * num_replicas
    self.routed = [0] * num_replicas
    self.affinity_hits = 0
    self._prefix_owner: Dict[bytes, int] = {}
    self._cost: Dict[Any, tuple] = {}           # request id -> (replica, blocks)

  def prefix_key(self, prompt: Seq[int]) -> Optional[bytes]:
    """Digest of the prompt's first `affinity_blocks` full blocks (None if it has none)."""
    full = min(self.affinity_blocks, len(prompt) // self.block_size)
    if full == 0:
      return None
    head = np.asarray(prompt[:full * self.block_size], np.int64).tobytes()
    return hashlib.blake2b(head, digest_size=16).digest()

  def least_loaded(self) -> int:
    return min(range(self.num_replicas),
               key=lambda r: (self.load_blocks[r], self.load_requests[r], r))

  def choose(self, prompt: Seq[int]) -> int:
    """The replica a request with this prompt would go to (changes nothing)."""
    if self.policy == "prefix_affinity":
      key = self.prefix_key(prompt)
      if key is not None and key in self._prefix_owner:
        return self._prefix_owner[key]
    return self.least_loaded()

  def book(self, request_id, replica: int, prompt: Seq[int], max_tokens: int,
           num_seqs: int = 1) -> None:
    """Records a request placed on `replica` (its load; pins its prefix there)."""
    if self.policy == "prefix_affinity":
      key = self.prefix_key(prompt)
      if key is not None:
        if key in self._prefix_owner:
          self.affinity_hits += 1
        self._prefix_owner.setdefault(key, replica)
    blocks = num_seqs * -(-(len(prompt) + max_tokens) // self.block_size)
    self.load_blocks[replica] += blocks
    self.load_requests[replica] += 1
    self.routed[replica] += 1
    self._cost[request_id] = (replica, blocks)

  def route(self, request_id, prompt: Seq[int], max_tokens: int, num_seqs: int = 1) -> int:
    """choose + book."""
    replica = self.choose(prompt)
    self.book(request_id, replica, prompt, max_tokens, num_seqs)
    return replica

  def finish(self, request_id) -> None:
    replica, blocks = self._cost.pop(request_id)
    self.load_blocks[replica] -= blocks
    self.load_requests[replica] -= 1


class DataParallelEngine:
  """`dp` engine replicas (each tensor-parallel over its tp devices) behind a `Router`.

  Args:
    model_config, params, cache_config: as for `Engine`; every replica gets the
      whole `cache_config` pool (num_blocks blocks, split over its tp devices).
    mesh: a ('dp', 'tp') mesh from `make_mesh(tp, dp)` (or a 1-D tp mesh: dp=1).
    routing: "auto", "least_loaded" or "prefix_affinity".
    affinity_blocks: see `Router`.
    concurrent: step replicas from a thread pool.
    engine_kwargs: passed to every replica's `Engine`.
  """

  def __init__(self, model_config: ModelConfig, params, cache_config: CacheConfig, *,
               mesh: Mesh, routing: str = "auto", affinity_blocks: int = 1,
               concurrent: bool = True, **engine_kwargs):
    if routing not in ROUTING_POLICIES:
      raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {routing!r}")
    if routing == "auto":
      routing = "prefix_affinity" if cache_config.enable_prefix_caching else "least_loaded"
    self.submeshes = dp_submeshes(mesh)
    for r, sub in enumerate(self.submeshes):
      if not any(d.process_index == jax.process_index() for d in sub.devices.flat):
        raise ValueError(
            f"replica {r} has no device in this process (process {jax.process_index()}): "
            "DataParallelEngine is a single-controller front; across hosts run one engine "
            "(or one DataParallelEngine) per host, see docs/distributed.md")
    self.replicas = [make_tp_engine(model_config, params, cache_config, mesh=sub,
                                    **engine_kwargs) for sub in self.submeshes]
    self.router = Router(len(self.replicas), cache_config.block_size, routing, affinity_blocks)
    self._replica_of: Dict[Any, int] = {}
    self._next_id = 0
    self._pool = (futures.ThreadPoolExecutor(max_workers=len(self.replicas))
                  if concurrent and len(self.replicas) > 1 else None)
    self.finished_per_replica = [0] * len(self.replicas)

  @property
  def dp(self) -> int:
    return len(self.replicas)

  def add_request(self, prompt: Seq[int], params=None, request_id: Any = None) -> Any:
    """Routes and queues a request (validated by the chosen replica before booking)."""
    from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
    params = params or SamplingParams()
    if request_id is None:
      request_id = self._next_id
      self._next_id += 1
    if request_id in self._replica_of:
      raise ValueError(f"request_id {request_id!r} is already in use")
    num_seqs = getattr(params, "num_seqs", 1)
    prompt = list(prompt)
    replica = self.router.choose(prompt)
    # The replica validates before queueing; on error nothing was booked anywhere.
    self.replicas[replica].add_request(prompt, params, request_id=request_id)
    self.router.book(request_id, replica, prompt, params.max_tokens, num_seqs)
    self._replica_of[request_id] = replica
    return request_id

  def replica_of(self, request_id) -> int:
    return self._replica_of[request_id]

  def has_unfinished(self) -> bool:
    return any(e.has_unfinished() for e in self.replicas)

  def step(self) -> list:
    """One step of every replica with work; returns the requests finished by it."""
    busy = [e for e in self.replicas if e.has_unfinished()]
    if self._pool is not None and len(busy) > 1:
      results = list(self._pool.map(lambda e: e.step(), busy))
    else:
      results = [e.step() for e in busy]
    finished = [out for outs in results for out in outs]
    for out in finished:
      self.router.finish(out.request_id)
      self.finished_per_replica[self._replica_of.pop(out.request_id)] += 1
    return finished

  def flush(self) -> None:
    for e in self.replicas:
      e.flush()

  def generate(self, prompts: Seq[Seq[int]], params=None) -> list:
    """Runs prompts to completion over all replicas; outputs in prompt order."""
    if params is None or not isinstance(params, (list, tuple)):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f"params must be one SamplingParams or {len(prompts)}, got {len(params)}")
    ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while self.has_unfinished():
      for out in self.step():
        done[out.request_id] = out
    self.flush()
    return [done[i] for i in ids]

  def metrics(self) -> dict:
    """Per-replica and combined counters (stats of each Engine summed; blocks; routing)."""
    per = []
    total = collections.Counter()
    for r, e in enumerate(self.replicas):
      stats = dict(e.stats)
      total.update(stats)
      per.append(dict(stats, replica=r, devices=[d.id for d in self.submeshes[r].devices.flat],
                      routed=self.router.routed[r], finished=self.finished_per_replica[r],
                      outstanding_requests=self.router.load_requests[r],
                      num_blocks=e.cache_config.num_blocks, num_free_blocks=int(e.num_free),
                      num_preemptions=e.num_preemptions))
    num_blocks = sum(p["num_blocks"] for p in per)
    free = sum(p["num_free_blocks"] for p in per)
    combined = dict(total, routed=sum(self.router.routed),
                    finished=sum(self.finished_per_replica),
                    num_preemptions=sum(p["num_preemptions"] for p in per),
                    num_blocks=num_blocks, num_free_blocks=free,
                    block_usage=(num_blocks - free) / num_blocks,
                    affinity_hits=self.router.affinity_hits, routing=self.router.policy)
    return {"replicas": per, "combined": combined}

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None
