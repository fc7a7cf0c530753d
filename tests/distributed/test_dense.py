"""hybrid.dense on real processes (gloo, CPU): every apply_* against one process training the plain model.

A small model with a DDP part, an FSDP part (per-block ``wrap`` and activation checkpointing) and
a plain FSDP part is trained on per-rank batches and compared with one process training the
plain model on the concatenated batch (mean loss). Further tests: FSDP really shards, names do
not change, mixed precision, DDP comm hooks, activation checkpointing.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchrec.modules.mlp import MLP

from hybrid.dense import DENSE_STRATEGIES, apply_ddp, apply_fsdp, apply_local
from hybrid.dense.ddp import _comm_hook
from hybrid.dense.fsdp import _mp_policy
from tests.harness import run_distributed

B = 4  # rows per rank
STEPS = 5


@dataclass
class FSDPOpts:
    reshard_after_forward: bool = True
    mixed_precision: SimpleNamespace | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    wrap: list[str] = field(default_factory=list)


@dataclass
class DDPOpts:
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool | str = "auto"
    comm_hook: str = "none"


class Mixed(nn.Module):
    """bottom -> middle -> top; odd sizes so that some FSDP shards are padded or empty."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = MLP(8, [16, 12])
        self.middle = MLP(12, [16, 12])
        self.top = nn.Sequential(nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.top(self.middle(self.bottom(x))).squeeze(1)


def build(seed: int = 0) -> Mixed:
    torch.manual_seed(seed)
    return Mixed()


MIXED_PLAN = [  # (fqn, strategy, options), inner before outer as the composer orders them
    ("bottom", "ddp", DDPOpts()),
    ("middle", "fsdp", FSDPOpts(wrap=["Perceptron"], activation_checkpointing=True)),
    ("top", "fsdp", FSDPOpts(reshard_after_forward=False)),
]


def apply_plan(model: nn.Module, plan, mesh) -> nn.Module:
    for fqn, strategy, opts in plan:
        DENSE_STRATEGIES[strategy](model, fqn, mesh=mesh, options=opts)
    return model


TEACHER = torch.randn(8, generator=torch.Generator().manual_seed(7)) / 8**0.5


def data(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: a learnable linear target plus noise."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, 8, generator=g)
    return x, x @ TEACHER + 0.1 * torch.randn(n, generator=g)


def make_opt(name: str, params):
    return torch.optim.SGD(params, lr=0.1) if name == "sgd" else torch.optim.Adagrad(params, lr=0.05)


def full(v: torch.Tensor) -> torch.Tensor:
    return (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in model.state_dict().items()}


def train(model: nn.Module, opt_name: str, *, rank: int, world_size: int, steps: int = STEPS,
          batch: int = B) -> list[float]:
    """Rank ``rank``'s ``batch`` rows of each step's global batch of ``world_size * batch`` rows;
    returns the mean loss over ranks per step."""
    opt = make_opt(opt_name, model.parameters())
    losses = []
    for s in range(steps):
        x, y = data(s, world_size * batch)
        lo, hi = rank * batch, (rank + 1) * batch
        loss = F.mse_loss(model(x[lo:hi]), y[lo:hi])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dist.is_initialized():
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    return losses


def _equivalence(rank: int, world_size: int, *, opt_name: str):
    mesh = init_device_mesh("cpu", (world_size,))
    model = apply_plan(build(), MIXED_PLAN, mesh)
    losses = train(model, opt_name, rank=rank, world_size=world_size)
    return full_state(model), losses


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
def test_mixed_ddp_fsdp_model_equals_single_process_training(opt_name):
    results = run_distributed(_equivalence, 2, timeout=60, opt_name=opt_name)
    ref = build()
    init = copy.deepcopy(ref.state_dict())
    ref_losses = train(ref, opt_name, rank=0, world_size=1, batch=2 * B)  # one process, the whole batch
    for got, losses in results:
        assert list(got) == list(ref.state_dict())
        for k, want in ref.state_dict().items():
            torch.testing.assert_close(got[k], want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")
            assert not torch.equal(got[k], init[k]), f"{k} did not train"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)


def _shard_bytes(rank: int, world_size: int):
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    apply_fsdp(model, "", mesh=mesh, options=FSDPOpts(wrap=["Linear"]))
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert all(isinstance(p, DTensor) for p in model.parameters())
    model(torch.randn(2, 32)).sum().backward()  # still trains
    grads = sum(p.grad.to_local().numel() * p.grad.element_size() for p in model.parameters())
    return full_bytes, local, grads


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_keeps_one_nth_of_the_parameters_per_rank(world_size):
    results = run_distributed(_shard_bytes, world_size, timeout=60)
    for full_bytes, local, grads in results:
        assert local * world_size == full_bytes  # every dim 0 here divides by 2 and 4: no padding
        assert grads == local


KEY_CASES = {
    "ddp": [("bottom", "ddp", DDPOpts())],
    "ddp root": [("", "ddp", DDPOpts())],
    "fsdp": [("middle", "fsdp", FSDPOpts())],
    "fsdp root": [("", "fsdp", FSDPOpts())],
    "fsdp wrap": [("middle", "fsdp", FSDPOpts(wrap=["Perceptron", "Linear"]))],
    "fsdp ac": [("top", "fsdp", FSDPOpts(activation_checkpointing=True))],
    "fsdp wrap ac": [("middle", "fsdp", FSDPOpts(wrap=["Perceptron"], activation_checkpointing=True))],
    "fsdp cpu_offload": [("top", "fsdp", FSDPOpts(cpu_offload=True))],
    "local": [("top", "local", None)],
    "mixed": MIXED_PLAN,
}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _names(rank: int, world_size: int):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, set_model_state_dict,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    records = _Records()
    logging.getLogger("hybrid").addHandler(records)
    logging.getLogger("hybrid").setLevel(logging.INFO)
    plain = build()
    out = {"plain": (list(plain.state_dict()), [n for n, _ in plain.named_parameters()])}
    for case, plan in KEY_CASES.items():
        model = apply_plan(build(), plan, mesh)
        out[case] = (list(model.state_dict()), [n for n, _ in model.named_parameters()])
        out[case + " dcp"] = list(get_model_state_dict(model))
        train(model, "sgd", rank=rank, world_size=world_size, steps=1)  # still trains
    # A plain state_dict loads into the DDP model with plain load_state_dict, and DDP still syncs.
    other = build(seed=1).state_dict()
    model = apply_plan(build(), KEY_CASES["ddp"], mesh)
    model.load_state_dict(other)
    loaded = all(torch.equal(v, other[k]) for k, v in model.state_dict().items())
    x, y = data(0, world_size * B)
    F.mse_loss(model(x[rank * B:(rank + 1) * B]), y[rank * B:(rank + 1) * B]).backward()
    grad = model.bottom._mlp[0]._linear.weight.grad
    synced = torch.equal(grad, _broadcast(grad))
    # The mixed model takes a full plain state_dict through torch.distributed.checkpoint.
    model = apply_plan(build(), MIXED_PLAN, mesh)
    set_model_state_dict(model, dict(other), options=StateDictOptions(full_state_dict=True))  # it edits the dict
    dcp_loaded = all(torch.equal(v, other[k]) for k, v in full_state(model).items())
    logging.getLogger("hybrid").removeHandler(records)
    return out, loaded, synced, dcp_loaded, records.messages


def _broadcast(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.broadcast(t, src=0)
    return t


def test_names_do_not_change_and_plain_state_dicts_load():
    for out, loaded, synced, dcp_loaded, messages in run_distributed(_names, 2, timeout=60):
        plain_keys, plain_params = out["plain"]
        for case in KEY_CASES:
            keys, params = out[case]
            assert keys == plain_keys, case
            assert params == plain_params, case
            assert out[case + " dcp"] == plain_keys, case
        assert loaded and synced and dcp_loaded
        assert any(m.startswith("applied ddp to bottom (") for m in messages)
        assert any(m.startswith("applied ddp to <root> (") for m in messages)
        assert any(m.startswith("applied fsdp to middle (") and "wrapped 2 blocks" in m for m in messages)
        assert any(m.startswith("applied local to top (") for m in messages)
        assert any("cpu_offload ignored" in m for m in messages)


def _mixed_precision(rank: int, world_size: int, *, steps: int):
    mesh = init_device_mesh("cpu", (world_size,))
    losses = {}
    for param_dtype, reduce_dtype in [("float32", "float32"), ("bfloat16", "float32"),
                                      ("bfloat16", "bfloat16"), ("float16", "float16")]:
        mp = SimpleNamespace(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        plan = [("bottom", "ddp", DDPOpts()),
                ("middle", "fsdp", FSDPOpts(mixed_precision=mp, wrap=["Perceptron"])),
                ("top", "fsdp", FSDPOpts(mixed_precision=mp))]
        model = apply_plan(build(), plan, mesh)
        losses[(param_dtype, reduce_dtype)] = train(model, "sgd", rank=rank, world_size=world_size, steps=steps)
        # The sharded parameters, their gradients (and so the optimizer) stay float32.
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
        assert model(torch.randn(2, 8)).dtype == torch.float32  # output cast back for fp32 neighbours
    return losses


# Measured (2 ranks, this model, 10 SGD steps): max |loss_lowp - loss_fp32| is about 3e-3 for
# bfloat16 and 3e-4 for float16 at losses around 1.0; the bound leaves a 10x margin for bfloat16.
MP_TOLERANCE = 0.03


def test_mixed_precision_tracks_float32():
    losses = run_distributed(_mixed_precision, 2, timeout=60, steps=10)[0]
    ref = torch.tensor(losses[("float32", "float32")])
    for key, got in losses.items():
        diff = (torch.tensor(got) - ref).abs().max().item()
        assert diff < MP_TOLERANCE, (key, diff)
    assert losses[("bfloat16", "float32")] != losses[("float32", "float32")]  # bf16 really computed


def _comm_hooks(rank: int, world_size: int, *, steps: int, hooks=("none", "fp16", "bf16")):
    from torch.distributed._composable import replicate

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for hook in hooks:
        model = apply_plan(build(), [("", "ddp", DDPOpts(comm_hook=hook))], mesh)
        registered = [h.__name__ for h, _ in replicate.state(model)._ddp._comm_hooks]
        losses = train(model, "sgd", rank=rank, world_size=world_size, steps=steps)
        out[hook] = (registered, losses, full_state(model))
    return out


# Measured (2 ranks, 10 SGD steps): parameters differ from the uncompressed run by about 1e-4
# (fp16) and 2e-3 (bf16), losses by about 1e-4 and 2e-3.
HOOK_TOLERANCE = {"fp16": 1e-3, "bf16": 1e-2}


def test_ddp_comm_hooks_are_registered_and_track_uncompressed_training():
    out = run_distributed(_comm_hooks, 2, timeout=60, steps=10)[0]
    assert out["none"][0] == []  # DDP's own all-reduce
    assert out["fp16"][0] == ["fp16_compress_hook"]
    assert out["bf16"][0] == ["_bf16_compress_hook_any_backend"]
    _, ref_losses, ref_state = out["none"]
    for hook, tol in HOOK_TOLERANCE.items():
        _, losses, state = out[hook]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=tol, rtol=0)
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], atol=tol, rtol=0, msg=lambda m: f"{hook} {k}: {m}")
        assert any(not torch.equal(v, ref_state[k]) for k, v in state.items())  # the hook did something


def _on_launch(rank: int, world_size: int, *, steps: int):
    """DDP with ``on_launch``, without and with fp16 compression, beside DDP with neither."""
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, hook, launch in [("plain", "none", False), ("launch", "none", True), ("fp16", "fp16", False),
                               ("fp16+launch", "fp16", True)]:
        calls: list[tuple[int, bool]] = []
        step = [0]

        def on_launch():
            # Inside the backward (a graph task runs), with the bucket's all-reduce under way.
            calls.append((step[0], torch._C._current_graph_task_id() != -1))

        model = build()
        applied = apply_ddp(model, "", mesh=mesh, options=DDPOpts(comm_hook=hook),
                            on_launch=on_launch if launch else None)
        opt = make_opt("sgd", model.parameters())
        grads = []
        for s in range(steps):
            step[0] = s
            x, y = data(s, world_size * B)
            opt.zero_grad()
            F.mse_loss(model(x[rank * B:(rank + 1) * B]), y[rank * B:(rank + 1) * B]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        out[name] = (applied, calls, grads)
    out["nothing"] = apply_ddp(nn.Sequential(nn.ReLU()), "", mesh=mesh, options=DDPOpts(), on_launch=lambda: None)
    return out


def test_ddp_on_launch_runs_in_each_bucket_reduction_and_keeps_ddps_gradients_bit_for_bit():
    """``on_launch`` is called inside the backward of every step, once the (one) bucket's
    all-reduce is launched; DDP's mean comes out bit for bit as without it, with 3 trainers (the
    1/3 scaling rounds), uncompressed and compressed."""
    for out in run_distributed(_on_launch, 3, timeout=90, steps=3):
        for ref, name in (("plain", "launch"), ("fp16", "fp16+launch")):
            applied, calls, grads = out[name]
            assert applied and calls == [(0, True), (1, True), (2, True)], (name, calls)
            assert out[ref][1] == []
            for s, (got, want) in enumerate(zip(grads, out[ref][2])):
                assert all(torch.equal(g, w) for g, w in zip(got, want)), (name, s)
        assert out["nothing"] is False  # no parameter takes gradients: no DDP, nothing to call


class Indexed(nn.Module):
    """Mixed behind a fixed feature permutation held as an integer buffer (like DLRM's
    ``triu_indices``), with an optional BatchNorm (float running statistics) in front, and an
    integer counter buffer that each trainer bumps differently."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.register_buffer("order", torch.arange(7, -1, -1))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.norm = nn.BatchNorm1d(8) if norm else nn.Identity()
        self.mixed = build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixed(self.norm(x[:, self.order]))


def _buffers(rank: int, world_size: int):
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for norm in (False, True):
        for setting in ("auto", True, False):
            torch.manual_seed(0)
            model = apply_plan(Indexed(norm), [("", "ddp", DDPOpts(broadcast_buffers=setting))], mesh)
            losses = train(model, "sgd", rank=rank, world_size=world_size, steps=3)
            model.seen.fill_(10 + rank)
            model.eval()
            model(torch.randn(2, 8))  # a broadcast comes before a forward; eval keeps the stats
            stats = model.norm.running_mean.clone() if norm else None
            out[(norm, setting)] = (model.seen.item(), losses, stats)
    return out


def test_ddp_broadcasts_buffers_only_where_a_float_buffer_needs_it():
    """Composable ``replicate`` never syncs buffers; hybrid does what DDP's ``broadcast_buffers``
    does, by default ('auto') only for modules with a floating-point buffer."""
    r0, r1 = run_distributed(_buffers, 2, timeout=60)
    # Integer buffers only: 'auto' and false leave each trainer's own counter; true takes rank 0's.
    assert [r1[(False, s)][0] for s in ("auto", True, False)] == [11, 10, 11]
    assert r0[(False, "auto")][1] == r0[(False, True)][1] == r1[(False, "auto")][1]
    # With a BatchNorm, 'auto' broadcasts: every trainer holds rank 0's running statistics.
    assert [r1[(True, s)][0] for s in ("auto", True, False)] == [10, 10, 11]
    assert torch.equal(r0[(True, "auto")][2], r1[(True, "auto")][2])
    assert torch.equal(r0[(True, True)][2], r1[(True, True)][2])
    assert not torch.equal(r0[(True, False)][2], r1[(True, False)][2])  # each trainer's own data


def _merged(rank: int, world_size: int):
    from torch.distributed._composable import replicate

    from hybrid.dense.ddp import apply_ddp_merged, merge_groups
    from hybrid.plan.schema import DDPOptions

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for merge in (True, False):
        model = build()
        apply_fsdp(model, "middle", mesh=mesh, options=FSDPOpts())
        groups = merge_groups(model, [("bottom", DDPOptions(merge=merge)), ("top", DDPOptions(merge=merge))])
        for root, fqns, opts in groups:
            apply_ddp_merged(model, root, fqns, mesh=mesh, options=opts)
        ddps = {}
        for fqn in ("", "bottom", "top"):
            try:
                ddps[fqn] = {id(p) for p in replicate.state(model.get_submodule(fqn))._ddp.parameters()}
            except (AttributeError, KeyError):
                pass
        want = {fqn: {id(p) for p in model.get_submodule(fqn).parameters()} for fqn in ("bottom", "top")}
        error = None
        try:
            model.bottom(torch.zeros(2, 8))  # a member called on its own, outside the root's forward
        except RuntimeError as e:
            error = str(e)
        with torch.no_grad():
            model.bottom(torch.zeros(2, 8))  # evaluation needs no sync: allowed
        losses = train(model, "sgd", rank=rank, world_size=world_size)
        out[merge] = {
            "groups": [(r, f) for r, f, _ in groups],
            "ddps": {k: v == (want["bottom"] | want["top"]) if k == "" else v == want[k] for k, v in ddps.items()},
            "error": error, "losses": losses, "state": full_state(model),
        }
    return out


def test_ddp_modules_with_equal_options_share_one_ddp_and_train_as_one_process():
    results = run_distributed(_merged, 2, timeout=90)
    ref = build()
    ref_losses = train(ref, "sgd", rank=0, world_size=1, batch=2 * B)
    for out in results:
        merged, separate = out[True], out[False]
        # merge: one DDP on the root holding exactly bottom's and top's parameters (not middle's,
        # which FSDP owns); merge: false, one DDP each.
        assert merged["groups"] == [("", ["bottom", "top"])]
        assert merged["ddps"] == {"": True}
        assert separate["groups"] == [("bottom", ["bottom"]), ("top", ["top"])]
        assert separate["ddps"] == {"bottom": True, "top": True}
        assert merged["error"] is not None and "bottom ran outside the forward of the model" in merged["error"]
        assert "merge: false" in merged["error"]
        assert separate["error"] is None
        for r in (merged, separate):
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
            for k, want in ref.state_dict().items():
                torch.testing.assert_close(r["state"][k], want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def _checkpointing(rank: int, world_size: int):
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for case, opts in {"plain": FSDPOpts(wrap=["Perceptron"]),
                       "ac blocks": FSDPOpts(wrap=["Perceptron"], activation_checkpointing=True),
                       "ac whole": FSDPOpts(activation_checkpointing=True)}.items():
        model = apply_plan(build(), [("bottom", "ddp", DDPOpts()), ("middle", "fsdp", opts)], mesh)
        calls = []
        model.middle._mlp[0]._linear.register_forward_hook(lambda *_: calls.append(1))
        x, y = data(0, world_size * B)
        F.mse_loss(model(x[rank * B:(rank + 1) * B]), y[rank * B:(rank + 1) * B]).backward()
        out[case] = ({n: full(p.grad) for n, p in model.named_parameters()}, len(calls))
    return out


def test_activation_checkpointing_recomputes_and_gives_identical_gradients():
    for out in run_distributed(_checkpointing, 2, timeout=60):
        plain, plain_calls = out["plain"]
        assert plain_calls == 1
        for case in ("ac blocks", "ac whole"):
            grads, calls = out[case]
            assert calls == 2, case  # forward, then the recomputation in backward
            assert list(grads) == list(plain)
            for n, g in grads.items():
                torch.testing.assert_close(g, plain[n], atol=0, rtol=0, msg=lambda m: f"{case} {n}: {m}")


def test_bad_option_values_name_the_choices():
    with pytest.raises(ValueError, match=r"mixed_precision.param_dtype: got 'fp8'.*'bfloat16'"):
        _mp_policy(SimpleNamespace(param_dtype="fp8", reduce_dtype="float32"), outermost=True)
    with pytest.raises(ValueError, match=r"comm_hook: got 'int8'.*'fp16'"):
        _comm_hook("int8", "cpu")
    policy = _mp_policy(SimpleNamespace(param_dtype="bfloat16", reduce_dtype="float32"), outermost=True)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert _mp_policy(SimpleNamespace(param_dtype="bfloat16", reduce_dtype="float32"), outermost=False).output_dtype is None
    assert _mp_policy(None, outermost=True).param_dtype is None


def test_registry_names_every_dense_strategy():
    assert DENSE_STRATEGIES == {"fsdp": apply_fsdp, "ddp": apply_ddp, "local": apply_local}
