"""The HTTP text-generation service: TGI- and OpenAI-compatible routes over a continuous-batching engine.

- `app.config`  settings (env `GPT_*`, CLI flags)
- the engine (`engine/`, below this package) runs the model; `app` is HTTP only
- `app.server`  the FastAPI application (`create_app`)
- `app.main`    `app` for `uvicorn app.main:app`
- `python -m app` the CLI entry point
"""

__version__ = "0.2.0"
