"""The explorer page in a real browser: Playwright driving headless Chromium against a real server.

The browser is the system's Chromium (Debian's `chromium` package; .ci/run installs it), or the
one in $GLASSLM_CHROMIUM; Playwright's own browser download is not needed. Every request goes to
127.0.0.1. Set GLASSLM_SCREENSHOT=path to keep a screenshot of the page outside the tmp dir.
"""

import json
import os
import shutil
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (the test extra)")

from glasslm.io.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from glasslm.presets import get_preset# noqa: E402
from glasslm.generation import GenerationConfig, generate  # noqa: E402
from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402
from glasslm.tokenizers import CharTokenizer  # noqa: E402

pytestmark = [pytest.mark.slow,  # the long runs: `pytest -m "not slow"` leaves them out
              pytest.mark.xdist_group("browser")]  # under xdist, one Chromium at a time

CHARS = "\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def find_chromium() -> str | None:
    for candidate in (os.environ.get("GLASSLM_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium binary found (apt-get install chromium, or set GLASSLM_CHROMIUM)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield browser
        browser.close()


def open_page(browser, url: str):
    """A page on `url` once the explorer says it is ready, and the list of requests it sent elsewhere."""
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    outside = []  # every request must stay on this machine
    page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready=true]", timeout=20_000)
    return page, outside


@pytest.fixture(scope="module")
def page_and_server(browser, tmp_path_factory):
    tok = CharTokenizer(list(CHARS))
    torch.manual_seed(0)
    config = get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=2, d_model=32, n_heads=4,
                        context_length=64)
    path = save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TransformerLM(config), tok)
    model, tok, _ = load_checkpoint(path)
    model.eval()
    app = create_app(model, tok, ServeConfig(name="tiny"))
    with serving_in_thread(app) as url:
        page, outside = open_page(browser, url)
        yield page, url, model, tok, app.state.engine
        assert outside == []
        page.close()


