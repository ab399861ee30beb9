"""A rank's start and what every run mode does on a device, checked on the CPU: megatron-core's
seeding as a CUDA rank runs it, process groups created in the same order on every rank, and no
tensor made by our code without an explicit device (what a GPU would reject)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.bootstrap import backend_for
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.job import (
    DataParts,
    ExecutorSettings,
    ModelParts,
    OptimizerSettings,
    PlanParts,
    RuntimeJob,
    encoder_plan_of,
)
from megatron_mllm.runtime.modes.reference import make_full_state
from megatron_mllm.runtime.planning.schedules import runtime_schedule

N = 4


def _upstream_seeding(rank: int, world: int, explicit: bool) -> dict:
    """megatron-core's own `model_parallel_cuda_manual_seed` (no CPU seeding patch), as every
    CUDA rank runs it; only its RNG tracker keeps states on the CPU generator."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import random as mc_random
    from megatron_mllm_patches.cpu_rng_tracker import CPURNGStatesTracker

    from megatron_mllm.runtime.assembly.bootstrap import seed_model_parallel

    dist.init_process_group("gloo", rank=rank, world_size=world)
    assert mc_random.model_parallel_cuda_manual_seed.__module__ == mc_random.__name__
    mc_random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if explicit:
        seed_model_parallel(7)
    else:  # what the runtime called before: no expert-parallel ranks
        mc_random.model_parallel_cuda_manual_seed(7, tp_rank=0)
    return {"names": sorted(mc_random.get_cuda_rng_tracker().get_states())}


def _first_weights(rank: int, world: int, upstream: bool) -> dict:
    """Initial weights after seeding with 7: megatron-core's own seeding (every CUDA rank's
    path) or the CPU patch's (init_rank on CPU)."""
    from megatron_mllm.models.weights import full_state
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import build_full_model

    if upstream:
        from megatron_mllm_patches import cuda_device_on_cpu

        cuda_device_on_cpu.apply()  # a CUDA rank has a current device; this machine has not
        _upstream_seeding(rank, world, True)
    else:
        init_rank(rank, world, 7, 60)
    state = full_state(*build_full_model(TINY).modules)
    return {k: state[k] for k in sorted(state)[:6]}


def test_one_seed_gives_the_same_initial_weights_on_the_gpu_and_the_cpu_path():
    (gpu_path,) = spawn(_first_weights, 1, True)
    (cpu_path,) = spawn(_first_weights, 1, False)
    assert gpu_path.keys() == cpu_path.keys()
    for name, tensor in gpu_path.items():
        assert torch.equal(tensor, cpu_path[name]), name


def test_seeding_runs_megatron_cores_unpatched_path():
    (out,) = spawn(_upstream_seeding, 1, True)
    assert len(out["names"]) == 3  # data-parallel, model-parallel and expert streams
    with pytest.raises(Exception, match="expert|parallel|None"):
        spawn(_upstream_seeding, 1, False)  # the old call dies on every CUDA rank


def test_backend_serves_cpu_and_cuda_tensors():
    assert backend_for(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("cpu")) == "gloo"


def _group_order(rank: int, world: int, job: RuntimeJob) -> list[tuple[int, ...]]:
    """Every new_group this rank makes while building the executor's run, in order."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.executor_run import ExecutorRun

    device = init_rank(rank, world, job.data.seed, job.timeout_s)
    made, original = [], distributed_c10d.new_group

    def recording(ranks=None, *args, **kwargs):
        made.append(tuple(sorted(ranks)) if ranks is not None else ())
        return original(ranks, *args, **kwargs)

    distributed_c10d.new_group = dist.new_group = recording
    try:
        ExecutorRun(rank, world, job, device)
    finally:
        distributed_c10d.new_group = dist.new_group = original
    return made


@pytest.mark.parametrize(
    "ordered", [pytest.param(False, marks=pytest.mark.slow), True], ids=["tagged", "ordered"]
)  # ordered (NCCL's way) creates every group the tagged run does, and one per direction
def test_process_groups_are_created_in_one_order_on_every_rank(ordered):
    """NCCL builds a communicator per group as it is created (device-bound default group):
    every rank must create the same groups in the same order, or they block each other."""
    plan = ParallelPlan(1, 1, 2)
    schedule = runtime_schedule(TINY, plan, 1, N, "optimus", encoder_plan=ParallelPlan(2, 1, 1))
    job = RuntimeJob(
        ModelParts(TINY, {}),
        PlanParts(plan, schedule=schedule),
        DataParts(1, N),
        executor=ExecutorSettings(ordered_p2p=ordered),
    )
    job = _with_state(job)
    orders = spawn(_group_order, 2, job)
    assert orders[0] == orders[1] and len(orders[0]) > 4
    if ordered:  # one group per message direction, both directions present
        assert orders[0].count((0, 1)) >= 2


_STATE: dict = {}


def _with_state(job: RuntimeJob) -> RuntimeJob:
    if "tiny" not in _STATE:
        _STATE["tiny"] = spawn(make_full_state, 1, TINY, 0)[0]
    return replace(job, model=replace(job.model, weights=_STATE["tiny"]))


def _guarded_steps(rank: int, world: int, job: RuntimeJob) -> list[str]:
    """Build the run, then one step (with clipping and the optimizer), the coreset's selection
    and broadcast where configured, and the training loop's loss reduction, under the guard."""
    from device_guard import ExplicitDevices

    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.runs import make_run

    device = init_rank(rank, world, job.data.seed, job.timeout_s)
    run = make_run(rank, world, job, device)
    guard = ExplicitDevices(strict=False)  # collect them all, for one clear assertion
    with guard:
        run.step(0)  # the executor's includes the loss reduction
    return guard.violations


