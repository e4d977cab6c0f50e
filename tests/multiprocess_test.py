"""2 processes x 2 CPU devices form one 4-device mesh and match the single-process result.

Launches tests/multiprocess_worker.py twice on localhost (`jax.distributed`
coordinator on a free port, gloo CPU collectives), each process driving 2 of
the 4 devices of a ('tp',) mesh with tp=4, so every layer's all-reduce crosses
the process boundary. Compares with this process's single-device run of the
same model: the paged forward's logits and the Engine's greedy generations.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import distributed_fixtures as fx
from paged_jax import kv_cache
from paged_jax.distributed import multiprocess
from paged_jax.engine import Engine
from paged_jax.models import llama

pytestmark = pytest.mark.slow  # two extra JAX processes: the slow tier (README, Tests)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
NUM_PROCESSES, DEVICES_PER_PROCESS = 2, 2
TIMEOUT_S = 300


def _launch(out_dir):
  """Runs the workers; returns (return codes, logs). Kills them all on timeout."""
  port = multiprocess.free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)   # the worker sets its own device count
  procs, logs = [], []
  for rank in range(NUM_PROCESSES):
    log = open(os.path.join(out_dir, f"log_{rank}.txt"), "w+")
    logs.append(log)
    procs.append(subprocess.Popen(
        [sys.executable, WORKER, f"--coordinator=127.0.0.1:{port}",
         f"--num_processes={NUM_PROCESSES}", f"--process_id={rank}",
         f"--devices_per_process={DEVICES_PER_PROCESS}", f"--out={out_dir}"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
  codes, deadline = [], time.monotonic() + TIMEOUT_S
  try:
    for p in procs:   # one deadline for the whole job
      codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
  except subprocess.TimeoutExpired:
    codes.append("timeout")
  finally:
    for p in procs:   # only our own workers (each leads its own session / process group)
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  texts = []
  for log in logs:
    log.seek(0)
    texts.append(log.read())
    log.close()
  return codes, texts


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
  for attempt in range(2):
    out = tmp_path_factory.mktemp(f"mp{attempt}")
    codes, texts = _launch(str(out))
    if codes == [0] * NUM_PROCESSES:
      return [json.load(open(out / f"process_{r}.json")) for r in range(NUM_PROCESSES)]
    if not any("in use" in t for t in texts):   # retry only a lost race for the free port
      break
  pytest.fail(f"workers failed: codes {codes}\n" +
              "\n".join(f"--- process {r} ---\n{t[-4000:]}" for r, t in enumerate(texts)))


def test_two_processes_form_one_four_device_mesh(worker_results):
  for rank, res in enumerate(worker_results):
    assert res["process_id"] == rank and res["process_count"] == NUM_PROCESSES
    assert res["device_count"] == 4 and res["local_device_count"] == DEVICES_PER_PROCESS
    # tp=4: each process holds 2 of the 4 KV-head shards, 8 / 4 = 2 heads each.
    shapes = [tuple(s) for s, _ in res["local_page_shards"]]
    assert shapes == [(fx.CONFIG.num_layers, 2, fx.CACHE.num_blocks, fx.CACHE.block_size,
                       fx.CONFIG.head_dim)] * DEVICES_PER_PROCESS
  ids = [d for res in worker_results for _, d in res["local_page_shards"]]
  assert len(set(ids)) == 4   # four distinct devices across the two processes


def test_tp_forward_across_processes_matches_single_process(worker_results):
  params = fx.params()
  step = jax.jit(llama.LlamaForCausalLM(fx.CONFIG, attention_backend="reference").apply)
  pages = kv_cache.init(fx.CACHE)
  for i, (tokens, positions, fields) in enumerate(fx.forward_inputs(seed=4)):
    want, pages = step(params, tokens, positions, pages, fx.as_meta(fields))
    for res in worker_results:
      np.testing.assert_allclose(np.asarray(res["logits"][i]), want, rtol=1e-5, atol=1e-5)
    assert np.std(np.asarray(want)) > 0.5


def test_engine_generation_across_processes_matches_single_process(worker_results):
  for res in worker_results:
    assert "engine_error" not in res, res.get("engine_error")
  engine = Engine(fx.CONFIG, fx.params(), fx.CACHE, **fx.ENGINE_KW)
  want = [o.outputs[0] for o in engine.generate(fx.PROMPTS, fx.greedy())]
  assert all(len(w) == fx.MAX_TOKENS for w in want)
  for res in worker_results:
    assert res["outputs"] == want
