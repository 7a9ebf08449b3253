"""Serving a trained model over HTTP (the --serve stage, model/serve_stage.py, runs these).

config.py        ServeConfig: the [serve] section (address, key, limits)
engine.py        the engine thread: a queue, continuous batching, text to each request
batch.py         the batch's compiled programs: per-row positions, rows in and out
text.py          streamed text: bytes to UTF-8, stop strings
openai_api.py    OpenAI's requests checked, and the objects answered
app.py           the Starlette routes, server-sent events, errors, the API key
playground.html  the page at GET /
"""
