"""`megatron-spec simulate` and `megatron-spec tune`.

    megatron-spec simulate --model qwen3-8b --hardware gb200 --gpus 32 --k 3 --acceptance 2.8
    megatron-spec simulate --validate            # the reference paper's 8B runs, predicted from its AR columns
    megatron-spec simulate --project             # Qwen3-235B-A22B on GB200 / H100, sync and async, +- speculation
    megatron-spec simulate ... --k 5 --acceptance 4 --sensitivity   # speed-up by per-position acceptance and k
    megatron-spec simulate --compare-published   # NeMo-RL's published H100 step times, simulated, with stage parts
    megatron-spec simulate --main-job RECORD.json  # a measured main job (CPU) against the step model
    megatron-spec simulate --refit --model qwen3-235b-a22b   # refit seconds per transport, sources stated
    megatron-spec simulate --refit --model qwen3-235b-a22b --tp 2 --pp 8 --ep 8 --gen-tp 8 --gen-gpus 64 --gpus 128 \
        --stage-layers 12,10                                    # ... and the refit of that layout as implemented
    megatron-spec tune --model qwen3-8b --hardware h100 --gpus 64 --k 3 --acceptance 2.8 --lags 0 1 2 --plot top.png
    megatron-spec tune --model qwen3-235b-a22b --gpus 128 --gpu h100 --fp8 --k 3 --acceptance 2.8 --methods mtp eagle3 \
        --lags 0 2 --ks 0 3 5

Only argparse is imported at parser-build time; the simulator loads when a command runs. The CPU model of our
embedded engine (validation (b)) has its own command: `python -m research.sim_cpu --help`.
"""

from __future__ import annotations

import argparse
import json

from ..drafters.registry import DEFAULT_SIM_DRAFTER, sim_names


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and cluster")
    g.add_argument("--model", default="qwen3-8b", help="preset name or path to an HF config.json")
    g.add_argument("--hardware", "--gpu", dest="hardware", default="h100", help="h100, h200, b200 or gb200")
    g.add_argument("--gpus", type=int, default=8, help="devices in the job")
    g = p.add_argument_group("workload")
    g.add_argument("--prompts", type=int, default=256, help="prompts per step")
    g.add_argument("--group", type=int, default=16, help="responses per prompt")
    g.add_argument("--prompt-len", type=int, default=200)
    g.add_argument("--mean-len", type=float, default=4000, help="mean response length before the cap")
    g.add_argument("--max-tokens", type=int, default=16384, help="response length cap")
    g.add_argument("--sigma", type=float, default=0.8, help="log-normal spread of response lengths")
    g = p.add_argument_group("speculation")
    g.add_argument("--k", type=int, default=0, help="speculative tokens (0: autoregressive)")
    g.add_argument("--acceptance", type=float, default=0.0, help="acceptance length tau at k (in [1, k+1])")
    g.add_argument("--per-position", default="", help="comma-separated per-position acceptance (k values)")
    g.add_argument("--drafter", default=DEFAULT_SIM_DRAFTER, help=", ".join(sim_names()))
    g.add_argument("--draft-model", default="", help="draft model preset for --drafter model")
    g.add_argument("--adaptive", action="store_true", help="let the controller change k as the batch shrinks")
    g.add_argument("--adaptive-threshold", type=int, default=0, help="sequences in flight above which k=0")
    g.add_argument("--online-drafter", action="store_true", help="train the drafter every step")
    g.add_argument("--drafter-passes", type=float, default=1.0,
                   help="online: drafter forward+backward passes over a step's tokens (drafts x replay x updates)")
    g.add_argument("--drafter-optimizer-steps", type=int, default=1,
                   help="online: drafter AdamW steps per RL step (updates x replay x minibatches)")
    g = p.add_argument_group("rollout engines")
    g.add_argument("--fp8", action="store_true", help="FP8 engine weights")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    g.add_argument("--max-num-seqs", type=int, default=1024)
    g = p.add_argument_group("trainer")
    g.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="tokens packed per training micro-batch (0: the whole batch; default 16384)")
    g.add_argument("--fold-logprob", action=argparse.BooleanOptionalAction, default=None,
                   help="behaviour logprobs from the train forward, no recompute pass (default: off)")
    g.add_argument("--reference-logprob", action="store_true",
                   help="a reference-policy log-prob pass each step (KL penalty), its weights swapped from host")
    g.add_argument("--recompute", default="selective", choices=("none", "selective", "full"),
                   help="activation recomputation of the trainer")
    g.add_argument("--train-global-batch", type=int, default=0,
                   help="sequences per optimizer step (0: all rollouts, one update per RL step)")
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="colocated: trainer states and engine weights round-trip host memory each step "
                        "(default: on when colocated)")
    g.add_argument("--moe-dispatcher", default="alltoall", choices=("alltoall", "allgather"),
                   help="the trainer's MoE token dispatcher (allgather moves ep / top_k times the bytes; tune "
                        "picks the one that moves fewer per layout)")
    g.add_argument("--train-fp8", action="store_true", help="FP8 training GEMMs")
    g.add_argument("--decode-eff", type=float, default=None,
                   help="share of the kernel roofline the engine reaches (default: the GPU's calibration)")
    g.add_argument("--in-flight-updates", action="store_true",
                   help="async: engines keep generating through refits, the batch never drains")


