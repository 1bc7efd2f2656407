"""Preference tuning (DPO, SimPO, ORPO): the loss, rewards and margins against TRL's DPOTrainer (full
and LoRA), CPOTrainer (SimPO) and ORPOTrainer (ORPO) on the same batch and weights; the LoRA reference is the adapter-free
base; a tiny model learns a synthetic preference (held-out accuracy well above chance); bad preference
data is refused with the line and field named; `glasslm finetune --method dpo` runs LoRA, QLoRA and
full, logs the rewards, and resumes exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch

from chat_models import hf_llama, hf_tokenizer
from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.data.preferences import load_preference_pairs, read_preferences
from glasslm.io.checkpoint import WEIGHTS_FILE, read_safetensors, resolve_checkpoint, save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer
from glasslm.training.batches import PreferenceBatches
from glasslm.training.dpo import (
    DPOObjective, ORPOObjective, SimPOObjective, log1mexp, reference_model, sequence_log_probs,
)
from glasslm.training.finetune import FinetuneConfig, chat_batches, prepare_model
from glasslm.transforms.lora import adapters_disabled, lora_layers

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
TOKENIZER = CharTokenizer.from_text("abcdefgh xyz ua:;")


pytestmark = pytest.mark.usefixtures("one_thread")


def _write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ----- against TRL -----

TRL_RECORDS = [
    {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello there"}],
     "rejected": [{"role": "assistant", "content": "no"}]},
    {"prompt": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"},
                {"role": "user", "content": "and?"}],
     "chosen": [{"role": "assistant", "content": "d"}], "rejected": [{"role": "assistant", "content": "e f g"}]},
    {"prompt": [{"role": "user", "content": "count"}], "chosen": [{"role": "assistant", "content": "one two"}],
     "rejected": [{"role": "assistant", "content": "three, four!"}]},
]


def _trl_trainer(policy, reference, tokenizer, beta, tmp_path, peft_config=None):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, beta=beta,
                     per_device_train_batch_size=len(TRL_RECORDS), save_strategy="no", bf16=False)
    return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(TRL_RECORDS),
                      processing_class=tokenizer, peft_config=peft_config)


def _trl_step(trainer):
    """TRL's DPOTrainer on TRL_RECORDS: (its tokenized pairs, its loss, its logged metrics) for one batch."""
    examples = [trainer.train_dataset[i] for i in range(len(TRL_RECORDS))]
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    return examples, loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@torch.no_grad()
def _chosen_log_probs(policy, reference, x, y):
    """Each chosen row's summed answer log-probability under the policy and under the reference."""
    from glasslm.training.dpo import sequence_log_probs

    return sequence_log_probs(policy(x[0::2]), y[0::2]), sequence_log_probs(reference(x[0::2]), y[0::2])


def _our_step(policy, reference, tokenizer, template, tmp_path, beta, objective=None):
    pairs = load_preference_pairs(_write_jsonl(tmp_path / "prefs.jsonl", TRL_RECORDS), tokenizer, template)
    x, y = PreferenceBatches(pairs, 128).eval_batches(len(pairs), 1, torch.Generator()).__next__()[:2]
    loss, stats = (objective or DPOObjective(reference, beta))(policy.train(), x, y)
    return pairs, x, y, loss, stats


