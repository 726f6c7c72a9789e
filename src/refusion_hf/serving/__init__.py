"""`refusion serve`: ReFusion models behind an OpenAI-compatible HTTP API, on `transformers serve`'s machinery
(`server.py`). Needs the `serving` extra (fastapi, uvicorn, openai)."""