def _layout(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism and placement")
    for name in ("tp", "pp", "ep", "cp"):
        g.add_argument(f"--{name}", type=int, default=1, help=f"training {name.upper()}")
    g.add_argument("--dp", type=int, default=0, help="training DP (0: fill the training GPUs)")
    g.add_argument("--gen-tp", type=int, default=1, help="GPUs per generation engine")
    g.add_argument("--gen-ep", type=int, default=1, help="expert-parallel ranks inside an engine")
    g.add_argument("--gen-gpus", type=int, default=0, help="disaggregated: GPUs that generate (0: colocated)")
    g.add_argument("--lag", type=int, default=0, help="policy lag (needs --gen-gpus)")


def register(subparsers) -> None:
    sim = subparsers.add_parser("simulate", help="predict RL step stage times (gen/logprob/train/...)",
                                description=__doc__.splitlines()[0])
    _common(sim)
    _layout(sim)
    mode = sim.add_mutually_exclusive_group()
    mode.add_argument("--validate", action="store_true", help="reference paper case (8B on 32 GB200)")
    mode.add_argument("--project", action="store_true", help="Qwen3-235B-A22B projection and sensitivity")
    mode.add_argument("--sensitivity", action="store_true",
                      help="this speculative configuration's whole-step speed-up over synchronous plain decoding for "
                           "per-position acceptance 0.5-0.9 and k 1-7, with the best k at each acceptance")
    mode.add_argument("--compare-published", action="store_true",
                      help="NeMo-RL's published H100 GRPO step times against the simulator, with stage parts")
    mode.add_argument("--main-job", default="", metavar="RECORD",
                      help="a measured main-job record (JSON with plain and speculative runs per seed) against the "
                           "step model on the CPU host: gen, the drafter's training, gen-stage and whole-step ratios")
    sim.add_argument("--main-job-prompts", type=int, default=0,
                     help="--main-job: prompts per step of the record's runs (0: the record's own, else 8)")
    mode.add_argument("--train-stage", action="store_true",
                      help="the 235B projection's train stage: bubble, schedule calls, interleaving, dispatcher")
    mode.add_argument("--refit", action="store_true",
                      help="the refit of --model per transport: the CPU host's measured gloo figure, GPU spec sheets; "
                           "then the refit of the --tp/--pp/--ep, --gen-tp, --gen-gpus layout as implemented "
                           "(a sender per stage), its assumptions printed")
    sim.add_argument("--stage-layers", default="", metavar="FIRST,LAST",
                     help="--refit: decoder layers of the first and last pipeline stages (default: an even split)")
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.set_defaults(func=simulate_command)

    tune = subparsers.add_parser("tune", help="search parallelism, split, k and controller for throughput")
    _common(tune)
    tune.add_argument("--lags", type=int, nargs="+", default=[0], help="policy lags allowed (0 = sync)")
    tune.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5, 7], help="k values to try")
    tune.add_argument("--methods", nargs="+", default=[], help="drafter kinds to try at the given acceptance "
                      "(eagle3, mtp, model, ngram; default: --drafter only)")
    tune.add_argument("--top", type=int, default=10)
    tune.add_argument("--plot", default="", help="write a PNG of the top configurations here")
    tune.add_argument("--json", action="store_true", help="print the top settings as JSON")
    tune.set_defaults(func=tune_command)