def test_the_loss_rewards_and_margins_equal_trls_on_the_same_batch_and_weights(tmp_path):
    from glasslm.hf import load_chat_template, load_model

    tokenizer, beta = hf_tokenizer(), 0.3
    for name, seed in (("policy", 0), ("reference", 1)):
        hf_llama(seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    policy, our_tokenizer = load_model(tmp_path / "policy")
    reference, _ = load_model(tmp_path / "reference")
    template = load_chat_template(tmp_path / "policy", our_tokenizer)
    pairs, x, y, loss, stats = _our_step(policy, reference, our_tokenizer, template, tmp_path, beta)
    examples, trl_loss, trl = _trl_step(_trl_trainer(hf_llama(0), hf_llama(1), tokenizer, beta, tmp_path))

    for pair, example in zip(pairs, examples):  # the same tokens, the same completion positions
        for side, ours in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            assert ours.ids == example["prompt_ids"] + example[f"{side}_ids"]
            labelled = [t + 1 for t, label in enumerate(ours.labels) if label != -100]
            assert labelled == list(range(len(example["prompt_ids"]), len(ours.ids)))
    assert loss.item() == pytest.approx(trl_loss, rel=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected"):
        assert stats[key].item() == pytest.approx(trl[key], rel=1e-4, abs=1e-6), key
    assert abs(trl["rewards/margins"]) > 1e-2  # policy and reference differ: the comparison can fail
    # the chosen answers' change from the reference, per answer token: the rewards over β, over the tokens
    tokens = torch.tensor([len(example["chosen_ids"]) for example in examples], dtype=torch.float32)
    chosen_rewards = torch.stack([beta * (p - r) for p, r in zip(*_chosen_log_probs(policy, reference, x, y))])
    assert chosen_rewards.mean().item() == pytest.approx(trl["rewards/chosen"], rel=1e-4)
    assert stats["logps/chosen_change_per_token"].item() == pytest.approx((chosen_rewards / beta / tokens).mean().item(),
                                                                          rel=1e-4)
    log_probs = sequence_log_probs(policy(x), y)
    assert log_probs[0::2].mean().item() == pytest.approx(trl["logps/chosen"], rel=1e-5)
    assert log_probs[1::2].mean().item() == pytest.approx(trl["logps/rejected"], rel=1e-5)


def test_with_lora_the_loss_equals_trls_whose_reference_is_the_peft_base(tmp_path):
    """TRL given a new adapter (peft_config, ref_model=None) uses the base with the adapter disabled as
    its reference; the same adapter, moved off its init and loaded into glasslm, gives the same loss."""
    import peft

    from glasslm.hf import load_chat_template, load_model

    tokenizer, beta = hf_tokenizer(), 0.3
    hf_llama(0).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    trainer = _trl_trainer(hf_llama(0), None, tokenizer, beta, tmp_path, peft_config=config)
    torch.manual_seed(5)
    with torch.no_grad():  # trained adapters: B away from its zero start
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    trainer.model.save_pretrained(tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config))
    _, trl_loss, trl = _trl_step(trainer)

    policy, our_tokenizer = load_model(tmp_path / "adapter")  # glasslm's LoRA model: base + the same adapters
    template = load_chat_template(tmp_path / "base", our_tokenizer)
    _, _, _, loss, stats = _our_step(policy, reference_model(policy, full=False), our_tokenizer, template, tmp_path,
                                     beta)
    assert loss.item() == pytest.approx(trl_loss, rel=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert stats[key].item() == pytest.approx(trl[key], rel=1e-4, abs=1e-6), key
    assert abs(trl["rewards/margins"]) > 1e-2


def test_the_simpo_loss_equals_trls_cpo_trainers_on_the_same_weights(tmp_path):
    """SimPO is TRL's CPOTrainer with loss_type="simpo" (and cpo_alpha=0): its own log-probability
    averaging (`get_batch_logps`) and loss (`cpo_loss`), run on transformers' logits."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer

    from glasslm.hf import load_chat_template, load_model

    beta, gamma = 2.0, 0.5
    hf_model = hf_llama(0).eval()
    hf_model.save_pretrained(tmp_path / "policy")
    hf_tokenizer().save_pretrained(tmp_path / "policy")
    policy, tokenizer = load_model(tmp_path / "policy")
    template = load_chat_template(tmp_path / "policy", tokenizer)
    _, x, y, loss, stats = _our_step(policy, None, tokenizer, template, tmp_path, beta, SimPOObjective(beta, gamma))

    labels = torch.full_like(x, -100)  # TRL's labels: the token itself at each answer position, unshifted
    labels[:, 1:] = torch.where(y[:, :-1] != -100, x[:, 1:], -100)
    with torch.no_grad():
        mean_log_probs = CPOTrainer.get_batch_logps(hf_model(x).logits, labels, average_log_prob=True)
    trl = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0,
                          accelerator=SimpleNamespace(device="cpu"))
    losses, chosen, rejected = CPOTrainer.cpo_loss(trl, mean_log_probs[0::2], mean_log_probs[1::2])
    assert loss.item() == pytest.approx(losses.mean().item(), rel=1e-5)
    assert stats["rewards/chosen"].item() == pytest.approx(chosen.mean().item(), rel=1e-5)
    assert stats["rewards/rejected"].item() == pytest.approx(rejected.mean().item(), rel=1e-5)
    assert stats["rewards/margins"].item() == pytest.approx((chosen - rejected).mean().item(), rel=1e-4)
    assert abs((chosen - rejected).mean().item()) > 1e-2


def test_the_orpo_loss_equals_trls_orpo_trainers_on_the_same_weights(tmp_path):
    """ORPO's odds-ratio term and rewards are TRL's ORPOTrainer's (`get_batch_logps`, `odds_ratio_loss`)
    on transformers' logits. Its supervised term covers the chosen answer's tokens, as in the paper;
    TRL's ORPOTrainer also counts the prompt's, so that term is checked against PyTorch's cross-entropy
    on the same logits and answer tokens."""
    from types import SimpleNamespace

    from trl.experimental.orpo import ORPOTrainer

    from glasslm.hf import load_chat_template, load_model

    beta = 0.5
    hf_model = hf_llama(0).eval()
    hf_model.save_pretrained(tmp_path / "policy")
    hf_tokenizer().save_pretrained(tmp_path / "policy")
    policy, tokenizer = load_model(tmp_path / "policy")
    template = load_chat_template(tmp_path / "policy", tokenizer)
    _, x, y, loss, stats = _our_step(policy, None, tokenizer, template, tmp_path, beta, ORPOObjective(beta))

    labels = torch.full_like(x, -100)  # TRL's labels: the token itself at each answer position, unshifted
    labels[:, 1:] = torch.where(y[:, :-1] != -100, x[:, 1:], -100)
    with torch.no_grad():
        logits = hf_model(x).logits
        mean_log_probs = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
        nll = torch.nn.functional.cross_entropy(logits[0::2, :-1].reshape(-1, logits.shape[-1]),
                                                labels[0::2, 1:].reshape(-1), ignore_index=-100)
    trl = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device="cpu"))
    ratio_terms, chosen, rejected, log_odds_ratio, _ = ORPOTrainer.odds_ratio_loss(trl, mean_log_probs[0::2],
                                                                                  mean_log_probs[1::2])
    assert loss.item() == pytest.approx((nll - ratio_terms.mean()).item(), rel=1e-5)
    assert stats["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    assert stats["log_odds_ratio"].item() == pytest.approx(log_odds_ratio.item(), rel=1e-5)
    assert stats["rewards/margins"].item() == pytest.approx((chosen - rejected).mean().item(), rel=1e-4)
    assert abs(ratio_terms.mean().item()) > 1e-3 and abs((chosen - rejected).mean().item()) > 1e-2


def test_log1mexp_is_the_closed_form_at_both_ends():
    x = torch.tensor([-1e-8, -1e-3, -0.5, -0.7, -2.0, -40.0], dtype=torch.float64)
    assert torch.allclose(log1mexp(x), torch.log(1 - torch.exp(x)), rtol=1e-6)
    assert log1mexp(torch.tensor([-1e-10])).item() == pytest.approx(math.log(1e-10), rel=1e-6)  # 1 - e^x rounds to 0 in float32
    assert log1mexp(torch.tensor([-100.0])).item() == pytest.approx(-math.exp(-100), rel=1e-6)


# ----- the reference -----

def _tiny(**overrides) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_preset("llama-tiny", vocab_size=TOKENIZER.vocab_size, context_length=48, n_layers=2,
                                    **overrides))


def test_the_lora_reference_is_the_base_with_the_adapters_off(tmp_path):
    base_model = _tiny()
    base = save_checkpoint(tmp_path / "base", base_model, TOKENIZER)
    model, _, _ = prepare_model(str(base), FinetuneConfig(lora_rank=2))
    reference = reference_model(model, full=False)
    ids = torch.tensor([TOKENIZER.encode("u:abc;a:cba;")])
    with torch.no_grad():
        for layer in lora_layers(model).values():  # trained adapters: B away from its zero start
            for b in layer.lora_b:
                b.add_(torch.randn_like(b))
        expected = base_model.eval()(ids)
        assert not torch.allclose(model(ids), expected, atol=1e-3)  # the adapters change the policy...
        assert torch.allclose(reference(ids), expected, atol=1e-5)  # ...and not the reference
    assert not any(layer.disabled for layer in lora_layers(model).values())  # switched back on afterwards
    assert torch.allclose(model(ids), model(ids))


def test_the_full_reference_is_a_frozen_copy_of_the_starting_weights():
    model = _tiny()
    reference = reference_model(model, full=True)
    ids = torch.tensor([TOKENIZER.encode("u:abc;a:cba;")])
    before = reference(ids).detach()
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    assert torch.equal(reference(ids), before)
    assert not any(p.requires_grad for p in reference.parameters())


# ----- learning -----

def _synthetic_preferences(n: int, seed: int) -> list[dict]:
    """The prompt is four letters; the preferred answer is "xy" if its last letter is one of a-d, else "yx"."""
    generator = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(n):
        word = "".join("abcdefgh"[i] for i in torch.randint(8, (4,), generator=generator).tolist())
        answers = ["xy", "yx"] if word[-1] in "abcd" else ["yx", "xy"]
        records.append({"prompt": word, "chosen": answers[0], "rejected": answers[1]})
    return records


def _dpo(folder, out, *extra):
    args = ["finetune", "--checkpoint", str(folder / "base"), "--method", "dpo", "--data", str(folder / "prefs.jsonl"),
            "--chat-template", str(folder / "t.jinja"), "--out", str(folder / out), "--batch-size", "8",
            "--warmup-steps", "0", "--val-fraction", "0.25", "--dpo-beta", "0.5", "--no-progress", "--device", "cpu",
            "--threads", "1", *extra]
    assert main(args) == 0
    return [json.loads(line) for line in (folder / out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def prefs(tmp_path):
    _write_jsonl(tmp_path / "prefs.jsonl", _synthetic_preferences(160, seed=0))
    save_checkpoint(tmp_path / "base", _tiny(), TOKENIZER)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    return tmp_path


def test_a_tiny_model_learns_a_preference_held_out_accuracy_rises_well_above_chance(prefs):
    records = _dpo(prefs, "dpo", "--full", "--lr", "3e-3", "--max-steps", "100", "--eval-interval", "100")
    last = records[-1]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert key in records[0] and f"val_{key}" in last
    assert last["val_rewards/accuracies"] >= 0.8  # chance is 0.5: 40 held-out pairs, never trained on
    assert last["val_rewards/margins"] > 1.0
    assert last["val_loss"] < 0.5  # log 2 = 0.69 at the start, where the policy is the reference


def test_simpo_learns_the_same_preference_without_a_reference(prefs):
    records = _dpo(prefs, "simpo", "--method", "simpo", "--dpo-beta", "2.0", "--full", "--lr", "3e-3",
                   "--max-steps", "100", "--eval-interval", "100")
    assert records[-1]["val_rewards/accuracies"] >= 0.8


def test_orpo_learns_the_same_preference_without_a_reference(prefs):
    records = _dpo(prefs, "orpo", "--method", "orpo", "--dpo-beta", "1.0", "--full", "--lr", "3e-3",
                   "--max-steps", "100", "--eval-interval", "100")
    first, last = records[0], records[-1]
    assert "nll_loss" in first and "log_odds_ratio" in first
    assert last["val_rewards/accuracies"] >= 0.8  # chance is 0.5


@pytest.mark.parametrize("extra", [(), ("--quantize", "int4"), ("--full",)], ids=["lora", "qlora", "full"])
def test_a_dpo_run_raises_the_margin_and_resumes_where_the_uninterrupted_one_ends(prefs, extra):
    """A resumed full run must compare against the base it started from, not the resumed weights."""
    common = ("--lr", "5e-3", "--lr-decay-steps", "8", "--eval-interval", "4", "--log-interval", "4", *extra)
    whole = _dpo(prefs, "whole", *common, "--max-steps", "8")
    _dpo(prefs, "halves", *common, "--max-steps", "4")
    assert main(["finetune", "--resume", str(prefs / "halves"), "--max-steps", "8", "--no-progress"]) == 0
    resumed = [json.loads(line) for line in (prefs / "halves" / "metrics.jsonl").read_text().splitlines()]
    assert resumed[-1]["val_rewards/margins"] == pytest.approx(whole[-1]["val_rewards/margins"], rel=1e-4, abs=1e-6)
    assert resumed[-1]["val_loss"] == pytest.approx(whole[-1]["val_loss"], rel=1e-5)
    assert whole[-1]["rewards/margins"] > 0  # the training pairs' margin, 0 at the start, has grown
    saved = resolve_checkpoint(prefs / "whole", prefer=("latest",))
    assert json.loads((saved / "meta.json").read_text())["finetune"]["method"] == "dpo"
    lora_only = all(".lora_" in name for name in read_safetensors(saved / WEIGHTS_FILE))
    assert lora_only == ("--full" not in extra)  # a LoRA run's checkpoints hold only the adapters


def test_a_time_limited_run_times_whole_pairs(tmp_path):
    """Under a time limit the estimate first times one drawn row alone: for preference batches that is
    one pair, two tensor rows (one row alone would be refused as half a pair)."""
    from glasslm.training.config import TrainConfig
    from glasslm.training.loop import train

    data = _write_jsonl(tmp_path / "prefs.jsonl", _synthetic_preferences(20, seed=0))
    model, tokenizer, _ = prepare_model(str(save_checkpoint(tmp_path / "base", _tiny(), TOKENIZER)), FinetuneConfig())
    batches = chat_batches(data, tokenizer, TEMPLATE, 48, 0.2, 0, preferences=True)
    result = train(model, TrainConfig(max_steps=1, batch_size=4, progress=False, device="cpu"), *batches,
                   refuse_longer_than_s=3600, objective=DPOObjective(reference_model(model, full=False), 0.1))
    assert result.step == 1 and result.val_losses[0][1] == pytest.approx(math.log(2), abs=1e-3)


# ----- bad input -----

@pytest.mark.parametrize("record, message", [
    ({"prompt": "ab", "chosen": "a"}, "line 2.*missing field 'rejected'"),
    ({"chosen": "a", "rejected": "b"}, "line 2.*missing field 'messages'"),
    ({"prompt": "ab", "chosen": 3, "rejected": "b"}, "line 2.*chosen.*list"),
    ({"prompt": [{"role": "user", "content": "ab"}], "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     "line 2.*chosen must start with an assistant message"),
    ({"prompt": [{"role": "robot", "content": "ab"}], "chosen": "a", "rejected": "b"}, "line 2.*prompt.*role"),
    ({"prompt": [], "chosen": "a", "rejected": "b"}, "line 2.*prompt is empty"),
    ("[1, 2]", "line 2.*JSON object"),
    ("{not json", "line 2.*not JSON"),
])
def test_bad_preference_records_are_named_by_line_and_field(tmp_path, record, message):
    path = _write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "ab", "chosen": "a", "rejected": "b"}, record])
    with pytest.raises(ValueError, match=message.replace("line 2", "prefs.jsonl:2")):
        read_preferences(path)


def test_empty_preference_data_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no preference pairs"):
        read_preferences(_write_jsonl(tmp_path / "prefs.jsonl", ["", "  "]))


def test_pairs_whose_completion_falls_outside_the_context_are_refused(tmp_path):
    path = _write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "a" * 60, "chosen": "b", "rejected": "c"}] * 4)
    train, _ = chat_batches(path, TOKENIZER, TEMPLATE, 32, 0.0, 0, preferences=True)
    with pytest.raises(ValueError, match="keep no completion token within context_length=32"):
        train.check("training")


def test_dpo_options_are_checked():
    with pytest.raises(ValueError, match="--dpo-beta must be positive"):
        FinetuneConfig(method="dpo", dpo_beta=0.0).check()
    with pytest.raises(ValueError, match="--lora-full"):
        FinetuneConfig(method="dpo", lora_full="unembed").check()


def test_progress_shows_the_rewards_and_warns_when_the_chosen_answers_collapse(prefs, capsys):
    """Issue 47: progress showed only `loss=0.0000` while the chosen answers' log-probabilities fell and
    the model stopped answering; now it shows the rewards, and says when the chosen answers lose ground."""
    args = ["finetune", "--checkpoint", str(prefs / "base"), "--method", "dpo", "--data", str(prefs / "prefs.jsonl"),
            "--chat-template", str(prefs / "t.jinja"), "--out", str(prefs / "hot"), "--batch-size", "8",
            "--device", "cpu", "--threads", "1", "--full", "--lr", "5e-2", "--max-steps", "12", "--warmup-steps", "0"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in (prefs / "hot" / "metrics.jsonl").read_text().splitlines()]
    changes = [r["logps/chosen_change_per_token"] for r in records if "logps/chosen_change_per_token" in r]
    collapsed = next(r for r in records if r.get("logps/chosen_change_per_token", 0) < -0.1)
    assert changes[0] > -0.1  # it starts at the reference; the warning comes when it falls
    assert err.count("warning: step") == 1 and f"warning: step {collapsed['step']}:" in err
    assert all(f"{name}=" in err for name in ("chosen", "rejected", "margin", "accuracy"))
    assert "val margin" in err and "val accuracy" in err
    done = next(line for line in out.splitlines() if line.startswith("done: "))
    assert "training chosen " in done and "held-out chosen " in done and done.count(" margin ") == 2
    quiet = ["--lr", "1e-4", "--out", str(prefs / "cool")]
    assert main([*args, *quiet]) == 0 and "warning: step" not in capsys.readouterr().err


def test_dpo_on_a_lora_checkpoint_trains_on_its_adapters_merged_and_says_so(prefs, capsys):
    """Issue 47: `finetune --method dpo --checkpoint RUN` on a LoRA run was refused ("already transformed
    ... merge first"); the adapters are now merged into their base beside the run, which trains on it."""
    from glasslm.hf import load_model

    _write_jsonl(prefs / "chat.jsonl", [{"messages": [{"role": "user", "content": r["prompt"]},
                                                      {"role": "assistant", "content": r["chosen"]}]}
                                        for r in _synthetic_preferences(32, seed=1)])
    assert main(["finetune", "--checkpoint", str(prefs / "base"), "--data", str(prefs / "chat.jsonl"), "--chat-template",
                 str(prefs / "t.jinja"), "--out", str(prefs / "sft"), "--max-steps", "6", "--lr", "1e-2",
                 "--no-progress", "--device", "cpu", "--threads", "1"]) == 0
    capsys.readouterr()
    args = ["finetune", "--checkpoint", str(prefs / "sft"), "--method", "dpo", "--data", str(prefs / "prefs.jsonl"),
            "--out", str(prefs / "dpo"), "--max-steps", "4", "--log-interval", "1", "--warmup-steps", "0",
            "--no-progress", "--device", "cpu", "--threads", "1"]  # no --chat-template: the SFT run's own
    assert main(args) == 0
    out = capsys.readouterr().out
    merged = prefs / "dpo-merged-base"
    assert "holds LoRA adapters" in out and str(merged) in out
    sft, _ = load_model(prefs / "sft")
    base, _ = load_model(merged)
    ids = torch.tensor([TOKENIZER.encode("u:abcd;a:xy;")])
    with torch.no_grad():
        assert (sft.eval()(ids) - base.eval()(ids)).abs().max() < 1e-5  # the SFT model, its adapters merged in
    records = [json.loads(line) for line in (prefs / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # step 1 runs at the reference: that model
    dpo, _ = load_model(prefs / "dpo")  # the DPO run's adapters load onto the merged base
    assert dpo.applied_transforms and (dpo.eval()(ids) - base(ids)).abs().max() > 1e-4
    assert main(args) == 1 and "dpo-merged-base" in capsys.readouterr().err  # not replaced without --overwrite
