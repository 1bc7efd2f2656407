"""The pictures `glasslm inspect` draws: every part of them on the canvas."""

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from glasslm.core.model import TransformerLM
from glasslm.interp.inspection import LOGIT_LENS_TITLE, encode_prompt, logit_lens_figure, logit_lens_top
from glasslm.presets import get_preset
from glasslm.tokenizers.char import CharTokenizer


@pytest.mark.parametrize("prompt", ["R", "RO", "ROM"])
def test_the_logit_lens_title_lies_inside_the_figure_for_a_short_prompt(prompt):
    # The narrowest figure (a 1-3 token prompt) once cut the one-line title at both edges.
    tokenizer = CharTokenizer.from_text("ROMEO: ")
    torch.manual_seed(0)
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tokenizer.vocab_size)).eval()
    tokens, labels = encode_prompt(tokenizer, prompt, model.config.context_length)
    top_ids, top_probs = logit_lens_top(model, tokens)
    top_tokens = [[tokenizer.decode([int(i)]) for i in row] for row in top_ids]
    fig = logit_lens_figure(top_tokens, top_probs, labels, LOGIT_LENS_TITLE)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # runs constrained layout
    title = fig.axes[0].title
    box, page = title.get_window_extent(canvas.get_renderer()), fig.bbox
    assert title.get_text().replace("\n", " ") == LOGIT_LENS_TITLE  # all of it, perhaps on several lines
    assert page.x0 <= box.x0 and box.x1 <= page.x1, (box, page)
    assert page.y0 <= box.y0 and box.y1 <= page.y1, (box, page)