def api(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def assert_lens_shows(page, url: str, body: dict, positions: int) -> None:
    """Click Logit lens; every cell's token is the API's top token for that layer and position."""
    page.click("#show-lens")
    page.wait_for_selector("#lens td[data-layer]")
    lens = page.locator("#lens td[data-layer]").evaluate_all(
        "els => els.map(e => [Number(e.dataset.layer), Number(e.dataset.pos), Number(e.dataset.id)])")
    layers = api(url, "/api/logit-lens", body)["layers"]
    assert len(lens) == len(layers) * positions
    assert all(layers[layer][pos]["id"] == token for layer, pos, token in lens)


def test_generation_streams_tokens_into_the_page(page_and_server, tmp_path):
    page, url, model, tok, engine = page_and_server
    page.fill("#prompt", "ROMEO:")
    page.fill("#max-tokens", "40")
    page.fill("#seed", "3")
    # Hold the server's worker at its 5th step: the page must already show the tokens sent so far.
    gate, steps, feed = threading.Event(), [], engine._feed
    def paused_feed(tokens):
        steps.append(1)
        if len(steps) == 5:
            gate.wait(60)
        return feed(tokens)
    engine._feed = paused_feed
    try:
        page.click("#generate")
        page.wait_for_function("document.querySelectorAll('#output .tok.gen').length >= 4")
        assert page.locator("#output .tok.gen").count() < 40
        assert page.get_attribute("#output", "data-done") is None and page.is_enabled("#stop")
    finally:
        gate.set()
        engine._feed = feed
    page.wait_for_selector("#output[data-done=true]", timeout=60_000)
    spans = page.locator("#output .tok.gen")
    ids = [int(i) for i in spans.evaluate_all("els => els.map(e => e.dataset.id)")]
    # Seeded sampling at the page's default temperature 0.8: what the library generates alone.
    expected = generate(model, [tok.encode("ROMEO:")], GenerationConfig(max_new_tokens=40, temperature=0.8, seed=3))
    assert ids == expected[0].tokens
    assert "40 tokens" in page.inner_text("#gen-status") and "finish: length" in page.inner_text("#gen-status")

    # The last token is selected: the bars show /api/next-token for its context, and follow the controls.
    page.wait_for_selector("#next-token-bars .bar-row[data-adjusted]")
    context = tok.encode("ROMEO:") + ids[:-1]
    table = api(url, "/api/next-token", {"tokens": context[-64:], "k": 12, "temperature": 0.8})
    shown = page.locator("#next-token-bars .bar-row").evaluate_all("els => els.map(e => Number(e.dataset.prob))")
    assert shown == pytest.approx([row["prob"] for row in table["top"]], abs=1e-6)
    page.locator("#temperature").fill("0")  # greedy: all mass on the top token, re-drawn live
    page.wait_for_function("document.querySelector('#next-token-bars .bar-row').dataset.adjusted === '1'")
    page.screenshot(path=tmp_path / "generate.png")


def test_attention_heat_map_shows_the_apis_numbers(page_and_server, tmp_path):
    page, url, model, tok, engine = page_and_server
    text = "To be, or not to be"
    page.fill("#inspect-text", text)
    page.select_option("#layer", "1")
    page.select_option("#head", "2")
    page.click("#show-attention")
    page.wait_for_selector("#attention-map svg[data-layer='1'][data-head='2']")
    cells = page.locator("#attention-map rect.cell").evaluate_all(
        "els => els.map(e => [Number(e.dataset.q), Number(e.dataset.k), Number(e.dataset.p)])")
    pattern = api(url, "/api/attention", {"text": text, "layer": 1, "head": 2})["patterns"][0]
    n = len(tok.encode(text))
    assert len(cells) == n * n
    for q, k, p in cells:
        assert p == pytest.approx(pattern[q][k], abs=1e-7)
    # The page's head 2 is the model's own head 2 (not, say, head 0 of the same layer).
    other = api(url, "/api/attention", {"text": text, "layer": 1, "head": 0})["patterns"][0]
    assert any(abs(p - other[q][k]) > 1e-4 for q, k, p in cells)

    assert_lens_shows(page, url, {"text": text}, n)

    page.fill("#loss-text", "First Citizen:\nBefore we proceed")
    page.click("#score")
    page.wait_for_selector("#loss-output .tok[data-loss]")
    losses = page.locator("#loss-output .tok").evaluate_all("els => els.map(e => e.dataset.loss ?? null)")
    expected = api(url, "/api/token-loss", {"text": "First Citizen:\nBefore we proceed"})["loss"]
    assert losses[0] is None and [float(x) for x in losses[1:]] == pytest.approx(expected[1:], abs=1e-6)

    shot = tmp_path / "explorer.png"
    page.screenshot(path=shot, full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("GLASSLM_SCREENSHOT"):
        shutil.copy(shot, Path(os.environ["GLASSLM_SCREENSHOT"]))


def test_the_demo_shaped_model_keeps_text_and_generation_apart_and_in_context(page_and_server):
    """The README's flow on a context-64 model: Generate, then Attention and Logit lens still work."""
    page, url, model, tok, engine = page_and_server
    context = model.config.context_length
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    prompt = page.input_value("#prompt")
    # The default new-token count fits: prompt + new tokens <= the context (80 would not).
    assert len(tok.encode(prompt)) + int(page.input_value("#max-tokens")) <= context
    page.fill("#inspect-text", "To be, or not to be")
    page.fill("#prompt", "ROMEO:")
    page.fill("#max-tokens", "80")  # more than fits: capped, and the status says so
    page.fill("#seed", "5")
    page.click("#generate")
    page.wait_for_selector("#output[data-done=true]", timeout=60_000)
    fits = context - len(tok.encode("ROMEO:"))
    assert page.locator("#output .tok.gen").count() == fits
    assert "capped from 80" in page.inner_text("#gen-status")
    # The user's own text under "Inside the model" is untouched, and Attention answers for it.
    assert page.input_value("#inspect-text") == "To be, or not to be"
    page.click("#show-attention")
    page.wait_for_function("document.querySelector('#inspect-status').textContent.startsWith('19 tokens')")
    assert not page.locator("#inspect-status.error").count()

    # A text longer than the context: the page shows its last window and says which.
    page.click("#inspect-generation")
    long_text = "ROMEO:" + "".join(page.locator("#output .tok.gen").evaluate_all("els => els.map(e => e.textContent)"))
    assert page.input_value("#inspect-text") == long_text
    long_text = long_text + " and more words after it"
    page.fill("#inspect-text", long_text)
    ids = tok.encode(long_text)
    assert len(ids) > context
    page.select_option("#layer", "0")
    page.select_option("#head", "1")
    page.click("#show-attention")
    page.wait_for_function("document.querySelector('#inspect-status').textContent.includes('showing its last')")
    status = page.inner_text("#inspect-status")
    assert f"the text is {len(ids)} tokens; showing its last {context}" in status
    assert not page.locator("#inspect-status.error").count()
    window = ids[-context:]
    pattern = api(url, "/api/attention", {"tokens": window, "layer": 0, "head": 1})["patterns"][0]
    cells = page.locator("#attention-map rect.cell").evaluate_all(
        "els => els.map(e => [Number(e.dataset.q), Number(e.dataset.k), Number(e.dataset.p)])")
    assert len(cells) == context * context
    assert all(p == pytest.approx(pattern[q][k], abs=1e-7) for q, k, p in cells)
    assert_lens_shows(page, url, {"tokens": window}, context)
    assert "showing its last" in page.inner_text("#inspect-status")


def grid_cells(page, where: str) -> list[tuple[int, int, float]]:
    return [tuple(cell) for cell in page.locator(f"{where} rect.cell").evaluate_all(
        "els => els.map(e => [Number(e.dataset.row), Number(e.dataset.col), Number(e.dataset.value)])")]


def assert_grid_shows(page, where: str, expected: list[list[float]]) -> None:
    cells = grid_cells(page, where)
    assert len(cells) == len(expected) * len(expected[0])
    for row, col, value in cells:
        assert value == pytest.approx(expected[row][col], abs=1e-7), (where, row, col)


def test_logit_attribution_view_shows_the_apis_numbers(page_and_server, tmp_path):
    page, url, model, tok, engine = page_and_server
    text = "To be, or not to be"
    ids = tok.encode(text)
    page.fill("#inspect-text", text)
    page.click("#show-dla")
    expected = api(url, "/api/logit-attribution", {"tokens": ids})
    page.wait_for_selector(f"#dla-map svg[data-token='{expected['token']['id']}']")  # the top prediction by default
    assert_grid_shows(page, "#dla-map", expected["heads"])
    shown = dict(page.locator("#dla-components td[data-label]").evaluate_all(
        "els => els.map(e => [e.dataset.label, Number(e.dataset.value)])"))
    assert shown == pytest.approx({"all heads (the grid)": sum(map(sum, expected["heads"])),
                                   **{c["label"]: c["value"] for c in expected["components"]},
                                   "unembed bias": expected["unembed_bias"]}, abs=1e-6)
    total = float(page.get_attribute("#dla-components td[data-total]", "data-total"))
    assert total == pytest.approx(expected["logit_minus_mean"], abs=1e-7)
    assert total == pytest.approx(sum(shown.values()), abs=1e-4)  # the page's rows add up to what it says
    legend = page.locator("#dla-legend .legend")  # the colour key: red -max|head| ... blue +max|head|
    assert float(legend.get_attribute("data-max")) == pytest.approx(max(abs(v) for row in expected["heads"] for v in row))
    assert "blue adds" in legend.inner_text() and "red takes away" in legend.inner_text()

    # Another token from the list of top predictions, then one typed as text.
    second = expected["top"][1]["id"]
    page.select_option("#dla-token", str(second))
    page.wait_for_selector(f"#dla-map svg[data-token='{second}']")
    assert_grid_shows(page, "#dla-map", api(url, "/api/logit-attribution", {"tokens": ids, "token": second})["heads"])
    typed = tok.encode("q")[0]
    page.fill("#dla-token-text", "q")
    page.click("#show-dla")
    page.wait_for_selector(f"#dla-map svg[data-token='{typed}']")
    assert_grid_shows(page, "#dla-map", api(url, "/api/logit-attribution", {"tokens": ids, "token": typed})["heads"])
    third = expected["top"][2]["id"]  # picking from the list again clears the typed token
    page.select_option("#dla-token", str(third))
    page.wait_for_selector(f"#dla-map svg[data-token='{third}']")
    assert page.input_value("#dla-token-text") == ""
    page.fill("#dla-token-text", "qq")
    page.click("#show-dla")
    page.wait_for_selector("#analysis-status.error")
    assert "token: 'qq' is 2 tokens" in page.inner_text("#analysis-status")
    page.fill("#dla-token-text", "")
    page.screenshot(path=tmp_path / "attribution.png", full_page=True)


def test_head_score_table_shows_the_apis_numbers(page_and_server):
    page, url, model, tok, engine = page_and_server
    text = "abc abc abc"  # repeated tokens: duplicate-token and induction scores exist on the text too
    page.fill("#inspect-text", text)
    page.click("#show-scores")
    page.wait_for_function("document.querySelector('#analysis-status').textContent.startsWith('11 tokens')")
    expected = api(url, "/api/head-scores", {"tokens": tok.encode(text)})
    cells = page.locator("#scores td[data-source]").evaluate_all(
        "els => els.map(e => [e.dataset.source, e.dataset.score, Number(e.dataset.layer), Number(e.dataset.head),"
        " e.dataset.value === undefined ? null : Number(e.dataset.value)])")
    assert len(cells) == 2 * 3 * 2 * 4  # (text, random) x three scores x 2 layers x 4 heads
    for source, score, layer, head, value in cells:
        assert value == pytest.approx(expected[source][score]["scores"][layer][head], abs=1e-7)
    random = expected["repeated_random"]
    assert f"{random['batch']} sequences of {random['half']} random tokens" in page.inner_text("#scores-title")

    page.fill("#inspect-text", "abc")  # nothing repeats: the page says so instead of showing 0
    page.click("#show-scores")
    page.wait_for_function("document.querySelector('#analysis-status').textContent.startsWith('3 tokens')")
    blank = page.locator("#scores td[data-source=prompt][data-score=induction]").all_inner_texts()
    assert blank == ["–"] * 8


def test_patching_heat_map_shows_the_apis_numbers(page_and_server, tmp_path):
    page, url, model, tok, engine = page_and_server
    clean, corrupted = "To be, or not to be", "To be, or not to me"
    page.fill("#inspect-text", clean)
    page.fill("#corrupted-text", corrupted)
    page.fill("#answer", ",")
    page.fill("#wrong-answer", "!")
    body = {"text": clean, "corrupted_text": corrupted, "answer": ",", "wrong_answer": "!"}
    for hook in ("attn_out", "resid_pre"):
        page.select_option("#patch-hook", hook)
        page.click("#show-patching")
        page.wait_for_selector(f"#patch-map svg[data-hook='{hook}']")
        expected = api(url, "/api/patching", body | {"hook": hook})
        assert_grid_shows(page, "#patch-map", expected["patched"])
    # resid_pre of layer 0 is the embedding: the changed position restores the clean run (1), the rest nothing (0).
    changed = [i for i, (a, b) in enumerate(zip(tok.encode(clean), tok.encode(corrupted))) if a != b]
    layer0 = {col: value for row, col, value in grid_cells(page, "#patch-map") if row == 0}
    assert layer0 == pytest.approx({col: 1.0 if col in changed else 0.0 for col in layer0}, abs=1e-5)
    legend = page.locator("#patch-legend .legend")
    assert (legend.get_attribute("data-min"), legend.get_attribute("data-max")) == ("-1", "1")
    assert "restores the clean run" in legend.inner_text()
    page.screenshot(path=tmp_path / "patching.png", full_page=True)
    if os.environ.get("GLASSLM_SCREENSHOT"):
        shutil.copy(tmp_path / "patching.png", Path(os.environ["GLASSLM_SCREENSHOT"]).with_suffix(".patching.png"))

    page.fill("#corrupted-text", corrupted + "!")  # one token too many: the server's 400 names the field
    page.click("#show-patching")
    page.wait_for_selector("#patch-status.error")
    assert "corrupted_text: the corrupted prompt is 20 tokens and the clean one 19" in page.inner_text("#patch-status")


def test_the_explorer_works_on_the_induction_study_model(browser, tmp_path):
    """docs/induction.md serves the study's model: 64 characters, no ':' or space, so none of the usual
    example texts encode. Start-up must survive, fill the boxes from the vocabulary, and every view work."""
    from glasslm.interp.explore import page_defaults
    from glasslm.interp.induction import PRESET, save_study_model

    torch.manual_seed(0)
    save_study_model(TransformerLM(get_preset(PRESET)), str(tmp_path / "induction"))
    model, tok, _ = load_checkpoint(tmp_path / "induction")
    with serving_in_thread(create_app(model.eval(), tok, ServeConfig(name="induction"))) as url:
        page, outside = open_page(browser, url)
        assert "made from its own vocabulary" in page.inner_text("#page-status")
        texts = page_defaults(tok, model.config.context_length)["texts"]
        boxes = {"prompt": "#prompt", "inspect_text": "#inspect-text", "corrupted_text": "#corrupted-text",
                 "answer": "#answer", "wrong_answer": "#wrong-answer", "loss_text": "#loss-text"}
        assert {field: page.input_value(box) for field, box in boxes.items()} == texts
        page.fill("#max-tokens", "8")
        page.click("#generate")
        page.wait_for_selector("#output[data-done=true]", timeout=60_000)
        assert page.locator("#output .tok.gen").count() == 8
        for button, done in [("#show-attention", "#attention-map rect.cell"), ("#show-lens", "#lens td[data-layer]"),
                             ("#show-dla", "#dla-legend .legend"), ("#show-scores", "#scores td[data-source]"),
                             ("#show-patching", "#patch-legend .legend"), ("#score", "#loss-output .tok[data-loss]")]:
            page.click(button)
            page.wait_for_selector(done, timeout=30_000)
        ids = tok.encode(texts["inspect_text"])
        assert_grid_shows(page, "#dla-map", api(url, "/api/logit-attribution", {"tokens": ids})["heads"])
        patched = api(url, "/api/patching", {"text": texts["inspect_text"], "corrupted_text": texts["corrupted_text"],
                                             "answer": texts["answer"], "wrong_answer": texts["wrong_answer"]})
        assert_grid_shows(page, "#patch-map", patched["patched"])
        assert not page.locator(".status.error").count()
        page.fill("#prompt", "ROMEO:")  # a character the vocabulary lacks: the panel says which
        page.click("#generate")
        page.wait_for_selector("#gen-status.error")
        assert "'R'" not in page.inner_text("#gen-status") and "':' is not in" in page.inner_text("#gen-status")
        page.screenshot(path=tmp_path / "induction.png", full_page=True)
        assert outside == []
        page.close()


def test_the_training_run_panel_draws_the_runs_curves_and_follows_it(browser, tmp_path):
    """A GRPO run's metrics.jsonl: one chart for the loss and one per logged signal, each line with one point
    per record holding it; a step logged while the page is open shows on the next refresh."""
    rows = [{"step": s, "train_loss": 0.5 / s, "reward": 0.1 * s, "reward_std": 0.05, "kl": 0.002 * s,
             "completion_length": 12 - s, "completion_length_max": 16 - s} for s in (1, 2, 3)]
    rows.insert(2, {"step": 2, "val_loss": 0.4})
    metrics = tmp_path / "grpo-run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "train_lo')  # torn: skipped
    tok = CharTokenizer(list(CHARS))
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1, d_model=32,
                                     n_heads=4, context_length=64)).eval()
    with serving_in_thread(create_app(model, tok, ServeConfig(name="grpo"), metrics_file=metrics)) as url:
        page, outside = open_page(browser, url)
        page.wait_for_selector("#run-panel[data-steps='4']")

        def drawn():
            """{chart: {series: (points in data-points, vertices of its polyline)}}"""
            return page.locator("#run-charts svg").evaluate_all("""svgs => Object.fromEntries(svgs.map(svg =>
                [svg.dataset.key, Object.fromEntries([...svg.querySelectorAll('polyline')].map(l =>
                    [l.classList[1], [Number(l.dataset.points), l.getAttribute('points').trim().split(' ').length]]))]))""")

        assert drawn() == {"loss": {"train": [3, 3], "validation": [1, 1]}, "reward": {"train": [3, 3]},
                           "kl": {"train": [3, 3]}, "completion_length": {"train": [3, 3], "longest": [3, 3]}}
        assert page.locator("#run-charts svg[data-key=reward] polygon.band").count() == 1
        assert page.locator("#run-charts svg[data-key=loss] circle").count() == 1  # the validation dot
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows + [rows[-1] | {"step": 4}]))
        page.wait_for_selector("#run-panel[data-steps='5']", timeout=15_000)
        assert {series["train"][0] for series in drawn().values()} == {4}
        assert "grpo-run" in page.inner_text("#run-status") and "step 4" in page.inner_text("#run-status")
        page.screenshot(path=tmp_path / "run.png", full_page=True)
        assert outside == []
        page.close()


