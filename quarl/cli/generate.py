"""``quarl generate``: sample from a local checkpoint (or the built-in model)."""

from __future__ import annotations

import argparse
import time

from quarl.cli.common import add_common_model_args, load_model_and_tokenizer


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a local HF checkpoint",
        description="Generate completions with the KV-cached reference decoder.",
    )
    add_common_model_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt in the tokenizer's chat template (default: on when the tokenizer has "
                        "one, as the built-in tokenizer and instruct models do); --no-chat feeds the raw text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show-logprobs", action="store_true", help="print the sampled tokens' log-probs")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quarl.model.generate import generate_simple

    model, tok, device = load_model_and_tokenizer(args)
    prompts = prompt_ids(tok, args.prompt, chat=tok.has_chat_template if args.chat is None else args.chat)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt encodes to zero tokens; give a non-empty --prompt")
    temperature = 0.0 if args.greedy else args.temperature
    t0 = time.perf_counter()
    out = generate_simple(
        model, prompts, args.max_new_tokens, temperature=temperature, top_p=args.top_p, top_k=args.top_k,
        stop_token_ids=[tok.eos_token_id], seed=args.seed,
    )
    dt = time.perf_counter() - t0
    n_tok = sum(len(t) for t in out.token_ids)
    for text, ids, lps, reason in zip(args.prompt, out.token_ids, out.logprobs, out.finish_reasons):
        print(f"### prompt: {text}")
        print(tok.decode(ids))
        if args.show_logprobs:
            print("logprobs:", " ".join(f"{x:.3f}" for x in lps))
        print(f"[{len(ids)} tokens, finish={reason}]")
    print(f"{n_tok} tokens in {dt:.2f}s ({n_tok / max(dt, 1e-9):.1f} tok/s) on {device}")
    return 0



def prompt_ids(tok, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids fed to the model: each prompt as a user turn of the chat template, or the raw text."""
    if chat:
        return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return [tok.encode(p) for p in prompts]