@pytest.mark.parametrize(
    "mode",
    ["executor", pytest.param("reference", marks=pytest.mark.slow),
     pytest.param("megatron_core", marks=pytest.mark.slow), "coreset"],
)  # fmt: skip
def test_no_tensor_is_made_without_a_device(mode):
    """The class of bug a CPU machine cannot see: a factory without `device=` in our code."""
    from megatron_mllm.data.coreset import CoresetConfig

    plan = ParallelPlan(1, 1, 2) if mode != "reference" else ParallelPlan(1, 1, 1)
    schedule = runtime_schedule(TINY, plan, 1, N, "optimus")
    data = DataParts(1, N)
    if mode == "coreset":
        enc_plan = encoder_plan_of(schedule, plan)[0]  # the pool runs on the same modules
        pool = runtime_schedule(TINY, plan, 1, 2 * N, "optimus", encoder_plan=enc_plan)
        data = DataParts(1, N, coreset=CoresetConfig(batch_size=N, features="exact"))
        data = replace(data, pool_schedule=pool)
    job = RuntimeJob(
        ModelParts(TINY, {}),
        PlanParts(plan, schedule),
        data,
        mode="executor" if mode == "coreset" else mode,
        optimizer=OptimizerSettings(lr=1e-2, clip_grad=0.5),
    )
    job = _with_state(job)
    violations = sorted({v for out in spawn(_guarded_steps, plan.world_size, job) for v in out})
    assert violations == []


def test_the_message_mode_knows_composite_backends():
    """A GPU rank's group is "cpu:gloo,cuda:nccl": its tensors go over NCCL, which has no tags,
    so the executor orders its messages (and megatron-core's baseline batches them)."""
    from megatron_mllm.runtime.assembly.bootstrap import backend_for, nccl_messages

    assert nccl_messages(backend_for(torch.device("cuda", 0)))
    assert nccl_messages("nccl") and nccl_messages("cuda:nccl,cpu:gloo")
    assert not nccl_messages("gloo") and not nccl_messages("cpu:gloo")
    assert not nccl_messages(backend_for(torch.device("cpu")))


def _fails_deep(rank: int, world: int) -> None:
    def inner():
        raise ValueError(f"rank {rank} broke here")

    inner()


def test_a_failed_ranks_traceback_is_kept():
    from megatron_mllm.runtime.assembly.launch import RankFailed, spawn

    with pytest.raises(RankFailed) as err:
        spawn(_fails_deep, 2)
    assert "\n" not in str(err.value) and "ValueError: rank 0 broke here" in str(err.value)
    for rank in (0, 1):
        report = err.value.tracebacks[rank]
        assert "Traceback" in report and "in inner" in report and "_fails_deep" in report


def _exchange_groups(rank, world):
    import torch.distributed as dist

    from megatron_mllm.runtime.assembly.bootstrap import init_rank, partition_subgroups
    from megatron_mllm.runtime.inputs.sample_exchange import dp_exchange_group

    init_rank(rank, world, 0, 60)
    try:
        partition_subgroups([[0, 1], [1, 2, 3]], backend="gloo")
        refused = ""
    except ValueError as err:
        refused = str(err)
    group = dp_exchange_group(ParallelPlan(2, 1, 2), rank)  # DP 2 x PP 2
    out = {"refused": refused, "mine": dist.get_process_group_ranks(group)}
    dist.destroy_process_group()
    return out


def test_gloo_subgroups_are_a_partition_created_on_every_rank():
    """Under a GPU-bound default group a rank outside a new gloo group still joins an NCCL
    split that its members skip: such groups are made as a partition of the world, in one
    enumeration on every rank, and anything else is refused before a group is created."""
    outs = spawn(_exchange_groups, 4)
    assert all("do not partition the 4 ranks" in o["refused"] for o in outs), outs
    from megatron_mllm.parallel.groups import backbone_rank

    plan = ParallelPlan(2, 1, 2)
    for rank, out in enumerate(outs):
        stage = next(s for s in range(2) if rank in [backbone_rank(plan, 0, d, s) for d in (0, 1)])
        assert out["mine"] == [backbone_rank(plan, 0, d, stage) for d in (0, 1)]
