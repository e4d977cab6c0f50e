"""One process of the 2-process test (tests/multiprocess_test.py launches two).

    python tests/multiprocess_worker.py --coordinator=127.0.0.1:PORT --num_processes=2 \
        --process_id=R --devices_per_process=2 --out=DIR

Joins the job (`paged_jax.distributed.multiprocess.initialize`, CPU gloo
collectives), builds ONE global ('tp',) mesh over every process's devices, then
  1. runs the tensor-parallel paged forward on the FORWARD_SCHEDULE steps of
     tests/distributed_fixtures.py (inputs as global arrays) and
  2. runs the tensor-parallel Engine's greedy generation on its PROMPTS,
and writes DIR/process_R.json with the logits and generated ids.
"""

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from paged_jax.distributed import multiprocess  # pylint: disable=g-import-not-at-top


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--coordinator", required=True)
  ap.add_argument("--num_processes", type=int, required=True)
  ap.add_argument("--process_id", type=int, required=True)
  ap.add_argument("--devices_per_process", type=int, default=2)
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  multiprocess.initialize(args.coordinator, args.num_processes, args.process_id,
                          cpu_devices_per_process=args.devices_per_process,
                          initialization_timeout=60)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import distributed_fixtures as fx  # pylint: disable=g-import-not-at-top
  from paged_jax.distributed import (TensorParallelDecoder, make_mesh,  # pylint: disable=g-import-not-at-top
                                     make_tp_engine)

  result = {"process_id": jax.process_index(), "process_count": jax.process_count(),
            "device_count": jax.device_count(), "local_device_count": jax.local_device_count()}
  mesh = make_mesh(tp=jax.device_count())
  replicated = NamedSharding(mesh, P())
  put = lambda x: multiprocess.global_array(x, replicated)
  params_host = fx.params()

  # 1. Model-level: the tp forward over the global mesh.
  tp_model = TensorParallelDecoder(fx.CONFIG, mesh, attention_backend="reference")
  params = tp_model.shard_params(params_host)   # device_put of identical host values
  pages = tp_model.init_pages(fx.CACHE)
  result["local_page_shards"] = [
      [list(s.data.shape), s.device.id] for s in pages.k.addressable_shards]
  step = jax.jit(tp_model.apply)
  logits = []
  for tokens, positions, fields in fx.forward_inputs(seed=4):
    out, pages = step(params, put(tokens), put(positions), pages, fx.as_meta(fields, put))
    logits.append(multiprocess.to_host(out).tolist())
  result["logits"] = logits

  # 2. Engine-level: greedy generation with the tensor-parallel engine.
  try:
    engine = make_tp_engine(fx.CONFIG, params_host, fx.CACHE, mesh=mesh, **fx.ENGINE_KW)
    outs = engine.generate(fx.PROMPTS, fx.greedy())
    result["outputs"] = [o.outputs[0] for o in outs]
  except Exception:  # pylint: disable=broad-except
    result["engine_error"] = traceback.format_exc()
  with open(os.path.join(args.out, f"process_{args.process_id}.json"), "w") as f:
    json.dump(result, f)
  multiprocess.shutdown()


if __name__ == "__main__":
  main()
