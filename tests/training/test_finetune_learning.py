"""Fine-tuning learns: a tiny base that knows the chat format (trained here to answer "copy abcd"
with "abcd") is fine-tuned to answer "reverse abcd" with "dcba", and reaches >= 90% exact match on
held-out strings, from a base that gets none right, with LoRA, with QLoRA (int4 base) and in full.
Strings are 4-5 distinct letters, so copying is never a right answer to "reverse"."""

from __future__ import annotations

import random

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.data.sft import encode_conversation
from glasslm.generation import generate_tokens
from glasslm.io.checkpoint import save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer
from glasslm.training.batches import SFTBatches
from glasslm.training.config import TrainConfig
from glasslm.training.finetune import FinetuneConfig, prepare_model
from glasslm.training.loop import train

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
LETTERS = "abcdefgh"
TOKENIZER = CharTokenizer.from_text(LETTERS + "ua:; copyrevs")
ALL_SITES = "q,k,v,attn_out,mlp_up,mlp_gate,mlp_down,unembed"


def _answer(task: str, s: str) -> str:
    return s if task == "copy" else s[::-1]


def _strings(n: int, rng: random.Random) -> list[str]:
    return ["".join(rng.sample(LETTERS, rng.randint(4, 5))) for _ in range(n)]


_rng = random.Random(0)
TRAIN = _strings(2000, _rng)
HELD_OUT = [s for s in _strings(80, random.Random(1)) if s not in set(TRAIN)][:50]


def _batches(task: str) -> SFTBatches:
    conversations = [[{"role": "user", "content": f"{task} {s}"}, {"role": "assistant", "content": _answer(task, s)}]
                     for s in TRAIN]
    return SFTBatches([encode_conversation(TOKENIZER, TEMPLATE, m) for m in conversations], context_length=32)


def exact_match(model: TransformerLM, task: str) -> float:
    """Share of held-out prompts whose greedy answer is exactly right ("a:dcba;")."""
    model.eval()
    hits = 0
    for s in HELD_OUT:
        want = f"a:{_answer(task, s)};"
        ids = generate_tokens(model, TOKENIZER.encode(f"u:{task} {s};"), max_new_tokens=len(want), temperature=0.0)
        hits += TOKENIZER.decode(list(ids)) == want
    return hits / len(HELD_OUT)


def _cfg(steps: int, lr: float) -> TrainConfig:
    return TrainConfig(max_steps=steps, batch_size=32, lr=lr, min_lr=lr / 10, warmup_steps=10, weight_decay=0.0,
                       eval_interval=0, progress=False, device="cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base(tmp_path_factory, one_thread):
    """A tiny Llama trained (600 steps) to copy: it knows the format, not the task."""
    config = get_preset("llama-tiny", vocab_size=TOKENIZER.vocab_size, n_layers=2, d_model=64, n_heads=4,
                        n_kv_heads=4, d_mlp=128, context_length=32)
    torch.manual_seed(0)
    result = train(TransformerLM(config), _cfg(600, 3e-3), _batches("copy"))
    path = tmp_path_factory.mktemp("finetune") / "base"
    save_checkpoint(path, result.model, TOKENIZER)
    assert exact_match(result.model, "copy") >= 0.8  # it has learned the format
    assert exact_match(result.model, "reverse") <= 0.05  # the base cannot reverse
    return str(path)


# QLoRA at 5e-3: at 1e-2 its run was a coin toss decided by float32 rounding (on an AMD EPYC without
# AVX-512, seeds 0-3 reached 0.28, 0.72, 0.54 and 1.0 exact match, loss stuck near 0.2 in the misses);
# at 5e-3 seeds 0-2 reached 1.0 there, and the readable int4 path 0.92 at 1e-2.
@pytest.mark.parametrize("method,lr", [
    pytest.param(FinetuneConfig(lora_rank=16, lora_alpha=16.0, lora_sites=ALL_SITES, lora_dropout=0.0), 1e-2,
                 id="lora"),
    pytest.param(FinetuneConfig(lora_rank=16, lora_alpha=16.0, lora_sites=ALL_SITES, lora_dropout=0.0,
                                quantize="int4"), 5e-3, id="qlora-int4"),
    pytest.param(FinetuneConfig(full=True), 2e-3, id="full"),
])
def test_finetuning_learns_to_reverse(base, method, lr):
    model, _, _ = prepare_model(base, method, seed=0)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    adapters = [name for name in trainable if ".lora_a." in name or ".lora_b." in name]
    assert (adapters == trainable) != method.full  # adapters only, or every weight
    result = train(model, _cfg(600, lr), _batches("reverse"))
    assert exact_match(result.model, "reverse") >= 0.9
