"""`python -m paged_jax.serve` driven by the official `openai` client over loopback HTTP.

One server process (the shipped tiny model, a small cache) serves the module; the
SIGTERM test starts its own. Greedy answers are checked against `Engine.generate` run in
this process on the same checkpoint (the independent reference); everything else against
the protocol's promises: a 400 for a bad request and the server still serving, a dropped
stream's blocks freed, SIGTERM draining and exiting 0.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from paged_jax import tokenizer  # pylint: disable=g-import-not-at-top,wrong-import-position
from paged_jax.engine import Engine, SamplingParams  # pylint: disable=g-import-not-at-top,wrong-import-position
from paged_jax.models import DEFAULT_CHECKPOINT, load_hf_checkpoint  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--max_model_len=128", "--max_seqs=16", "--block_size=16", "--num_blocks=96",
        "--max_num_batched_tokens=128"]
PROMPTS = ["Once upon a time", "The little dog", "She said", "In the morning"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(extra=()):
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  # The log goes to a file: an unread pipe fills up and would block the server.
  log = tempfile.TemporaryFile("w+")
  proc = subprocess.Popen([sys.executable, "-m", "paged_jax.serve", f"--port={port}", *ARGS,
                           *extra], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                          text=True)
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      log.seek(0)
      raise RuntimeError(f"server exited {proc.returncode}: {log.read()[-2000:]}")
    try:
      with urllib.request.urlopen(url + "/health", timeout=2) as r:
        if r.status == 200:
          return proc, url
    except OSError:
      time.sleep(0.5)
  proc.kill()
  raise RuntimeError("server did not start in 300 s")


def _metrics(url) -> dict:
  with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
    text = r.read().decode()
  out = {}
  for line in text.splitlines():
    if line and not line.startswith("#"):
      name, value = line.rsplit(" ", 1)
      out[name] = float(value)
  return out


@pytest.fixture(scope="module")
def server():
  proc, url = _start()
  try:
    yield url
  finally:
    proc.terminate()
    proc.wait(timeout=120)


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference():
  """Greedy completions of PROMPTS from an in-process Engine: {(prompt, max_tokens): text}."""
  config, params = load_hf_checkpoint(DEFAULT_CHECKPOINT)
  cache = config.cache_config(block_size=16, max_seqs=8, max_blocks_per_seq=8, num_blocks=64)
  engine = Engine(config, params, cache, max_num_batched_tokens=128)
  sp = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(tokenizer.EOS_ID,))
  outs = engine.generate([tokenizer.encode(p) for p in PROMPTS], sp)
  return {p: tokenizer.decode(o.outputs[0]) for p, o in zip(PROMPTS, outs)}


def test_models_and_health(client, server):
  ids = [m.id for m in client.models.list().data]
  assert ids == ["tiny_byte_llama"]
  with urllib.request.urlopen(server + "/health") as r:
    assert r.status == 200


def test_greedy_completion_equals_engine_generate(client, reference):
  r = client.completions.create(model="tiny_byte_llama", prompt=PROMPTS[0], max_tokens=24,
                                temperature=0)
  assert r.choices[0].text == reference[PROMPTS[0]]
  assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]))
  assert r.usage.completion_tokens <= 24
  # A list of prompts: one choice each, in order; echo puts the prompt first.
  r = client.completions.create(model="m", prompt=PROMPTS[:2], max_tokens=24, temperature=0,
                                echo=True)
  assert [c.text for c in r.choices] == [p + reference[p] for p in PROMPTS[:2]]


def test_logprobs_are_the_engines(client):
  """logprobs=0: each sampled token's log-probability, equal to RequestOutput.logprobs
  (checked against the dense oracle in engine_logprobs_test), streamed or not."""
  config, params = load_hf_checkpoint(DEFAULT_CHECKPOINT)
  cache = config.cache_config(block_size=16, max_seqs=2, max_blocks_per_seq=8, num_blocks=16)
  sp = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(tokenizer.EOS_ID,))
  want = Engine(config, params, cache).generate([tokenizer.encode(PROMPTS[3])], sp)[0]
  r = client.completions.create(model="m", prompt=PROMPTS[3], max_tokens=12, temperature=0,
                                logprobs=0)
  lp = r.choices[0].logprobs
  assert lp.tokens == [tokenizer.decode([i]) for i in want.outputs[0]]
  assert lp.token_logprobs == pytest.approx(want.logprobs[0], abs=1e-5)
  assert lp.text_offset == [len(tokenizer.decode(want.outputs[0][:k]))
                            for k in range(len(want.outputs[0]))]
  chunks = list(client.chat.completions.create(
      model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
      temperature=0, logprobs=True, stream=True))
  streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
              for c in ch.choices[0].logprobs.content]
  whole = client.chat.completions.create(
      model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
      temperature=0, logprobs=True)
  assert [c.logprob for c in streamed] == [c.logprob for c in whole.choices[0].logprobs.content]
  assert len(streamed) == whole.usage.completion_tokens


@pytest.fixture(scope="module")
def dense_logprobs():
  """ids -> f64[len(ids), vocab]: every position's next-token log-probabilities by the
  dense, cache-free forward (the oracle)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from paged_jax.models import dense  # pylint: disable=g-import-not-at-top
  config, params = load_hf_checkpoint(DEFAULT_CHECKPOINT)

  def logprobs(ids):
    logits = np.asarray(dense.forward(params, config, np.asarray(ids, np.int32)), np.float64)
    m = logits.max(axis=-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
  return logprobs


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, dense_logprobs):
  """lm-evaluation-harness's loglikelihood request (local-completions): echo, logprobs=1,
  max_tokens=1, temperature 0. Every prompt token after the first gets log p(token |
  before) and its best alternative, equal to the dense oracle's; the first has none."""
  prompt = "The little dog ran"
  ids = tokenizer.encode(prompt)
  r = client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                                echo=True, logprobs=1)
  lp = r.choices[0].logprobs
  ref = dense_logprobs(ids + [0])
  assert r.choices[0].text.startswith(prompt)
  assert lp.tokens[:len(ids)] == [tokenizer.decode([i]) for i in ids]
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  assert lp.token_logprobs[1:len(ids)] == pytest.approx(
      [ref[i - 1, ids[i]] for i in range(1, len(ids))], abs=1e-4)
  for i in range(1, len(ids)):   # the best alternative (and the prompt token itself)
    best = tokenizer.decode([int(ref[i - 1].argmax())])
    assert lp.top_logprobs[i][best] == pytest.approx(ref[i - 1].max(), abs=1e-4)
    assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
  assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
  assert lp.text_offset[:len(ids)] == [len(tokenizer.decode(ids[:k])) for k in range(len(ids))]


