"""`refusion serve`: ReFusion models behind an OpenAI-compatible HTTP API of this package's own, on public APIs only
(`app.py`: routes; `protocol.py`: request models; `handler.py`: a request's path; `prompts.py`: chat templates and
tokens; `decoding.py`: the decoding worker on `generate()` / `generate_batch()`; `connections.py`: HTTP deadlines).
Needs the `serving` extra (fastapi, uvicorn, pydantic, openai, prometheus-client)."""
