"""The wire formats, one module per API: request models (validated by FastAPI, strict: no "10" for an
integer, NaN refused, unknown keys ignored as TGI and vLLM do) and response models (for the OpenAPI
document; routes build plain dicts in the same shape).

- `app.protocol.common`  pieces both APIs share (strictness, "accepted only when off" fields)
- `app.protocol.tgi`     TGI's /generate, /generate_stream, POST / (router/src/server.rs shapes)
- `app.protocol.openai`  OpenAI's /v1/completions, /v1/chat/completions, /v1/models; vLLM's /tokenize
"""