def test_top_alternatives_of_generated_tokens(client, dense_logprobs):
  """completions logprobs=3 and chat top_logprobs=2: each generated token's best
  alternatives are the dense oracle's, streamed or not."""
  prompt = PROMPTS[1]
  r = client.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0,
                                logprobs=3)
  lp = r.choices[0].logprobs
  ids = tokenizer.encode(prompt)
  out = [tokenizer.encode(t)[-1] for t in lp.tokens]   # [BOS, byte] each
  ref = dense_logprobs(ids + out)
  for k, top in enumerate(lp.top_logprobs):
    row = ref[len(ids) + k - 1]
    want = {tokenizer.decode([int(i)]): row[i] for i in row.argsort()[::-1][:3]}
    assert set(want) <= set(top) and len(top) <= 4
    assert [top[t] for t in want] == pytest.approx(list(want.values()), abs=1e-4)
  msgs = [{"role": "user", "content": "Hi"}]
  whole = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2)
  chunks = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=4,
                                               temperature=0, logprobs=True, top_logprobs=2,
                                               stream=True))
  streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
              for c in ch.choices[0].logprobs.content]
  content = whole.choices[0].logprobs.content
  assert [[a.logprob for a in c.top_logprobs] for c in streamed] == [
      [a.logprob for a in c.top_logprobs] for c in content]
  for c in content:   # best first, the sampled (greedy) token the best
    assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
    assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)


def test_stream_concatenates_to_the_whole_answer(client, reference):
  chunks = list(client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=24,
                                          temperature=0, stream=True))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[PROMPTS[1]]
  assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_stop_string_cuts_the_text(client, reference):
  full = reference[PROMPTS[0]]
  stop = full[5:8]
  r = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                stop=[stop])
  assert r.choices[0].text == full[:full.find(stop)]
  assert r.choices[0].finish_reason == "stop"


