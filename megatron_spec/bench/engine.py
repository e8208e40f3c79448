"""`megatron-spec bench engine`: our plain engine vs HF transformers' `generate`, side by side in one process.

Same model weights, same prompts (equal length, so HF needs no padding), same sampling settings (`--temperature`,
1 by default, 0 for greedy; no top-k/top-p; EOS ignored so both make exactly `new_tokens` tokens), batch 1, 8 and
32, in `--dtype`. Each repeat runs ours and the peer back to back (which goes first alternates): `speedup` is the
median over repeats of the pair's ratio, with its range (a ratio of two runs seconds apart cancels most of a shared
machine's changing load, which moved the peer's own figures by up to 17 % between runs here); tokens/s and ms per
step are best-of, for scale.

`--peer vllm` measures vLLM (plain decoding, the model exported to a temporary HF directory, one engine for all
batches; eager unless `--vllm-compiled`) in place of HF `generate`; `--peer no-kernels` measures our own engine with
its fused CPU kernels off (torch's ops: `megatron_spec.kernels.disabled`), the same engine object, so the ratio is
what the kernels gain. The columns keep their names (`hf_*` then means the peer).
"""

from __future__ import annotations

import argparse
import os


def hf_twin(model):
    """An HF transformers model holding exactly our model's weights."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from ..models import save_pretrained

    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        return AutoModelForCausalLM.from_pretrained(d, dtype=model.dtype).eval()


def bench_prompts(vocab: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()


def vllm_twin(model, max_len: int, compiled: bool = False):
    """A vLLM engine on exactly our model's weights (imported by name: the core never imports vLLM itself)."""
    import importlib
    import tempfile
    from pathlib import Path

    export = importlib.import_module("megatron_spec.generators.vllm.export")
    backend = importlib.import_module("megatron_spec.generators.vllm")
    path = export.export_target(model, Path(tempfile.mkdtemp(prefix="bench-engine-vllm-")) / "model")
    return backend.VLLMGenerator(str(path), max_model_len=max_len, enforce_eager=not compiled)


def run(model_name: str, batches: list[int], new_tokens: int, prompt_len: int, repeats: int,
        peer: str = "hf", dtype: str = "float32", temperatures: tuple[float, ...] = (1.0,),
        vllm_compiled: bool = False) -> dict:
    from statistics import median

    import torch

    from .. import kernels
    from ..engine import LLMEngine, SamplingParams
    from ..models import from_pretrained
    from .common import machine, timed

    model = from_pretrained(model_name, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    if peer == "vllm":
        peer_engine = vllm_twin(model, min(model.config.max_position_embeddings, prompt_len + new_tokens + 16),
                                vllm_compiled)
    elif peer == "hf":
        hf = hf_twin(model)
    engine = LLMEngine(model, max_num_seqs=max(batches))
    rows = []
    for batch, temperature in ((b, t) for b in batches for t in temperatures):
        params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=0)
        prompts = bench_prompts(model.config.vocab_size, batch, prompt_len, seed=batch)
        ids = torch.tensor(prompts)

        def ours():
            return engine.generate(prompts, params)

        def theirs():
            if peer == "vllm":
                return peer_engine.generate(prompts, params)
            if peer == "no-kernels":
                with kernels.disabled():
                    return engine.generate(prompts, params)
            with torch.inference_mode():
                sampling = dict(temperature=temperature, top_k=0, top_p=1.0) if temperature else {}
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=bool(temperature),
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, **sampling)

        ours(), theirs()  # warm-up: allocator, kernels, caches
        pairs = []  # (ours, peer) seconds of one repeat; which runs first alternates
        for r in range(repeats):
            if r % 2 == 0:
                t_o = timed(ours)[0]
                t_p = timed(theirs)[0]
            else:
                t_p = timed(theirs)[0]
                t_o = timed(ours)[0]
            pairs.append((t_o, t_p))
        t_ours, t_hf = min(p[0] for p in pairs), min(p[1] for p in pairs)
        ratios = [hf / o for o, hf in pairs]
        tokens = batch * new_tokens
        rows.append({"batch": batch, "temperature": temperature, "ours_tok_s": tokens / t_ours, "hf_tok_s": tokens / t_hf,
                     "ours_ms_step": 1000 * t_ours / new_tokens, "hf_ms_step": 1000 * t_hf / new_tokens,
                     "speedup": median(ratios), "speedup_range": [min(ratios), max(ratios)]})
    if peer == "vllm":
        peer_engine.close()
    return {"benchmark": "engine", "peer": peer, "vllm_compiled": vllm_compiled if peer == "vllm" else None,
            "model": model_name, "dtype": dtype, "machine": machine(), "load_average": list(os.getloadavg()),
            "new_tokens": new_tokens, "prompt_len": prompt_len, "repeats": repeats, "rows": rows}


def main(args: argparse.Namespace) -> int:
    from .common import print_table, set_threads, write_json

    set_threads(args.threads)
    result = run(args.model, args.batch, args.new_tokens, args.prompt_len, args.repeats, args.peer, args.dtype,
                 tuple(args.temperature), args.vllm_compiled)
    print(f"bench engine: {result['model']} ({args.dtype}) on {result['machine']}, {args.new_tokens} new tokens, "
          f"peer {args.peer}")
    print_table(result["rows"], ["batch", "temperature", "ours_tok_s", "hf_tok_s", "ours_ms_step", "hf_ms_step", "speedup"])
    print(f"wrote {write_json(args.out, result)}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="checkpoint directory or 'smollm2-135m'")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (0 keeps torch's default)")
    p.add_argument("--peer", choices=["hf", "vllm", "no-kernels"], default="hf",
                   help="hf: transformers generate; vllm: a vLLM engine (needs the vllm extra); no-kernels: our "
                        "engine without its fused CPU kernels")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0], help="0 is greedy; one row per value")
    p.add_argument("--vllm-compiled", action="store_true",
                   help="with --peer vllm: vLLM's default compiled mode instead of eager")
    p.add_argument("--out", default="runs/bench/bench_engine.json")
