"""Fine-tuning data: the loss sees exactly the assistant's tokens, records are read with clear
errors, and padding changes nothing the loss sees."""

import json

import pytest
import torch
import torch.nn.functional as F

from glasslm.core.model import TransformerLM
from glasslm.data.sft import (
    IGNORE_INDEX, encode_conversation, padded_batch, read_conversations, sft_batches, split_examples,
)
from glasslm.presets import get_preset
from glasslm.tokenizers import train_tokenizer_from_text

CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def tokenizer():
    text = "user assistant reverse abc cba add 12 34 46 the answer is " * 30
    return train_tokenizer_from_text(text, vocab_size=300, special_tokens=SPECIALS)


def test_only_the_assistant_turns_are_trained(tokenizer):
    messages = [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"},
                {"role": "user", "content": "add 12 34"}, {"role": "assistant", "content": "46"}]
    example = encode_conversation(tokenizer, CHATML, messages)
    assert tokenizer.decode(example.ids) == "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    trained = [t for t in example.labels if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "cba<|im_end|>\n46<|im_end|>\n"
    for t, label in enumerate(example.labels):  # every trained label is the next token, nothing else
        assert label == IGNORE_INDEX or label == example.ids[t + 1]
    prompt_ids = tokenizer.encode("<|im_start|>user\nreverse abc<|im_end|>\n<|im_start|>assistant\n")
    assert example.ids[:len(prompt_ids)] == prompt_ids  # what the model sees when asked at inference


def test_records_in_both_shapes_and_errors_that_name_the_line(tmp_path):
    good = tmp_path / "chat.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                    + "\n\n" + json.dumps({"instruction": "add", "input": "1 2", "output": "3"}) + "\n")
    conversations = read_conversations(good)
    assert conversations[1] == [{"role": "user", "content": "add\n\n1 2"}, {"role": "assistant", "content": "3"}]
    cases = {
        "{not json": r"bad.jsonl:1: not JSON",
        json.dumps({"messages": [{"role": "user", "content": "x"}]}): r"bad.jsonl:1: .*no assistant turn",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}): r"bad.jsonl:1: messages\[0\]\.role",
        json.dumps({"prompt": "x"}): r"bad.jsonl:1: expected 'messages' or 'instruction' \+ 'output'",
        json.dumps({"instruction": "x", "output": 3}): r"bad.jsonl:1: output must be text",
    }
    for line, error in cases.items():
        (tmp_path / "bad.jsonl").write_text(line + "\n")
        with pytest.raises(ValueError, match=error):
            read_conversations(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no conversations"):
        read_conversations(tmp_path / "empty.jsonl")


def test_padding_leaves_each_examples_loss_unchanged(tokenizer):
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny", vocab_size=tokenizer.vocab_size, n_layers=1)).eval()
    examples = [encode_conversation(tokenizer, CHATML, [{"role": "user", "content": "add " * n},
                                                        {"role": "assistant", "content": "46 " * (3 - n)}])
                for n in (1, 2)]
    ids, labels = padded_batch(examples, context_length=64)
    with torch.no_grad():
        batch_losses = F.cross_entropy(model(ids).transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        for row, example in enumerate(examples):
            alone = F.cross_entropy(model(torch.tensor([example.ids])).transpose(1, 2),
                                    torch.tensor([example.labels]), ignore_index=IGNORE_INDEX, reduction="none")
            torch.testing.assert_close(batch_losses[row, :len(example.ids)], alone[0], rtol=1e-5, atol=1e-6)
    assert (labels[0, len(examples[0].ids):] == IGNORE_INDEX).all()


def test_splits_and_endless_batches_are_seeded(tokenizer):
    examples = [encode_conversation(tokenizer, CHATML, [{"role": "user", "content": "add"},
                                                        {"role": "assistant", "content": str(i)}]) for i in range(10)]
    train, val = split_examples(examples, 0.2, seed=1)
    assert len(train) == 8 and len(val) == 2 and split_examples(examples, 0.2, seed=1) == (train, val)
    first = [b[0] for _, b in zip(range(5), sft_batches(train, 3, 64, torch.Generator().manual_seed(0)))]
    again = [b[0] for _, b in zip(range(5), sft_batches(train, 3, 64, torch.Generator().manual_seed(0)))]
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and all(b.shape[0] == 3 for b in first)
    with pytest.raises(ValueError, match="leave none to train on"):
        split_examples(examples[:1], 0.5)
