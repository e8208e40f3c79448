"""Every trainer and generator `rl/backends.py` registers implements its protocol (`megatron_spec.interfaces`):
each member is there, and each method takes the protocol's arguments. The Ray groups implement the part the Ray
driver's loop calls. The loop turns speculation off for a step only through the protocols' `speculation`."""

import inspect
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Protocol

import pytest

from megatron_spec.interfaces import Generator, Policy, no_step_gate
from megatron_spec.rl import backends
from megatron_spec.rl.loop import Trainer


def members(protocol) -> dict[str, object]:
    """The protocol's members (its own and its protocol bases'), by name: the function of a method, None for an
    attribute."""
    out = {}
    for base in reversed(protocol.__mro__):
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        out.update({n: None for n in getattr(base, "__annotations__", {})})
        out.update({n: getattr(v, "__func__", v) for n, v in vars(base).items()
                    if not n.startswith("_") and callable(getattr(v, "__func__", v))})
    return out


def problems(cls, protocol) -> dict[str, str]:
    """What `cls` lacks of `protocol`: a member it does not have, or a method that cannot take the protocol's
    arguments (positionally, after self / cls)."""
    out = {}
    for name, func in members(protocol).items():
        if not hasattr(cls, name):
            out[name] = "missing"
        elif func is not None:
            impl = inspect.getattr_static(cls, name)
            impl = getattr(impl, "__func__", impl)
            if not callable(impl):
                out[name] = "not a method"
                continue
            wanted = len(inspect.signature(func).parameters) - 1
            try:
                inspect.signature(impl).bind(*range(wanted + 1))
            except TypeError as err:
                out[name] = f"does not take the protocol's {wanted} argument(s): {err}"
    return out


def resolve_or_skip(table: dict, name: str):
    try:
        return backends.resolve(table, name, "backend")
    except ImportError as err:
        pytest.skip(f"needs {err}")


@pytest.mark.parametrize("name", backends.POLICIES)
def test_every_registered_trainer_implements_the_policy_protocol(name):
    cls = resolve_or_skip(backends.POLICIES, name)
    assert problems(cls, Policy) == {}


@pytest.mark.parametrize("table,name", [(t, n) for t in ("GENERATORS", "GENERATORS_FROM_FILES")
                                        for n in getattr(backends, t)])
def test_every_registered_generator_implements_the_generator_protocol(table, name):
    obj = resolve_or_skip(getattr(backends, table), name)
    if isinstance(obj, type):
        assert problems(obj, Generator) == {}
    else:  # a function that builds a registered class from the files: called as `from_rl` is
        inspect.signature(obj).bind("cfg", None, None)


def test_the_ray_groups_implement_what_the_ray_driver_leaves_to_them():
    """The driver refits through its transport (no `export_weights` / `update_weights`) and its engines wake and
    sleep in their actors; the groups are built by the driver, not by `from_rl`. Everything else is there."""
    from megatron_spec.placement.groups import GeneratorGroup, ShardedTrainerGroup, TrainerGroup

    for group in (TrainerGroup, ShardedTrainerGroup):
        assert problems(group, Policy) == {"export_weights": "missing", "from_rl": "missing"}
    assert problems(GeneratorGroup, Generator) == {"from_rl": "missing", "update_weights": "missing",
                                                   "sleep": "missing", "wake": "missing"}


def test_the_check_finds_a_missing_method_and_a_wrong_signature():
    """The check can fail: a generator without `speculation`, and one whose `generate` takes no params, are named."""
    from megatron_spec.generators.embedded import EmbeddedGenerator

    class NoGate(EmbeddedGenerator):
        speculation = None

    class OneArgument(EmbeddedGenerator):
        def generate(self, prompts):
            return []

    assert problems(NoGate, Generator) == {"speculation": "not a method"}
    del NoGate.speculation  # back to the inherited one
    assert problems(NoGate, Generator) == {}

    class Bare:
        pass

    assert set(problems(Bare, Generator)) == set(members(Generator))
    assert list(problems(OneArgument, Generator)) == ["generate"]
    assert set(members(Generator)) >= {"generate", "update_weights", "sleep", "wake", "close", "from_rl",
                                       "speculation", "supports_step_gate"}
    assert set(members(Policy)) >= {"logprobs", "train_step", "export_weights", "state_dict", "load_state_dict",
                                    "from_rl", "speculation", "supports_step_gate", "trains_drafter_online"}


class Side:
    """A trainer or generator stub that records the speculation the loop asks of it."""

    def __init__(self, gate: bool, online: bool = True):
        self.supports_step_gate, self.trains_drafter_online, self.calls = gate, online, []

    @contextmanager
    def speculation(self, enabled: bool):
        self.calls.append(("enter", enabled))
        yield
        self.calls.append(("exit", enabled))


def loop_with(policy, generator, adaptive=True) -> Trainer:
    trainer = Trainer.__new__(Trainer)
    trainer.policy, trainer.generator = policy, generator
    trainer.cfg = SimpleNamespace(spec=SimpleNamespace(adaptive=adaptive),
                                  drafter_train=SimpleNamespace(gate=True, online=True))
    return trainer


def test_the_loop_gates_only_a_pair_that_both_support_the_gate():
    assert loop_with(Side(True), Side(True)).gated()
    assert not loop_with(Side(True), Side(False)).gated()
    assert not loop_with(Side(False), Side(True)).gated()
    assert not loop_with(Side(True, online=False), Side(True)).gated()
    assert not loop_with(Side(True), Side(True), adaptive=False).gated()


def test_a_plain_step_goes_through_both_sides_speculation():
    """False: both sides plain inside the block and back after it; `engine=False`: the trainer's side only;
    None / True: neither side is asked."""
    policy, generator = Side(True), Side(True)
    trainer = loop_with(policy, generator)
    with trainer.speculation(False):
        assert policy.calls == [("enter", False)] and generator.calls == [("enter", False)]
    assert policy.calls[-1] == generator.calls[-1] == ("exit", False)
    policy.calls.clear(), generator.calls.clear()
    with trainer.speculation(False, engine=False):
        pass
    assert policy.calls == [("enter", False), ("exit", False)] and generator.calls == []
    policy.calls.clear()
    for on in (None, True):
        with trainer.speculation(on):
            pass
    assert policy.calls == generator.calls == []


def test_an_implementation_without_the_gate_refuses_a_plain_step():
    with no_step_gate(object(), True):
        pass
    with pytest.raises(NotImplementedError, match="object cannot switch speculation off"):
        no_step_gate(object(), False)