def test_a_model_from_no_run_says_so_in_the_training_run_panel(page_and_server):
    page = page_and_server[0]
    page.wait_for_selector("#run-panel[data-steps='0']")
    assert "not in a training run directory" in page.inner_text("#run-status")
    assert page.locator("#run-charts svg").count() == 0


def test_the_run_charts_axis_labels_are_whole_negative_numbers_included(browser, tmp_path):
    """Issue 47: a negative axis label ("-0.01179") is drawn whole inside its chart, minus sign and all."""
    rows = [{"step": s, "train_loss": 0.69 - 0.01 * s, "rewards/chosen": -0.05 * s, "rewards/rejected": -0.03821 * s,
             "rewards/margins": -0.01179 * s, "rewards/accuracies": 1.0} for s in (1, 2, 3)]
    metrics = tmp_path / "dpo-run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = CharTokenizer(list(CHARS))
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1, d_model=32,
                                     n_heads=4, context_length=64)).eval()
    with serving_in_thread(create_app(model, tok, ServeConfig(name="dpo"), metrics_file=metrics)) as url:
        page, outside = open_page(browser, url)
        page.wait_for_selector("#run-panel[data-steps='3']")
        labels = page.locator("#run-charts svg text").evaluate_all(
            "ts => ts.map(t => [t.closest('svg').dataset.key, t.textContent, t.getBBox().x])")
        assert any(text in ("-0.03537", "\u22120.03537") for _, text, _ in labels), labels  # 3 x -0.01179
        clipped = [(key, text, x) for key, text, x in labels if x < 0]
        assert clipped == []
        lines = page.locator("#run-charts svg[data-key='rewards/chosen'] polyline").evaluate_all(
            "ls => ls.map(l => [l.classList[1], Number(l.dataset.points)])")
        assert sorted(lines) == [["chosen", 3], ["rejected", 3]]  # the chosen and rejected rewards, one chart
        assert outside == []
        page.close()


