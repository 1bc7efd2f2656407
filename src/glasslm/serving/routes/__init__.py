"""The app's routes, one module per concern; each exposes `router`, and `glasslm.serving.app` includes them.

- `health`: GET /health (liveness, load and counters; 503 while draining);
- `completions`: OpenAI's POST /v1/completions and GET /v1/models;
- `tokenize`: POST /tokenize and /detokenize (vLLM's shapes);
- `chat`: OpenAI's POST /v1/chat/completions, messages rendered with the model's chat template;
- `explorer`: the explorer page (/ and /static) and its JSON endpoints under /api.
"""
