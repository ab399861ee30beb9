"""The coreset's pool pass in training (`runtime/modes/coreset_steps.py`): only the rows the
selection scores go forward; the rows of sources kept whole do not, and the rows chosen are
those a pass over the whole pool chooses."""

import copy
import warnings

import torch

from megatron_mllm.data.coreset import CoresetConfig, CoresetSelector
from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.job import (
    Collect,
    DataParts,
    ExecutorSettings,
    ModelParts,
    OptimizerSettings,
    PlanParts,
    RuntimeJob,
)
from megatron_mllm.runtime.modes.reference import make_full_state
from megatron_mllm.runtime.planning.schedules import pool_plan, runtime_plan

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
N, POOL = 4, 8  # the step's micro-batches (of 1) and the pool's (ratio 2)
PLAN = ParallelPlan(1, 1, 2)


def _whole_pool_rows(run, batches) -> list[int]:
    """The rows chosen after a forward pass over every pool row (before rows were skipped)."""
    from megatron_mllm.runtime.engine.step_types import PassKind

    coreset = run.coreset
    run.sync_params()
    executor = run.executor_for(
        coreset.pool_program,
        run.job.data.pool_schedule.meta,
        batches.__getitem__,
        kind=PassKind.POOL,
        ordered=run.pool_ordered,
    )
    executor.run_step()
    return coreset._share(coreset._pick(batches, executor.last_layer_inputs))


def _scored_and_whole(rank: int, world: int, job: RuntimeJob) -> list[tuple]:
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.executor_run import ExecutorRun

    run = ExecutorRun(rank, world, job, init_rank(rank, world, 0, 60))
    coreset, out = run.coreset, []
    for step in range(4):
        batches = coreset.pool_list(run.data.pool(step))
        state = copy.deepcopy(coreset.selector.state_dict())
        scored = coreset.pool_rows(batches)
        coreset.selector.load_state_dict(state)  # the same directions and moments again
        sources = [s for b in batches for s in b.sources]
        out.append((scored, _whole_pool_rows(run, batches), sources))
    return [*out, sorted(coreset._passes)]


def test_only_scored_rows_go_forward_and_the_choice_is_the_whole_pools():
    """PP=2 Optimus, ordered messages: on imbalanced pools (the synthetic classes), the pass
    forwards the scored rows' micro-batches only, and every stage gets the rows a pass over
    the whole pool would choose."""
    state = spawn(make_full_state, 1, TINY, 0)[0]
    step, _ = runtime_plan(TINY, PLAN, 1, N, "optimus")
    job = RuntimeJob(
        ModelParts(TINY, state),
        PlanParts(PLAN, schedule=step),
        DataParts(
            1,
            N,
            coreset=CoresetConfig(batch_size=N, pool_ratio=2, features="zo", seed=3),
            pool_schedule=pool_plan(step, TINY, PLAN, 1, POOL)[0],
        ),
        optimizer=OptimizerSettings(lr=1e-2),
        collect=Collect(grads=False),
        executor=ExecutorSettings(ordered_p2p=True),  # NCCL's matching by order
    )
    ranks = spawn(_scored_and_whole, 2, job)
    *steps, passes = ranks[0]
    assert ranks[1][-1] == passes and passes and all(0 < n < POOL for n in passes)
    for r, results in enumerate(ranks):
        for scored, whole, _ in results[:-1]:
            assert scored == whole and len(scored) == N, (r, scored, whole)
    # the rows that did not go forward (their sources kept whole) are all chosen
    selector = CoresetSelector(job.data.coreset)
    skipped = 0
    for scored, _, sources in steps:
        forwarded = set(selector.scored_rows(torch.tensor(sources)).tolist())
        whole = {i for i in range(len(sources)) if i not in forwarded}
        assert whole <= set(scored)
        skipped += len(whole)
    assert skipped > 0
