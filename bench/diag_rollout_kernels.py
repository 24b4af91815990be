"""Per-kernel GPU time of one decode step of the rollout engine (GPU only): builds the engine
on random weights as ``quarl bench rollout`` does, generates a few tokens, then replays the
largest captured decode graph under torch.profiler and prints the kernels by total time.

    PYTHONPATH=. python3 bench/diag_rollout_kernels.py --shape qwen2.5-7b --format w4a16 --batch 64
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from quarl.quant.bench import median_cuda_time
from quarl.bench.rollout import random_model, shape_config
from quarl.rollout.config import EngineConfig
from quarl.rollout.engine import Engine
from quarl.rollout.sampling_params import SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--format", default="w4a16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    cfg = shape_config(args.shape, args.prompt_len + 64)
    model = random_model(cfg, torch.device("cuda"))
    engine = Engine(model, scheme=None if args.format == "bf16" else args.format,
                    config=EngineConfig(max_num_seqs=args.batch, max_model_len=args.prompt_len + 64))
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    graph = engine.runner.graphs[max(engine.runner.graphs)][0]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = 1e3 * median_cuda_time(graph.replay, 50)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name[:90]
            t, n = rows.get(name, (0.0, 0))
            rows[name] = (t + e.device_time, n + 1)
    total = sum(t for t, _ in rows.values()) / args.reps
    print(f"{args.format} B={args.batch}: graph replay {replay_ms:.3f} ms (median of 50), {total / 1e3:.3f} ms of kernels "
          f"per step (decode attention tiling {list(engine.runner.decode_tiling)})")
    for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {t / args.reps / 1e3:7.3f} ms  {n // args.reps:4d}x  {name}")


if __name__ == "__main__":
    main()