def test_the_experts_view_shows_each_tokens_chosen_experts(browser, page_and_server, tmp_path):
    """On a mixture of experts the Experts button shows every layer's top-k experts per token, the API's;
    on a dense model it stays hidden."""
    dense_page = page_and_server[0]
    assert dense_page.locator("#show-experts").is_hidden() and dense_page.locator("#experts-view").is_hidden()
    tok = CharTokenizer(list(CHARS))
    torch.manual_seed(0)
    model = TransformerLM(get_preset("shakespeare-char-cpu-moe", vocab_size=tok.vocab_size, n_layers=2,
                                     context_length=64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    app = create_app(model, tok, ServeConfig(name="tiny-moe"))
    with serving_in_thread(app) as url:
        page, outside = open_page(browser, url)
        text = "To be, or not to be"
        page.fill("#inspect-text", text)
        page.click("#show-experts")
        page.wait_for_selector("#experts td[data-layer]")
        cells = page.locator("#experts td[data-layer]").evaluate_all(
            "els => els.map(e => [Number(e.dataset.layer), Number(e.dataset.pos), e.dataset.experts])")
        layers = {row["layer"]: row for row in api(url, "/api/experts", {"text": text})["layers"]}
        assert len(cells) == 2 * len(tok.encode(text)) and sorted(layers) == [0, 1]
        assert all(",".join(map(str, layers[layer]["experts"][pos])) == chosen for layer, pos, chosen in cells)
        assert len({chosen for _, _, chosen in cells}) > 1
        assert outside == []
        page.close()
