"""A sequence model composed from a plan: a torchrec ``EmbeddingCollection`` (item histories,
row-wise, Adam) and a plain ``nn.Embedding`` with ``padding_idx`` (actions, table-wise, row-wise
Adagrad) on 2 parameter servers, a DDP head, 2 trainers. Trained 8 sync steps it equals one
process training the plain model on the global batch (losses, every parameter, every table row);
then a checkpoint saved by the job restores into a second composed model with the same state,
and its export holds the unsharded model's keys -- the tables' whole.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

import hybrid
from hybrid.checkpoint import Checkpoint, export_state_dict, save
from hybrid.launch.roles import role_of
from hybrid.plan import plan_from_dict
from tests.harness import run_distributed
from tests.support.sparse import ReferenceSparseOptimizer, kjt_slice

STEPS, B, L, DIM = 8, 4, 6, 8
ITEMS, CATS, ACTIONS = 60, 9, 5
DENSE_LR, ITEM_LR, ACTION_LR = 0.2, 0.05, 0.1


class SeqModel(nn.Module):
    """Item history (truncated to ``L``) plus each position's action, a category, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        meta = torch.device("meta")
        self.items = EmbeddingCollection(tables=[
            EmbeddingConfig(name="item", embedding_dim=DIM, num_embeddings=ITEMS, feature_names=["hist"]),
            EmbeddingConfig(name="cats", embedding_dim=DIM, num_embeddings=CATS, feature_names=["cat"]),
        ], device=meta)
        self.actions = nn.Embedding(ACTIONS, DIM, padding_idx=0, device=meta)
        self.head = nn.Linear(DIM, 1, device=meta)

    def forward(self, kjt, actions: torch.Tensor) -> torch.Tensor:
        jts = self.items(kjt)
        hist = jts["hist"].to_padded_dense(desired_length=L)  # longer histories are cut here
        cat = jts["cat"].to_padded_dense(desired_length=1).squeeze(1)
        x = torch.tanh(hist + self.actions(actions)).mean(1) + cat
        return self.head(x).squeeze(1)


PLAN = {
    "items": {"strategy": "parameter_server", "sharding": "row_wise", "optimizer": {"name": "adam", "lr": ITEM_LR}},
    "actions": {"strategy": "parameter_server", "sharding": "table_wise",
                "optimizer": {"name": "rowwise_adagrad", "lr": ACTION_LR}},
    "head": {"strategy": "ddp"},
}


def plain_model() -> SeqModel:
    """The one-process twin: every table filled as the servers fill theirs."""
    model = SeqModel()
    hybrid.init_tables(model.actions, seed=0, path="actions")
    return hybrid.materialize(model, seed=0)


def global_data(step: int, n: int):
    g = torch.Generator().manual_seed(900 + step)
    hist_len = torch.randint(0, L + 1, (n,), generator=g)
    hist_len[step % n] = 3 * L  # longer than the model reads
    hist_len[(step + 1) % n] = 0  # an empty history
    cat_len = torch.randint(0, 2, (n,), generator=g)
    data = {"hist": (hist_len, torch.randint(0, ITEMS, (int(hist_len.sum()),), generator=g), None),
            "cat": (cat_len, torch.randint(0, CATS, (int(cat_len.sum()),), generator=g), None)}
    actions = torch.randint(0, ACTIONS, (n, L), generator=g)  # 0 is the padding action
    labels = torch.randint(0, 2, (n,), generator=g).float()
    return data, actions, labels


def _touched(ids: torch.Tensor, rows: int, skip: int | None = None) -> torch.Tensor:
    mask = torch.zeros(rows, dtype=torch.bool)
    mask[ids.reshape(-1)] = True
    if skip is not None:
        mask[skip] = False
    return mask


def _job(rank, world_size, *, num_servers, root):
    role = role_of(rank, world_size, num_servers)
    if not role.is_trainer:
        return None
    t_n, me = role.num_trainers, role.index
    plan = plan_from_dict({"world_size": world_size, "topology": {"parameter_servers": num_servers}, "modules": PLAN})
    model = hybrid.compose(SeqModel(), plan, role=role, seed=0)
    ref = plain_model()
    assert list(model.state_dict()) == list(ref.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=DENSE_LR)
    ref_opt = torch.optim.SGD(ref.head.parameters(), lr=DENSE_LR)
    tables = {"item": ref.items.embeddings["item"].weight, "cats": ref.items.embeddings["cats"].weight,
              "actions": ref.actions.weight}
    sparse = {"item": ReferenceSparseOptimizer("adam", tables["item"].data, lr=ITEM_LR),
              "cats": ReferenceSparseOptimizer("adam", tables["cats"].data, lr=ITEM_LR),
              "actions": ReferenceSparseOptimizer("rowwise_adagrad", tables["actions"].data, lr=ACTION_LR)}
    losses, ref_losses = [], []
    for s in range(STEPS):
        data, actions, labels = global_data(s, t_n * B)
        lo, hi = me * B, (me + 1) * B
        with hybrid.step(model, optimizer) as st:
            loss = F.binary_cross_entropy_with_logits(model(kjt_slice(data, lo, hi), actions[lo:hi]), labels[lo:hi])
            st.backward(loss)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / t_n)
        ref_opt.zero_grad()
        for w in tables.values():
            w.grad = None
        ref_loss = F.binary_cross_entropy_with_logits(ref(kjt_slice(data, 0, t_n * B), actions), labels)
        ref_loss.backward()
        ref_opt.step()
        sparse["item"].step(tables["item"].grad, _touched(data["hist"][1], ITEMS))
        sparse["cats"].step(tables["cats"].grad, _touched(data["cat"][1], CATS))
        sparse["actions"].step(tables["actions"].grad, _touched(actions, ACTIONS, skip=0))
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    got, want = model.state_dict(), ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
    init = plain_model().state_dict()
    for k in want:
        assert not torch.equal(got[k], init[k]), f"{k} did not train"
    assert not got["actions.weight"][0].any()  # the padding row: zero, never updated

    ckpt = save(root, STEPS, model, optimizer)
    # A second model of the same plan (its own tables on the servers) restores the checkpoint.
    ckpt_obj = Checkpoint(ckpt)
    again = hybrid.compose(SeqModel(), plan, role=role, name="again", seed=1, start_step=ckpt_obj.step)
    opt2 = torch.optim.SGD(again.parameters(), lr=DENSE_LR)
    ckpt_obj.restore(again, opt2)
    restored = again.state_dict()
    for k in want:
        assert torch.equal(restored[k], got[k]), k
    dist.barrier()
    if me != 0:
        return None
    exported = export_state_dict(ckpt)
    assert list(exported) == list(want)
    for k in want:
        assert torch.equal(exported[k], got[k]), k
    # The optimizer state came back too: the servers hold Adam's moments of the item rows.
    (coll,) = [m for m in again.modules() if type(m).__name__ == "RemoteEmbeddingCollection"][:1]
    _, states = coll.read_tables(with_state=True)
    torch.testing.assert_close(states["item"]["exp_avg"], sparse["item"].state["exp_avg"], rtol=1e-5, atol=1e-6)
    return {"losses": losses}


def test_sequence_model_trains_as_one_process_and_checkpoints(tmp_path):
    out = run_distributed(_job, 4, setup="hybrid", num_servers=2, timeout=240, root=str(tmp_path / "ckpt"))
    losses = out[0]["losses"]
    assert len(losses) == STEPS and losses[-1] != losses[0]
