"""`--api-key`: every route but /health answers 401 (with WWW-Authenticate) without the Bearer key,
the explorer page included; the real `openai` client gets in with the key and is refused without it."""

import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")

from glasslm.cli import serve as serve_command  # noqa: E402
from glasslm.cli.common import CheckpointOption, RuntimeOptions  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402

from test_serve import tiny_model  # noqa: E402

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def url():
    model, tok = tiny_model()
    with serving_in_thread(create_app(model, tok, ServeConfig(name="tiny", api_key=KEY))) as address:
        yield address


def _status(url: str, path: str, key: str | None, body: bytes | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers)


@pytest.mark.parametrize("path,body", [
    ("/", None), ("/static/app.js", None), ("/api/info", None), ("/api/tokenize", b'{"text": "hi"}'),
    ("/api/logit-attribution", b'{"text": "hi"}'), ("/api/head-scores", b'{"text": "hi"}'),
    ("/api/patching", b'{"text": "hi", "corrupted_text": "ho", "answer": "a", "wrong_answer": "e"}'),
    ("/v1/models", None), ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1}'),
    ("/tokenize", b'{"prompt": "hi"}'), ("/openapi.json", None), ("/docs", None), ("/no-such-page", None),
])
def test_every_route_needs_the_key(url, path, body):
    for key in (None, "wrong", KEY + "x"):
        status, headers = _status(url, path, key, body)
        assert status == 401 and headers.get("www-authenticate") == "Bearer", (path, key, status)
    status, _ = _status(url, path, KEY, body)
    assert status == (404 if path == "/no-such-page" else 200), path


def test_health_stays_open_for_probes(url):
    assert _status(url, "/health", None)[0] == 200


def test_the_openai_client_with_the_key_and_with_a_wrong_one(url):
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    reply = good.completions.create(model="tiny", prompt="ROMEO:", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad.completions.create(model="tiny", prompt="ROMEO:", max_tokens=3)


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="api_key"):
        ServeConfig(api_key=" ")


def test_glasslm_serve_takes_the_key_from_the_environment(monkeypatch):
    seen = {}
    monkeypatch.setenv("GLASSLM_API_KEY", "from-env")
    monkeypatch.setattr(serve_command, "load_for_inference", lambda *a, **k: tiny_model())
    monkeypatch.setattr("glasslm.hf.load_chat_template", lambda checkpoint, tokenizer, template_file: None)
    monkeypatch.setattr("glasslm.serving.server.serve",
                        lambda model, tok, config, chat_template=None, metrics_file=None: seen.update(config=config))
    assert serve_command.serve(CheckpointOption("runs/x"), ServeConfig(), RuntimeOptions()) == 0
    assert seen["config"].api_key == "from-env" and seen["config"].host == "127.0.0.1"
    serve_command.serve(CheckpointOption("runs/x"), ServeConfig(api_key="flag"), RuntimeOptions())
    assert seen["config"].api_key == "flag"  # the option wins over the environment
