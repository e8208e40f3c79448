"""`slurm/ray.sub` rendered for a 2-node plan, checked against the plan: CPUs per task on every step, the open-file
limit, every fixed port on `ray start`, each node's address, and a node-major rank list that keeps the plan's TP,
expert and engine groups inside a node. The template runs here against stand-ins for srun, scontrol and ray (the
multi-node half the one-node test cluster cannot show); tests/slurm runs it for real on one node."""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launchers import ray_slurm_plan, render_sbatch
from launchers.plans import RAY_PORTS, node_group_problems, ranks_by_node, ray_ports
from megatron_spec.distributed.process_groups import straddling_groups
from megatron_spec.layout import Layout
from megatron_spec.rl.overrides import apply_overrides

ROOT = Path(__file__).resolve().parents[1]
CPUS = 3


def free_ports(n: int) -> list[int]:
    """n distinct ports free on this machine now, outside Ray's default worker range (ephemeral ports are above
    32767 on Linux)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def tiny_moe_layout(placement: str) -> dict:
    """The tiny MoE recipe on the Megatron trainer at TP 2, EP 2 on 2 nodes of 4 devices: colocated (every node
    trains and generates), or disaggregated (node 0 trains, node 1 holds 2 engines of TP 2)."""
    from megatron_spec.nemo_run_cli import load_recipe
    from recipes._common import Scale

    cfg = load_recipe(ROOT / "recipes" / "tiny_moe_grpo_spec.py").tiny_moe_grpo_spec()
    over = ["backend.trainer=megatron", "backend.megatron.tp=2", "backend.megatron.ep=2", "backend.megatron.etp=1"]
    if placement == "colocated":
        return Scale(nodes=2, gpus_per_node=4).layout(apply_overrides(cfg, over))
    over += ["backend.generator=vllm", "backend.placement=disaggregated", "backend.generators=2",
             "backend.vllm.tensor_parallel_size=2"]
    disaggregated = Layout(etp=1, engine=Layout(tp=2, etp=1), engines=2, colocated=False)
    return Scale(nodes=2, gpus_per_node=4, parallel=disaggregated).layout(apply_overrides(cfg, over))


def two_node_plan(placement: str, **ray) -> dict:
    single = [k for k in RAY_PORTS if k not in ("RAY_MIN_WORKER_PORT", "RAY_MAX_WORKER_PORT")]
    ports = dict(zip(single, free_ports(len(single))))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    target = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 16384)
    ray = {"open_files": {"target": target, "min": 1024}, **ray}
    plan = ray_slurm_plan("A", "batch", nodes=2, gpus_per_node=4, time="00:10:00", cpus_per_task=CPUS, ports=ports,
                          **ray)
    plan["recommended"] = {"nodes": 2, "gpus_per_node": 4, **tiny_moe_layout(placement)}
    return plan


def inputs(text: str) -> dict[str, str]:
    """The rendered assignments: `K=${K:-v}` (the plan's, the environment may override) and `K=v`."""
    head = text.split("# ---- inputs, from the environment")[0]
    out = {}
    for k, v in re.findall(r"^([A-Z_]+)=(.*)$", head, re.M):
        m = re.fullmatch(r"\$\{%s:-(.*)\}" % k, v)
        out[k] = (m.group(1) if m else v).strip("'")
    return out


def span(text: str) -> range:
    a, _, b = text.partition("-")
    return range(int(a), int(b or a) + 1)


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_rendered_inputs_are_the_plans_and_keep_groups_inside_a_node(placement):
    """The 2-node script sets CPUS_PER_TASK, OPEN_FILES(_MIN) and every port to the plan's values; RANKS_BY_NODE
    lists each node's 4 units node-major (0-3, 4-7), and with that order every TP group (2 consecutive trainer
    ranks), expert group (EP 2 x ETP 1) and engine (its TP units) lies inside one node's units."""
    plan = two_node_plan(placement)
    text = render_sbatch(plan, "true", "t")
    got = inputs(text)
    assert got["CPUS_PER_TASK"] == str(CPUS) and "#SBATCH --nodes=2" in text
    assert (got["OPEN_FILES"], got["OPEN_FILES_MIN"]) == (str(plan["ray"]["open_files"]["target"]), "1024")
    assert {k: int(got[k]) for k in RAY_PORTS} == plan["ray"]["ports"]
    nodes = [span(s) for s in got["RANKS_BY_NODE"].split()]
    assert nodes == [range(0, 4), range(4, 8)]
    layout = plan["recommended"]
    meg, tp = layout["megatron"], layout["vllm"]["tensor_parallel_size"]
    train = 8 if placement == "colocated" else 4
    on = lambda units: {i for i, n in enumerate(nodes) if set(units) & set(n)}  # noqa: E731
    for size in (meg["tp"], meg["ep"] * meg["etp"]):
        assert all(len(on(range(g, g + size))) == 1 for g in range(0, train, size)), size
    first_engine_unit = 0 if placement == "colocated" else train
    assert all(len(on(range(first_engine_unit + j * tp, first_engine_unit + (j + 1) * tp))) == 1
               for j in range(layout["vllm"]["engines"]))
    listed = [line for line in text.splitlines() if line.startswith("#   node ")]
    want = (["#   node 0: units 0-3, trainer ranks 0-3, engines 0-3", "#   node 1: units 4-7, trainer ranks 4-7, "
             "engines 4-7"] if placement == "colocated" else
            ["#   node 0: units 0-3, trainer ranks 0-3", "#   node 1: units 4-7, engines 0-1"])
    assert listed == want
    assert node_group_problems(layout, 2) == []
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def stubs(tmp_path: Path) -> tuple[dict, Path]:
    """Stand-ins: scontrol (nodes n1, n2), srun (logs its options, runs the step here), ray (logs its arguments
    and its soft open-file limit; the head listens on its --port), and a `ray` module whose nodes() are the head
    plus every worker that has run `ray start --address`."""
    bin_dir, py_dir, log = tmp_path / "bin", tmp_path / "py" / "ray", tmp_path / "calls.log"
    bin_dir.mkdir()
    py_dir.mkdir(parents=True)
    listen = ("import socket, sys, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)"
              "; s.bind(('', int(sys.argv[1]))); s.listen(); time.sleep(60)")
    body = {
        "scontrol": "printf 'n1\\nn2\\n'",
        "hostname": "echo 10.0.0.1 10.9.9.9",
        "srun": f'echo "srun $*" >> {log}; while [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done; "$@"',
        "ray": f'echo "ray $* nofile=$(ulimit -Sn)" >> {log}\n'
               'if [[ " $* " == *" --head "* ]]; then echo "Ray runtime started"\n'
               '  for a in "$@"; do [[ $a == --port=* ]] && port=${a#--port=}; done\n'
               f'  exec {sys.executable} -c "{listen}" "$port"; fi',
    }
    for name, text in body.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{text}\n")
        (bin_dir / name).chmod(0o755)
    (py_dir / "__init__.py").write_text(
        "def init(**kw): pass\n"
        "def nodes():\n"
        f"    joined = sum('ray start --address' in l for l in open({str(log)!r}).read().splitlines())\n"
        f"    return [{{'Alive': True, 'NodeManagerAddress': f'n{{i}}', 'Resources': {{'GPU': 4, 'CPU': {CPUS}}}}}"
        "            for i in range(1 + joined)]\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(tmp_path / "py"),
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "42",
           "SLURM_CPUS_ON_NODE": "64", "RAY_WAIT_S": "30", "LOG_DIR": str(tmp_path / "logs")}
    return env, log


def flags(call: str) -> dict[str, str]:
    return dict(re.findall(r"--([a-z-]+)=(\S+)", call))


def low_soft_limit():
    """The job starts with a soft open-file limit of 1024 (a common default), so the raise is visible."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))


def test_rendered_script_starts_each_node_as_the_plan_says(tmp_path):
    """Run as rendered for 2 nodes: every srun step asks for CPUS_PER_TASK CPUs; both `ray start`s run with the
    open-file limit raised from 1024 to the plan's target, --num-cpus and every node port of the plan (the head
    also its GCS, client and dashboard ports), at one non-loopback address (the head's, which the worker reaches
    by the route to it); the worker joins only once the head's GCS port answers, and the head waits for it before
    COMMAND runs with RAY_ADDRESS at the head's GCS port and the rendered rank list; the job's exit code is
    COMMAND's."""
    plan = two_node_plan("colocated")
    env, log = stubs(tmp_path)
    script = tmp_path / "ray.sub"
    command = f'echo "driver $RAY_ADDRESS $MEGATRON_SPEC_RANKS_BY_NODE" >> {log}; exit 3'
    script.write_text(render_sbatch(plan, command, "t"))
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=low_soft_limit)
    assert done.returncode == 3, done.stderr
    calls = log.read_text().splitlines()
    sruns = [c for c in calls if c.startswith("srun ")]
    assert len(sruns) == 3 and all(f"--cpus-per-task={CPUS}" in c for c in sruns)  # head IP, worker, head
    head = [flags(c) for c in calls if c.startswith("ray start --head")]
    worker = [flags(c) for c in calls if c.startswith("ray start --address")]
    assert len(head) == 1 and len(worker) == 1
    ports = plan["ray"]["ports"]
    node = {"node-manager-port": "RAY_NODE_MANAGER_PORT", "object-manager-port": "RAY_OBJECT_MANAGER_PORT",
            "runtime-env-agent-port": "RAY_RUNTIME_ENV_AGENT_PORT",
            "dashboard-agent-grpc-port": "RAY_DASHBOARD_AGENT_GRPC_PORT",
            "dashboard-agent-listen-port": "RAY_DASHBOARD_AGENT_LISTEN_PORT",
            "metrics-export-port": "RAY_METRICS_EXPORT_PORT", "min-worker-port": "RAY_MIN_WORKER_PORT",
            "max-worker-port": "RAY_MAX_WORKER_PORT"}
    for f in (*head, *worker):
        assert {k: int(f[k]) for k in node} == {k: ports[v] for k, v in node.items()}
        assert f["num-cpus"] == str(CPUS) and f["num-gpus"] == "4"
    head, worker = head[0], worker[0]
    assert (int(head["port"]), int(head["ray-client-server-port"]), int(head["dashboard-port"])) == \
        (ports["RAY_PORT"], ports["RAY_CLIENT_PORT"], ports["RAY_DASHBOARD_PORT"])
    ip = head["node-ip-address"]
    assert not ip.startswith("127.") and worker["node-ip-address"] == ip  # both "nodes" are this machine
    assert worker["address"] == f"{ip}:{ports['RAY_PORT']}"
    nofile = {c.rsplit("nofile=", 1)[1] for c in calls if c.startswith("ray start")}
    assert nofile == {str(plan["ray"]["open_files"]["target"])}
    assert f"driver {ip}:{ports['RAY_PORT']} 0-3 4-7" in calls
    assert f"Ray cluster up with 8 GPUs on 2 nodes of {CPUS} CPUs" in done.stdout


