"""The main job's gen stage against plain decoding inside the RL loop itself: every step's rollouts generated twice,
by the speculative engine the loop uses and by a plain engine on the same refitted weights, in one process.

`benchmarks/main_job.py` pairs whole runs in separate processes (the issue's measure), where the host's speed between
processes moves the ratio by up to ~20 %; the in-process benchmarks (`octave_parts`, `adaptive_ab`) time rollouts of
one checkpoint, with no training between them. This one keeps the loop as it is (refit, training, the drafter's
online update, the controller's state carried from step to step) and adds one plain `generate` of the same prompts
and sampling seed each step, the order changing between steps; the loop trains on the speculative rollouts, so
the run is the main job's. Whichever engine runs first after the train stage may pay for what training left
behind, so the engines take every order in turn, and plain over spec is reported for spec before plain and after,
and as their geometric mean. The plain engine's completions are dropped; its rollouts sample the same distribution,
not the same tokens.

`--fixed-k K` adds a third engine drafting K tokens on every step with the loop's drafter (the same module, so
trained online alike) and no controller: what the adaptive controller leaves on the table, or saves, in the loop.

    python benchmarks/loop_pairs.py run.steps=50 [--fixed-k 3] --out research/records/loop_pairs.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import Counter
from pathlib import Path



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON to write")
    p.add_argument("--fixed-k", type=int, default=0, help="also time an engine drafting this many tokens every step")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the main job's config")
    args = p.parse_args(argv)
    from megatron_spec.bench.common import machine, record_choices
    from megatron_spec.engine import LLMEngine
    from megatron_spec.rl import loop
    from megatron_spec.rl.overrides import apply_overrides
    from megatron_spec.speculative.adaptive import octave
    from megatron_spec.drafters.config import SpecConfig
    from recipes.tiny_grpo_spec import tiny_grpo_spec

    defaults = ["run.out_dir=runs/loop_pairs", "run.resume=false", "run.report=false", "run.eval_every=0"]
    cfg = apply_overrides(tiny_grpo_spec(), defaults + args.overrides)
    if args.fixed_k and cfg.spec is None:
        p.error("--fixed-k needs the job to speculate (spec is null)")
    engines = ("spec", "plain") + (("fixed",) if args.fixed_k else ())
    orders = list(itertools.permutations(engines))  # every order in turn: no engine always runs after training
    rows = []

    class PairedTrainer(loop.Trainer):
        def rollouts(self, step, prompts):
            generator = self.generator
            if not hasattr(self, "others"):
                size = generator.engine.max_num_seqs
                self.others = {"plain": LLMEngine(generator.model, max_num_seqs=size)}
                if args.fixed_k:
                    spec = SpecConfig(cfg.spec.method, args.fixed_k, adaptive=False)
                    self.others["fixed"] = LLMEngine(generator.model, size, spec=spec, drafter=generator.drafter)
            controller, chosen = generator.engine.controller, []
            if controller:  # its choices, this step
                record_choices(controller, chosen)
            params, seconds = self.sampling_params(step), {}
            order = orders[step % len(orders)]
            for name in order:
                start = time.perf_counter()
                if name == "spec":
                    outs = generator.generate(prompts, params)
                else:
                    self.others[name].generate(prompts, params)
                    self.others[name].cache = None  # freed between rollouts, as the generator's sleep frees its own
                seconds[name] = time.perf_counter() - start
            generator.sleep()
            if controller:
                del controller.choose_k
            rows.append({"step": step, "spec_first": order.index("spec") < order.index("plain"), "order": order,
                         **seconds,
                         "choices": {f"octave {o} k {k}": n
                                     for (o, k), n in sorted(Counter((octave(b), k) for b, k in chosen).items())}})
            print(f"step {step}: " + " ".join(f"plain / {n} {seconds['plain'] / seconds[n]:.3f}"
                                              for n in engines if n != "plain"), flush=True)
            return loop.Rollouts(outs)

    loop.run(cfg, PairedTrainer)

    def ratio(sel, name="spec"):
        return sum(r["plain"] for r in sel) / sum(r[name] for r in sel)

    first = {"spec": ratio([r for r in rows if r["spec_first"]]), "plain": ratio([r for r in rows if not r["spec_first"]])}
    result = {"benchmark": "loop_pairs", "machine": machine(), "overrides": defaults + args.overrides,
              "steps": len(rows), "plain_over_spec_pooled": ratio(rows),
              "plain_over_spec_spec_first": first["spec"], "plain_over_spec_plain_first": first["plain"],
              "plain_over_spec_order_neutral": (first["spec"] * first["plain"]) ** 0.5,
              "fixed_k": args.fixed_k or None, "plain_over_fixed_pooled": ratio(rows, "fixed") if args.fixed_k else None,
              "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
