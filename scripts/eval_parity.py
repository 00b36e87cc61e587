"""lm-evaluation-harness through the gateway against lm-eval's ``hf`` model in one process.

Usage: python scripts/eval_parity.py [--model tiny-hybrid|tiny-dense|smollm2-135m] [--threshold TOKENS]
       python scripts/eval_parity.py --url URL --checkpoint DIR   # a system already serving DIR

1. Exports the embedded model as a Hugging Face checkpoint (``common/lab/export.py``), or takes the
   converted checkpoint of the real model ``smollm2-135m`` (``common/model/named.py``), and starts the
   whole system serving it, with the router's threshold low enough
   (``--threshold``; 40 tokens for the embedded models' byte-level tokens, 12 for smollm2-135m, whose
   tokenizer makes the task prompts 10-14 tokens long) that the longer prompts are prefilled on the PrfaaS worker and their
   KVCache (and prompt logprobs) cross the link, the shorter ones on PD-P.
2. Runs the custom tasks ``common/lab/data/eval/prfaas_parity_{mc,gen}.yaml`` over the JSONL beside
   them (loglikelihood items: multiple choice, ``acc`` / ``acc_norm``; ``generate_until`` items:
   greedy, ``exact_match``) through lm-eval's ``local-completions`` model against the gateway
   (``echo`` with prompt logprobs, one request at a time), then through lm-eval's ``hf`` model on
   the exported checkpoint in this process, and compares every metric, every loglikelihood and
   every generation.
3. Asks the gateway for ``echo`` + ``logprobs: 5`` completions (greedy, 8 tokens) and compares every
   prompt and completion token's logprob and top-5 alternatives with a one-process forward of the
   same checkpoint over prompt + completion.

No hub and no network: the data set is local (``datasets``' json builder), both sides read the
exported tokenizer, and ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` are set.

The last line is ``lm_eval_tasks=<n> metrics_equal=<true|false> max_loglik_diff=<x>
logprob_max_diff=<y>``: ``metrics_equal`` is true when every metric of every task is the same float
on both sides and every generated text is the same string; ``max_loglik_diff`` is the largest
|gateway - hf| over every loglikelihood lm-eval computed, ``logprob_max_diff`` the largest
difference of step 3 (both in nats). On this machine it takes about 2 minutes, most of it the
system's start-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import time
import urllib.request
from pathlib import Path

from common.lab.cluster import Cluster
from common.lab.export import export_checkpoint
from common.lab.procs import ROOT
from common.model.named import NAMED_MODELS, ensure_checkpoint

TASK_DIR = ROOT / "common" / "lab" / "data" / "eval"
TASKS = ["prfaas_parity_mc", "prfaas_parity_gen"]
LOGPROB_PROMPTS = ["The KVCache of a long prompt", "Prefill-as-a-Service moves prefill", "a b c d e f g h i j k l m n o p"]


def run_lm_eval(model: str, model_args: str) -> dict:
    """lm-eval's ``simple_evaluate`` of :data:`TASKS` with per-sample logs."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=1, device="cpu", log_samples=True,
                           task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False), random_seed=0, numpy_random_seed=0,
                           torch_random_seed=0, fewshot_random_seed=0)


def metrics(res: dict) -> dict[tuple[str, str], float]:
    """Every numeric metric of every task: ``{(task, metric): value}``."""
    out = {}
    for task in TASKS:
        for k, v in res["results"][task].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[(task, k)] = float(v)
    return out


def per_sample(res: dict) -> dict[tuple[str, int], list]:
    """Each sample's responses: loglikelihoods (one per choice) or generated texts."""
    out = {}
    for task in TASKS:
        for s in res["samples"][task]:
            out[(task, s["doc_id"])] = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in s["resps"]]
    return out


