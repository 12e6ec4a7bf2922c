"""``--strategy fsdp2``: the model sharded over the workers with FSDP2, its checkpoints
sharded (every rank writes its part with torch.distributed.checkpoint).

One module-scoped set of runs of the built-in task on real Ray workers over gloo (fp32,
SGD, accumulation 2 on 2 workers with clipping on, an uneven validation split): DDP, and
FSDP2 uninterrupted; FSDP2 stopped at step 13 by ``--max-steps`` (inside epoch 2), then
continued on 2 workers (the same sharded checkpoint, the same run) and on 1 worker
(``--resume-from`` it: DCP reshards the 2 ranks' shards onto 1). The assertions share
them. The refusals and the sharding rules come first, without Ray. (Elsewhere, on runs
those modules make anyway: the char-LM example under FSDP2 against DDP in
test_example_char_lm, a Tune sweep whose trials write sharded checkpoints to S3 in
test_s3_storage.)

Tolerances: FSDP2 reduce-scatters gradients where DDP all-reduces them and clips by a
norm summed over shards, so DDP and FSDP2 need only agree to float rounding (measured: 0
on the built-in task, 2.5e-7 on the char LM). A resume at the same world size is
bit-identical; at 1 worker, the two micro-batches' gradients accumulate where the 2
ranks' were averaged, which stays at rounding (measured 7.5e-9; see tests/ledgers.py).
Run with -s to see the differences.
"""

from __future__ import annotations

import os

import pytest
import torch
from ledgers import max_difference
from torch import nn

from ray_ddp.checkpoint.format import (
    SHARDS,
    CheckpointError,
    check_strategy,
    load_model,
    load_state,
)
from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.worker.sharding import bf16_policy, default_blocks

TASK = "ray_ddp.image_classification:ImageClassification"

# 10 optimizer steps of 64 samples per epoch: 16 per micro-batch x 2 workers x 2, or
# x 1 worker x 4; the last step of each epoch is short, 48 samples in 3 micro-batches, so at
# 2 workers rank 1 has one where rank 0 has two (under FSDP2 it runs a weight-0 filler as
# its second: every forward and backward all-gathers, and a rank missing one would hang).
# Validation: 129 samples in batches of 32, so rank 0 has 3 batches and rank 1 two (FSDP2's
# forwards must still be run by both).
RUN = {
    "model": "small_cnn",
    "epochs": 2,
    "train_samples": 624,
    "val_samples": 129,
    "batch_size": 16,
    "accum_steps": 2,
    "optimizer": "sgd",
    "lr": 0.05,
    "grad_clip": 0.5,
    "seed": 7,
    "checkpoint_every": 5,
    "export": False,
    "tensorboard": False,
    "progress_interval_s": 0,
}


# ------------------------------------------------------------------ without Ray
@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"amp": "fp16"}, "--amp fp16 needs a GradScaler that knows sharded gradients"),
        ({"compile": True}, "--compile is not supported with --strategy fsdp2 yet"),
    ],
)
def test_what_fsdp2_cannot_run_with_is_refused_in_one_line(flags, words):
    with pytest.raises(ConfigError, match=words):
        validate(TrainConfig(strategy="fsdp2", **flags))
    validate(TrainConfig(strategy="fsdp2", amp="bf16"))
    with pytest.raises(ConfigError, match="unknown --strategy .fsdp.; choose one of: ddp, fsdp2"):
        validate(TrainConfig(strategy="fsdp"))


def test_a_checkpoint_resumes_only_under_the_strategy_that_wrote_it():
    with pytest.raises(CheckpointError, match="saved with --strategy fsdp2, this run has"):
        check_strategy({"sharded": "dcp"}, "ddp", "ckpt")
    with pytest.raises(CheckpointError, match="saved with --strategy ddp, this run has"):
        check_strategy({"model": {}}, "fsdp2", "ckpt")
    check_strategy({"sharded": "dcp"}, "fsdp2", "ckpt")


def test_the_default_blocks_are_the_items_of_the_outermost_containers():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
            self.norm = nn.LayerNorm(8)

    net = Net()
    assert default_blocks(net) == list(net.layers)  # not the Linears inside them
    flat = nn.Module()
    flat.a, flat.act, flat.b = nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)
    assert default_blocks(flat) == [flat.a, flat.b]  # children that hold parameters
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert default_blocks(seq) == [seq[0], seq[2]]


