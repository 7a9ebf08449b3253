"""Serving a trained model over HTTP (the --serve stage, model/serve_stage.py, runs these).

config.py        ServeConfig: the [serve] section (address, key, limits)
requests.py      a request to the engine, and its two refusals (queue full, stopping)
engine.py        the engine thread: continuous batching, text to each request
inbox.py         what other threads share with it: the waiting queue, status, counters
batch_state.py   the batch as the device holds it, and each row's sampling settings
prefix.py        prefix reuse: which row's kept prompt a new request starts from
programs.py      which chunk and prefill shapes the engine runs, compiled before it serves
batch.py         the batch's compiled programs: per-row positions, rows in and out
text.py          streamed text: bytes to UTF-8, stop strings
outbox.py        a request's output held back, sent at most every stream interval
logprobs.py      log-probabilities in OpenAI's shapes (completions and chat)
openai_api.py    OpenAI's requests checked, and the objects answered
bodies.py        request bodies read within their size, buffer and time bounds
job.py           one prompt's engine request and the events that come back for it
guard.py         before a route: the Host check, JSON only, bounded connections
metrics.py       GET /metrics in Prometheus's text format
app.py           the Starlette routes, server-sent events, errors, the API key
playground.html  the page at GET /
"""