def compare_evals(api: dict, hf: dict) -> tuple[bool, float, int]:
    """``(metrics equal, largest loglikelihood difference, generations that differ)``; prints a table."""
    ma, mh = metrics(api), metrics(hf)
    print(f"{'task':<20} {'metric':<22} {'gateway':>12} {'hf':>12}")
    for key in sorted(set(ma) | set(mh)):
        print(f"{key[0]:<20} {key[1]:<22} {ma.get(key, float('nan')):>12.6f} {mh.get(key, float('nan')):>12.6f}")
    equal = ma.keys() == mh.keys() and all(ma[k] == mh[k] or (math.isnan(ma[k]) and math.isnan(mh[k])) for k in ma)
    sa, sh = per_sample(api), per_sample(hf)
    diff, gen_diff = 0.0, 0
    for key, resp in sh.items():
        other = sa.get(key)
        for a, b in zip(other or [], resp):
            if isinstance(b, float):
                diff = max(diff, abs(float(a) - b))
            elif a != b:
                gen_diff += 1
                print(f"generation differs ({key}): gateway {a!r} hf {b!r}")
        if other is None or len(other) != len(resp):
            equal = False
    return equal, diff, gen_diff


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def logprob_diff(url: str, served: str, ckpt: Path, tokenizer) -> float:
    """Largest |gateway - one-process forward| over the logprobs and top-5 of :data:`LOGPROB_PROMPTS`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    worst = 0.0
    for prompt in LOGPROB_PROMPTS:
        ids = tokenizer.encode(prompt)
        body = post(f"{url}/v1/completions", {"model": served, "prompt": ids, "max_tokens": 8, "temperature": 0,
                                              "logprobs": 5, "echo": True, "ignore_eos": True, "return_token_ids": True,
                                              "return_tokens_as_token_ids": True})
        choice = body["choices"][0]
        seq = ids + choice["token_ids"]
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
        lp = choice["logprobs"]
        if len(lp["token_logprobs"]) != len(seq) or lp["token_logprobs"][0] is not None:
            raise RuntimeError(f"echo logprobs cover {len(lp['token_logprobs'])} tokens of {len(seq)}")
        for j in range(1, len(seq)):
            worst = max(worst, abs(lp["token_logprobs"][j] - float(ref[j - 1, seq[j]])))
            for name, value in lp["top_logprobs"][j].items():  # "token_id:<id>": the top 5 and the chosen one
                worst = max(worst, abs(value - float(ref[j - 1, int(name.removeprefix("token_id:"))])))
            want = set(torch.topk(ref[j - 1], 5).indices.tolist())
            if not want <= {int(name.removeprefix("token_id:")) for name in lp["top_logprobs"][j]}:
                worst = math.inf  # another top 5 than the forward's

    return worst


def served_model(url: str) -> str:
    """The id of the model the gateway at ``url`` serves (the first of ``/v1/models``)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def through_gateway(url: str, ckpt: Path) -> tuple[dict, float]:
    """lm-eval's ``local-completions`` against the gateway at ``url`` serving ``ckpt``, then the logprob
    check (:func:`logprob_diff`); prints the route counts. Returns ``(results, logprob_max_diff)``."""
    from transformers import AutoTokenizer

    served = served_model(url)
    t1 = time.monotonic()
    api = run_lm_eval("local-completions", f"base_url={url}/v1/completions,model={served},tokenizer={ckpt},"
                      "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
    print(f"lm-eval through the gateway: {time.monotonic() - t1:.1f}s")
    lp_diff = logprob_diff(url, served, ckpt, AutoTokenizer.from_pretrained(ckpt))
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        print("\n".join(line for line in r.read().decode().splitlines() if line.startswith("prfaas_route_decisions_total")))
    return api, lp_diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-hybrid", choices=["tiny-hybrid", "tiny-dense", "smollm2-135m"])
    p.add_argument("--threshold", type=int, help="router threshold t (tokens): longer prompts go to PrfaaS "
                   "(default: 12 for smollm2-135m, 40 for the embedded models)")
    p.add_argument("--url", help="the gateway of a running system (default: start one)")
    p.add_argument("--checkpoint", help="with --url: the checkpoint directory it serves (the served id comes from /v1/models)")
    args = p.parse_args()
    if bool(args.url) != bool(args.checkpoint):
        p.error("--url and --checkpoint go together")
    if args.threshold is None:
        args.threshold = 12 if args.model in NAMED_MODELS else 40
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    os.chdir(ROOT)  # the task YAMLs name the JSONL relative to the repository root
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="prfaas-eval-") as tmp:
        if args.url:
            ckpt = Path(args.checkpoint)
            api, lp_diff = through_gateway(args.url, ckpt)
        else:
            if args.model in NAMED_MODELS:  # a real model: its converted checkpoint, served by name
                ckpt, served = Path(ensure_checkpoint(args.model)), args.model
            else:
                ckpt = export_checkpoint(args.model, Path(tmp) / f"prfaas-{args.model}")
                served = str(ckpt)
            t0 = time.monotonic()
            cluster = Cluster(model=served, threshold=args.threshold).start(timeout=400)  # a cold cache converts first
            try:
                print(f"system up in {time.monotonic() - t0:.1f}s serving {ckpt.name} (threshold {args.threshold} tokens)")
                api, lp_diff = through_gateway(cluster.url, ckpt)
            finally:
                cluster.stop()
        t2 = time.monotonic()
        hf = run_lm_eval("hf", f"pretrained={ckpt},dtype=float32")
        print(f"lm-eval hf in one process: {time.monotonic() - t2:.1f}s")
    equal, ll_diff, gen_diff = compare_evals(api, hf)
    print(f"generations that differ: {gen_diff}")
    print(f"lm_eval_tasks={len(TASKS)} metrics_equal={'true' if equal and not gen_diff else 'false'} "
          f"max_loglik_diff={ll_diff:.3g} logprob_max_diff={lp_diff:.3g}")


if __name__ == "__main__":
    main()
