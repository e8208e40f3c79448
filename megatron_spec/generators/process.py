"""`ProcessGenerator`: the embedded generator in a process of its own, for a run whose trainer holds the policy
only in shards (`backend.trainer=megatron` with `backend.generator=embedded`).

That process loads the policy (and drafter) from the checkpoint files itself and is refit from the trainer's
stream every step, so the loop's process (Megatron's rank 0) never holds a full copy of the model. It is not a
trainer rank: it runs without torchrun's rank variables, and the loop reports its peak RSS among its children.

Calls cross a socket pair: `generate`, `update_weights`, `sleep`, `wake`, `close` (the `Generator` of
`megatron_spec.interfaces`, without the whole-step gate). A refit sends one bucket at a time (serialised by
`torch.save`), so either side stages one bucket, not the model. An error in the generator's process comes back
with its traceback and is raised here; a generator process that dies (e.g. killed for memory) is reported with its
exit code.

    python -m megatron_spec.generators.process FD    (started by `ProcessGenerator`, never by hand)
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection

import torch

from megatron_spec.interfaces import no_step_gate

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
                 "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
"""What torchrun sets for its workers: the generator's process is not one of them."""


def _pack(bucket) -> bytes:
    """One refit bucket as bytes; a view is saved as its own elements, not its whole storage."""
    out = []
    for name, t in bucket:
        t = t.detach()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        out.append((name, t))
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


class ProcessGenerator:
    """The Generator interface (`generate`, `update_weights`, `sleep`, `wake`, `close`) of an `EmbeddedGenerator`
    that lives in a child process started with the run's config."""

    supports_step_gate = False

    def __init__(self, cfg):
        parent, child = socket.socketpair()
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
        env["OMP_NUM_THREADS"] = str(cfg.run.threads)
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(child.fileno())], pass_fds=[child.fileno()],
                                     env=env)
        child.close()
        self.conn = Connection(parent.detach())
        self.closed = False
        self._send(cfg)
        self._result()  # loaded (or the load's error)

    @classmethod
    def from_rl(cls, cfg, model=None, drafter=None) -> "ProcessGenerator":
        """`model` and `drafter` must be None: the generator's process loads its own from `cfg`'s checkpoints."""
        if model is not None or drafter is not None:
            raise ValueError("ProcessGenerator loads the policy and drafter in its own process; pass None")
        return cls(cfg)

    def _exited(self, err: Exception) -> RuntimeError:
        code = self.proc.wait(timeout=60)
        return RuntimeError(f"the generator's process exited (code {code}; -9 is a kill, e.g. for memory): {err!r}")

    def _send(self, obj=None, data: bytes | None = None) -> None:
        try:
            self.conn.send(obj) if data is None else self.conn.send_bytes(data)
        except OSError as err:  # a broken pipe: the process is gone
            raise self._exited(err) from err

    def _result(self):
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError) as err:
            raise self._exited(err) from err
        if status == "error":
            raise RuntimeError(f"in the generator's process:\n{value}")
        return value

    def _call(self, name: str, *args):
        self._send((name, args))
        return self._result()

    def generate(self, prompts, params):
        return self._call("generate", prompts, params)

    def update_weights(self, stream) -> int:
        """Send the bucketed `(hf_name, tensor)` stream one bucket at a time; returns the bytes loaded."""
        self._send(("update_weights", ()))
        for bucket in stream:
            self._send(data=_pack(bucket))
        self._send(data=b"")
        return self._result()

    def sleep(self) -> None:
        self._call("sleep")

    def wake(self) -> None:
        self._call("wake")

    def speculation(self, enabled: bool):
        return no_step_gate(self, enabled)

    def close(self) -> None:
        """Stop the generator's process (waits for it)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.conn.send(("close", ()))
            self.conn.recv()
        except (EOFError, OSError):
            pass
        self.conn.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def link_checkpoint(policy: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32"):
    """`out` as the policy's HF directory for vLLM without loading it: its files linked, its config.json with
    `torch_dtype` = `dtype` (what vLLM serves; float32, as the in-process generator computes)."""
    from megatron_spec.generators.vllm.export import link_model

    return link_model(policy, out, dtype)


def vllm_from_files(cfg, model=None, drafter=None):
    """A `VLLMGenerator` for a run whose loop holds no policy: vLLM loads the policy's checkpoint files (linked
    under `<run.out_dir>/vllm/policy`), and the drafter's directory for vLLM is written from its checkpoint files
    tensor by tensor (`VLLMGenerator.from_rl`), so this process never holds the policy or a drafter module."""
    from pathlib import Path

    from megatron_spec.generators.vllm import VLLMGenerator

    if model is not None or drafter is not None:
        raise ValueError("vllm_from_files reads the checkpoint files; pass no model or drafter")
    link_checkpoint(cfg.model.policy, Path(cfg.run.out_dir) / "vllm" / "policy")
    return VLLMGenerator.from_rl(cfg, None, None)


def _buckets(conn: Connection):
    while data := conn.recv_bytes():
        yield _unpack(data)


def serve(conn: Connection) -> None:
    """The generator's process: load the policy and drafter named by the config, then answer calls until `close`."""
    from megatron_spec.models import from_pretrained
    from megatron_spec.generators.embedded import EmbeddedGenerator
    from megatron_spec.rl.loop import load_drafter_for

    cfg = conn.recv()
    torch.set_num_threads(cfg.run.threads)
    try:
        model = from_pretrained(cfg.model.policy, device=cfg.run.torch_device())
        drafter = load_drafter_for(cfg, model)
        gen = EmbeddedGenerator(model, drafter, cfg.spec, max_num_seqs=cfg.grpo.prompts_per_step * cfg.grpo.group_size,
                                own=True, record_routing=cfg.grpo.routing_replay)
        del model, drafter
    except Exception:  # noqa: BLE001  (reported to the caller, which raises it)
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        name, args = conn.recv()
        if name == "close":
            conn.send(("ok", None))
            return
        try:
            if name == "update_weights":
                stream = _buckets(conn)
                try:
                    result = gen.update_weights(stream)
                finally:
                    for _ in stream:  # a failed load still reads the rest of the stream
                        pass
            else:
                result = getattr(gen, name)(*args)
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", result))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