@pytest.mark.parametrize("name", ["RAY_NODE_MANAGER_PORT", "MEGATRON_SPEC_WEIGHTS_PORT"])
def test_a_taken_port_is_named_before_ray_starts(tmp_path, name):
    """A process listening on one of the plan's ports (a raylet's; the refit's weight-update group's): the step
    stops with exit 5 naming the port and its variable, and no `ray start` runs."""
    plan = two_node_plan("colocated")
    env, log = stubs(tmp_path)
    script = tmp_path / "ray.sub"
    script.write_text(render_sbatch(plan, "exit 0", "t"))
    port = plan["ray"]["ports"][name]
    with socket.socket() as s:
        s.bind(("", port))
        s.listen()
        done = subprocess.run(["bash", str(script)], env={**env, "RAY_WAIT_S": "3"}, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 5, done.stderr
    assert f"port {port} ({name}) is taken" in done.stderr
    assert not any(c.startswith("ray start") for c in log.read_text().splitlines())


def test_an_open_file_limit_below_the_minimum_stops_the_step(tmp_path):
    """A hard limit of 2048 under OPEN_FILES_MIN=4096: the step cannot raise the soft limit far enough and stops
    with exit 4, naming the limits and the fix, before Ray starts."""
    plan = two_node_plan("colocated", open_files={"target": 65536, "min": 4096})
    env, log = stubs(tmp_path)
    script = tmp_path / "ray.sub"
    script.write_text(render_sbatch(plan, "exit 0", "t"))
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 2048)))
    assert done.returncode == 4, done.stderr
    assert "open-file limit 2048 (hard 2048) is below OPEN_FILES_MIN=4096" in done.stderr
    assert not any(c.startswith("ray start") for c in log.read_text().splitlines())


