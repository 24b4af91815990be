"""Run-10 diagnosis: max |engine - learner| log-prob per scheme, fused vs unfused engine
paths (QAT learner = the teacher-forced reference), on the GPU tests' small model."""
import copy
import json
import os
import sys

import torch

sys.path.insert(0, "tests_gpu/rollout")
from test_gpu_rollout import _small_model, DEV  # noqa: E402

from quarl.learner.logprobs import sequence_logprobs
from quarl.quant import quantize_model
from quarl.rollout import Engine, EngineConfig, SamplingParams

res = {}
prompts = [[1, 2, 3, 4], [7] * 30]
params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
for scheme in ["bf16", "w4a16", "w8a8-int8", "w8a8-fp8"]:
    master = _small_model(torch.bfloat16)
    learner = copy.deepcopy(master)
    if scheme != "bf16":
        quantize_model(learner, scheme, mode="qat")
    for fused in (True, False):
        eng = Engine(copy.deepcopy(master), scheme=scheme, config=EngineConfig(max_model_len=256, max_num_seqs=4, num_kv_blocks=100, fused_kernels=fused))
        out = eng.generate(prompts, params)
        diffs = []
        for p, c in zip(prompts, out):
            ids = torch.tensor([p + c.token_ids], device=DEV)
            with torch.no_grad():
                ref, _ = sequence_logprobs(learner, ids)
            d = (torch.tensor(c.logprobs) - ref[0, len(p) - 1 :].float().cpu()).abs()
            diffs.append([float(d.max()), float(d.mean())])
        res[f"{scheme} fused={fused}"] = diffs
        print(scheme, fused, diffs, flush=True)
        del eng
        torch.cuda.empty_cache()
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "diag_w8a8.json"), "w"), indent=1)
