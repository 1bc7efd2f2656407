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