def _spec(args):
    from .config import Speculation

    if args.k <= 0:
        return None
    per_pos = tuple(float(x) for x in args.per_position.split(",") if x.strip())
    return Speculation(k=args.k, acceptance_length=0.0 if per_pos else args.acceptance, per_position=per_pos,
                       drafter=args.drafter, draft_model=args.draft_model, adaptive=args.adaptive,
                       adaptive_threshold=args.adaptive_threshold, online_drafter_training=args.online_drafter,
                       drafter_passes=args.drafter_passes, drafter_optimizer_steps=args.drafter_optimizer_steps)


def _config(args, layout: bool = True):
    from .config import GenParallel, LengthDist, SimConfig, TrainParallel, Workload

    workload = Workload(prompts_per_step=args.prompts, group_size=args.group, prompt_len=args.prompt_len,
                        response=LengthDist(mean=args.mean_len, max_tokens=args.max_tokens, sigma=args.sigma))
    colocated = not getattr(args, "gen_gpus", 0)
    train_gpus = args.gpus - (0 if colocated else args.gen_gpus)
    if layout:
        per = args.tp * args.pp * args.cp
        train = TrainParallel(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, dp=args.dp or max(train_gpus // per, 1))
        gen = GenParallel(tp=args.gen_tp, ep=args.gen_ep)
    else:
        train, gen = TrainParallel(dp=train_gpus), GenParallel()
    return SimConfig(model=args.model, hardware=args.hardware, gpus=args.gpus, workload=workload, train=train,
                     gen=gen, colocated=colocated, gen_gpus=0 if colocated else args.gen_gpus, spec=_spec(args),
                     policy_lag=getattr(args, "lag", 0), gen_dtype_bytes=1 if args.fp8 else 2,
                     gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                     micro_batch_tokens=args.micro_batch_tokens, fold_logprob=args.fold_logprob,
                     reference_logprob=args.reference_logprob, recompute=args.recompute,
                     moe_dispatcher=args.moe_dispatcher,
                     train_global_batch=args.train_global_batch, offload=args.offload, train_fp8=args.train_fp8,
                     decode_eff=args.decode_eff, in_flight_updates=args.in_flight_updates)


def simulate_command(args) -> int:
    if args.validate:
        from .report import validation_report

        print(validation_report())
        return 0
    if args.project:
        from .report import projection_report

        print(projection_report())
        return 0
    if args.sensitivity:
        from .projection import acceptance_sensitivity, format_sensitivity

        sens = acceptance_sensitivity(_config(args))
        if args.json:
            import shlex
            import sys

            rates = sorted({r for r, _ in sens.speedups})
            print(json.dumps({"command": "megatron-spec " + shlex.join(sys.argv[1:]),
                              "machine": "any: the simulator is deterministic arithmetic",
                              "assumed": dict(zip(("per_position", "k", "speedup"), sens.assumed)),
                              "tuner_k": {f"{r:g}": sens.best_k(r) for r in rates},
                              "speedup_range_with_tuner_k": sens.speedup_range(),
                              "speedups": [{"per_position": r, "k": k, "speedup": v, "gen_s": sens.gen_s[(r, k)]}
                                           for (r, k), v in sens.speedups.items()]}, indent=2))
        else:
            print(format_sensitivity(sens))
        return 0
    if args.main_job:
        from pathlib import Path

        from .main_job import compare_pair, format_pairs, pairs, record_drafter, record_prompts

        path = Path(args.main_job)
        if not path.is_file():
            raise ValueError(f"--main-job: no record at {path}")
        record = json.loads(path.read_text())
        if args.json:
            prompts = args.main_job_prompts or record_prompts(record)
            print(json.dumps([{"variant": s["variant"], "seed": s["seed"], "prompts_per_step": prompts,
                               **{r.name: {"measured": r.measured, "simulated": r.simulated, "error": r.error}
                                  for r in compare_pair(p, s, prompts=prompts, **record_drafter(record))}}
                              for p, s in pairs(record)], indent=2))
        else:
            print(format_pairs(record, prompts=args.main_job_prompts))
        return 0
    if args.train_stage:
        from .train_stage import train_stage_report

        print(train_stage_report(args.hardware, 512) + "\n\n" + train_stage_report(args.hardware, 2048))
        return 0
    if args.refit:
        from .stages import refit_table

        print(refit_table(args.model, args.fp8))
        if args.hardware != "cpu":
            from .refit import RefitTopology, refit_report

            first, last = (int(x) for x in args.stage_layers.split(",")) if args.stage_layers else (0, 0)
            gen_gpus = args.gen_gpus or args.gpus
            top = RefitTopology(tp=args.tp, pp=args.pp, ep=args.ep, engines=max(1, gen_gpus // args.gen_tp),
                                gen_tp=args.gen_tp, colocated=not args.gen_gpus, first_stage_layers=first,
                                last_stage_layers=last)
            print("\n" + refit_report(args.model, top, args.hardware, args.fp8))
        return 0
    if args.compare_published:
        from .fit import FIT_ROWS
        from .published import compare, format_table

        tables = {"h100": compare(), "h100-fp8": compare(precision="fp8"), "gb200": compare(hardware="gb200")}
        if args.json:
            print(json.dumps({hw: [{"row": c.name, "release": c.release, "published_s": c.published_s,
                                    "simulated_s": c.result.step_s, "ratio": c.ratio, "stages": c.result.stages}
                                   for c in comps] for hw, comps in tables.items()}, indent=2))
        else:
            print("H100 BF16 (Hopper calibration, fitted on five of these rows)")
            print(format_table(tables["h100"], fitted=FIT_ROWS))
            print("\nH100 FP8 (FP8 engines and training; the FP8 training gain is not fitted)")
            print(format_table(tables["h100-fp8"], footer=False))
            print("\nGB200 BF16 (Blackwell spec-sheet set, not fitted: a check that shows its optimism)")
            print(format_table(tables["gb200"], footer=False))
        return 0
    from .pipeline import simulate
    from .report import step_report

    result = simulate(_config(args), with_plain=True)
    if args.json:
        print(json.dumps({"stages": result.stages, "step_s": result.step_s, "exposed_gen_s": result.exposed_gen_s,
                          "tokens_per_s_per_gpu": result.throughput, "mean_batch": result.gen.mean_batch,
                          "mean_k": result.gen.mean_k, "drafter_train_s": result.drafter_train_s,
                          "refit_s": result.refit_s, "refit_transport": result.refit_transport,
                          "gen_ratio": result.gen_ratio, "whole_step_ratio": result.whole_step_ratio}, indent=2))
    else:
        print(step_report(result))
    return 0


def tune_command(args) -> int:
    from .tune import TuneSpace, format_rejections, format_table, plot, search

    space = TuneSpace(lags=tuple(args.lags), ks=tuple(args.ks), methods=tuple(args.methods))
    result = search(_config(args, layout=False), space)
    if not result.ranked:
        raise ValueError("no configuration fits: " + format_rejections(result.rejected).replace("\n", "; "))
    cands = result.ranked[: args.top]
    if args.json:
        print(json.dumps({"top": [c.settings() for c in cands],
                          "rejected": {result.rejected.example[k]: n for k, n in result.rejected.most_common()},
                          "ranked_below_top": len(result.ranked) - len(cands)}, indent=2))
    else:
        print(format_table(cands))
        print(f"\n{len(result.ranked) - len(cands)} configurations that fit ranked below these; left out:")
        print(format_rejections(result.rejected))
    if args.plot:
        print(f"plot written to {plot(cands, args.plot)}")
    return 0
