"""The HTTP text-generation service: TGI- and OpenAI-compatible routes over a continuous-batching engine.

- `app.config`  settings (env `GPT_*`, CLI flags)
- `app.engine`  the worker thread that owns the model and the KV-cache slots
- `app.server`  the FastAPI application (`create_app`)
- `app.main`    `app` for `uvicorn app.main:app`
- `python -m app` the CLI entry point
"""

__version__ = "0.2.0"
