"""Refit through the weight-update group against refit through Ray's object store, on the same model and actors.

One trainer actor (the embedded policy) and one engine actor (our engine), disaggregated on a local Ray cluster,
for each transport in fresh actors: one warm-up refit, then `--rounds` timed refits of the same weights (the
driver's view: from the start of the export to the engine's last load). Recorded per transport: bytes per refit,
median seconds, GB/s, and each actor's peak resident memory above its resident memory before the first refit
(`ru_maxrss`, so the worst moment of any refit), plus the driver's. The model is a randomly initialised preset
(default smollm2-135m, fp32), written once to a temporary directory.

    python benchmarks/refit_collective.py --out research/records/refit_collective.json

`--link` measures instead the collective refit against the link's own limit: for each bucket size of
`--buckets-mb`, in fresh actors, one warm-up refit, then `--rounds` pairs taken in turn, a refit (export, pack,
send, receive, load into the engine) and one broadcast of the same number of bytes as a single tensor on the same
weight-update group between buffers made beforehand (what the link carries at best: nothing packed, allocated or
loaded). Both are timed from the driver, from the call to the last side's answer. Recorded per size: the medians,
GB/s of both and their ratio; the best size is the CPU default of `backend.refit_bucket_mb`.

    flock /tmp/ms-timing.lock python benchmarks/refit_collective.py --link --out research/records/refit_link.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path


def rss_mb(_actor=None) -> float:
    """Current resident memory of this process, MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb(_actor=None) -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(cfg, transport: str, rounds: int) -> dict:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from megatron_spec.placement.groups import GeneratorGroup, TrainerGroup
    from megatron_spec.placement.bundles import Placement
    from megatron_spec.placement.transport import TRANSPORTS, resolve

    cfg.backend.refit_transport = transport
    placement = Placement("disaggregated", 1, 1, {"CPU": 1.0})
    pg = placement_group(placement.bundles)
    ray.get(pg.ready())
    trainer, generator = TrainerGroup(cfg, placement, pg), GeneratorGroup(cfg, placement, pg)
    try:
        refit = TRANSPORTS[transport](cfg, trainer, generator)
        actors = {"trainer": trainer.ranks[0], "engine": generator.engines[0]}
        base = {k: ray.get(a.__ray_call__.remote(rss_mb)) for k, a in actors.items()}
        seconds, nbytes = [], 0
        for version in range(rounds + 1):
            t0 = time.perf_counter()
            results = resolve(refit.start(version))
            if version:  # the first is the warm-up
                seconds.append(time.perf_counter() - t0)
            nbytes = results[0][0]
        peaks = {k: ray.get(a.__ray_call__.remote(peak_mb)) for k, a in actors.items()}
        median = statistics.median(seconds)
        return {"transport": transport, "bytes": nbytes, "rounds": rounds, "seconds": seconds,
                "median_s": median, "gb_per_s": nbytes / median / 1e9,
                "peak_rss_above_start_mb": {k: peaks[k] - base[k] for k in actors},
                "rss_before_mb": base, "peak_rss_mb": peaks}
    finally:
        generator.close()
        trainer.close()
        remove_placement_group(pg)


def _link_buffer(actor, nbytes: int) -> None:
    """In an actor: a buffer of `nbytes`, every page touched, for the link broadcasts (made outside their timing, so
    they measure the link, not page faults)."""
    import torch

    actor._link_buffer = torch.zeros(nbytes, dtype=torch.uint8)


def _link_broadcast(actor, sender: bool) -> None:
    """In the trainer (sender) or engine actor: broadcast the buffer as one tensor on the weight-update group."""
    group = actor.weights
    group._broadcast(actor._link_buffer, None if sender else group.pgs[0])


