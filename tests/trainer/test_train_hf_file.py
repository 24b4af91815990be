"""A user's setup: a local HF checkpoint + HF tokenizer with a chat template + a JSONL file."""

from __future__ import annotations

import json

import torch

from quarl.config import load_run_config
from quarl.trainer import checkpoint as ckpt
from quarl.trainer.loop import Trainer
from tests.hf_models import make_hf_checkpoint

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(10) for b in range(10)]
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def test_train_on_hf_checkpoint_and_jsonl(tmp_path):
    model_dir = tmp_path / "model"
    tok = _tokenizer(model_dir)
    make_hf_checkpoint("qwen2", model_dir, vocab_size=len(tok) + 6)
    data = tmp_path / "train.jsonl"
    rows = [{"question": [{"role": "user", "content": f"What is {a} plus {b}?"}], "gold": str(a + b)}
            for a in range(6) for b in range(6)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_run_config(None, [
        f"--model.path={model_dir}", "--data.task=file", f"--data.path={data}", "--data.prompt_key=question",
        "--data.answer_key=gold", "--data.num_eval=4", "--data.reward=tests.trainer.reward_fns:digit_one",
        "--data.reward_workers=0", "--trainer.sft_warmup_steps=0", "--trainer.steps=2",
        "--trainer.prompts_per_step=4", "--rollout.n=4", "--rollout.max_new_tokens=8", "--trainer.eval_every=2",
        f"--trainer.run_dir={tmp_path / 'run'}", "--trainer.tensorboard=false", "--quant.scheme=w4a16",
        "--optim.lr=1e-3",
    ])
    trainer = Trainer(cfg)
    # the prompt the engine sees is the tokenizer's chat template applied to the messages
    ids = trainer.tokenizer.apply_chat_template(rows[0]["question"])
    assert tok.decode(ids).replace(" ", "").startswith("<|user|>Whatis0plus0?<|end|><|assistant|>")
    trainer.run()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and "eval/acc" in metrics[-1]
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "run"))
    assert state["step"] == 2
    assert any(k.endswith("q_proj.bias") for k in state["learner"]["model"])  # Qwen2's q/k/v bias trained too
    assert torch.isfinite(torch.tensor(metrics[-1]["mismatch/kl_k3"]))