def test_node_address_by_interface_and_never_loopback(tmp_path):
    """The template's address finder: RAY_NODE_IFACE=lo gives 127.0.0.1, refused with the fix; an interface that
    does not exist is named; the route toward an address gives a non-loopback address of this machine."""
    plan = two_node_plan("colocated")
    env, _ = stubs(tmp_path)
    script = tmp_path / "ray.sub"
    script.write_text(render_sbatch(plan, "exit 0", "t"))
    subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    finder = tmp_path / "logs" / "node-ip.py"
    lo = subprocess.run([sys.executable, str(finder), "lo"], capture_output=True, text=True)
    assert lo.returncode == 1 and "got 127.0.0.1" in lo.stderr and "set RAY_NODE_IFACE" in lo.stderr
    missing = subprocess.run([sys.executable, str(finder), "nosuchif0"], capture_output=True, text=True)
    assert missing.returncode == 1 and "no IPv4 address on RAY_NODE_IFACE=nosuchif0" in missing.stderr
    routed = subprocess.run([sys.executable, str(finder), "", "10.0.0.1"], capture_output=True, text=True)
    assert routed.returncode == 0 and not routed.stdout.startswith("127.")


@pytest.mark.parametrize("over, message", [
    ({"RAY_PORT": 6700}, "RAY_NODE_MANAGER_PORT and RAY_PORT are both 6700"),
    ({"RAY_PORT": 10500}, "RAY_PORT=10500 lies in the Ray worker range 10002..10999"),
    ({"RAY_MAX_WORKER_PORT": 10010}, "fewer than 64 workers"),
    ({"RAY_CLIENT_PORT": 80}, "1024..65535"),
    ({"RAY_GCS": 1}, "unknown Ray ports"),
])
def test_ray_ports_are_checked(over, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ray_ports(over)
    assert ray_ports({"RAY_DASHBOARD_PORT": 0})["RAY_DASHBOARD_PORT"] == 0  # no dashboard


def test_ray_plan_refuses_bad_node_settings():
    with pytest.raises(ValueError, match="cpus_per_task"):
        ray_slurm_plan("A", cpus_per_task=0)
    with pytest.raises(ValueError, match="not a network interface name"):
        ray_slurm_plan("A", node_iface="eth0; rm -rf /")
    with pytest.raises(ValueError, match="1024 <= min <= target"):
        ray_slurm_plan("A", open_files={"target": 4096, "min": 8192})


def test_groups_that_would_straddle_nodes_are_named():
    """On nodes of 4 devices: TP 3 and EP 3 do not divide 4; EP 8 spans two whole nodes (allowed); a
    disaggregated trainer of 6 devices leaves node 1 split between trainer ranks and engines."""
    layout = {"gpus": 8, "megatron": {"tp": 3, "ep": 3, "etp": 1},
              "vllm": {"tensor_parallel_size": 2, "engines": 1}, "ray": {"placement": "disaggregated"}}
    problems = node_group_problems(layout, 2)
    assert len(problems) == 3 and "TP 3" in problems[0] and "EP 3 x ETP 1" in problems[1]
    assert "trainer's 6 devices end inside a node of 4" in problems[2]
    layout["megatron"] = {"tp": 1, "ep": 8, "etp": 1}
    layout["vllm"]["engines"] = 2
    assert node_group_problems(layout, 2) == []
    assert ranks_by_node(layout, 2) == [{"node": 0, "units": [0, 3], "trainer_ranks": [0, 3], "engines": None},
                                        {"node": 1, "units": [4, 7], "trainer_ranks": None, "engines": [0, 1]}]


def test_the_driver_names_groups_a_placement_put_on_two_nodes():
    """Every rank's node in rank order: a node-major order keeps TP 2 groups whole; an interleaved one (Ray placed
    bundles alternately) splits every group; a group larger than a node is not counted."""
    assert straddling_groups(["a", "a", "b", "b"], 2) == []
    assert straddling_groups(["a", "b", "a", "b"], 2) == [0, 1]
    assert straddling_groups(["a", "a", "a", "b", "b", "b"], 2) == [1]
    assert straddling_groups(["a", "a", "b", "b"], 4) == []
    assert straddling_groups(["a", "b"], 1) == []


def test_the_templates_own_defaults_are_the_plans():
    """A script submitted by hand (no plan) gets the same ports and limits as a rendered one: each of the template's
    defaults is the plan's."""
    from launchers.render import ray_defaults

    text = (ROOT / "slurm" / "ray.sub").read_text()
    for name, value in ray_defaults().items():
        assert f"\n{name}=${{{name}:-{value}}}" in text, name


def test_nemo_run_executor_of_a_ray_plan_asks_for_its_cpus():
    """The NeMo-Run SlurmExecutor built from a ray-slurm plan (for experiments composed by hand) carries the plan's
    CPUs per task and exclusive nodes; a plain SLURM plan leaves the CPUs to SLURM."""
    pytest.importorskip("nemo_run")
    import launchers

    ray = launchers.ray_slurm_executor("A", "batch", 2, 4, "00:10:00", None, cpus_per_task=12)
    assert (ray.cpus_per_task, ray.exclusive, ray.nodes, ray.ntasks_per_node) == (12, True, 2, 1)
    assert launchers.slurm_executor("A", "batch", 1, 1, "00:10:00", None).cpus_per_task is None
