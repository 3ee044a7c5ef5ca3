"""One vLLM engine with the tiny Qwen2-VL, run by tests/test_vllm_engine.py in the vLLM venv.

    python engine.py --model DIR --role ec_producer|ec_consumer|plain --connector mmfeat|example|trap
                     [--runtime-dir RT] [--store DIR] [--images 0,1] [--report FILE]
                     [--lifetime retained|counted] [--consumers N] [--namespace NS] [--max-tokens N]
                     [--view-min-bytes N] [--load-wait S] [--ec-params JSON] [--tp N]

Prints one JSON line: the generated tokens of each prompt, each request's ec_transfer_params, and the
engine's start time. Each image is a seeded random 56x56 picture (4 image tokens).
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timed_connectors, for vLLM's processes too
os.environ["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__)) + os.pathsep + os.environ.get("PYTHONPATH", "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", required=True, choices=["ec_producer", "ec_consumer", "ec_both", "plain"])
    ap.add_argument("--connector", default="mmfeat", choices=["mmfeat", "example", "trap"],
                    help="trap: mmfeat's with the test's trap after each lookup (trap_connector.py)")
    ap.add_argument("--runtime-dir")
    ap.add_argument("--store")
    ap.add_argument("--ec-params", help="a JSON list, per image, of the ec_transfer_params its request carries")
    ap.add_argument("--load-wait", type=float, help="the connector's load_wait_s")
    ap.add_argument("--images", default="0,1")
    ap.add_argument("--report")
    ap.add_argument("--retain-ttl", type=float, default=300.0)
    ap.add_argument("--lifetime", default="retained", choices=["retained", "counted"])
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--namespace", default="")
    ap.add_argument("--max-tokens", type=int, default=8, help="1: each request ends in the step that loads it")
    ap.add_argument("--view-min-bytes", type=int, help="the connector's view_min_bytes (0: view every item)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (the CPU backend's shm communicator)")
    args = ap.parse_args()

    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    kw = dict(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=256, enforce_eager=True,
              seed=0, tensor_parallel_size=args.tp)
    if args.role != "plain":
        if args.connector in ("mmfeat", "trap"):
            extra = {"runtime_dir": args.runtime_dir, "retain_ttl_s": args.retain_ttl, "lifetime": args.lifetime,
                     "consumers": args.consumers, "namespace": args.namespace}
            if args.report:
                extra["report_file"] = args.report
            if args.view_min_bytes is not None:
                extra["view_min_bytes"] = args.view_min_bytes
            if args.load_wait:
                extra["load_wait_s"] = args.load_wait
            name, module = ("TimedMmfeatECConnector", "timed_connectors") if args.connector == "mmfeat" else \
                ("TrappedMmfeatECConnector", "trap_connector")
        else:
            extra, name, module = {"shared_storage_path": args.store}, "TimedECExampleConnector", "timed_connectors"
        kw["ec_transfer_config"] = {"ec_connector": name, "ec_connector_module_path": module,
                                    "ec_role": args.role, "ec_connector_extra_config": extra}
    t0 = time.time()
    llm = LLM(**kw)
    started = time.time() - t0
    seeds = [int(s) for s in args.images.split(",")]
    images = [Image.fromarray((np.random.RandomState(s).rand(56, 56, 3) * 255).astype("uint8")) for s in seeds]
    prompt = "<|im_start|>user <|vision_start|><|image_pad|><|vision_end|>w1 w2<|im_end|><|im_start|>assistant "
    t1 = time.time()
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    if args.ec_params:
        # As an orchestrator passes on what the producer's request_finished returned (vLLM reads
        # extra_args["ec_transfer_params"] into the request).
        with open(args.ec_params) as f:
            sampling = [SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                       extra_args={"ec_transfer_params": p}) for p in json.load(f)]
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": im}} for im in images], sampling)
    print("ENGINE-RESULT " + json.dumps({
        "start_s": started, "generate_s": time.time() - t1,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "ec_params": [getattr(o, "ec_transfer_params", None) for o in outs],
    }, default=str), flush=True)


if __name__ == "__main__":
    main()
