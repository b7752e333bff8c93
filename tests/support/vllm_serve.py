"""One vLLM instance at tp 2 on CPU, as a script (vLLM's `LLM` must be built under a __main__ guard):
load CKPT with LOAD_FORMAT, collect every worker's state (vllm_probe.StateProbe), optionally generate
greedy tokens, and write it all as JSON.

    python tests/support/vllm_serve.py CKPT LOAD_FORMAT OUT.json [--ep] [--tokens] [--mtp] [--extra JSON]

--mtp serves the checkpoint's multi-token-prediction layer as the speculative-decoding draft (vLLM's DeepSeekMTP).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Its own folder on sys.path: run as a script under PYTHONSAFEPATH=1 (scripts/vllm_stage.sh), Python adds none.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_probe  # noqa: E402, F401  (installs the load hook in this process, which forked workers inherit)

PROMPT = [1, 17, 42, 99, 7, 3, 150, 64]
STEPS = 16


def serve_once(ckpt: str, load_format: str, ep: bool, tokens: bool, extra: dict, pp: int = 1, mtp: bool = False) -> dict:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(ckpt, tensor_parallel_size=2 // pp, pipeline_parallel_size=pp, dtype="bfloat16", enforce_eager=True, max_model_len=128,
              distributed_executor_backend="mp", skip_tokenizer_init=True, enable_expert_parallel=ep,
              load_format=load_format, model_loader_extra_config=extra,
              worker_extension_cls="vllm_probe.StateProbe",
              speculative_config={"method": "mtp", "num_speculative_tokens": 1} if mtp else None)
    result = {"startup_s": time.perf_counter() - start, "ranks": llm.collective_rpc("distload_probe_state")}
    if tokens:
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        result["tokens"] = list(outputs[0].outputs[0].token_ids)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("load_format")
    parser.add_argument("out")
    parser.add_argument("--ep", action="store_true")
    parser.add_argument("--tokens", action="store_true")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (of the 2 ranks)")
    parser.add_argument("--mtp", action="store_true", help="serve the MTP layer as the speculative draft")
    parser.add_argument("--extra", default="{}")
    args = parser.parse_args()
    result = serve_once(args.ckpt, args.load_format, args.ep, args.tokens, json.loads(args.extra), args.pp, args.mtp)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
