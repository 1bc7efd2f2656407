"""schemathesis against `glasslm serve`'s own /openapi.json: every operation, bodies generated to fit the
schema and to break it, a bounded number of each. No answer may be a 5xx, and every 4xx must be OpenAI's
error shape with a message naming the field it is about (`param`, or the body as a whole)."""

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402

from test_serve import tiny_model  # noqa: E402

EXAMPLES = 12  # per operation and mode: ~20 s in all on a busy 2-core machine
BUSY = 429  # the queue is full: about no field, and expected under a burst of generated requests


def _check(response) -> None:
    method, path = response.request.method, response.request.url
    assert response.status_code < 500, (method, path, response.request.body, response.text)
    if 400 <= response.status_code < 500 and response.status_code != BUSY:
        error = response.json()["error"]
        message, param = error["message"], error["param"]
        assert message and "Traceback" not in message, (path, error)
        if response.status_code in (400, 422):
            about_body = "body" in message or "JSON" in message
            assert (param and param.split(".")[0].split("[")[0] in message) or about_body, (
                method, path, response.request.body, error)


@pytest.mark.slow
def test_no_generated_request_gets_a_5xx_and_every_4xx_names_its_field():
    model, tok = tiny_model()
    config = ServeConfig(name="tiny", max_batch=4, max_queue=8, max_tokens_limit=4)  # fuzzed requests stay short
    with serving_in_thread(create_app(model, tok, config)) as url:
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/completions", "/tokenize", "/detokenize", "/api/next-token"}
        calls = []
        for operation in operations:
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def fuzz(case):
                    response = case.call(base_url=url, timeout=30)
                    calls.append(response.status_code)
                    _check(response)

                try:
                    fuzz()
                except Unsatisfiable:  # nothing to break in a GET without parameters
                    assert mode == schemathesis.GenerationMode.NEGATIVE and operation.method.upper() == "GET"
        assert len(calls) >= len(operations) * 2  # every operation was exercised in both modes