def test_bf16_is_fsdp2s_precision_policy_except_with_batchnorm():
    plain = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert bf16_policy(plain, "bf16") and not bf16_policy(plain, "off")
    assert not bf16_policy(nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1)), "bf16")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_reads_into_a_plain_model_and_a_lost_shard_is_named(tmp_path):
    """A DCP checkpoint of one process (no process group) stands in for the workers'."""
    import torch.distributed.checkpoint as dcp

    from ray_ddp.checkpoint.format import FORMAT_VERSION, full_model_state, write_state

    torch.manual_seed(0)
    trained, fresh = nn.Linear(3, 2), nn.Linear(3, 2)
    dcp.save({"model": trained.state_dict()}, checkpoint_id=str(tmp_path / SHARDS), no_dist=True)
    write_state(str(tmp_path), {"format_version": FORMAT_VERSION, "sharded": "dcp"})
    state = load_state(str(tmp_path))
    read = full_model_state(str(tmp_path), state, fresh)
    assert all(torch.equal(read[k], v) for k, v in trained.state_dict().items())
    os.remove(tmp_path / SHARDS / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="lacks __0_0.distcp: a rank's shard is lost"):
        load_state(str(tmp_path))


@pytest.fixture
def one_rank_group():
    """A real process group of this process alone (gloo on 127.0.0.1): FSDP2 needs one."""
    import torch.distributed as dist
    from ports import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_resume_without_the_optimizer_leaves_it_fresh(one_rank_group, tmp_path):
    """What a resume with another ``--optimizer`` kind does under FSDP2: the saved weights
    read into the shards, the new optimizer untouched (no state: torch's
    ``get_state_dict(model, optimizer)`` would have stepped it once on zero gradients,
    AdamW's then at step 1 with zero moments). The same kind reads its state back."""
    from ray_ddp.worker.sharding import load_shards, save_shards, shard_model

    def sharded() -> nn.Module:
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        return shard_model(net, [net[0], net[2]], "off", torch.device("cpu"), world_size=1)

    torch.manual_seed(0)
    trained, fresh = sharded(), sharded()
    sgd = torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9)
    trained(torch.randn(3, 4)).sum().backward()
    sgd.step()
    save_shards(str(tmp_path), trained, sgd)

    def full(net: nn.Module) -> list[torch.Tensor]:
        return [p.full_tensor() for p in net.parameters()]

    def momenta(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [
            opt.state[p]["momentum_buffer"].full_tensor() for p in opt.param_groups[0]["params"]
        ]

    assert not all(map(torch.equal, full(trained), full(fresh)))
    adamw = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_shards(str(tmp_path), fresh, adamw, with_optimizer=False)
    steps = [float(state["step"]) for state in adamw.state.values()]
    assert steps == [] and all(p.grad is None for p in fresh.parameters()), steps
    assert all(map(torch.equal, full(trained), full(fresh)))
    again = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    load_shards(str(tmp_path), fresh, again, with_optimizer=True)
    assert all(map(torch.equal, momenta(sgd), momenta(again)))


# ------------------------------------------------------------------ on Ray
@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    from ray_ddp.driver.run import fit

    storage = str(tmp_path_factory.mktemp("fsdp2"))

    def run(name, **more):
        return fit(TASK, storage_path=storage, name=name, **{**RUN, **more})

    out = {
        "ddp": run("ddp", num_workers=2),
        "fsdp": run("fsdp", num_workers=2, strategy="fsdp2", export=True),
        "stopped": run("again", num_workers=2, strategy="fsdp2", max_steps=13),
    }
    stopped = out["stopped"]["latest_checkpoint"]
    out["stopped_state"] = load_state(stopped)
    out["stopped_files"] = sorted(os.listdir(os.path.join(stopped, SHARDS)))
    # On 1 worker from the 2 workers' shards (before the re-run below adds checkpoints
    # and Ray may remove this one).
    out["one"] = run("one", num_workers=1, strategy="fsdp2", resume_from=stopped)
    out["again"] = run("again", num_workers=2, strategy="fsdp2")
    return out


def weights(summary):
    return load_model(summary["latest_checkpoint"]).state_dict()


@pytest.mark.ray
def test_fsdp2_trains_as_ddp_does(runs):
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    assert "model" in load_state(ddp["latest_checkpoint"])  # DDP's checkpoint is unchanged
    for a, b in zip(ddp["history"], fsdp["history"], strict=True):
        for key in ("train_loss", "val_loss", "val_acc"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a, b)
    # The uneven validation split (rank 0: 3 batches, rank 1: 2) counted every sample once.
    assert fsdp["final"]["evaluated_samples"] == RUN["val_samples"]
    difference = max_difference(weights(ddp), weights(fsdp))
    print(f"largest weight difference, DDP and FSDP2: {difference:.3g}")  # with pytest -s
    assert difference < 1e-5, difference


@pytest.mark.ray
def test_a_sharded_checkpoint_has_every_ranks_shard_and_no_whole_model(runs):
    state = runs["stopped_state"]
    assert state["sharded"] == "dcp" and "model" not in state and "optimizer" not in state
    assert state["progress"]["step"] == 13 and state["world_size"] == 2
    assert runs["stopped_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.ray
def test_a_sharded_checkpoint_resumes_bit_identically_on_the_same_workers(runs):
    assert [row["epoch"] for row in runs["again"]["history"]] == [2]  # resumed inside it
    again, fsdp = weights(runs["again"]), weights(runs["fsdp"])
    assert all(torch.equal(again[k], fsdp[k]) for k in fsdp), max_difference(again, fsdp)
    assert runs["again"]["history"][-1]["train_loss"] == runs["fsdp"]["history"][-1]["train_loss"]


@pytest.mark.ray
def test_a_sharded_checkpoint_resumes_resharded_on_one_worker(runs):
    one, fsdp = runs["one"], runs["fsdp"]
    assert one["world_size"] == 1 and one["global_batch_size"] == 64
    assert [(row["epoch"], row["accum_steps"]) for row in one["history"]] == [(2, 4)]
    difference = max_difference(weights(one), weights(fsdp))
    print(f"largest weight difference, resharded on 1 worker: {difference:.3g}")
    assert difference < 1e-6, difference
    assert one["history"][-1]["val_loss"] == pytest.approx(
        fsdp["history"][-1]["val_loss"], rel=1e-6
    )


@pytest.mark.ray
def test_a_resume_with_another_optimizer_starts_it_fresh_under_both_strategies(
    runs, tmp_path, capsys
):
    """DDP's and FSDP2's checkpoints of step 20 (SGD), each resumed with ``--optimizer
    adamw`` for 3 steps: both AdamWs start from nothing, so the weights still agree to
    rounding, and both runs say so in their resume line. (FSDP2's once started at step 1
    with zero moments, its first step 0.74 of the size: 6e-4 apart here.) Two fits."""
    from ray_ddp.driver.run import fit

    switched = {**RUN, "optimizer": "adamw", "lr": 1e-3, "epochs": 3, "max_steps": 23}
    capsys.readouterr()
    resumed = {
        strategy: fit(
            TASK,
            storage_path=str(tmp_path),
            name=f"adamw-{strategy}",
            num_workers=2,
            strategy=strategy,
            resume_from=runs[source]["latest_checkpoint"],
            **switched,
        )
        for strategy, source in (("ddp", "ddp"), ("fsdp2", "fsdp"))
    }
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "resumed from" in ln]
    assert len(lines) == 2, lines
    assert all("optimizer sgd -> adamw: its state starts fresh" in ln for ln in lines), lines
    state = load_state(resumed["ddp"]["latest_checkpoint"])
    assert state["progress"]["step"] == 23
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {3.0}
    difference = max_difference(weights(resumed["ddp"]), weights(resumed["fsdp2"]))
    print(f"largest weight difference after the switch to AdamW: {difference:.3g}")
    assert difference < 1e-5, difference


@pytest.mark.ray
def test_evaluate_and_export_read_a_sharded_checkpoint(runs, s3):
    """Export reads the shards into one plain model. ``jobs/evaluate.py`` evaluates them
    sharded, as training validated them: on 2 workers, each reading the slices it holds
    from its own download of the checkpoint (here on S3), and holding half the model."""
    import s3server

    from ray_ddp.driver.evaluate import results_text, run_evaluation
    from ray_ddp.io import storage

    fsdp = runs["fsdp"]
    assert os.path.exists(fsdp["export"]["state_dict"])  # exported from the shards
    exported = torch.load(fsdp["export"]["state_dict"], weights_only=True)
    best = load_model(fsdp["best"]["checkpoint"]).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in best.items())
    uri = f"s3://{s3server.BUCKET}/fsdp2/{os.path.basename(fsdp['latest_checkpoint'])}"
    storage.upload_dir(fsdp["latest_checkpoint"], uri)
    results = run_evaluation(uri, "val", {"num_workers": 2}, predictions_path=None)
    assert results["samples"] == RUN["val_samples"]
    assert results["metrics"]["loss"] == pytest.approx(fsdp["history"][-1]["val_loss"], rel=1e-6)
    # The small CNN has no buffers: its parameters are split between the two, none twice.
    whole, held = results["model_bytes"], results["held_bytes"]
    assert whole == sum(p.numel() * p.element_size() for p in best.values())
    assert len(held) == 2 and sum(held) == whole and max(held) < 0.6 * whole, (held, whole)
    assert "sharded (FSDP2): the workers held " in results_text(results)