def measure_link(cfg, bucket_mb: int, rounds: int) -> dict:
    """Refits with `bucket_mb` buckets and link broadcasts of the same bytes, in turn, on one pair of actors."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from megatron_spec.placement.groups import GeneratorGroup, TrainerGroup
    from megatron_spec.placement.bundles import Placement
    from megatron_spec.placement.transport import CollectiveRefit, resolve

    cfg.backend.refit_transport, cfg.backend.refit_bucket_mb = "collective", bucket_mb
    placement = Placement("disaggregated", 1, 1, {"CPU": 1.0})
    pg = placement_group(placement.bundles)
    ray.get(pg.ready())
    trainer, generator = TrainerGroup(cfg, placement, pg), GeneratorGroup(cfg, placement, pg)
    try:
        refit = CollectiveRefit(cfg, trainer, generator)
        sender, engine = trainer.ranks[0], generator.engines[0]
        nbytes = resolve(refit.start(0))[0][0]  # the warm-up, which also sends the layout
        ray.get([a.__ray_call__.remote(_link_buffer, nbytes) for a in (sender, engine)])
        refit_s, link_s = [], []
        for version in range(1, rounds + 1):
            t0 = time.perf_counter()
            resolve(refit.start(version))
            refit_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.get([sender.__ray_call__.remote(_link_broadcast, True),
                     engine.__ray_call__.remote(_link_broadcast, False)])
            link_s.append(time.perf_counter() - t0)
        refit_med, link_med = statistics.median(refit_s), statistics.median(link_s)
        return {"bucket_mb": bucket_mb, "bytes": nbytes, "refit_s": refit_s, "link_s": link_s,
                "refit_median_s": refit_med, "link_median_s": link_med, "refit_gb_per_s": nbytes / refit_med / 1e9,
                "link_gb_per_s": nbytes / link_med / 1e9, "refit_over_link_throughput": link_med / refit_med}
    finally:
        generator.close()
        trainer.close()
        remove_placement_group(pg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--link", action="store_true", help="the refit against one broadcast of its bytes (see above)")
    p.add_argument("--buckets-mb", default="16,64,256", help="with --link: the bucket sizes measured, MiB")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import ray
    import torch

    from megatron_spec.models import CausalLM, preset, save_pretrained
    from megatron_spec.rl.config import RLConfig

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = CausalLM(preset(args.preset))
        model.reset_parameters(std=0.02)
        save_pretrained(model, Path(tmp) / "policy")
        del model
        cfg = RLConfig()
        cfg.model.policy, cfg.model.drafter, cfg.spec = str(Path(tmp) / "policy"), None, None
        cfg.run.out_dir, cfg.run.threads = str(Path(tmp) / "run"), 1
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            if args.link:
                return write_link(args, argv, [measure_link(cfg, int(mb), args.rounds)
                                               for mb in args.buckets_mb.split(",")])
            driver_before = rss_mb()
            runs = [measure(cfg, t, args.rounds) for t in ("collective", "object_store")]
        finally:
            ray.shutdown()
    load = os.getloadavg()
    record = {"command": "python benchmarks/refit_collective.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "preset": args.preset, "dtype": "float32", "bucket_bytes": None,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, local Ray cluster of 2 CPUs",
              "load_average_1_5_15": load, "driver_rss_before_mb": driver_before, "driver_peak_rss_mb": peak_mb(),
              "runs": runs,
              "collective_over_object_store_seconds": runs[0]["median_s"] / runs[1]["median_s"]}
    from megatron_spec.rl.loop import REFIT_BUCKET_BYTES

    record["bucket_bytes"] = REFIT_BUCKET_BYTES
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}, indent=1))
    for r in runs:
        print(r["transport"], f"{r['bytes'] / 1e6:.1f} MB", f"{r['median_s']:.3f} s", f"{r['gb_per_s']:.3f} GB/s",
              r["peak_rss_above_start_mb"])
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def write_link(args, argv, rows: list[dict]) -> int:
    best = max(rows, key=lambda r: r["refit_gb_per_s"])
    given = argv if argv is not None else sys.argv[1:]
    record = {"command": "python benchmarks/refit_collective.py " + " ".join(given),
              "preset": args.preset, "dtype": "float32", "transport": "collective (gloo)",
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({_cpu_model()}), local Ray cluster of 2 CPUs",
              "load_average_1_5_15": os.getloadavg(), "rows": rows, "best_bucket_mb": best["bucket_mb"],
              "best_refit_over_link_throughput": best["refit_over_link_throughput"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    for r in rows:
        print(f"bucket {r['bucket_mb']:>4} MiB  {r['bytes'] / 1e6:.1f} MB  refit {r['refit_median_s']:.3f} s "
              f"{r['refit_gb_per_s']:.3f} GB/s  link {r['link_median_s']:.3f} s {r['link_gb_per_s']:.3f} GB/s  "
              f"refit/link {r['refit_over_link_throughput']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
