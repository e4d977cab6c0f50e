"""The serving benchmark's stream sent over HTTP to an OpenAI-compatible server.

`serve_http` is `serving.serve_online` with the engine behind `python -m paged_jax.serve`
(or any server speaking vLLM's API): each request is POSTed to /v1/completions at its
arrival time as token ids, greedy, `max_tokens` = its output length with `ignore_eos`, and
streamed, so the first token's time is when its first text arrives. Latencies count from
the scheduled arrival, as in-process, so the two runs' figures compare side by side and
their difference is what the HTTP layer (client, server, SSE) costs per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, Optional, Sequence

import numpy as np

from paged_jax.bench import latency


async def _one(client, url: str, model: str, req, t0: float, first, finish, i: int) -> None:
  await asyncio.sleep(max(0.0, t0 + req.arrival_time - time.perf_counter()))
  body = {"model": model, "prompt": [int(t) for t in req.prompt_token_ids],
          "max_tokens": int(req.output_len), "temperature": 0, "ignore_eos": True,
          "stream": True}
  async with client.stream("POST", url + "/v1/completions", json=body) as r:
    if r.status_code != 200:
      raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if first[i] != first[i] and any(c.get("text") for c in chunk.get("choices", ())):
        first[i] = time.perf_counter() - t0
  finish[i] = time.perf_counter() - t0
  if first[i] != first[i]:   # no text at all (e.g. held-back bytes): first = last
    first[i] = finish[i]


def serve_http(url: str, requests: Sequence, *, model: Optional[str] = None,
               timeout_s: float = 3600.0) -> Dict:
  """Sends `requests` (workloads.Request, sorted by arrival) to the server at `url`.

  Returns {"summary": latency.summarize(...), "arrival", "first_token", "finish"
  (f64[n], s from the start), "output_len" (i32[n])}.
  """
  import httpx  # pylint: disable=g-import-not-at-top
  logging.getLogger("httpx").setLevel(logging.WARNING)   # not a line per request
  model = model or json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read()
                              )["data"][0]["id"]
  n = len(requests)
  first, finish = np.full(n, np.nan), np.full(n, np.nan)

  async def main():
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
      t0 = time.perf_counter()
      await asyncio.gather(*[_one(client, url, model, r, t0, first, finish, i)
                             for i, r in enumerate(requests)])

  asyncio.run(main())
  arr = np.array([r.arrival_time for r in requests], float)
  out_len = np.array([r.output_len for r in requests], np.int32)
  return {"summary": latency.summarize(arr, first, finish, out_len), "arrival": arr,
          "first_token": first, "finish": finish, "output_len": out_len}


def start_server(flags: Sequence[str], *, timeout_s: float = 600.0):
  """`python -m paged_jax.serve` on a free loopback port with `flags`; returns
  (process, url) once /health answers (its log: the file `process.log_path`). The
  caller terminates the process."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  # The server's log goes to a file: a pipe nobody reads fills up (64 KiB of per-request
  # access lines) and then blocks the server mid-run.
  log = tempfile.NamedTemporaryFile("w+b", prefix="paged_jax_serve_", suffix=".log",
                                    delete=False)
  proc = subprocess.Popen([sys.executable, "-m", "paged_jax.serve", f"--port={port}",
                           *flags], stdout=log, stderr=subprocess.STDOUT)
  proc.log_path = log.name
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      with open(log.name, "rb") as f:
        raise RuntimeError(f"the server exited {proc.returncode}: "
                           f"{f.read()[-1500:].decode(errors='replace')}")
    try:
      with urllib.request.urlopen(url + "/health", timeout=2):
        return proc, url
    except OSError:
      time.sleep(0.5)
  proc.kill()
  raise RuntimeError(f"the server did not answer /health in {timeout_s:g} s")
