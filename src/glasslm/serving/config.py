"""`ServeConfig`: everything about a server that is not the model (the `glasslm serve` options).

Example:
    >>> ServeConfig(port=0, max_batch=8).max_queue
    64
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass
class ServeConfig:
    """How `glasslm serve` listens, batches, queues and who it lets in."""

    host: str = "127.0.0.1"  # address to listen on (127.0.0.1: this machine only)
    port: int = 8000  # TCP port; 0 picks a free one
    name: str | None = None  # model name in the API; none: the checkpoint directory's name
    max_batch: int = 32  # requests decoded together; 1 serves one at a time
    max_queue: int = 64  # requests that may wait; more get HTTP 429
    max_tokens_limit: int = 2048  # largest max_tokens a request may ask for
    grace: float = 10.0  # seconds in-flight requests get to finish after SIGTERM before they are aborted
    log_level: LogLevel = "info"  # server log detail; info logs one line per request
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on every route but /health; default $GLASSLM_API_KEY
    ignore_eos: bool = False  # go on past the model's end-of-sequence tokens (they end a completion by default)
    # memory for keys and values of recent prompts and answers, reused by requests that begin alike
    # (a shared system prompt, the earlier turns of a chat); 0 turns the prefix cache off
    prefix_cache_mb: int = 512
    # a Jinja chat template file for /v1/chat/completions; none: the checkpoint's own (chat_template.jinja or
    # tokenizer_config.json's chat_template)
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {self.max_batch} and {self.max_queue}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")
        if self.max_tokens_limit < 1 or self.grace < 0:
            raise ValueError("max_tokens_limit must be >= 1 and grace >= 0")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")
