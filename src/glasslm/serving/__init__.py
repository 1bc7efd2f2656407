"""`glasslm serve`: an OpenAI-compatible completions server and the explorer page, in one process (docs/serving.md).

- `app`: `create_app(model, tokenizer, config)`, the FastAPI app assembled from `routes/`;
- `routes/`: one module per concern (`health`, `completions`, `chat`, `tokenize`, `explorer`), each exposing a `router`;
- `context`: `Served`, what every route shares (model, tokenizer, config, engine, prompt encoding) and
  the checks of a request against the model (`Served.check`);
- `schemas`: request bodies and OpenAI's response shapes; `errors`: OpenAI-shaped error answers;
- `events`: a request's events gathered whole, or streamed as server-sent events;
- `server`: `serve` under uvicorn with a graceful SIGTERM, and `serving_in_thread` for embedding;
- `config`: `ServeConfig`, the one place the server's defaults live.

Decoding itself is `glasslm.generation.engine.Engine` (continuous batching). Everything but
`config` needs the `serve` extra (fastapi, uvicorn).
"""