def test_chat_completion_uses_the_template(client):
  msgs = [{"role": "user", "content": "Once upon a time"}]
  r = client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0,
                                     seed=3)
  assert r.choices[0].message.role == "assistant"
  assert r.usage.prompt_tokens == len(tokenizer.encode("<|user|>Once upon a time\n"
                                                       "<|assistant|>"))
  streamed = client.chat.completions.create(model="m", messages=msgs, max_tokens=8,
                                            temperature=0, stream=True)
  text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
  assert text == r.choices[0].message.content


def test_sixteen_concurrent_requests_all_answer_as_alone(client, reference):
  def one(i):
    p = PROMPTS[i % len(PROMPTS)]
    return p, client.completions.create(model="m", prompt=p, max_tokens=24,
                                        temperature=0).choices[0].text
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    answers = list(pool.map(one, range(16)))
  assert [t for _, t in answers] == [reference[p] for p, _ in answers]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": [5, 999]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "seed": -2}, "seed"),
])
def test_bad_request_is_400_and_the_server_keeps_serving(client, reference, body, param):
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="m", **{k: v for k, v in body.items()})
  assert e.value.status_code == 400 and e.value.body["param"] == param
  r = client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=24, temperature=0)
  assert r.choices[0].text == reference[PROMPTS[2]]


def test_not_json_and_bad_messages_are_400(server, client):
  req = urllib.request.Request(server + "/v1/completions", data=b"{not json",
                               headers={"Content-Type": "application/json"})
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(req)
  assert e.value.code == 400 and "JSON" in json.loads(e.value.read())["error"]["message"]
  with pytest.raises(openai.BadRequestError):
    client.chat.completions.create(model="m", messages=[], max_tokens=3)


def test_dropped_stream_frees_its_blocks(client, server):
  stream = client.completions.create(model="m", prompt="Once", max_tokens=100, stream=True,
                                     temperature=0.8, seed=1)
  for i, _ in enumerate(stream):
    if i == 2:
      break
  stream.close()
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    m = _metrics(server)
    if m["paged_jax:num_requests_running"] == 0 and m["paged_jax:kv_cache_usage_perc"] == 0:
      break
    time.sleep(0.2)
  assert m["paged_jax:num_requests_running"] == 0
  assert m["paged_jax:kv_cache_usage_perc"] == 0
  assert m['paged_jax:request_success_total{finished_reason="abort"}'] >= 1


def test_sigterm_drains_running_requests_and_exits_zero():
  proc, url = _start(["--drain_s=60"])
  try:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      fut = pool.submit(c.completions.create, model="m", prompt="Once", max_tokens=60,
                        temperature=0)
      time.sleep(1.0)        # the request is in (it compiles and runs for seconds)
      proc.send_signal(signal.SIGTERM)
      r = fut.result(timeout=300)
    assert r.choices[0].finish_reason in ("length", "stop", "abort")
    assert proc.wait(timeout=120) == 0
  finally:
    if proc.poll() is None:
      proc.kill()


def test_speculating_server_answers_as_the_engine_without_speculation(reference):
  """--speculative_config (vLLM's JSON): greedy completions equal the in-process engine's
  without speculation."""
  proc, url = _start(['--speculative_config={"method": "ngram", "num_speculative_tokens": 3,'
                      ' "prompt_lookup_max": 3, "prompt_lookup_min": 1}'])
  try:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for prompt, text in reference.items():
      r = c.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
      assert r.choices[0].text == text
  finally:
    proc.terminate()
    proc.wait(timeout=120)


@pytest.mark.parametrize("value", ["{not json", '{"method": "ngram"}'])
def test_bad_speculative_config_is_a_one_line_exit(value):
  r = subprocess.run([sys.executable, "-m", "paged_jax.serve", f"--speculative_config={value}"],
                     cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
                     capture_output=True, text=True, timeout=300)
  assert r.returncode != 0
  last = r.stderr.strip().splitlines()[-1]
  assert "speculative_config" in last, r.stderr[-2000:]
