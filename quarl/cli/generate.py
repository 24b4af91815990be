"""``quarl generate``: sample from a local checkpoint (or the built-in model)."""

from __future__ import annotations

import argparse
import time

from quarl.cli.common import add_common_model_args, load_model_and_tokenizer


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a local HF checkpoint",
        description="Generate completions with the rollout engine (paged KV cache, CUDA graphs on GPU), "
        "in bf16 or a low-bit scheme (--scheme w4a16 runs the kernels a training run's rollouts run).",
    )
    add_common_model_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt in the tokenizer's chat template (default: on when the tokenizer has "
                        "one, as the built-in tokenizer and instruct models do); --no-chat feeds the raw text")
    p.add_argument("--scheme", default="bf16", help="engine weight format: bf16, w4a16, w8a8-fp8, ... "
                   "(quarl.quant schemes)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV-cache storage: auto (the model dtype) or fp8 (e4m3 codes with a float32 scale per "
                        "token and kv head: ~1.9x the tokens per byte)")
    p.add_argument("-n", "--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show-logprobs", action="store_true", help="print the sampled tokens' log-probs")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quarl.quant import get_scheme
    from quarl.rollout import Engine, EngineConfig, SamplingParams

    model, tok, device = load_model_and_tokenizer(args, get_scheme(args.scheme))
    prompts = prompt_ids(tok, args.prompt, chat=tok.has_chat_template if args.chat is None else args.chat)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt encodes to zero tokens; give a non-empty --prompt")
    params = SamplingParams(
        n=args.n, temperature=0.0 if args.greedy else args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_new_tokens=args.max_new_tokens, stop_token_ids=(tok.eos_token_id,), seed=args.seed,
    )
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    config = EngineConfig(max_num_seqs=max(len(prompts) * args.n, 1), max_model_len=longest,
                          kv_cache_dtype=args.kv_cache_dtype)
    if device.type == "cpu":
        config.num_kv_blocks = len(prompts) * args.n * -(-longest // config.block_size)
    engine = Engine(model, scheme=get_scheme(args.scheme), config=config)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_tok = sum(len(c.token_ids) for c in out)
    for c in out:
        print(f"### prompt: {args.prompt[c.prompt_index]}" + (f"  (sample {c.sample_index})" if args.n > 1 else ""))
        print(tok.decode(c.token_ids))
        if args.show_logprobs:
            print("logprobs:", " ".join(f"{x:.3f}" for x in c.logprobs))
        print(f"[{len(c.token_ids)} tokens, finish={c.finish_reason}]")
    kv = "" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype} KV cache"
    print(f"{n_tok} tokens in {dt:.2f}s ({n_tok / max(dt, 1e-9):.1f} tok/s) on {device}, {args.scheme}{kv}")
    return 0


def prompt_ids(tok, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids fed to the model: each prompt as a user turn of the chat template, or the raw text."""
    if chat:
        return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return [tok.encode(p) for p in prompts]
