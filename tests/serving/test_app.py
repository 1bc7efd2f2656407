"""The app is assembled from the route modules: every module in serving/routes is included, each path once."""

import importlib
import pkgutil

import pytest

pytest.importorskip("fastapi")

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from glasslm.serving import routes  # noqa: E402
from glasslm.serving.app import ROUTERS, create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.tokenizers import CharTokenizer  # noqa: E402


def test_every_route_module_is_included_in_the_app():
    modules = [importlib.import_module(f"glasslm.serving.routes.{m.name}") for m in pkgutil.iter_modules(routes.__path__)]
    assert {id(m.router) for m in modules} == {id(r) for r in ROUTERS}
    tok = CharTokenizer.from_text("ab")
    app = create_app(TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=2, n_layers=1)).eval(), tok,
                     ServeConfig(name="m"))
    # OpenAPI writes a path parameter without its converter ({model_id:path} as {model_id})
    expected = {route.path.replace(":path}", "}") for router in ROUTERS for route in router.routes
                if getattr(route, "include_in_schema", False)}
    assert set(app.openapi()["paths"]) == expected
    assert {"/health", "/v1/completions", "/v1/models", "/api/next-token"} <= expected
    assert app.state.served.name == "m" and app.state.engine is app.state.served.engine


def test_an_app_needs_a_tokenizer():
    with pytest.raises(ValueError, match="no tokenizer"):
        create_app(TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=2, n_layers=1)), None)


def _body_schema(spec: dict, path: str) -> dict:
    """The JSON schema of an operation's request body, its $refs resolved against the spec's components."""
    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(spec["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]])
            return {k: resolve(v) for k, v in node.items()}
        return [resolve(v) for v in node] if isinstance(node, list) else node
    return resolve(spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])


def test_the_openapi_documents_the_statuses_the_server_answers_and_405_names_the_allowed_methods():
    """Issue 47 (schemathesis's findings): /openapi.json listed only 200 and 422, while the server answers 400
    (never 422) and 404 as designed; `POST /api/attention {}` fitted the schema and was refused; 405 had no Allow."""
    from fastapi.testclient import TestClient
    import jsonschema_rs

    tok = CharTokenizer.from_text("ab")
    app = create_app(TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=3, n_layers=1)).eval(), tok,
                     ServeConfig(name="m"))
    spec = app.openapi()
    probes = [("post", "/v1/completions", {"prompt": "ab", "max_tokens": "many"}, 400),
              ("post", "/v1/completions", {"prompt": "ab", "model": "other"}, 404),
              ("post", "/v1/chat/completions", {"messages": []}, 400),
              ("get", "/v1/models/other", None, 404),
              ("post", "/tokenize", {"prompt": "ab", "model": "other"}, 404),
              ("post", "/detokenize", {"tokens": "ab"}, 400),
              ("post", "/api/attention", {"text": "ab", "layer": 9}, 400),
              ("post", "/api/next-token", {"text": "ab", "k": 0}, 400)]
    with TestClient(app) as client:
        for method, path, body, status in probes:
            answer = client.request(method, path, json=body)
            assert answer.status_code == status, (path, answer.text)
            documented = spec["paths"][path.replace("/other", "/{model_id}")][method]["responses"]
            assert str(status) in documented, (path, sorted(documented))
            error = documented[str(status)]["content"]["application/json"]["schema"]
            assert jsonschema_rs.validator_for(error if "$ref" not in error else
                                               spec["components"]["schemas"][error["$ref"].rsplit("/", 1)[1]]
                                               ).is_valid(answer.json())
        assert not [(p, m) for p, ops in spec["paths"].items() for m, op in ops.items() if "422" in op["responses"]]
        attention = jsonschema_rs.validator_for(_body_schema(spec, "/api/attention"))
        assert not attention.is_valid({}) and attention.is_valid({"text": "ab", "layer": 0})
        assert not attention.is_valid({"text": "ab", "tokens": [0]}) and not attention.is_valid({"text": ""})
        assert client.post("/api/attention", json={}).status_code == 400
        for method, path, allowed in (("get", "/v1/completions", "POST"), ("delete", "/v1/models", "GET"),
                                      ("put", "/api/attention", "POST")):
            answer = client.request(method, path)
            assert answer.status_code == 405 and answer.headers.get("allow") == allowed, (path, answer.headers)
