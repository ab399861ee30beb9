import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mllm.data.coreset import (
    CoresetConfig,
    CoresetSelector,
    LossReplay,
    exact_features,
    facility_location,
    facility_location_brute_force,
    resolve_block,
    source_budgets,
    zeroth_order_features,
)
from megatron_mllm.errors import ConfigError


def linear_ce(hidden, targets, block):
    """A last layer: logits = hidden @ block.T, per-example cross entropy."""
    return torch.nn.functional.cross_entropy(hidden @ block.T, targets, reduction="none")


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 24), st.integers(1, 6), st.integers(1, 24), st.integers(0, 10_000))
def test_lazy_greedy_equals_brute_force(n, d, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (n, d), generator=g).double()  # integer grid: many exact ties
    assert facility_location(x, k) == facility_location_brute_force(x, k)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=4, max_size=64), st.data())
def test_budgets_sum_to_b_and_small_sources_stay_whole(ids, data):
    ids = torch.tensor(ids)
    b = data.draw(st.integers(1, len(ids)))
    budgets = source_budgets(ids, b)
    assert sum(budgets.values()) == b
    counts = {int(s): int((ids == s).sum()) for s in ids.unique()}
    assert all(0 <= budgets[s] <= counts[s] for s in counts)
    mean = len(ids) / len(counts)
    small = {s: c for s, c in counts.items() if c < mean}
    if sum(small.values()) <= b:
        assert all(budgets[s] == c for s, c in small.items())


def test_selection_keeps_small_sources_and_returns_b():
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([0] * 20 + [1] * 14 + [2] * 3 + [3] * 2 + [4] * 1)
    hidden, block = torch.randn(40, 8, generator=g), torch.randn(5, 8, generator=g)
    targets = torch.randint(0, 5, (40,), generator=g)
    sel = CoresetSelector(CoresetConfig(batch_size=20))
    idx = sel.select(ids, linear_ce, hidden, targets, block)
    assert len(idx) == 20 and len(set(idx.tolist())) == 20
    for s in (2, 3, 4):
        assert set((ids == s).nonzero().squeeze(1).tolist()) <= set(idx.tolist())


def test_zeroth_order_approaches_the_directional_derivative():
    g = torch.Generator().manual_seed(1)
    hidden, block = torch.randn(6, 5, generator=g).double(), torch.randn(4, 5, generator=g).double()
    targets = torch.randint(0, 4, (6,), generator=g)
    exact = exact_features(linear_ce, hidden, targets, block)  # [n, 20]
    errors = []
    for eps in (1e-1, 1e-2, 1e-3, 1e-4):
        gen = torch.Generator().manual_seed(7)
        zo = zeroth_order_features(LossReplay(linear_ce), hidden, targets, block, 16, eps, gen)
        gen = torch.Generator().manual_seed(7)
        dirs = torch.randn((16, *block.shape), generator=gen, dtype=block.dtype)
        dirs = dirs.reshape(16, -1).T
        errors.append((zo - exact @ dirs).abs().max().item())
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-6  # O(eps^2)


def test_fresh_directions_every_step():
    g = torch.Generator().manual_seed(2)
    hidden, block = torch.randn(10, 5, generator=g), torch.randn(3, 5, generator=g)
    targets = torch.randint(0, 3, (10,), generator=g)
    sel = CoresetSelector(CoresetConfig(batch_size=4))
    a = sel.features(linear_ce, hidden, targets, block)
    b = sel.features(linear_ce, hidden, targets, block)
    assert not torch.allclose(a, b)  # not one fixed direction for the whole run


def test_resumed_run_selects_identically():
    g = torch.Generator().manual_seed(3)
    pools = [
        (
            torch.randint(0, 3, (32,), generator=g),
            torch.randn(32, 6, generator=g),
            torch.randint(0, 4, (32,), generator=g),
        )
        for _ in range(4)
    ]
    block = torch.randn(4, 6, generator=g)
    config = CoresetConfig(batch_size=16, seed=5)
    straight = CoresetSelector(config)
    picks = [straight.select(ids, linear_ce, h, t, block) for ids, h, t in pools]
    first = CoresetSelector(config)
    first.select(*pools[0][:1], linear_ce, *pools[0][1:], block)
    state = first.state_dict()
    resumed = CoresetSelector(config)
    resumed.load_state_dict(state)
    for (ids, h, t), expected in zip(pools[1:], picks[1:], strict=True):
        assert torch.equal(resumed.select(ids, linear_ce, h, t, block), expected)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(batch_size=4, pool_ratio=0.5), "must be between 1 and 64"),
        (dict(batch_size=4, pool_ratio=float("nan")), "must be between 1 and 64"),
        (dict(batch_size=4, pool_ratio=1e9), "must be between 1 and 64"),
        (dict(batch_size=4, num_directions=4), "at least 16"),
        (dict(batch_size=4, features="magic"), "use zo or exact"),
    ],
)
def test_bad_configuration(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        CoresetConfig(**kwargs)


def test_bad_pool_and_block():
    with pytest.raises(ConfigError, match="smaller than the batch"):
        source_budgets(torch.tensor([0, 1]), 3)
    with pytest.raises(ConfigError, match="source id"):
        source_budgets(torch.tensor([0, -1, 1]), 2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    assert resolve_block(model, "1.weight", rows=1).shape == (1, 3)
    with pytest.raises(ConfigError, match="not a parameter"):
        resolve_block(model, "head.weight")
