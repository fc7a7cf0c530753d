"""Checkpoints end to end: resume bit for bit, a crash mid-save, reshard, export.

Three real jobs through ``hybrid launch -n 4 train`` (2 trainers + 2 parameter servers, tables
row-wise, DLRM with DDP bottom and FSDP top, sync, float32, a tiny model):

- **straight**: 20 steps, one checkpoint at the end;
- **crashed**: the same 20 steps with a checkpoint every 10, and server ps1 SIGKILLs itself while
  writing its shards of step 20 (injected by ``tests/support/inject/sitecustomize.py``);
- **tampered**: a copy of straight's checkpoint with pickled code planted in one file (the
  manifest fixed to match): resume and export refuse it (exit 2, one line), the code never runs;
  with the key straight was signed with, a rewritten manifest is refused;
- **resumed**: new processes, ``checkpoint.resume=latest`` in the crashed run's directory: it
  must pick step 10 and train steps 11..20 -- losses and every parameter equal to straight's.

Then the straight run's final checkpoint is loaded by jobs of other shapes (1 trainer / 1 server
row-wise, 3 trainers / 2 servers table-wise) through the training loop's own resume path, and
exported for the plain model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import (
    Checkpoint,
    CheckpointError,
    export,
    export_state_dict,
    load_export,
    latest,
    load_tables,
    read_manifest,
    verify,
)
from hybrid.checkpoint.files import KEY_ENV, MANIFEST, FileEntry
from tests.harness import run_distributed
from tests.support import tamper
from tests.support.cli import REPO, run_hybrid

STEPS = 20
PLAN, CONFIG = "conf/plans/dlrm.yaml", "conf/train/dlrm.yaml"
TINY = ["model.num_embeddings=60", "model.features=[C1,C2,C3,C4]", "model.embedding_dim=8", "model.bottom_mlp=[8,8]",
        "model.top_mlp=[8,1]", "data.batch_size=8", "data.eval_batches=1", "train.log_every=1", "train.eval_every=0",
        "train.plot=false", "train.progress=false", "train.tensorboard=false", "runtime.rpc_timeout_s=30",
        "runtime.heartbeat_s=1", "runtime.shutdown_timeout_s=20", f"train.steps={STEPS}"]
TWO_BY_TWO = "plan.topology.parameter_servers=2"
EBC = "sparse_arch.embedding_bag_collection"
LAUNCH_TIMEOUT = 300
KILL_ENV = {"HYBRID_TEST_CHECKPOINT_KILL": "ps1:20", "PYTHONPATH": f"{REPO / 'tests/support/inject'}:{REPO}"}
KEY = "test-signing-key"
pytestmark = pytest.mark.slow  # about 2.5 minutes on 2 idle cores (8 process groups started)


def _train(out: Path, *extra: str, env: dict[str, str] | None = None, nproc: int = 4):
    return run_hybrid(["launch", "-n", str(nproc), "train", "--plan", PLAN, "--config", CONFIG, *TINY, TWO_BY_TWO,
                       f"train.out_dir={out}", *extra], timeout=LAUNCH_TIMEOUT, env=env)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("straight")
    tmp = root / "tmp"
    tmp.mkdir()
    res = _train(root / "out", f"checkpoint.dir={root / 'ckpt'}", env={KEY_ENV: KEY, "TMPDIR": str(tmp)})  # signed
    assert res.returncode == 0, res.output
    assert not list(tmp.glob("torchelastic_*")), "a clean run left torchrun's log directory behind"
    return root


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    root = tmp_path_factory.mktemp("crashed")
    res = _train(root / "out", f"checkpoint.dir={root / 'ckpt'}", "checkpoint.every=10", env=KILL_ENV)
    return root, res


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(straight, crashed):
    root, res = crashed
    assert res.returncode != 0, res.output
    partial = root / "ckpt" / "step_00000020"
    assert partial.is_dir() and not (partial / "manifest.json").exists(), res.output
    assert any(partial.glob("tables/*/*/shard1-of-2.part*.pt")), "ps1 was killed before it wrote anything"
    assert latest(root / "ckpt") == root / "ckpt" / "step_00000010"
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        Checkpoint(partial)
    previous = read_manifest(root / "ckpt" / "step_00000010")
    for rel, e in previous["files"].items():  # every file of step 10 is intact
        verify(root / "ckpt" / "step_00000010", FileEntry(rel, e["size"], e["sha256"]))
    assert _losses(root / "out") == _losses(straight / "out")  # saving changed nothing in training


def test_resume_latest_continues_bit_for_bit(straight, crashed, tmp_path):
    root = tmp_path / "crashed"
    shutil.copytree(crashed[0] / "ckpt", root / "ckpt")  # leave the crashed run's files to the crash test
    out = tmp_path / "resumed"
    res = _train(out, f"checkpoint.dir={root / 'ckpt'}", "checkpoint.every=10", "checkpoint.resume=latest")
    assert res.returncode == 0, res.output
    assert "resuming at step 10 from" in res.stderr, res.output
    got, want = _losses(out), _losses(straight / "out")
    assert sorted(got) == list(range(11, STEPS + 1))
    assert got == {s: want[s] for s in got}  # float equality: bit for bit
    exported = tmp_path / "resumed.pt"
    cli = run_hybrid(["export", str(root / "ckpt"), str(exported)], timeout=120)
    assert cli.returncode == 0 and "(step 20)" in cli.stdout, cli.output
    _assert_same_state(torch.load(exported, weights_only=True), export_state_dict(straight / "ckpt" / "step_00000020"))
    mine, ref = load_tables(root / "ckpt" / "step_00000020"), load_tables(straight / "ckpt" / "step_00000020")
    for key, (w, state) in ref.items():  # the servers' optimizer state too
        assert torch.equal(mine[key][0], w) and all(torch.equal(mine[key][1][k], v) for k, v in state.items()), key


def _load_job(rank, world_size, *, num_servers, ckpt, overrides, out):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hybrid.checkpoint import dense_only
    from hybrid.ps.client import pipeline_of
    from hybrid.launch.roles import role_of
    from hybrid.train.loop import build_trainer, load_run, remote_collections

    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    plan, cfg, _, resolved = load_run(str(REPO / PLAN), str(REPO / CONFIG),
                                      [*TINY, *overrides, f"checkpoint.resume={ckpt}", f"train.out_dir={out}"],
                                      world_size)
    trainer = build_trainer(role, plan, cfg, resolved)
    batch = next(iter(trainer.eval_data))
    trainer.model.eval()
    with torch.no_grad():
        pred = trainer.task.forward(trainer.model, batch)  # answered only if the servers are at step 20
    with dense_only(trainer.model):
        dense = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    dist.barrier()
    if role.index != 0:
        return None
    (coll,) = remote_collections(trainer.model)
    weights, states = coll.read_tables(with_state=True)
    return {
        "pred": pred, "dense": dense, "tables": {t: (weights[t], states[t]) for t in weights},
        "inputs": (batch.dense, batch.sparse.keys(), batch.sparse.values(), batch.sparse.lengths()),
        "next_step": pipeline_of(trainer.model).next_step,
        "servers_at": {s: d["complete_through"] for s, d in coll.stats().items()},
        "layouts": {lay.sharding for lay in coll.layouts}, "trainers": role.num_trainers,
    }


SHAPES = {
    "1x1-row_wise": (2, 1, []),
    "3x2-table_wise": (5, 2, [f"plan.modules.{EBC}.sharding=table_wise"]),
}
_loaded: dict[str, dict] = {}


def _load_as(shape: str, straight: Path, tmp: Path) -> dict:
    if shape not in _loaded:
        world, servers, extra = SHAPES[shape]
        results = run_distributed(_load_job, world, setup="hybrid", num_servers=servers, timeout=240,
                                  ckpt=str(straight / "ckpt"), out=str(tmp / shape),
                                  overrides=[f"plan.topology.parameter_servers={servers}", *extra])
        _loaded[shape] = results[0]
    return _loaded[shape]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_checkpoint_of_2_trainers_2_servers_loads_at_another_shape(straight, tmp_path, shape):
    got = _load_as(shape, straight, tmp_path)
    world, servers, _ = SHAPES[shape]
    assert got["trainers"] == world - servers and got["layouts"] == {shape.split("-")[1]}
    saved = straight / "ckpt" / "step_00000020"
    for key, (w, state) in load_tables(saved).items():
        name = key.split(".")[-2]
        lw, lstate = got["tables"][name]
        assert torch.equal(lw, w), key  # row for row
        assert lstate.keys() == state.keys() and all(torch.equal(lstate[k], v) for k, v in state.items()), key
    ref = export_state_dict(saved)
    for key, v in got["dense"].items():
        assert torch.equal(v, ref[key]), key
    assert got["next_step"] == STEPS and set(got["servers_at"].values()) == {STEPS - 1}


def test_export_loads_into_the_plain_model_and_predicts_the_same(straight, tmp_path):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hybrid.train.loop import load_run

    out = tmp_path / "model.pt"
    res = run_hybrid(["export", str(straight / "ckpt"), str(out)], timeout=120)
    assert res.returncode == 0, res.output
    state = torch.load(out, weights_only=True)
    _, cfg, _, _ = load_run(str(REPO / PLAN), str(REPO / CONFIG), TINY, 2)
    plain = cfg.spec.make_model(cfg.model_kwargs)
    assert list(state) == list(plain.state_dict())  # the unsharded model's keys, in its order
    plain.load_state_dict(state)
    # Past part_bytes (here 1,000 bytes: 60-row tables of dim 8 in parts of 31 rows) the tables go
    # into files of their own, named in the index; read back, the same state dict.
    parts = export(straight / "ckpt", tmp_path / "parts" / "model.pt", part_bytes=1000)
    index = json.loads((tmp_path / "parts" / "model.pt.index.json").read_text())
    assert all([p["rows"] for p in ps] == [[0, 31], [31, 60]] for ps in index["tables"].values()), index
    assert len(parts["files"]) == 2 + 2 * len(index["tables"]) and parts["keys"] == list(state)
    _assert_same_state(load_export(tmp_path / "parts" / "model.pt"), state)
    got = _load_as("1x1-row_wise", straight, tmp_path)
    dense, keys, values, lengths = got["inputs"]
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    plain.eval()
    with torch.no_grad():
        pred = plain(dense, sparse).reshape(-1)
    torch.testing.assert_close(pred, got["pred"], rtol=1e-6, atol=1e-6)


def _plant(ckpt: Path, kind: str, marker: Path) -> None:
    """Pickled code in one file of checkpoint ``ckpt`` (sizes and checksums fixed to match)."""
    if kind == "dcp_byte_item":
        tamper.dcp_item(ckpt / "dense", "optim.param_groups.0.lr", marker)
    elif kind == "dcp_tensor_as_bytes":
        tamper.dcp_item(ckpt / "dense", _a_dense_weight(ckpt), marker)
    elif kind == "dcp_metadata":
        tamper.dcp_metadata(ckpt / "dense", marker)
    elif kind == "table_shard":
        tamper.torch_file(sorted(ckpt.glob("tables/*/*/shard0-of-2.part*.pt"))[0], marker)
    elif kind == "trainer_state":
        tamper.torch_file(ckpt / "trainers" / "trainer1.pt", marker)
    tamper.refresh_manifest(ckpt)


def _a_dense_weight(ckpt: Path) -> str:
    from hybrid.checkpoint.files import load_dcp_metadata

    names = sorted(k for k in load_dcp_metadata(ckpt / "dense" / ".metadata").state_dict_metadata
                   if k.startswith("model.") and k.endswith("weight"))
    return names[0]


def _error_lines(res) -> list[str]:
    return [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("error:")]


# Who reads the planted file on resume: a server (table shards), the second trainer (its own
# state), or every trainer (the dense part, through DCP). The dense part's reader is the same
# code in every trainer and in one process, so those cases resume in one process (a fourth of
# the processes to start); the others need the 2 x 2 job.
PLANTED = {"dcp_byte_item": 1, "dcp_tensor_as_bytes": 1, "dcp_metadata": 1, "table_shard": 4, "trainer_state": 4}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_planted_code_never_runs_on_resume_or_export(straight, tmp_path, kind):
    root = tmp_path / "ckpt"
    shutil.copytree(straight / "ckpt", root)
    ckpt = latest(root)
    marker = tmp_path / "pwned"
    _plant(ckpt, kind, marker)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = _train(tmp_path / "out", f"checkpoint.dir={root}", "checkpoint.resume=latest", env={"TMPDIR": str(tmp)},
                 nproc=PLANTED[kind])
    assert res.returncode == 2, res.output
    assert not list(tmp.glob("torchelastic_*")), "a failed run left torchrun's log directory behind"
    errors = _error_lines(res)
    assert len(errors) == 1 and ("weights_only=True" in errors[0] or "not allowed" in errors[0]), res.output
    assert "Traceback" not in res.output, res.output
    exported = run_hybrid(["export", str(root), str(tmp_path / "model.pt")], timeout=120)
    if kind in ("dcp_tensor_as_bytes", "dcp_metadata", "table_shard"):  # what export reads
        assert exported.returncode == 2 and len(_error_lines(exported)) == 1, exported.output
        assert "Traceback" not in exported.output, exported.output
    else:
        assert exported.returncode == 0, exported.output
    assert not marker.exists(), res.output


def test_with_the_key_a_rewritten_manifest_is_refused(straight, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(straight / "ckpt", root)
    ckpt = latest(root)
    assert "signature" in json.loads((ckpt / MANIFEST).read_text())
    ok = run_hybrid(["export", str(root), str(tmp_path / "a.pt")], timeout=120, env={KEY_ENV: KEY})
    assert ok.returncode == 0, ok.output
    shard = sorted(ckpt.glob("tables/*/*/shard0-of-2.part*.pt"))[0]
    data = torch.load(shard, weights_only=True)
    data["weight"] = torch.zeros_like(data["weight"])  # tensors only: nothing but the key can tell
    torch.save(data, shard)
    tamper.refresh_manifest(ckpt)
    for env in ({KEY_ENV: KEY}, {KEY_ENV: "another-key"}):
        res = run_hybrid(["export", str(root), str(tmp_path / "b.pt")], timeout=120, env=env)
        assert res.returncode == 2 and "does not verify" in res.stderr, res.output
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    res = _train(tmp_path / "out", f"checkpoint.dir={root}", "checkpoint.resume=latest",
                 f"checkpoint.key_file={key_file}")
    assert res.returncode == 2 and "Traceback" not in res.output, res.output
    assert len(_error_lines(res)) == 1 and "does not verify" in _error_lines(res)[0], res.output


def test_a_run_refuses_a_checkpoint_dir_it_would_overwrite_or_cannot_make(straight, tmp_path):
    """Before its first step, one line and exit 2: a run that does not resume, pointed at a
    checkpoint.dir holding another run's checkpoints (its saves would replace or prune them),
    changes none of their files; a checkpoint.dir, or a train.out_dir, that cannot be made (a
    file is in the way)."""
    root = tmp_path / "ckpt"
    shutil.copytree(straight / "ckpt", root)
    before = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))
    res = _train(tmp_path / "fresh", f"checkpoint.dir={root}", "checkpoint.every=10", nproc=1)
    errors = _error_lines(res)
    assert res.returncode == 2 and len(errors) == 1, res.output
    assert "of another run" in errors[0] and "checkpoint.resume=latest" in errors[0], res.output
    assert sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")) == before
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    res = _train(tmp_path / "blocked", f"checkpoint.dir={blocker / 'ckpt'}", nproc=1)
    errors = _error_lines(res)
    assert res.returncode == 2 and len(errors) == 1 and "cannot create it" in errors[0], res.output
    assert "Traceback" not in res.output and not (tmp_path / "blocked" / "metrics.jsonl").exists(), res.output
    res = _train(blocker / "out", nproc=1)  # train.out_dir under a file
    errors = _error_lines(res)
    assert res.returncode == 2 and errors == [f"error: train.out_dir {blocker / 'out'}: cannot create it "
                                              f"(Not a directory)"], res.output


def test_resuming_with_another_dense_optimizer_names_both(straight, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(straight / "ckpt", root)
    saved = read_manifest(latest(root), key=KEY.encode())["dense"]["optimizer_class"]
    other = "adam" if saved == "SGD" else "sgd"
    res = _train(tmp_path / "out", f"checkpoint.dir={root}", "checkpoint.resume=latest", f"train.optimizer={other}",
                 env={KEY_ENV: KEY}, nproc=1)
    errors = _error_lines(res)
    assert res.returncode == 2 and len(errors) == 1, res.output
    assert f"holds the state of dense optimizer {saved}; this run's is" in errors[0] and "train.optimizer" in errors[0], \
        res.output
